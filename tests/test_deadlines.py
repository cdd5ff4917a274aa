"""The route deadlines' shared timer (edgeproxy._obtain.deadlines)."""

from __future__ import annotations

import asyncio
import time

from edgeproxy._obtain.deadlines import Deadlines


async def _guarded(deadlines: Deadlines, remaining: float, work: float) -> str:
    """``work`` seconds under a ``remaining`` deadline, as the failover stage runs an attempt."""
    watch = deadlines.watch(asyncio.get_running_loop(), remaining)
    try:
        await asyncio.sleep(work)
    except asyncio.CancelledError:
        if watch.expired():
            return "deadline"
        raise
    finally:
        deadlines.release(watch)
    return "done"


async def test_each_request_gets_its_own_deadline_under_one_timer() -> None:
    deadlines = Deadlines()
    started = time.monotonic()
    results = await asyncio.gather(
        _guarded(deadlines, 0.3, 0.05),  # answers in time
        _guarded(deadlines, 0.1, 5.0),  # passes its deadline first
        _guarded(deadlines, 0.2, 5.0),  # then this one
        _guarded(deadlines, 5.0, 0.15),  # answers in time, long before its deadline
    )
    assert results == ["done", "deadline", "deadline", "done"]
    assert time.monotonic() - started < 1.0
    # Nothing is left to watch, and the timer was not left armed for long.
    assert not deadlines._heap


async def test_a_request_cancelled_for_another_reason_stays_cancelled() -> None:
    deadlines = Deadlines()
    task = asyncio.ensure_future(_guarded(deadlines, 5.0, 5.0))
    await asyncio.sleep(0.01)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert task.cancelled()


async def test_requests_arriving_one_after_another_arm_no_new_timer() -> None:
    deadlines = Deadlines()
    assert await _guarded(deadlines, 10.0, 0) == "done"
    timer = deadlines._timer
    assert timer is not None
    for _ in range(5):
        assert await _guarded(deadlines, 10.0, 0) == "done"
    assert deadlines._timer is timer
    # An earlier deadline re-arms it.
    assert await _guarded(deadlines, 1.0, 0) == "done"
    assert deadlines._timer is not timer
    assert not deadlines._heap
