"""The ASGI front end's WebSockets, under real ASGI servers (hypercorn, and uvicorn with
each of its WebSocket implementations), driven by aiohttp's client.

The pipeline is a stub here: it accepts and echoes on one path, refuses on others and
does nothing on one, so that what is tested is the front end's side of the contract
(:mod:`edgeproxy._server.asgiws`): the handshake accepted or refused, the session's
messages, its limits and its close."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import os
import socket
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from starlette.applications import Starlette
from starlette.routing import Mount

from edgeproxy._core.config import LimitsConfig
from edgeproxy._core.errors import error_response
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.response import StreamResponse
from edgeproxy._core.websocket import Accept, Closed
from edgeproxy._server.asgi import AsgiApp
from edgeproxy._server.asgiws import close_reason, refusal_code

from .test_asgi import served

MAX_MESSAGE = 1024
REFUSAL = "too many sessions from this address"


class StubProxy:
    """What :class:`AsgiApp` needs of a proxy, with a pipeline that accepts and echoes on
    ``/echo``, refuses on ``/refuse`` (a whole JSON answer) and ``/refuse-streamed`` (one
    written piece by piece), answers nothing on ``/nothing``, fails on ``/boom`` and waits
    on ``/hold``."""

    def __init__(self, *, stays_closed: bool = False) -> None:
        self.config = SimpleNamespace(limits=LimitsConfig())
        self.guard = None
        self.is_open = False
        self.ever_opened = stays_closed
        self.stays_closed = stays_closed
        self.exchanges: list[Exchange] = []
        self.ended: list[Closed] = []
        self.after_end: list[BaseException] = []
        self.session_over = asyncio.Event()
        self.holding = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None

    async def open(self) -> None:
        self.ever_opened = True
        self.is_open = not self.stays_closed

    async def close(self) -> None:
        self.is_open = False

    async def serve_exchange(self, exchange: Exchange) -> StreamResponse:
        self.exchanges.append(exchange)
        self.task = asyncio.current_task()
        path = exchange.path
        if path == "/echo":
            await self._echo(exchange)
            return StreamResponse()
        if path == "/refuse":
            return error_response(429, "rate_limit_error", REFUSAL, code="too_many_sessions")
        if path == "/refuse-streamed":
            answer = StreamResponse(status=503, content_type="application/json")
            await answer.prepare(exchange)
            await answer.write(b'{"error": {"message": "no region can take')
            await answer.write_eof(b' a session now", "type": "overloaded"}}')
            return answer
        if path == "/hold":
            self.holding.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if path == "/boom":
            raise RuntimeError("a pipeline that fails")
        return StreamResponse()  # "/nothing": neither accepted nor answered

    async def _echo(self, exchange: Exchange) -> None:
        offered = exchange.native["subprotocols"]
        ws = await exchange.accept(
            Accept(
                subprotocol="b" if "b" in offered else None,
                headers=(("X-Edgeproxy-Region", "ap-1"),),
                max_message=MAX_MESSAGE,
            )
        )
        try:
            while True:
                message = await ws.receive()
                if isinstance(message, Closed):
                    self.ended.append(message)
                    break
                if message == "close, please":
                    await ws.close(4000, "as asked")
                    self.ended.append(Closed(4000, "as asked"))
                    break
                await ws.send(message)
            # The session is over on this side: receive says so again, send refuses.
            assert await ws.receive() == self.ended[-1]
            try:
                await ws.send("late")
            except ConnectionResetError as exc:
                self.after_end.append(exc)
        finally:
            self.session_over.set()


def without_denial(app: Any) -> Any:
    """``app`` behind a server that offers no ``websocket.http.response`` extension."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            extensions = dict(scope.get("extensions") or {})
            extensions.pop("websocket.http.response", None)
            scope = {**scope, "extensions": extensions}
        await app(scope, receive, send)

    return wrapped


@contextlib.asynccontextmanager
async def hypercorn_served(app: Any) -> AsyncIterator[str]:
    config = HypercornConfig()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    # Hypercorn adopts the descriptor; detached, only it closes it.
    config.bind = [f"fd://{sock.detach()}"]
    config.graceful_timeout = 0.5
    config.accesslog = None
    config.errorlog = None
    stop = asyncio.Event()
    task = asyncio.create_task(serve(app, config, shutdown_trigger=stop.wait))
    try:
        yield f"ws://127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def uvicorn_served(ws: str) -> Callable[[Any], contextlib.AbstractAsyncContextManager[str]]:
    return functools.partial(served, ws=ws, scheme="ws")


