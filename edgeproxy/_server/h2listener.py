"""The HTTP/2 client listener: hypercorn serving the ASGI front end, with HTTP/1.1 beside it.

``server.http2 = true`` puts it in place of the aiohttp listener: over TLS, ALPN offers
``h2`` and ``http/1.1``; in cleartext (``server.h2c``) a client may start HTTP/2 with
prior knowledge or upgrade to it. One browser connection then carries every SSE stream
of a page, instead of six connections at most over HTTP/1.1.

hypercorn parses and frames; this module adds what a proxy facing the internet needs on
top, with the limits of ``[limits]``:

* the connection caps of the aiohttp listener (``max_connections``, per address);
* a request head must arrive within ``header_timeout`` once its first bytes came;
* HTTP/2 abuse, each counted and answered with GOAWAY (``ENHANCE_YOUR_CALM``) and a
  closed connection: rapid reset (CVE-2023-44487: streams the client cancels before
  their answer ends, ``h2_max_premature_resets``), PING and SETTINGS floods
  (``h2_max_control_frames`` per 10 seconds), more open streams than
  ``h2_max_concurrent_streams`` (h2 refuses them as a protocol error);
* CONTINUATION floods are refused by h2 itself (at most 64 frames in one header block,
  each at most 16 KiB), header lists over ``max_headers`` x ``max_header_size`` by the
  SETTINGS it advertises;
* an answer aborted mid-stream resets its stream (RST_STREAM) once what was written
  before it has gone out; hypercorn alone would leave the stream open;
* what a stream's answer may hold in the listener while its client does not take it
  (flow control) is bounded, per stream and per connection: the application's send then
  waits, so the proxy stops reading the region, as over HTTP/1.1; a stream whose client
  takes nothing for ``h2_send_stall_timeout`` is reset (hypercorn 0.18 alone buffers
  whole answers for a client that keeps its window shut);
* a connection the client closed or reset gives up its place under the caps, and its
  socket, at once, not after ``keepalive_timeout``.

Body size, stall, rate and deadline are bounded by the ASGI front end, as on any server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h11
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HyperConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h2 import BufferCompleteError, H2Protocol, StreamBuffer
from hypercorn.protocol.h11 import H11Protocol

from edgeproxy._core.config import LimitsConfig
from edgeproxy._server.asgi import Receive, Scope, Send
from edgeproxy._server.listener import ConnectionGuard

__all__ = ["Http2Listener"]

logger = logging.getLogger("edgeproxy")

_CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
_CONTROL_WINDOW = 10.0
_MAX_RECV = 2**16
_ASGI = Callable[[Scope, Receive, Send], Awaitable[None]]
# What an answer may hold in the listener while its client does not take it: per stream,
# per connection, and what any stream may hold even when its connection is at its cap (two
# frames: a stream that is read is never held up by others that are not).
STREAM_BUFFER = 256 * 1024
CONNECTION_BUFFER = 1024 * 1024
_STREAM_FLOOR = 2 * 2**14


class _HyperConfig(HyperConfig):
    """hypercorn's settings, with the listener's Server header (or none) in place of
    hypercorn's own, on its own answers (a 400, a 408) as on the application's."""

    def __init__(self, server_header: str) -> None:
        self.include_server_header = False
        self._server: tuple[tuple[bytes, bytes], ...] = (
            ((b"server", server_header.encode("ascii")),) if server_header else ()
        )

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        # Its Date (the one the answer carries: the proxy drops the region's) and ours.
        headers = super().response_headers(protocol)
        headers.extend(self._server)
        return headers


def _hyper_config(limits: LimitsConfig, grace: float, server_header: str) -> HyperConfig:
    config = _HyperConfig(server_header)
    config.h2_max_concurrent_streams = limits.h2_max_concurrent_streams
    config.h2_max_header_list_size = limits.max_headers * limits.max_header_size
    config.h11_max_incomplete_size = limits.max_request_line + limits.max_header_size * 2
    config.keep_alive_timeout = limits.keepalive_timeout
    # Its GOAWAY after this many requests marks the last stream processed and never
    # answers it; connections are bounded by the keep-alive timeout instead.
    config.keep_alive_max_requests = sys.maxsize
    config.graceful_timeout = grace
    config.accesslog = None
    config.errorlog = logging.getLogger("edgeproxy.http2")
    return config


class _Abuse(h2.exceptions.ProtocolError):
    """A client broke one of the listener's HTTP/2 limits."""


