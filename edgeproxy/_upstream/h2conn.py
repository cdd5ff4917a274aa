"""One HTTP/2 client connection of :class:`~edgeproxy._upstream.h2pool.H2Pool`, on ``h2``.

* A :class:`Connection` is an :class:`asyncio.Protocol` for one TCP
  connection. Frames produced by h2 are written once per event-loop turn.
* GOAWAY drains it: h2's connection state machine is changed so that the
  streams the peer accepted still finish; the others fail as *refused*
  (:class:`RefusedStream`), which the pool may retry elsewhere.
* Receive windows are large (16 MiB per connection, 1 MiB per stream) and data
  is acknowledged only when the consumer takes it, so a slow client pushes
  back on the upstream instead of growing our buffers.
* Each request is a :class:`Stream`; its response is an :class:`H2Response`.
* A malformed response (RFC 9113 §8.1.1: a bad header block, a
  ``Content-Length`` its DATA does not match, frames out of order) is a
  *stream* error: that stream is reset with PROTOCOL_ERROR and its request
  fails, while the connection and its other streams carry on. h2's own checks
  would make each of these a connection error, so they are turned off and
  done here and in :mod:`~edgeproxy._upstream.h2clientengine`, per stream
  (:func:`~edgeproxy._http2.fields.parse_fields`, the engine's stream class).
* h2 remembers how each of the last 65,536 closed streams closed (about 7 MB
  per long-lived connection); only streams closed by RST_STREAM are kept, and
  only the last :data:`~edgeproxy._http2.engine.RESET_STREAMS_KEPT` of them
  (:class:`~edgeproxy._http2.engine.ResetStreams`).
* A response's HEADERS and DATA frames, and a request's, pass without h2's frame objects,
  events and state machines' calls wherever h2 would only count them and move the
  stream on (``_fast_headers``, ``_fast_data``, :mod:`~edgeproxy._upstream.h2send`); h2
  takes every other frame, and the header blocks of both paths go through its one HPACK
  decoder. Request header blocks use the static table alone
  (:mod:`~edgeproxy._http2.staticpack`), so h2's encoder is never used.

With :mod:`~edgeproxy._upstream.h2clientengine`, :mod:`~edgeproxy._upstream.h2frames`
and :mod:`~edgeproxy._upstream.h2send`, this is the only module of the upstream layer that
imports the HTTP/2 protocol engine (``h2`` and ``hpack``); what the listener shares of it
is :mod:`edgeproxy._http2`.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Final, Protocol, cast

# The protocol engine, jh2 (see edgeproxy._http2.engine): the fast paths here touch its
# internals too, one more reason its version is pinned to a tested range in setup.cfg.
import jh2 as h2
import jh2.connection
import jh2.errors
import jh2.events
import jh2.exceptions
import jh2.settings
import jh2.stream
import jh2.utilities

from edgeproxy._http2.engine import (
    HALF_CLOSED_LOCAL,
    RESET_STREAMS_KEPT,
    STREAM_OPEN,
    engine_config,
    peer_defaults,
    received_end_stream,
)
from edgeproxy._http2.fields import Malformed, parse_fields
from edgeproxy._http2.frames import ENDED, TAKEN, header_frames, split_frames
from edgeproxy._http2.staticpack import TABLE_SIZE_ZERO, encode_block
from edgeproxy._http2.windows import take_data, window_update_due
from edgeproxy._http2.writes import QueuedWrites
from edgeproxy._upstream.h2clientengine import ClientEngine, MalformedData, MalformedHeaders
from edgeproxy._upstream.h2frames import (
    GatheredBlock,
    decode_error,
    header_block,
)
from edgeproxy._upstream.h2head import block_steps
from edgeproxy._upstream.h2send import new_request_stream, request_data, request_headers
from edgeproxy._upstream.h2stream import (
    H2Response,
    Stream,
    set_response_headers,
    timeout_waiter,
)
from edgeproxy._upstream.pool import (
    UpstreamError,
    UpstreamNotHTTP2,
    UpstreamProtocolError,
)

__all__ = [
    "Connection",
    "ConnectionPool",
    "H2Response",
    "RefusedStream",
    "Stream",
    "timeout_waiter",
]

_CONNECTION_WINDOW: Final = 16 * 1024 * 1024
_STREAM_WINDOW: Final = 1024 * 1024
_DEFAULT_WINDOW: Final = 65535
# Stop opening streams a little before the 31-bit id space runs out, so the
# connection drains instead of failing a request.
_LAST_STREAM_ID: Final = 2**31 - 1 - 2 * 1024
_CANCEL: Final = h2.errors.ErrorCodes.CANCEL
_NO_ERROR: Final = h2.errors.ErrorCodes.NO_ERROR
_PROTOCOL_ERROR: Final = h2.errors.ErrorCodes.PROTOCOL_ERROR
_REFUSED: Final = h2.errors.ErrorCodes.REFUSED_STREAM
# Frames we must answer; at most this many while the peer reads none of our data.
_ANSWERED: Final = (h2.events.PingReceived, h2.events.RemoteSettingsChanged)
_MAX_UNREAD_REPLIES: Final = 1000
_CLIENT_OPEN: Final = h2.connection.ConnectionState.CLIENT_OPEN
_SEND_HEADERS: Final = h2.connection.ConnectionInputs.SEND_HEADERS
_HEADER_TABLE_SIZE: Final = h2.settings.SettingCodes.HEADER_TABLE_SIZE
# jh2's compiled HPACK decodes to (name, value, never indexed) byte triples, which the
# HEADERS fast path reads; its pure-Python fallback leaves every HEADERS frame to h2.
_COMPILED_HPACK: Final = bool(h2.connection.ALTERNATIVE_HPACK)
_END_HEADERS: Final = 0x4
_HEADERS: Final = 0x1


class RefusedStream(UpstreamProtocolError):
    """The peer provably did not process the stream (GOAWAY or REFUSED_STREAM)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class ConnectionPool(Protocol):
    """What a connection tells its :class:`~edgeproxy._upstream.h2pool.H2Pool` and asks of
    it: a Protocol, as the pool's module imports this one to open connections."""

    @property
    def origin(self) -> str: ...

    def stream_budget(self, now: float | None = None) -> int: ...

    def _learn_stream_budget(self, accepted: int) -> None: ...

    def _slot_freed(self, conn: Connection) -> None: ...

    def _capacity_changed(self, conn: Connection) -> None: ...

    def _connection_gone(self, conn: Connection) -> None: ...


