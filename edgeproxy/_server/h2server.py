"""The HTTP/2 client listener (``server.http2``): jh2 reads and writes the frames, the
pipeline serves each stream, and HTTP/1.1 on the same port is the default listener's.

One listening socket serves both protocols. A connection is told apart at once: over TLS
by ALPN; in cleartext (``server.h2c``) by its first bytes, the HTTP/2 preface (prior
knowledge) or an HTTP/1.1 request asking ``Upgrade: h2c``. Every other connection is
handed, with the bytes read so far, to the aiohttp handler of the default listener
(:class:`~edgeproxy._server.listener.EdgeRequestHandler`): HTTP/1.1 here is the same code,
with the same head checks, JSON errors, 505 and limits.

An HTTP/2 connection (:class:`H2Connection`) runs jh2's state machine; each request stream
becomes an :class:`H2Exchange`, served by the pipeline in a task of its own, cancelled
when its client resets the stream or leaves. On top of jh2, with the limits of
``[limits]``:

* **stream errors stay stream errors** (RFC 9113 §8.1.1): a malformed request (a bad field
  name or value, a connection-specific field, pseudo-headers out of order or missing, a
  ``content-length`` its DATA does not match, trailers that do not end the stream) gets
  RST_STREAM ``PROTOCOL_ERROR`` on its own stream, counted as ``h2_stream_errors``; jh2's
  own checks, which end the connection, are off;
* **the stream cap**: ``h2_max_concurrent_streams`` is advertised, and a stream past it gets
  RST_STREAM ``REFUSED_STREAM`` (safe to retry), counted as ``h2_refused_streams``;
* **abuse by cost**: streams the client cancels before their answer ends, and streams the
  proxy resets before any region sees them (malformed, over the cap), each cost one; past
  ``h2_max_premature_resets`` (the count halves every 30 seconds), GOAWAY
  ``ENHANCE_YOUR_CALM`` (rapid reset, CVE-2023-44487), however many cheap requests the
  connection also sends. An answer the proxy gives itself (a 429, a 4xx) costs nothing
  here: a browser's tabs share one connection;
* **floods**: PING, SETTINGS (one per entry), PRIORITY, unknown frames and empty DATA
  frames share ``h2_max_control_frames`` per 10 seconds; WINDOW_UPDATE frames get that
  many plus four per DATA frame the proxy sent and per stream the client opened in the
  window (a client reading a long answer sends one or two per frame, and may open each
  stream's window at once): past either, GOAWAY ``ENHANCE_YOUR_CALM``;
* **flow control pushes back**: an answer the client does not take waits in a bounded
  buffer (256 KiB per stream, 1 MiB per connection, each stream 32 KiB at least), then the
  pipeline's write waits and the proxy stops reading the region; a stream whose client
  takes nothing for ``server.h2_send_stall_timeout`` is reset (``CANCEL``), counted as
  ``h2_send_stalls``; a socket the client does not read stops every stream's writes;
* **framing** (:mod:`~edgeproxy._server.h2frames`): a frame declared past
  SETTINGS_MAX_FRAME_SIZE gets GOAWAY ``FRAME_SIZE_ERROR`` as its header arrives; of a
  frame not yet whole only what came is held, and a read costs what its bytes do;
* **the head deadline**: a header block must be whole within ``header_timeout`` once its
  first frame came, and so must a frame once its first byte came (a DATA frame within
  ``body_timeout``), streams open or not;
* **the header list**: SETTINGS_MAX_HEADER_LIST_SIZE is what HTTP/1.1 takes; a request past
  it, or past ``max_headers`` or ``max_header_size``, gets 431 on its stream alone;
* **idle**: a connection with no stream for ``keepalive_timeout`` gets GOAWAY and closes;
  one the client closed or reset frees its place under the caps at once.

Request bodies are bounded as on every front end (size, stall, rate, deadline). A
request's receive window (64 KiB) is given back as the pipeline reads its body, so an
upload pushes back too.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Protocol, cast

import jh2.config
import jh2.connection
import jh2.errors
import jh2.events
import jh2.exceptions
import jh2.settings
import jh2.stream
from aiohttp import web
from jh2.hyperframe.frame import GoAwayFrame
from multidict import CIMultiDict, CIMultiDictProxy

from edgeproxy._core.errors import ProxyError
from edgeproxy._core.exchange import Exchange, TlsInfo, Writer
from edgeproxy._core.response import Response, StreamResponse
from edgeproxy._protocol.bodies import BodyTooLarge, body_wait
from edgeproxy._server.h2frames import TOO_LARGE, FrameReader
from edgeproxy._server.h2request import (
    BadUpgrade,
    head_refusal,
    header_list_size,
    request_fields,
    upgrade_request,
)
from edgeproxy._server.headchecks import check_head, own_answer
from edgeproxy._server.listener import ConnectionGuard, GuardedSite, _raw_error
from edgeproxy._upstream.h2conn import (
    RESET_STREAMS_KEPT,
    ResetStreams,
    engine_config,
    peer_defaults,
    received_end_stream,
    take_data,
)
from edgeproxy._upstream.h2fields import (
    FRAME_HEADER,
    Malformed,
    field_name,
    field_value,
    header_frames,
)

__all__ = [
    "CONNECTION_BUFFER",
    "PREFACE",
    "STREAM_BUFFER",
    "H2Connection",
    "H2Exchange",
    "H2Site",
    "Served",
]

logger = logging.getLogger("edgeproxy")

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# What an answer may hold in the listener while its client does not take it: per stream,
# per connection, and what any stream may hold even when its connection is at its cap (two
# frames: a stream that is read is never held up by others that are not).
STREAM_BUFFER: Final = 256 * 1024
CONNECTION_BUFFER: Final = 1024 * 1024
_STREAM_FLOOR: Final = 2 * 2**14
_CONTROL_WINDOW: Final = 10.0
# The rapid-reset count halves every this many seconds: a long-lived browser connection
# whose user closes chats now and then never reaches the limit; a burst does.
_RESET_HALF_LIFE: Final = 30.0
_WINDOW_UPDATES_PER_EARNED: Final = 4
# A request's receive window; the connection's is this for every stream it may have
# open, so that one request whose body is not read never holds up the others'.
_STREAM_WINDOW: Final = 65535
_DEFAULT_WINDOW: Final = 65535
_CALM: Final = jh2.errors.ErrorCodes.ENHANCE_YOUR_CALM
_PROTOCOL_ERROR: Final = jh2.errors.ErrorCodes.PROTOCOL_ERROR
_REFUSED: Final = jh2.errors.ErrorCodes.REFUSED_STREAM
_CANCEL: Final = jh2.errors.ErrorCodes.CANCEL
_INTERNAL: Final = jh2.errors.ErrorCodes.INTERNAL_ERROR
_NO_ERROR: Final = jh2.errors.ErrorCodes.NO_ERROR
_FRAME_SIZE_ERROR: Final = jh2.errors.ErrorCodes.FRAME_SIZE_ERROR
_RST_STREAM: Final = 0x3
_DATA: Final = 0x0
_SEND_HEADERS: Final = jh2.connection.ConnectionInputs.SEND_HEADERS
_STREAM_SEND_HEADERS: Final = jh2.stream.StreamInputs.SEND_HEADERS
_STREAM_SEND_END_STREAM: Final = jh2.stream.StreamInputs.SEND_END_STREAM
_SEND_DATA: Final = jh2.connection.ConnectionInputs.SEND_DATA
_STREAM_SEND_DATA: Final = jh2.stream.StreamInputs.SEND_DATA
_RECV_HEADERS: Final = jh2.stream.StreamInputs.RECV_HEADERS
_SERVER_OPEN: Final = jh2.connection.ConnectionState.SERVER_OPEN
_SENT_RESET: Final = jh2.stream.StreamClosedBy.SEND_RST_STREAM
# Stream states a DATA frame from the server leaves as they are.
_SENDING: Final = frozenset(
    {jh2.stream.StreamState.OPEN, jh2.stream.StreamState.HALF_CLOSED_REMOTE}
)
_NO_BODY_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})
# Response fields HTTP/2 does not carry (RFC 9113 §8.2.2).
_CONNECTION_HEADERS: Final = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"}
)
_SWITCHING: Final = (
    b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
)
# How long an answer cut at shutdown may wait for the client to take its last event.
_CUT_WAIT: Final = 0.5


class Served(Protocol):
    """What the listener needs of the proxy it serves (``EdgeProxy`` is one): whether it is
    open, and the pipeline's entry."""

    @property
    def is_open(self) -> bool: ...

    async def serve_exchange(self, exchange: Exchange) -> StreamResponse: ...


