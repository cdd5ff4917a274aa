"""One HTTP/2 request/response exchange (:class:`Stream`) and the response it gives the
pool's caller (:class:`H2Response`), with the response's head as the stream takes it. The
frames themselves are the connection's (:mod:`edgeproxy._upstream.h2conn`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Final, Protocol

from edgeproxy._core.types import Body, Headers
from edgeproxy._http2.fields import Malformed, parse_fields
from edgeproxy._upstream.pool import UpstreamError, UpstreamTimeout

__all__ = [
    "CANCEL",
    "H2Response",
    "Stream",
    "StreamConnection",
    "set_head",
    "set_response_headers",
    "timeout_waiter",
]


class _FrameSize(Protocol):
    @property
    def max_outbound_frame_size(self) -> int: ...


class StreamConnection(Protocol):
    """What a stream uses of its :class:`~edgeproxy._upstream.h2conn.Connection`: a
    Protocol, as the connection's module imports this one to open streams."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def h2(self) -> _FrameSize: ...

    @property
    def writable(self) -> bool: ...

    @property
    def send_blocked(self) -> set[Stream]: ...

    def send_window(self, stream_id: int) -> int: ...

    def send_data(self, stream_id: int, data: memoryview, end_stream: bool) -> None: ...

    def flush_soon(self) -> None: ...

    def release(self, stream: Stream) -> None: ...

    def reset(self, stream: Stream, code: int) -> None: ...

    def acknowledge(self, stream_id: int, size: int) -> None: ...


# RST_STREAM's CANCEL error code (RFC 9113 §7).
CANCEL: Final = 0x8


def timeout_waiter(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


class Stream:
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
        "wait_until",
        "timer",
        "timer_at",
        "head",
        "expected_length",
        "received_length",
    )

    def __init__(self, conn: StreamConnection, stream_id: int, head: bool = False) -> None:
        self.conn = conn
        self.id = stream_id
        self.status = 0
        self.headers: Headers = []
        # Body bytes received and not yet taken, and their flow-controlled length (padding
        # included): a read takes them all at once and acknowledges them in one go.
        self.chunks: list[bytes] = []
        self.unacked = 0
        self.remote_ended = False
        self.local_ended = False
        self.released = False  # slot handed back to the connection
        self.finished = False  # consumer saw the end, an error, or closed it
        self.error: UpstreamError | None = None
        self.reset_code: int | None = None
        # One waiter is enough: a stream has a single consumer, which first
        # sends the body, then waits for headers, then reads the body.
        self.waiter: asyncio.Future[bool] | None = None
        # The waiter's deadline, and the one timer that enforces it: armed by the first
        # wait, kept across waits whose deadlines are later, re-armed when it fires early.
        self.wait_until = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.head = head  # a HEAD request: the response has no body
        self.expected_length: int | None = None  # from Content-Length, checked per stream
        self.received_length = 0

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
        """Wait for any state change; False if ``deadline`` passed first.

        A body arriving in many small reads waits once per read: rather than a timer
        armed and cancelled each time, the stream keeps one, which at its expiry ends
        the wait if the waiter's own deadline has passed, and otherwise moves on to it.
        """
        loop = self.conn.loop
        if deadline <= loop.time():
            return False
        fut: asyncio.Future[bool] = loop.create_future()
        self.waiter = fut
        self.wait_until = deadline
        timer = self.timer
        if timer is None or self.timer_at > deadline:
            if timer is not None:
                timer.cancel()
            self.timer = loop.call_at(deadline, self._expire)
            self.timer_at = deadline
        try:
            return await fut
        finally:
            self.waiter = None

    def _expire(self) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        loop = self.conn.loop
        if loop.time() >= self.wait_until:
            waiter.set_result(False)
        else:
            self.timer = loop.call_at(self.wait_until, self._expire)
            self.timer_at = self.wait_until

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

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
            window = conn.send_window(self.id) if conn.writable else 0
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
            conn.send_data(self.id, view[:size], end and last)
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
        """The body bytes received since the last read (waiting for some), or None at the end.

        Everything queued is taken at once, as aiohttp's ``iter_any`` does for HTTP/1.1:
        the DATA frames that arrived in one read are relayed in one write, not one each.
        """
        chunks = self.chunks
        deadline: float | None = None
        while not chunks:
            if self.error is not None:
                self.finished = True
                raise self.error
            if self.remote_ended:
                self.finished = True
                self.stop_timer()
                return None
            if deadline is None:
                deadline = self.conn.loop.time() + read_timeout
            if not await self.wait(deadline):
                raise UpstreamTimeout("upstream response body timed out", phase="read")
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        flow, self.unacked = self.unacked, 0
        # Acknowledging on consumption, not on receipt, is what makes a slow
        # client stall the upstream once the stream window is used up.
        self.conn.acknowledge(self.id, flow)
        return data

    def close(self, code: int = CANCEL) -> None:
        """Stop the exchange: reset if still open, return unread window. Idempotent."""
        self.finished = True
        self.stop_timer()
        if not self.released:
            self.conn.reset(self, code)
        if self.unacked:
            self.conn.acknowledge(self.id, self.unacked)
            self.unacked = 0
            self.chunks.clear()


class H2Response:
    """:class:`~edgeproxy._upstream.pool.UpstreamResponse` for one HTTP/2 stream."""

    __slots__ = ("_stream", "_read_timeout", "status", "headers", "http_version")

    def __init__(self, stream: Stream, read_timeout: float) -> None:
        self._stream = stream
        self._read_timeout = read_timeout
        self.status = stream.status
        self.headers = stream.headers
        self.http_version = "2"

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return _Body(self._stream, self._read_timeout)

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


class _Body:
    """A response's body, chunk by chunk: a class rather than an async generator so that
    the compiled build (mypyc, which has no async generators) compiles it too. A consumer
    that stops early closes the response (``aclose``), which closes the stream."""

    __slots__ = ("_stream", "_read_timeout")

    def __init__(self, stream: Stream, read_timeout: float) -> None:
        self._stream = stream
        self._read_timeout = read_timeout

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        stream = self._stream
        try:
            chunk = await stream.read(self._read_timeout)
        except BaseException:
            # Cancellation, timeouts, errors: none of them may leave the stream open.
            stream.close()
            raise
        if chunk is None:
            stream.close()
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self._stream.close()


def set_response_headers(stream: Stream, raw: list[Any]) -> None:
    """Take the final response's header block; raises :class:`Malformed`."""
    set_head(stream, *parse_fields(raw, trailers=False))


def set_head(stream: Stream, status: int, headers: Headers, length: int | None) -> None:
    """Take the final response's checked head; raises :class:`Malformed` for a 1xx."""
    if status < 200:
        raise Malformed(f"informational :status {status} where the final one was due")
    stream.headers = headers
    stream.status = status
    # A response to HEAD, a 204 and a 304 have no content whatever
    # Content-Length says (RFC 9110 §6.4.1).
    stream.expected_length = 0 if stream.head or status in (204, 304) else length
