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
