"""In-flight caps, the priority queue, shedding and the degrade policy, through the real server.

The upstream here is a small aiohttp app whose ``/gate/...`` requests wait
on an event the test sets, so "the upstream is saturated" is a state the
test controls rather than a race against the clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from edgeproxy import EdgeProxy, Exchange, Response, hookimpl
from edgeproxy._admission.admission import AdmissionStage

from .conftest import ProxyFactory, eventually


@dataclass
class GatedUpstream:
    url: str
    gate: asyncio.Event
    served: list[str] = field(default_factory=list)
    headers: dict[str, CIMultiDict[str]] = field(default_factory=dict)


@pytest.fixture
async def upstream() -> AsyncIterator[GatedUpstream]:
    gate = asyncio.Event()
    state = GatedUpstream("", gate)

    async def handler(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        state.headers[name] = CIMultiDict(request.headers)
        if name.startswith("block"):
            await gate.wait()
        state.served.append(name)
        return web.json_response({"name": name})

    app = web.Application()
    app.router.add_route("*", "/gate/{name}", handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    state.url = f"http://{host}:{port}"
    yield state
    gate.set()
    await runner.cleanup()


def region(upstream: GatedUpstream) -> list[dict[str, Any]]:
    return [{"name": "g", "url": upstream.url, "http2": False}]


def admission(proxy: EdgeProxy) -> AdmissionStage:
    return proxy.pipeline.admission


async def fetch(
    client: aiohttp.ClientSession, proxy: EdgeProxy, name: str, priority: int | None = None
) -> tuple[int, CIMultiDict[str], Any]:
    headers = {} if priority is None else {"X-Priority": str(priority)}
    async with client.get(f"{proxy.url}/gate/{name}", headers=headers) as resp:
        return resp.status, CIMultiDict(resp.headers), await resp.json()


async def test_high_priority_is_served_first_and_low_priority_is_shed(
    upstream: GatedUpstream, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        region(upstream), admission={"max_in_flight": 1, "max_queue": 3, "max_queue_time": 30}
    )
    stage = admission(proxy)
    async with aiohttp.ClientSession() as client:
        blocker = asyncio.create_task(fetch(client, proxy, "block"))
        await eventually(lambda: stage.in_flight == 1)
        tasks: dict[str, asyncio.Task[Any]] = {}

        async def enqueue(name: str, priority: int, waiting: int) -> None:
            tasks[name] = asyncio.create_task(fetch(client, proxy, name, priority))
            await eventually(lambda: stage.waiting == waiting or tasks[name].done())

        await enqueue("low-1", 1, 1)
        await enqueue("low-2", 1, 2)
        await enqueue("low-3", 1, 3)
        # The queue is full: each high-priority newcomer pushes out the newest low one.
        await enqueue("high-1", 5, 3)
        await enqueue("high-2", 5, 3)
        # A low-priority newcomer cannot push out an equal: it is shed itself.
        await enqueue("low-4", 1, 3)
        for name in ("low-3", "low-2", "low-4"):
            status, headers, data = await tasks[name]
            assert status == 503, name
            assert int(headers["Retry-After"]) >= 1
            assert data["error"]["code"] in ("evicted", "queue_full")
        assert (await tasks["low-4"])[2]["error"]["code"] == "queue_full"
        assert (await tasks["low-3"])[2]["error"]["code"] == "evicted"
        upstream.gate.set()
        assert (await blocker)[0] == 200
        for name in ("high-1", "high-2", "low-1"):
            assert (await tasks[name])[0] == 200
    # One slot: the region saw them strictly in admission order.
    assert upstream.served == ["block", "high-1", "high-2", "low-1"]
    snapshot = proxy.status()["admission"]
    assert snapshot["shed"] == {"queue_full": 1, "queue_timeout": 0, "evicted": 2}
    assert snapshot["queued"] == 0 and snapshot["in_flight"] == 0


async def test_queue_timeout_is_503_with_retry_after(
    upstream: GatedUpstream, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        region(upstream), admission={"max_in_flight": 1, "max_queue_time": 0.3}
    )
    async with aiohttp.ClientSession() as client:
        blocker = asyncio.create_task(fetch(client, proxy, "block"))
        await eventually(lambda: admission(proxy).in_flight == 1)
        status, headers, data = await fetch(client, proxy, "waits")
        assert status == 503
        assert data["error"]["code"] == "queue_timeout"
        assert data["error"]["type"] == "overloaded"
        assert int(headers["Retry-After"]) >= 1
        assert headers["X-Request-Id"]
        upstream.gate.set()
        assert (await blocker)[0] == 200
    assert "waits" not in upstream.served
    assert proxy.status()["admission"]["shed"]["queue_timeout"] == 1


async def test_queue_wait_never_passes_the_route_deadline(
    upstream: GatedUpstream, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        region(upstream),
        admission={"max_in_flight": 1, "max_queue_time": 60},
        routes=[
            {"name": "slow", "path": "/gate/block", "deadline": 60},
            {"name": "tight", "path": "/gate", "deadline": 0.5},
        ],
    )
    async with aiohttp.ClientSession() as client:
        blocker = asyncio.create_task(fetch(client, proxy, "block"))
        await eventually(lambda: admission(proxy).in_flight == 1)
        # Still blocked: only the 0.5 s deadline can end this wait.
        status, _, data = await asyncio.wait_for(fetch(client, proxy, "tight"), 30)
        assert status == 503
        assert data["error"]["code"] == "queue_timeout"
        upstream.gate.set()
        assert (await blocker)[0] == 200


async def test_deadline_is_propagated_upstream(
    upstream: GatedUpstream, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        region(upstream),
        admission={"max_in_flight": 1},
        routes=[{"name": "r", "path": "/gate", "deadline": 20}],
    )
    async with aiohttp.ClientSession() as client:
        blocker = asyncio.create_task(fetch(client, proxy, "block"))
        await eventually(lambda: admission(proxy).in_flight == 1)
        queued = asyncio.create_task(fetch(client, proxy, "after-queue"))
        await eventually(lambda: admission(proxy).waiting == 1)
        await asyncio.sleep(0.2)  # time spent queued comes off the budget
        upstream.gate.set()
        assert (await blocker)[0] == 200
        assert (await queued)[0] == 200
        # A client's own value is replaced.
        async with client.get(
            proxy.url + "/gate/direct", headers={"X-Request-Timeout-Ms": "999999"}
        ) as resp:
            assert resp.status == 200
    waited = int(upstream.headers["after-queue"]["X-Request-Timeout-Ms"])
    assert 0 < waited < 20_000 - 150
    assert 0 < int(upstream.headers["direct"]["X-Request-Timeout-Ms"]) <= 20_000


async def test_per_route_cap_leaves_other_routes_alone(
    upstream: GatedUpstream, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        region(upstream),
        routes=[{"name": "blocky", "path": "/gate/block", "max_in_flight": 1}],
    )
    stage = admission(proxy)
    async with aiohttp.ClientSession() as client:
        first = asyncio.create_task(fetch(client, proxy, "block"))
        await eventually(lambda: stage.in_flight == 1)
        second = asyncio.create_task(fetch(client, proxy, "block"))
        await eventually(lambda: stage.waiting == 1)
        # Another route has no cap: served at once while "blocky" is full.
        for i in range(3):
            assert (await fetch(client, proxy, f"free-{i}"))[0] == 200
        assert proxy.status()["admission"]["routes"]["blocky"] == {"in_flight": 1, "queued": 1}
        upstream.gate.set()
        assert (await first)[0] == 200 and (await second)[0] == 200
    assert upstream.served[:3] == ["free-0", "free-1", "free-2"]


async def test_global_and_route_caps_combine(
    upstream: GatedUpstream, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        region(upstream),
        admission={"max_in_flight": 2, "max_queue_time": 30},
        routes=[{"name": "blocky", "path": "/gate/block", "max_in_flight": 1}],
    )
    stage = admission(proxy)
    async with aiohttp.ClientSession() as client:
        a = asyncio.create_task(fetch(client, proxy, "block"))
        await eventually(lambda: stage.in_flight == 1)
        b = asyncio.create_task(fetch(client, proxy, "block"))  # route full: waits
        await eventually(lambda: stage.waiting == 1)
        # The global cap still has room for another route, ahead of the waiting one.
        c = asyncio.create_task(fetch(client, proxy, "blocking-elsewhere"))
        await eventually(lambda: stage.in_flight == 2)
        assert stage.waiting == 1
        # Now both caps are full: the default route waits too.
        d = asyncio.create_task(fetch(client, proxy, "free"))
        await eventually(lambda: stage.waiting == 2)
        upstream.gate.set()
        results = [await t for t in (a, b, c, d)]
    assert [r[0] for r in results] == [200, 200, 200, 200]


async def test_overload_on_a_degrade_route_takes_the_fallback_ladder(
    upstream: GatedUpstream, make_proxy: ProxyFactory
) -> None:
    reasons: list[str] = []

    class Degrade:
        @hookimpl
        def edgeproxy_fallback(self, ctx: Any, reason: str) -> Response:
            reasons.append(reason)
            return Response.json({"degraded": True, "route": ctx.route.name})

    proxy = await make_proxy(
        region(upstream),
        admission={"max_in_flight": 1, "max_queue": 0},
        routes=[
            {"name": "soft", "path": "/gate/soft", "on_overload": "degrade"},
            {"name": "hard", "path": "/gate/hard"},
        ],
        plugins=[Degrade()],
    )
    async with aiohttp.ClientSession() as client:
        blocker = asyncio.create_task(fetch(client, proxy, "block"))
        await eventually(lambda: admission(proxy).in_flight == 1)
        status, headers, data = await fetch(client, proxy, "soft")
        assert status == 200
        assert data == {"degraded": True, "route": "soft"}
        assert headers["X-Edgeproxy-Degraded"] == "plugin"
        # A "shed" route answers 503 itself.
        status, headers, data = await fetch(client, proxy, "hard")
        assert status == 503 and data["error"]["code"] == "queue_full"
        upstream.gate.set()
        assert (await blocker)[0] == 200
    assert reasons == ["overloaded"]
    assert "soft" not in upstream.served


async def test_client_leaving_the_queue_frees_its_place(
    upstream: GatedUpstream, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        region(upstream), admission={"max_in_flight": 1, "max_queue": 1, "max_queue_time": 30}
    )
    stage = admission(proxy)
    async with aiohttp.ClientSession() as client:
        blocker = asyncio.create_task(fetch(client, proxy, "block"))
        await eventually(lambda: stage.in_flight == 1)
        leaver = asyncio.create_task(fetch(client, proxy, "leaver"))
        await eventually(lambda: stage.waiting == 1)
        leaver.cancel()
        await eventually(lambda: stage.waiting == 0)
        # Its place is free for the next one.
        stayer = asyncio.create_task(fetch(client, proxy, "stayer"))
        await eventually(lambda: stage.waiting == 1)
        upstream.gate.set()
        assert (await blocker)[0] == 200
        assert (await stayer)[0] == 200
    assert "leaver" not in upstream.served
    await eventually(lambda: stage.in_flight == 0)


# The aiohttp listener, and the HTTP/2 listener's HTTP/1.1 side.
LISTENERS: dict[str, dict[str, Any]] = {"aiohttp": {}, "http2": {"http2": True, "h2c": True}}


async def raw_get(proxy: EdgeProxy, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw HTTP/1.1 connection that has sent ``GET /gate/<name>``."""
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /gate/{name} HTTP/1.1\r\nHost: proxy.test\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


