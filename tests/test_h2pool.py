"""Tests for :class:`edgeproxy._upstream.h2pool.H2Pool` against real HTTP/2 servers.

Three servers are used:

* hypercorn serving a small ASGI app defined here (h2c prior knowledge, TLS);
* a raw ``h2`` server defined here, for behaviour hypercorn cannot produce on
  demand (GOAWAY that drains properly, REFUSED_STREAM, 1xx, unanswered PING,
  a peer that never opens its flow-control window);
* nginx, when installed (``@pytest.mark.nginx``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qs

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hyperframe.frame
import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config

from edgeproxy._http2 import engine, fields
from edgeproxy._upstream import h2conn
from edgeproxy._upstream.h2clientengine import ClientEngine
from edgeproxy._upstream.h2pool import H2Pool
from edgeproxy._upstream.pool import (
    PoolLimits,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from edgeproxy.testing import HostileRegion

from ._h2stubs import StubPool, Wire
from .conftest import stop_process

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MiB = 1024 * 1024


# --------------------------------------------------------------------------
# ASGI app served by hypercorn


@dataclass
class AppState:
    """What the ASGI app saw, plus knobs the tests turn."""

    connections: set[tuple[str, int]] = field(default_factory=set)
    active: Counter[tuple[str, int]] = field(default_factory=Counter)
    peak_per_connection: int = 0
    requests: int = 0
    disconnects: int = 0
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    last_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    gates: defaultdict[int, asyncio.Event] = field(
        default_factory=lambda: defaultdict(asyncio.Event)
    )
    bytes_sent: int = 0


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(parts)


async def _disconnected_within(receive: Receive, delay: float) -> bool:
    # Hypercorn keeps running an app whose stream was reset; returning on
    # http.disconnect lets the server shut down without cancelling us.
    watcher = asyncio.ensure_future(receive())
    try:
        done, _ = await asyncio.wait([watcher], timeout=delay)
        return bool(done)
    finally:
        watcher.cancel()


def make_app(state: AppState) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert scope["type"] == "http"
        client = tuple(scope["client"])
        state.connections.add(client)
        state.active[client] += 1
        state.peak_per_connection = max(state.peak_per_connection, state.active[client])
        state.requests += 1
        state.last_headers = list(scope["headers"])
        try:
            await _handle(scope, receive, send, state)
        finally:
            state.active[client] -= 1

    return app


async def _start(send: Send, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None):
    await send({"type": "http.response.start", "status": status, "headers": headers or []})


async def _handle(scope: Scope, receive: Receive, send: Send, state: AppState) -> None:
    path = scope["path"]
    query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
    if path == "/hello":
        await _read_body(receive)
        delay = float(query.get("delay", "0"))
        if delay and await _disconnected_within(receive, delay):
            return
        await _start(send, headers=[(b"x-reply", b"Yes")])
        await send({"type": "http.response.body", "body": b"hello"})
    elif path == "/echo":
        body = await _read_body(receive)
        digest = hashlib.sha256(body).hexdigest().encode()
        await _start(send, headers=[(b"x-sha256", digest), (b"x-length", str(len(body)).encode())])
        view = memoryview(body)
        for offset in range(0, len(body), 256 * 1024):
            chunk = bytes(view[offset : offset + 256 * 1024])
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/gated":
        # Chunk i+1 is only sent once the test has received chunk i, so a
        # client that buffered or coalesced would deadlock.
        await _read_body(receive)
        await _start(send)
        count = int(query["n"])
        for index in range(count):
            await send({"type": "http.response.body", "body": b"c%d" % index, "more_body": True})
            if index + 1 < count:
                await state.gates[index].wait()
        await send({"type": "http.response.body", "body": b""})
    elif path == "/infinite":
        await _read_body(receive)
        await _start(send)
        watcher = asyncio.ensure_future(receive())
        try:
            while not watcher.done():
                await send({"type": "http.response.body", "body": b"x" * 1024, "more_body": True})
                await asyncio.sleep(0.005)
        finally:
            if watcher.done() and watcher.result()["type"] == "http.disconnect":
                state.disconnects += 1
                state.disconnected.set()
            watcher.cancel()
    elif path == "/stall":
        await _read_body(receive)
        await _start(send)
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await receive()  # returns on disconnect
    elif path == "/big":
        await _read_body(receive)
        size = int(query["size"])
        chunk = b"b" * (64 * 1024)
        await _start(send)
        sent = 0
        while sent < size:
            piece = chunk[: size - sent]
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            sent += len(piece)
            state.bytes_sent = sent
        await send({"type": "http.response.body", "body": b""})
    else:
        await _start(send, 404)
        await send({"type": "http.response.body", "body": b"not found"})


def _listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    return sock


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def hypercorn_server(
    state: AppState | None = None, **options: Any
) -> AsyncIterator[tuple[str, AppState]]:
    state = state or AppState()
    config = Config()
    sock = _listening_socket()
    port = sock.getsockname()[1]
    # Hypercorn adopts the descriptor; detaching means only it closes it.
    config.bind = [f"fd://{sock.detach()}"]
    config.graceful_timeout = 0.5
    config.accesslog = None
    config.errorlog = None
    for key, value in options.items():
        setattr(config, key, value)
    scheme = "https" if config.ssl_enabled else "http"
    stop = asyncio.Event()
    task = asyncio.create_task(serve(make_app(state), config, shutdown_trigger=stop.wait))
    try:
        yield f"{scheme}://127.0.0.1:{port}", state
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def limits(**overrides: Any) -> PoolLimits:
    base: dict[str, Any] = {
        "max_connections": 4,
        "connect_timeout": 2.0,
        "read_timeout": 10.0,
        "write_timeout": 10.0,
        "pool_timeout": 10.0,
        "warm_connections": 1,
        "ping_interval": 30.0,
        "keepalive_expiry": 30.0,
    }
    base.update(overrides)
    return PoolLimits(**base)


@contextlib.asynccontextmanager
async def open_pool(origin: str, pool_limits: PoolLimits, **kwargs: Any) -> AsyncIterator[H2Pool]:
    pool = H2Pool(origin, pool_limits, **kwargs)
    try:
        yield pool
    finally:
        await pool.aclose()


async def fetch(
    pool: H2Pool, target: str, method: str = "GET", body: Any = None, **kw: Any
) -> tuple[int, bytes]:
    resp = await pool.request(method, target, [], body, **kw)
    try:
        data = b"".join([chunk async for chunk in resp.aiter_bytes()])
    finally:
        await resp.aclose()
    return resp.status, data


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------
# hypercorn-based tests


async def test_get_and_post_round_trip() -> None:
    async with hypercorn_server() as (origin, state), open_pool(origin, limits()) as pool:
        await pool.start()
        resp = await pool.request(
            "GET",
            "/hello",
            [("Accept", "text/plain"), ("Connection", "keep-alive"), ("Keep-Alive", "5")],
        )
        assert resp.status == 200
        assert resp.http_version == "2"
        assert ("x-reply", "Yes") in resp.headers
        assert all(not name.startswith(":") for name, _ in resp.headers)
        assert [c async for c in resp.aiter_bytes()] == [b"hello"]
        await resp.aclose()
        names = [name for name, _ in state.last_headers]
        assert b"accept" in names
        assert b"connection" not in names and b"keep-alive" not in names

        payload = os.urandom(10_000)
        status, data = await fetch(pool, "/echo", "POST", payload)
        assert status == 200 and data == payload

        stats = pool.stats()
        assert stats.requests_total == 2
        assert stats.streams_in_use == 0
        assert stats.http_version == "2"


async def test_authority_and_async_iterable_body() -> None:
    async def body() -> AsyncIterator[bytes]:
        for part in (b"ab", b"", b"cd"):
            await asyncio.sleep(0)
            yield part

    async with hypercorn_server() as (origin, state), open_pool(origin, limits()) as pool:
        resp = await pool.request("POST", "/echo", [], body(), authority="api.example:8443")
        data = b"".join([c async for c in resp.aiter_bytes()])
        await resp.aclose()
        assert data == b"abcd"
        assert (b"host", b"api.example:8443") in state.last_headers


async def test_streaming_chunks_arrive_separately() -> None:
    async with hypercorn_server() as (origin, state), open_pool(origin, limits()) as pool:
        resp = await pool.request("GET", "/gated?n=4", [])
        chunks = []
        async for chunk in resp.aiter_bytes():
            chunks.append(chunk)
            state.gates[len(chunks) - 1].set()
        await resp.aclose()
        assert chunks == [b"c0", b"c1", b"c2", b"c3"]


async def test_many_concurrent_requests_share_few_connections() -> None:
    async with (
        hypercorn_server() as (origin, state),
        open_pool(origin, limits(max_connections=4)) as pool,
    ):
        await pool.start()
        results = await asyncio.gather(*(fetch(pool, "/hello?delay=0.05") for _ in range(200)))
        assert all(result == (200, b"hello") for result in results)
        assert len(state.connections) <= 4
        assert pool.stats().connections_open <= 4
        assert pool.stats().streams_in_use == 0


async def test_peer_max_concurrent_streams_respected() -> None:
    async with (
        hypercorn_server(h2_max_concurrent_streams=4) as (origin, state),
        open_pool(origin, limits(max_connections=3)) as pool,
    ):
        results = await asyncio.gather(*(fetch(pool, "/hello?delay=0.02") for _ in range(50)))
        assert all(result == (200, b"hello") for result in results)
        assert state.peak_per_connection <= 4
        assert len(state.connections) <= 3


async def test_pool_timeout_when_all_streams_busy() -> None:
    async with (
        hypercorn_server(h2_max_concurrent_streams=1) as (origin, _),
        open_pool(origin, limits(max_connections=1, pool_timeout=0.2)) as pool,
    ):
        slow = asyncio.create_task(fetch(pool, "/hello?delay=1"))
        await wait_until(lambda: pool.stats().streams_in_use == 1)
        with pytest.raises(UpstreamTimeout) as info:
            await pool.request("GET", "/hello", [])
        assert info.value.phase == "pool" and info.value.retryable
        assert await slow == (200, b"hello")


async def test_waiters_are_served_in_arrival_order() -> None:
    # One stream in total: every request after the first queues. Freed slots
    # go to the oldest waiter, and a request arriving meanwhile queues behind.
    async with (
        hypercorn_server(h2_max_concurrent_streams=1) as (origin, _),
        open_pool(origin, limits(max_connections=1)) as pool,
    ):
        held = await pool.request("GET", "/stall", [])
        order: list[str] = []

        async def tagged(tag: str) -> None:
            assert await fetch(pool, "/hello") == (200, b"hello")
            order.append(tag)

        tasks = []
        for index, tag in enumerate("BCD"):
            tasks.append(asyncio.create_task(tagged(tag)))
            await wait_until(lambda n=index + 1: len(pool._waiters) == n)
        await held.aclose()
        tasks.append(asyncio.create_task(tagged("E")))
        await asyncio.gather(*tasks)
        assert order == ["B", "C", "D", "E"]


async def test_aclose_mid_body_resets_stream_and_frees_slot() -> None:
    async with hypercorn_server() as (origin, state), open_pool(origin, limits()) as pool:
        resp = await pool.request("GET", "/infinite", [])
        body = resp.aiter_bytes()
        await anext(body)
        await anext(body)
        assert pool.stats().streams_in_use == 1
        await resp.aclose()
        assert pool.stats().streams_in_use == 0
        await resp.aclose()  # idempotent
        await body.aclose()
        await asyncio.wait_for(state.disconnected.wait(), 5)
        # The connection is still good for more requests.
        assert await fetch(pool, "/hello") == (200, b"hello")


async def test_cancelling_body_reader_resets_stream() -> None:
    async with hypercorn_server() as (origin, state), open_pool(origin, limits()) as pool:
        got_data = asyncio.Event()

        async def consume() -> None:
            resp = await pool.request("GET", "/infinite", [])
            async for _ in resp.aiter_bytes():
                got_data.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got_data.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.stats().streams_in_use == 0
        await asyncio.wait_for(state.disconnected.wait(), 5)


async def test_cancelling_request_before_headers_resets_stream() -> None:
    async with hypercorn_server() as (origin, _), open_pool(origin, limits()) as pool:
        task = asyncio.create_task(pool.request("GET", "/hello?delay=5", []))
        await wait_until(lambda: pool.stats().streams_in_use == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.stats().streams_in_use == 0


async def test_dropped_response_releases_its_stream() -> None:
    async with hypercorn_server() as (origin, state), open_pool(origin, limits()) as pool:
        resp = await pool.request("GET", "/infinite", [])
        assert pool.stats().streams_in_use == 1
        del resp
        assert pool.stats().streams_in_use == 0
        await asyncio.wait_for(state.disconnected.wait(), 5)


async def test_read_timeout_waiting_for_headers() -> None:
    async with (
        hypercorn_server() as (origin, _),
        open_pool(origin, limits(read_timeout=0.2)) as pool,
    ):
        with pytest.raises(UpstreamTimeout) as info:
            await pool.request("GET", "/hello?delay=3", [])
        assert info.value.phase == "read" and not info.value.retryable
        assert pool.stats().streams_in_use == 0


async def test_read_timeout_between_body_chunks() -> None:
    async with (
        hypercorn_server() as (origin, _),
        open_pool(origin, limits(read_timeout=0.2)) as pool,
    ):
        resp = await pool.request("GET", "/stall", [])
        chunks = []
        with pytest.raises(UpstreamTimeout) as info:
            async for chunk in resp.aiter_bytes():
                chunks.append(chunk)
        assert chunks == [b"first"]
        assert info.value.phase == "read"
        assert pool.stats().streams_in_use == 0
        await resp.aclose()


async def test_large_bodies_both_directions() -> None:
    payload = os.urandom(6 * MiB)
    async with hypercorn_server() as (origin, _), open_pool(origin, limits()) as pool:
        headers = [("content-type", "application/octet-stream")]
        resp = await pool.request("POST", "/echo", headers, payload)
        assert dict(resp.headers)["x-sha256"] == hashlib.sha256(payload).hexdigest()
        received = bytearray()
        async for chunk in resp.aiter_bytes():
            received += chunk
        await resp.aclose()
        assert bytes(received) == payload

        status, data = await fetch(pool, f"/big?size={8 * MiB}")
        assert status == 200 and len(data) == 8 * MiB


async def test_connect_refused() -> None:
    port = _free_port()
    async with open_pool(f"http://127.0.0.1:{port}", limits()) as pool:
        with pytest.raises(UpstreamConnectError) as info:
            await pool.start()
        assert info.value.retryable
        with pytest.raises(UpstreamConnectError):
            await pool.request("GET", "/", [])
        assert pool.stats().connections_open == 0


async def test_connect_timeout_when_peer_never_sends_settings() -> None:
    sock = _listening_socket()  # accepts at the TCP level, never speaks HTTP/2
    try:
        port = sock.getsockname()[1]
        async with open_pool(f"http://127.0.0.1:{port}", limits(connect_timeout=0.2)) as pool:
            with pytest.raises(UpstreamTimeout) as info:
                await pool.start()
            assert info.value.phase == "connect"
    finally:
        sock.close()


async def test_idle_connections_expire_down_to_warm() -> None:
    async with (
        hypercorn_server(h2_max_concurrent_streams=1) as (origin, _),
        open_pool(
            origin, limits(max_connections=3, warm_connections=1, keepalive_expiry=0.2)
        ) as pool,
    ):
        await pool.start()
        await asyncio.gather(*(fetch(pool, "/hello?delay=0.1") for _ in range(3)))
        assert pool.stats().connections_open == 3
        await wait_until(lambda: pool.stats().connections_open == 1)
        assert await fetch(pool, "/hello") == (200, b"hello")


async def test_pool_aclose_fails_inflight_and_is_idempotent() -> None:
    async with hypercorn_server() as (origin, _):
        pool = H2Pool(origin, limits())
        task = asyncio.create_task(pool.request("GET", "/hello?delay=5", []))
        await wait_until(lambda: pool.stats().streams_in_use == 1)
        await pool.aclose()
        with pytest.raises(UpstreamProtocolError):
            await task
        await pool.aclose()
        assert pool.stats().connections_open == 0
        with pytest.raises(UpstreamError):
            await pool.request("GET", "/hello", [])


# --------------------------------------------------------------------------
# TLS


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl CLI not available to make a self-signed certificate")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", key, "-out", cert, "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_tls_with_alpn(tls_cert: tuple[str, str]) -> None:
    cert, key = tls_cert
    context = ssl.create_default_context(cafile=cert)
    context.set_alpn_protocols(["h2"])
    async with (
        hypercorn_server(certfile=cert, keyfile=key) as (origin, _),
        open_pool(origin, limits(), ssl_context=context) as pool,
    ):
        assert origin.startswith("https://")
        await pool.start()
        assert await fetch(pool, "/hello") == (200, b"hello")


async def test_tls_without_h2_alpn_fails_clearly(tls_cert: tuple[str, str]) -> None:
    cert, key = tls_cert
    context = ssl.create_default_context(cafile=cert)
    context.set_alpn_protocols(["h2"])
    async with (
        hypercorn_server(certfile=cert, keyfile=key, alpn_protocols=["http/1.1"]) as (origin, _),
        open_pool(origin, limits(), ssl_context=context) as pool,
    ):
        with pytest.raises(UpstreamConnectError, match="ALPN"):
            await pool.start()


async def test_tls_default_context_verifies_certificate(tls_cert: tuple[str, str]) -> None:
    cert, key = tls_cert
    async with (
        hypercorn_server(certfile=cert, keyfile=key) as (origin, _),
        open_pool(origin, limits()) as pool,
    ):
        with pytest.raises(UpstreamConnectError):
            await pool.start()


# --------------------------------------------------------------------------
# A raw h2 server for GOAWAY, REFUSED_STREAM, 1xx, PING and flow control


@dataclass
class RawServerState:
    goaway_after: int | None = None  # GOAWAY after this many streams per connection
    refuse_first: int = 0  # RST_STREAM(REFUSED_STREAM) the first N streams overall
    connections: int = 0
    requests: int = 0
    refused: int = 0
    unanswered: int = 0
    bytes_sent: int = 0
    protocols: list[RawH2Protocol] = field(default_factory=list)


class RawH2Protocol(asyncio.Protocol):
    def __init__(self, state: RawServerState) -> None:
        self.state = state
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        self.transport: asyncio.Transport | None = None
        self.frozen = False  # stop reading: PINGs go unanswered
        self.accepted = 0
        self.goaway_sent = False
        self.pending: set[int] = set()
        self.paths: dict[int, bytes] = {}
        self.big: dict[int, int] = {}  # stream id -> bytes still to send
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self.state.connections += 1
        self.state.protocols.append(self)
        self.conn.initiate_connection()
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.frozen:
            assert self.transport is not None
            self.transport.pause_reading()
            return
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.on_request(event.stream_id, dict(event.headers))
            elif isinstance(event, h2.events.DataReceived):
                if self.paths.get(event.stream_id) != b"/noack":
                    self.conn.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
            elif isinstance(event, h2.events.StreamEnded):
                if event.stream_id in self.pending:
                    self.loop.call_later(0.005, self.respond, event.stream_id)
            elif isinstance(event, h2.events.WindowUpdated):
                self.pump()
            elif isinstance(event, h2.events.StreamReset):
                self.big.pop(event.stream_id, None)
        self.flush()

    def pump(self) -> None:
        """Send /big bodies exactly as fast as the client's windows allow."""
        for stream_id, remaining in list(self.big.items()):
            while remaining:
                window = self.conn.local_flow_control_window(stream_id)
                size = min(window, self.conn.max_outbound_frame_size, remaining)
                if size <= 0:
                    break
                remaining -= size
                self.conn.send_data(stream_id, b"r" * size, end_stream=not remaining)
                self.state.bytes_sent += size
            if remaining:
                self.big[stream_id] = remaining
            else:
                del self.big[stream_id]
        self.flush()

    def on_request(self, stream_id: int, headers: dict[bytes, bytes]) -> None:
        self.state.requests += 1
        self.paths[stream_id] = headers[b":path"]
        if self.goaway_sent:
            self.state.unanswered += 1  # above last_stream_id: ignored, as nginx does
            return
        if self.state.refuse_first > self.state.refused:
            self.state.refused += 1
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        self.accepted += 1
        self.pending.add(stream_id)
        limit = self.state.goaway_after
        if limit is not None and self.accepted >= limit:
            # Written by hand: h2's close_connection() would stop us from
            # answering the streams we still promise to finish.
            self.flush()
            frame = hyperframe.frame.GoAwayFrame(0, last_stream_id=stream_id, error_code=0)
            assert self.transport is not None
            self.transport.write(frame.serialize())
            self.goaway_sent = True

    def respond(self, stream_id: int) -> None:
        if self.transport is None:
            return
        path = self.paths[stream_id]
        if path.startswith(b"/big"):
            self.conn.send_headers(stream_id, [(b":status", b"200")])
            self.big[stream_id] = int(path.partition(b"=")[2])
            self.pending.discard(stream_id)
            self.pump()
            return
        if path == b"/early":
            self.conn.send_headers(stream_id, [(b":status", b"103"), (b"link", b"</a>")])
        self.conn.send_headers(stream_id, [(b":status", b"200"), (b"x-path", path)])
        self.conn.send_data(stream_id, b"ok:" + path, end_stream=True)
        self.pending.discard(stream_id)
        self.flush()
        if self.goaway_sent and not self.pending:
            self.transport.close()