# -- jh2, with per-stream errors ----------------------------------------------------------


class _MalformedRequest(jh2.events.Event):
    """A header block jh2 would end the connection for; this stream alone is reset."""

    def __init__(self, stream_id: int, reason: str) -> None:
        self.stream_id = stream_id
        self.reason = reason


class _SelfDependent(_MalformedRequest):
    """A PRIORITY frame, or the priority of a HEADERS frame, making a stream depend on
    itself: that stream's error (RFC 7540 §5.3.1), which jh2 makes the connection's."""


class _H2Stream(jh2.stream.H2Stream):
    """A jh2 stream whose malformed requests are stream errors (RFC 9113 §8.1.1);
    ``content-length`` is checked by :class:`H2Connection`, per stream."""

    def receive_headers(
        self, headers: Any, end_stream: bool, header_encoding: Any
    ) -> tuple[list[Any], list[jh2.events.Event]]:
        headers = list(headers)
        machine = self.state_machine
        reason = ""
        if machine.headers_received:
            if not end_stream:
                reason = "trailers did not end the stream"
        elif headers and headers[0][0] == b":status":
            # jh2 would take it for an informational response: a connection error.
            reason = "a response pseudo-header in a request"
        if not reason:
            return cast(
                "tuple[list[Any], list[jh2.events.Event]]",
                super().receive_headers(headers, end_stream, header_encoding),
            )
        if not machine.headers_received:
            machine.process_input(_RECV_HEADERS)  # open, so that it can be reset
        return [], [_MalformedRequest(self.stream_id, reason)]

    def _initialize_content_length(self, headers: Any) -> None:
        self._expected_content_length = None


class _H2Conn(jh2.connection.H2Connection):
    """jh2's server connection: streams of :class:`_H2Stream`, closed ones forgotten as
    they end, and no cap on open streams of its own (the listener refuses a stream past
    its cap with REFUSED_STREAM; jh2 would end the connection)."""

    def __init__(self, config: jh2.config.H2Configuration) -> None:
        super().__init__(config)
        self._closed_streams = ResetStreams(size_limit=RESET_STREAMS_KEPT)

    @property
    def open_inbound_streams(self) -> int:
        return 0

    def _receive_settings_frame(self, frame: Any) -> tuple[list[Any], list[Any]]:
        frames, events = super()._receive_settings_frame(frame)
        if "ACK" not in frame.flags:
            # What the frame cost to take is one per entry, repeated ones included.
            events[-1].entries = frame.body_len // 6
        return frames, events

    def _receive_priority_frame(self, frame: Any) -> tuple[list[Any], list[Any]]:
        if frame.depends_on != frame.stream_id:
            return cast("tuple[list[Any], list[Any]]", super()._receive_priority_frame(frame))
        events = self.state_machine.process_input(jh2.connection.ConnectionInputs.RECV_PRIORITY)
        return [], [*events, _SelfDependent(frame.stream_id, "a stream depends on itself")]

    def _begin_new_stream(self, stream_id: int, allowed_ids: Any) -> Any:
        stream = super()._begin_new_stream(stream_id, allowed_ids)
        stream.__class__ = _H2Stream
        return stream

    def forget(self, stream_id: int) -> None:
        """A closed stream leaves the table (jh2 sweeps it only when counting streams)."""
        stream = self.streams.get(stream_id)
        if stream is not None and stream.closed:
            del self.streams[stream_id]
            self._closed_streams[stream_id] = stream.closed_by


@functools.lru_cache(maxsize=4)
def _date(second: int) -> bytes:
    return email.utils.formatdate(second, usegmt=True).encode()


# -- one request stream ---------------------------------------------------------------------


