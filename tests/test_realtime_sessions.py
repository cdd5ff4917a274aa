"""WebSocket sessions through the aiohttp listener, against regions whose handshakes fail
in the ways a fake region of the test kit cannot: refused with any status, never
answered, and regions that hold sessions open for the drain, the caps and the memory
measure. The Realtime API driven by the official SDK is tests/test_realtime.py.
"""

from __future__ import annotations

import asyncio
import gc
import json
import resource
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict

from edgeproxy import EdgeProxy, Response, hookimpl
from edgeproxy._core.config import Config
from edgeproxy._core.context import start_context
from edgeproxy._core.outcome import SessionTotals
from edgeproxy._observability.access_log import record
from edgeproxy._protocol.headers import request_ids

from .conftest import ProxyFactory, eventually


class WsRegion:
    """A region of one aiohttp server: its handshake refused with ``refuse`` (a status),
    held for ``hold`` seconds, or accepted; an accepted session greets with
    ``session.created``, answers ``response.create`` with a response and echoes the rest."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.refuse: int | None = None
        self.hold: asyncio.Event | None = None
        self.handshakes = 0
        self.flooded = 0
        self.open = 0
        self.seen: list[str] = []
        self.headers: list[CIMultiDict[str]] = []
        self.release_done = asyncio.Event()
        self.release_done.set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.handshakes += 1
        self.headers.append(CIMultiDict(request.headers))
        if self.hold is not None:
            await self.hold.wait()
        if self.refuse is not None:
            return web.json_response(
                {"error": {"message": "no"}}, status=self.refuse, headers={"Retry-After": "3"}
            )
        ws = web.WebSocketResponse(protocols=("realtime",))
        await ws.prepare(request)
        self.open += 1
        try:
            await ws.send_str(
                json.dumps(
                    {
                        "type": "session.created",
                        "session": {
                            "id": f"sess_{self.name}_{self.handshakes}",
                            "model": request.query.get("model"),
                        },
                    }
                )
            )
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    continue
                self.seen.append(msg.data)
                try:
                    kind = json.loads(msg.data).get("type")
                except ValueError:
                    kind = None
                if kind == "flood":
                    # Deltas as fast as the proxy takes them, counted as they go.
                    chunk = "A" * 65536
                    while True:
                        await ws.send_str(chunk)
                        self.flooded += len(chunk)
                if kind == "response.create":
                    await ws.send_str(json.dumps({"type": "response.created"}))
                    await ws.send_str(
                        json.dumps({"type": "response.output_text.delta", "delta": "hi"})
                    )
                    await self.release_done.wait()
                    await ws.send_str(
                        json.dumps(
                            {
                                "type": "response.done",
                                "response": {
                                    "usage": {
                                        "total_tokens": 7,
                                        "input_tokens": 3,
                                        "output_tokens": 4,
                                    }
                                },
                            }
                        )
                    )
                else:
                    await ws.send_str(msg.data)
        finally:
            self.open -= 1
        return ws


RegionMaker = Callable[[str], Awaitable[WsRegion]]


@pytest.fixture
async def ws_region() -> AsyncIterator[RegionMaker]:
    made: list[WsRegion] = []

    async def make(name: str) -> WsRegion:
        region = WsRegion(name)
        await region.start()
        made.append(region)
        return region

    yield make
    for region in made:
        if region.hold is not None:
            region.hold.set()
        region.release_done.set()
        await region.stop()


# The PoP is in Singapore: the first region is nearest, each next one farther.
_PLACES = [{"lat": 1.3, "lon": 103.8}, {"lat": 35.68, "lon": 139.69}, {"lat": 50.11, "lon": 8.68}]


def tables(*regions: WsRegion) -> list[dict[str, Any]]:
    """The regions in rank order, nearest first."""
    return [
        {"name": r.name, "url": r.url, "serves_any_model": True, "http2": False, **place}
        for r, place in zip(regions, _PLACES, strict=False)
    ]


async def open_session(
    http: aiohttp.ClientSession, proxy: EdgeProxy, path: str = "/v1/realtime?model=m", **kw: Any
) -> aiohttp.ClientWebSocketResponse:
    return await http.ws_connect(proxy.url + path, protocols=("realtime",), **kw)


async def refusal(http: aiohttp.ClientSession, proxy: EdgeProxy, path: str) -> tuple[int, Any]:
    with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
        await open_session(http, proxy, path)
    # The JSON error itself, as a plain GET with the same headers reads it.
    headers = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    }
    async with http.get(proxy.url + path, headers=headers) as response:
        return caught.value.status, (response.status, await response.json())


async def test_a_region_refusing_the_handshake_is_failed_over(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    bad, good = await ws_region("bad"), await ws_region("good")
    bad.refuse = 503
    proxy = await make_proxy(tables(bad, good))
    async with aiohttp.ClientSession() as http:
        ws = await open_session(http, proxy)
        assert ws.protocol == "realtime"
        assert ws._response.headers["x-edgeproxy-region"] == "good"
        created = json.loads(await ws.receive_str())
        assert created["type"] == "session.created"
        await ws.close()
    assert bad.handshakes == 1 and good.handshakes == 1
    # The client's handshake fields are the proxy's; the region got its own.
    assert good.headers[0]["Sec-WebSocket-Key"] != ""
    status = proxy.status()["websocket"]
    assert status["failovers_total"] == 1 and status["opened_total"] == 1


async def test_a_handshake_no_region_answers_in_time_fails_over(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    slow, good = await ws_region("slow"), await ws_region("good")
    slow.hold = asyncio.Event()
    proxy = await make_proxy(tables(slow, good), websocket={"connect_timeout": 0.2})
    async with aiohttp.ClientSession() as http:
        ws = await open_session(http, proxy)
        assert ws._response.headers["x-edgeproxy-region"] == "good"
        await ws.close()


async def test_refusals_before_the_upgrade_are_json_errors(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    only = await ws_region("only")
    only.refuse = 401
    proxy = await make_proxy(tables(only))
    async with aiohttp.ClientSession() as http:
        status, (again, body) = await refusal(http, proxy, "/v1/realtime?model=m")
    # The region's 401 is the client's own: not failed over, not held against the region.
    assert status == again == 401
    assert body["error"]["code"] == "websocket_refused"
    assert proxy.regions.by_name["only"].health.consecutive_failures == 0


async def test_every_region_refusing_is_a_502_with_retry_after(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    a, b = await ws_region("a"), await ws_region("b")
    a.refuse = b.refuse = 503
    proxy = await make_proxy(tables(a, b))
    async with aiohttp.ClientSession() as http:
        status, (again, body) = await refusal(http, proxy, "/v1/realtime?model=m")
        with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
            await open_session(http, proxy)
    assert status == 502 and body["error"]["code"] == "upstream_unavailable"
    assert caught.value.headers is not None and caught.value.headers.get("Retry-After") == "3"


async def test_an_unknown_model_is_refused_with_the_models_404(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    region = await ws_region("r")
    proxy = await make_proxy(
        [{"name": "r", "url": region.url, "models": ["gpt-rt"], "http2": False}]
    )
    async with aiohttp.ClientSession() as http:
        status, (_, body) = await refusal(http, proxy, "/v1/realtime?model=other")
        ws = await open_session(http, proxy, "/v1/realtime?model=gpt-rt")
        await ws.close()
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert region.handshakes == 1


async def test_a_hook_refuses_a_handshake_and_sees_its_end_with_usage(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    region = await ws_region("r")
    ended: list[Any] = []

    class Gate:
        @hookimpl
        def edgeproxy_request_received(self, request: Any, ctx: Any) -> Response | None:
            if request.websocket and "Authorization" not in ctx.headers:
                return Response.json({"error": {"message": "who are you"}}, status=401)
            return None

        @hookimpl
        def edgeproxy_response_complete(self, request: Any, ctx: Any) -> None:
            if request.websocket:
                ended.append((ctx.status, ctx.usage, ctx.outcome.session))

    proxy = await make_proxy(tables(region), plugins=[Gate()])
    async with aiohttp.ClientSession() as http:
        status, _ = await refusal(http, proxy, "/v1/realtime?model=m")
        assert status == 401
        ws = await open_session(http, proxy, headers={"Authorization": "Bearer k"})
        await ws.receive_str()
        await ws.send_str(json.dumps({"type": "response.create"}))
        kinds = [json.loads(await ws.receive_str())["type"] for _ in range(3)]
        assert kinds == ["response.created", "response.output_text.delta", "response.done"]
        await ws.close()
    await eventually(lambda: any(status == 101 for status, _, _ in ended))
    (status, usage, session) = next(e for e in ended if e[0] == 101)
    assert usage["total_tokens"] == 7 and usage["prompt_tokens"] == 3
    assert session.responses == 1 and session.ended_by == "client"
    # As for any request, the client's credentials stay at the edge (regions get their own).
    assert "Authorization" not in region.headers[0]


async def test_a_client_address_past_its_cap_gets_429(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    region = await ws_region("r")
    proxy = await make_proxy(tables(region), websocket={"max_sessions_per_ip": 2})
    async with aiohttp.ClientSession() as http:
        held = [await open_session(http, proxy) for _ in range(2)]
        status, (again, body) = await refusal(http, proxy, "/v1/realtime?model=m")
        await held[0].close()
        await eventually(lambda: proxy.status()["websocket"]["open"] == 1)
        after = await open_session(http, proxy)
        for ws in (*held, after):
            await ws.close()
    assert status == again == 429 and body["error"]["code"] == "too_many_sessions"
    assert proxy.status()["websocket"]["refused"]["per_ip"] == 2


async def test_a_tenant_past_its_cap_gets_429_while_others_are_served(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    region = await ws_region("r")

    class Tenant:
        @hookimpl
        def edgeproxy_request_received(self, request: Any, ctx: Any) -> None:
            ctx.tenant = ctx.headers.get("x-tenant")

    proxy = await make_proxy(
        tables(region), plugins=[Tenant()], websocket={"max_sessions_per_tenant": 1}
    )
    async with aiohttp.ClientSession() as http:
        first = await open_session(http, proxy, headers={"x-tenant": "acme"})
        with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
            await open_session(http, proxy, headers={"x-tenant": "acme"})
        other = await open_session(http, proxy, headers={"x-tenant": "globex"})
        await first.close()
        await other.close()
    assert caught.value.status == 429
    assert proxy.status()["websocket"]["refused"] == {"per_tenant": 1}


async def test_a_drain_lets_the_response_under_way_finish_then_closes_with_1001(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    region = await ws_region("r")
    region.release_done.clear()
    proxy = await make_proxy(tables(region))
    async with aiohttp.ClientSession() as http:
        ws = await open_session(http, proxy)
        await ws.receive_str()
        await ws.send_str(json.dumps({"type": "response.create"}))
        await ws.receive_str()
        await ws.receive_str()  # a delta: the response is under way
        stopping = asyncio.create_task(proxy.stop(grace=30.0))
        await eventually(lambda: proxy.draining)
        region.release_done.set()
        done = json.loads(await ws.receive_str())
        closing = json.loads(await ws.receive_str())
        close = await ws.receive()
        await stopping
    assert done["type"] == "response.done"
    assert closing["error"]["code"] == "session_closing"
    assert close.type is aiohttp.WSMsgType.CLOSE and close.data == 1001


async def test_a_client_that_never_reads_holds_the_proxy_to_its_buffer_bound(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    region = await ws_region("r")
    buffer = 256 * 1024
    proxy = await make_proxy(tables(region), websocket={"buffer": buffer})
    reader = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=reader) as http:
        ws = await open_session(http, proxy)
        await ws.receive_str()
        # The client's socket stops being read from here on.
        transport = ws._response.connection.transport  # type: ignore[union-attr]
        assert transport is not None
        transport.pause_reading()
        await ws.send_str(json.dumps({"type": "flood"}))
        (relay,) = proxy.pipeline.sessions._open
        # However long the region pushes, what the proxy holds toward the client stays
        # within its bound (one message over it at most), and the region is stopped.
        last = -1
        for _ in range(50):
            await eventually(lambda: region.flooded > 0)
            held = relay.client.buffered()
            assert held <= buffer + 65536 + 1024, held
            if region.flooded == last:
                break
            last = region.flooded
            await asyncio.sleep(0.05)
        assert region.flooded < 64 * 1024 * 1024
        transport.resume_reading()
        await ws.close()
    # The region, flooding still, never answers the proxy's close: it is cut loose.
    await eventually(lambda: proxy.status()["websocket"]["open"] == 0)


async def test_a_reload_closes_open_sessions_with_1012_and_takes_new_ones(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    region = await ws_region("r")
    proxy = await make_proxy(tables(region))
    async with aiohttp.ClientSession() as http:
        ws = await open_session(http, proxy)
        await ws.receive_str()
        await proxy.reload(proxy.config.model_copy(deep=True))
        closing = json.loads(await ws.receive_str())
        close = await ws.receive()
        fresh = await open_session(http, proxy)
        assert json.loads(await fresh.receive_str())["type"] == "session.created"
        await fresh.close()
    assert closing["error"]["code"] == "session_closing"
    assert close.data == 1012


async def test_routes_say_which_handshakes_become_sessions(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    region = await ws_region("r")
    proxy = await make_proxy(
        tables(region),
        routes=[
            {"name": "ws", "path": "/ws", "websocket": "any"},
            {"name": "closed", "path": "/v1/closed", "websocket": "off"},
        ],
    )
    async with aiohttp.ClientSession() as http:
        plain = await http.ws_connect(proxy.url + "/ws/echo")
        assert json.loads(await plain.receive_str())["type"] == "session.created"
        await plain.send_str("anything at all")
        assert await plain.receive_str() == "anything at all"
        await plain.close()
        # Not a Realtime path on a "realtime" route: a plain request, which the region
        # answers as it does a GET without the upgrade.
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await http.ws_connect(proxy.url + "/v1/chat")
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await http.ws_connect(proxy.url + "/v1/closed/realtime")


async def test_a_session_joining_a_call_goes_to_the_region_holding_it(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    a, b = await ws_region("a"), await ws_region("b")
    proxy = await make_proxy(tables(a, b))
    async with aiohttp.ClientSession() as http:
        # The session a region makes is its own: a session joining it goes there.
        proxy.pipeline.owners.remember("rtc_b", "b", "pub")  # an anonymous client's
        ws = await open_session(http, proxy, "/v1/realtime?call_id=rtc_b&model=m")
        assert ws._response.headers["x-edgeproxy-region"] == "b"
        await ws.close()
        status, (_, body) = await refusal_of_stranger(http, proxy)
    assert status == 404 and body["error"]["code"] == "call_not_found"


async def refusal_of_stranger(http: aiohttp.ClientSession, proxy: EdgeProxy) -> tuple[int, Any]:
    proxy.pipeline.owners.remember("rtc_x", "a", "tsomeone-else")
    return await refusal(http, proxy, "/v1/realtime?call_id=rtc_x&model=m")


async def test_a_thousand_idle_sessions_and_their_memory(
    ws_region: RegionMaker, make_proxy: ProxyFactory
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 5000:
        pytest.skip(f"1,000 sessions need ~4,000 descriptors; the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < 5000:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(8192, hard), hard))
    region = await ws_region("r")
    proxy = await make_proxy(tables(region), websocket={"max_sessions_per_ip": 0})
    sessions = 1000
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        # Warm up, so that what is measured is what a session adds.
        warm = [await open_session(http, proxy) for _ in range(20)]
        for ws in warm:
            await ws.receive_str()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            opened: list[aiohttp.ClientWebSocketResponse] = []
            for _ in range(sessions // 100):
                more = await asyncio.gather(*(open_session(http, proxy) for _i in range(100)))
                opened.extend(more)
            for ws in opened:
                await ws.receive_str()
            await eventually(lambda: proxy.status()["websocket"]["open"] == sessions + 20)
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        proxy_bytes = sum(
            stat.size_diff
            for stat in after.compare_to(before, "filename")
            if "/edgeproxy/" in stat.traceback[0].filename
        )
        every_byte = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        per_session = proxy_bytes / sessions
        print(
            f"\n{sessions} idle sessions: {per_session / 1024:.1f} KiB per session allocated by "
            f"edgeproxy's modules; {every_byte / sessions / 1024:.1f} KiB by everything in this "
            "process (clients, aiohttp on three sides, the region)"
        )
        # The relay's own state is a few objects and three tasks per session.
        assert per_session < 64 * 1024
        await asyncio.gather(*(ws.close() for ws in (*warm, *opened)))
    await eventually(lambda: proxy.status()["websocket"]["open"] == 0)


def test_a_sessions_access_log_line() -> None:
    rid, trace = request_ids(None, None)
    config = Config.from_mapping(
        {"regions": [{"name": "r", "url": "http://127.0.0.1:1"}]}, environ={}
    )
    ctx = start_context(
        rid,
        trace,
        "GET",
        "/v1/realtime?model=m",
        CIMultiDict(),
        "1.2.3.4",
        0.0,
        config.route_for("GET", "/v1/realtime"),
        "http",
        "1.1",
        "h",
    )
    ctx.outcome.status = 101
    ctx.outcome.usage = {"total_tokens": 3}
    ctx.outcome.session = SessionTotals(
        messages_in=2,
        messages_out=5,
        bytes_in=10,
        responses=1,
        close_code=1000,
        ended_by="client",
    )
    line = record(None, ctx)  # type: ignore[arg-type]
    assert line["status"] == 101 and line["path"] == "/v1/realtime"
    assert line["websocket"]["messages_out"] == 5 and line["websocket"]["ended_by"] == "client"
    assert orjson.dumps(line)