class _ConnectionGuard:
    """One connection's HTTP/2 counters, checked on every batch of frames it sends."""

    __slots__ = ("controls", "guard", "opened", "premature", "protocol", "window_start")

    def __init__(self, guard: ConnectionGuard, protocol: H2Protocol, now: float) -> None:
        self.guard = guard
        self.protocol = protocol
        self.opened = 0
        self.premature = 0
        self.controls = 0
        self.window_start = now

    def check(self, events: list[h2.events.Event], now: float) -> None:
        limits = self.guard.limits
        streams = self.protocol.streams
        # Streams opened in this batch are not among hypercorn's yet.
        new: set[int] = set()
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                self.opened += 1
                new.add(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                if event.remote_reset and (event.stream_id in streams or event.stream_id in new):
                    self.premature += 1
            elif isinstance(
                event,
                h2.events.PingReceived
                | h2.events.RemoteSettingsChanged
                | h2.events.PriorityUpdated,
            ):
                self.controls += 1
        if self.premature > limits.h2_max_premature_resets and self.premature * 2 >= self.opened:
            self.guard.h2_rapid_resets += 1
            raise _Abuse("too many streams cancelled before their answer (rapid reset)")
        if now - self.window_start >= _CONTROL_WINDOW:
            self.window_start, self.controls = now, 0
        elif self.controls > limits.h2_max_control_frames:
            self.guard.h2_control_floods += 1
            raise _Abuse("too many PING/SETTINGS/PRIORITY frames")


def _guard_h2(protocol: H2Protocol, guard: ConnectionGuard) -> None:
    """Check every batch of frames the client sends on ``protocol``'s connection."""
    conn: h2.connection.H2Connection = protocol.connection
    receive = conn.receive_data
    loop = asyncio.get_running_loop()
    counters = _ConnectionGuard(guard, protocol, loop.time())

    def receive_data(data: Any) -> list[h2.events.Event]:
        try:
            events = receive(data)
        except h2.exceptions.ProtocolError:
            # hypercorn answers it with GOAWAY and closes; counted here.
            guard.h2_protocol_errors += 1
            raise
        try:
            counters.check(events, loop.time())
        except _Abuse as abuse:
            logger.warning("HTTP/2 client %s: %s; closing", protocol.client, abuse)
            conn.close_connection(error_code=_CALM)
            raise
        return events

    conn.receive_data = receive_data  # type: ignore[method-assign]  # this connection only


class _Flow(dict[int, StreamBuffer]):
    """One HTTP/2 connection's answer buffers (hypercorn's ``stream_buffers``, each stream's
    replaced by a :class:`_Buffer` as hypercorn adds it), what they hold in all, and the
    sends waiting for room."""

    def __init__(self, protocol: H2Protocol, guard: ConnectionGuard, stall_timeout: float) -> None:
        super().__init__()
        self.protocol = protocol
        self.guard = guard
        self.stall_timeout = stall_timeout
        self.held = 0
        self.loop = asyncio.get_running_loop()
        self._waiters: set[asyncio.Future[None]] = set()

    def __setitem__(self, stream_id: int, buffer: StreamBuffer) -> None:
        super().__setitem__(stream_id, _Buffer(self, stream_id))

    def __delitem__(self, stream_id: int) -> None:
        buffer = self[stream_id]
        super().__delitem__(stream_id)
        if isinstance(buffer, _Buffer):
            buffer.discard()

    def room(self, held: int) -> int:
        """How many more bytes a stream holding ``held`` may buffer now."""
        return max(_STREAM_FLOOR - held, min(STREAM_BUFFER - held, CONNECTION_BUFFER - self.held))

    def added(self, size: int) -> None:
        self.held += size
        guard = self.guard
        guard.h2_buffered += size
        guard.h2_buffered_peak = max(guard.h2_buffered_peak, guard.h2_buffered)

    def taken(self, size: int) -> None:
        """``size`` bytes left a buffer (sent, or dropped): the sends waiting look again."""
        self.held -= size
        self.guard.h2_buffered -= size
        self.wake()

    def wake(self) -> None:
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until some buffer of the connection changes, or ``timeout`` seconds."""
        waiter = self.loop.create_future()
        self._waiters.add(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)

    def close(self) -> None:
        """The connection ended: every buffer lets go of what it held."""
        for buffer in list(self.values()):
            if isinstance(buffer, _Buffer):
                buffer.discard()
        self.wake()


class _Buffer(StreamBuffer):
    """One stream's answer on its way out, bounded (hypercorn's un-pauses its writer
    whenever a send takes less than half its mark, which a closed window always does, and
    so buffers whole answers). A send waits while the stream holds what :meth:`_Flow.room`
    allows; one whose client has taken nothing of it for the stall timeout resets it."""

    def __init__(self, flow: _Flow, stream_id: int) -> None:
        super().__init__(flow.protocol.context.event_class)
        self.flow = flow
        self.stream_id = stream_id
        self.closed = False
        self.taken_at = flow.loop.time()

    async def push(self, data: bytes) -> None:
        if self._complete:
            raise BufferCompleteError()
        view = memoryview(data)
        since: float | None = None
        while view and not self.closed:
            room = self.flow.room(len(self.buffer))
            if room > 0:
                piece = view[:room]
                self.buffer += piece
                self.flow.added(len(piece))
                view = view[room:]
            else:
                since = self.flow.loop.time() if since is None else since
                await self._wait(since)

    async def pop(self, max_length: int) -> bytes:
        length = min(len(self.buffer), max_length)
        if length <= 0:
            return b""
        data = bytes(self.buffer[:length])
        del self.buffer[:length]
        self.taken_at = self.flow.loop.time()
        self.flow.taken(length)
        return data

    async def drain(self) -> None:
        since = self.flow.loop.time()
        while self.buffer and not self.closed:
            await self._wait(since)

    async def close(self) -> None:
        self._complete = True
        self.discard()

    def discard(self) -> None:
        """Drop what is held, and let the sends waiting go (as hypercorn's close does)."""
        self.closed = True
        size = len(self.buffer)
        self.buffer = bytearray()
        if size:
            self.flow.taken(size)
        else:
            self.flow.wake()

    async def _wait(self, since: float) -> None:
        """Wait for room, from ``since``; past the stall timeout without a byte taken by the
        client, reset the stream and raise ``ConnectionResetError`` (ASGI's send on a
        stream that is gone)."""
        flow = self.flow
        deadline = max(since, self.taken_at) + flow.stall_timeout
        left = deadline - flow.loop.time()
        if left > 0:
            await flow.wait(left)
            return
        await self._stalled()
        raise ConnectionResetError("the client took nothing of its answer (stalled stream)")

    async def _stalled(self) -> None:
        flow = self.flow
        protocol = flow.protocol
        stream_id = self.stream_id
        flow.guard.h2_send_stalls += 1
        logger.info(
            "HTTP/2 client %s took nothing of stream %d for %ss; resetting it",
            protocol.client,
            stream_id,
            flow.stall_timeout,
        )
        self.discard()
        try:
            protocol.connection.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        except h2.exceptions.ProtocolError:
            pass  # closed already
        else:
            # The RST_STREAM goes out without holding up this send (the socket may be full).
            protocol.task_group.spawn(protocol._flush)
        # hypercorn's sender finds the stream closed and forgets its buffer; the request
        # hears http.disconnect; the connection may go idle.
        with contextlib.suppress(KeyError):  # priority's MissingStreamError
            protocol.priority.unblock(stream_id)
        await protocol.has_data.set()
        await protocol.stream_send(StreamClosed(stream_id=stream_id))


class _Connection(TCPServer):
    """hypercorn's connection, with the head deadline and the HTTP/2 guard."""

    def __init__(self, listener: Http2Listener, release: Callable[[], None], *args: Any) -> None:
        super().__init__(*args)
        self._listener = listener
        self._release = release
        self._guarded = False
        self._gone = False  # the client closed or reset the connection
        self.flow: _Flow | None = None  # HTTP/2: the answers' buffers
        self._half_closed = False  # the client ended its side after a request whole
        # What cancels the HTTP/1.1 request waiting in admission's queue, while it waits.
        self._leave: Callable[[], None] | None = None

    def queued(self, leave: Callable[[], None] | None) -> None:
        """The HTTP/1.1 request running waits in admission's queue (``leave`` cancels it),
        or no longer (None). One whose client half-closed already is taken as gone."""
        self._leave = leave
        if leave is not None and self._half_closed:
            self._task_group.spawn(self._client_gone, leave)

    async def _client_gone(self, leave: Callable[[], None] | None) -> None:
        """As for a client that closed: hypercorn closes the stream (nothing is answered)
        and the connection, then ``leave`` cancels the request it still ran, if any."""
        await self.protocol.handle(Closed())
        # hypercorn's keep-alive timer would hold the connection (its task, its socket, its
        # place under the caps) until keep_alive_timeout although the client is gone, and
        # each request ending restarts it: the read side ended, so the socket closes and
        # the place is given back now; the requests still running are told, and end.
        self.let_go()
        await self.idle_task.stop()
        if leave is not None:
            leave()

    def let_go(self) -> None:
        """The client is gone: close the socket (nothing more is written to it), drop
        what the answers held, give back the place under the caps."""
        if self._gone:
            return
        self._gone = True
        self.writer.close()
        if self.flow is not None:
            self.flow.close()
        self._release()

    async def protocol_send(self, event: Event) -> None:
        # hypercorn sends the server's SETTINGS the moment a connection turns HTTP/2 (by
        # ALPN, the client's preface, or an h2c upgrade), before it hands the new protocol
        # the bytes read with the switch: guarded here, those are checked like the rest.
        if not self._guarded:
            inner = self.protocol.protocol
            if isinstance(inner, H2Protocol):
                listener = self._listener
                _guard_h2(inner, listener.guard)
                # Before any stream: each gets a bounded buffer.
                self.flow = _Flow(inner, listener.guard, listener.send_stall_timeout)
                inner.stream_buffers = self.flow
                self._guarded = True
        if self._gone and isinstance(event, RawData | Updated):
            # Nothing to write to a client gone, and no keep-alive timer to restart.
            return
        await super().protocol_send(event)

    async def _read_data(self) -> None:
        guard = self._listener.guard
        limits = guard.limits
        loop = asyncio.get_running_loop()
        head_since: float | None = None
        while not self.reader.at_eof():
            inner = self.protocol.protocol
            timeout = None
            if _partial_head(inner):
                head_since = loop.time() if head_since is None else head_since
                timeout = max(head_since + limits.header_timeout - loop.time(), 0.0)
            else:
                head_since = None
            try:
                async with asyncio.timeout(timeout):
                    data = await self.reader.read(_MAX_RECV)
            except TimeoutError:
                guard.header_timeouts += 1
                break
            except (ConnectionError, OSError, ssl.SSLError):
                break
            await self.protocol.handle(RawData(data))
        if (
            self.reader.at_eof()
            and limits.half_close == "answer"
            and self._leave is None
            and _sent_whole(self.protocol.protocol)
        ):
            # The client sent its request whole and shut its side (shutdown(SHUT_WR)): it
            # still reads. hypercorn would take the EOF for a disconnect and cancel the
            # answer. h11 is told instead (unless a read of nothing told it already): the
            # answer goes out, then hypercorn closes, the client's side being CLOSED. Not
            # for a request waiting in admission's queue (a FIN is also how a client that
            # closed looks: its place goes to the next), nor with half_close = "abort".
            self._half_closed = True
            if _their_state(self.protocol.protocol) is not h11.CLOSED:
                await self.protocol.handle(RawData(b""))
            return
        # The request waiting in the queue is cancelled even if it reads nothing more.
        await self._client_gone(self._leave)


def _their_state(protocol: H11Protocol | H2Protocol) -> object:
    """The client's side of an HTTP/1.1 connection, in h11's states."""
    if isinstance(protocol, H11Protocol) and isinstance(protocol.connection, h11.Connection):
        return protocol.connection.their_state
    return None


def _sent_whole(protocol: H11Protocol | H2Protocol) -> bool:
    """Whether an HTTP/1.1 request received whole is being answered."""
    if not isinstance(protocol, H11Protocol) or protocol.stream is None:
        return False
    return _their_state(protocol) in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)