async def after_fin(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """Half-close (shutdown(SHUT_WR)), then all the proxy sends up to its own close, less
    the interim 100 the aiohttp listener probes a half-closed client with."""
    writer.write_eof()
    try:
        sent = await asyncio.wait_for(reader.read(), 10.0)
    finally:
        writer.close()
    return sent.removeprefix(_CONTINUE)


def half_closed(request: Exchange) -> bool:
    """Whether the listener has seen the client's FIN (its private state, either listener)."""
    native = request.native
    if isinstance(native, web.Request):
        return bool(getattr(native.protocol, "_half_closed", False))
    assert isinstance(native, dict)
    connection = getattr(native["extensions"]["edgeproxy.queued"], "__self__", None)
    return bool(getattr(connection, "_half_closed", False))


class QueueAfterTheFin:
    """Holds ``/gate/late`` until its client's FIN reached the listener, then lets it queue."""

    @hookimpl
    async def edgeproxy_request_received(self, request: Exchange, ctx: Any) -> None:
        if ctx.path.endswith("/late"):
            await eventually(lambda: half_closed(request))


@pytest.mark.parametrize("server", LISTENERS.values(), ids=LISTENERS.keys())
async def test_a_half_closed_client_gives_up_its_queue_place_not_its_slot(
    upstream: GatedUpstream, make_proxy: ProxyFactory, server: dict[str, Any]
) -> None:
    # half_close = "answer" (the default), and a long keep-alive timeout: every close here is
    # the FIN's.
    proxy = await make_proxy(
        region(upstream),
        admission={"max_in_flight": 1, "max_queue": 2, "max_queue_time": 30},
        server=server,
        limits={"keepalive_timeout": 60.0},
        plugins=[QueueAfterTheFin()],
    )
    stage = admission(proxy)
    # Holding the slot when its FIN comes: still answered.
    blocker = await raw_get(proxy, "block")
    await eventually(lambda: stage.in_flight == 1)
    blocker_answer = asyncio.create_task(after_fin(*blocker))
    # Waiting in the queue when its FIN comes (a client that closed looks the same): its
    # place goes, and nothing is answered.
    assert await after_fin(*await raw_get(proxy, "waiter")) == b""
    await eventually(lambda: stage.waiting == 0)
    # Its FIN came before it queued: it does not queue for long either.
    assert await after_fin(*await raw_get(proxy, "late")) == b""
    await eventually(lambda: stage.waiting == 0 and stage.queued_total == 2)
    upstream.gate.set()
    answer = await blocker_answer
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"name": "block"}'), answer
    async with aiohttp.ClientSession() as client:
        assert (await fetch(client, proxy, "next"))[0] == 200
    assert upstream.served == ["block", "next"]
    await eventually(lambda: stage.in_flight == 0 and proxy.guard.open == 0)


