"""WebSockets on the HTTP/2 listener (:mod:`edgeproxy._server.h2server`): RFC 8441's
extended CONNECT, as browsers open ``wss://`` on an HTTP/2 connection.

The connection advertises SETTINGS_ENABLE_CONNECT_PROTOCOL, and a request with
``:method CONNECT`` and ``:protocol websocket`` becomes an :class:`H2WebSocketExchange`: a
``GET`` to the pipeline, which refuses it as any request (a non-2xx answer on the stream)
or accepts it. Accepted, the stream's DATA carries RFC 6455 frames both ways (wsproto
frames them; the HTTP/1.1 handshake is HTTP/2's 200) and :class:`H2WebSocket` is the
session's client side.

The stream keeps the listener's bounds, not a request body's:

* what comes in is bounded by the message size (``Accept.max_message``, 1009 past it) and
  by the stream's receive window, given back once the messages it carried are taken, so
  a client sending faster than the session reads is pushed back; no body size or rate
  limit applies, and an idle session is not a stalled one;
* what goes out waits in the stream's bounded buffer, then :meth:`H2WebSocket.send`
  waits; ``h2_send_stall_timeout`` counts from when data began to wait, so only a client
  that takes nothing of what waits is reset;
* a message is sent as fragments, so that pongs and a close (from another task, or
  answering the client) go out between them, never inside a frame;
* with permessage-deflate, what the client sends is inflated a slice at a time, so that
  a small frame cannot expand past the message bound in one step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Final

from multidict import CIMultiDict, CIMultiDictProxy
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import (
    BytesMessage,
    CloseConnection,
    Message,
    Ping,
    TextMessage,
)
from wsproto.extensions import Extension, PerMessageDeflate

from edgeproxy._core.websocket import MESSAGE_TOO_BIG, NORMAL, Accept, Closed, WebSocket
from edgeproxy._server.h2exchange import ExchangeConnection, H2Exchange

__all__ = ["WEBSOCKET", "H2WebSocket", "H2WebSocketExchange", "negotiate_deflate"]

WEBSOCKET: Final = "websocket"
"""The ``:protocol`` of a WebSocket's extended CONNECT (RFC 8441 §4)."""

# A message goes out in fragments of this many bytes (characters, for text).
_FRAGMENT: Final = 64 * 1024
# Compressed input is inflated this much at a time: at most about a thousand times it.
_INFLATE_SLICE: Final = 4096
_ABNORMAL: Final = 1006
_OPEN: Final = ConnectionState.OPEN
_REMOTE_CLOSING: Final = ConnectionState.REMOTE_CLOSING


def negotiate_deflate(offers: list[str]) -> tuple[list[Extension], str | None]:
    """The first permessage-deflate offer of ``sec-websocket-extensions`` that can be
    taken: the extension for wsproto and the response header's value; none, ``None``."""
    for header in offers:
        for offer in header.split(","):
            name = offer.split(";", 1)[0].strip().lower()
            if name != PerMessageDeflate.name:
                continue
            extension = PerMessageDeflate()
            try:
                params = extension.accept(offer.strip())
            except ValueError:  # a window size that is not a number
                continue
            if params is None:
                continue
            value = f"{name}; {params}" if params else name
            return [extension], value
    return [], None


class H2WebSocketExchange(H2Exchange):
    """An extended CONNECT for a WebSocket, as the pipeline's exchange: a ``GET`` without
    a body until :meth:`accept`; DATA sent before that is held (the stream's window bounds
    it) for the session."""

    websocket = True

    __slots__ = ("_session",)

    def __init__(
        self,
        conn: ExchangeConnection,
        stream_id: int,
        target: str,
        scheme: str,
        headers: CIMultiDictProxy[str],
    ) -> None:
        super().__init__(conn, stream_id, "GET", target, scheme, headers, None, False)
        self._session: H2WebSocket | None = None

    def body_chunk(self, data: bytes, flow: int, ended: bool) -> str | None:
        session = self._session
        if session is not None:
            session.feed(data, flow, ended)
            return None
        # Before the accept: held, unacknowledged, for the session to take.
        self._hold(data, flow, ended)
        return None

    def body_ended(self) -> str | None:
        self._more = False
        if self._session is not None:
            self._session.feed(b"", 0, True)
        self._wake()
        return None

    async def read_chunk(self) -> bytes:
        # The handshake has no body; what follows it is the session's.
        if self.gone:
            raise ConnectionResetError("the client reset the stream")
        return b""

    async def accept(self, accept: Accept) -> WebSocket:
        if self.started:
            raise RuntimeError("the handshake was answered already")
        if self.gone:
            raise ConnectionResetError("the client reset the stream")
        extensions: list[Extension] = []
        agreed = None
        if accept.compress:
            extensions, agreed = negotiate_deflate(
                self.headers.getall("sec-websocket-extensions", [])
            )
        headers: CIMultiDict[str] = CIMultiDict()
        if accept.subprotocol:
            headers["sec-websocket-protocol"] = accept.subprotocol
        if agreed is not None:
            headers["sec-websocket-extensions"] = agreed
        for name, value in accept.headers:
            headers.add(name, value)
        await self.start(200, headers, None, False)
        self.upgraded = True
        ws = Connection(ConnectionType.SERVER, extensions)
        session = self._session = H2WebSocket(self, ws, accept, deflate=bool(extensions))
        early = b"".join(self._body)
        self._body.clear()
        session.feed(early, 0, not self._more)
        return session

    def abort(self) -> None:
        if self._session is not None:
            self._session.ended()
        super().abort()

    async def cut(self, data: bytes) -> None:
        if self._session is None:
            await super().cut(data)
        else:
            self.abort()  # raw bytes would break the session's framing


