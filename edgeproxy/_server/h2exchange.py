"""One request stream of the HTTP/2 listener (:mod:`edgeproxy._server.h2server`) as the
pipeline's :class:`~edgeproxy._core.exchange.Exchange`: its body as it arrives, its answer
framed by its connection."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import time
from collections import deque
from typing import Any, Final, Protocol

from multidict import CIMultiDict, CIMultiDictProxy

from edgeproxy._core.errors import ProxyError
from edgeproxy._core.exchange import Exchange, TlsInfo, Writer
from edgeproxy._protocol.bodies import BodyTooLarge, body_wait
from edgeproxy._server.guard import ConnectionGuard

__all__ = ["ExchangeConnection", "H2Exchange"]

_NO_BODY_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})
# Response fields HTTP/2 does not carry (RFC 9113 §8.2.2).
_CONNECTION_HEADERS: Final = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"}
)
# How long an answer cut at shutdown may wait for the client to take its last event.
_CUT_WAIT: Final = 0.5


class ExchangeConnection(Protocol):
    """What a stream needs of its connection
    (:class:`~edgeproxy._server.h2connection.H2Connection`): a Protocol, as the
    connection's module imports this one to open streams."""

    loop: asyncio.AbstractEventLoop
    guard: ConnectionGuard
    ip: str
    tls: TlsInfo | None
    server_header: bytes

    def encode_head(self, fields: list[tuple[bytes, bytes, bool]]) -> bytes: ...

    def send_head(self, stream: H2Exchange, *, end: bool) -> None: ...

    def fast_data(self, stream: H2Exchange, data: bytes, end: bool) -> bool: ...

    def send_body(self, stream: H2Exchange, data: bytes) -> None: ...

    def room(self, stream: H2Exchange) -> int: ...

    async def wait_room(self, stream: H2Exchange) -> None: ...

    async def wait_sent(self, stream: H2Exchange) -> None: ...

    def reset_when_sent(self, stream: H2Exchange) -> None: ...

    def acknowledge(self, stream_id: int, size: int) -> None: ...

    # The site ends a stream it served through its connection too.
    def _drop(self, stream: H2Exchange) -> None: ...


@functools.lru_cache(maxsize=4)
def _date(second: int) -> bytes:
    return email.utils.formatdate(second, usegmt=True).encode()


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
        "upgraded",
    )

    def __init__(
        self,
        conn: ExchangeConnection,
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
        self.upgraded = False  # a WebSocket handshake accepted: the stream is its session's

    # -- the request body ----------------------------------------------------------

    def body_chunk(self, data: bytes, flow: int, ended: bool) -> str | None:
        """DATA for this request, as it arrives; what is wrong with it, if anything."""
        self._received += len(data)
        expected = self.expected
        if expected is not None and (
            self._received > expected or (ended and self._received != expected)
        ):
            return f"{self._received} bytes of DATA for a content-length of {expected}"
        self._hold(data, flow, ended)
        return None

    def _hold(self, data: bytes, flow: int, ended: bool) -> None:
        """Keep DATA until the request reads it (its flow-control window credited then)."""
        if data:
            self._body.append(data)
        if flow:
            self.unacked += flow
        if ended:
            self._more = False
        self._wake()

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

    def _has_body(self) -> bool:
        """Whether the answer takes body bytes (not to HEAD, nor a 204 or a 304); raises
        once the client reset the stream."""
        if self.gone:
            raise ConnectionResetError("the client reset the stream")
        return not self.bodiless

    async def write(self, data: bytes) -> None:
        if not self._has_body():
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
        if not self._has_body():
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