class H2Exchange(Exchange):
    """One HTTP/2 request stream as the pipeline's exchange: the body as it arrives
    (bounded), the answer framed here, held within the stream's and the connection's
    buffer while the client's window is shut."""

    __slots__ = (
        "_active",
        "_body",
        "_conn",
        "_ended",
        "_head",
        "_more",
        "_received",
        "_reset_after",
        "_task",
        "_waiter",
        "answered",
        "bodiless",
        "end_requested",
        "expected",
        "gone",
        "id",
        "out",
        "refusal",
        "started",
        "taken_at",
        "unacked",
    )

    def __init__(
        self,
        conn: H2Connection,
        stream_id: int,
        method: str,
        target: str,
        scheme: str,
        headers: CIMultiDictProxy[str],
        length: int | None,
        ended: bool,
    ) -> None:
        self._conn = conn
        self.id = stream_id
        self.native = None
        self.method = method
        self.target = target
        self.headers = headers
        self.client = conn.ip or None
        self.scheme = "https" if conn.tls is not None else (scheme or "http")
        self.version = "2"
        self.host = headers.get("Host", "")
        self.tls = conn.tls
        self.expected = length
        self.content_length = length if length is not None else (0 if ended else None)
        self.body_exists = not ended and (
            bool(length) if length is not None else method not in _NO_BODY_METHODS
        )
        self._more = not ended
        self._body: deque[bytes] = deque()
        self._received = 0
        self._active = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._head: bytes = b""  # the answer's HEADERS, sent with its first DATA
        self._ended = False  # END_STREAM sent
        self._reset_after = False  # reset once what is held has gone out
        self.unacked = 0  # request bytes read by the pipeline, not yet given back
        self.out = bytearray()  # the answer's bytes waiting for the client's window
        self.end_requested = False
        self.started = False
        self.answered = False  # the answer ended (END_STREAM or reset by the proxy)
        self.gone = False
        self.taken_at = conn.loop.time()
        # An answer to HEAD is its head alone (RFC 9110 §9.3.2): clients reset a stream
        # that carries DATA after it.
        self.bodiless = method == "HEAD"
        self.refusal: ProxyError | None = None  # the listener's answer, before the pipeline

    # -- the request body ----------------------------------------------------------

    def body_chunk(self, data: bytes, flow: int, ended: bool) -> str | None:
        """DATA for this request, as it arrives; what is wrong with it, if anything."""
        self._received += len(data)
        expected = self.expected
        if expected is not None and (
            self._received > expected or (ended and self._received != expected)
        ):
            return f"{self._received} bytes of DATA for a content-length of {expected}"
        if data:
            self._body.append(data)
        if flow:
            self.unacked += flow
        if ended:
            self._more = False
        self._wake()
        return None

    def body_ended(self) -> str | None:
        expected = self.expected
        if expected is not None and self._received != expected:
            return f"{self._received} bytes of DATA for a content-length of {expected}"
        self._more = False
        self._wake()
        return None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def read_chunk(self) -> bytes:
        conn = self._conn
        limits = conn.guard.limits
        taken = 0
        while True:
            if self.gone:
                raise ConnectionResetError("the client reset the stream")
            body = self._body
            if body:
                chunk = body.popleft()
                taken = len(chunk)
                break
            if not self._more:
                return b""
            await self._next_chunk()
        limit = limits.max_body_size
        if limit and self._received > limit:
            too_large = BodyTooLarge(limit)
            conn.guard.count_body_error(too_large)
            raise too_large
        if self.unacked:
            conn.acknowledge(self.id, self.unacked if not body else taken)
            self.unacked = 0 if not body else self.unacked - taken
        return chunk

    async def _next_chunk(self) -> None:
        """Until more of the body comes, within its bounds (the time spent here is all
        that counts: time the proxy did not read is not the client's)."""
        guard = self._conn.guard
        limits = guard.limits
        grace = min(limits.body_rate_grace, 1.0) if guard.draining else limits.body_rate_grace
        waiter = self._waiter = self._conn.loop.create_future()
        try:
            _, waited = await body_wait(
                waiter, limits, active=self._active, received=self._received, rate_grace=grace
            )
        except ProxyError as error:
            guard.count_body_error(error)
            raise
        finally:
            self._waiter = None
        self._active += waited

    def client_gone(self) -> bool:
        return self.gone

    # -- the answer -----------------------------------------------------------------

    async def start(
        self, status: int, headers: CIMultiDict[str], length: int | None, close: bool
    ) -> Writer:
        if self.gone:
            raise ConnectionResetError("the client reset the stream")
        conn = self._conn
        fields = [(b":status", str(status).encode(), False)]
        for name, value in headers.items():
            lowered = name.lower()
            if lowered not in _CONNECTION_HEADERS:
                fields.append((lowered.encode("latin-1"), value.encode("utf-8"), False))
        if length is not None and "Content-Length" not in headers:
            fields.append((b"content-length", str(length).encode(), False))
        if "Date" not in headers:
            fields.append((b"date", _date(int(time.time())), False))
        if conn.server_header and "Server" not in headers:
            fields.append((b"server", conn.server_header, False))
        self.started = True
        self._head = conn.encode_head(fields)
        if length is None or self.bodiless:
            # A stream: its head goes now, not with its first event.
            conn.send_head(self, end=self.bodiless)
        return self.write

    async def write(self, data: bytes) -> None:
        if self.gone:
            raise ConnectionResetError("the client reset the stream")
        if self.bodiless:
            return
        conn = self._conn
        if self._head:
            conn.send_head(self, end=False)
        if not self.out and conn.fast_data(self, data, False):
            return
        while data:
            room = conn.room(self) - len(self.out)
            if room >= len(data):
                conn.send_body(self, data)
                return
            if room > 0:
                conn.send_body(self, data[:room])
                data = data[room:]
            # Held to its bound: what is left waits for the client to take some.
            await conn.wait_room(self)

    async def end(self, data: bytes = b"") -> None:
        if self.gone:
            raise ConnectionResetError("the client reset the stream")
        if self.bodiless:
            return
        conn = self._conn
        if self._head:
            if not data:
                conn.send_head(self, end=True)
                return
            conn.send_head(self, end=False)
        if not self.out and data and conn.fast_data(self, data, True):
            return
        if len(data) > conn.room(self) - len(self.out):
            await self.write(data)  # held within bounds, piece by piece
            data = b""
        # The last piece carries END_STREAM.
        self.end_requested = True
        conn.send_body(self, data)
        if not self.answered:
            await conn.wait_sent(self)

    def abort(self) -> None:
        self._conn.reset_when_sent(self)

    async def cut(self, data: bytes) -> None:
        if not self.gone and self.started:
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                async with asyncio.timeout(_CUT_WAIT):
                    await self.write(data)
        self.abort()


# -- one HTTP/2 connection ------------------------------------------------------------------


