"""Region health: outlier ejection, active checks, circuit breakers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from edgeproxy import Config, EdgeProxy
from edgeproxy._upstream.regions import RegionSet

from .conftest import FakeClock, ProxyFactory, RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SIN = {"lat": 1.29, "lon": 103.85}
TOKYO = {"lat": 35.68, "lon": 139.69}


def region_set(n: int, clock: FakeClock | None = None, **health: Any) -> RegionSet:
    regions = [{"name": f"r{i}", "url": "http://127.0.0.1:9"} for i in range(n)]
    config = Config.from_mapping(proxy_config(regions, health=health), environ={})
    regions_set = RegionSet(config, clock=clock or FakeClock())
    for region in regions_set:
        region.endpoints[0].mark_up()
    return regions_set


def status_of(proxy: EdgeProxy, name: str) -> dict[str, Any]:
    return next(r for r in proxy.status()["regions"] if r["name"] == name)


# -- outlier ejection, unit level (explicit clock) --------------------------------------


async def test_ejection_time_grows_with_each_ejection_and_decays_back() -> None:
    clock = FakeClock()
    regions = region_set(
        2,
        clock,
        consecutive_failures=3,
        base_ejection_time=10,
        max_ejection_time=25,
        outlier_interval=100,
    )
    health, r0 = regions.health, regions.by_name["r0"]

    def fail(times: int) -> None:
        for _ in range(times):
            health.record(r0, failed=True)  # dated by the clock

    def available_in(seconds: float) -> bool:
        return health.available(r0, clock() + seconds)

    def ejected_for() -> float:
        snapshot = next(r for r in regions.snapshot() if r["name"] == "r0")["health"]
        return float(snapshot["ejected_for_s"])

    try:
        fail(2)
        health.record(r0, failed=False)  # a success breaks the streak
        fail(2)
        assert health.available(r0, clock())
        fail(1)
        assert ejected_for() == 10.0
        clock.advance(5.0)
        assert ejected_for() == 5.0 and not available_in(4.9)  # ejected for 10 s
        assert available_in(5.0)  # ... and back
        clock.advance(6.0)  # t = 11
        fail(3)
        assert ejected_for() == 20.0  # the second ejection lasts 20 s
        clock.advance(21.0)  # t = 32
        fail(3)
        assert ejected_for() == 25.0  # third: 30 s, capped at 25 s
        clock.advance(25.0)  # t = 57
        assert health.available(r0, clock())
        assert r0.health.ejections_total == 3
        # A long calm (3 outlier intervals) earns the multiplier back down to 1.
        clock.advance(300.0)
        fail(3)
        assert ejected_for() == 10.0
    finally:
        await regions.close()


async def test_max_ejection_percent_keeps_regions_in_service() -> None:
    regions = region_set(4, consecutive_failures=1, max_ejection_percent=50)
    try:
        for region in regions:
            regions.health.record(region, failed=True, now=0.0)
        assert sum(not regions.health.available(r, 1.0) for r in regions) == 2
    finally:
        await regions.close()
    # A tiny percentage still allows one ejection; zero allows none.
    regions = region_set(3, consecutive_failures=1, max_ejection_percent=10)
    try:
        for region in regions:
            regions.health.record(region, failed=True, now=0.0)
        assert sum(not regions.health.available(r, 1.0) for r in regions) == 1
    finally:
        await regions.close()
    regions = region_set(2, consecutive_failures=1, max_ejection_percent=0)
    try:
        for region in regions:
            regions.health.record(region, failed=True, now=0.0)
        assert all(regions.health.available(r, 1.0) for r in regions)
    finally:
        await regions.close()


# -- end to end --------------------------------------------------------------------------


async def test_5xx_burst_ejects_the_region_and_it_returns_after_the_ejection_time(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    near = await make_region("near", fault="5xx", fault_paths=["/v1/"])
    far = await make_region("far")
    # The proxy dates attempts with the real clock: this one runs ahead of it on demand.
    clock = FakeClock.following(time.monotonic)
    proxy = await make_proxy(
        [{"name": "near", "url": near.url, **SIN}, {"name": "far", "url": far.url, **TOKYO}],
        health={"consecutive_failures": 3, "base_ejection_time": 30.0},
        routing={"probe_decay": 0.2, "retry_budget_min": 100},
        clock=clock,
    )
    async with aiohttp.ClientSession() as client:
        # Every request is answered: the 503s are retried on the other region. How many
        # it takes before three of them have probed near depends on the scheduling of a
        # busy machine; the loop stops at the ejection.
        for _ in range(50):
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.status == 200
                await resp.read()
            if status_of(proxy, "near")["health"]["ejected"]:
                break
        near_status = status_of(proxy, "near")
        assert near_status["health"]["ejected"] and near_status["health"]["ejections_total"] == 1
        assert 0.0 < near_status["health"]["ejected_for_s"] <= 30.0
        assert near.requests_by_path.get(CHAT) == 3
        # Ejected: nothing more goes to it.
        for _ in range(5):
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.headers["X-Edgeproxy-Region"] == "far"
                assert "X-Edgeproxy-Attempts" not in resp.headers
        assert near.requests_by_path.get(CHAT) == 3

        near.behavior.fault = None  # repaired while ejected
        # The ejection time passes: the nearer region is back, its failures long forgotten.
        clock.advance(30.0)
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Region"] == "near"
            await resp.read()
    assert near.requests_by_path.get(CHAT) == 4
    assert not status_of(proxy, "near")["health"]["ejected"]


async def test_active_checks_take_a_region_out_and_back(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    near = await make_region("near")
    far = await make_region("far")
    proxy = await make_proxy(
        [{"name": "near", "url": near.url, **SIN}, {"name": "far", "url": far.url, **TOKYO}],
        health={
            "active": True,
            "interval": 0.05,
            "timeout": 0.5,
            "unhealthy_threshold": 2,
            "healthy_threshold": 2,
        },
    )
    await eventually(lambda: status_of(proxy, "near")["health"]["active"] == "healthy")
    near.configure(fault="5xx", fault_paths=["/healthz"])  # the API works, health says no
    await eventually(lambda: status_of(proxy, "near")["health"]["active"] == "unhealthy")
    assert "503" in status_of(proxy, "near")["health"]["last_check_error"]
    before = near.requests_by_path.get(CHAT, 0)
    async with aiohttp.ClientSession() as client:
        for _ in range(5):
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.headers["X-Edgeproxy-Region"] == "far"
    assert near.requests_by_path.get(CHAT, 0) == before
    near.behavior.fault = None
    await eventually(lambda: status_of(proxy, "near")["health"]["active"] == "healthy")
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.headers["X-Edgeproxy-Region"] == "near"


async def test_active_check_of_a_killed_region(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy(
        [{"name": "r1", "url": region.url}],
        health={"active": True, "interval": 0.05, "timeout": 0.3, "unhealthy_threshold": 2},
    )
    await region.kill()
    await eventually(lambda: status_of(proxy, "r1")["health"]["active"] == "unhealthy")
    assert not status_of(proxy, "r1")["health"]["available"]
    await region.restart()
    await eventually(lambda: status_of(proxy, "r1")["health"]["available"])
    assert status_of(proxy, "r1")["state"] == "up"


async def test_circuit_breaker_caps_concurrent_and_pending_requests(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1", fault="stall")
    proxy = await make_proxy(
        [{"name": "r1", "url": region.url}],
        health={"max_concurrent": 2, "max_pending": 5},
    )
    async with aiohttp.ClientSession() as client:
        stalled = [
            asyncio.ensure_future(client.post(proxy.url + CHAT, json=BODY)) for _ in range(2)
        ]
        await region.wait_until(lambda c: c.in_flight == 2)
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "1"
            error = (await resp.json())["error"]
        assert error["code"] == "region_overloaded"
        health = status_of(proxy, "r1")["health"]
        assert health["breaker_open"] and health["breaker_overflows_total"] == 1
        for task in stalled:
            task.cancel()
        await asyncio.gather(*stalled, return_exceptions=True)
    await eventually(lambda: region.in_flight == 0 and proxy.pipeline.in_flight == 0)
    assert region.requests_total == 2  # the refused request never reached the region
    assert not status_of(proxy, "r1")["health"]["breaker_open"]


async def test_breaker_on_pending_sends_the_overflow_to_the_next_region(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    slow = await make_region("slow", fault="stall")
    other = await make_region("other")
    proxy = await make_proxy(
        [{"name": "slow", "url": slow.url, **SIN}, {"name": "other", "url": other.url, **TOKYO}],
        health={"max_pending": 1},
    )
    async with aiohttp.ClientSession() as client:
        stalled = asyncio.ensure_future(client.post(proxy.url + CHAT, json=BODY))
        await slow.wait_until(lambda c: c.in_flight == 1)
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Region"] == "other"
        stalled.cancel()
        await asyncio.gather(stalled, return_exceptions=True)
    await eventually(lambda: slow.in_flight == 0)