@contextlib.asynccontextmanager
async def raw_server(state: RawServerState) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: RawH2Protocol(state), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for proto in state.protocols:
            if proto.transport is not None:
                proto.transport.abort()
        await server.wait_closed()


async def test_goaway_drains_and_retries_refused_streams() -> None:
    state = RawServerState(goaway_after=5)
    async with raw_server(state) as origin, open_pool(origin, limits(max_connections=8)) as pool:
        semaphore = asyncio.Semaphore(16)

        async def one(index: int) -> tuple[int, bytes]:
            async with semaphore:
                return await fetch(pool, f"/r{index}")

        results = await asyncio.gather(*(one(i) for i in range(200)))
        assert results == [(200, b"ok:/r%d" % i) for i in range(200)]
        assert state.unanswered > 0  # the retry path really ran
        assert pool.stats().streams_in_use == 0


async def test_refused_stream_is_retried_once() -> None:
    state = RawServerState(refuse_first=3)
    async with raw_server(state) as origin, open_pool(origin, limits()) as pool:
        results = await asyncio.gather(*(fetch(pool, f"/r{i}") for i in range(3)))
        assert results == [(200, b"ok:/r%d" % i) for i in range(3)]
        assert state.refused == 3


async def test_refused_stream_with_streamed_body_is_not_retried() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"once"

    state = RawServerState(refuse_first=1)
    async with raw_server(state) as origin, open_pool(origin, limits()) as pool:
        with pytest.raises(UpstreamProtocolError) as info:
            await pool.request("POST", "/upload", [], body())
        assert info.value.retryable
        assert pool.stats().streams_in_use == 0


