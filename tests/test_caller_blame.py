"""One client cannot steer a PoP: a 5xx counts against a region only when several callers
get them ([health] min_failing_callers), and a request two regions rejected is poison.

The clocks of health, routing and the poison table are injected (FakeClock); a region's
5xx answers come from real fake regions (hypercorn) whose fault applies only to the
bodies that carry a marker (``fault_body``), or from real llama.cpp servers.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict

from edgeproxy import Config, EdgeProxy, RequestContext
from edgeproxy._admission.poison import Poison, caller_of
from edgeproxy._protocol.headers import trace_context
from edgeproxy._upstream.health import Health
from edgeproxy._upstream.regions import Region, RegionSet

from .conftest import (
    FakeClock,
    LlamaServers,
    ProxyFactory,
    RegionFactory,
    needs_llama_server,
    proxy_config,
)

CHAT = "/v1/chat/completions"
GOOD = {"model": "fake-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# What one client sends: a body every region answers with 500 (as llama.cpp's server does),
# though nothing in it is what the edge refuses for every server (its fault_body marks it).
BAD = {"model": "fake-llm", "messages": [{"role": "user", "content": "bad"}]}
MARK = '"bad"'
# The PoP is in Singapore (conftest): near is there, far is in Sao Paulo, 16,000 km away.
NEAR = {"lat": 1.29, "lon": 103.85}
FAR = {"lat": -23.55, "lon": -46.63}
ONE = [{"name": "near", "url": "http://127.0.0.1:9"}]


def key(who: str) -> dict[str, str]:
    """A caller, by its API key (the Authorization header, hashed, names it)."""
    return {"Authorization": f"Bearer {who}", "Content-Type": "application/json"}


def others_served(proxy: EdgeProxy, *names: str) -> None:
    """The evidence a region's 5xx needs to be a caller's own: the region served another
    caller within the window (traffic that routing would send to the nearest region only)."""
    for name in names:
        proxy.regions.health.served(proxy.regions.by_name[name], "t:others")


def status_of(proxy: EdgeProxy, name: str) -> dict[str, Any]:
    return next(r for r in proxy.status()["regions"] if r["name"] == name)


async def post(
    client: aiohttp.ClientSession, proxy: EdgeProxy, body: dict[str, Any], who: str
) -> tuple[int, str, dict[str, Any], aiohttp.typedefs.LooseHeaders]:
    async with client.post(proxy.url + CHAT, data=orjson.dumps(body), headers=key(who)) as resp:
        payload = await resp.json(content_type=None)
        return resp.status, resp.headers.get("X-Edgeproxy-Region", ""), payload, resp.headers


# -- the rule, unit level ---------------------------------------------------------------


@pytest.fixture
async def near() -> AsyncIterator[tuple[Region, Health, FakeClock]]:
    """One region, its health policy (min_failing_callers = 3, a 30 s window) and its clock."""
    clock = FakeClock(100.0)
    health = {"min_failing_callers": 3, "failure_window": 30.0}
    config = Config.from_mapping(proxy_config(ONE, health=health), environ={})
    regions = RegionSet(config, clock=clock)
    region = regions.by_name["near"]
    region.endpoints[0].mark_up()
    yield region, regions.health, clock
    await regions.close()


def test_one_callers_5xx_count_only_without_evidence_that_others_are_served(
    near: tuple[Region, Health, FakeClock],
) -> None:
    region, health, clock = near
    # No evidence that the region serves anyone: its failure is its own.
    assert health.blame(region, "h:mallory")
    # The region serves alice meanwhile: from now on mallory's 5xx are mallory's own,
    # however often.
    health.served(region, "t:alice")
    assert not any(health.blame(region, "h:mallory") for _ in range(1000))
    snap = health.snapshot(region, clock())
    assert snap["failures"]["callers"] == 1 and not snap["failures"]["counted"]
    assert snap["failures"]["recent"] == 1001 and snap["failures"]["callers_own_total"] == 1000
    # A capacity answer is never the caller's.
    assert health.blame(region, "h:mallory", status=503)
    assert health.blame(region, "h:mallory", status=529)
    # A second failing caller: still too few. A third: the region's fault from now on.
    assert not health.blame(region, "ip:10.0.0.2")
    assert health.blame(region, "t:carol")
    assert health.blame(region, "h:mallory")
    # The window passes: the failing callers and the evidence are forgotten, so the
    # next failure is the region's again.
    clock.advance(31.0)
    assert health.blame(region, "t:carol")
    assert health.snapshot(region, clock())["failures"]["callers"] == 1


def test_the_evidence_must_be_another_caller(near: tuple[Region, Health, FakeClock]) -> None:
    region, health, clock = near
    # Served mallory itself: no evidence about anyone else.
    health.served(region, "h:mallory")
    assert health.blame(region, "h:mallory")
    # Two callers served, the latest mallory: the other one still counts as evidence.
    health.served(region, "t:alice")
    health.served(region, "h:mallory")
    assert not health.blame(region, "h:mallory")
    clock.advance(31.0)
    assert health.blame(region, "h:mallory")


def test_a_failing_active_check_confirms_a_single_callers_failures(
    near: tuple[Region, Health, FakeClock],
) -> None:
    region, health, _ = near
    health.served(region, "t:alice")
    assert not health.blame(region, "h:mallory")
    region.health.active_ok = False  # the probe fails too: the region is at fault
    assert health.blame(region, "h:mallory")


def test_the_callers_kept_are_bounded(near: tuple[Region, Health, FakeClock]) -> None:
    region, health, _ = near
    for i in range(10_000):
        health.blame(region, f"ip:10.0.{i // 256}.{i % 256}")
    assert len(region.health.failing_callers) <= 256
    assert len(region.health.failures) <= 1024


def _ctx(body: bytes, who: str) -> RequestContext:
    ctx = RequestContext(
        request_id="r",
        trace=trace_context(None),
        method="POST",
        target=CHAT,
        headers=CIMultiDict(key(who)),
        client_ip="10.0.0.9",
        started=0.0,
        route=Config.from_mapping(proxy_config(ONE), environ={}).route_for("POST", CHAT),
    )
    ctx.body = body
    ctx.body_read = True
    return ctx


def test_a_body_two_regions_rejected_is_poison_until_the_ttl_passes() -> None:
    clock = FakeClock(10.0)
    config = Config.from_mapping(
        proxy_config(ONE, health={"poison_ttl": 60.0, "poison_strikes": 2}), environ={}
    )
    poison = Poison(config, clock=clock)
    bad, good = _ctx(b'{"messages":"bad"}', "mallory"), _ctx(b'{"messages":[]}', "alice")
    # Nothing known: no digest is even computed.
    assert poison.rejection(bad) is None and not poison.known
    assert poison.failed(bad, "near", 500) is None  # one region: maybe the region's
    assert poison.failed(bad, "near", 500) is None  # the same region again: still one
    error = poison.failed(bad, "far", 503)
    assert error is not None and error.status == 502 and error.code == "upstream_rejected_request"
    assert "region near answered 500" in error.message
    assert "region far answered 503" in error.message
    rejected = poison.rejection(bad)
    assert rejected is not None and rejected.headers["Retry-After"] == "61"
    assert poison.rejection(good) is None
    # Two strikes make the caller limited (429); others are not.
    poison.strike(bad)
    assert poison.limited(bad) is None
    poison.strike(bad)
    limited = poison.limited(bad)
    assert limited is not None and limited.status == 429 and limited.code == "rejected_requests"
    assert poison.limited(good) is None
    assert caller_of(bad, "Authorization") != caller_of(good, "Authorization")
    assert poison.snapshot() == {
        "poison_bodies": 1,
        "poison_detected_total": 1,
        "poison_rejected_total": 1,
        "callers_limited": 1,
        "callers_limited_total": 1,
    }
    # Penalties fade on the clock.
    clock.advance(61.0)
    assert poison.rejection(bad) is None and poison.limited(bad) is None
    assert poison.snapshot()["poison_bodies"] == 0 and poison.snapshot()["callers_limited"] == 0


def test_a_body_that_streams_through_is_never_poison() -> None:
    poison = Poison(Config.from_mapping(proxy_config(ONE), environ={}))
    ctx = _ctx(b"", "x")
    ctx.body_read = False
    assert poison.digest(ctx) is None
    assert poison.failed(ctx, "a", 500) is None and poison.failed(ctx, "b", 500) is None


# -- end to end: fake regions, injected clock --------------------------------------------


@pytest.fixture
def clock() -> FakeClock:
    # The proxy dates attempts with the real clock: this one runs ahead of it on demand.
    return FakeClock.following(time.monotonic)


async def two_regions(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    clock: FakeClock,
    *,
    near_fault_body: str | None = MARK,
    **sections: dict[str, Any],
) -> tuple[EdgeProxy, Any, Any]:
    near = await make_region(
        "near", fault="5xx", fault_status=500, fault_body=near_fault_body, fault_paths=["/v1/"]
    )
    far = await make_region("far", fault="5xx", fault_status=500, fault_body=MARK)
    health = {"min_failing_callers": 3, **sections.pop("health", {})}
    proxy = await make_proxy(
        [{"name": "near", "url": near.url, **NEAR}, {"name": "far", "url": far.url, **FAR}],
        health=health,
        clock=clock,
        **sections,
    )
    return proxy, near, far


async def test_one_tenant_flooding_bad_bodies_moves_no_one(
    make_region: RegionFactory, make_proxy: ProxyFactory, clock: FakeClock
) -> None:
    proxy, near, far = await two_regions(make_region, make_proxy, clock)
    served: Counter[str] = Counter()
    async with aiohttp.ClientSession() as client:
        for i in range(100):
            if i % 5 == 0:
                # Others are served meanwhile: the evidence that the failures are mallory's.
                status, region, _, _ = await post(client, proxy, GOOD, f"alice{i % 7}")
                assert status == 200
                served[region] += 1
            status, region, _, _ = await post(client, proxy, BAD, "mallory")
            assert status == 500  # the region's own answer, relayed
            clock.advance(0.5)  # 50 s of traffic: the window slides past old failures
            assert status_of(proxy, "near")["health"]["ejections_total"] == 0
    assert served["near"] >= 0.95 * sum(served.values()), served
    health = status_of(proxy, "near")["health"]
    assert not health["ejected"] and health["available"]
    assert health["failures"]["callers"] == 1 and not health["failures"]["counted"]
    assert health["failures"]["callers_own_total"] == 100
    assert health["failures"]["counted_total"] == 0
    assert health["latency_penalty_ms"] == 0.0
    assert status_of(proxy, "near")["errors_total"] == 0


async def test_five_tenants_seeing_5xx_move_traffic_away_until_it_fades(
    make_region: RegionFactory, make_proxy: ProxyFactory, clock: FakeClock
) -> None:
    # near fails every request now: a real outage, seen by every tenant.
    proxy, near, far = await two_regions(
        make_region,
        make_proxy,
        clock,
        near_fault_body=None,
        health={"consecutive_failures": 3, "base_ejection_time": 30.0},
    )
    async with aiohttp.ClientSession() as client:
        for i in range(20):
            await post(client, proxy, GOOD, f"tenant{i % 5}")
            if status_of(proxy, "near")["health"]["ejected"]:
                break
        health = status_of(proxy, "near")["health"]
        assert health["ejected"] and health["ejections_total"] == 1
        assert health["failures"]["callers"] >= 3 and health["failures"]["counted"]
        assert "distinct callers got 5xx" in health["last_ejection_reason"]
        served: Counter[str] = Counter()
        for i in range(20):
            status, region, _, _ = await post(client, proxy, GOOD, f"tenant{i % 5}")
            assert status == 200
            served[region] += 1
        assert served == {"far": 20}
        # Repaired; the ejection and the failures fade on the clock, and near is back.
        near.behavior.fault = None
        clock.advance(61.0)
        status, region, _, _ = await post(client, proxy, GOOD, "tenant0")
        assert (status, region) == (200, "near")
        assert status_of(proxy, "near")["health"]["failures"]["callers"] == 0


async def test_a_poison_request_gets_502_after_two_attempts_then_none(
    make_region: RegionFactory, make_proxy: ProxyFactory, clock: FakeClock
) -> None:
    proxy, near, far = await two_regions(
        make_region,
        make_proxy,
        clock,
        health={"poison_ttl": 120.0, "poison_strikes": 3},
        routing={"retry_statuses": [500, 502, 503, 504], "retry_budget_min": 100},
    )
    sent = lambda: near.requests_by_path.get(CHAT, 0) + far.requests_by_path.get(CHAT, 0)  # noqa: E731
    others_served(proxy, "near", "far")
    async with aiohttp.ClientSession() as client:
        status, _, payload, headers = await post(client, proxy, BAD, "mallory")
        assert status == 502 and payload["error"]["code"] == "upstream_rejected_request"
        assert "region near answered 500" in payload["error"]["message"]
        assert "region far answered 500" in payload["error"]["message"]
        assert headers["X-Edgeproxy-Attempts"] == "2" and sent() == 2
        # Known now: the same body is answered at once, with no attempt.
        for _ in range(2):
            status, _, payload, headers = await post(client, proxy, BAD, "mallory")
            assert status == 502 and payload["error"]["code"] == "upstream_rejected_request"
            assert "Retry-After" in headers and "X-Edgeproxy-Attempts" not in headers
        assert sent() == 2
        # Three poison requests: the caller is limited, whatever it sends; others are not.
        status, _, payload, headers = await post(client, proxy, GOOD, "mallory")
        assert status == 429 and payload["error"]["code"] == "rejected_requests"
        assert int(headers["Retry-After"]) > 0
        status, region, _, _ = await post(client, proxy, GOOD, "alice")
        assert (status, region) == (200, "near")
        limits = proxy.status()["limits"]["rejected_requests"]
        assert limits["poison_bodies"] == 1 and limits["poison_rejected_total"] == 2
        assert limits["callers_limited"] == 1 and limits["callers_limited_total"] == 1
        # The regions were never judged for it.
        for name in ("near", "far"):
            region_status = status_of(proxy, name)
            assert region_status["health"]["failures"]["counted_total"] == 0
            assert region_status["errors_total"] == 0
        # The ttl passes: the body is tried again, and the caller is free again.
        clock.advance(121.0)
        others_served(proxy, "near", "far")
        status, _, _, headers = await post(client, proxy, BAD, "mallory")
        # Two attempts more: 5 with alice's answer.
        assert status == 502 and headers["X-Edgeproxy-Attempts"] == "2" and sent() == 5
        status, _, _, _ = await post(client, proxy, GOOD, "mallory")
        assert status == 200


# -- end to end: real llama.cpp regions ----------------------------------------------------


@pytest.fixture
async def llama_proxy(
    llama_servers: LlamaServers, make_proxy: ProxyFactory, clock: FakeClock
) -> AsyncIterator[EdgeProxy]:
    """The two llama.cpp regions behind a proxy whose choice between them is the score alone.

    A real server's answers take what they take: a cold one's first takes hundreds of
    milliseconds (more on a busy machine), and the peak-EWMA keeps that peak. Far has no
    history, so its prior is near's service time plus its 160 ms round trip, which such a
    peak brings within the default ``equal_within`` (1.5x) of near's score: the two would be
    equals, drawn between, and far's fast answers would then keep the traffic, flood or no
    flood. With ``equal_within = 1`` only a better score wins, and far's prior stays 160 ms
    worse than near's own latency, whatever it is: only what the flood does to near's standing
    (an ejection, its failures counted) can move anyone. The failure window outlasts the test
    (pytest's timeout): the evidence of alice's answers and the count of callers with 5xx
    hold however slowly the requests run.
    """
    near_url, far_url = await asyncio.gather(llama_servers(), llama_servers())
    yield await make_proxy(
        [{"name": "near", "url": near_url, **NEAR}, {"name": "far", "url": far_url, **FAR}],
        health={"min_failing_callers": 3, "failure_window": 3600.0},
        routing={"equal_within": 1.0},
        upstream={"http2": False},
        clock=clock,
    )


class TestLlamaCpp:
    pytestmark = needs_llama_server

    async def test_a_bad_body_flood_moves_no_one(self, llama_proxy: EdgeProxy) -> None:
        """llama-cpp-python's OpenAI server answers a message of no role it knows with 500
        (its validation error, as several servers do; the edge leaves message shapes to the
        servers): one client's flood of them leaves every other tenant on the near region."""
        proxy, flood = llama_proxy, 30
        good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        bogus = {"model": "m", "messages": [{"role": "bogus", "content": "hi"}]}
        served: Counter[str] = Counter()
        async with aiohttp.ClientSession() as client:
            for _ in range(5):
                status, region, _, _ = await post(client, proxy, good, "alice")
                # Checked here, before any flood: a region chosen otherwise than by the score
                # (equals drawn between) shows as itself, not as the flood's doing.
                assert (status, region) == (200, "near")
                served[region] += 1
            for _ in range(flood):
                status, region, _, _ = await post(client, proxy, bogus, "mallory")
                assert status == 500 and region == "near"
            for i in range(10):
                status, region, _, _ = await post(client, proxy, good, f"tenant{i % 3}")
                assert status == 200
                served[region] += 1
        assert served == {"near": 15}
        health = status_of(proxy, "near")["health"]
        assert health["ejections_total"] == 0 and not health["failures"]["counted"]
        assert health["failures"]["callers_own_total"] == flood
        assert health["failures"]["counted_total"] == 0 and health["latency_penalty_ms"] == 0.0
        assert status_of(proxy, "near")["errors_total"] == 0
        assert status_of(proxy, "far")["requests_total"] == 0


# -- one caller in an outage: the ladder, never a lockout ----------------------------------


@pytest.mark.parametrize("retry_after", [None, "1"], ids=["no-retry-after", "retry-after"])
@pytest.mark.model
async def test_one_caller_in_a_full_outage_gets_the_local_model_then_the_regions_again(
    make_region: RegionFactory, make_proxy: ProxyFactory, clock: FakeClock, retry_after: str | None
) -> None:
    """A sidecar's one caller, both regions saturated (503), the default caller rule
    (min_failing_callers = 3): every request is answered by the local model, never 502 or
    429; once the regions recover, its next requests go back to them."""
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the local model needs llama-cpp-python, gguf and numpy")
    from edgeproxy.testing import tiny_llama_gguf

    saturated = {"fault": "5xx", "fault_status": 503, "fault_retry_after": retry_after}
    near = await make_region("near", **saturated)
    far = await make_region("far", **saturated)
    proxy = await make_proxy(
        [{"name": "near", "url": near.url, **NEAR}, {"name": "far", "url": far.url, **FAR}],
        health={"min_failing_callers": 3},
        local_model={"path": str(tiny_llama_gguf("Q4_0")), "n_ctx": 256, "max_tokens": 8},
        clock=clock,
    )
    local = proxy.pipeline.fallback.local
    for _ in range(600):
        if local.state not in ("idle", "loading"):
            break
        await asyncio.sleep(0.05)
    # The proxy's waits for a Retry-After move the injected clock, not the wall clock.
    failover = proxy.pipeline.failover

    async def waits(seconds: float) -> None:
        clock.advance(seconds)

    failover.sleep = waits
    async with aiohttp.ClientSession() as client:
        for _ in range(12):
            status, region, payload, headers = await post(client, proxy, GOOD, "app")
            assert status == 200, payload
            assert headers["X-Edgeproxy-Degraded"] == "local-model" and region == "local"
        limits = proxy.status()["limits"]["rejected_requests"]
        assert limits["poison_detected_total"] == 0 and limits["callers_limited_total"] == 0
        # The regions recover; once their ejections (and waits) have passed, the same
        # caller is served by them again.
        near.behavior.fault = None
        far.behavior.fault = None
        clock.advance(301.0)
        status, region, _, headers = await post(client, proxy, GOOD, "app")
        assert (status, region) == (200, "near") and "X-Edgeproxy-Degraded" not in headers


async def test_the_same_body_from_another_caller_is_tried_afresh_and_the_penalty_is_per_model(
    make_region: RegionFactory, make_proxy: ProxyFactory, clock: FakeClock
) -> None:
    proxy, near, far = await two_regions(
        make_region,
        make_proxy,
        clock,
        health={"poison_ttl": 120.0, "poison_strikes": 1},
        routing={"retry_statuses": [500, 502, 503, 504], "retry_budget_min": 100},
    )
    others_served(proxy, "near", "far")
    async with aiohttp.ClientSession() as client:
        status, _, payload, _ = await post(client, proxy, BAD, "mallory")
        assert status == 502 and payload["error"]["code"] == "upstream_rejected_request"
        # Bob sends the same body: his is tried, not answered with mallory's mark.
        before = near.requests_by_path.get(CHAT, 0) + far.requests_by_path.get(CHAT, 0)
        others_served(proxy, "near", "far")
        status, _, payload, headers = await post(client, proxy, BAD, "bob")
        after = near.requests_by_path.get(CHAT, 0) + far.requests_by_path.get(CHAT, 0)
        assert after > before and headers.get("Retry-After") != "121"
        # Mallory's one strike limits her on this model only: another model is served.
        status, _, payload, _ = await post(client, proxy, GOOD, "mallory")
        assert status == 429 and payload["error"]["code"] == "rejected_requests"
        status, region, _, _ = await post(client, proxy, {**GOOD, "model": "other"}, "mallory")
        assert (status, region) == (200, "near")
