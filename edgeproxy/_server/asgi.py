"""The ASGI front end: the proxy as an ASGI application, for Starlette and FastAPI hosts and
for ASGI servers.

An ASGI request becomes the pipeline's :class:`Exchange`. The request head is checked as
the aiohttp listener checks it; the body is read through ``receive`` and bounded as the
aiohttp listener bounds it (size, stall, rate and deadline). Once the body has been read,
a watcher keeps reading ``receive``: ``http.disconnect`` marks the client gone and
cancels the request's task, so upstream work stops when the client leaves, as
``handler_cancellation`` does under aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from multidict import CIMultiDict

from edgeproxy._core.config import Config
from edgeproxy._core.errors import ProxyError
from edgeproxy._core.exchange import Exchange, Writer
from edgeproxy._core.response import StreamResponse
from edgeproxy._protocol.bodies import BodyTooLarge, body_wait
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
from edgeproxy._server.asgiws import serve as serve_websocket
from edgeproxy._server.headchecks import check_head, own_answer
from edgeproxy._server.listener import ConnectionGuard

__all__ = ["AnswerAborted", "AsgiApp", "AsgiExchange", "ClientGone", "Served"]

logger = logging.getLogger("edgeproxy")

_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})


class AnswerAborted(Exception):
    """Raised to the ASGI server after an answer that must not look complete: the server
    then resets the stream (HTTP/2) or closes the connection (HTTP/1.1)."""


class Served(Protocol):
    """What the ASGI application needs of the proxy it serves."""

    @property
    def config(self) -> Config: ...

    @property
    def guard(self) -> ConnectionGuard: ...

    @property
    def is_open(self) -> bool: ...

    @property
    def ever_opened(self) -> bool: ...

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def serve_exchange(self, exchange: Exchange) -> StreamResponse: ...


class AsgiExchange(Exchange):
    """One ASGI HTTP request (scope, ``receive``, ``send``) as the pipeline's exchange."""

    __slots__ = (
        "_active",
        "_aborted",
        "_gone",
        "_guard",
        "_more",
        "_read_started",
        "_received",
        "_receive",
        "_send",
        "_started",
        "_task",
        "_watcher",
        "scope",
    )

    def __init__(self, scope: Scope, receive: Receive, send: Send, guard: ConnectionGuard) -> None:
        self.native = self.scope = scope
        self._receive = receive
        self._send = send
        # Its limits bound the body; a body that breaks one is counted in /status with the
        # listener's own.
        self._guard = guard
        self.method = scope["method"]
        self.target = scope_target(scope)
        headers = self.headers = scope_headers(scope.get("headers", []))
        client = scope.get("client")
        self.client = client[0] if client else None
        self.scheme = scope.get("scheme", "http")
        self.version = version = scope.get("http_version", "1.1")
        server = scope.get("server")
        self.host = headers.get("Host") or (f"{server[0]}:{server[1]}" if server else "")
        self.tls = scope_tls(scope, version) if self.scheme == "https" else None
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.body_exists = (
            bool(self.content_length)
            if self.content_length is not None
            else "Transfer-Encoding" in headers
            or (version == "2" and self.method not in _NO_BODY_METHODS)
        )
        self._more = self.body_exists
        self._read_started = False
        self._received = 0
        self._active = 0.0  # seconds spent waiting for body bytes
        self._gone = False
        self._started = False
        self._aborted = False
        self._task: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Task[None] | None = None

    # -- the request body ------------------------------------------------

    async def read_chunk(self) -> bytes:
        self._read_started = True
        while self._more:
            message = await self._next_body_message()
            if message["type"] == "http.disconnect":
                self._more = False
                self._client_left()
                raise ClientGone("the client went away while sending its body")
            body: bytes = message.get("body", b"")
            self._more = bool(message.get("more_body", False))
            if not self._more:
                self._watch()
            if body:
                self._received += len(body)
                limit = self._guard.limits.max_body_size
                if limit and self._received > limit:
                    too_large = BodyTooLarge(limit)
                    self._guard.count_body_error(too_large)
                    raise too_large
                return body
        return b""

    async def _next_body_message(self) -> Message:
        """The next message, within the body's bounds (the time spent here is all that
        counts: time the proxy did not read is not the client's)."""
        limits = self._guard.limits
        try:
            message, waited = await body_wait(
                self._receive(),
                limits,
                active=self._active,
                received=self._received,
                rate_grace=limits.body_rate_grace,
            )
        except ProxyError as error:
            self._guard.count_body_error(error)
            raise
        self._active += waited
        return message

    def client_gone(self) -> bool:
        return self._gone

    # -- the client going away -------------------------------------------

    def bind(self, task: asyncio.Task[Any]) -> None:
        """The task serving this request: cancelled when the client disconnects."""
        self._task = task
        if not self._more:
            self._watch()

    def _watch(self) -> None:
        if self._watcher is None and self._task is not None:
            self._watcher = asyncio.create_task(self._wait_disconnect())

    async def _wait_disconnect(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._client_left()
                return
            # A body nobody reads (the answer came first): its bytes are dropped.

    def _client_left(self) -> None:
        if self._gone:
            return
        self._gone = True
        task = self._task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    def queued(self, waiting: bool) -> None:
        # A server that tells a client's half-close apart (the HTTP/2 listener's HTTP/1.1
        # side) cancels the request, through this, when one comes while it waits.
        hook = self.scope.get("extensions", {}).get("edgeproxy.queued")
        if hook is not None:
            hook(self._client_left if waiting else None)

    def close(self) -> None:
        """Stop watching for the client (the request is over)."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()

    # -- the response ----------------------------------------------------

    async def start(
        self, status: int, headers: CIMultiDict[str], length: int | None, close: bool
    ) -> Writer:
        if not self._more and not self._read_started:
            # No body to read: from now on, receive only says whether the client left.
            self._watch()
        h2 = self.version == "2"
        raw = [
            (name.lower().encode("latin-1"), value.encode("utf-8"))
            for name, value in headers.items()
            if not (h2 and name.lower() in CONNECTION_HEADERS)
        ]
        if length is not None and "Content-Length" not in headers:
            raw.append((b"content-length", str(length).encode()))
        if close and not h2 and "Connection" not in headers:
            raw.append((b"connection", b"close"))
        self._started = True
        await self._checked_send({"type": "http.response.start", "status": status, "headers": raw})
        return self.write

    async def write(self, data: bytes) -> None:
        if self._gone:
            raise ClientGone("the client went away")
        await self._checked_send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        if self._gone:
            raise ClientGone("the client went away")
        await self._checked_send({"type": "http.response.body", "body": data, "more_body": False})

    async def _checked_send(self, message: Message) -> None:
        try:
            await self._send(message)
        except OSError as exc:
            # ASGI 2.4: a server raises an OSError for a send on a closed connection.
            self._client_left()
            raise ClientGone("the client went away") from exc

    def abort(self) -> None:
        reset = self.scope.get("extensions", {}).get("edgeproxy.reset")
        if reset is not None:
            reset()  # the stream is reset: nothing left for the server to do
        else:
            self._aborted = True

    async def cut(self, data: bytes) -> None:
        if not self._gone and self._started:
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                async with asyncio.timeout(CUT_WAIT):
                    await self.write(data)
        self.abort()

    @property
    def started(self) -> bool:
        return self._started

    @property
    def aborted(self) -> bool:
        """Whether the answer was aborted and the server must end it (no reset extension)."""
        return self._aborted


class AsgiApp:
    """The proxy as an ASGI application (``proxy.asgi``).

    Mount it in a host (``app.mount("/llm", proxy.asgi)``) or serve it with any ASGI
    server. ``lifespan`` events open and close the proxy's pools; a host whose router
    does not forward them to mounted apps (Starlette, FastAPI) passes
    :meth:`EdgeProxy.lifespan <edgeproxy.EdgeProxy.lifespan>` as its own ``lifespan``.
    Mounted without either, the proxy opens on its first request, once, with a warning
    that says how to open and close it properly (it is then closed by nobody).

    A ``websocket`` scope is a handshake the pipeline accepts or refuses like any
    request (see :mod:`edgeproxy._server.asgiws`).

    A server may put a callable in the scope's ``extensions["edgeproxy.reset"]``: an
    aborted answer calls it to reset the request's stream at once (the HTTP/2 listener
    does; otherwise the application raises :class:`AnswerAborted` to its server). One in
    ``extensions["edgeproxy.queued"]`` is called with what cancels the request when it
    starts waiting in the admission queue, and with None once it no longer does: a server
    that answers clients that half-close (the HTTP/2 listener's HTTP/1.1 side) calls the
    one it holds on a FIN, so that a client that closed gives up its place.
    """

    def __init__(self, proxy: Served) -> None:
        self.proxy = proxy
        self._opening: asyncio.Lock | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "websocket":
            # Imported here: the WebSocket exchange builds on this module's helpers.

            await serve_websocket(self._answer, scope, receive, send)
        else:
            raise ValueError(f"unknown ASGI scope type {kind!r}")

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        proxy = self.proxy
        exchange = AsgiExchange(scope, receive, send, proxy.guard)
        task = asyncio.current_task()
        assert task is not None
        exchange.bind(task)
        try:
            answer = await self._answer(exchange)
            if not answer.prepared and not exchange.started and not exchange.client_gone():
                await answer.prepare(exchange)
                await answer.write_eof()
        except asyncio.CancelledError:
            if exchange.client_gone() and task.uncancel() == 0:
                return  # the client left: nothing to answer, nobody to tell
            raise
        except ClientGone:
            return
        finally:
            exchange.close()
        if exchange.aborted:
            raise AnswerAborted("the answer was aborted")

    async def _answer(self, exchange: Exchange) -> StreamResponse:
        if not self.proxy.is_open and not await self._open_on_first_request():
            return own_answer(
                ProxyError(
                    503,
                    "service_unavailable",
                    "the proxy is not open: run its ASGI lifespan, or pass proxy.lifespan "
                    "to the host application",
                    code="not_open",
                )
            )
        error = check_head(
            exchange.method,
            exchange.target,
            exchange.headers,
            0 if exchange.version == "1.0" else 1,
            self.proxy.config.limits,
        )
        if error is not None:
            # A declared body over the limit is refused here, before any of it is read: it
            # counts as one too large, as one that grows past the limit does while read.
            self.proxy.guard.count_body_error(error)
            return own_answer(error)
        # The pipeline answers every ProxyError itself (a body bound while it reads, too).
        return await self.proxy.serve_exchange(exchange)

    async def _open_on_first_request(self) -> bool:
        """Open a proxy mounted without a lifespan, once; False when it stays closed (it
        was closed after being open, or opening failed)."""
        proxy = self.proxy
        if proxy.ever_opened:
            return proxy.is_open
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if proxy.ever_opened:
                return proxy.is_open
            logger.warning(
                "edgeproxy: the proxy was not opened by its host's lifespan, so its first "
                "request opens it and nothing will close it. Pass lifespan=proxy.lifespan to "
                "the host (FastAPI(lifespan=proxy.lifespan), Starlette(lifespan=...)), or "
                "serve proxy.asgi with an ASGI server that runs its lifespan"
            )
            try:
                await proxy.open()
            except Exception:
                logger.exception("edgeproxy: opening the proxy on its first request failed")
                return False
        return proxy.is_open

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            kind = message["type"]
            if kind == "lifespan.startup":
                try:
                    await self.proxy.open()
                except Exception as exc:
                    logger.exception("edgeproxy could not start")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif kind == "lifespan.shutdown":
                try:
                    await self.proxy.close()
                except Exception as exc:
                    logger.exception("edgeproxy did not close cleanly")
                    await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.shutdown.complete"})
                return
