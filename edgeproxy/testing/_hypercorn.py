"""What the fake needs from hypercorn that ASGI does not offer.

ASGI has no way to reset one HTTP/2 stream, to send GOAWAY, to close a
connection, or to know that a body chunk has actually left the server. With
hypercorn (checked against 0.17 and 0.18) an application exception after the
headers leaves an HTTP/2 stream open forever instead of resetting it, and
``keep_alive_max_requests`` sends a GOAWAY that names the stream that
triggered it as processed and then never answers it. So the fake reaches the
objects behind the ASGI ``send`` callable: the ``HTTPStream`` it is bound to,
that stream's ``H2Protocol``/``H11Protocol`` and the ``TCPServer`` with its
``StreamWriter``. Everything is looked up defensively: if hypercorn's layout
changes, :meth:`StreamHandle.from_send` returns ``None`` and the fake degrades
(faults fall back to plain ASGI behaviour) instead of crashing, and the
tests of this package fail loudly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final

import h2.connection
import h2.errors
import h2.exceptions
from hyperframe.frame import GoAwayFrame

log = logging.getLogger(__name__)

INTERNAL_ERROR: Final = int(h2.errors.ErrorCodes.INTERNAL_ERROR)
REFUSED_STREAM: Final = int(h2.errors.ErrorCodes.REFUSED_STREAM)
HTTP_1_1_REQUIRED: Final = int(h2.errors.ErrorCodes.HTTP_1_1_REQUIRED)

_warned = False


def _raw_data(data: bytes) -> object:
    from hypercorn.events import RawData

    return RawData(data=data)


class StreamHandle:
    """One request's stream and connection inside hypercorn."""

    __slots__ = ("http2", "stream_id", "writer", "_stream", "_protocol", "_tcp")

    def __init__(self, stream: Any, protocol: Any, tcp: Any, writer: asyncio.StreamWriter) -> None:
        self._stream = stream
        self._protocol = protocol
        self._tcp = tcp
        self.writer = writer
        self.stream_id: int = stream.stream_id
        self.http2 = isinstance(getattr(protocol, "connection", None), h2.connection.H2Connection)

    @classmethod
    def from_send(cls, send: Callable[..., Any]) -> StreamHandle | None:
        """Find the stream behind an ASGI ``send`` callable; ``None`` if not hypercorn's."""
        stream = getattr(send, "__self__", None)
        protocol = getattr(getattr(stream, "send", None), "__self__", None)
        tcp = getattr(getattr(protocol, "send", None), "__self__", None)
        writer = getattr(tcp, "writer", None)
        if isinstance(writer, asyncio.StreamWriter) and isinstance(
            getattr(stream, "stream_id", None), int
        ):
            return cls(stream, protocol, tcp, writer)
        global _warned
        if not _warned:
            _warned = True
            log.warning(
                "cannot reach hypercorn's stream objects; resets, GOAWAY and prompt "
                "shutdown of stalled requests fall back to plain ASGI behaviour"
            )
        return None

    async def wait_server_terminated(self) -> None:
        """Wait until hypercorn starts shutting down.

        Hypercorn sets its worker's ``terminated`` event and closes its
        listening sockets in one step, so once this returns no new
        connection can arrive: dropping connections after it means a client
        that retries (aiohttp retries idempotent requests) is refused
        instead of landing on a server that is going away.
        """
        terminated = getattr(getattr(self._protocol, "context", None), "terminated", None)
        if terminated is None:
            return
        await terminated.wait()

    @property
    def connection_key(self) -> int:
        """An identity for the connection, stable while it is open."""
        return id(self._tcp)

    def is_closing(self) -> bool:
        return self.writer.transport.is_closing()

    async def flush(self) -> None:
        """Wait until the body sent so far is written to the socket buffer.

        Hypercorn's HTTP/2 sender coalesces queued body messages into one DATA
        frame; waiting here keeps one frame per message. HTTP/1.1 writes
        synchronously, so there is nothing to wait for.
        """
        if not self.http2:
            return
        buffer = getattr(self._protocol, "stream_buffers", {}).get(self.stream_id)
        # An empty buffer's "empty" event is not set until its first pop, so
        # waiting on a buffer that never held data would hang.
        if buffer is not None and len(buffer.buffer) > 0:
            await buffer.drain()

    async def reset(self, error_code: int = INTERNAL_ERROR) -> None:
        """Abort this response: RST_STREAM on HTTP/2, drop the connection on HTTP/1.1."""
        if not self.http2:
            # close() (not abort()) so that body bytes still in the transport
            # buffer reach the client before the connection ends.
            self.writer.transport.close()
            return
        await self.flush()
        conn: h2.connection.H2Connection = self._protocol.connection
        try:
            conn.reset_stream(self.stream_id, error_code=error_code)
        except h2.exceptions.ProtocolError:
            return  # the stream is already closed; nothing left to reset
        await self._write(conn.data_to_send())

    async def send_goaway(self, last_stream_id: int, error_code: int = 0) -> None:
        """Send GOAWAY without closing h2's connection state machine.

        ``H2Connection.close_connection`` moves h2 to CLOSED, after which the
        streams up to ``last_stream_id`` can no longer be answered; a raw frame
        keeps them serviceable, as RFC 9113 section 6.8 intends.
        """
        if self.http2:
            frame = GoAwayFrame(stream_id=0, last_stream_id=last_stream_id, error_code=error_code)
            await self._write(frame.serialize())

    async def close_when_flushed(self, timeout: float = 5.0) -> None:
        """Close the connection once every response on it has been written out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and not self._flushed():
            await asyncio.sleep(0.005)
        transport = self.writer.transport
        if transport.is_closing():
            return
        if self.writer.can_write_eof():
            # Half-close and let hypercorn keep reading until the client
            # closes too: closing a socket with unread input (a late
            # WINDOW_UPDATE, say) sends RST, which can destroy the end of
            # the last response before the client has read it.
            self.writer.write_eof()
            deadline = loop.time() + timeout
            while loop.time() < deadline and not transport.is_closing():
                await asyncio.sleep(0.01)
        transport.close()

    def plain_hpack(self) -> None:
        """Encode this HTTP/2 connection's later header blocks without Huffman coding.

        hpack's pure-Python Huffman coder takes seconds over a header of a few
        hundred kilobytes, blocking the region's loop; plain literals are as
        valid HPACK and cost next to nothing.
        """
        if not self.http2:
            return
        encoder = getattr(getattr(self._protocol, "connection", None), "encoder", None)
        encode = getattr(type(encoder), "encode", None)
        if encoder is None or encode is None or "encode" in getattr(encoder, "__dict__", {}):
            return

        def plain(headers: Any, huffman: bool = True) -> bytes:
            result: bytes = encode(encoder, headers, huffman=False)
            return result

        try:
            encoder.encode = plain
        except AttributeError:  # pragma: no cover - an encoder with slots
            pass

    def abort(self) -> None:
        """Drop the connection at once, discarding unsent data."""
        self.writer.transport.abort()

    def _flushed(self) -> bool:
        if self.is_closing():
            return True
        if getattr(self._protocol, "streams", None):
            return False
        for buffer in getattr(self._protocol, "stream_buffers", {}).values():
            # A complete buffer is deleted right after END_STREAM is written,
            # so one still present means END_STREAM is pending. Incomplete
            # empty buffers belong to reset streams and never drain.
            if len(buffer.buffer) > 0 or buffer.complete:
                return False
        return self.writer.transport.get_write_buffer_size() == 0

    async def _write(self, data: bytes) -> None:
        if data:
            # Through the TCPServer's send path, so its lock orders this after
            # any frames hypercorn is writing.
            await self._protocol.send(_raw_data(data))
