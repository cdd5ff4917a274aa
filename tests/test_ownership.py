"""Every upstream attempt has one owner that cancels it, on every way a request can end.

Each test runs a real proxy in front of real hypercorn h2c fake regions, ends a
request one way (the deadline, with or without hedging; the client leaving
while it waits or while it streams; a plugin failing around an attempt; the
fallback winning a deadline race; the proxy shutting down), and checks that
soon after the client got its answer nothing is left upstream: the proxy's
region counts no attempt in flight or waiting, the HTTP/2 pool holds no
stream, and the fake region saw the stream reset (it counts the request as
cancelled and none in flight).

``read_timeout`` is a minute, and "soon" is a poll with a 5 s ceiling: a
leaked attempt cannot pass by timing out upstream in the meantime.

A background cache refresh, which outlives the client's handler, is relayed
by the same loop as a client's answer, without the client's request.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from edgeproxy import EdgeProxy, Exchange, RequestContext, Response, StreamResponse, hookimpl
from edgeproxy._upstream.regions import Region
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory, eventually

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SIN = {"lat": 1.29, "lon": 103.85}
TOKYO = {"lat": 35.68, "lon": 139.69}
# Long enough that an attempt nobody cancelled is still open when the poll gives up.
UPSTREAM = {"read_timeout": 60.0, "connect_timeout": 2.0}
RELEASED_WITHIN = 5.0


def chat_route(**keys: Any) -> list[dict[str, Any]]:
    return [{"name": "chat", "path": CHAT, "retries": 0, **keys}]


def regions_config(*fakes: FakeRegion) -> list[dict[str, Any]]:
    places = [SIN, TOKYO]
    return [{"name": f.name, "url": f.url, **places[i % 2]} for i, f in enumerate(fakes)]


def nothing_held(region: Region) -> bool:
    return (
        region.in_flight == 0
        and region.pending == 0
        and all(e.in_flight == 0 for e in region.endpoints)
        and all(e.pool.stats().streams_in_use == 0 for e in region.endpoints)
    )


async def released(
    regions: list[Region], fakes: list[FakeRegion], *, cancelled: int | None = 1
) -> None:
    """Poll until no attempt holds a slot or a stream, and each fake saw its stream reset."""

    def done() -> bool:
        return all(nothing_held(r) for r in regions) and all(
            f.in_flight == 0 and (cancelled is None or f.cancelled_total == cancelled)
            for f in fakes
        )

    await eventually(done, timeout=RELEASED_WITHIN)
    for fake in fakes:
        # The attempts went over HTTP/2: what was released is a multiplexed stream.
        assert set(fake.counters().requests_by_http_version) <= {"2"}


def held(proxy: EdgeProxy, *fakes: FakeRegion) -> list[Region]:
    return [proxy.regions.by_name[f.name] for f in fakes]


async def post(proxy: EdgeProxy, body: dict[str, Any] = BODY) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=body) as resp:
            return resp.status, await resp.json()


# -- the deadline ------------------------------------------------------------------------


async def test_deadline_with_hedging_cancels_every_attempt(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    first = await make_region("first", fault="stall")
    hedge = await make_region("hedge", fault="stall")
    proxy = await make_proxy(
        regions_config(first, hedge),
        routes=chat_route(hedge=True, hedge_delay=0.05, deadline=0.3),
        routing={"hedge_budget_min": 10},
        upstream=UPSTREAM,
    )
    status, body = await post(proxy)
    assert status == 504 and body["error"]["code"] == "deadline_exceeded"
    assert hedge.requests_total == 1  # the hedge was sent, and is cancelled with the first
    await released(held(proxy, first, hedge), [first, hedge])


async def test_deadline_without_hedging_cancels_the_attempt(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    stalled = await make_region("stalled", fault="stall")
    proxy = await make_proxy(
        regions_config(stalled), routes=chat_route(deadline=0.3), upstream=UPSTREAM
    )
    status, body = await post(proxy)
    assert status == 504 and body["error"]["code"] == "deadline_exceeded"
    await released(held(proxy, stalled), [stalled])


@pytest.mark.parametrize("hedge", [False, True], ids=["in-turn", "hedged"])
async def test_deadline_race_with_nothing_to_race_cancels_the_attempts(
    make_region: RegionFactory, make_proxy: ProxyFactory, hedge: bool
) -> None:
    # deadline_action = "race" keeps the attempts past the deadline for the fallback;
    # with no local model and no plugin answer, the pipeline cancels them.
    fakes = [await make_region(f"r{i}", fault="stall") for i in range(2 if hedge else 1)]
    proxy = await make_proxy(
        regions_config(*fakes),
        routes=chat_route(deadline=0.3, deadline_action="race", hedge=hedge, hedge_delay=0.05),
        routing={"hedge_budget_min": 10},
        upstream=UPSTREAM,
    )
    status, body = await post(proxy)
    assert status == 504 and body["error"]["code"] == "deadline_exceeded"
    await released(held(proxy, *fakes), fakes)


# -- the client leaves ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "route",
    [{}, {"hedge": True, "hedge_delay": 0.05}, {"deadline_action": "race"}],
    ids=["in-turn", "hedged", "race-action"],
)
async def test_client_gone_while_waiting_for_the_first_byte(
    make_region: RegionFactory, make_proxy: ProxyFactory, route: dict[str, Any]
) -> None:
    fakes = [await make_region(f"r{i}", fault="stall") for i in range(2)]
    proxy = await make_proxy(
        regions_config(*fakes),
        routes=chat_route(deadline=30.0, **route),
        routing={"hedge_budget_min": 10},
        upstream=UPSTREAM,
        # The client hangs up with a FIN, which the default half_close = "answer" takes for
        # a half-close to answer: the attempts would run on to the answer or the deadline.
        limits={"half_close": "abort"},
    )
    sent = 2 if route.get("hedge") else 1
    async with aiohttp.ClientSession() as client:
        request = asyncio.ensure_future(client.post(proxy.url + CHAT, json=BODY))
        await eventually(lambda: sum(f.in_flight for f in fakes) == sent)
        request.cancel()  # the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await request
    waited = [f for f in fakes if f.requests_total]
    assert len(waited) == sent
    await released(held(proxy, *fakes), waited)


async def test_client_gone_mid_stream(make_region: RegionFactory, make_proxy: ProxyFactory) -> None:
    streaming = await make_region("streaming", inter_token_delay=0.1, tokens=200)
    proxy = await make_proxy(regions_config(streaming), routes=chat_route(), upstream=UPSTREAM)
    async with aiohttp.ClientSession() as client:
        resp = await client.post(proxy.url + CHAT, json={**BODY, "stream": True, "max_tokens": 200})
        assert resp.status == 200
        assert await resp.content.readany()  # the stream started
        resp.close()  # and the client hangs up in the middle of it
    await released(held(proxy, streaming), [streaming])


# -- a plugin fails around an attempt ---------------------------------------------------------


class FailingRequest:
    """Raises in edgeproxy_upstream_request for one region: the hedge to it."""

    def __init__(self, region: str) -> None:
        self.region = region

    @hookimpl
    def edgeproxy_upstream_request(self, region: Region) -> None:
        if region.name == self.region:
            raise RuntimeError("plugin failure")


async def test_plugin_failing_in_upstream_request_cancels_the_other_attempt(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    stalled = await make_region("stalled", fault="stall")
    other = await make_region("other")
    proxy = await make_proxy(
        regions_config(stalled, other),
        routes=chat_route(hedge=True, hedge_delay=0.05, deadline=30.0),
        routing={"hedge_budget_min": 10},
        plugins=(FailingRequest("other"),),
        upstream=UPSTREAM,
    )
    status, body = await post(proxy)
    # The hedge never left (the plugin failed before sending it); the first attempt,
    # still waiting on the stalled region, is cancelled with the request.
    assert status == 500 and body["error"]["code"] == "plugin_error"
    assert other.requests_total == 0
    await released(held(proxy, stalled, other), [stalled])


class FailingResponse:
    @hookimpl
    def edgeproxy_upstream_response(self) -> None:
        raise RuntimeError("plugin failure")


async def test_plugin_failing_in_upstream_response_cancels_the_stream(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    streaming = await make_region("streaming", inter_token_delay=0.1, tokens=200)
    proxy = await make_proxy(
        regions_config(streaming),
        routes=chat_route(),
        plugins=(FailingResponse(),),
        upstream=UPSTREAM,
    )
    status, body = await post(proxy, {**BODY, "stream": True, "max_tokens": 200})
    assert status == 500 and body["error"]["code"] == "plugin_error"
    await released(held(proxy, streaming), [streaming])


# -- the fallback wins a deadline race ----------------------------------------------------------


class Degrade:
    @hookimpl
    def edgeproxy_fallback(self) -> StreamResponse:
        return Response.json({"degraded": True})


async def test_plugin_fallback_answer_cancels_the_raced_attempts(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    fakes = [await make_region(f"r{i}", fault="stall") for i in range(2)]
    proxy = await make_proxy(
        regions_config(*fakes),
        routes=chat_route(deadline=0.3, deadline_action="race", hedge=True, hedge_delay=0.05),
        routing={"hedge_budget_min": 10},
        plugins=(Degrade(),),
        upstream=UPSTREAM,
    )
    status, body = await post(proxy)
    assert status == 200 and body == {"degraded": True}
    await released(held(proxy, *fakes), fakes)


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the local model needs llama-cpp-python, gguf and numpy")
    from edgeproxy.testing import tiny_llama_gguf

    return tiny_llama_gguf("Q4_0")


@pytest.mark.model
async def test_local_answer_winning_the_race_cancels_the_raced_attempts(
    make_region: RegionFactory, make_proxy: ProxyFactory, tiny_model: Path
) -> None:
    fakes = [await make_region(f"r{i}", fault="stall") for i in range(2)]
    proxy = await make_proxy(
        regions_config(*fakes),
        routes=chat_route(deadline=0.3, deadline_action="race", hedge=True, hedge_delay=0.05),
        routing={"hedge_budget_min": 10},
        local_model={"path": str(tiny_model), "n_ctx": 256, "max_tokens": 32},
        upstream=UPSTREAM,
    )
    local = proxy.pipeline.fallback.local
    await eventually(lambda: local.ready, timeout=30.0)
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Degraded"] == "local-model"
            assert (await resp.json())["usage"]["completion_tokens"] == 4
    assert proxy.status()["fallback"]["races"] == {"local": 1}
    await released(held(proxy, *fakes), fakes)


# -- shutdown --------------------------------------------------------------------------------


@pytest.mark.parametrize("hedge", [False, True], ids=["in-turn", "hedged"])
async def test_shutdown_cancels_an_attempt_in_flight(
    make_region: RegionFactory, make_proxy: ProxyFactory, hedge: bool
) -> None:
    fakes = [await make_region(f"r{i}", fault="stall") for i in range(2)]
    proxy = await make_proxy(
        regions_config(*fakes),
        routes=chat_route(deadline=30.0, hedge=hedge, hedge_delay=0.05),
        routing={"hedge_budget_min": 10},
        upstream=UPSTREAM,
    )
    regions = held(proxy, *fakes)
    sent = 2 if hedge else 1
    async with aiohttp.ClientSession() as client:
        request = asyncio.ensure_future(client.post(proxy.url + CHAT, json=BODY))
        await eventually(lambda: sum(f.in_flight for f in fakes) == sent)
        # The grace period ends with the request still waiting: it is cut off.
        assert await proxy.stop(grace=0.1) is False
        with contextlib.suppress(aiohttp.ClientError):
            (await request).close()
    await released(regions, [f for f in fakes if f.requests_total])


# -- a background cache refresh ------------------------------------------------------------


class UpstreamHooks:
    """Records, for each upstream-side hook call, whether it had a request and the cache outcome."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool, str | None]] = []

    def _record(self, hook: str, request: web.Request | None, ctx: RequestContext) -> None:
        self.seen.append((hook, request is not None, ctx.cache))

    @hookimpl
    def edgeproxy_route(self, request: Exchange | None, ctx: RequestContext) -> None:
        self._record("route", request, ctx)

    @hookimpl
    def edgeproxy_upstream_request(self, request: Exchange | None, ctx: RequestContext) -> None:
        self._record("upstream_request", request, ctx)

    @hookimpl
    def edgeproxy_upstream_response(self, request: Exchange | None, ctx: RequestContext) -> None:
        self._record("upstream_response", request, ctx)

    @hookimpl
    def edgeproxy_stream_chunk(self, request: Exchange | None, ctx: RequestContext) -> None:
        self._record("stream_chunk", request, ctx)


