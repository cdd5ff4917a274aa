"""The answers of an HTTP/2 listener connection (:mod:`edgeproxy._server.h2server`): framed
here, sent as the client's windows and the socket allow, held within a bounded buffer
meanwhile, and the request bodies' receive windows given back as the pipeline reads them.

:class:`H2Flow` is a part of :class:`~edgeproxy._server.h2connection.H2Connection`, its
base class: the methods are the connection's own, called as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Final, Protocol, cast

import jh2.connection
import jh2.errors
import jh2.exceptions
import jh2.stream

from edgeproxy._http2.engine import queue_headers
from edgeproxy._http2.frames import FRAME_HEADER
from edgeproxy._http2.windows import queue_data
from edgeproxy._http2.writes import QueuedWrites
from edgeproxy._server.guard import ConnectionGuard
from edgeproxy._server.h2exchange import H2Exchange
from edgeproxy._server.h2serverengine import ServerEngine

__all__ = ["CONNECTION_BUFFER", "STREAM_BUFFER", "FlowSite", "H2Flow"]

logger = logging.getLogger("edgeproxy")

# What an answer may hold in the listener while its client does not take it: per stream,
# per connection, and what any stream may hold even when its connection is at its cap (two
# frames: a stream that is read is never held up by others that are not).
STREAM_BUFFER: Final = 256 * 1024
CONNECTION_BUFFER: Final = 1024 * 1024
_STREAM_FLOOR: Final = 2 * 2**14
_CANCEL: Final = jh2.errors.ErrorCodes.CANCEL
_INTERNAL: Final = jh2.errors.ErrorCodes.INTERNAL_ERROR
_SEND_HEADERS: Final = jh2.connection.ConnectionInputs.SEND_HEADERS
_STREAM_SEND_END_STREAM: Final = jh2.stream.StreamInputs.SEND_END_STREAM
_SERVER_OPEN: Final = jh2.connection.ConnectionState.SERVER_OPEN
# Stream states a DATA frame from the server leaves as they are.
_SENDING: Final = frozenset(
    {jh2.stream.StreamState.OPEN, jh2.stream.StreamState.HALF_CLOSED_REMOTE}
)


class FlowSite(Protocol):
    """What the answers need of the listener: how long a client may take nothing."""

    @property
    def send_stall_timeout(self) -> float: ...


class H2Flow(QueuedWrites):
    """The answers' framing, buffering and flow control, and the connection's writes."""

    # The connection's, set as it starts (H2Connection.__init__).
    h2: ServerEngine
    site: FlowSite
    guard: ConnectionGuard
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    ip: str
    blocked: set[H2Exchange]
    held: int
    writable: bool
    closing: bool
    _room_waiters: set[asyncio.Future[None]]
    _flush_scheduled: bool
    _earned: int

    if TYPE_CHECKING:

        def _gone(self, stream: H2Exchange) -> None: ...

        def _drop(self, stream: H2Exchange) -> None: ...

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
        queue_headers(h2, h2stream, block, end)
        if end:
            self._finished(stream)
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
        while sent < size:
            window = min(h2stream.outbound_flow_control_window, h2.outbound_flow_control_window)
            if window <= 0:
                break
            piece = min(window, frame, size - sent)
            last = stream.end_requested and sent + piece == size
            queue_data(h2, h2stream, out[sent : sent + piece], last)
            sent += piece
            self._earned += 1
        if sent:
            del out[:sent]
            stream.taken_at = self.loop.time()
            self._taken(sent)
        if not out and stream.end_requested and not stream.answered:
            if not sent:  # nothing left to carry END_STREAM: an empty DATA frame does
                queue_data(h2, h2stream, b"", True)
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