async def test_informational_response_is_skipped() -> None:
    async with raw_server(RawServerState()) as origin, open_pool(origin, limits()) as pool:
        resp = await pool.request("GET", "/early", [])
        assert resp.status == 200
        assert ("x-path", "/early") in resp.headers
        assert b"".join([c async for c in resp.aiter_bytes()]) == b"ok:/early"
        await resp.aclose()


async def test_slow_reader_applies_backpressure() -> None:
    size = 8 * MiB
    state = RawServerState()
    async with raw_server(state) as origin, open_pool(origin, limits()) as pool:
        resp = await pool.request("GET", f"/big?size={size}", [])
        body = resp.aiter_bytes()
        total = len(await anext(body))
        # Give the server every chance to run ahead of a reader that stalls.
        await asyncio.sleep(0.2)
        # Unread data is not acknowledged, so the server is held to one
        # stream window (1 MiB) even though the connection window is 16 MiB.
        assert state.bytes_sent <= MiB
        async for chunk in body:
            total += len(chunk)
        await resp.aclose()
        assert total == size
        assert state.bytes_sent == size


async def test_write_timeout_when_peer_never_opens_window() -> None:
    async with (
        raw_server(RawServerState()) as origin,
        open_pool(origin, limits(write_timeout=0.2)) as pool,
    ):
        with pytest.raises(UpstreamTimeout) as info:
            await pool.request("POST", "/noack", [], b"z" * (256 * 1024))
        assert info.value.phase == "write"
        assert pool.stats().streams_in_use == 0