SERVERS = {
    "hypercorn": hypercorn_served,
    # uvicorn's "auto" choice when the websockets package is installed.
    "uvicorn-websockets": uvicorn_served("websockets-sansio"),
    "uvicorn-wsproto": uvicorn_served("wsproto"),
}


@pytest.fixture(params=list(SERVERS))
def server(request: pytest.FixtureRequest) -> Any:
    return SERVERS[request.param]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def closed_with(ws: aiohttp.ClientWebSocketResponse) -> tuple[int, str]:
    """The close frame the client got: its code and reason."""
    message = await ws.receive()
    assert message.type is aiohttp.WSMsgType.CLOSE, message
    return int(message.data), message.extra or ""


async def test_echo_text_and_binary_with_the_subprotocol_chosen(
    server: Any, session: aiohttp.ClientSession
) -> None:
    proxy = StubProxy()
    answers: list[aiohttp.ClientResponse] = []

    async def on_end(_: Any, __: Any, params: aiohttp.TraceRequestEndParams) -> None:
        answers.append(params.response)

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(on_end)
    host = Starlette(routes=[Mount("/llm", app=AsgiApp(proxy))])
    async with (
        server(host) as base,
        aiohttp.ClientSession(trace_configs=[trace]) as traced,
        traced.ws_connect(f"{base}/llm/echo?model=m", protocols=("a", "b")) as ws,
    ):
        assert ws.protocol == "b"
        assert answers[0].headers["X-Edgeproxy-Region"] == "ap-1"
        await ws.send_str("hello, région")
        assert await ws.receive_str() == "hello, région"
        payload = os.urandom(MAX_MESSAGE)
        await ws.send_bytes(payload)
        assert await ws.receive_bytes() == payload
        await ws.send_str("close, please")
        assert await closed_with(ws) == (4000, "as asked")
    await proxy.session_over.wait()
    (exchange,) = proxy.exchanges
    assert exchange.websocket
    assert (exchange.method, exchange.target, exchange.path) == ("GET", "/echo?model=m", "/echo")
    assert [p.strip() for p in exchange.headers["Sec-WebSocket-Protocol"].split(",")] == ["a", "b"]
    assert exchange.scheme == "http" and exchange.tls is None
    assert not exchange.body_exists and await exchange.read() == b""
    assert len(proxy.after_end) == 1


async def test_client_close_ends_the_session(server: Any, session: aiohttp.ClientSession) -> None:
    proxy = StubProxy()
    async with server(AsgiApp(proxy)) as base:
        ws = await session.ws_connect(f"{base}/echo")
        await ws.send_str("ping")
        assert await ws.receive_str() == "ping"
        await ws.close(code=4001, message=b"done")
        await proxy.session_over.wait()
    (ended,) = proxy.ended
    assert isinstance(ended, Closed)
    # What the server reports of the client's close frame is its own affair (hypercorn
    # reports an abnormal end however the client closed).
    assert ended.code in (4001, 1006)
    assert proxy.exchanges[0].client_gone()
    assert len(proxy.after_end) == 1


