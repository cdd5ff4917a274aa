"""The ASGI front end's WebSockets: a ``websocket`` scope as the pipeline's :class:`Exchange`.

The pipeline either answers the handshake as any request (a refusal: a status and a JSON
body) or accepts it and relays the session through the :class:`WebSocket` it gets back.

A refusal goes out as an HTTP response where the server offers the
``websocket.http.response`` extension. Elsewhere a ``websocket.close`` before the accept
reaches the client only as a bare 403, so the handshake is accepted and at once closed
with a code mapped from the status (1013: try again later, 1008: refused, 1011: failed)
and the error's message as the reason: the client learns why.

Until the handshake is settled a watcher reads ``receive``: a client that leaves cancels
the request's task, as under HTTP. From the accept on, the session's own reads see it go.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, Final

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from edgeproxy._core.exchange import Exchange, Writer
from edgeproxy._core.response import Response, StreamResponse
from edgeproxy._core.websocket import (
    GOING_AWAY,
    INTERNAL_ERROR,
    MESSAGE_TOO_BIG,
    POLICY,
    TRY_AGAIN_LATER,
    Accept,
    Closed,
    WebSocket,
)
from edgeproxy._server.asgiscope import (
    CONNECTION_HEADERS,
    CUT_WAIT,
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    scope_headers,
    scope_target,
    scope_tls,
)

__all__ = ["AsgiWebSocket", "AsgiWebSocketExchange", "close_reason", "refusal_code", "serve"]

_DENIAL: Final = "websocket.http.response"
# RFC 6455 5.5: a control frame's payload is at most 125 bytes, 2 of them the code.
_MAX_REASON: Final = 123
# A refusal is a short JSON error; past this much, its message is not looked for.
_MAX_REFUSAL_BODY: Final = 64 * 1024
# How long a close this side sent waits for the client's.
_CLOSE_WAIT: Final = 2.0


def refusal_code(status: int) -> int:
    """The close code that stands for a refusal's HTTP status."""
    if status in (429, 503):
        return TRY_AGAIN_LATER
    if status in (400, 401, 403, 404):
        return POLICY
    return INTERNAL_ERROR


def _clip(reason: str) -> str:
    encoded = reason.encode("utf-8", "replace")
    if len(encoded) <= _MAX_REASON:
        return reason
    # A cut through a character drops that character, not the whole reason.
    return encoded[:_MAX_REASON].decode("utf-8", "ignore")


def close_reason(status: int, body: bytes | bytearray) -> str:
    """A close reason for a refusal: its JSON error's message (OpenAI's and Anthropic's
    ``error.message``, or a top-level ``message``), else the status's phrase; at most 123
    bytes of UTF-8."""
    message: object = None
    with contextlib.suppress(ValueError):
        data = orjson.loads(body)
        if isinstance(data, dict):
            error = data.get("error")
            message = error.get("message") if isinstance(error, dict) else error
            if not isinstance(message, str) or not message:
                message = data.get("message")
    if not isinstance(message, str) or not message:
        try:
            message = HTTPStatus(status).phrase
        except ValueError:
            message = f"HTTP {status}"
    return _clip(message)


def _too_big(message: str | bytes, limit: int) -> bool:
    size = len(message)
    if isinstance(message, bytes) or size > limit:
        return size > limit
    # A character is 1 to 4 bytes of UTF-8: encode only when the count cannot tell.
    return size * 4 > limit and len(message.encode("utf-8", "surrogatepass")) > limit


class AsgiWebSocket(WebSocket):
    """The client's side of an accepted session, on the ASGI server's ``receive``/``send``."""

    def __init__(self, exchange: AsgiWebSocketExchange, accept: Accept) -> None:
        self._exchange = exchange
        self._receive = exchange._receive
        self._max_message = accept.max_message
        self.subprotocol = accept.subprotocol
        self._closed: Closed | None = None

    async def receive(self) -> str | bytes | Closed:
        while self._closed is None:
            message = await self._receive()
            kind = message["type"]
            if kind == "websocket.disconnect":
                self._exchange._left()
                if self._closed is None:
                    # No code in the client's close frame reads 1005 (RFC 6455 7.1.5).
                    code = int(message.get("code", 1005))
                    self._closed = Closed(code, message.get("reason") or "")
            elif self._closed is not None:
                break  # closed on this side while the read waited: nothing more is taken
            elif kind == "websocket.receive":
                text = message.get("text")
                payload: str | bytes = text if text is not None else message.get("bytes") or b""
                if _too_big(payload, self._max_message):
                    await self.close(MESSAGE_TOO_BIG, "message too big")
                    break
                return payload
        assert self._closed is not None
        return self._closed

    async def send(self, message: str | bytes) -> None:
        if self._closed is not None or self._exchange._gone:
            raise ClientGone("the WebSocket is closed")
        key = "text" if isinstance(message, str) else "bytes"
        await self._exchange._checked_send({"type": "websocket.send", key: message})

    async def close(self, code: int = 1000, reason: str = "") -> None:
        if self._closed is not None:
            return
        reason = _clip(reason)
        self._closed = Closed(code, reason)
        if self._exchange._gone:
            return  # the client left: there is nobody to send a close to
        with contextlib.suppress(ClientGone):
            await self._exchange._send_close(code, reason)

    @property
    def closed(self) -> bool:
        return self._closed is not None


