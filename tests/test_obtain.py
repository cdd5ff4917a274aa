"""One way to obtain an answer: each failure kind is a value, and holds nothing running.

Every request that no region answers goes through :meth:`Obtainer.obtain`, which returns
a :class:`Failure` with its kind. These tests drive real requests through the proxy and
look at the value ``obtain`` returned and at what the regions still hold at that moment:
every attempt, including those kept past the deadline to race the local model, is
released by the time the value is returned (a bound of zero on the proxy's own clock,
so no timing is asserted).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from edgeproxy import EdgeProxy, hookimpl
from edgeproxy._obtain.failover import Failure, FailureKind
from edgeproxy.testing import FakeRegion

from .conftest import FakeClock, ProxyFactory, RegionFactory, eventually

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
LOCAL_PEERS = ["127.0.0.0/8", "::1"]


def record_outcomes(proxy: EdgeProxy) -> list[tuple[Any, dict[str, int], int]]:
    """What each top-level ``obtain`` returned, with the attempts each region still held
    and the streams its pool still had in use when it returned."""
    obtainer = proxy.pipeline.obtainer
    obtain = obtainer.obtain
    seen: list[tuple[Any, dict[str, int], int]] = []

    async def spy(*args: Any, **kwargs: Any) -> Any:
        result = await obtain(*args, **kwargs)
        held = {region.name: region.in_flight for region in proxy.regions}
        streams = sum(region.pool.stats().streams_in_use for region in proxy.regions)
        seen.append((result, held, streams))
        return result

    obtainer.obtain = spy  # type: ignore[method-assign]
    return seen


async def post(proxy: EdgeProxy, body: Any = BODY, **kwargs: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=body, **kwargs) as resp:
            return resp.status, await resp.json()


def only_failure(seen: list[tuple[Any, dict[str, int], int]]) -> Failure:
    [(result, held, streams)] = seen
    assert isinstance(result, Failure)
    assert all(n == 0 for n in held.values()), held
    assert streams == 0
    assert result.pending is None
    return result


async def test_upstream_failure_is_a_value_with_nothing_left_running(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1", fault="5xx", fault_status=503)
    proxy = await make_proxy([region], routes=[{"name": "chat", "path": CHAT, "retries": 0}])
    seen = record_outcomes(proxy)
    status, body = await post(proxy)
    failure = only_failure(seen)
    assert failure.kind is FailureKind.UPSTREAM
    assert status == failure.status == 503
    assert body["error"]["code"] == "upstream_unavailable"


async def test_deadline_failure_releases_the_attempts_it_raced(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # deadline_action = "race" keeps the attempt running past the deadline for the local
    # model to race; with no local model it must be cancelled before obtain returns.
    slow = await make_region("slow", ttft=30.0)
    proxy = await make_proxy(
        [slow],
        routes=[{"name": "chat", "path": CHAT, "deadline": 0.2, "deadline_action": "race"}],
    )
    seen = record_outcomes(proxy)
    status, body = await post(proxy)
    failure = only_failure(seen)
    assert failure.kind is FailureKind.DEADLINE
    assert status == 504 and body["error"]["code"] == "deadline_exceeded"
    await eventually(lambda: slow.cancelled_total == 1)


class _NoRegion:
    @hookimpl
    def edgeproxy_route(self, request: Any, ctx: Any, candidates: Any) -> list[Any]:
        return []


async def test_no_region_failure(make_region: RegionFactory, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy([await make_region("r1")], plugins=[_NoRegion()])
    seen = record_outcomes(proxy)
    status, body = await post(proxy)
    assert only_failure(seen).kind is FailureKind.NO_REGION
    assert status == 503 and body["error"]["code"] == "no_region"


async def test_overloaded_failure_when_every_breaker_is_open(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region], health={"max_concurrent": 1})
    proxy.regions.by_name["r1"].in_flight = 1  # its one slot is taken
    seen = record_outcomes(proxy)
    try:
        status, body = await post(proxy)
    finally:
        proxy.regions.by_name["r1"].in_flight = 0
    [(result, _, streams)] = seen
    assert isinstance(result, Failure) and result.kind is FailureKind.OVERLOADED
    assert streams == 0 and result.pending is None
    assert status == 503 and body["error"]["code"] == "region_overloaded"


async def test_shed_requests_reach_the_ladder_as_an_overloaded_failure(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy(
        [region],
        admission={"max_in_flight": 1, "max_queue": 0},
        routes=[{"name": "chat", "path": CHAT, "on_overload": "degrade"}],
    )
    proxy.pipeline.admission.in_flight = 1  # the one slot is taken
    seen = record_outcomes(proxy)
    try:
        status, _ = await post(proxy)
    finally:
        proxy.pipeline.admission.in_flight = 0
    assert only_failure(seen).kind is FailureKind.OVERLOADED
    assert status == 503
    assert region.counters().requests_by_path.get(CHAT, 0) == 0


async def test_model_failures_unknown_and_malformed(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    # Bodies unchecked at the edge: a model that is no name reaches the catalog.
    proxy = await make_proxy(
        [{"name": "r1", "url": region.url, "models": ["m"]}],
        routes=[{"name": "chat", "path": CHAT, "check_bodies": False}],
    )
    seen = record_outcomes(proxy)
    status, body = await post(proxy, {**BODY, "model": "other"})
    assert only_failure(seen).kind is FailureKind.MODEL_UNKNOWN
    assert status == 404 and body["error"]["code"] == "model_not_found"
    seen.clear()
    status, body = await post(proxy, {**BODY, "model": 7})
    assert only_failure(seen).kind is FailureKind.BAD_REQUEST
    assert status == 400


async def test_residency_failure_is_never_degraded(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    eu = await make_region("eu")
    us = await make_region("us")
    proxy = await make_proxy(
        [
            {"name": "eu", "url": eu.url, "jurisdiction": "eu"},
            {"name": "us", "url": us.url, "jurisdiction": "us"},
        ],
        geo={"residency": {"EU": ["eu"]}, "trusted_peers": LOCAL_PEERS},
        routes=[{"name": "chat", "path": CHAT, "fallback": ["stale", "local"]}],
    )
    proxy.regions.by_name["eu"].mark_down("down for the test")
    seen = record_outcomes(proxy)
    status, body = await post(proxy, headers={"CF-IPCountry": "FR"})
    assert only_failure(seen).kind is FailureKind.RESIDENCY
    assert status == 503 and body["error"]["code"] == "residency"
    assert us.counters().requests_by_path.get(CHAT, 0) == 0


async def _stored(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> tuple[FakeRegion, FakeClock, EdgeProxy, dict[str, Any]]:
    """A region, the cache's clock, a proxy caching chat answers for 10 s and serving them
    stale for 60 more, and a request whose answer it stored."""
    region = await make_region("r1")
    clock = FakeClock(start=float(int(time.time())))
    proxy = await make_proxy(
        [region],
        cache={"xfetch_beta": 0.0},
        cache_clock=clock,
        routes=[{"name": "chat", "path": CHAT, "cache_ttl": 10, "stale_while_revalidate": 60}],
    )
    body = {**BODY, "temperature": 0}
    assert (await post(proxy, body))[0] == 200
    await eventually(lambda: proxy.status()["cache"]["stores"] == 1)
    return region, clock, proxy, body


async def _refreshed(proxy: EdgeProxy, clock: FakeClock, body: dict[str, Any]) -> None:
    """``body`` asked again once its answer is stale: served so, and refreshed once."""
    clock.advance(20)
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=body) as resp:
            assert resp.headers["X-Edgeproxy-Cache"] == "STALE"
    await eventually(lambda: proxy.status()["cache"]["refreshes"] == 1)


async def test_the_cache_refresh_takes_the_same_path(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # A stale-while-revalidate refresh is obtained like any request, with no fallback;
    # the cache asks for it as a value and never calls back into the pipeline.
    region, clock, proxy, body = await _stored(make_region, make_proxy)
    assert not hasattr(proxy.pipeline.cache, "fetch")
    seen = record_outcomes(proxy)
    await _refreshed(proxy, clock, body)
    [(result, _, _)] = seen
    assert not isinstance(result, Failure)
    assert region.counters().requests_by_path[CHAT] == 2


async def test_a_refresh_after_a_request_the_client_gave_up_on_is_a_refresh(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # A request cancelled while it waits for its region (the client left) leaves nothing
    # behind that a later refresh takes for its own failure: a build that compiled the
    # pipeline once counted such a refresh, stored and all, as "cancelled".
    region, clock, proxy, body = await _stored(make_region, make_proxy)
    region.configure(fault="stall")
    async with aiohttp.ClientSession() as client:
        left = asyncio.ensure_future(client.post(proxy.url + CHAT, json={**body, "n": 2}))
        await region.wait_until(lambda c: c.in_flight == 1)
        left.cancel()
        await asyncio.gather(left, return_exceptions=True)
    await eventually(lambda: proxy.pipeline.in_flight == 0)
    region.configure(fault=None)
    await _refreshed(proxy, clock, body)
    assert proxy.status()["cache"]["refresh_failures"] == 0


class _Outcome:
    """What a finished request's context says happened to it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, int, float | None]] = []

    @hookimpl
    def edgeproxy_response_complete(self, ctx: Any) -> None:
        self.seen.append((ctx.region, ctx.attempts, ctx.upstream_ttfb))


