"""HTTP/2 upstream pool built directly on ``h2`` and asyncio protocols.

Why not httpx/httpcore: on a small box their per-request overhead (anyio
cancel scopes, a failed ``import sniffio`` per lock, an O(requests x
connections) pool scan) caps throughput far below aiohttp, and their HTTP/2
connection dies on the first GOAWAY instead of draining. See
``bench/pool_compare.py``.

Design in brief:

* One :class:`_Connection` per TCP connection, an :class:`asyncio.Protocol`.
  Frames produced by h2 are written once per event-loop turn.
* Streams are multiplexed up to the peer's ``SETTINGS_MAX_CONCURRENT_STREAMS``;
  the pool opens more connections (up to ``max_connections``) only when every
  live one is full, and otherwise queues requests for up to ``pool_timeout``.
* GOAWAY drains a connection: streams the peer accepted finish, the others are
  failed as *refused* and, when the body can be replayed, retried once on
  another connection. A fixed per-connection request limit (nginx's
  ``keepalive_requests``) is learnt from GOAWAY, and connections are then
  retired just before it, so steady traffic sees no refused streams.
* Receive windows are large (16 MiB per connection, 1 MiB per stream) and data
  is acknowledged only when the consumer takes it, so a slow client pushes
  back on the upstream instead of growing our buffers.
* One maintenance task per pool PINGs quiet connections, closes dead or
  long-idle ones and keeps ``warm_connections`` open.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Final, cast
from urllib.parse import urlsplit

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from hpack import NeverIndexedHeaderTuple

from edgeproxy._upstream.pool import (
    Body,
    Headers,
    PoolLimits,
    PoolStats,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)

__all__ = ["H2Pool", "H2Response"]

_log = logging.getLogger(__name__)

_CONNECTION_WINDOW: Final = 16 * 1024 * 1024
_STREAM_WINDOW: Final = 1024 * 1024
_DEFAULT_WINDOW: Final = 65535
# A refused stream was never seen by the application, so a retry is safe; one
# retry absorbs the usual GOAWAY race without hiding a peer that refuses all.
_REFUSED_RETRIES: Final = 1
# Stop opening streams a little before the 31-bit id space runs out, so the
# connection drains instead of failing a request.
_LAST_STREAM_ID: Final = 2**31 - 1 - 2 * 1024
# How long a per-connection stream limit learnt from GOAWAY is trusted.
_BUDGET_TTL: Final = 600.0
# Headers that describe the HTTP/1.1 connection and are illegal in HTTP/2.
_CONNECTION_SPECIFIC: Final = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "host", "te"}
)
# Kept out of the HPACK dynamic table: per-request values would only churn it
# (and cost an insert and an eviction each), and credentials must not be
# indexed where a compression side channel could probe them (RFC 7541 §7.1.3).
_NEVER_INDEXED: Final = frozenset(
    {"x-request-id", "traceparent", "tracestate", "authorization", "proxy-authorization"}
)
_CANCEL: Final = h2.errors.ErrorCodes.CANCEL
_NO_ERROR: Final = h2.errors.ErrorCodes.NO_ERROR
_REFUSED: Final = h2.errors.ErrorCodes.REFUSED_STREAM


class _RefusedStream(UpstreamProtocolError):
    """The peer provably did not process the stream (GOAWAY or REFUSED_STREAM)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


def _copy_error(err: UpstreamError) -> UpstreamError:
    # One failed connect wakes many waiters; each gets its own instance so that
    # tracebacks and __context__ do not get stitched together across tasks.
    if isinstance(err, UpstreamTimeout):
        return UpstreamTimeout(str(err), phase=err.phase)
    if isinstance(err, UpstreamProtocolError):
        return UpstreamProtocolError(str(err), retryable=err.retryable)
    return type(err)(str(err))


class _DrainingStateMachine(h2.connection.H2ConnectionStateMachine):
    """h2's connection state machine, except that a received GOAWAY keeps it open.

    Stock h2 treats GOAWAY as terminal and then rejects the HEADERS and DATA
    of streams the peer promised to finish (nginx sends GOAWAY *before* the
    response of its last request), so every in-flight request would fail. We
    keep the machine open and stop opening streams ourselves.
    """

    _transitions = {
        **h2.connection.H2ConnectionStateMachine._transitions,
        (
            h2.connection.ConnectionState.IDLE,
            h2.connection.ConnectionInputs.RECV_GOAWAY,
        ): (None, h2.connection.ConnectionState.IDLE),
        (
            h2.connection.ConnectionState.CLIENT_OPEN,
            h2.connection.ConnectionInputs.RECV_GOAWAY,
        ): (None, h2.connection.ConnectionState.CLIENT_OPEN),
    }