@pytest.mark.parametrize("server", LISTENERS.values(), ids=LISTENERS.keys())
async def test_with_half_close_abort_a_half_closed_client_gives_up_its_slot(
    upstream: GatedUpstream, make_proxy: ProxyFactory, server: dict[str, Any]
) -> None:
    proxy = await make_proxy(
        region(upstream),
        admission={"max_in_flight": 1, "max_queue": 2, "max_queue_time": 30},
        server=server,
        limits={"half_close": "abort", "keepalive_timeout": 60.0},
    )
    stage = admission(proxy)
    # Its FIN is its leaving: its upstream request is cancelled, its slot freed.
    blocker = await raw_get(proxy, "block")
    await eventually(lambda: stage.in_flight == 1)
    waiter = await raw_get(proxy, "block-2")
    await eventually(lambda: stage.waiting == 1)
    assert await after_fin(*blocker) == b""
    # The waiter gets the slot; its FIN in turn frees it.
    await eventually(lambda: stage.in_flight == 1 and stage.waiting == 0)
    assert await after_fin(*waiter) == b""
    await eventually(lambda: stage.in_flight == 0)
    upstream.gate.set()
    async with aiohttp.ClientSession() as client:
        assert (await fetch(client, proxy, "next"))[0] == 200
    await eventually(lambda: proxy.guard.open == 0)