class AsgiWebSocketExchange(Exchange):
    """One ASGI ``websocket`` scope, its ``websocket.connect`` already received, as the
    pipeline's exchange: accepted, or answered (refused) as an HTTP request."""

    __slots__ = (
        "_aborted",
        "_body",
        "_close_sent",
        "_denial",
        "_done",
        "_gone",
        "_receive",
        "_send",
        "_socket",
        "_status",
        "_task",
        "_watcher",
        "scope",
    )

    websocket = True

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.native = self.scope = scope
        self._receive = receive
        self._send = send
        self.method = "GET"
        self.target = scope_target(scope)
        headers = scope_headers(scope.get("headers", []))
        offered = scope.get("subprotocols")
        if offered and "Sec-WebSocket-Protocol" not in headers:
            # A server may keep the offer only in the scope (uvicorn's wsproto does); the
            # pipeline reads it where any front end puts it.
            with_offer = CIMultiDict(headers)
            with_offer["Sec-WebSocket-Protocol"] = ", ".join(offered)
            headers = CIMultiDictProxy(with_offer)
        self.headers = headers
        client = scope.get("client")
        self.client = client[0] if client else None
        # ASGI says ws/wss; the pipeline knows the scheme the handshake came on.
        self.scheme = "https" if scope.get("scheme") in ("wss", "https") else "http"
        self.version = version = scope.get("http_version", "1.1")
        server = scope.get("server")
        self.host = headers.get("Host") or (f"{server[0]}:{server[1]}" if server else "")
        self.tls = scope_tls(scope, version) if self.scheme == "https" else None
        self.content_length = None
        self.body_exists = False
        self._denial = _DENIAL in scope.get("extensions", {})
        self._gone = False
        self._done = False  # the handshake was settled: accepted, refused or closed
        self._aborted = False
        self._close_sent = False
        self._status: int | None = None  # the refusal's status, once started
        self._body = bytearray()
        self._socket: AsgiWebSocket | None = None
        self._task: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Task[None] | None = None

    # -- the request ---------------------------------------------------------

    async def read_chunk(self) -> bytes:
        return b""  # a handshake has no body

    def client_gone(self) -> bool:
        return self._gone

    def bind(self, task: asyncio.Task[Any]) -> None:
        """The task serving the handshake: cancelled if the client leaves before it is
        settled."""
        self._task = task
        self._watcher = asyncio.create_task(self._wait_disconnect())

    async def _wait_disconnect(self) -> None:
        while (await self._receive())["type"] != "websocket.disconnect":
            pass  # nothing else comes before the accept
        self._left()
        task = self._task
        if task is not None and not task.done():
            task.cancel()

    def drop_watcher(self) -> None:
        """Cancel the watcher without waiting for it (the request is over)."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()

    async def stop_watching(self) -> None:
        """Stop reading ``receive`` for the client leaving: from now on its reads are the
        session's (the watcher's pending read is given up, its message left queued)."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not watcher.done():
            watcher.cancel()
            await asyncio.wait({watcher})

    def _left(self) -> None:
        self._gone = True

    async def _checked_send(self, message: Message) -> None:
        if self._gone:
            raise ClientGone("the client went away")
        try:
            await self._send(message)
        except OSError as exc:
            # ASGI 2.4: a server raises an OSError for a send on a closed connection.
            self._left()
            raise ClientGone("the client went away") from exc

    # -- the handshake accepted ----------------------------------------------

    async def accept(self, accept: Accept) -> WebSocket:
        if self._done or self._status is not None:
            raise RuntimeError("the handshake was already answered")
        await self.stop_watching()
        if self._gone:
            raise ClientGone("the client went away before its handshake was accepted")
        self._done = True
        # permessage-deflate (accept.compress) is the server's to offer: ASGI has no say.
        await self._checked_send(
            {
                "type": "websocket.accept",
                "subprotocol": accept.subprotocol,
                "headers": [
                    (name.lower().encode("latin-1"), value.encode("utf-8"))
                    for name, value in accept.headers
                ],
            }
        )
        self._socket = AsgiWebSocket(self, accept)
        return self._socket

    @property
    def accepted(self) -> bool:
        return self._socket is not None

    @property
    def answered(self) -> bool:
        """Whether the handshake was accepted, or its refusal begun."""
        return self._socket is not None or self._status is not None or self._done

    # -- the handshake refused: an HTTP answer -------------------------------

    async def start(
        self, status: int, headers: CIMultiDict[str], length: int | None, close: bool
    ) -> Writer:
        if self._done or self._status is not None:
            raise RuntimeError("the handshake was already answered")
        self._status = status
        if self._denial:
            await self.stop_watching()
            # The connection is the server's: it ends it after the answer.
            raw = [
                (name.lower().encode("latin-1"), value.encode("utf-8"))
                for name, value in headers.items()
                if name.lower() not in CONNECTION_HEADERS
            ]
            if length is not None and "Content-Length" not in headers:
                raw.append((b"content-length", str(length).encode()))
            await self._checked_send(
                {"type": "websocket.http.response.start", "status": status, "headers": raw}
            )
        return self.write

    async def write(self, data: bytes) -> None:
        if self._gone:
            raise ClientGone("the client went away")
        if self._denial:
            await self._checked_send(
                {"type": "websocket.http.response.body", "body": data, "more_body": True}
            )
        elif len(self._body) < _MAX_REFUSAL_BODY:
            self._body += data

    async def end(self, data: bytes = b"") -> None:
        if self._gone:
            raise ClientGone("the client went away")
        if self._status is None:
            raise RuntimeError("end() before start()")
        self._done = True
        if self._denial:
            await self._checked_send(
                {"type": "websocket.http.response.body", "body": data, "more_body": False}
            )
            return
        if len(self._body) < _MAX_REFUSAL_BODY:
            self._body += data
        await self._close_handshake(
            refusal_code(self._status), close_reason(self._status, self._body)
        )

    def abort(self) -> None:
        # An HTTP answer cut short is ended by the server when the application returns; a
        # refusal not sent yet becomes the default close.
        self._aborted = True

    async def _close_handshake(self, code: int, reason: str) -> None:
        """Accept the handshake only to close it with ``code``: a close before the accept
        reaches the client as a bare 403, without the code or the reason."""
        await self.stop_watching()
        self._done = True
        if self._gone:
            return
        offered = self.scope.get("subprotocols") or ()
        # A client that offered subprotocols fails a handshake that picks none (browsers
        # do) and would never read the close: the first offered is taken, and no message
        # is exchanged under it.
        await self._checked_send(
            {"type": "websocket.accept", "subprotocol": offered[0] if offered else None}
        )
        await self._send_close(code, _clip(reason))

    async def _send_close(self, code: int, reason: str) -> None:
        await self._checked_send({"type": "websocket.close", "code": code, "reason": reason})
        self._close_sent = True

    # -- the end -------------------------------------------------------------

    async def settle(self, code: int) -> None:
        """Leave the client with a close if the pipeline did not: the session closed with
        ``code``, or a handshake neither accepted nor refused closed with it. Nothing is
        sent after the client left, nor after an HTTP answer begun."""
        await self.stop_watching()
        if self._gone:
            return
        socket = self._socket
        if socket is not None:
            await socket.close(code)
        elif not self._done and (self._status is None or not self._denial):
            await self._close_handshake(code, "")

    async def linger(self) -> None:
        """After a close this side sent, wait a little for the client's: a server that ends
        the connection when the application returns (hypercorn) would otherwise cut the
        closing handshake short, and the client see an abnormal end."""
        if not self._close_sent or self._gone:
            return
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(_CLOSE_WAIT):
                while (await self._receive())["type"] != "websocket.disconnect":
                    pass  # messages sent after the close are not read
        self._left()

    @property
    def aborted(self) -> bool:
        return self._aborted