async def test_unanswered_ping_closes_connection_and_warm_one_is_reopened() -> None:
    state = RawServerState()
    async with (
        raw_server(state) as origin,
        open_pool(
            origin, limits(ping_interval=0.05, connect_timeout=0.2, warm_connections=1)
        ) as pool,
    ):
        await pool.start()
        assert await fetch(pool, "/a") == (200, b"ok:/a")
        state.protocols[0].frozen = True
        # A second connection exists and the pool holds one: the frozen one went.
        await wait_until(lambda: state.connections >= 2 and pool.stats().connections_open == 1)
        assert await fetch(pool, "/b") == (200, b"ok:/b")


# --------------------------------------------------------------------------
# nginx


NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
)

NGINX_CONF = """
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    keepalive_requests 50;
    client_max_body_size 64m;
    server {{
        listen 127.0.0.1:{port} http2;
        root {prefix}/www;
        location = /ok {{ return 200 '{{"ok":true}}'; }}
        location = /upload {{ return 200 'uploaded'; }}
    }}
}}
"""


@pytest.fixture(scope="module")
def nginx_origin() -> Iterator[str]:
    if NGINX is None:
        pytest.skip("nginx binary not found")
    prefix = tempfile.mkdtemp(prefix="edgeproxy-h2pool-nginx-")
    os.chmod(prefix, 0o755)  # workers may run as an unprivileged user
    os.mkdir(os.path.join(prefix, "www"))
    with open(os.path.join(prefix, "www", "big.bin"), "wb") as fh:
        fh.write(b"n" * (8 * MiB))
    os.chmod(os.path.join(prefix, "www"), 0o755)
    port = _free_port()
    conf = os.path.join(prefix, "nginx.conf")
    with open(conf, "w") as fh:
        fh.write(NGINX_CONF.format(prefix=prefix, port=port))
    proc = subprocess.Popen(
        [NGINX, "-p", prefix, "-c", conf],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    pytest.skip(f"nginx did not start: {err.strip()[:300]}")
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)
        if proc.stderr is not None:
            proc.stderr.close()
        shutil.rmtree(prefix, ignore_errors=True)


