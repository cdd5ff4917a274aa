"""The HTTP/2 listener against clients that do not read and clients that leave.

A client that keeps its flow-control window shut (SETTINGS_INITIAL_WINDOW_SIZE = 0, no
WINDOW_UPDATE) holds a bounded buffer per stream and per connection; the proxy then stops
reading the region, as over HTTP/1.1; a stream whose client takes nothing for
``server.h2_send_stall_timeout`` is reset and counted. A connection the client closes or
resets gives its place under ``max_connections_per_ip`` back at once, not after
``keepalive_timeout``.

The clients are raw h2 connections; the region is an aiohttp app that streams a large SSE
answer and says how far it got (its writes wait while the proxy does not read)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
import uvloop
from aiohttp import web

from edgeproxy import Config, EdgeProxy
from edgeproxy._server.h2server import CONNECTION_BUFFER

from .conftest import CustomRegion, ProxyFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
BODY = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()
H2C = {"http2": True, "h2c": True}
EVENT_CONTENT = 64 * 1024
ANSWER = 4 * 1024 * 1024  # each stream's answer
STREAMS = 20


def _event(index: int) -> bytes:
    chunk = {
        "id": "chatcmpl-big",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "x" * EVENT_CONTENT}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@dataclass
class BigRegion:
    """What the region's answers did: started, written (bytes), finished, cancelled, and
    each answer's transport (to see whether its writes wait)."""

    url: str = ""
    started: int = 0
    written: int = 0
    finished: int = 0
    cancelled: int = 0
    transports: list[asyncio.BaseTransport] = field(default_factory=list)

    def waiting(self) -> int:
        """Answers whose writes wait: the proxy does not read them."""
        return sum(
            1
            for t in self.transports
            if not t.is_closing() and t.get_write_buffer_size() > 0  # type: ignore[attr-defined]
        )


@pytest.fixture
async def big_region(custom_region: CustomRegion) -> AsyncIterator[BigRegion]:
    yield await serve_big_region(custom_region)


async def serve_big_region(custom_region: CustomRegion, answer: int = ANSWER) -> BigRegion:
    """A region streaming ``answer`` bytes of SSE per request through a small send buffer."""
    region = BigRegion()

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        transport = request.transport
        assert transport is not None
        # A small send buffer: the proxy's reads, not the kernel's, decide how far it gets.
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        region.transports.append(transport)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        region.started += 1
        event = _event(0)
        try:
            for _ in range(answer // len(event) + 1):
                await resp.write(event)
                region.written += len(event)
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionError):
            region.cancelled += 1
            raise
        region.finished += 1
        return resp

    app = web.Application()
    app.router.add_post(CHAT, chat)
    region.url = await custom_region(app)
    return region


async def start_proxy(make_proxy: ProxyFactory, region: BigRegion, **server: Any) -> EdgeProxy:
    return await make_proxy(
        [{"name": "big", "url": region.url, "http2": False}],
        server={**H2C, **server},
        limits={"max_connections_per_ip": 20},
    )


