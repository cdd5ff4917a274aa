"""WebSockets on the HTTP/2 listener (RFC 8441 extended CONNECT).

The listener runs on its own, with a stand-in for the pipeline: a ``websocket`` exchange
is accepted and echoed (``/echo``, ``/small`` with a small message bound), handed to the
test, which reads and sends itself (``/hold``), or refused with a 429 (``/refuse``); any
other request gets a JSON 200. The client is a raw h2 connection (prior knowledge)
framing RFC 6455 with wsproto on the stream's DATA."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
from aiohttp import web
from wsproto.events import (
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    TextMessage,
)

from edgeproxy._core.config import LimitsConfig
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.response import Response, StreamResponse
from edgeproxy._core.websocket import Accept, Closed, WebSocket
from edgeproxy._server.guard import ConnectionGuard
from edgeproxy._server.h2connection import H2Connection
from edgeproxy._server.h2flow import STREAM_BUFFER
from edgeproxy._server.h2server import H2Site

from ._h2ws import END, Client, extended_connect
from .conftest import eventually

ENABLE_CONNECT_PROTOCOL = h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL
SMALL = 1024


# -- the listener, with a stand-in for the pipeline ----------------------------------


@dataclass
class Session:
    exchange: Exchange
    ws: WebSocket
    closed: asyncio.Future[Closed]  # what an echo's receive() ended with
    released: asyncio.Future[None]  # a held session's end


@dataclass
class Stub:
    """What the pipeline would do with each exchange; the sessions it accepted."""

    is_open: bool = True
    sessions: asyncio.Queue[Session] = field(default_factory=asyncio.Queue)
    requests: list[Exchange] = field(default_factory=list)
    held: list[Session] = field(default_factory=list)

    def release(self) -> None:
        for session in self.held:
            if not session.released.done():
                session.released.set_result(None)

    async def serve_exchange(self, exchange: Exchange) -> StreamResponse:
        self.requests.append(exchange)
        if not exchange.websocket:
            return Response.json({"ok": True, "method": exchange.method})
        if exchange.path == "/refuse":
            error = {"error": {"type": "rate_limit_error", "message": "Too many sessions."}}
            return Response.json(error, status=429)
        offered = exchange.headers.get("sec-websocket-protocol")
        accept = Accept(
            subprotocol=offered.split(",")[0].strip() if offered else None,
            headers=(("x-edgeproxy-region", "r1"),),
            max_message=SMALL if exchange.path == "/small" else Accept().max_message,
        )
        ws = await exchange.accept(accept)
        loop = asyncio.get_running_loop()
        session = Session(exchange, ws, loop.create_future(), loop.create_future())
        self.sessions.put_nowait(session)
        if exchange.path == "/hold":
            self.held.append(session)
            await session.released
        else:
            while True:
                message = await ws.receive()
                if isinstance(message, Closed):
                    session.closed.set_result(message)
                    break
                await ws.send(message)
        await ws.close()
        return StreamResponse.sent_by(exchange, 200)


@dataclass
class Listener:
    stub: Stub
    site: H2Site
    port: int

    def connection(self) -> H2Connection:
        (conn,) = self.site.connections
        return conn


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    stub = Stub()
    runner = web.AppRunner(web.Application())
    await runner.setup()
    guard = ConnectionGuard(LimitsConfig())
    site = H2Site(runner, "127.0.0.1", 0, guard=guard, proxy=stub, send_stall_timeout=60.0)
    await site.start()
    server = site._server
    assert isinstance(server, asyncio.Server)
    port = server.sockets[0].getsockname()[1]
    yield Listener(stub, site, port)
    tasks = {task for conn in site.connections for task in conn.tasks}
    stub.release()
    site.close_connections()
    # The sessions end on their own: receive() says the connection went (1006).
    if tasks:
        await asyncio.wait(tasks, timeout=10)
    await runner.cleanup()


@pytest.fixture
async def client(listener: Listener) -> AsyncIterator[Client]:
    client = await Client.open(listener.port)
    yield client
    await client.close()


# -- the handshake -------------------------------------------------------------------


async def test_the_handshake_is_accepted_on_a_listener_that_advertises_it(
    listener: Listener, client: Client
) -> None:
    assert (await client.settings)[ENABLE_CONNECT_PROTOCOL] == 1
    stream_id, stream = await client.websocket(
        "/echo?model=m", (("sec-websocket-protocol", "realtime, other"),)
    )
    head = stream.head.result()
    assert head[b"sec-websocket-protocol"] == b"realtime"
    assert head[b"x-edgeproxy-region"] == b"r1"
    assert b"sec-websocket-extensions" not in head  # none offered
    session = await listener.stub.sessions.get()
    exchange = session.exchange
    assert exchange.websocket and exchange.method == "GET"
    assert exchange.target == "/echo?model=m" and exchange.path == "/echo"
    assert exchange.headers["sec-websocket-version"] == "13"
    assert exchange.headers["host"] == "localhost"
    assert ":protocol" not in exchange.headers
    assert session.ws.subprotocol == "realtime"


async def test_text_and_binary_messages_echo(client: Client) -> None:
    stream_id, stream = await client.websocket()
    await client.send(stream_id, TextMessage("héllo"))
    assert await client.message(stream) == "héllo"
    await client.send(stream_id, BytesMessage(b"\x00\x01\xff"))
    assert await client.message(stream) == b"\x00\x01\xff"
    # Larger than the stream's window: its window is given back as the message comes.
    big = bytes(range(256)) * 1024
    await client.send(stream_id, BytesMessage(big))
    assert await client.message(stream) == big


async def test_a_fragmented_message_is_reassembled(listener: Listener, client: Client) -> None:
    stream_id, stream = await client.websocket("/hold")
    session = await listener.stub.sessions.get()
    await client.send(stream_id, TextMessage("hel", message_finished=False))
    await client.send(stream_id, TextMessage("lo", message_finished=True))
    assert await session.ws.receive() == "hello"
    await client.send(stream_id, BytesMessage(b"ab", message_finished=False))
    await client.send(stream_id, Ping(b"between"))  # a control frame between fragments
    await client.send(stream_id, BytesMessage(b"cd", message_finished=False))
    await client.send(stream_id, BytesMessage(b"ef", message_finished=True))
    assert await session.ws.receive() == b"abcdef"
    assert await client.next(stream) == Pong(b"between")


async def test_pings_are_answered_both_ways(listener: Listener, client: Client) -> None:
    stream_id, stream = await client.websocket("/hold")
    session = await listener.stub.sessions.get()
    await client.send(stream_id, Ping(b"are you there"))
    assert await client.next(stream) == Pong(b"are you there")
    await session.ws.ping()
    event = await client.next(stream)
    assert isinstance(event, Ping)
    await client.send(stream_id, event.response())
    # The session goes on.
    await session.ws.send("still here")
    assert await client.message(stream) == "still here"


async def test_permessage_deflate_is_negotiated_when_offered(client: Client) -> None:
    offer = (("sec-websocket-extensions", "permessage-deflate; client_max_window_bits"),)
    stream_id, stream = await client.websocket("/echo", offer)
    agreed = stream.head.result()[b"sec-websocket-extensions"]
    assert agreed.startswith(b"permessage-deflate")
    text = "a compressible sentence. " * 8000
    await client.send(stream_id, TextMessage(text))
    assert await client.message(stream) == text


async def test_a_session_closed_by_the_client_gets_its_close_back(
    listener: Listener, client: Client
) -> None:
    stream_id, stream = await client.websocket()
    session = await listener.stub.sessions.get()
    await client.send(stream_id, CloseConnection(1000, "bye"))
    assert await client.next(stream) == CloseConnection(1000, "bye")
    assert await client.next(stream) == END
    assert await session.closed == Closed(1000, "bye")
    with pytest.raises(ConnectionResetError):
        await session.ws.send("too late")


async def test_a_session_closed_by_the_proxy_ends_its_stream(
    listener: Listener, client: Client
) -> None:
    stream_id, stream = await client.websocket("/hold")
    session = await listener.stub.sessions.get()
    await session.ws.close(1012, "reload")
    await session.ws.close(1000)  # once only
    assert await client.next(stream) == CloseConnection(1012, "reload")
    assert await client.next(stream) == END
    assert await session.ws.receive() == Closed(1012, "reload")


# -- bounds --------------------------------------------------------------------------


async def test_an_oversize_message_ends_the_session_with_1009(
    listener: Listener, client: Client
) -> None:
    stream_id, stream = await client.websocket("/small")
    session = await listener.stub.sessions.get()
    await client.send(stream_id, TextMessage("x" * SMALL))
    assert await client.message(stream) == "x" * SMALL  # at the bound: taken
    # Past it, even in fragments.
    await client.send(stream_id, BytesMessage(b"y" * 600, message_finished=False))
    await client.send(stream_id, BytesMessage(b"y" * 600, message_finished=True))
    close = await client.next(stream)
    assert isinstance(close, CloseConnection) and close.code == 1009
    assert await client.next(stream) == END
    closed = await session.closed
    assert closed.code == 1009


async def test_a_client_that_does_not_read_holds_the_send_within_a_bound(
    listener: Listener,
) -> None:
    """A client whose window stays shut: the session's send waits, the listener holds no
    more than the stream's buffer; once the client reads, every message arrives."""
    client = await Client.open(listener.port, window=0)
    try:
        stream_id, stream = await client.websocket("/hold")
        session = await listener.stub.sessions.get()
        ws = session.ws
        message = b"z" * (64 * 1024)
        count = 3 * STREAM_BUFFER // len(message)
        sent = 0

        async def sender() -> None:
            nonlocal sent
            for _ in range(count):
                await ws.send(message)
                sent += 1

        task = asyncio.create_task(sender())
        await eventually(lambda: ws.buffered() >= STREAM_BUFFER)
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done() and sent < count
        assert ws.buffered() <= STREAM_BUFFER
        assert listener.site.guard.h2_buffered_peak <= STREAM_BUFFER
        assert stream.events.empty()
        # The client reads: all of it comes.
        client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
        client.conn.increment_flow_control_window(1 << 24)
        client.flush()
        for _ in range(count):
            assert await client.message(stream) == message
        await task
        assert ws.buffered() == 0
    finally:
        await client.close()