class H2Connection(asyncio.Protocol):
    """One client connection speaking HTTP/2: jh2's state, its streams, its counters."""

    def __init__(
        self,
        site: H2Site,
        transport: asyncio.Transport,
        ip: str,
        release: Callable[[], None],
    ) -> None:
        self.site = site
        self.guard = guard = site.guard
        limits = guard.limits
        self.loop = asyncio.get_running_loop()
        self.transport = transport
        self.ip = ip
        self._release = release
        self.server_header = guard.server_header.encode("ascii") if guard.server_header else b""
        ssl_object = transport.get_extra_info("ssl_object")
        self.tls = (
            TlsInfo(ssl_object.version(), "h2", ssl_object.server_hostname)
            if ssl_object is not None
            else None
        )
        # Requests are checked per stream here (request_fields, head_refusal).
        h2 = self.h2 = _H2Conn(engine_config(client_side=False))
        self.max_streams = limits.h2_max_concurrent_streams
        list_size = header_list_size(limits)
        h2.local_settings = jh2.settings.Settings(
            client=False,
            initial_values={
                jh2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams,
                jh2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: list_size,
                jh2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _STREAM_WINDOW,
                jh2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL: 0,
            },
        )
        # A block past the size advertised is decoded still, to answer 431 on its stream
        # alone (the HPACK state must stay whole); twice past it, the decoder gives up and
        # the connection ends, so that an HPACK bomb costs no more.
        h2.decoder.max_header_list_size = 2 * list_size
        h2.remote_settings = peer_defaults(peer_is_client=True)
        self.streams: dict[int, H2Exchange] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.blocked: set[H2Exchange] = set()  # answers waiting for a window or the socket
        self.held = 0  # answer bytes held for this connection's clients
        self._room_waiters: set[asyncio.Future[None]] = set()
        self.writable = True
        self.closing = False
        self.draining = False
        self._flush_scheduled = False
        self._reader = FrameReader(self._fast_body, self._receive)
        now = self.loop.time()
        self._window_start = now
        self._controls = 0
        self._window_updates = 0
        # DATA frames sent and streams opened in the window: each lets the client send a
        # few WINDOW_UPDATEs.
        self._earned = 0
        self._cost = 0.0
        self._cost_at = now
        self._block_since: float | None = None  # a header block waits for CONTINUATION
        self._frame_since: float | None = None  # a frame (or the preface) is not yet whole
        self._timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = now
        self.last_stream = 0

    # -- the start --------------------------------------------------------------------

    def begin(self, data: bytes, upgrade: tuple[bytes, list[tuple[bytes, bytes]]] | None) -> None:
        """Take the connection over, with the bytes read so far; ``upgrade``: the
        ``HTTP2-Settings`` and header block of an HTTP/1.1 request that upgraded it."""
        self.guard.connections.add(self)
        h2 = self.h2
        try:
            if upgrade is None:
                h2.initiate_connection()
            else:
                # The client's settings first: a 101 cannot be taken back.
                h2.initiate_upgrade_connection(upgrade[0])
                self.transport.write(_SWITCHING)
        except jh2.exceptions.ProtocolError:
            self.guard.h2_protocol_errors += 1
            self.close()
            return
        h2.increment_flow_control_window(self.max_streams * _STREAM_WINDOW - _DEFAULT_WINDOW)
        self.flush()
        self._arm()
        if upgrade is not None:
            self._request(1, upgrade[1], ended=True)
        if data:
            self.data_received(data)

    # -- asyncio.Protocol -----------------------------------------------------------------

    @property
    def input_held(self) -> int:
        """Bytes held of a frame not yet whole (one frame at most)."""
        return self._reader.held

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        h2 = self.h2
        preface = h2.incoming_buffer._preamble_len
        if preface:
            # jh2 checks the preface; the frames after it are framed here.
            if not self._receive(data[:preface]):
                return
            data = data[preface:]
        walked = self._reader.feed(data, h2.max_inbound_frame_size) if data else 0
        if walked < 0:
            if walked == TOO_LARGE:
                self._frame_too_large()
            return
        if self._controls or self._window_updates:
            self._check_abuse()
        if self.closing:
            return
        self._partial(walked)
        self.flush_soon()

    def _dropped_body(self, stream_id: int, length: int) -> bool:
        """DATA for a request the proxy reset (refused, malformed, answered): the client sent
        it before it saw the reset. Counted against the connection's window and given back,
        without the second reset jh2 would send (one that would hide the first's reason)."""
        h2 = self.h2
        window = h2._inbound_flow_control_window_manager
        if (
            h2._closed_streams.get(stream_id) is not _SENT_RESET
            or length > h2.max_inbound_frame_size
            or window.current_window_size < length
            or h2.incoming_buffer._headers_buffer
        ):
            return False
        window.current_window_size -= length
        if not length:
            self._controls += 1
        else:
            h2.acknowledge_received_data(length, stream_id)
        return True

    def _receive(self, frames: bytes) -> bool:
        """Hand bytes to jh2 and act on its events; False once the connection ends."""
        try:
            events = self.h2.receive_data(frames)
        except jh2.exceptions.ProtocolError as exc:
            self.guard.h2_protocol_errors += 1
            logger.info("HTTP/2 client %s broke the protocol: %s; closing", self.ip, exc)
            self.close()  # jh2 queued its GOAWAY
            return False
        for event in events:
            self._handle(event)
            if self.closing:
                return False
        if events:
            self._check_abuse()
        return not self.closing

    def _fast_body(self, stream_id: int, buf: bytes, start: int, end: int, last: int) -> bool:
        """A DATA frame (not padded) of a request body taken without jh2's frame objects,
        state machines and events; False leaves it to jh2. ``last``: END_STREAM.

        Taken only where jh2 would accept it and do nothing but count it (and, for the
        last, move the stream's state on): the connection open, no header block in
        progress, the frame within the size limit, the request one of ours and open, and
        both receive windows with room for it. jh2's two windows are charged, and its
        stream state changed, as jh2 does.
        """
        stream = self.streams.get(stream_id)
        h2 = self.h2
        length = end - start
        if stream is None:
            return self._dropped_body(stream_id, length)
        h2stream = take_data(
            h2, stream_id, length, connection_open=_SERVER_OPEN, after_headers=False
        )
        if h2stream is None:
            return False
        if last:
            received_end_stream(h2stream.state_machine)
        elif not length:
            self._controls += 1  # an empty DATA frame that ends nothing: counted
        problem = stream.body_chunk(buf[start:end] if length else b"", length, bool(last))
        if problem is not None:
            self._malformed(stream_id, problem, length)
        return True

    def eof_received(self) -> bool | None:
        return None  # the client is gone: connection_lost does the rest

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closing = True
        self.guard.connections.discard(self)
        self.site.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for stream in list(self.streams.values()):
            self._gone(stream)
        self.held = 0
        self._wake_all()
        self._release()

    def pause_writing(self) -> None:
        self.writable = False

    def resume_writing(self) -> None:
        self.writable = True
        self._push_blocked()

    # -- events -----------------------------------------------------------------------------

    def _handle(self, event: jh2.events.Event) -> None:
        kind = type(event)
        if kind is jh2.events.DataReceived:
            stream = self.streams.get(event.stream_id)
            if stream is None:
                if not event.data and event.stream_ended is None:
                    self._controls += 1
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                return
            ended = event.stream_ended is not None
            if not event.data and not ended:
                self._controls += 1  # an empty DATA frame that ends nothing: counted
            problem = stream.body_chunk(event.data, event.flow_controlled_length, ended)
            if problem is not None:
                self._malformed(event.stream_id, problem, event.flow_controlled_length)
        elif kind is jh2.events.RequestReceived:
            self._request(event.stream_id, event.headers, ended=event.stream_ended is not None)
            if event.priority_updated is not None:
                self._controls += 1
        elif kind is jh2.events.StreamEnded:
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                problem = stream.body_ended()
                if problem is not None:
                    self._malformed(event.stream_id, problem, 0)
        elif kind is jh2.events.WindowUpdated:
            self._window_updates += 1
            if event.stream_id == 0:
                self._push_blocked()
            else:
                stream = self.streams.get(event.stream_id)
                if stream is not None and stream.out:
                    self._push(stream)
        elif kind is jh2.events.StreamReset:
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                if not stream.answered:
                    self._spend()  # cancelled before its answer ended
                self._gone(stream)
        elif kind is _MalformedRequest:
            self._malformed(event.stream_id, event.reason, 0)
        elif kind is _SelfDependent:
            self._controls += 1
            self._self_dependent(event.stream_id, event.reason)
        elif kind is jh2.events.TrailersReceived:
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                problem = None
                try:
                    for name, value in event.headers:
                        if name[:1] == b":":
                            raise Malformed("a pseudo-header in trailers")
                        field_name(name)
                        field_value(name, value)
                except Malformed as exc:
                    problem = str(exc)
                problem = problem or stream.body_ended()
                if problem is not None:
                    self._malformed(event.stream_id, problem, 0)
        elif kind is jh2.events.RemoteSettingsChanged:
            self._controls += max(1, event.entries)
            self._push_blocked()  # a larger initial window opens every stream's
        elif kind in (
            jh2.events.PingReceived,
            jh2.events.PriorityUpdated,
            jh2.events.UnknownFrameReceived,
        ):
            self._controls += 1
        elif kind is jh2.events.ConnectionTerminated:
            # The client is leaving: what it started is cancelled; the socket closes.
            self.close()

    def _request(self, stream_id: int, raw: Any, *, ended: bool) -> None:
        self.last_stream = stream_id
        self._earned += 1  # a client may open each stream's window at once
        if self.draining:
            # Past the GOAWAY's last stream: never processed, the client retries it.
            with contextlib.suppress(jh2.exceptions.ProtocolError):
                self.h2.reset_stream(stream_id, _REFUSED)
            self.h2.forget(stream_id)
            return
        if len(self.streams) >= self.max_streams:
            self.guard.h2_refused_streams += 1
            self._refuse(stream_id, _REFUSED)
            return
        try:
            method, scheme, target, headers, length = request_fields(raw)
        except Malformed as exc:
            self._malformed(stream_id, str(exc), 0)
            return
        stream = H2Exchange(self, stream_id, method, target, scheme, headers, length, ended)
        stream.refusal = head_refusal(raw, self.guard.limits)
        if ended and length:
            self._malformed(stream_id, f"no DATA for a content-length of {length}", 0)
            return
        self.streams[stream_id] = stream
        self._idle_since = None
        task = self.loop.create_task(self.site.serve(stream))
        stream._task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _refuse(self, stream_id: int, code: int) -> None:
        with contextlib.suppress(jh2.exceptions.ProtocolError):
            self.h2.reset_stream(stream_id, code)
        self.h2.forget(stream_id)
        self._spend()

    def _malformed(self, stream_id: int, reason: str, flow: int) -> None:
        """A malformed request (RFC 9113 §8.1.1): its stream alone is reset."""
        self.guard.h2_stream_errors += 1
        logger.debug("HTTP/2 client %s: stream %d malformed: %s", self.ip, stream_id, reason)
        stream = self.streams.get(stream_id)
        if flow:
            # Counted against the connection's window, never to be read.
            self.h2.acknowledge_received_data(flow, stream_id)
        if stream is not None:
            stream.answered = True
            self._gone(stream)
        self._refuse(stream_id, _PROTOCOL_ERROR)

    def _self_dependent(self, stream_id: int, reason: str) -> None:
        h2 = self.h2
        if stream_id in h2.streams:
            self._malformed(stream_id, reason, 0)
        elif stream_id > h2.highest_inbound_stream_id:
            # An idle stream, which jh2 will not reset: the reset is written here.
            self.guard.h2_stream_errors += 1
            payload = int(_PROTOCOL_ERROR).to_bytes(4, "big")
            h2._data_to_send += FRAME_HEADER.pack(0, 4, _RST_STREAM, 0, stream_id) + payload
            self.flush_soon()

    def _gone(self, stream: H2Exchange) -> None:
        """The stream ended for its client (reset, or the connection gone): its request is
        cancelled, what it held dropped."""
        stream.gone = True
        self._drop(stream)
        stream._wake()
        task = stream._task
        if task is not None and not task.done():
            task.cancel()

    def _drop(self, stream: H2Exchange) -> None:
        if self.streams.pop(stream.id, None) is None:
            return
        if stream.out:
            self._taken(len(stream.out))
            stream.out = bytearray()
        self.blocked.discard(stream)
        if stream.unacked:
            with contextlib.suppress(jh2.exceptions.ProtocolError):
                self.h2.acknowledge_received_data(stream.unacked, stream.id)
            stream.unacked = 0
        if stream._ended and stream._more and not stream.gone:
            # Answered whole before the request's body ended: the client may stop sending
            # it (RFC 9113 §8.1), and the stream does not stay half open.
            with contextlib.suppress(jh2.exceptions.ProtocolError):
                self.h2.reset_stream(stream.id, _NO_ERROR)
            self.flush_soon()
        self.h2.forget(stream.id)
        if not self.streams:
            self._idle_since = self.loop.time()
            if self.draining:
                self.close()

    # -- abuse ------------------------------------------------------------------------------

    def _spend(self) -> None:
        """One stream the proxy refused, or the client cancelled, before its answer ended."""
        now = self.loop.time()
        self._cost = self._cost * 0.5 ** ((now - self._cost_at) / _RESET_HALF_LIFE) + 1
        self._cost_at = now

    def _check_abuse(self) -> None:
        limits = self.guard.limits
        if self._cost > limits.h2_max_premature_resets:
            self.guard.h2_rapid_resets += 1
            self._abuse("too many streams cancelled or refused before their answer (rapid reset)")
            return
        now = self.loop.time()
        if now - self._window_start >= _CONTROL_WINDOW:
            self._window_start = now
            self._controls = self._window_updates = self._earned = 0
            return
        budget = limits.h2_max_control_frames
        if self._controls > budget or (
            self._window_updates > budget + _WINDOW_UPDATES_PER_EARNED * self._earned
        ):
            self.guard.h2_control_floods += 1
            self._abuse("too many control, WINDOW_UPDATE, empty or unknown frames")

    def _frame_too_large(self) -> None:
        """A frame declared past SETTINGS_MAX_FRAME_SIZE (RFC 9113 §4.2): the connection's
        error, decided on its header, before any of the frame is kept."""
        self.guard.h2_protocol_errors += 1
        logger.info("HTTP/2 client %s sent a frame past the size limit; closing", self.ip)
        with contextlib.suppress(jh2.exceptions.ProtocolError):
            self.h2.close_connection(error_code=_FRAME_SIZE_ERROR, last_stream_id=self.last_stream)
        self.close()

    def _abuse(self, reason: str) -> None:
        logger.warning("HTTP/2 client %s: %s; closing", self.ip, reason)
        with contextlib.suppress(jh2.exceptions.ProtocolError):
            self.h2.close_connection(error_code=_CALM, last_stream_id=self.last_stream)
        self.close()

    # -- the answers --------------------------------------------------------------------------

    def encode_head(self, fields: list[tuple[bytes, bytes, bool]]) -> bytes:
        """The answer's header block, by the connection's HPACK encoder (jh2's compiled one,
        or its pure-Python fallback: both take ``(name, value, sensitive)``)."""
        return cast(bytes, self.h2.encoder.encode(fields))

    def send_head(self, stream: H2Exchange, *, end: bool) -> None:
        block, stream._head = stream._head, b""
        h2 = self.h2
        h2stream = h2.streams.get(stream.id)
        if h2stream is None:
            return
        h2.state_machine.process_input(_SEND_HEADERS)
        h2stream.state_machine.process_input(_STREAM_SEND_HEADERS)
        if end:
            h2stream.state_machine.process_input(_STREAM_SEND_END_STREAM)
            self._finished(stream)
        h2._data_to_send += header_frames(stream.id, block, end, h2.max_outbound_frame_size)
        self.flush_soon()
        if end:
            self._drop(stream)

    def fast_data(self, stream: H2Exchange, data: bytes, end: bool) -> bool:
        """Send ``data`` as one DATA frame now, when nothing of the stream waits and the
        windows, the frame size and the socket allow it (an SSE event, a JSON body): jh2's
        windows are charged as jh2 does; its state machines are left alone, as a DATA frame
        that does not end the stream does not move them. False: take the general way."""
        size = len(data)
        h2 = self.h2
        h2stream = h2.streams.get(stream.id)
        if (
            not self.writable
            or stream.answered
            or h2stream is None
            or size > h2.max_outbound_frame_size
            or size > h2.outbound_flow_control_window
            or size > h2stream.outbound_flow_control_window
            or h2stream.state_machine.state not in _SENDING
            or h2.state_machine.state is not _SERVER_OPEN
        ):
            return False
        h2stream.outbound_flow_control_window -= size
        h2.outbound_flow_control_window -= size
        self._earned += 1
        stream.taken_at = self.loop.time()
        frame = FRAME_HEADER.pack(size >> 16, size & 0xFFFF, 0, 1 if end else 0, stream.id)
        if end:
            h2stream.state_machine.process_input(_STREAM_SEND_END_STREAM)
        pending = h2._data_to_send
        if pending:
            # Frames queued before (HEADERS, replies) go first, in the same write.
            pending += frame
            pending += data
            self.flush()
        elif not self.transport.is_closing():
            self.transport.write(frame + data)
        if end:
            self._finished(stream)
            self._drop(stream)
        return True

    def send_body(self, stream: H2Exchange, data: bytes) -> None:
        """Queue ``data`` of ``stream``'s answer and send what the windows allow."""
        if data:
            stream.out += data
            self.held += len(data)
            guard = self.guard
            guard.h2_buffered += len(data)
            if guard.h2_buffered > guard.h2_buffered_peak:
                guard.h2_buffered_peak = guard.h2_buffered
        self._push(stream)

    def _push(self, stream: H2Exchange) -> None:
        """Send as much of ``stream``'s answer as the windows and the socket allow."""
        if not self.writable or stream.gone or stream.answered:
            if stream.out or stream.end_requested:
                self.blocked.add(stream)
            return
        h2 = self.h2
        h2stream = h2.streams.get(stream.id)
        if h2stream is None:
            return
        out = stream.out
        size = len(out)
        sent = 0
        frame = h2.max_outbound_frame_size
        buffer = h2._data_to_send
        while sent < size:
            window = min(h2stream.outbound_flow_control_window, h2.outbound_flow_control_window)
            if window <= 0:
                break
            piece = min(window, frame, size - sent)
            last = stream.end_requested and sent + piece == size
            h2.state_machine.process_input(_SEND_DATA)
            h2stream.state_machine.process_input(_STREAM_SEND_DATA)
            if last:
                h2stream.state_machine.process_input(_STREAM_SEND_END_STREAM)
            h2stream.outbound_flow_control_window -= piece
            h2.outbound_flow_control_window -= piece
            buffer += FRAME_HEADER.pack(piece >> 16, piece & 0xFFFF, 0, 1 if last else 0, stream.id)
            buffer += out[sent : sent + piece]
            sent += piece
            self._earned += 1
        if sent:
            del out[:sent]
            stream.taken_at = self.loop.time()
            self._taken(sent)
        if not out and stream.end_requested and not stream.answered:
            if not sent:  # nothing left to carry END_STREAM: an empty DATA frame does
                h2.state_machine.process_input(_SEND_DATA)
                h2stream.state_machine.process_input(_STREAM_SEND_DATA)
                h2stream.state_machine.process_input(_STREAM_SEND_END_STREAM)
                buffer += FRAME_HEADER.pack(0, 0, 0, 1, stream.id)
            self._finished(stream)
        if out or (stream.end_requested and not stream.answered):
            self.blocked.add(stream)
        else:
            self.blocked.discard(stream)
        self.flush_soon()
        if stream.answered:
            self._drop(stream)
        elif stream._reset_after and not out:
            self._reset(stream, _INTERNAL)

    def _finished(self, stream: H2Exchange) -> None:
        stream.answered = True
        stream._ended = True
        self._wake_all()

    def _push_blocked(self) -> None:
        for stream in list(self.blocked):
            self._push(stream)

    def _taken(self, size: int) -> None:
        self.held -= size
        self.guard.h2_buffered -= size
        self._wake_all()

    def _wake_all(self) -> None:
        waiters, self._room_waiters = self._room_waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def room(self, stream: H2Exchange) -> int:
        """How much of its answer ``stream`` may hold now."""
        held = len(stream.out)
        return max(_STREAM_FLOOR, min(STREAM_BUFFER, CONNECTION_BUFFER - self.held + held))

    async def wait_room(self, stream: H2Exchange) -> None:
        """Until ``stream`` may hold more (:meth:`room`); past the stall timeout with
        nothing taken by its client, the stream is reset."""
        while len(stream.out) >= self.room(stream) and not stream.gone:
            await self._wait(stream)
        if stream.gone:
            raise ConnectionResetError("the client reset the stream")

    async def wait_sent(self, stream: H2Exchange) -> None:
        """Until the whole answer has gone out (its END_STREAM with it)."""
        while not stream.answered and not stream.gone:
            await self._wait(stream)
        if stream.gone and not stream._ended:
            raise ConnectionResetError("the client reset the stream")

    async def _wait(self, stream: H2Exchange) -> None:
        left = stream.taken_at + self.site.send_stall_timeout - self.loop.time()
        if left <= 0:
            self.guard.h2_send_stalls += 1
            logger.info(
                "HTTP/2 client %s took nothing of stream %d for %ss; resetting it",
                self.ip,
                stream.id,
                self.site.send_stall_timeout,
            )
            self._reset(stream, _CANCEL)
            raise ConnectionResetError("the client took nothing of its answer (stalled stream)")
        waiter = self.loop.create_future()
        self._room_waiters.add(waiter)
        try:
            async with asyncio.timeout(left):
                await waiter
        except TimeoutError:
            pass
        finally:
            self._room_waiters.discard(waiter)

    def reset_when_sent(self, stream: H2Exchange) -> None:
        """End ``stream``'s answer so that it cannot look complete: RST_STREAM once what
        was written before (an SSE error event) has gone out."""
        if stream.gone or stream.answered:
            return
        if stream._head:
            self.send_head(stream, end=False)
        if stream.out:
            stream._reset_after = True
        else:
            self._reset(stream, _INTERNAL)

    def _reset(self, stream: H2Exchange, code: int) -> None:
        with contextlib.suppress(jh2.exceptions.ProtocolError):
            self.h2.reset_stream(stream.id, code)
        stream.answered = True
        self._gone(stream)
        self.flush_soon()

    def acknowledge(self, stream_id: int, size: int) -> None:
        """The pipeline read ``size`` bytes of the request: its client may send more."""
        if self.closing:
            return
        with contextlib.suppress(jh2.exceptions.ProtocolError):
            self.h2.acknowledge_received_data(size, stream_id)
        self.flush_soon()

    def flush_soon(self) -> None:
        """Write what jh2 queued at the end of this loop turn: the frames of every stream
        and reply made meanwhile go out in one write."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        data = self.h2.data_to_send()
        if data and not self.transport.is_closing():
            self.transport.write(data)

    # -- timers ---------------------------------------------------------------------------

    def _partial(self, walked: int) -> None:
        """The deadlines of what is not yet whole: a header block waiting for its
        CONTINUATION frames, from its first frame; a frame (or the preface), from its first
        byte (``walked``: whole frames came in this read, so a new one started in it)."""
        h2 = self.h2
        now: float | None = None
        if h2.incoming_buffer._headers_buffer:
            if self._block_since is None:
                self._block_since = now = self.loop.time()
        else:
            self._block_since = None
        if self._reader.held or h2.incoming_buffer._preamble_len:
            if walked or self._frame_since is None:
                self._frame_since = now if now is not None else self.loop.time()
        else:
            self._frame_since = None

    def _arm(self) -> None:
        self._timer = self.loop.call_later(1.0, self._tick)

    def _tick(self) -> None:
        """Once a second: the deadlines of a header block and a frame, and the idle
        timeout."""
        self._timer = None
        if self.closing:
            return
        limits = self.guard.limits
        now = self.loop.time()
        if self._block_since is not None and now - self._block_since >= limits.header_timeout:
            self.guard.header_timeouts += 1
            self.close()
            return
        since = self._frame_since
        if since is not None:
            # The frames that must come whole quickly are small; a DATA frame is part of a
            # body, whose stall bound it gets.
            data = self._reader.kind == _DATA
            if now - since >= (limits.body_timeout if data else limits.header_timeout):
                if data:
                    self.guard.body_timeouts += 1
                else:
                    self.guard.header_timeouts += 1
                logger.info("HTTP/2 client %s left a frame unfinished; closing", self.ip)
                self.close()
                return
        idle = self._idle_since
        if idle is not None and now - idle >= limits.keepalive_timeout:
            self.close()
            return
        self._arm()

    # -- the end ----------------------------------------------------------------------------

    def goaway(self) -> None:
        """The proxy drains: no new stream; those open finish, then the connection closes."""
        if self.closing or self.draining:
            return
        self.draining = True
        # Queued by hand: jh2's close_connection() would close its state machine, and the
        # streams open could send nothing more, nor the client its WINDOW_UPDATEs.
        frame = GoAwayFrame(0)
        frame.last_stream_id = self.last_stream
        frame.error_code = _NO_ERROR
        self.h2._data_to_send += frame.serialize()
        self.flush_soon()
        if not self.streams:
            self.close()

    def check_body(self) -> None:
        """The proxy drains: bodies still arriving get the short rate grace (read at the
        next wait)."""

    def cancel_request(self) -> bool:
        """The grace period is over: cancel what still runs."""
        cut = False
        for task in list(self.tasks):
            if not task.done():
                task.cancel()
                cut = True
        return cut

    def close(self) -> None:
        """Send what is queued (a GOAWAY), then close the socket."""
        if self.closing:
            return
        self.closing = True
        for stream in list(self.streams.values()):
            self._gone(stream)
        with contextlib.suppress(jh2.exceptions.ProtocolError):
            if self.h2.state_machine.state is not jh2.connection.ConnectionState.CLOSED:
                self.h2.close_connection(error_code=_NO_ERROR, last_stream_id=self.last_stream)
        data = self.h2.data_to_send()
        if data and not self.transport.is_closing():
            self.transport.write(data)
        self.transport.close()


# -- telling the protocols apart -----------------------------------------------------------


class _Front(asyncio.Protocol):
    """A new connection on the listener until it is told apart: HTTP/2 (ALPN, the preface,
    an upgrade) becomes an :class:`H2Connection`, anything else the HTTP/1.1 handler."""

    __slots__ = ("_accepted", "_buffer", "_counted", "_ip", "_site", "_timer", "_transport")

    def __init__(self, site: H2Site) -> None:
        self._site = site
        self._buffer = b""
        self._counted = False
        self._ip = ""
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._accepted = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        site = self._site
        self._accepted = asyncio.get_running_loop().time()
        guard = site.guard
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        ip = self._ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refused = guard.admit(ip)
        if refused is not None:
            _refuse(self._transport, guard, refused)
            return
        self._counted = True
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            if ssl_object.selected_alpn_protocol() == "h2":
                self._h2(b"", None)
            else:
                self._http1(b"")
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(guard.limits.header_timeout, self._too_slow)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data
        if PREFACE.startswith(buffer[:24]):
            if len(buffer) >= len(PREFACE):
                self._h2(buffer, None)
            else:
                self._buffer = buffer
            return
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if (
                len(buffer) < self._site.upgrade_head_max
                and b"\n" in buffer
                # A bare LF is no upgrade's: the handler answers it at once.
                and buffer.count(b"\n") == buffer.count(b"\r\n")
            ):
                # An HTTP/1.1 head on its way: whole, it may ask to upgrade.
                self._buffer = buffer
                return
            self._http1(buffer)
            return
        try:
            upgrade = upgrade_request(buffer[:end])
        except BadUpgrade as exc:
            self._bad_upgrade(str(exc))
            return
        if upgrade is None:
            self._http1(buffer)
        else:
            self._h2(buffer[end + 4 :], upgrade)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_timer()
        if self._counted:
            self._counted = False
            self._site.guard.release(self._ip)

    def _too_slow(self) -> None:
        # The handler answers a head that did not come in time (408), as on HTTP/1.1.
        self._timer = None
        if self._transport is not None and self._counted:
            self._http1(self._buffer)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _bad_upgrade(self, reason: str) -> None:
        """A 400 in HTTP/1.1, and the connection closes: what followed the head was meant
        for HTTP/2."""
        self._stop_timer()
        transport = self._transport
        assert transport is not None
        server = self._site.guard.server_header
        transport.write(_raw_error(400, f"Bad h2c upgrade: {reason}.", "bad_upgrade", server))
        transport.close()

    def _http1(self, data: bytes) -> None:
        """The default listener's handler takes the connection and what was read of it."""
        self._stop_timer()
        transport = self._transport
        assert transport is not None
        # The handler counts the connection itself.
        self._counted = False
        self._site.guard.release(self._ip)
        handler = self._site.handler_factory()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if data and not transport.is_closing():
            handler.data_received(data)
        handler.head_since(self._accepted)

    def _h2(self, data: bytes, upgrade: tuple[bytes, list[tuple[bytes, bytes]]] | None) -> None:
        self._stop_timer()
        transport = self._transport
        assert transport is not None
        self._counted = False  # the connection's to give back now
        site = self._site
        ip = self._ip
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                site.guard.release(ip)

        conn = H2Connection(site, transport, ip, release)
        transport.set_protocol(conn)
        site.connections.add(conn)
        conn.begin(data, upgrade)


