"""Region choice: geo prior, peak-EWMA, load, weights, tiers, probing, /status."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest

from edgeproxy import Config, EdgeProxy, hookimpl
from edgeproxy._routing.router import Router, great_circle_km
from edgeproxy._upstream.regions import LatencyWindow, PeakEwma, Region, RegionSet

from .conftest import FakeClock, ProxyFactory, RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# The test PoP is Singapore (conftest): these are near, medium and far from it.
SIN = {"lat": 1.29, "lon": 103.85}
TOKYO = {"lat": 35.68, "lon": 139.69}
FRANKFURT = {"lat": 50.11, "lon": 8.68}


async def chat(client: aiohttp.ClientSession, proxy: EdgeProxy, **headers: str) -> str:
    async with client.post(proxy.url + CHAT, json=BODY, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["X-Edgeproxy-Region"]


async def served_by(proxy: EdgeProxy, n: int, concurrency: int = 1) -> Counter[str]:
    """Send ``n`` chat requests, ``concurrency`` at a time; count who served them."""
    counts: Counter[str] = Counter()
    queue = iter(range(n))
    async with aiohttp.ClientSession() as client:

        async def worker() -> None:
            for _ in queue:
                counts[await chat(client, proxy)] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


# -- the building blocks ------------------------------------------------------------


def test_great_circle_distance() -> None:
    assert great_circle_km(0, 0, 0, 0) == 0
    # Singapore - Frankfurt is about 10,260 km.
    assert 10_100 < great_circle_km(1.29, 103.85, 50.11, 8.68) < 10_400


def test_peak_ewma_jumps_up_at_once_and_decays_down() -> None:
    clock = FakeClock()
    ewma = PeakEwma(decay=10.0, clock=clock)
    ewma.observe(0.1)
    assert ewma.value == pytest.approx(0.1)
    clock.advance(0.1)
    ewma.observe(1.0)
    assert ewma.value == pytest.approx(1.0)  # a slow sample counts at once
    assert ewma.stamp == pytest.approx(0.1)
    clock.advance(0.1)
    ewma.observe(0.1)
    assert ewma.value > 0.98  # a fast sample right after barely moves it
    clock.advance(29.8)
    ewma.observe(0.1)
    assert ewma.value < 0.15  # ... but old history is forgotten over ~decay seconds
    assert ewma.samples == 4
    ewma.observe(0.1, now=100.0)  # an explicit time wins over the clock
    assert ewma.stamp == 100.0


def test_latency_window_p95() -> None:
    window = LatencyWindow(size=100)
    assert window.p95() is None
    for i in range(100):
        window.add(i / 100)
    assert window.p95() == pytest.approx(0.94)
    for _ in range(100):
        window.add(5.0)
    assert window.p95() == 5.0  # only recent samples count


async def test_weights_share_traffic_among_equals() -> None:
    config = Config.from_mapping(
        proxy_config(
            [
                {"name": "heavy", "url": "http://127.0.0.1:9", "weight": 3},
                {"name": "light", "url": "http://127.0.0.1:9", "weight": 1},
            ]
        ),
        environ={},
    )
    regions = RegionSet(config, clock=FakeClock(start=10.0))
    try:
        for region in regions:
            region.endpoints[0].mark_up()
            for i in range(5):
                region.latency.observe(0.05, now=float(i))
        router = Router(config, regions, seed=7)
        counts = Counter(router.candidates()[0].name for _ in range(4000))
        assert 0.70 < counts["heavy"] / 4000 < 0.80
        # The busier of two equals loses: load moves the share.
        regions.by_name["heavy"].in_flight = 3
        counts = Counter(router.candidates()[0].name for _ in range(1000))
        assert counts["light"] > counts["heavy"]
    finally:
        await regions.close()


async def test_priority_tiers_and_panic_routing() -> None:
    config = Config.from_mapping(
        proxy_config(
            [
                {"name": "backup", "url": "http://127.0.0.1:9", "priority": 1, **SIN},
                {"name": "main", "url": "http://127.0.0.1:9", **FRANKFURT},
            ]
        ),
        environ={},
    )
    regions = RegionSet(config, clock=FakeClock())
    try:
        for region in regions:
            region.endpoints[0].mark_up()
        router = Router(config, regions)
        # Tier 0 serves although tier 1 is much nearer; tier 1 is the failover target.
        assert [r.name for r in router.candidates()] == ["main", "backup"]
        regions.by_name["main"].mark_down("gone")
        assert [r.name for r in router.candidates()] == ["backup"]
        regions.by_name["backup"].mark_down("gone too")
        # Nothing is known to work: every region is tried rather than none.
        assert {r.name for r in router.candidates()} == {"main", "backup"}
    finally:
        await regions.close()


def _region(regions: RegionSet, name: str) -> Region:
    return regions.by_name[name]


async def test_a_faded_penalty_is_judged_against_measured_peers_not_the_raw_geo_guess() -> None:
    # Both regions sit where the geo model guesses ~115 ms (no coordinates: the PoP's
    # distance to 0,0), but answer in 15 ms. a was slow for a while; once its penalty has
    # faded it must look like b again, not like the 115 ms guess that b beats forever.
    config = Config.from_mapping(
        proxy_config(
            [
                {"name": "a", "url": "http://127.0.0.1:9"},
                {"name": "b", "url": "http://127.0.0.1:9"},
            ],
            routing={"probe_decay": 0.3},
        ),
        environ={},
    )
    clock = FakeClock(start=10.0)
    regions = RegionSet(config, clock=clock)
    try:
        router = Router(config, regions, seed=5)
        a, b = _region(regions, "a"), _region(regions, "b")
        assert a.geo_rtt > 0.1
        for region in regions:
            region.endpoints[0].mark_up()
        for _ in range(5):
            a.latency.observe(0.4, now=10.0)
            b.latency.observe(0.015, now=10.0)
        assert {router.candidates()[0].name for _ in range(50)} == {"b"}
        clock.advance(5.0)  # 16 probe_decay periods without an answer from a
        assert router.expected_latency(a, clock()) == pytest.approx(0.015, abs=1e-3)
        assert {router.candidates()[0].name for _ in range(100)} == {"a", "b"}
    finally:
        await regions.close()


async def test_a_stalled_region_looks_slow_before_it_answers() -> None:
    config = Config.from_mapping(
        proxy_config(
            [{"name": "a", "url": "http://127.0.0.1:9"}, {"name": "b", "url": "http://127.0.0.1:9"}]
        ),
        environ={},
    )
    clock = FakeClock(start=10.0)
    regions = RegionSet(config, clock=clock)
    try:
        router = Router(config, regions, seed=3)
        a, b = _region(regions, "a"), _region(regions, "b")
        for region in regions:
            region.endpoints[0].mark_up()
            for i in range(5):
                region.latency.observe(0.05, now=float(i))
        assert router.expected_latency(a, clock()) == pytest.approx(0.05)
        # A request to a has just been sent: a and b are still equals.
        a.pending_since[1] = clock()
        assert {router.candidates()[0].name for _ in range(50)} == {"a", "b"}
        # It has waited 2 s for its first byte: a is no longer an equal.
        clock.advance(2.0)
        assert a.oldest_pending(clock()) == 2.0
        assert router.expected_latency(a, clock()) == 2.0
        assert {router.candidates()[0].name for _ in range(50)} == {"b"}
        del a.pending_since[1]
        assert router.expected_latency(a, clock()) == pytest.approx(0.05)
        assert b.oldest_pending(clock()) == 0.0
    finally:
        await regions.close()


# -- end to end ------------------------------------------------------------------


async def test_nearest_region_wins_before_any_traffic(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    regions = [await make_region(n) for n in ("frankfurt", "tokyo", "singapore")]
    proxy = await make_proxy(
        [
            {"name": "frankfurt", "url": regions[0].url, **FRANKFURT},
            {"name": "tokyo", "url": regions[1].url, **TOKYO},
            {"name": "singapore", "url": regions[2].url, **SIN},
        ]
    )
    assert [r.name for r in proxy.pipeline.router.candidates()] == [
        "singapore",
        "tokyo",
        "frankfurt",
    ]
    async with aiohttp.ClientSession() as client:
        assert await chat(client, proxy) == "singapore"


async def test_traffic_converges_to_the_faster_region(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    fast = await make_region("fast", ttft=0.005)
    slow = await make_region("slow", ttft=0.12)
    # Same place: only measured latency tells them apart.
    proxy = await make_proxy([{"name": "slow", "url": slow.url}, {"name": "fast", "url": fast.url}])
    await served_by(proxy, 20, concurrency=2)
    counts = await served_by(proxy, 40, concurrency=2)
    assert counts["fast"] >= 36, counts
    status = {r["name"]: r for r in proxy.status()["regions"]}
    assert status["fast"]["latency"]["ewma_ms"] < status["slow"]["latency"]["ewma_ms"]


async def test_slowing_a_region_moves_traffic_away_and_back(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    a = await make_region("a", ttft=0.01)
    b = await make_region("b", ttft=0.01)
    proxy = await make_proxy(
        [{"name": "a", "url": a.url}, {"name": "b", "url": b.url}],
        routing={"decay": 1.0, "probe_decay": 0.3},
    )
    counts = await served_by(proxy, 40, concurrency=4)
    assert counts["a"] > 0 and counts["b"] > 0, counts

    a.behavior.ttft = 0.4  # brownout
    await served_by(proxy, 20, concurrency=4)
    counts = await served_by(proxy, 40, concurrency=4)
    assert counts["a"] <= 6, counts  # probes only

    a.behavior.ttft = 0.01  # recovery: the probes find it fast again

    async def a_is_back() -> bool:
        return (await served_by(proxy, 20, concurrency=4))["a"] >= 5

    deadline = asyncio.get_running_loop().time() + 20
    while not await a_is_back():
        assert asyncio.get_running_loop().time() < deadline, "a never got traffic back"


async def test_route_hook_can_still_reorder_candidates(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    near = await make_region("near")
    far = await make_region("far")

    class Reverse:
        @hookimpl
        def edgeproxy_route(self, candidates: list[Region]) -> list[Region]:
            return list(reversed(candidates))

    proxy = await make_proxy(
        [{"name": "near", "url": near.url, **SIN}, {"name": "far", "url": far.url, **FRANKFURT}],
        plugins=[Reverse()],
    )
    async with aiohttp.ClientSession() as client:
        assert await chat(client, proxy) == "far"


async def test_status_shows_latency_load_health_and_share(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    a = await make_region("a", ttft=0.005)
    b = await make_region("b", ttft=0.005)
    proxy = await make_proxy(
        [
            {"name": "a", "url": a.url, "jurisdiction": "eu", "tags": ["gpu"], **SIN},
            {"name": "b", "url": b.url, "urls": [a.url], "priority": 1, **TOKYO},
        ]
    )
    await served_by(proxy, 10)
    # The last answer's bookkeeping may finish after the client has its body (and has
    # closed the connection, which cancels the handler before the sample is taken).
    region_a = proxy.regions.by_name["a"]
    await eventually(lambda: region_a.in_flight == 0)
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/status") as resp:
            status = await resp.json()
    regions = {r["name"]: r for r in status["regions"]}
    ra, rb = regions["a"], regions["b"]
    assert ra["state"] == "up" and ra["jurisdiction"] == "eu" and ra["tags"] == ["gpu"]
    assert ra["latency"]["samples"] >= 9 and ra["latency"]["ewma_ms"] > 0
    assert ra["latency"]["p95_ttfb_ms"] > 0
    assert rb["latency"]["geo_rtt_ms"] > ra["latency"]["geo_rtt_ms"]
    assert ra["share"] == 1.0 and rb["share"] == 0.0
    assert ra["requests_total"] == 10 and ra["in_flight"] == 0 and ra["pending"] == 0
    assert ra["health"] == {
        "available": True,
        "active": "off",
        "last_check_error": None,
        "ejected": False,
        "ejected_for_s": 0.0,
        "ejections_total": 0,
        "consecutive_failures": 0,
        "last_ejection_reason": None,
        "failures": {
            "recent": 0,
            "callers": 0,
            "counted": True,  # min_failing_callers = 1 (conftest): every 5xx would count
            "counted_total": 0,
            "callers_own_total": 0,
            "window_s": 30.0,
        },
        "latency_penalty_ms": 0.0,
        "latency_penalty_age_s": None,
        "breaker_open": False,
        "breaker_overflows_total": 0,
    }
    assert rb["priority"] == 1
    assert [e["url"] for e in rb["endpoints"]] == [b.url, a.url]
    assert rb["pool"]["connections_open"] >= 2  # one warm connection per endpoint


async def test_region_with_several_endpoints_spreads_and_survives_one_dying(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    e1 = await make_region("e1", ttft=0.05)
    e2 = await make_region("e2", ttft=0.05)
    proxy = await make_proxy([{"name": "multi", "url": e1.url, "urls": [e2.url]}])
    await served_by(proxy, 20, concurrency=4)
    assert e1.requests_total > 0 and e2.requests_total > 0
    await e1.kill()
    counts = await served_by(proxy, 20, concurrency=2)
    assert counts == {"multi": 20}
    await eventually(lambda: proxy.regions.by_name["multi"].endpoints[0].state == "down")