async def serve(
    answer_of: Callable[[Exchange], Awaitable[StreamResponse]],
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    """Serve one ``websocket`` scope: ``answer_of`` is the ASGI application's way to its
    proxy's pipeline (the not-open 503 and the head checks first, as for HTTP)."""
    if (await receive())["type"] != "websocket.connect":
        return  # the client left before its handshake reached the application
    exchange = AsgiWebSocketExchange(scope, receive, send)
    task = asyncio.current_task()
    assert task is not None
    exchange.bind(task)
    try:
        answer = await answer_of(exchange)
        # A whole-body answer is for the front end to send, as under HTTP; any other answer
        # the pipeline left unsent is no refusal, and the handshake gets the default close.
        if not exchange.answered and isinstance(answer, Response) and not answer.prepared:
            await answer.prepare(exchange)
            await answer.write_eof()
    except asyncio.CancelledError:
        if exchange.client_gone() and task.uncancel() == 0:
            return  # the client left: nothing to answer, nobody to tell
        # Shutdown: the client is told, without waiting long on it.
        with contextlib.suppress(TimeoutError, ClientGone):
            async with asyncio.timeout(CUT_WAIT):
                await exchange.settle(GOING_AWAY)
        raise
    except ClientGone:
        return
    except BaseException:
        with contextlib.suppress(ClientGone):
            await exchange.settle(INTERNAL_ERROR)
        raise
    finally:
        exchange.drop_watcher()
    with contextlib.suppress(ClientGone):
        # Returned without a close: the client must not take the session's end for a clean
        # one.
        await exchange.settle(INTERNAL_ERROR)
    await exchange.linger()