async def test_priority_from_a_plugin_wins_over_the_header(
    upstream: GatedUpstream, make_proxy: ProxyFactory
) -> None:
    class Vip:
        @hookimpl
        def edgeproxy_request_received(self, ctx: Any) -> None:
            if ctx.path.endswith("vip"):
                ctx.priority = 100

    proxy = await make_proxy(
        region(upstream), admission={"max_in_flight": 1, "max_queue_time": 30}, plugins=[Vip()]
    )
    stage = admission(proxy)
    async with aiohttp.ClientSession() as client:
        blocker = asyncio.create_task(fetch(client, proxy, "block"))
        await eventually(lambda: stage.in_flight == 1)
        loud = asyncio.create_task(fetch(client, proxy, "loud", priority=50))
        await eventually(lambda: stage.waiting == 1)
        vip = asyncio.create_task(fetch(client, proxy, "vip", priority=-5))
        await eventually(lambda: stage.waiting == 2)
        upstream.gate.set()
        for task in (blocker, loud, vip):
            assert (await task)[0] == 200
    assert upstream.served == ["block", "vip", "loud"]


async def test_no_caps_means_no_queue(upstream: GatedUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(region(upstream))
    upstream.gate.set()
    async with aiohttp.ClientSession() as client:
        results = await asyncio.gather(*(fetch(client, proxy, f"n{i}") for i in range(10)))
    assert all(r[0] == 200 for r in results)
    snapshot = proxy.status()["admission"]
    assert snapshot["admitted_total"] == 10 and snapshot["queued_total"] == 0