async def test_the_values_returned_say_what_was_tried_and_the_context_records_it(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # Failover writes nothing on the request: its values carry the attempts and the
    # region, and the obtain path records them, as the logs and hooks read them after.
    regions = [await make_region(n, fault="5xx", fault_status=503) for n in ("r1", "r2")]
    outcome = _Outcome()
    proxy = await make_proxy(
        regions, routes=[{"name": "chat", "path": CHAT, "retries": 1}], plugins=[outcome]
    )
    seen = record_outcomes(proxy)
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 503
            region, attempts = (
                resp.headers["X-Edgeproxy-Region"],
                resp.headers["X-Edgeproxy-Attempts"],
            )
    failure = only_failure(seen)
    assert failure.attempts == 2 and attempts == "2"
    assert failure.region == region and region in ("r1", "r2")
    await eventually(lambda: len(outcome.seen) == 1)
    assert outcome.seen == [(region, 2, None)]

    # A region answers (after the other failed, if it was tried first): the answer
    # carries the count and its time to headers, and the context records them.
    healthy = await make_region("ok")
    broken = await make_region("down", fault="5xx", fault_status=503)
    outcome = _Outcome()
    proxy = await make_proxy(
        [broken, healthy], routes=[{"name": "chat", "path": CHAT, "retries": 1}], plugins=[outcome]
    )
    seen = record_outcomes(proxy)
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200
            header = resp.headers.get("X-Edgeproxy-Attempts", "1")
    [(answer, _, _)] = seen
    assert answer.region.name == "ok" and str(answer.attempts) == header
    await eventually(lambda: len(outcome.seen) == 1)
    assert outcome.seen == [("ok", answer.attempts, answer.ttfb)]
