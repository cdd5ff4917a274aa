"""The per-region background loop under the health checks and the load scrapes."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from edgeproxy._upstream.regiontasks import RegionTasks

from .conftest import eventually


@dataclass
class Named:
    name: str


async def test_one_named_task_per_region_runs_its_work_again_until_closed() -> None:
    runs: Counter[str] = Counter()

    async def work(region: Named) -> None:
        runs[region.name] += 1

    tasks = RegionTasks("probe", work, 0.0)
    tasks.start([Named("a"), Named("b")])
    tasks.start([Named("c")])  # already running: no second set of tasks
    names = {t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("probe:")}
    assert names == {"probe:a", "probe:b"}
    await eventually(lambda: runs["a"] >= 3 and runs["b"] >= 3)
    await tasks.close()
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("probe:")]
    assert "c" not in runs


async def test_each_region_may_have_its_own_interval_and_wait_before_its_first_run() -> None:
    runs: Counter[str] = Counter()

    async def work(region: Named) -> None:
        runs[region.name] += 1

    # "slow" waits an hour before its first run (its work was done by whoever started it);
    # "fast" runs again and again meanwhile.
    intervals = {"fast": 0.0, "slow": 3600.0}
    tasks = RegionTasks("refresh", work, lambda r: intervals[r.name], wait_first=True)
    tasks.start([Named("fast"), Named("slow")])
    await eventually(lambda: runs["fast"] >= 3)
    assert runs["slow"] == 0
    await tasks.close()