class Client:
    """A raw HTTP/2 client (prior knowledge), with a receive window of ``window``."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, window: int
    ) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window}
        )
        self.heads: dict[int, int] = {}  # stream -> status
        self.bodies: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}  # stream -> error code
        self._reading: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, proxy: EdgeProxy, *, window: int = 65535) -> Client:
        host, port = proxy.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        client = cls(reader, writer, window)
        client.conn.initiate_connection()
        await client.flush()
        client._reading = asyncio.create_task(client._read())
        return client

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)
            await self.writer.drain()

    def request(self) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":path", CHAT),
            (":scheme", "http"),
            (":authority", "localhost"),
            ("content-type", "application/json"),
        ]
        self.conn.send_headers(stream_id, headers)
        self.conn.send_data(stream_id, BODY, end_stream=True)
        return stream_id

    async def _read(self) -> None:
        while data := await self.reader.read(65536):
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    self.heads[event.stream_id] = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    self.bodies[event.stream_id] = (
                        self.bodies.get(event.stream_id, b"") + event.data
                    )
                    self.conn.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
                elif isinstance(event, h2.events.StreamEnded):
                    self.ended.add(event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    self.resets[event.stream_id] = int(event.error_code or 0)
            await self.flush()

    async def close(self, *, reset: bool = False) -> None:
        if reset:
            # SO_LINGER 0: the close sends RST, not FIN.
            sock = self.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.writer.transport.abort()
        else:
            self.conn.close_connection()
            await self.flush()
            self.writer.close()
        if self._reading is not None:
            self._reading.cancel()
            await asyncio.gather(self._reading, return_exceptions=True)
        if not reset:
            await asyncio.gather(self.writer.wait_closed(), return_exceptions=True)


# -- a client that does not read ---------------------------------------------------


async def test_zero_window_streams_hold_a_bounded_buffer_and_push_back_on_the_region(
    big_region: BigRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await start_proxy(make_proxy, big_region)
    guard = proxy.guard
    client = await Client.open(proxy, window=0)
    streams = [client.request() for _ in range(STREAMS)]
    await client.flush()
    # Every answer started (its head came), then the region's writes wait: the proxy
    # stopped reading each of them.
    await eventually(lambda: len(client.heads) == STREAMS)
    await eventually(lambda: big_region.waiting() == STREAMS, timeout=20)
    assert set(client.heads.values()) == {200}
    assert big_region.started == STREAMS
    assert big_region.finished == 0
    # The listener holds a bounded part of the 80 MiB asked for: the connection's cap, and
    # what each stream may hold beyond it.
    bound = CONNECTION_BUFFER + STREAMS * 32 * 1024
    assert guard.h2_buffered_peak <= bound, guard.h2_buffered_peak
    assert guard.snapshot()["h2_buffered_bytes"] <= bound
    assert not client.bodies and not client.ended
    # The client leaves: its buffers are let go, the region's answers cancelled.
    await client.close()
    await eventually(lambda: guard.snapshot()["h2_buffered_bytes"] == 0)
    await eventually(lambda: big_region.cancelled == STREAMS)
    await eventually(lambda: guard.open == 0)
    assert big_region.finished == 0 and streams


async def test_a_stream_stalled_past_the_timeout_is_reset_and_counted(
    custom_region: CustomRegion, make_proxy: ProxyFactory
) -> None:
    # An answer larger than what the kernel may buffer between the region and the proxy
    # (a loopback socket's receive buffer grows to several MB): so the region is still
    # writing when the stream is reset, whatever the buffers grew to.
    big_region = await serve_big_region(custom_region, 64 * 1024 * 1024)
    proxy = await start_proxy(make_proxy, big_region, h2_send_stall_timeout=0.3)
    guard = proxy.guard
    client = await Client.open(proxy, window=0)
    streams = [client.request() for _ in range(2)]
    await client.flush()
    await eventually(lambda: set(client.resets) == set(streams))
    assert set(client.resets.values()) == {h2.errors.ErrorCodes.CANCEL}
    assert guard.snapshot()["h2_send_stalls"] == 2
    # Their requests were cancelled, and with them the region's answers.
    await eventually(lambda: big_region.cancelled == 2)
    await eventually(lambda: proxy.pipeline.in_flight == 0)
    assert guard.snapshot()["h2_buffered_bytes"] == 0
    assert big_region.finished == 0
    await client.close()


async def test_a_client_that_reads_gets_the_whole_answer(
    big_region: BigRegion, make_proxy: ProxyFactory
) -> None:
    """The bounds hold back a reader only as fast as it reads."""
    proxy = await start_proxy(make_proxy, big_region)
    client = await Client.open(proxy, window=1024 * 1024)
    stream = client.request()
    await client.flush()
    await eventually(lambda: stream in client.ended, timeout=30)
    body = client.bodies[stream]
    assert body.endswith(b"data: [DONE]\n\n") and len(body) > ANSWER
    assert big_region.finished == 1
    await client.close()
    await eventually(lambda: proxy.guard.snapshot()["h2_buffered_bytes"] == 0)


# -- clients that leave ------------------------------------------------------------


async def test_sequential_connections_do_not_keep_their_places(
    big_region: BigRegion, make_proxy: ProxyFactory
) -> None:
    """25 connections one after another (open, one request, GOAWAY and close, as curl
    --http2-prior-knowledge does) under max_connections_per_ip = 20: all served."""
    proxy = await start_proxy(make_proxy, big_region)
    for _ in range(25):
        client = await Client.open(proxy, window=16 * 1024 * 1024)
        stream = client.request()
        await client.flush()
        await eventually(lambda c=client, s=stream: s in c.ended or s in c.resets, timeout=30)
        assert client.heads[stream] == 200 and stream in client.ended
        await client.close()
    assert proxy.guard.snapshot()["connections_refused_per_ip"] == 0
    await eventually(lambda: proxy.guard.open == 0)


async def test_a_reset_connection_frees_its_place(
    big_region: BigRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await start_proxy(make_proxy, big_region)
    guard = proxy.guard
    # One idle (its answer done), one in the middle of answers it does not read.
    idle = await Client.open(proxy, window=16 * 1024 * 1024)
    stream = idle.request()
    await idle.flush()
    await eventually(lambda: stream in idle.ended, timeout=30)
    busy = await Client.open(proxy, window=0)
    for _ in range(3):
        busy.request()
    await busy.flush()
    await eventually(lambda: len(busy.heads) == 3)
    await eventually(lambda: guard.h2_buffered > 0)
    assert guard.open == 2
    await idle.close(reset=True)
    await busy.close(reset=True)
    await eventually(lambda: guard.open == 0)
    await eventually(lambda: guard.snapshot()["h2_buffered_bytes"] == 0)
    await eventually(lambda: big_region.cancelled == 3)
    # A full house of connections from the address, each reset: none keeps its place.
    clients = [await Client.open(proxy) for _ in range(20)]
    await eventually(lambda: guard.open == 20)
    for client in clients:
        await client.close(reset=True)
    await eventually(lambda: guard.open == 0)
    late = await Client.open(proxy, window=16 * 1024 * 1024)
    stream = late.request()
    await late.flush()
    await eventually(lambda: stream in late.ended, timeout=30)
    assert late.heads[stream] == 200
    await late.close()


def test_connections_left_free_their_places_on_uvloop() -> None:
    """The same on uvloop (what ``edgeproxy serve`` runs on), whose sockets close apart
    from asyncio's."""

    async def scenario() -> None:
        runners: list[web.AppRunner] = []

        async def custom_region(app: web.Application) -> str:
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            host, port = runner.addresses[0][:2]
            return f"http://{host}:{port}"

        proxies: list[EdgeProxy] = []

        async def make_proxy(regions: list[dict[str, Any]], **sections: Any) -> EdgeProxy:
            config = Config.from_mapping(proxy_config(regions, **sections), environ={})
            proxy = EdgeProxy(config)
            await proxy.start()
            proxies.append(proxy)
            return proxy

        try:
            region = await serve_big_region(custom_region)
            await test_sequential_connections_do_not_keep_their_places(region, make_proxy)
            region = await serve_big_region(custom_region)
            await test_a_reset_connection_frees_its_place(region, make_proxy)
        finally:
            for proxy in proxies:
                await proxy.stop()
            for runner in runners:
                await runner.cleanup()

    uvloop.run(scenario())