class Connection(QueuedWrites):
    """One HTTP/2 connection: h2 state, its transport and its live streams."""

    def __init__(self, pool: ConnectionPool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        # Responses are checked per stream here (parse_fields).
        self.h2: ClientEngine = ClientEngine(engine_config(client_side=True), RESET_STREAMS_KEPT)
        self.queued = self.h2.data_to_send
        self.h2.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _STREAM_WINDOW,
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 2**16,
            },
        )
        # A region whose SETTINGS leave INITIAL_WINDOW_SIZE out would answer a body sent
        # past its window with FLOW_CONTROL_ERROR.
        self.h2.remote_settings = peer_defaults(peer_is_client=False)
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self.send_blocked: set[Stream] = set()
        self.ready: asyncio.Future[UpstreamError | None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.draining = False
        self.lost = False
        self.writable = True
        self._flush_scheduled = False
        self.closing = False
        now = self.opened_at = loop.time()
        self.last_recv = now
        self.idle_since: float | None = now
        self.ping_sent_at: float | None = None
        self._ping_seq = 0
        self.streams_opened = 0
        self._unread_replies = 0  # PING/SETTINGS answered while the peer was not reading
        self._inbuf = b""  # the start of a frame not yet complete
        # The peer changed SETTINGS_HEADER_TABLE_SIZE: the next request's header block
        # must say the (always empty) dynamic table we use is within it.
        self._table_size_due = False
        # A response's header block in CONTINUATION frames, gathered by _fast_headers.
        self._block: GatheredBlock | None = None

    # -- state -----------------------------------------------------------

    @property
    def max_streams(self) -> int:
        return self.h2.remote_settings.max_concurrent_streams

    @property
    def unparsed(self) -> bytes:
        """What the server sent that is not a whole frame yet (all of it, when HTTP/1.x)."""
        return self._inbuf

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
                    UpstreamNotHTTP2(
                        self.pool.origin,
                        f"ALPN chose {chosen!r}, not h2" if chosen else "ALPN agreed on no h2",
                        http1=chosen in (None, "http/1.1"),
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
        pending = self._inbuf
        buf = pending + data if pending else data
        # Complete frames only: the HEADERS and DATA frames of an open response take the
        # fast paths (_fast_headers, _fast_data), every other frame goes to h2 in runs, in
        # the order received.
        pos = split_frames(buf, self._fast_data, self._receive, self._fast_headers)
        if pos < 0:
            return
        self._inbuf = buf[pos:] if pos < len(buf) else b""
        if self.h2._data_to_send:
            # Replies (SETTINGS and PING acknowledgements, resets) go out this loop turn.
            self.flush_soon()

    def _receive(self, frames: bytes) -> bool:
        """Hand complete frames to h2 and act on its events; False once the connection ends."""
        if self._block is not None:
            # Only the CONTINUATION frames of the header block gathered here may come.
            self._connection_error(
                h2.exceptions.ProtocolError("Invalid frame during header block.")
            )
            return False
        try:
            events = self.h2.receive_data(frames)
        except h2.exceptions.ProtocolError as exc:
            self._protocol_error(exc, frames)
            return False
        for event in events:
            self._handle(event)
        if not self.writable:
            # Each PING and SETTINGS is answered; a peer that sends them while
            # not reading the answers would grow our write buffer for good
            # (the "ping flood" and "settings flood" of CVE-2019-9512/9515).
            self._unread_replies += sum(isinstance(e, _ANSWERED) for e in events)
            if self._unread_replies > _MAX_UNREAD_REPLIES:
                self.abort(
                    UpstreamProtocolError(
                        "upstream floods PING/SETTINGS frames without reading the replies"
                    )
                )
                return False
        return not self.closing

    def _protocol_error(self, exc: Exception, frames: bytes) -> None:
        """The peer broke the connection's rules: GOAWAY, and every stream fails."""
        if not self.ready.done():
            self.ready.set_result(UpstreamNotHTTP2.from_reply(self.pool.origin, frames))
        # h2 has queued a GOAWAY naming the error; close() writes it out
        # before closing, since the connection state can't be trusted.
        self.close(UpstreamProtocolError(f"HTTP/2 protocol error from upstream: {exc}"))

    def _fast_headers(
        self, stream_id: int, buf: bytes, start: int, end: int, flags: int, kind: int
    ) -> int:
        """A response's HEADERS frame (``kind``), or a CONTINUATION of one, taken without
        h2's frame objects, state machines and events: TAKEN, 0 to leave it to h2, or
        ENDED once it ended the connection.

        Taken where h2 would only decode the block and move the stream on: the connection
        open, no header block of h2's in progress, the frame within the size limit, the
        stream one of ours and open for receiving. A block in CONTINUATION frames is
        gathered here, and until it ends any other frame is a connection error, as in h2.
        The block is decoded by h2's own HPACK decoder, whose dynamic table must see every
        block in order; then come h2's stream steps with the checks that make a malformed
        response its stream's error (:func:`~edgeproxy._upstream.h2head.block_steps`).
        """
        if self._block is not None:
            return self._continue_block(stream_id, buf, start, end, flags, kind)
        if kind != _HEADERS or not _COMPILED_HPACK:
            return 0  # a CONTINUATION of h2's own block, or one h2 names the error of
        stream = self.streams.get(stream_id)
        h2conn = self.h2
        if stream is None or stream.finished:
            return 0
        h2stream = h2conn.streams.get(stream_id)
        if (
            h2stream is None
            or end - start > h2conn.max_inbound_frame_size
            or h2conn.incoming_buffer._headers_buffer
            or h2conn.state_machine.state is not _CLIENT_OPEN
        ):
            return 0
        machine = h2stream.state_machine
        state = machine.state
        # RECEIVING's two states, by identity: an Enum's hash is a Python call.
        if state is not STREAM_OPEN and state is not HALF_CLOSED_LOCAL:
            return 0
        block = header_block(stream_id, buf, start, end, flags)
        if block is None:
            return 0
        if not flags & _END_HEADERS:
            self._block = GatheredBlock(stream_id, block, flags & 1)
            return TAKEN
        return self._take_block(stream, machine, block, flags & 1)

    def _take_block(self, stream: Stream, machine: Any, block: bytes, last: int) -> int:
        try:
            decoded = self.h2.decoder.decode(block, raw=True)
        except Exception as exc:
            return self._connection_error(decode_error(exc))
        reason, ended = block_steps(stream, machine, decoded, last)
        if reason:
            self._malformed(stream.id, reason)
        elif ended:
            self._ended(stream)
        else:
            stream.wake()
        return TAKEN

    def _continue_block(
        self, stream_id: int, buf: bytes, start: int, end: int, flags: int, kind: int
    ) -> int:
        """A frame while a header block gathered here is in progress."""
        gathered = cast(GatheredBlock, self._block)
        h2conn = self.h2
        size = h2conn.max_inbound_frame_size
        got = gathered.add(stream_id, kind, buf, start, end, flags, size)
        if got is None:
            return TAKEN
        self._block = None
        if not isinstance(got, bytes):
            return self._connection_error(got)
        stream = self.streams.get(stream_id)
        h2stream = h2conn.streams.get(stream_id)
        if stream is not None and not stream.finished and h2stream is not None:
            machine = h2stream.state_machine
            if machine.state is STREAM_OPEN or machine.state is HALF_CLOSED_LOCAL:
                return self._take_block(stream, machine, got, gathered.end_stream)
        # The stream was let go meanwhile: h2 decodes the block and answers as it would.
        last = bool(gathered.end_stream)
        return TAKEN if self._receive(header_frames(stream_id, got, last, size)) else ENDED

    def _connection_error(self, error: h2.exceptions.ProtocolError) -> int:
        """A connection error found on a fast path: GOAWAY naming it, as h2 would."""
        self._block = None
        self.h2._terminate_connection(error.error_code)
        self._protocol_error(error, b"")
        return ENDED

    def _fast_data(self, stream_id: int, buf: bytes, start: int, end: int, last: int) -> bool:
        """A DATA frame (not padded) taken without h2's frame objects, state machines and
        events; False leaves it to h2. ``last``: it ends the stream (END_STREAM).

        Taken only where h2 would accept it and do nothing but count it (and, for the
        last, move the stream's state on): the connection open, no header block in
        progress, the frame within the size limit, the stream one of ours, open for
        receiving, its response headers in, and both receive windows with room for it.
        h2's two windows are charged, and its stream state changed, as h2 does.
        """
        stream = self.streams.get(stream_id)
        if stream is None or stream.finished or self._block is not None:
            return False
        length = end - start
        h2stream = take_data(
            self.h2, stream_id, length, connection_open=_CLIENT_OPEN, after_headers=True
        )
        if h2stream is None:
            return False
        if length:
            stream.received_length += length
            expected = stream.expected_length
            if expected is not None and stream.received_length > expected:
                self._malformed(stream_id, f"more DATA than its content-length of {expected}")
                self.acknowledge(stream_id, length)
                return True
            stream.chunks.append(buf[start:end])
            stream.unacked += length
        if last:
            received_end_stream(h2stream.state_machine)
            self._ended(stream)
            return True
        stream.wake()
        return True

    def eof_received(self) -> bool | None:
        return None  # let the transport close; connection_lost does the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        error: UpstreamError
        if self.ready.done():
            reason = f": {exc}" if exc else ""
            error = UpstreamProtocolError(f"upstream connection lost{reason}")
        else:
            # Before the server's SETTINGS: it refused the preface (or its TLS said no h2).
            error = UpstreamNotHTTP2.from_reply(self.pool.origin, self._inbuf, exc)
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
        self._unread_replies = 0
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
            stream.received_length += len(event.data)
            expected = stream.expected_length
            if expected is not None and stream.received_length > expected:
                self._malformed(event.stream_id, f"more DATA than its content-length of {expected}")
                self.acknowledge(event.stream_id, event.flow_controlled_length)
                return
            if event.data:
                stream.chunks.append(event.data)
                stream.unacked += event.flow_controlled_length
            elif event.flow_controlled_length:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            stream.wake()
        elif isinstance(event, MalformedHeaders):
            self._malformed(event.stream_id, event.reason)
        elif isinstance(event, h2.events.ResponseReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                try:
                    set_response_headers(stream, event.headers)
                except Malformed as exc:
                    self._malformed(event.stream_id, str(exc))
                    return
                stream.wake()
        elif isinstance(event, h2.events.StreamEnded):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                self._ended(stream)
        elif isinstance(
            event, h2.events.InformationalResponseReceived | h2.events.TrailersReceived
        ):
            # Neither is passed on, but a malformed one makes the response malformed.
            if event.stream_id in self.streams:
                trailers = isinstance(event, h2.events.TrailersReceived)
                try:
                    parse_fields(event.headers, trailers=trailers)
                except Malformed as exc:
                    self._malformed(event.stream_id, str(exc))
        elif isinstance(event, MalformedData):
            self._malformed(event.stream_id, event.reason)
            # h2 counted the frame against the connection window only.
            self.acknowledge(event.stream_id, event.flow_controlled_length)
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
                self._on_reset(stream, event.error_code, remote=event.remote_reset)
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            if not self.ready.done():
                self.ready.set_result(None)
            if _HEADER_TABLE_SIZE in event.changed_settings:
                self._table_size_due = True
            self.pool._capacity_changed(self)
            # A larger SETTINGS_INITIAL_WINDOW_SIZE opens every send window.
            for blocked in list(self.send_blocked):
                blocked.wake()
        elif isinstance(event, h2.events.PingAckReceived):
            self.ping_sent_at = None
        elif isinstance(event, h2.events.ConnectionTerminated):
            self._on_goaway(event.last_stream_id, event.error_code)
        # Priority and settings acks need no action.

    def _ended(self, stream: Stream) -> None:
        """The response ended (END_STREAM): checked against its Content-Length."""
        expected = stream.expected_length
        if expected is not None and stream.received_length != expected:
            received = stream.received_length
            self._malformed(
                stream.id, f"{received} bytes of DATA for a content-length of {expected}"
            )
            return
        stream.remote_ended = True
        if stream.local_ended:
            self.release(stream)
        stream.wake()

    def _malformed(self, stream_id: int, reason: str) -> None:
        """A malformed response: reset its stream and fail its request (RFC 9113 §8.1.1).

        Only this stream ends; the connection and its other streams carry on.
        """
        if not self.lost:
            try:
                self.h2.reset_stream(stream_id, _PROTOCOL_ERROR)
            except h2.exceptions.ProtocolError:
                pass  # the response ended and so did the request: nothing to reset
            self.flush_soon()
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.fail(UpstreamProtocolError(f"malformed HTTP/2 response from upstream: {reason}"))

    def _on_reset(self, stream: Stream, code: int, *, remote: bool = True) -> None:
        stream.reset_code = code
        name = _error_name(code)
        if stream.remote_ended:
            # The response is complete; a reset now only stops our upload.
            self.release(stream)
            stream.wake()
        elif not remote:
            # h2 reset it for us: the peer broke a stream rule, such as
            # overflowing the stream's flow-control window.
            stream.fail(UpstreamProtocolError(f"upstream broke the stream's rules ({name})"))
        elif code == _REFUSED:
            stream.fail(RefusedStream("upstream refused the stream (REFUSED_STREAM)"))
        else:
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
                stream.fail(RefusedStream(f"upstream sent GOAWAY ({name}) before the stream"))
        if refused and code == _NO_ERROR and not was_draining:
            self.pool._learn_stream_budget((last + 1) // 2)
        if not self.streams:
            self.close()
        if not was_draining:
            self.pool._capacity_changed(self)

    # -- outbound --------------------------------------------------------

    def open_stream(self, headers: list[tuple[str, str]], end_stream: bool) -> Stream | None:
        """Start a request; None if the peer has no room for another stream."""
        h2conn = self.h2
        try:
            stream_id = h2conn.get_next_available_stream_id()
            method = self._send_head(stream_id, headers, end_stream)
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
        stream = Stream(self, stream_id, head=method == "HEAD")
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

    def _send_head(self, stream_id: int, headers: list[tuple[str, str]], end_stream: bool) -> str:
        """h2's ``send_headers`` for a new request stream, without its frame objects: h2's
        checks and state transitions in its order, the header block encoded with the
        static table alone (:mod:`~edgeproxy._http2.staticpack`), framed here.

        h2's own encoder is never used, so the peer's dynamic table stays empty and no
        block depends on another. Returns the request's method ("" without one)."""
        h2conn = self.h2
        limit = h2conn.remote_settings.max_concurrent_streams
        if h2conn.open_outbound_streams + 1 > limit:
            raise h2.exceptions.TooManyStreamsError(f"Max outbound streams is {limit}")
        if h2conn.state_machine.state is not _CLIENT_OPEN:
            h2conn.state_machine.process_input(_SEND_HEADERS)  # raises as h2 does
        stream = new_request_stream(h2conn, stream_id)
        block = encode_block(headers)
        if self._table_size_due:
            self._table_size_due = False
            block = TABLE_SIZE_ZERO + block
        # What h2's send_headers notes of the request, from its leading pseudo-header fields.
        method = ""
        for name, value in headers:
            if name == ":method":
                method = value
                stream.request_method = value.encode()
            elif name == ":authority":
                stream._authority = value.encode()
            elif name[:1] != ":":
                break
        request_headers(h2conn, stream, block, end_stream)
        return method

    def send_window(self, stream_id: int) -> int:
        """What ``stream_id`` may send now (h2's ``local_flow_control_window``)."""
        h2conn = self.h2
        h2stream = h2conn.streams.get(stream_id)
        if h2stream is None:
            return h2conn.local_flow_control_window(stream_id)  # raises as h2 does
        return min(h2conn.outbound_flow_control_window, h2stream.outbound_flow_control_window)

    def send_data(self, stream_id: int, data: memoryview, end_stream: bool) -> None:
        """h2's ``send_data`` without its frame objects: h2's checks, state transitions
        and window charges, the DATA frame built here (unpadded, as we send them)."""
        h2conn = self.h2
        stream = h2conn.streams.get(stream_id)
        size = len(data)
        if (
            stream is None
            or size > stream.outbound_flow_control_window
            or size > h2conn.outbound_flow_control_window
            or size > h2conn.max_outbound_frame_size
        ):
            h2conn.send_data(stream_id, data, end_stream=end_stream)  # raises as h2 does
            return
        request_data(h2conn, stream, data, end_stream)

    def start_draining(self) -> None:
        if not self.draining:
            self.draining = True
            self.pool._capacity_changed(self)

    def release(self, stream: Stream) -> None:
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

    def reset(self, stream: Stream, code: int) -> None:
        if not self.lost and stream.id in self.streams:
            try:
                self.h2.reset_stream(stream.id, code)
            except h2.exceptions.ProtocolError:
                pass  # already closed in h2's view; nothing to tell the peer
            self.flush_soon()
        self.release(stream)

    def acknowledge(self, stream_id: int, size: int) -> None:
        """Hand ``size`` flow-controlled bytes of ``stream_id`` back to the peer.

        h2 sends a WINDOW_UPDATE only once enough bytes were processed; until one is
        due, acknowledging only adds to its counts, done here without its calls.
        """
        if self.lost or not size:
            return
        h2conn = self.h2
        conn_window = h2conn._inbound_flow_control_window_manager
        h2stream = h2conn.streams.get(stream_id)
        # h2 hands a closed stream's bytes back to the connection's window alone.
        stream_window = (
            h2stream._inbound_window_manager if h2stream is not None and h2stream.open else None
        )
        if not window_update_due(conn_window, size) and (
            stream_window is None or not window_update_due(stream_window, size)
        ):
            conn_window._bytes_processed += size
            if stream_window is not None:
                stream_window._bytes_processed += size
            return
        h2conn.acknowledge_received_data(size, stream_id)
        self.flush_soon()

    def ping(self) -> None:
        self._ping_seq += 1
        self.ping_sent_at = self.loop.time()
        self.h2.ping(self._ping_seq.to_bytes(8, "big"))
        self.flush_soon()

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