@pytest.mark.nginx
@pytest.mark.parametrize("concurrency", [64, 256])
async def test_nginx_goaway_drain_has_no_errors(nginx_origin: str, concurrency: int) -> None:
    # keepalive_requests 50: nginx sends GOAWAY every 50 streams per connection.
    async with open_pool(nginx_origin, limits(max_connections=8)) as pool:
        await pool.start()
        semaphore = asyncio.Semaphore(concurrency)
        errors: list[BaseException] = []

        async def one() -> None:
            async with semaphore:
                try:
                    assert await fetch(pool, "/ok") == (200, b'{"ok":true}')
                except UpstreamError as exc:
                    errors.append(exc)

        await asyncio.gather(*(one() for _ in range(500)))
        assert errors == []
        assert pool.stats().streams_in_use == 0


@pytest.mark.nginx
async def test_nginx_large_bodies(nginx_origin: str) -> None:
    async with open_pool(nginx_origin, limits()) as pool:
        status, data = await fetch(pool, "/big.bin")
        assert status == 200 and data == b"n" * (8 * MiB)
        status, data = await fetch(pool, "/upload", "POST", os.urandom(4 * MiB))
        assert (status, data) == (200, b"uploaded")


# --------------------------------------------------------------------------
# Per-connection memory and per-stream errors (see also test_hostile_region.py)