async def test_a_session_idle_past_the_stall_timeout_is_not_reset(
    listener: Listener,
) -> None:
    client = await Client.open(listener.port, window=0)
    try:
        stream_id, stream = await client.websocket("/hold")
        session = await listener.stub.sessions.get()
        exchange: Any = session.exchange
        # As if the stream had sent nothing for far longer than the stall timeout.
        exchange.taken_at -= 10 * listener.site.send_stall_timeout
        task = asyncio.create_task(session.ws.send(b"w" * (2 * STREAM_BUFFER)))
        await eventually(lambda: session.ws.buffered() > 0)
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done()
        assert listener.site.guard.h2_send_stalls == 0
        assert not stream.reset.done()
        client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
        client.conn.increment_flow_control_window(1 << 24)
        client.flush()
        assert await client.message(stream) == b"w" * (2 * STREAM_BUFFER)
        await task
    finally:
        await client.close()


async def test_a_client_sending_faster_than_the_session_reads_is_pushed_back(
    listener: Listener, client: Client
) -> None:
    stream_id, stream = await client.websocket("/hold")
    session = await listener.stub.sessions.get()
    message = BytesMessage(b"q" * 4096)
    sending = asyncio.create_task(_send_many(client, stream_id, message, 64))
    # The session reads nothing: the client's window shuts after about one window.
    await eventually(lambda: client.conn.local_flow_control_window(stream_id) <= 0)
    assert not sending.done()
    for _ in range(64):
        assert await session.ws.receive() == b"q" * 4096
    await sending


