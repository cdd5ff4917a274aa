"""One background task per region, doing one piece of work every interval: the home of
the loop under the active health checks (:mod:`edgeproxy._upstream.health`), the
load scrapes (:mod:`edgeproxy._upstream.reported`) and the learning of each region's
models (:mod:`edgeproxy._upstream.catalog`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, Protocol, TypeVar

__all__ = ["RegionTasks"]


class _Named(Protocol):
    @property
    def name(self) -> str: ...


R = TypeVar("R", bound=_Named)


class RegionTasks(Generic[R]):
    """One task per region, each running ``work(region)``, then sleeping ``interval``
    seconds (the same for every region, or each region's own: ``interval(region)``),
    until :meth:`close` cancels it.

    Each pause is jittered by ±10 % so that regions started together drift apart;
    ``first_delay`` > 0 also spreads the first runs uniformly over that many seconds, and
    ``wait_first`` pauses once before the first run (its work was done already).
    Tasks are named ``<kind>:<region name>``.
    """

    def __init__(
        self,
        kind: str,
        work: Callable[[R], Awaitable[object]],
        interval: float | Callable[[R], float],
        *,
        first_delay: float = 0.0,
        wait_first: bool = False,
    ) -> None:
        self.kind = kind
        self.work = work
        self.interval = interval
        self.first_delay = first_delay
        self.wait_first = wait_first
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, regions: Iterable[R]) -> None:
        """Start a task for each of ``regions``; nothing while tasks already run."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        for region in regions:
            task = loop.create_task(self._loop(region), name=f"{self.kind}:{region.name}")
            self._tasks.add(task)
            # The set holds each task until it ends, so that none is collected mid-run.
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel the tasks and wait until they have ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _pause(self, region: R) -> float:
        interval = self.interval
        seconds = interval if isinstance(interval, (int, float)) else interval(region)
        return seconds * random.uniform(0.9, 1.1)

    async def _loop(self, region: R) -> None:
        if self.first_delay > 0:
            await asyncio.sleep(random.uniform(0, self.first_delay))
        if self.wait_first:
            await asyncio.sleep(self._pause(region))
        while True:
            await self.work(region)
            await asyncio.sleep(self._pause(region))