async def fetch_json(pool: H2Pool) -> int:
    status, body = await fetch(pool, "/hostile/json")
    assert b'"object":"chat.completion"' in body
    return status


async def test_closed_stream_table_stays_empty_on_a_long_lived_connection() -> None:
    # h2 remembers how each of the last 65,536 closed streams closed, about
    # 7 MB per long-lived connection. Streams that ended are not kept at all.
    async with (
        HostileRegion() as region,
        open_pool(region.url, limits(max_connections=1)) as pool,
    ):
        semaphore = asyncio.Semaphore(20)

        async def one() -> None:
            async with semaphore:
                assert await fetch_json(pool) == 200

        await asyncio.gather(*(one() for _ in range(600)))
        conn = pool._conns[0]
        assert conn.streams_opened == 600
        assert len(conn.h2._closed_streams) == 0
        assert region.counters.connections == 1


async def test_reset_streams_are_remembered_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # Streams cancelled mid-body are reset: the last ones are remembered, so
    # that the DATA still in flight for them stays a stream error.
    # The bound the connection gives its engine, made 16 (on the engine: the compiled build's
    # connection reads its own constant, which no patch of its module reaches).
    made = ClientEngine.__init__

    def kept_16(self: ClientEngine, config: h2.config.H2Configuration, kept: int) -> None:
        made(self, config, 16)

    monkeypatch.setattr(ClientEngine, "__init__", kept_16)
    async with (
        HostileRegion() as region,
        open_pool(region.url, limits(max_connections=1)) as pool,
    ):
        for _ in range(40):
            resp = await pool.request("GET", "/hostile/endless", [])
            body = resp.aiter_bytes()
            await anext(body)
            await resp.aclose()
            await body.aclose()
        assert await fetch_json(pool) == 200
        table = pool._conns[0].h2._closed_streams
        assert 0 < len(table) <= 16
        assert region.counters.connections == 1
        assert region.counters.reset_codes[int(h2.errors.ErrorCodes.CANCEL)] == 40


async def test_ping_flood_while_our_replies_go_unread_closes_the_connection() -> None:
    async with (
        HostileRegion() as region,
        open_pool(region.url, limits(max_connections=1)) as pool,
    ):
        await pool.start()
        conn = pool._conns[0]
        waiting = await pool.request("GET", "/hostile/sse?gate=1", [])
        body = waiting.aiter_bytes()
        assert b"tok0" in await anext(body)
        # As if the peer had stopped reading and our write buffer were full.
        conn.pause_writing()
        with contextlib.suppress(UpstreamProtocolError):
            # Its answer may come in the same read as the flood, before the check.
            await fetch(pool, "/hostile/ping-flood?count=2000")
        with pytest.raises(UpstreamProtocolError, match="floods PING"):
            async for _ in body:
                pass
        assert conn.closing
        # The pool moves on to a new connection.
        assert await fetch_json(pool) == 200
        assert region.counters.connections == 2


