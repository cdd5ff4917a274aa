"""One HTTP/2 connection of the listener (:mod:`edgeproxy._server.h2server`): jh2's state,
the lifecycle of its request streams (each an
:class:`~edgeproxy._server.h2exchange.H2Exchange` served in a task of its own), and its end.
Its answers' flow control is :class:`~edgeproxy._server.h2flow.H2Flow`, its limits
:class:`~edgeproxy._server.h2limits.H2Limits`: base classes, so that each method is the
connection's own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Final, Protocol

import jh2.connection
import jh2.errors
import jh2.events
import jh2.exceptions
import jh2.settings
import jh2.stream
from jh2.hyperframe.frame import GoAwayFrame

from edgeproxy._core.exchange import TlsInfo
from edgeproxy._http2.engine import engine_config, peer_defaults, received_end_stream
from edgeproxy._http2.fields import Malformed, field_name, field_value
from edgeproxy._http2.frames import FRAME_HEADER, TOO_LARGE, FrameReader
from edgeproxy._http2.windows import take_data
from edgeproxy._server.guard import ConnectionGuard
from edgeproxy._server.h2exchange import H2Exchange
from edgeproxy._server.h2flow import FlowSite, H2Flow
from edgeproxy._server.h2limits import H2Limits
from edgeproxy._server.h2request import head_refusal, header_list_size, request_fields
from edgeproxy._server.h2serverengine import MalformedRequest, SelfDependent, ServerEngine
from edgeproxy._server.h2websocket import WEBSOCKET, H2WebSocketExchange

__all__ = ["ConnectionSite", "H2Connection"]

logger = logging.getLogger("edgeproxy")

# A request's receive window; the connection's is this for every stream it may have
# open, so that one request whose body is not read never holds up the others'.
_STREAM_WINDOW: Final = 65535
_DEFAULT_WINDOW: Final = 65535
_PROTOCOL_ERROR: Final = jh2.errors.ErrorCodes.PROTOCOL_ERROR
_REFUSED: Final = jh2.errors.ErrorCodes.REFUSED_STREAM
_NO_ERROR: Final = jh2.errors.ErrorCodes.NO_ERROR
_RST_STREAM: Final = 0x3
_SERVER_OPEN: Final = jh2.connection.ConnectionState.SERVER_OPEN
_SENT_RESET: Final = jh2.stream.StreamClosedBy.SEND_RST_STREAM
_SWITCHING: Final = (
    b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
)


class ConnectionSite(FlowSite, Protocol):
    """What a connection needs of its listener
    (:class:`~edgeproxy._server.h2server.H2Site`): a Protocol, as the listener's module
    imports this one to open connections."""

    @property
    def guard(self) -> ConnectionGuard: ...

    @property
    def connections(self) -> set[H2Connection]: ...

    async def serve(self, stream: H2Exchange) -> None: ...


class H2Connection(H2Flow, H2Limits, asyncio.Protocol):
    """One client connection speaking HTTP/2: jh2's state, its streams, its counters."""

    site: ConnectionSite

    def __init__(
        self,
        site: ConnectionSite,
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
        h2 = self.h2 = ServerEngine(engine_config(client_side=False))
        self.queued = h2.data_to_send
        self.max_streams = limits.h2_max_concurrent_streams
        list_size = header_list_size(limits)
        h2.local_settings = jh2.settings.Settings(
            client=False,
            initial_values={
                jh2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams,
                jh2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: list_size,
                jh2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _STREAM_WINDOW,
                # WebSockets over HTTP/2 (RFC 8441): h2websocket.
                jh2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL: 1,
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
                if not stream.answered and not stream.upgraded:
                    self._spend()  # cancelled before its answer ended (a WebSocket's never ends)
                self._gone(stream)
        elif kind is MalformedRequest:
            self._malformed(event.stream_id, event.reason, 0)
        elif kind is SelfDependent:
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
            method, scheme, target, headers, length, protocol = request_fields(raw)
        except Malformed as exc:
            self._malformed(stream_id, str(exc), 0)
            return
        stream: H2Exchange
        if protocol == WEBSOCKET:
            if ended:
                self._malformed(stream_id, "an extended CONNECT that ends its stream", 0)
                return
            stream = H2WebSocketExchange(self, stream_id, target, scheme, headers)
        else:
            # A plain CONNECT, or another :protocol: the pipeline refuses its method.
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
        # An accepted WebSocket's session learns it from receive() (1006), and closes the
        # region's side itself.
        if task is not None and not task.done() and not stream.upgraded:
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