class _H2Connection(h2.connection.H2Connection):
    """An h2 client connection that can drain after GOAWAY."""

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config)
        self.state_machine = _DrainingStateMachine()

    def clear_outbound_data_buffer(self) -> None:
        # h2 calls this only on a received GOAWAY; the buffer may still hold
        # WINDOW_UPDATEs or body frames for streams the peer will finish, so it
        # must be written, not dropped.
        return


def _timeout_waiter(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


class _Stream:
    """State of one request/response exchange on a connection."""

    __slots__ = (
        "conn",
        "id",
        "status",
        "headers",
        "chunks",
        "unacked",
        "remote_ended",
        "local_ended",
        "released",
        "finished",
        "error",
        "reset_code",
        "waiter",
    )

    def __init__(self, conn: _Connection, stream_id: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.status = 0
        self.headers: Headers = []
        self.chunks: deque[tuple[bytes, int]] = deque()
        self.unacked = 0  # flow-controlled bytes queued but not yet taken
        self.remote_ended = False
        self.local_ended = False
        self.released = False  # slot handed back to the connection
        self.finished = False  # consumer saw the end, an error, or closed it
        self.error: UpstreamError | None = None
        self.reset_code: int | None = None
        # One waiter is enough: a stream has a single consumer, which first
        # sends the body, then waits for headers, then reads the body.
        self.waiter: asyncio.Future[bool] | None = None

    # -- events from the connection -------------------------------------

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def fail(self, error: UpstreamError) -> None:
        if self.error is None and not (self.remote_ended and self.local_ended):
            self.error = error
        self.conn.release(self)
        self.wake()

    # -- waiting ---------------------------------------------------------

    async def wait(self, deadline: float) -> bool:
        """Wait for any state change; False if ``deadline`` passed first."""
        loop = self.conn.loop
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        fut: asyncio.Future[bool] = loop.create_future()
        self.waiter = fut
        handle = loop.call_at(deadline, _timeout_waiter, fut)
        try:
            return await fut
        finally:
            handle.cancel()
            self.waiter = None

    # -- sending ---------------------------------------------------------

    async def send_body(self, body: Body, write_timeout: float) -> None:
        if body is None:
            return
        if isinstance(body, bytes | bytearray | memoryview):
            await self._send(memoryview(body).cast("B"), True, write_timeout)
            return
        async for chunk in body:
            if chunk and not await self._send(memoryview(chunk).cast("B"), False, write_timeout):
                return
        await self._send(memoryview(b""), True, write_timeout)

    async def _send(self, view: memoryview, end: bool, write_timeout: float) -> bool:
        """Send ``view`` within flow control; False if the peer no longer wants it."""
        conn = self.conn
        h2conn = conn.h2
        loop = conn.loop
        deadline = loop.time() + write_timeout
        while True:
            if self.error is not None:
                raise self.error
            if self.released:
                # The peer finished the response and reset the stream: it
                # does not need the rest of the body (RFC 9113, 8.1).
                return False
            window = h2conn.local_flow_control_window(self.id) if conn.writable else 0
            if window <= 0 and len(view):
                conn.send_blocked.add(self)
                try:
                    progressed = await self.wait(deadline)
                finally:
                    conn.send_blocked.discard(self)
                if not progressed:
                    raise UpstreamTimeout(
                        "upstream stopped accepting the request body", phase="write"
                    )
                continue
            size = min(len(view), window, h2conn.max_outbound_frame_size)
            last = size == len(view)
            h2conn.send_data(self.id, view[:size], end_stream=end and last)
            conn.flush_soon()
            if last:
                if end:
                    self.local_ended = True
                    if self.remote_ended:
                        conn.release(self)
                return True
            view = view[size:]
            deadline = loop.time() + write_timeout

    # -- receiving -------------------------------------------------------

    async def wait_headers(self, read_timeout: float) -> None:
        deadline = self.conn.loop.time() + read_timeout
        while not self.status:
            if self.error is not None:
                raise self.error
            if not await self.wait(deadline):
                raise UpstreamTimeout("upstream response headers timed out", phase="read")

    async def read(self, read_timeout: float) -> bytes | None:
        """The next body chunk, or None at the end of the body."""
        chunks = self.chunks
        if not chunks:
            if self.error is not None:
                self.finished = True
                raise self.error
            if self.remote_ended:
                self.finished = True
                return None
            deadline = self.conn.loop.time() + read_timeout
            while not chunks:
                if self.error is not None:
                    self.finished = True
                    raise self.error
                if self.remote_ended:
                    self.finished = True
                    return None
                if not await self.wait(deadline):
                    raise UpstreamTimeout("upstream response body timed out", phase="read")
        data, flow = chunks.popleft()
        self.unacked -= flow
        # Acknowledging on consumption, not on receipt, is what makes a slow
        # client stall the upstream once the stream window is used up.
        self.conn.acknowledge(self.id, flow)
        return data

    def close(self, code: int = _CANCEL) -> None:
        """Stop the exchange: reset if still open, return unread window. Idempotent."""
        self.finished = True
        if not self.released:
            self.conn.reset(self, code)
        if self.unacked:
            self.conn.acknowledge(self.id, self.unacked)
            self.unacked = 0
            self.chunks.clear()


class H2Response:
    """:class:`~edgeproxy._upstream.pool.UpstreamResponse` for one HTTP/2 stream."""

    __slots__ = ("_stream", "_read_timeout", "status", "headers", "http_version")

    def __init__(self, stream: _Stream, read_timeout: float) -> None:
        self._stream = stream
        self._read_timeout = read_timeout
        self.status = stream.status
        self.headers = stream.headers
        self.http_version = "2"

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        stream = self._stream
        try:
            while True:
                chunk = await stream.read(self._read_timeout)
                if chunk is None:
                    return
                yield chunk
        finally:
            # Reached on cancellation, timeouts, errors and a consumer that
            # breaks out early: none of them may leave the stream open.
            stream.close()

    async def aclose(self) -> None:
        self._stream.close()

    def __del__(self) -> None:
        # A response dropped without aclose() (or a fully read body) would
        # hold its stream slot and flow-control window for good.
        stream = self._stream
        if stream.finished and stream.released and not stream.unacked:
            return
        try:
            if not stream.conn.loop.is_closed():
                stream.close()
        except Exception:  # pragma: no cover - interpreter shutdown, odd states
            pass


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection: h2 state, its transport and its live streams."""

    def __init__(self, pool: H2Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self.h2 = _H2Connection(config)
        self.h2.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _STREAM_WINDOW,
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 2**16,
            },
        )
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, _Stream] = {}
        self.send_blocked: set[_Stream] = set()
        self.ready: asyncio.Future[UpstreamError | None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.draining = False
        self.lost = False
        self.writable = True
        self._flush_scheduled = False
        self.closing = False
        now = loop.time()
        self.last_recv = now
        self.idle_since: float | None = now
        self.ping_sent_at: float | None = None
        self._ping_seq = 0
        self.streams_opened = 0

    # -- state -----------------------------------------------------------

    @property
    def max_streams(self) -> int:
        return self.h2.remote_settings.max_concurrent_streams

    # -- asyncio.Protocol ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, hence a cast.
        self.transport = cast(asyncio.Transport, transport)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - non-TCP sockets in odd setups
                pass
        ssl_object = self.transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            chosen = ssl_object.selected_alpn_protocol()
            if chosen != "h2":
                # Not a word of HTTP/2 to a server that did not agree to it.
                self.ready.set_result(
                    UpstreamConnectError(
                        f"{self.pool.origin} did not negotiate HTTP/2 via ALPN (got {chosen!r});"
                        " the server must support h2 and the SSL context must offer it"
                    )
                )
                return
        # The preface must be written before anything else: the server's
        # SETTINGS can arrive (and need an ACK) before create_connection()
        # even returns to its caller.
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(_CONNECTION_WINDOW - _DEFAULT_WINDOW)
        self.flush()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.last_recv = self.loop.time()
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            # h2 has queued a GOAWAY naming the error; close() writes it out
            # before closing, since the connection state can't be trusted.
            self.close(UpstreamProtocolError(f"HTTP/2 protocol error from upstream: {exc}"))
            return
        for event in events:
            self._handle(event)
        self.flush_soon()

    def eof_received(self) -> bool | None:
        return None  # let the transport close; connection_lost does the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        error: UpstreamError
        if self.ready.done():
            reason = f": {exc}" if exc else ""
            error = UpstreamProtocolError(f"upstream connection lost{reason}")
        else:
            error = UpstreamConnectError(f"upstream closed the connection during setup: {exc}")
            self.ready.set_result(error)
        for stream in list(self.streams.values()):
            stream.fail(error)
        self.transport = None
        if not self.closed.done():
            self.closed.set_result(None)
        self.pool._connection_gone(self)

    def pause_writing(self) -> None:
        self.writable = False

    def resume_writing(self) -> None:
        self.writable = True
        for stream in list(self.send_blocked):
            stream.wake()

    # -- h2 events -------------------------------------------------------

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.DataReceived):
            stream = self.streams.get(event.stream_id)
            if stream is None or stream.finished:
                # Nobody will read this; give the window back at once.
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                return
            if event.data:
                stream.chunks.append((event.data, event.flow_controlled_length))
                stream.unacked += event.flow_controlled_length
            elif event.flow_controlled_length:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            stream.wake()
        elif isinstance(event, h2.events.ResponseReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                _set_response_headers(stream, event.headers)
                stream.wake()
        elif isinstance(event, h2.events.StreamEnded):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.remote_ended = True
                if stream.local_ended:
                    self.release(stream)
                stream.wake()
        elif isinstance(event, h2.events.WindowUpdated):
            if event.stream_id == 0:
                for blocked in list(self.send_blocked):
                    blocked.wake()
            else:
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    stream.wake()
        elif isinstance(event, h2.events.StreamReset):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                self._on_reset(stream, event.error_code)
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            if not self.ready.done():
                self.ready.set_result(None)  # the pool adds us and wakes waiters
            else:
                self.pool._capacity_changed(self)
            # A larger SETTINGS_INITIAL_WINDOW_SIZE opens every send window.
            for blocked in list(self.send_blocked):
                blocked.wake()
        elif isinstance(event, h2.events.PingAckReceived):
            self.ping_sent_at = None
        elif isinstance(event, h2.events.ConnectionTerminated):
            self._on_goaway(event.last_stream_id, event.error_code)
        # Informational (1xx) responses, trailers, priority and settings acks
        # need no action: 1xx is skipped, trailers are not forwarded.

    def _on_reset(self, stream: _Stream, code: int) -> None:
        stream.reset_code = code
        if stream.remote_ended:
            # The response is complete; a reset now only stops our upload.
            self.release(stream)
            stream.wake()
        elif code == _REFUSED:
            stream.fail(_RefusedStream("upstream refused the stream (REFUSED_STREAM)"))
        else:
            name = _error_name(code)
            stream.fail(UpstreamProtocolError(f"upstream reset the stream ({name})"))

    def _on_goaway(self, last_stream_id: int | None, code: int | None) -> None:
        was_draining = self.draining
        self.draining = True
        last = last_stream_id if last_stream_id is not None else 0
        name = _error_name(code if code is not None else 0)
        refused = 0
        for stream in list(self.streams.values()):
            if stream.id > last:
                refused += 1
                stream.fail(_RefusedStream(f"upstream sent GOAWAY ({name}) before the stream"))
        if refused and code == _NO_ERROR and not was_draining:
            self.pool._learn_stream_budget((last + 1) // 2)
        if not self.streams:
            self.close()
        if not was_draining:
            self.pool._capacity_changed(self)

    # -- outbound --------------------------------------------------------

    def open_stream(self, headers: list[tuple[str, str]], end_stream: bool) -> _Stream | None:
        """Start a request; None if the peer has no room for another stream."""
        h2conn = self.h2
        try:
            stream_id = h2conn.get_next_available_stream_id()
            h2conn.send_headers(stream_id, headers, end_stream=end_stream)
        except h2.exceptions.TooManyStreamsError:
            return None
        except h2.exceptions.NoAvailableStreamIDError:
            self.start_draining()
            return None
        except h2.exceptions.ProtocolError as exc:
            # h2 refuses to open streams here (its state broke); nothing was
            # sent, so the request can go elsewhere.
            self.close(UpstreamProtocolError(f"HTTP/2 connection unusable: {exc}"))
            return None
        stream = _Stream(self, stream_id)
        stream.local_ended = end_stream
        self.streams[stream_id] = stream
        self.idle_since = None
        self.streams_opened += 1
        budget = self.pool.stream_budget(self.loop.time())
        if stream_id >= _LAST_STREAM_ID or (budget and self.streams_opened >= budget):
            # Retire the connection before the peer's GOAWAY would refuse
            # streams; see H2Pool._learn_stream_budget.
            self.start_draining()
        self.flush_soon()
        return stream

    def start_draining(self) -> None:
        if not self.draining:
            self.draining = True
            self.pool._capacity_changed(self)

    def release(self, stream: _Stream) -> None:
        if stream.released:
            return
        stream.released = True
        if self.streams.pop(stream.id, None) is None:
            return
        self.send_blocked.discard(stream)
        if not self.streams:
            self.idle_since = self.loop.time()
            if self.draining:
                self.close()
        if not self.draining and not self.lost:
            self.pool._slot_freed(self)

    def reset(self, stream: _Stream, code: int) -> None:
        if not self.lost and stream.id in self.streams:
            try:
                self.h2.reset_stream(stream.id, code)
            except h2.exceptions.ProtocolError:
                pass  # already closed in h2's view; nothing to tell the peer
            self.flush_soon()
        self.release(stream)

    def acknowledge(self, stream_id: int, size: int) -> None:
        if self.lost or not size:
            return
        self.h2.acknowledge_received_data(size, stream_id)
        self.flush_soon()

    def ping(self) -> None:
        self._ping_seq += 1
        self.ping_sent_at = self.loop.time()
        self.h2.ping(self._ping_seq.to_bytes(8, "big"))
        self.flush_soon()

    def flush_soon(self) -> None:
        # Requests started in the same loop turn share one write() call.
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self, error: UpstreamError | None = None) -> None:
        """GOAWAY, fail what is left with ``error`` and close the transport."""
        if self.closing:
            return
        self.closing = True
        self.draining = True
        if error is not None:
            for stream in list(self.streams.values()):
                stream.fail(error)
        if self.transport is not None and not self.transport.is_closing():
            try:
                self.h2.close_connection()
            except h2.exceptions.ProtocolError:
                pass
            self.flush()
            self.transport.close()

    def abort(self, error: UpstreamError) -> None:
        self.closing = True
        self.draining = True
        for stream in list(self.streams.values()):
            stream.fail(error)
        if self.transport is not None:
            self.transport.abort()


def _error_name(code: int) -> str:
    try:
        return h2.errors.ErrorCodes(code).name
    except ValueError:
        return f"error {code}"


def _set_response_headers(stream: _Stream, raw: list[Any]) -> None:
    headers: Headers = []
    status = 0
    for name, value in raw:
        if name[:1] == b":":
            if name == b":status":
                status = int(value)
            continue
        headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))
    stream.headers = headers
    stream.status = status


class H2Pool:
    """HTTP/2 :class:`~edgeproxy._upstream.pool.UpstreamPool` for one origin, built on ``h2``.

    ``http://`` origins use h2c with prior knowledge; ``https://`` origins use
    TLS and require the server to pick ``h2`` by ALPN. A caller-supplied
    ``ssl_context`` is used as is (it is not modified, since it may be shared
    with HTTP/1.1 pools) and must therefore offer ``h2`` itself.

    Pool sizing: at most ``limits.max_connections`` non-draining connections;
    a draining connection (GOAWAY received) does not count, so a replacement
    can open while it finishes its last streams. Idle connections are closed
    after ``keepalive_expiry`` except for ``warm_connections`` of them, which
    are kept (and PINGed, and reopened if they die) so the first request after
    a quiet spell does not pay for a handshake.
    """

    def __init__(
        self,
        origin: str,
        limits: PoolLimits,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"H2Pool needs an http:// or https:// origin, got {origin!r}")
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.limits = limits
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._authority = parts.netloc
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            if ssl_context is None:
                ssl_context = ssl.create_default_context()
                ssl_context.set_alpn_protocols(["h2"])
            self._ssl = ssl_context
        self._conns: list[_Connection] = []
        self._connecting = 0
        self._connect_tasks: set[asyncio.Task[None]] = set()
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self._fresh_waiters: deque[asyncio.Future[bool]] = deque()
        # Waiters handed a slot that have not run yet: until they do, a new
        # request must not take the slot from under them (FIFO fairness).
        self._handoffs = 0
        self._connect_epoch = 0
        self._connect_error: UpstreamError | None = None
        self._connect_backoff_until = 0.0
        self._expected_streams = 100
        # Per-connection stream limits inferred from GOAWAY; 0 means unknown.
        self._budget_candidate = 0  # seen once: only steers retries
        self._stream_budget = 0  # seen twice in a row: retires connections
        self._budget_until = 0.0
        self._requests = 0
        self._closed = False
        self._started = False
        self._maintenance: asyncio.Task[None] | None = None
        self._ping_timeout = max(0.05, min(limits.ping_interval, limits.connect_timeout))

    # -- public API ------------------------------------------------------

    async def start(self) -> None:
        if self._closed:
            raise UpstreamProtocolError(f"pool for {self.origin} is closed")
        self._started = True
        self._ensure_maintenance()
        warm = max(0, min(self.limits.warm_connections, self.limits.max_connections))
        missing = warm - sum(1 for c in self._conns if not c.draining)
        if missing <= 0:
            return
        results = await asyncio.gather(
            *(self._open_connection() for _ in range(missing)), return_exceptions=True
        )
        errors: list[BaseException] = []
        for result in results:
            if isinstance(result, _Connection):
                self._add_connection(result)
            else:
                errors.append(result)
        if len(errors) == len(results):
            err = errors[0]
            if isinstance(err, UpstreamError):
                raise err
            raise UpstreamConnectError(f"cannot connect to {self.origin}: {err}") from err

    async def request(
        self,
        method: str,
        target: str,
        headers: Headers,
        body: Body = None,
        *,
        authority: str | None = None,
    ) -> H2Response:
        if self._closed:
            raise UpstreamProtocolError(f"pool for {self.origin} is closed")
        self._requests += 1
        limits = self.limits
        if isinstance(body, bytes | bytearray | memoryview) and not len(body):
            body = None
        header_block = self._header_block(method, target, headers, body, authority)
        replayable = body is None or isinstance(body, bytes | bytearray | memoryview)
        retries = 0
        must_wait = False
        while True:
            fresh = retries > 0
            # Queue behind earlier waiters rather than jump ahead of them.
            queued = self._handoffs or (self._fresh_waiters if fresh else self._waiters)
            conn = None if must_wait or queued else self._pick(fresh)
            if conn is None:
                conn = await self._acquire(fresh)
            stream = conn.open_stream(header_block, body is None)
            if stream is None:
                # The peer's view of its stream limit was tighter than ours:
                # wait for a slot rather than spin on the same connection.
                must_wait = True
                continue
            must_wait = False
            try:
                await stream.send_body(body, limits.write_timeout)
                await stream.wait_headers(limits.read_timeout)
            except _RefusedStream:
                stream.close()
                if replayable and retries < _REFUSED_RETRIES:
                    retries += 1
                    continue
                raise
            except BaseException:
                # Timeouts, cancellation, a failing body iterator: the stream
                # must not stay open on the connection.
                stream.close()
                raise
            return H2Response(stream, limits.read_timeout)

    def stats(self) -> PoolStats:
        return PoolStats(
            connections_open=len(self._conns),
            streams_in_use=sum(len(c.streams) for c in self._conns),
            requests_total=self._requests,
            http_version="2",
        )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks: list[asyncio.Task[None]] = list(self._connect_tasks)
        if self._maintenance is not None:
            tasks.append(self._maintenance)
            self._maintenance = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._wake_all()
        conns = list(self._conns)
        error = UpstreamProtocolError(f"pool for {self.origin} closed")
        for conn in conns:
            conn.close(error)
        pending = [conn.closed for conn in conns if not conn.closed.done()]
        if pending:
            # Wait for connection_lost so no transport outlives the pool (an
            # unclosed transport warns when collected).
            _, not_done = await asyncio.wait(pending, timeout=1.0)
            if not_done:
                for conn in conns:
                    if conn.transport is not None:
                        conn.transport.abort()
                await asyncio.wait(not_done, timeout=1.0)
        self._conns.clear()

    # -- request helpers -------------------------------------------------

    def _header_block(
        self,
        method: str,
        target: str,
        headers: Headers,
        body: Body,
        authority: str | None,
    ) -> list[tuple[str, str]]:
        block = [
            (":method", method),
            (":scheme", self._scheme),
            (":authority", authority or self._authority),
            (":path", target or "/"),
        ]
        has_length = False
        for name, value in headers:
            lname = name.lower()
            if lname in _CONNECTION_SPECIFIC:
                if lname == "host" and authority is None:
                    block[2] = (":authority", value)
                elif lname == "te" and value.strip().lower() == "trailers":
                    block.append(("te", "trailers"))
                continue
            if lname[:1] == ":":
                continue
            if lname == "content-length":
                has_length = True
            if lname in _NEVER_INDEXED:
                block.append(cast(tuple[str, str], NeverIndexedHeaderTuple(lname, value)))
                continue
            block.append((lname, value))
        if not has_length and isinstance(body, bytes | bytearray | memoryview):
            # Not required by HTTP/2, but lets servers size buffers and reject
            # oversized bodies before reading them.
            block.append(("content-length", str(len(body))))
        return block

    # -- connection selection --------------------------------------------

    def _pick(self, fresh: bool = False) -> _Connection | None:
        """The least-loaded usable connection with a free stream slot.

        ``fresh`` is for retrying a refused stream: it prefers the connection
        that has opened the fewest streams and is still below the
        per-connection limit suggested by the last GOAWAY, so the retry is not
        refused again by a connection as old as the one that refused it. When
        no such connection exists and no new one can be opened, it settles for
        the least-used one rather than wait for a limit that may be wrong.
        """
        best: _Connection | None = None
        best_key = 1 << 62
        fallback: _Connection | None = None
        cap = self._retry_cap() if fresh else 0
        for conn in self._conns:
            if conn.draining or conn.lost:
                continue
            load = len(conn.streams)
            if load >= conn.h2.remote_settings.max_concurrent_streams:
                continue
            if not fresh:
                if load < best_key:
                    best, best_key = conn, load
                continue
            key = conn.streams_opened
            if cap and key >= cap:
                if fallback is None or key < fallback.streams_opened:
                    fallback = conn
            elif key < best_key:
                best, best_key = conn, key
        if best is None and fallback is not None and not self._can_grow():
            return fallback
        return best

    def _can_grow(self) -> bool:
        """Whether a connection is on its way or another may be opened."""
        if self._connecting:
            return True
        live = sum(1 for c in self._conns if not c.draining and not c.lost)
        return live < self.limits.max_connections

    async def _acquire(self, fresh: bool = False) -> _Connection:
        """Wait up to ``pool_timeout`` for a stream slot, opening connections as needed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.pool_timeout
        epoch = self._connect_epoch
        # Retries wait apart: they cannot use every freed slot, and a wake-up
        # they cannot use must not be lost to a plain request.
        queue = self._fresh_waiters if fresh else self._waiters
        first = True
        while True:
            if self._closed:
                raise UpstreamProtocolError(f"pool for {self.origin} is closed")
            self._maybe_connect(len(self._waiters) + len(self._fresh_waiters) + 1)
            fut: asyncio.Future[bool] = loop.create_future()
            if first:
                queue.append(fut)
                first = False
            else:
                # Woken but beaten to the slot: keep our place at the front.
                queue.appendleft(fut)
            handle = loop.call_at(deadline, _timeout_waiter, fut)
            try:
                woken = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.result():
                    # We were handed a free slot but will not use it.
                    self._handoffs -= 1
                    if not self._wake_one(self._waiters):
                        self._wake_one(self._fresh_waiters)
                raise
            finally:
                handle.cancel()
                if not fut.done() or fut.cancelled() or not fut.result():
                    # Woken futures were already taken off the queue.
                    try:
                        queue.remove(fut)
                    except ValueError:
                        pass
            if woken:
                self._handoffs -= 1
            conn = self._pick(fresh)
            if conn is not None:
                return conn
            if self._closed:
                raise UpstreamProtocolError(f"pool for {self.origin} is closed")
            if not woken:
                raise UpstreamTimeout(
                    f"no HTTP/2 stream to {self.origin} became free in time", phase="pool"
                )
            if (
                self._connect_epoch != epoch
                and self._connect_error is not None
                and self._connecting == 0
                and not any(not c.draining and not c.lost for c in self._conns)
            ):
                # Nothing live can free a slot and the connect we waited for
                # failed: report it now rather than at pool_timeout.
                raise _copy_error(self._connect_error)

    def _maybe_connect(self, demand: int) -> None:
        live = sum(1 for c in self._conns if not c.draining and not c.lost)
        if live + self._connecting >= self.limits.max_connections:
            return
        if self._connecting and demand <= self._connecting * self._expected_streams:
            return  # connections on their way will absorb the queue
        loop = asyncio.get_running_loop()
        if loop.time() < self._connect_backoff_until and self._conns:
            return
        self._connecting += 1
        task = loop.create_task(self._connect_in_background())
        self._connect_tasks.add(task)
        task.add_done_callback(self._connect_tasks.discard)

    async def _connect_in_background(self) -> None:
        try:
            conn = await self._open_connection()
        except Exception as exc:
            if not isinstance(exc, UpstreamError):
                exc = UpstreamConnectError(f"cannot connect to {self.origin}: {exc!r}")
            self._connect_error = exc
            self._connect_epoch += 1
            loop = asyncio.get_running_loop()
            self._connect_backoff_until = loop.time() + min(1.0, self.limits.connect_timeout)
        else:
            self._add_connection(conn)
        finally:
            self._connecting -= 1
            self._wake_all()

    async def _open_connection(self) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(self, loop)
        try:
            async with asyncio.timeout(self.limits.connect_timeout):
                await loop.create_connection(
                    lambda: conn,
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                )
                error = await conn.ready
                if error is not None:
                    raise error
        except TimeoutError as exc:
            conn.abort(UpstreamConnectError("connect timed out"))
            raise UpstreamTimeout(
                f"timed out connecting to {self.origin}", phase="connect"
            ) from exc
        except OSError as exc:
            conn.abort(UpstreamConnectError(str(exc)))
            raise UpstreamConnectError(f"cannot connect to {self.origin}: {exc}") from exc
        except BaseException as exc:
            conn.abort(UpstreamConnectError(str(exc)))
            raise
        return conn

    def _add_connection(self, conn: _Connection) -> None:
        if conn.lost:
            return
        if self._closed:
            conn.close()
            return
        self._conns.append(conn)
        self._expected_streams = max(1, min(conn.max_streams, self.stream_budget() or 1000))
        self._ensure_maintenance()

    def stream_budget(self, now: float | None = None) -> int:
        """Streams after which a connection is retired; 0 when no limit is known."""
        if now is None:
            now = asyncio.get_running_loop().time()
        if self._stream_budget and self._budget_until <= now:
            self._stream_budget = 0
        return self._stream_budget

    def _retry_cap(self) -> int:
        return self.stream_budget() or self._budget_candidate

    def _learn_stream_budget(self, accepted: int) -> None:
        """Infer a per-connection stream limit from a GOAWAY that refused streams.

        Servers such as nginx (``keepalive_requests``) and hypercorn
        (``keep_alive_max_requests``) send GOAWAY after a fixed number of
        streams and refuse whatever else is in flight. One such GOAWAY makes
        the count a candidate, which only keeps retried streams off
        connections that have already opened that many. The same count seen
        on the next GOAWAY confirms it: from then on connections are retired
        just before it, so steady traffic sees no refused streams at all.

        Requiring two matching counts keeps a GOAWAY from a reload or a
        shutdown (at an arbitrary count) from shrinking every connection's
        life; a smaller count contradicts and drops the budget, and the
        budget expires after ``_BUDGET_TTL`` in case the server's limit grew.
        """
        if accepted <= 0:
            return
        now = asyncio.get_running_loop().time()
        if accepted == self._budget_candidate:
            self._stream_budget = accepted
            self._budget_until = now + _BUDGET_TTL
            self._expected_streams = max(1, min(self._expected_streams, accepted))
            for conn in self._conns:
                if conn.streams_opened >= accepted:
                    conn.start_draining()
        elif self._stream_budget and accepted < self._stream_budget:
            self._stream_budget = 0
        self._budget_candidate = accepted

    # -- waking ----------------------------------------------------------

    def _wake_one(self, waiters: deque[asyncio.Future[bool]]) -> bool:
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(True)
                self._handoffs += 1
                return True
        return False

    def _wake_all(self) -> None:
        for waiters in (self._waiters, self._fresh_waiters):
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(True)
                    self._handoffs += 1

    def _slot_freed(self, conn: _Connection) -> None:
        if self._waiters:
            self._wake_one(self._waiters)
        elif self._fresh_waiters and self._pick(fresh=True) is not None:
            self._wake_one(self._fresh_waiters)

    def _capacity_changed(self, conn: _Connection) -> None:
        if self._waiters or self._fresh_waiters:
            self._wake_all()

    def _connection_gone(self, conn: _Connection) -> None:
        try:
            self._conns.remove(conn)
        except ValueError:
            pass
        if self._waiters or self._fresh_waiters:
            self._wake_all()

    # -- maintenance -----------------------------------------------------

    def _ensure_maintenance(self) -> None:
        if self._maintenance is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._maintenance = loop.create_task(self._maintain())

    async def _maintain(self) -> None:
        limits = self.limits
        tick = max(0.02, min(limits.ping_interval, limits.keepalive_expiry, self._ping_timeout) / 2)
        loop = asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(tick)
            try:
                self._maintain_once(loop.time())
            except Exception:  # pragma: no cover - a bug must not stop keepalive
                _log.exception("H2Pool maintenance failed for %s", self.origin)

    def _maintain_once(self, now: float) -> None:
        limits = self.limits
        warm = max(0, min(limits.warm_connections, limits.max_connections))
        live = [c for c in self._conns if not c.draining and not c.lost]
        # Most recently used first, so the warm ones kept are the freshest.
        idle = sorted(
            (c for c in live if c.idle_since is not None),
            key=lambda c: c.idle_since or 0.0,
            reverse=True,
        )
        keep = max(0, warm - (len(live) - len(idle)))
        for index, conn in enumerate(idle):
            assert conn.idle_since is not None
            if index >= keep and now - conn.idle_since >= limits.keepalive_expiry:
                conn.close()
        for conn in self._conns:
            if conn.lost or conn.closing:
                continue
            if conn.ping_sent_at is not None:
                if now - conn.ping_sent_at >= self._ping_timeout:
                    conn.abort(UpstreamProtocolError("upstream did not answer PING"))
            elif now - conn.last_recv >= limits.ping_interval:
                conn.ping()
        if self._started and not self._waiters and not self._fresh_waiters:
            alive = sum(1 for c in self._conns if not c.draining and not c.lost)
            if alive + self._connecting < warm and now >= self._connect_backoff_until:
                self._maybe_connect(1)