@pytest.mark.parametrize(
    "block",
    [
        [(b":status", b"200")],
        [(b":status", b"204"), (b"content-length", b"0")],
        [(b":status", b"103"), (b"link", b"</a>; rel=preload")],
        [(b":status", b"599"), (b"x-empty", b""), (b"te", b"Trailers")],
        [(b":status", b"200"), (b"x-utf8", "é".encode()), (b"content-length", b"7")],
    ],
)
def test_well_formed_response_fields_pass(block: list[tuple[bytes, bytes]]) -> None:
    status, headers, _ = fields.parse_fields(block, trailers=False)
    assert status == int(block[0][1])
    assert len(headers) == len(block) - 1


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        ([(b":status", b"2OO")], "invalid :status"),
        ([(b":status", b"1000")], "invalid :status"),
        ([(b":status", b"099")], "out of range"),
        ([(b":status", b"101")], "101"),
        ([(b"server", b"x"), (b":status", b"200")], "after a regular field"),
        ([(b":status", b"200"), (b"x-a", b"tab\t")], "invalid value"),
        ([(b":status", b"200"), (b"x\x7f", b"1")], "invalid field name"),
        ([(b":status", b"200"), (b"keep-alive", b"5")], "connection-specific"),
        ([(b":status", b"200"), (b"content-length", b"-1")], "invalid content-length"),
        ([(b":status", b"200"), (b"content-length", b"1, 1")], "invalid content-length"),
        ([(b"x-a", b"1")], "no :status"),
    ],
)
def test_malformed_response_fields_are_named(block: list[tuple[bytes, bytes]], reason: str) -> None:
    with pytest.raises(fields.Malformed, match=reason):
        fields.parse_fields(block, trailers=False)


def test_trailers_may_not_carry_pseudo_headers() -> None:
    assert fields.parse_fields([(b"x-t", b"1")], trailers=True)[1] == [("x-t", "1")]
    with pytest.raises(fields.Malformed, match="in trailers"):
        fields.parse_fields([(b":status", b"200")], trailers=True)


# --------------------------------------------------------------------------
# DATA frames taken without h2's frame machinery (Connection._fast_data)


async def _exchange() -> tuple[h2conn.Connection, Wire, h2.connection.H2Connection, int]:
    """A client Connection with one open request, and the server's h2 connection."""
    loop = asyncio.get_running_loop()
    conn = h2conn.Connection(cast(Any, StubPool()), loop)
    wire = Wire()
    conn.connection_made(cast(Any, wire))
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    server.initiate_connection()
    server.receive_data(wire.take())
    conn.data_received(server.data_to_send())
    stream = conn.open_stream(
        [(":method", "GET"), (":scheme", "http"), (":authority", "a"), (":path", "/")], True
    )
    assert stream is not None
    conn.flush()
    server.receive_data(wire.take())
    return conn, wire, server, stream.id


@pytest.mark.parametrize("split", [1, 5, 9, 10, 4096])
async def test_data_frames_in_any_split_arrive_whole_and_are_counted(split: int) -> None:
    conn, wire, server, stream_id = await _exchange()
    server.send_headers(stream_id, [(b":status", b"200"), (b"content-length", b"26")])
    body = b""
    for i, part in enumerate([b"abc", b"", b"defgh", b"ijklmnop"]):
        # A padded frame too: h2 takes it, and its padding counts against the windows.
        server.send_data(stream_id, part, pad_length=3 if i == 2 else None)
        body += part
    server.send_data(stream_id, b"qrstuvwxyz", end_stream=True)
    body += b"qrstuvwxyz"
    raw = server.data_to_send()
    stream = conn.streams[stream_id]
    for start in range(0, len(raw), split):
        conn.data_received(raw[start : start + split])
    assert conn._inbuf == b""
    assert stream.status == 200
    assert b"".join(stream.chunks) == body
    # The padded frame's 4 extra bytes (length byte and padding) are flow-controlled too.
    assert stream.unacked == len(body) + 4
    assert conn.h2.inbound_flow_control_window == h2conn._CONNECTION_WINDOW - len(body) - 4
    assert stream.remote_ended
    assert await stream.read(1.0) == body
    assert stream.unacked == 0
    assert await stream.read(1.0) is None
    assert not conn.closing


async def test_data_before_the_response_headers_is_left_to_h2() -> None:
    conn, wire, server, stream_id = await _exchange()
    stream = conn.streams[stream_id]
    frame = hyperframe.frame.DataFrame(stream_id, data=b"early")
    conn.data_received(frame.serialize())
    with pytest.raises(UpstreamProtocolError, match="DATA came before the response headers"):
        await stream.wait_headers(1.0)
    assert not conn.closing