@pytest.mark.parametrize("kind", ["text", "binary"])
async def test_a_message_past_the_limit_closes_1009(
    server: Any, session: aiohttp.ClientSession, kind: str
) -> None:
    proxy = StubProxy()
    async with (
        server(AsgiApp(proxy)) as base,
        session.ws_connect(f"{base}/echo") as ws,
    ):
        if kind == "text":
            # Fewer characters than the limit, more bytes of UTF-8.
            await ws.send_str("é" * (MAX_MESSAGE // 2 + 1))
        else:
            await ws.send_bytes(b"x" * (MAX_MESSAGE + 1))
        code, _ = await closed_with(ws)
        assert code == 1009
        await proxy.session_over.wait()
    assert [c.code for c in proxy.ended] == [1009]
    assert len(proxy.after_end) == 1


@pytest.mark.parametrize("denial", [True, False], ids=["http-answer", "close-fallback"])
async def test_refused_handshake(server: Any, session: aiohttp.ClientSession, denial: bool) -> None:
    proxy = StubProxy()
    app = AsgiApp(proxy)
    async with server(app if denial else without_denial(app)) as base:
        if denial:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(f"{base}/refuse")
            assert refused.value.status == 429
            # The same refusal read as a plain answer to a handshake: its JSON body.
            status, body = await handshake_answer(session, f"{base}/refuse")
            assert status == 429
            assert body["error"]["message"] == REFUSAL
            assert body["error"]["code"] == "too_many_sessions"
            status, body = await handshake_answer(session, f"{base}/refuse-streamed")
            assert status == 503
            assert body["error"]["message"] == "no region can take a session now"
        else:
            async with session.ws_connect(f"{base}/refuse", protocols=("realtime",)) as ws:
                assert await closed_with(ws) == (1013, REFUSAL)
            async with session.ws_connect(f"{base}/refuse-streamed") as ws:
                assert await closed_with(ws) == (1013, "no region can take a session now")


@pytest.mark.parametrize("path", ["/nothing", "/boom"])
@pytest.mark.parametrize("denial", [True, False], ids=["http-answer", "close-fallback"])
async def test_neither_accepted_nor_answered_closes_1011(
    server: Any, session: aiohttp.ClientSession, denial: bool, path: str
) -> None:
    app = AsgiApp(StubProxy())
    async with (
        server(app if denial else without_denial(app)) as base,
        session.ws_connect(f"{base}{path}") as ws,
    ):
        code, _ = await closed_with(ws)
        assert code == 1011


@pytest.mark.parametrize("path", ["/hold", "/echo"], ids=["handshake", "session"])
async def test_a_request_cut_at_shutdown_closes_1001(
    server: Any, session: aiohttp.ClientSession, path: str
) -> None:
    proxy = StubProxy()
    async with (
        server(AsgiApp(proxy)) as base,
        session.ws_connect(f"{base}{path}") if path == "/echo" else _pending() as ws,
    ):
        if ws is None:
            connecting = asyncio.create_task(session.ws_connect(f"{base}{path}"))
            await proxy.holding.wait()
        else:
            await ws.send_str("ping")
            assert await ws.receive_str() == "ping"
        assert proxy.task is not None
        # As a generation cuts the requests that outlast its drain.
        proxy.task.cancel()
        if ws is None:
            ws = await connecting
        code, _ = await closed_with(ws)
        assert code == 1001
        await ws.close()


@contextlib.asynccontextmanager
async def _pending() -> AsyncIterator[None]:
    yield None


@pytest.mark.parametrize("denial", [True, False], ids=["http-answer", "close-fallback"])
async def test_a_proxy_not_open_refuses_503(
    server: Any, session: aiohttp.ClientSession, denial: bool
) -> None:
    app = AsgiApp(StubProxy(stays_closed=True))
    async with server(app if denial else without_denial(app)) as base:
        if denial:
            status, body = await handshake_answer(session, f"{base}/echo")
            assert status == 503
            assert body["error"]["code"] == "not_open"
        else:
            async with session.ws_connect(f"{base}/echo") as ws:
                code, reason = await closed_with(ws)
                assert code == 1013
                assert reason.startswith("the proxy is not open")
                assert len(reason.encode()) <= 123


async def test_client_leaving_before_the_accept_cancels_the_pipeline(
    server: Any, session: aiohttp.ClientSession
) -> None:
    proxy = StubProxy()
    async with server(AsgiApp(proxy)) as base:
        connecting = asyncio.create_task(session.ws_connect(f"{base}/hold"))
        await proxy.holding.wait()
        connecting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await connecting
        await proxy.cancelled.wait()
    assert proxy.exchanges[0].client_gone()


async def handshake_answer(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    """A WebSocket handshake sent as a plain request, for the refusal's status and body."""
    headers = {
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(),
    }
    async with session.get(url.replace("ws://", "http://", 1), headers=headers) as resp:
        return resp.status, await resp.json()


def test_close_codes_and_reasons() -> None:
    assert [refusal_code(s) for s in (429, 503, 400, 401, 403, 404, 500, 502)] == [
        1013,
        1013,
        1008,
        1008,
        1008,
        1008,
        1011,
        1011,
    ]
    anthropic = b'{"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}'
    assert close_reason(529, anthropic) == "busy"
    assert close_reason(404, b'{"message": "no such route"}') == "no such route"
    assert close_reason(502, b"<html>bad gateway</html>") == "Bad Gateway"
    assert close_reason(599, b"") == "HTTP 599"
    long = close_reason(429, b'{"error": {"message": "' + "é".encode() * 100 + b'"}}')
    assert long == "é" * 61 and len(long.encode()) == 122