async def _send_many(client: Client, stream_id: int, event: Event, count: int) -> None:
    for _ in range(count):
        await client.send(stream_id, event)


# -- refusal, resets, malformed requests ---------------------------------------------


async def test_a_refused_handshake_is_an_answer_on_its_stream(
    listener: Listener, client: Client
) -> None:
    stream = client.request(extended_connect("/refuse"))
    head = await stream.head
    assert head[b":status"] == b"429"
    assert await client.next(stream) == END
    body = json.loads(stream.body)
    assert body["error"]["type"] == "rate_limit_error"
    # The connection goes on.
    stream_id, ws_stream = await client.websocket()
    await client.send(stream_id, TextMessage("after"))
    assert await client.message(ws_stream) == "after"


async def test_a_client_reset_ends_the_session_with_1006(
    listener: Listener, client: Client
) -> None:
    stream_id, stream = await client.websocket("/hold")
    session = await listener.stub.sessions.get()
    client.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
    client.flush()
    assert await session.ws.receive() == Closed(1006, "the client reset the stream")
    with pytest.raises(ConnectionResetError):
        await session.ws.send("gone")
    # A session the client ends is no premature reset.
    assert listener.connection()._cost == 0


async def test_a_lost_connection_ends_the_session_with_1006(listener: Listener) -> None:
    client = await Client.open(listener.port)
    await client.websocket("/hold")
    session = await listener.stub.sessions.get()
    client.writer.transport.abort()
    closed = await session.ws.receive()
    assert isinstance(closed, Closed) and closed.code == 1006
    await client.close()