def _refuse(transport: asyncio.Transport, guard: ConnectionGuard, message: str) -> None:
    """Answer a connection over a cap and close it, reading nothing of it: a client that
    negotiated h2 by ALPN gets HTTP/2's refusal, any other the aiohttp listener's 503. In
    cleartext an h2c client with prior knowledge gets the 503 too: telling it apart would
    mean waiting for its first bytes."""
    tls = transport.get_extra_info("ssl_object")
    if tls is not None and tls.selected_alpn_protocol() == "h2":
        transport.write(_h2_refusal(message))
    else:
        transport.write(guard.refusal(message))
    transport.close()


@functools.cache
def _h2_refusal(message: str) -> bytes:
    """The server's preface allowing no stream, then GOAWAY: last stream 0 (none was
    processed, so the client may retry each request elsewhere), ENHANCE_YOUR_CALM (back
    off rather than reconnect at once), the reason as its debug data."""
    conn = jh2.connection.H2Connection(jh2.config.H2Configuration(client_side=False))
    conn.local_settings = jh2.settings.Settings(
        client=False, initial_values={jh2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0}
    )
    conn.initiate_connection()
    conn.close_connection(error_code=_CALM, additional_data=message.encode(), last_stream_id=0)
    return cast(bytes, conn.data_to_send())


