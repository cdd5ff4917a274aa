"""Failover before the first byte, deadlines, retry and hedge budgets, hedged requests."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import aiohttp
import orjson
import pytest

from edgeproxy import Response, StreamResponse, hookimpl
from edgeproxy._obtain.failover import (
    Budget,
    DeadlineExceeded,
    Failure,
    FailureKind,
    PendingUpstream,
)

from .conftest import ProxyFactory, RegionFactory, eventually

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SIN = {"lat": 1.29, "lon": 103.85}
TOKYO = {"lat": 35.68, "lon": 139.69}
FRANKFURT = {"lat": 50.11, "lon": 8.68}


def chat_route(**keys: Any) -> list[dict[str, Any]]:
    return [{"name": "chat", "path": CHAT, **keys}]


# -- budget ----------------------------------------------------------------------------


def test_budget_is_a_share_of_recent_requests_plus_a_reserve() -> None:
    budget = Budget(ratio=0.2, min_per_s=0.0, window=10.0)
    for _ in range(10):
        budget.deposit(now=100.0)
    assert budget.try_spend(now=100.0) and budget.try_spend(now=100.5)
    assert not budget.try_spend(now=101.0)
    # The requests leave the window, and with them the budget they earned.
    assert not budget.try_spend(now=111.0)
    reserve = Budget(ratio=0.0, min_per_s=0.5, window=10.0)
    assert [reserve.try_spend(now=5.0) for _ in range(6)] == [True] * 5 + [False]


# -- failover ----------------------------------------------------------------------------


async def test_killing_a_region_mid_run_loses_no_request_that_had_not_started_streaming(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    doomed = await make_region("doomed", ttft=0.05, inter_token_delay=0.02)
    backup = await make_region("backup", ttft=0.05, inter_token_delay=0.02)
    proxy = await make_proxy(
        [
            {"name": "doomed", "url": doomed.url, **SIN},
            {"name": "backup", "url": backup.url, **SIN},
        ],
        routing={"retry_budget_min": 100},
    )
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()

    async def worker(client: aiohttp.ClientSession, stream: bool) -> None:
        while not stop.is_set():
            async with client.post(proxy.url + CHAT, json={**BODY, "stream": stream}) as resp:
                if resp.status != 200:
                    outcomes[f"status {resp.status}"] += 1
                    continue
                try:
                    body = await resp.read()
                except aiohttp.ClientPayloadError:
                    body = b""
                if not stream:
                    outcomes["ok" if orjson.loads(body)["choices"] else "bad"] += 1
                elif body.endswith(b"data: [DONE]\n\n"):
                    outcomes["stream ok"] += 1
                else:
                    # Broken after it started: it must say so, never end cleanly.
                    outcomes["stream broken"] += 1

    async with aiohttp.ClientSession() as client:
        workers = [asyncio.ensure_future(worker(client, stream=i % 3 == 0)) for i in range(9)]
        await eventually(lambda: doomed.requests_total >= 10 and backup.requests_total >= 10)
        await doomed.kill()
        served = backup.requests_total
        await eventually(lambda: backup.requests_total >= served + 30)
        await doomed.restart()
        await eventually(lambda: proxy.regions.by_name["doomed"].up, timeout=15)
        stop.set()
        await asyncio.gather(*workers)
    errors = {k: v for k, v in outcomes.items() if k not in ("ok", "stream ok", "stream broken")}
    assert errors == {}, outcomes
    assert outcomes["ok"] > 20
    # Requests caught on the killed region went to the other one.
    assert proxy.regions.by_name["backup"].retries_total > 0
    # Only streams already running on the killed region may break (3 stream workers).
    assert outcomes["stream broken"] <= 3


async def test_connect_failure_fails_over_with_attempts_header(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    near = await make_region("near")
    far = await make_region("far")
    proxy = await make_proxy(
        [{"name": "near", "url": near.url, **SIN}, {"name": "far", "url": far.url, **TOKYO}]
    )
    await near.kill()  # the proxy still believes it is up
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Region"] == "far"
            assert resp.headers["X-Edgeproxy-Attempts"] == "2"
        # Now it is known down: straight to the other region.
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.headers["X-Edgeproxy-Region"] == "far"
            assert "X-Edgeproxy-Attempts" not in resp.headers
    assert proxy.regions.by_name["near"].state == "down"


async def test_reset_before_the_first_byte_is_retried_but_not_after(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    near = await make_region("near", fault="reset", fault_after_tokens=0)
    far = await make_region("far")
    # Tiers, not latency, put near first both times: the failure must not move the choice.
    proxy = await make_proxy(
        [
            {"name": "near", "url": near.url, **SIN},
            {"name": "far", "url": far.url, **TOKYO, "priority": 1},
        ],
        health={"outlier_detection": False},
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Region"] == "far"
            assert resp.headers["X-Edgeproxy-Attempts"] == "2"
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        # Once the first bytes went out, a broken stream is an error event, never a retry.
        near.configure(fault_after_tokens=2, inter_token_delay=0.01)
        far_before = far.requests_total
        async with client.post(proxy.url + CHAT, json={**BODY, "stream": True}) as resp:
            assert resp.headers["X-Edgeproxy-Region"] == "near"
            raw = b""
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in resp.content.iter_any():
                    raw += chunk
        assert b"event: error" in raw and b"[DONE]" not in raw
        assert far.requests_total == far_before


async def test_5xx_is_retried_for_llm_posts_and_idempotent_methods_only(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    near = await make_region("near", fault="5xx", fault_status=503)
    far = await make_region("far")
    proxy = await make_proxy(
        [{"name": "near", "url": near.url, **SIN}, {"name": "far", "url": far.url, **TOKYO}],
        health={"outlier_detection": False},
        routing={"probe_decay": 0.001, "retry_budget_min": 100},
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200 and resp.headers["X-Edgeproxy-Attempts"] == "2"
        async with client.get(proxy.url + "/echo/x") as resp:
            assert resp.status == 200 and resp.headers["X-Edgeproxy-Region"] == "far"
        await asyncio.sleep(0.05)  # let near's penalty fade so that it is tried first again
        # A POST to a non-LLM path may not be applied twice: the error goes to the client.
        async with client.post(proxy.url + "/echo/x", data=b"payment") as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
            assert resp.headers["X-Edgeproxy-Region"] == "near"
            assert "X-Edgeproxy-Attempts" not in resp.headers
    assert error["code"] == "upstream_unavailable"
    assert "near answered 503" in error["message"]


async def test_single_region_5xx_keeps_its_status(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1", fault="5xx", fault_status=502)
    proxy = await make_proxy([{"name": "r1", "url": region.url}])
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 502
            assert (await resp.json())["error"]["type"] == "upstream_error"


async def test_retry_budget_caps_retries_under_a_full_outage(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    regions = [await make_region(f"r{i}", fault="5xx") for i in range(3)]
    proxy = await make_proxy(
        [{"name": r.name, "url": r.url} for r in regions],
        routes=chat_route(retries=2),
        routing={"retry_budget": 0.1, "retry_budget_min": 0.0},
        health={"outlier_detection": False},
    )
    async with aiohttp.ClientSession() as client:
        for _ in range(40):
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.status == 503
                await resp.read()
    upstream = sum(r.requests_by_path.get(CHAT, 0) for r in regions)
    # Unbudgeted, 40 requests x 3 attempts = 120 upstream requests; the budget allows 10%.
    assert 40 <= upstream <= 44, upstream
    assert sum(r["retries_total"] for r in proxy.status()["regions"]) == upstream - 40


async def test_streamed_upload_gets_one_attempt(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    near = await make_region("near", fault="5xx")
    far = await make_region("far")
    proxy = await make_proxy(
        [{"name": "near", "url": near.url, **SIN}, {"name": "far", "url": far.url, **TOKYO}]
    )
    payload = b"x" * 200_000  # large and not JSON: streamed upstream, cannot be replayed
    async with aiohttp.ClientSession() as client:
        async with client.put(proxy.url + "/echo/upload", data=payload) as resp:
            assert resp.status == 503
    assert far.requests_total == 0


# -- deadline and fallback -----------------------------------------------------------


class Degrade:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    @hookimpl
    def edgeproxy_fallback(self, reason: str) -> StreamResponse:
        self.reasons.append(reason)
        return Response.json({"degraded": True})


async def test_deadline_expiry_is_a_504_that_reaches_the_fallback(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    stalled = await make_region("stalled", fault="stall")
    proxy = await make_proxy(
        [{"name": "stalled", "url": stalled.url}], routes=chat_route(deadline=0.3)
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 504
            error = (await resp.json())["error"]
    assert error["code"] == "deadline_exceeded" and "0.3s" in error["message"]
    await eventually(lambda: stalled.in_flight == 0 and stalled.cancelled_total == 1)

    degrade = Degrade()
    proxy = await make_proxy(
        [{"name": "stalled", "url": stalled.url}],
        routes=chat_route(deadline=0.3),
        plugins=(degrade,),
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200 and await resp.json() == {"degraded": True}
            assert resp.headers["X-Edgeproxy-Degraded"] == "plugin"
    assert degrade.reasons == ["upstream_timeout"]


async def test_attempts_exhausted_reach_the_fallback(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    regions = [await make_region(f"r{i}", fault="5xx") for i in range(2)]
    degrade = Degrade()
    proxy = await make_proxy(
        [{"name": r.name, "url": r.url} for r in regions],
        plugins=(degrade,),
        routing={"retry_budget_min": 10},
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200 and await resp.json() == {"degraded": True}
    assert degrade.reasons == ["upstream_error"]
    assert sum(r.requests_by_path.get(CHAT, 0) for r in regions) == 2


# -- hedging -------------------------------------------------------------------------


async def test_hedge_wins_against_a_stalled_region_and_the_loser_is_cancelled(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    stalled = await make_region("stalled", fault="stall")
    healthy = await make_region("healthy", ttft=0.01)
    proxy = await make_proxy(
        [
            {"name": "stalled", "url": stalled.url, **SIN},
            {"name": "healthy", "url": healthy.url, **TOKYO},
        ],
        routes=chat_route(hedge=True, hedge_delay=0.1),
        routing={"hedge_budget_min": 10},
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Region"] == "healthy"
            assert resp.headers["X-Edgeproxy-Attempts"] == "2"
            assert (await resp.json())["choices"]
    await eventually(lambda: stalled.cancelled_total == 1 and stalled.in_flight == 0)
    await eventually(lambda: proxy.regions.by_name["healthy"].in_flight == 0)
    regions = {r["name"]: r for r in proxy.status()["regions"]}
    assert regions["healthy"]["hedges_total"] == 1
    assert regions["stalled"]["in_flight"] == 0 and regions["stalled"]["pending"] == 0
    assert regions["healthy"]["in_flight"] == 0


async def test_hedge_after_the_regions_p95_and_within_its_budget(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    near = await make_region("near", ttft=0.01)
    # Far slower too, so that a loaded machine's hiccup on near never makes far look the
    # better region while near's history builds.
    far = await make_region("far", ttft=0.3)
    proxy = await make_proxy(
        [{"name": "near", "url": near.url, **SIN}, {"name": "far", "url": far.url, **FRANKFURT}],
        routes=chat_route(hedge=True, deadline=2.0),
        routing={"hedge_budget": 0.0, "hedge_budget_min": 0.1},  # one hedge per 10 s window
    )
    failover = proxy.pipeline.failover
    failover.hedge_budget = Budget(0.0, 0.0, 10.0)  # no hedging while the history builds
    async with aiohttp.ClientSession() as client:
        for _ in range(25):  # history for near's p95
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.headers["X-Edgeproxy-Region"] == "near"
                assert "X-Edgeproxy-Attempts" not in resp.headers
        assert len(proxy.regions.by_name["near"].ttfb) >= 20
        failover.hedge_budget = Budget(0.0, 0.1, 10.0)  # one hedge per 10 s window, unspent
        near.configure(fault="stall")
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200 and resp.headers["X-Edgeproxy-Region"] == "far"
            assert resp.headers["X-Edgeproxy-Attempts"] == "2"
    # One hedge per 10 s window, and it is spent.
    assert failover.hedge_budget.available() < 1
    await eventually(lambda: near.in_flight == 0 and near.cancelled_total >= 1)


async def test_hedging_is_off_without_budget(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    stalled = await make_region("stalled", fault="stall")
    healthy = await make_region("healthy")
    proxy = await make_proxy(
        [
            {"name": "stalled", "url": stalled.url, **SIN},
            {"name": "healthy", "url": healthy.url, **TOKYO},
        ],
        routes=chat_route(hedge=True, hedge_delay=0.05, deadline=0.3),
        routing={"hedge_budget": 0.0, "hedge_budget_min": 0.0},
        # Far beyond the wait below: only the deadline's cancellation can end the attempt.
        upstream={"read_timeout": 60.0},
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 504
            assert "X-Edgeproxy-Attempts" not in resp.headers
    assert healthy.requests_by_path.get(CHAT, 0) == 0
    # The lone attempt was cancelled at the deadline: its stream reset, its slot freed.
    region = proxy.regions.by_name["stalled"]
    await eventually(
        lambda: stalled.cancelled_total == 1 and stalled.in_flight == 0 and region.in_flight == 0,
        timeout=5.0,
    )
    assert region.pool.stats().streams_in_use == 0


async def test_deadline_race_hands_the_running_attempt_to_the_fallback(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    slow = await make_region("slow", ttft=0.6)
    proxy = await make_proxy(
        [{"name": "slow", "url": slow.url}],
        routes=chat_route(deadline=0.2, deadline_action="race"),
    )
    handed: list[Any] = []

    class Spy:
        """The obtainer's failover, recording each failure it hands back (a wrapper, not
        a patched method: the compiled build's classes take no new attributes)."""

        def __init__(self, real: Any) -> None:
            self.real = real

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

        async def send(self, *args: Any, **kwargs: Any) -> Any:
            result = await self.real.send(*args, **kwargs)
            if isinstance(result, Failure):
                handed.append((result.kind, result.error, result.pending))
            return result

    obtainer = proxy.pipeline.obtainer
    obtainer.failover = Spy(obtainer.failover)
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            # No local model to race against: the attempt is dropped, the deadline answers.
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == "deadline_exceeded"
    # The deadline's failure is a value holding the attempt still running, not an
    # exception carrying it.
    [(kind, error, pending)] = handed
    assert kind is FailureKind.DEADLINE and isinstance(error, DeadlineExceeded)
    assert isinstance(pending, PendingUpstream)
    await eventually(lambda: slow.in_flight == 0 and slow.cancelled_total == 1)
    await eventually(lambda: proxy.regions.by_name["slow"].in_flight == 0)
