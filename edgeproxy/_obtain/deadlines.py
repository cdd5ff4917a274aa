"""Route deadlines under one timer: what ``asyncio.timeout`` does per request, shared.

The failover stage bounds each request's wait for a first byte by its route's
deadline. One ``asyncio.timeout`` per request arms and cancels a timer and goes
through several Python calls each time; :class:`Deadlines` keeps the deadlines in
a heap under a single timer instead.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math

__all__ = ["Deadlines", "Watch"]


class Watch:
    """One request's route deadline, as :class:`Deadlines` keeps it."""

    __slots__ = ("when", "task", "cancelling", "done", "fired")

    def __init__(self, when: float, task: asyncio.Task[object]) -> None:
        self.when = when
        self.task = task
        self.cancelling = task.cancelling()
        self.done = False
        self.fired = False

    def expired(self) -> bool:
        """Whether the deadline, and no other cancellation, cancelled the task (the
        deadline's cancellation is taken back either way, as ``asyncio.timeout`` does)."""
        if not self.fired:
            return False
        self.fired = False
        return self.task.uncancel() <= self.cancelling


class Deadlines:
    """The route deadlines of the requests waiting for a first byte, under one timer.

    What ``asyncio.timeout`` does per request (a timer armed and cancelled, the task
    cancelled when it fires) at a fraction of the cost: deadlines wait in a heap, the one
    timer is armed for the earliest and re-armed only when it fires or an earlier one
    comes, so that requests arriving one after another arm none. A request that got its
    answer leaves its entry done; done entries leave the heap from its top.
    """

    __slots__ = ("_heap", "_seq", "_timer", "_timer_at")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Watch]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def watch(self, loop: asyncio.AbstractEventLoop, remaining: float) -> Watch:
        """Cancel the current task ``remaining`` seconds from now, unless released first."""
        task = asyncio.current_task(loop)
        assert task is not None
        when = loop.time() + remaining
        entry = Watch(when, task)
        heapq.heappush(self._heap, (when, next(self._seq), entry))
        if when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(when, self._fire, loop)
            self._timer_at = when
        return entry

    def release(self, entry: Watch) -> None:
        entry.done = True
        if entry.fired:
            entry.expired()  # fired as the task finished anyway: its cancellation is void
        heap = self._heap
        while heap and heap[0][2].done:
            heapq.heappop(heap)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._timer_at = math.inf
        heap = self._heap
        now = loop.time()
        while heap and (heap[0][2].done or heap[0][0] <= now):
            entry = heapq.heappop(heap)[2]
            if not entry.done:
                entry.done = entry.fired = True
                entry.task.cancel()
        if heap:
            self._timer_at = heap[0][0]
            self._timer = loop.call_at(self._timer_at, self._fire, loop)
