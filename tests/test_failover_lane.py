"""The common request's lane in failover: one attempt with no plan, the plan on demand.

``Failover.send`` sends a request whose best candidate is open straight to it, and makes
the attempt loop's plan only when that attempt fails or the deadline passes. A request on a
route with ``deadline_action = "race"`` always goes through the plan (its attempts may
outlive the deadline), so each case here is run both ways: what the client gets, and what
the regions saw, must be the same.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from .conftest import ProxyFactory, RegionFactory

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SIN = {"lat": 1.29, "lon": 103.85}
TOKYO = {"lat": 35.68, "lon": 139.69}

# What the client sees of an answer: status, the region that answered, the attempts made.
Seen = tuple[int, str | None, str | None, str | None]


async def _ask(url: str, *, stream: bool = False) -> Seen:
    async with aiohttp.ClientSession() as client:
        async with client.post(url + CHAT, json={**BODY, "stream": stream}) as resp:
            body = await resp.read()
            code = None
            if resp.status != 200:
                code = (await resp.json())["error"].get("code")
            else:
                assert body
            return (
                resp.status,
                resp.headers.get("X-Edgeproxy-Region"),
                resp.headers.get("X-Edgeproxy-Attempts"),
                code,
            )


async def _both_ways(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    regions: list[dict[str, Any]],
    *,
    stream: bool = False,
    deadline: float = 30.0,
    kill: tuple[str, ...] = (),
) -> tuple[Seen, Seen, list[int]]:
    """``regions`` (name, fault settings, place) asked once through the lane and once
    through the plan; each way has regions of its own. Returns both answers and, per
    region, how many requests the lane's and the plan's saw (lane's first)."""
    seen: list[Seen] = []
    counts: list[list[int]] = []
    for action in ("cancel", "race"):
        made = []
        for spec in regions:
            keys = {k: v for k, v in spec.items() if k not in ("name", "lat", "lon", "priority")}
            made.append(await make_region(spec["name"], **keys))
        proxy = await make_proxy(
            [
                {
                    "name": spec["name"],
                    "url": region.url,
                    "lat": spec["lat"],
                    "lon": spec["lon"],
                    "priority": spec.get("priority", 0),
                }
                for spec, region in zip(regions, made, strict=True)
            ],
            routes=[
                {"name": "chat", "path": CHAT, "deadline": deadline, "deadline_action": action}
            ],
            health={"outlier_detection": False},
            routing={"retry_budget_min": 100},
        )
        for region in made:
            if region.name in kill:
                await region.kill()
        seen.append(await _ask(proxy.url, stream=stream))
        counts.append([region.requests_total for region in made])
    return seen[0], seen[1], [c for pair in zip(*counts, strict=True) for c in pair]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_first_attempt_that_answers_is_the_same_either_way(
    make_region: RegionFactory, make_proxy: ProxyFactory, stream: bool
) -> None:
    lane, plan, counts = await _both_ways(
        make_region,
        make_proxy,
        [{"name": "near", **SIN}, {"name": "far", **TOKYO, "priority": 1}],
        stream=stream,
    )
    assert lane == plan == (200, "near", None, None)
    assert counts == [1, 1, 0, 0]


@pytest.mark.parametrize(
    ("far_fault", "seen"),
    [
        ({}, (200, "far", "2", None)),  # near's 503, then far's answer
        ({"fault": "5xx", "fault_status": 502}, (502, "far", "2", "upstream_unavailable")),
    ],
)
async def test_a_first_attempt_refused_with_a_5xx_goes_on_as_the_plan_would(
    make_region: RegionFactory, make_proxy: ProxyFactory, far_fault: dict[str, Any], seen: Seen
) -> None:
    lane, plan, counts = await _both_ways(
        make_region,
        make_proxy,
        [
            {"name": "near", "fault": "5xx", "fault_status": 503, **SIN},
            {"name": "far", **far_fault, **TOKYO, "priority": 1},
        ],
    )
    assert lane == plan == seen
    assert counts == [1, 1, 1, 1]


async def test_a_first_region_that_cannot_be_reached_goes_on_to_the_next(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    lane, plan, _ = await _both_ways(
        make_region,
        make_proxy,
        [{"name": "near", **SIN}, {"name": "far", **TOKYO, "priority": 1}],
        kill=("near",),
    )
    assert lane == plan == (200, "far", "2", None)


async def test_the_deadline_on_the_first_attempt_is_the_same_504(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    lane, plan, _ = await _both_ways(
        make_region,
        make_proxy,
        [{"name": "stalled", "fault": "stall", **SIN}],
        deadline=0.3,
    )
    assert lane == plan == (504, "stalled", None, "deadline_exceeded")