async def test_background_refresh_is_relayed_without_the_client_request(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    hooks = UpstreamHooks()
    # A huge XFetch beta: every fresh hit refreshes the entry in the background.
    proxy = await make_proxy(
        regions_config(region), cache={"xfetch_beta": 1e9}, plugins=(hooks,), upstream=UPSTREAM
    )
    cache = proxy.pipeline.cache
    body = {**BODY, "temperature": 0}
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=body) as resp:
            assert resp.headers["X-Edgeproxy-Cache"] == "MISS"
            await resp.read()
        await eventually(lambda: cache.stats.stores == 1, timeout=RELEASED_WITHIN)
        async with client.post(proxy.url + CHAT, json=body) as resp:
            assert resp.headers["X-Edgeproxy-Cache"] == "HIT"
            await resp.read()
    await eventually(lambda: cache.stats.stores == 2, timeout=RELEASED_WITHIN)
    assert cache.stats.refreshes == 1 and cache.stats.refresh_failures == 0
    hooks_of = {
        outcome: {(hook, has) for hook, has, o in hooks.seen if o == outcome}
        for outcome in ("MISS", "REFRESH")
    }
    every = {"route", "upstream_request", "upstream_response", "stream_chunk"}
    # The client's request went through every hook with its request; the refresh went
    # through the same ones (the same relay loop), with none: the handler had returned.
    assert hooks_of["MISS"] == {(hook, True) for hook in every}
    assert hooks_of["REFRESH"] == {(hook, False) for hook in every}
    await released(held(proxy, region), [region], cancelled=0)