async def test_data_beyond_the_stream_window_is_left_to_h2() -> None:
    conn, wire, server, stream_id = await _exchange()
    server.send_headers(stream_id, [(b":status", b"200")])
    conn.data_received(server.data_to_send())
    stream = conn.streams[stream_id]
    # More than the stream's 1 MiB window, in frames h2's own sender would never write.
    frame = hyperframe.frame.DataFrame(stream_id, data=b"x" * 16384)
    for _ in range(h2conn._STREAM_WINDOW // 16384):
        conn.data_received(frame.serialize())
    assert not conn.closing
    conn.data_received(frame.serialize())
    assert conn.closing
    with pytest.raises(UpstreamProtocolError, match="protocol error"):
        await stream.wait_headers(1.0)
        await stream.read(1.0)
        await stream.read(1.0)


async def test_one_timer_serves_every_wait_of_a_stream() -> None:
    conn, wire, server, stream_id = await _exchange()
    stream = conn.streams[stream_id]
    loop = asyncio.get_running_loop()
    # A long wait arms the timer; woken, it leaves the timer armed for the next waits.
    waiting = asyncio.ensure_future(stream.wait(loop.time() + 30))
    await asyncio.sleep(0)
    timer = stream.timer
    assert timer is not None
    stream.wake()
    assert await waiting
    assert stream.timer is timer
    # A later deadline keeps it; an earlier one re-arms it, and still ends the wait on time.
    waiting = asyncio.ensure_future(stream.wait(loop.time() + 60))
    await asyncio.sleep(0)
    assert stream.timer is timer
    stream.wake()
    assert await waiting
    started = time.monotonic()
    assert not await stream.wait(loop.time() + 0.05)
    assert time.monotonic() - started < 1.0
    # The timer that fired before the waiter's deadline moved on to it.
    waiting = asyncio.ensure_future(stream.wait(loop.time() + 0.2))
    await asyncio.sleep(0)
    stream.timer_at = 0.0  # as if it had been armed for an earlier wait
    assert stream.timer is not None
    stream.timer.cancel()
    stream.timer = loop.call_at(loop.time() + 0.05, stream._expire)
    started = time.monotonic()
    assert not await waiting
    assert time.monotonic() - started >= 0.1
    stream.close()
    assert stream.timer is None


async def test_acknowledged_bytes_open_the_windows_as_h2_would() -> None:
    conn, wire, server, stream_id = await _exchange()
    server.send_headers(stream_id, [(b":status", b"200")])
    conn.data_received(server.data_to_send())
    stream = conn.streams[stream_id]
    sent = 0
    # Read after every frame: most acknowledgements are only counted, until one is due.
    while sent < 600 * 1024:
        server.send_data(stream_id, b"x" * 16384)
        sent += 16384
        conn.data_received(server.data_to_send())
        assert len(await stream.read(1.0) or b"") == 16384
        conn.flush()
        server.receive_data(wire.take())
    # h2 hands half a window back at once: the stream's (1 MiB) after 512 KiB.
    assert server.local_flow_control_window(stream_id) == h2conn._STREAM_WINDOW - (
        sent - 512 * 1024
    )
    assert conn.h2.streams[stream_id]._inbound_window_manager._bytes_processed == sent - 512 * 1024
    assert conn.h2._inbound_flow_control_window_manager._bytes_processed == sent


async def test_a_last_data_frame_short_of_the_content_length_fails_its_stream() -> None:
    conn, wire, server, stream_id = await _exchange()
    server.send_headers(stream_id, [(b":status", b"200"), (b"content-length", b"5")])
    conn.data_received(server.data_to_send())
    stream = conn.streams[stream_id]
    frame = hyperframe.frame.DataFrame(stream_id, data=b"abc", flags=["END_STREAM"])
    conn.data_received(frame.serialize())
    assert await stream.read(1.0) == b"abc"
    with pytest.raises(UpstreamProtocolError, match="3 bytes of DATA for a content-length of 5"):
        await stream.read(1.0)
    assert not conn.closing


@pytest.mark.parametrize("last", [b"done", b""], ids=["with-data", "empty"])
async def test_a_last_data_frame_closes_the_stream_in_h2_too(last: bytes) -> None:
    conn, wire, server, stream_id = await _exchange()
    server.send_headers(stream_id, [(b":status", b"200"), (b"content-length", b"4")])
    stream = conn.streams[stream_id]
    if not last:
        server.send_data(stream_id, b"done")
    server.send_data(stream_id, last, end_stream=True)
    conn.data_received(server.data_to_send())
    assert stream.remote_ended and stream.released and stream.error is None
    assert await stream.read(1.0) == b"done"
    assert stream_id not in conn.streams  # released: the request had ended, the response too
    h2stream = conn.h2.streams[stream_id]
    assert h2stream.closed
    assert h2stream.closed_by is engine.CLOSED_BY_END_STREAM
    # h2 forgets it as it forgets any stream that ended, without remembering it.
    assert conn.h2.open_outbound_streams == 0
    assert stream_id not in conn.h2.streams
    assert len(conn.h2._closed_streams) == 0


def test_the_byte_tests_of_field_values_agree_with_the_rfc_pattern() -> None:
    alphabet = [b"a", b" ", b"\t", b"\n", b"\r", b"\x00", b"\x7f", b"\xff"]
    for size in range(5):
        for parts in itertools.product(alphabet, repeat=size):
            value = b"".join(parts)
            assert fields._bad_value(value) == bool(fields._BAD_VALUE.search(value)), value