class H2WebSocket(WebSocket):
    """The client's side of a WebSocket session on an HTTP/2 stream."""

    __slots__ = (
        "_closed",
        "_close_frame",
        "_close_sent",
        "_deflate",
        "_kind",
        "_lock",
        "_messages",
        "_parts",
        "_pong",
        "_size",
        "_stream",
        "_ws",
        "max_message",
        "subprotocol",
    )

    def __init__(
        self, stream: H2WebSocketExchange, ws: Connection, accept: Accept, *, deflate: bool
    ) -> None:
        self._stream = stream
        self._ws = ws
        self._deflate = deflate
        self.subprotocol = accept.subprotocol
        self.max_message = accept.max_message
        self._messages: deque[str | bytes] = deque()
        self._parts: list[str | bytes | bytearray] = []  # the message being reassembled
        self._kind: type[str] | type[bytes] = bytes
        self._size = 0
        self._closed: Closed | None = None  # what receive() returns once the messages run out
        self._close_sent = False
        # Control frames held while a send is inside a frame: the last pong, the close.
        self._pong = b""
        self._close_frame: bytes | None = None
        self._lock = asyncio.Lock()

    # -- the client's frames -----------------------------------------------------------

    def feed(self, data: bytes, flow: int, ended: bool) -> None:
        """DATA of the stream (``flow``: what it counted against the windows); ``ended``:
        the client ended its side."""
        stream = self._stream
        stream.unacked += flow
        if data and self._closed is None:
            ws = self._ws
            step = _INFLATE_SLICE if self._deflate else len(data)
            for start in range(0, len(data), step):
                ws.receive_data(data[start : start + step])
                self._events()
                if self._closed is not None:
                    break
        if ended and self._closed is None:
            self._closed = Closed(_ABNORMAL, "the client ended the stream without a close")
        self._acknowledge()
        stream._wake()

    def _events(self) -> None:
        ws = self._ws
        for event in ws.events():
            if isinstance(event, Message):
                if not self._message(event):
                    return
            elif isinstance(event, Ping):
                self._control(ws.send(event.response()), final=False)
            elif isinstance(event, CloseConnection):
                if ws.state is _REMOTE_CLOSING:
                    self._closed = Closed(event.code, event.reason or "")
                    self._close_sent = True
                    self._control(ws.send(event.response()), final=True)
                else:
                    # What wsproto could not parse: its close code says why.
                    self._fail(event.code, event.reason or "")
                return

    def _message(self, event: Message[str] | Message[bytes | bytearray]) -> bool:
        """A piece of a message; False once it made the message too big."""
        piece = event.data
        parts = self._parts
        if not parts:
            self._kind = str if isinstance(piece, str) else bytes
        self._size += len(piece.encode()) if isinstance(piece, str) else len(piece)
        if self._size > self.max_message:
            self._fail(MESSAGE_TOO_BIG, "message too big")
            return False
        if piece:
            parts.append(piece)
        if event.message_finished:
            if self._kind is str:
                message: str | bytes = "".join(p for p in parts if isinstance(p, str))
            else:
                message = b"".join(p for p in parts if not isinstance(p, str))
            self._messages.append(message)
            parts.clear()
            self._size = 0
        return True

    def _fail(self, code: int, reason: str) -> None:
        """The client broke a bound or the protocol: the session ends with ``code``."""
        self._closed = Closed(code, reason)
        self._parts.clear()
        self._close_sent = True
        if self._ws.state in (_OPEN, _REMOTE_CLOSING):
            self._control(self._ws.send(CloseConnection(code, reason)), final=True)

    def _acknowledge(self) -> None:
        """Give the stream's window back while no whole message waits to be taken: a
        client the session does not read is held to one window beyond them."""
        stream = self._stream
        if stream.unacked and not self._messages and self._closed is None and not stream.gone:
            stream._conn.acknowledge(stream.id, stream.unacked)
            stream.unacked = 0

    def ended(self) -> None:
        """The stream ended without a close (aborted)."""
        self._close_sent = True
        if self._closed is None:
            self._closed = Closed(_ABNORMAL, "the stream was reset")

    # -- the proxy's frames ------------------------------------------------------------

    def _control(self, frame: bytes, *, final: bool) -> None:
        """A pong or a close (``final``: the stream ends after it), queued now unless a
        send is inside a frame; a pong is dropped for a newer one while the client reads
        nothing (RFC 6455 §5.5.3)."""
        stream = self._stream
        if stream.gone or stream.end_requested:
            return
        if self._lock.locked():
            if final:
                self._close_frame = frame
            else:
                self._pong = frame
            return
        if not final and len(stream.out) >= stream._conn.room(stream):
            self._pong = frame
            return
        self._queue(frame, final=final)

    def _queue(self, frame: bytes, *, final: bool) -> None:
        stream = self._stream
        if not stream.out:
            stream.taken_at = stream._conn.loop.time()  # a stall counts from now
        if final:
            stream.end_requested = True
        stream._conn.send_body(stream, frame)

    def _held(self) -> None:
        """Between two frames of a send: what waited for it goes out."""
        if self._pong:
            pong, self._pong = self._pong, b""
            self._queue(pong, final=False)
        if self._close_frame is not None:
            frame, self._close_frame = self._close_frame, None
            self._queue(frame, final=True)

    def _gone(self) -> bool:
        stream = self._stream
        return stream.gone or self._close_sent or stream.end_requested

    async def receive(self) -> str | bytes | Closed:
        stream = self._stream
        while True:
            if self._messages:
                message = self._messages.popleft()
                self._acknowledge()
                return message
            if self._closed is not None:
                return self._closed
            if stream.gone:
                self._closed = Closed(_ABNORMAL, "the client reset the stream")
                return self._closed
            waiter = stream._waiter = stream._conn.loop.create_future()
            try:
                await waiter
            finally:
                stream._waiter = None

    async def send(self, message: str | bytes) -> None:
        if self._gone():
            raise ConnectionResetError("the WebSocket is closed")
        async with self._lock:
            size = len(message)
            start = 0
            while True:
                if self._gone():
                    raise ConnectionResetError("the WebSocket is closed")
                piece = message[start : start + _FRAGMENT]
                start += len(piece)
                last = start >= size
                if isinstance(piece, str):
                    frame = self._ws.send(TextMessage(piece, message_finished=last))
                else:
                    frame = self._ws.send(BytesMessage(piece, message_finished=last))
                await self._write(frame)
                self._held()
                if last:
                    return

    async def _write(self, frame: bytes) -> None:
        """One frame to the stream's buffer, waiting for room (the client's reading)."""
        stream = self._stream
        if not stream.out:
            stream.taken_at = stream._conn.loop.time()
        try:
            await stream.write(frame)
        except BaseException:
            # Inside a frame: nothing more can follow it on this stream.
            if not stream.gone:
                self.ended()
                stream.abort()
            raise

    async def close(self, code: int = NORMAL, reason: str = "") -> None:
        stream = self._stream
        if not self._close_sent:
            self._close_sent = True
            if self._closed is None:
                self._closed = Closed(code, reason)
            stream._wake()
            ws = self._ws
            if ws.state in (_OPEN, _REMOTE_CLOSING) and not stream.gone:
                self._control(ws.send(CloseConnection(code, reason)), final=True)
        if stream.end_requested and not stream.answered and not stream.gone:
            # Until the close has gone out, as an answer's end (reset past the stall).
            with contextlib.suppress(ConnectionResetError):
                await stream._conn.wait_sent(stream)

    async def ping(self) -> None:
        if self._gone() or self._ws.state is not _OPEN:
            return  # the session is over: nothing to keep alive
        self._control(self._ws.send(Ping()), final=False)

    def buffered(self) -> int:
        return len(self._stream.out)