async def test_a_stream_ended_without_a_close_ends_the_session_with_1006(
    listener: Listener, client: Client
) -> None:
    stream_id, stream = await client.websocket()
    session = await listener.stub.sessions.get()
    await client.send(stream_id, TextMessage("last"), end=True)
    assert await client.message(stream) == "last"
    closed = await session.closed
    assert closed.code == 1006
    # The session's close still goes out on the half-closed stream.
    event = await client.next(stream)
    assert isinstance(event, CloseConnection) and event.code == 1000
    assert await client.next(stream) == END


@pytest.mark.parametrize(
    "fields",
    [
        # :protocol on a method other than CONNECT.
        [(":method", "GET"), (":protocol", "websocket"), (":scheme", "http"),
         (":path", "/echo"), (":authority", "localhost")],
        # An extended CONNECT without :path, :scheme or :authority.
        [(":method", "CONNECT"), (":protocol", "websocket"), (":scheme", "http"),
         (":authority", "localhost")],
        [(":method", "CONNECT"), (":protocol", "websocket"), (":path", "/echo"),
         (":authority", "localhost")],
        [(":method", "CONNECT"), (":protocol", "websocket"), (":scheme", "http"),
         (":path", "/echo")],
        [(":method", "CONNECT"), (":protocol", ""), (":scheme", "http"),
         (":path", "/echo"), (":authority", "localhost")],
    ],
)  # fmt: skip
async def test_a_malformed_extended_connect_is_a_stream_error(
    listener: Listener, client: Client, fields: list[tuple[str, str]]
) -> None:
    stream = client.request(fields)
    assert await stream.reset == h2.errors.ErrorCodes.PROTOCOL_ERROR
    assert listener.site.guard.h2_stream_errors == 1
    assert not listener.stub.requests
    # Only that stream: the connection serves the next.
    stream_id, ws_stream = await client.websocket()
    await client.send(stream_id, TextMessage("ok"))
    assert await client.message(ws_stream) == "ok"


async def test_an_extended_connect_that_ends_its_stream_is_a_stream_error(
    listener: Listener, client: Client
) -> None:
    stream = client.request(extended_connect(), end=True)
    assert await stream.reset == h2.errors.ErrorCodes.PROTOCOL_ERROR
    assert not listener.stub.requests


@pytest.mark.parametrize(
    "fields",
    [
        [(":method", "CONNECT"), (":authority", "example.com:443")],
        [(":method", "CONNECT"), (":protocol", "connect-udp"), (":scheme", "https"),
         (":path", "/.well-known/masque/udp/h/443/"), (":authority", "localhost")],
    ],
)  # fmt: skip
async def test_other_connects_keep_their_answer(
    listener: Listener, client: Client, fields: list[tuple[str, str]]
) -> None:
    stream = client.request(fields)
    head = await stream.head
    assert head[b":status"] == b"405"
    assert not listener.stub.requests


# -- streams side by side ------------------------------------------------------------


async def test_two_sessions_and_a_request_share_a_connection(
    listener: Listener, client: Client
) -> None:
    first_id, first = await client.websocket("/echo?n=1")
    second_id, second = await client.websocket("/echo?n=2")
    request = client.request(
        [(":method", "GET"), (":scheme", "http"), (":path", "/v1/models"),
         (":authority", "localhost")],
        end=True,
    )  # fmt: skip
    await client.send(first_id, TextMessage("one"))
    await client.send(second_id, BytesMessage(b"two"))
    head = await request.head
    assert head[b":status"] == b"200"
    assert await client.next(request) == END
    assert json.loads(request.body) == {"ok": True, "method": "GET"}
    assert await client.message(second) == b"two"
    assert await client.message(first) == "one"
    assert len(listener.connection().streams) == 2
    await client.send(first_id, CloseConnection(1000))
    assert await client.next(first) == CloseConnection(1000, "")
    assert await client.next(first) == END
    await client.send(second_id, TextMessage("still"))
    assert await client.message(second) == "still"