# -- the listener ------------------------------------------------------------------------------


class H2Site(GuardedSite):
    """The client listener with ``server.http2``: HTTP/2 connections here, HTTP/1.1 ones
    to the default listener's handler, under one guard."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        guard: ConnectionGuard,
        proxy: Served,
        send_stall_timeout: float,
        backlog: int = 128,
        reuse_port: bool = False,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(
            runner,
            host,
            port,
            guard=guard,
            backlog=backlog,
            reuse_port=reuse_port,
            ssl_context=ssl_context,
        )
        self.proxy = proxy
        self.send_stall_timeout = send_stall_timeout
        self.connections: set[H2Connection] = set()
        limits = guard.limits
        self.upgrade_head_max = limits.max_request_line + limits.max_header_size * 4
        self.handshake_timeout = limits.header_timeout

    def protocol_factory(self) -> Callable[[], asyncio.Protocol]:
        # Each connection starts as a front, which picks its protocol.
        return functools.partial(_Front, self)

    async def stop(self) -> None:
        """Stop accepting; HTTP/2 clients get GOAWAY (the streams they have finish)."""
        await super().stop()
        for conn in list(self.connections):
            conn.goaway()

    def close_connections(self) -> None:
        """Close every HTTP/2 connection still open (after the drain)."""
        for conn in list(self.connections):
            conn.close()
        self.connections.clear()

    async def serve(self, stream: H2Exchange) -> None:
        """One request stream, through the pipeline; its answer goes back on it."""
        proxy = self.proxy
        try:
            if not proxy.is_open:
                closed = ProxyError(
                    503, "service_unavailable", "The proxy is not open.", code="not_open"
                )
                answer: StreamResponse = own_answer(closed)
            else:
                error = stream.refusal or check_head(
                    stream.method, stream.target, stream.headers, 1, self.guard.limits
                )
                if error is not None:
                    self.guard.count_body_error(error)
                    answer = own_answer(error)
                else:
                    answer = await proxy.serve_exchange(stream)
            if not answer.prepared and not stream.started and not stream.gone:
                if type(answer) is Response:
                    await stream.start(answer.status, answer.headers, len(answer.body), False)
                    await stream.end(answer.body)
                else:
                    await answer.prepare(stream)
                    await answer.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            if not stream.gone:
                stream.abort()
            current = asyncio.current_task()
            if current is not None and current.cancelling() and not stream.gone:
                raise
        except Exception:
            logger.exception("HTTP/2 stream %d failed", stream.id)
            stream.abort()
        finally:
            conn = stream._conn
            if not stream.answered and not stream.gone:
                stream.abort()
            if stream.unacked:
                conn.acknowledge(stream.id, stream.unacked)
                stream.unacked = 0
            if stream.answered and not stream.out:
                conn._drop(stream)