def _partial_head(protocol: H11Protocol | H2Protocol) -> bool:
    """Whether the client has sent part of a request head and not the rest."""
    if isinstance(protocol, H2Protocol):
        # h2's frame buffer: a header block waiting for its CONTINUATION frames, or part
        # of a frame while no request runs (private names, read defensively).
        buffer = protocol.connection.incoming_buffer
        return bool(getattr(buffer, "_headers_buffer", None)) or (
            bool(getattr(buffer, "_data", None)) and not protocol.streams
        )
    connection = protocol.connection
    return connection.their_state is h11.IDLE and bool(connection.trailing_data[0])


def _refuse(writer: asyncio.StreamWriter, guard: ConnectionGuard, message: str) -> None:
    """Answer a connection over a cap and close it, reading nothing of it and waiting for
    nothing: a client that negotiated h2 by ALPN gets HTTP/2's refusal, any other the
    aiohttp listener's 503. In cleartext an h2c client with prior knowledge gets the 503
    too: telling it apart would mean waiting for its first bytes."""
    tls = writer.get_extra_info("ssl_object")
    if tls is not None and tls.selected_alpn_protocol() == "h2":
        writer.write(_h2_refusal(message))
    else:
        writer.write(guard.refusal(message))
    writer.close()


@functools.cache
def _h2_refusal(message: str) -> bytes:
    """The server's preface allowing no stream, then GOAWAY: last stream 0 (none was
    processed, so the client may retry each request elsewhere), ENHANCE_YOUR_CALM (back
    off rather than reconnect at once), the reason as its debug data."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.local_settings = h2.settings.Settings(
        client=False, initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0}
    )
    conn.initiate_connection()
    conn.close_connection(error_code=_CALM, additional_data=message.encode(), last_stream_id=0)
    return conn.data_to_send()


class Http2Listener:
    """The client listener over HTTP/2 and HTTP/1.1, serving ``app`` (the ASGI front end)."""

    def __init__(
        self,
        app: _ASGI,
        guard: ConnectionGuard,
        *,
        ssl_context: ssl.SSLContext | None,
        grace: float,
        send_stall_timeout: float = 60.0,
    ) -> None:
        self.guard = guard
        self.send_stall_timeout = send_stall_timeout
        self._app = ASGIWrapper(self._with_reset(app))  # type: ignore[arg-type]
        self._ssl = ssl_context
        self._config = _hyper_config(guard.limits, grace, guard.server_header)
        self._context = WorkerContext(None)
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._requests: set[asyncio.Task[Any]] = set()
        self._resets: set[asyncio.Task[None]] = set()

    @property
    def addresses(self) -> list[Any]:
        if self._server is None:
            return []
        return [sock.getsockname() for sock in self._server.sockets]

    async def start(self, host: str, port: int, *, backlog: int, reuse_port: bool) -> None:
        self._server = await asyncio.start_server(
            self._connected,
            host,
            port,
            backlog=backlog,
            reuse_port=reuse_port or None,
            ssl=self._ssl,
            ssl_handshake_timeout=self.guard.limits.header_timeout if self._ssl else None,
        )

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        guard = self.guard
        peer = writer.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refused = guard.admit(ip)
        if refused is not None:
            _refuse(writer, guard, refused)
            return
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                guard.release(ip)

        connection = _Connection(
            self,
            release,
            self._app,
            asyncio.get_running_loop(),
            self._config,
            self._context,
            {},
            reader,
            writer,
        )
        try:
            await connection
        except asyncio.CancelledError:
            # Cut by close(): the connection's own task, which nothing awaits.
            pass
        finally:
            self._connections.pop(task, None)
            if connection.flow is not None:
                connection.flow.close()
            release()

    def _with_reset(self, app: _ASGI) -> _ASGI:
        """``app`` with the ``edgeproxy.reset`` extension on HTTP/2 requests, and each
        request's task kept (to cut at shutdown)."""

        async def serve(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            stream = getattr(send, "__self__", None)
            protocol = getattr(getattr(stream, "send", None), "__self__", None)
            if scope.get("http_version") == "2":
                if isinstance(protocol, H2Protocol) and stream is not None:
                    scope["extensions"]["edgeproxy.reset"] = lambda: self._reset(
                        protocol, stream.stream_id
                    )
            elif isinstance(protocol, H11Protocol):
                # Its connection tells the request when the client half-closes (queued).
                connection = getattr(protocol.send, "__self__", None)
                if isinstance(connection, _Connection):
                    scope["extensions"]["edgeproxy.queued"] = connection.queued
            task = asyncio.current_task()
            assert task is not None
            self._requests.add(task)
            try:
                await app(scope, receive, send)
            finally:
                self._requests.discard(task)

        return serve

    def _reset(self, protocol: H2Protocol, stream_id: int) -> None:
        task = asyncio.create_task(self._reset_when_sent(protocol, stream_id))
        self._resets.add(task)
        task.add_done_callback(self._resets.discard)

    @staticmethod
    async def _reset_when_sent(protocol: H2Protocol, stream_id: int) -> None:
        # What was written before the abort (an SSE error event) goes out first.
        buffer = protocol.stream_buffers.get(stream_id)
        if buffer is not None and len(buffer.buffer) > 0:
            try:
                await buffer.drain()
            except ConnectionResetError:
                return  # its client took nothing: reset already
        try:
            protocol.connection.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
        except h2.exceptions.ProtocolError:
            return  # closed already
        data = protocol.connection.data_to_send()
        if data:
            await protocol.send(RawData(data=data))

    async def stop_accepting(self) -> None:
        """Close the listening socket; connections open go on, and GOAWAY their clients
        once idle (hypercorn's ``terminated``)."""
        if self._server is not None:
            self._server.close()
        await self._context.terminated.set()

    def cut_requests(self) -> int:
        """Cancel every request still running; returns how many."""
        cut = 0
        for task in list(self._requests):
            if not task.done():
                task.cancel()
                cut += 1
        self.guard.shutdown_cuts += cut
        return cut

    async def close(self) -> None:
        """Close every connection and wait for them."""
        await self.stop_accepting()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        # Closed from the socket up, hypercorn's tasks end on their own; those that do not
        # within the wait are cancelled.
        for writer in list(self._connections.values()):
            writer.close()
        if self._connections:
            _, pending = await asyncio.wait(list(self._connections), timeout=5.0)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for task in list(self._resets):
            task.cancel()
