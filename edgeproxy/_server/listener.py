"""Limits on what a client may send, and how slowly: the proxy's first line of defence.

Three layers, cheapest first:

* :class:`EdgeRequestHandler` (the proxy's own listener) enforces the
  connection-level limits aiohttp does not have: a cap on open connections,
  a header read timeout, a body idle timeout against slowloris, the body size
  of chunked uploads, and parser errors answered as OpenAI-shaped JSON with
  the precise status (414 for a request line too long, 431 for headers).
* :func:`limits_middleware` checks the request head before any stage or
  plugin sees it: framing that could smuggle a second request past another
  hop (``Transfer-Encoding`` the proxy would not read the same way, duplicate
  ``Content-Length``), HTTP versions, request-target forms, methods that make
  no sense through a reverse proxy, header bytes that are not UTF-8, and a
  declared body over ``max_body_size`` (413 before reading it). A framing
  error closes the connection, since the proxy can no longer tell where the
  next request starts.
* :func:`read_json_body` validates the JSON body of LLM routes before any
  upstream work (400 for the wrong content type, invalid JSON or UTF-8, or a
  body that is not an object).

aiohttp's C parser (llhttp) already answers 400 and closes for ``Content-Length``
together with ``Transfer-Encoding``, duplicate or malformed ``Content-Length``,
obsolete line folding, bare LF/CR line ends and bad chunk sizes. Its pure-Python
fallback (``AIOHTTP_NO_EXTENSIONS=1``) lets a few through (``Transfer-Encoding:
chunked, chunked``, lower-case methods, raw non-ASCII bytes in the target), and
both accept ``Transfer-Encoding`` on HTTP/1.0, codings other than ``chunked``,
absolute-form targets and HTTP/0.9: the middleware closes those gaps, whichever
parser runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.typedefs import Middleware
from aiohttp.web_request import BaseRequest
from yarl import URL

from edgeproxy._core.config import LimitsConfig
from edgeproxy._core.errors import ProxyError, error_body, error_response
from edgeproxy._protocol.bodies import BodyTimeout, BodyTooLarge
from edgeproxy._protocol.headers import request_id

__all__ = [
    "BodyTimeout",
    "BodyTooLarge",
    "ConnectionGuard",
    "EdgeRequestHandler",
    "GuardedSite",
    "check_request_head",
    "limits_middleware",
]

logger = logging.getLogger("edgeproxy")

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Methods a reverse proxy must not forward: CONNECT would tunnel, TRACE reflects
# the request (cookies and credentials included) back to a script (XST).
_REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
# Codings a server may receive in Transfer-Encoding; the proxy only decodes chunked.
_KNOWN_CODINGS = frozenset({"chunked", "gzip", "x-gzip", "deflate", "compress", "identity"})
# Error messages echo at most this much of what the client sent.
_ECHO_LIMIT = 120


# -- the request head ------------------------------------------------------------


def _framing_error(status: int, message: str, code: str) -> ProxyError:
    # The proxy cannot know where the next request on this connection starts.
    return ProxyError(
        status, "invalid_request_error", message, code=code, headers={"Connection": "close"}
    )


def check_request_head(request: BaseRequest, limits: LimitsConfig) -> ProxyError | None:
    """What is wrong with the request line and headers, if anything; None when they are fine."""
    version = request.version
    if version.major != 1 or version.minor not in (0, 1):
        return _framing_error(
            505, "Only HTTP/1.0 and HTTP/1.1 are supported.", "http_version_not_supported"
        )
    headers = request.headers
    te = headers.getall("Transfer-Encoding", ())
    if te:
        if version.minor == 0:
            # RFC 9112 6.1: a 1.0 message with Transfer-Encoding has faulty framing.
            return _framing_error(
                400, "Transfer-Encoding is not allowed in HTTP/1.0.", "invalid_framing"
            )
        if "Content-Length" in headers:
            return _framing_error(
                400, "Content-Length and Transfer-Encoding together.", "invalid_framing"
            )
        codings = [c.strip().lower() for value in te for c in value.split(",")]
        if codings != ["chunked"]:
            known = all(c in _KNOWN_CODINGS for c in codings)
            if known and codings[-1] == "chunked" and codings.count("chunked") == 1:
                return _framing_error(
                    501, "Only Transfer-Encoding: chunked is supported.", "not_implemented"
                )
            return _framing_error(400, "Invalid Transfer-Encoding.", "invalid_framing")
    lengths = headers.getall("Content-Length", ())
    if len(lengths) > 1:
        return _framing_error(400, "Duplicate Content-Length.", "invalid_framing")
    if lengths:
        if not lengths[0].isdigit() or not lengths[0].isascii():
            return _framing_error(400, "Invalid Content-Length.", "invalid_framing")
        if limits.max_body_size and int(lengths[0]) > limits.max_body_size:
            return BodyTooLarge(limits.max_body_size)
    method = request.method
    if method in _REFUSED_METHODS:
        return ProxyError(
            405,
            "invalid_request_error",
            f"Method {method} is not allowed through this proxy.",
            code="method_not_allowed",
        )
    target = request.raw_path
    if not target.startswith("/") and not (target == "*" and method == "OPTIONS"):
        return ProxyError(
            400,
            "invalid_request_error",
            "The request target must be a path (origin-form); this is not a forward proxy.",
            code="invalid_target",
        )
    if not target.isascii():
        return ProxyError(
            400,
            "invalid_request_error",
            "The request target has raw non-ASCII bytes; percent-encode them.",
            code="invalid_target",
        )
    for name, value in headers.items():
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                # aiohttp keeps undecodable bytes as surrogates; they cannot be forwarded.
                return ProxyError(
                    400,
                    "invalid_request_error",
                    f"Header {name[:_ECHO_LIMIT]!r} is not valid UTF-8.",
                    code="invalid_header",
                )
    return None


def limits_middleware(limits: LimitsConfig) -> Middleware:
    """The request-head checks, and the per-request hooks of :class:`EdgeRequestHandler`."""

    @web.middleware
    async def edgeproxy_limits(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        error = check_request_head(request, limits)
        if error is not None:
            resp = error_response(
                error.status,
                error.type,
                error.message,
                code=error.code,
                headers={"X-Edgeproxy-Region": "none", "X-Request-Id": request_id(None)},
            )
            if error.headers.get("Connection") == "close" or error.status == 413:
                resp.force_close()
            return resp
        protocol = request.protocol
        if not isinstance(protocol, EdgeRequestHandler):
            # Mounted in a host application: its own server, without these timers.
            return await handler(request)
        protocol.request_started(request)
        try:
            return await handler(request)
        finally:
            protocol.request_finished()

    return edgeproxy_limits


# -- connections -----------------------------------------------------------------


class ConnectionGuard:
    """The limits and counters shared by every connection of one listener."""

    def __init__(self, limits: LimitsConfig) -> None:
        self.limits = limits
        self.open = 0
        self.refused = 0
        self.header_timeouts = 0
        self.body_timeouts = 0
        self.bodies_too_large = 0

    def handler_kwargs(self) -> dict[str, Any]:
        """aiohttp ``RequestHandler`` settings for these limits."""
        limits = self.limits
        return {
            "max_line_size": limits.max_request_line,
            "max_field_size": limits.max_header_size,
            "max_headers": limits.max_headers,
            "keepalive_timeout": limits.keepalive_timeout,
            # A proxy forwards bodies as they are: decoding gzip here would
            # both corrupt them (Content-Encoding still says gzip) and let a
            # small upload expand past max_body_size.
            "auto_decompress": False,
        }

    def snapshot(self) -> dict[str, Any]:
        return {
            "connections_open": self.open,
            "max_connections": self.limits.max_connections,
            "connections_refused": self.refused,
            "header_timeouts": self.header_timeouts,
            "body_timeouts": self.body_timeouts,
            "bodies_too_large": self.bodies_too_large,
        }


# Connection phases, see EdgeRequestHandler.
_IDLE, _HEAD, _BODY, _BUSY, _DRAIN = range(5)


def _raw_error(status: int, message: str, code: str) -> bytes:
    body = error_body("invalid_request_error", message, code=code)
    phrase = HTTPStatus(status).phrase
    return (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        "X-Edgeproxy-Region: none\r\n\r\n"
    ).encode("ascii") + body


class EdgeRequestHandler(web.RequestHandler):
    """aiohttp's HTTP/1.1 connection handler plus the limits it lacks.

    Phases: idle (between requests), head (bytes of a request head are
    arriving: the header timeout runs), body (the handler runs and the body
    is still arriving: the idle timeout runs and the size is counted), busy
    (the handler runs, the body is complete), drain (the handler answered
    without reading the whole body, which aiohttp now discards). The
    middleware reports when a handler starts and ends.
    """

    __slots__ = (
        "_guard",
        "_counted",
        "_phase",
        "_timer",
        "_payload",
        "_last_data",
        "_head_bytes",
        "_line_len",
        "_stalled",
    )

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._counted = False
        self._phase = _IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._payload: Any = None
        self._last_data = 0.0
        self._head_bytes = 0
        self._line_len = -1  # length of the request line, once its end arrived
        self._stalled = False

    # -- asyncio protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        guard = self._guard
        if guard.open >= guard.limits.max_connections:
            guard.refused += 1
            self._refuse(
                503,
                "Too many connections to this proxy; retry shortly.",
                "too_many_connections",
                retry_after=1,
            )
            return
        guard.open += 1
        self._counted = True
        # A new connection must send its first request head in time.
        self._phase = _HEAD
        self._arm(guard.limits.header_timeout, self._head_timeout)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._counted = False
            self._guard.open -= 1
        self._cancel_timer()
        self._payload = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        phase = self._phase
        if phase == _BODY:
            self._last_data = self._loop.time()
        elif phase == _DRAIN:
            super().data_received(data)
            if self._payload is None or self._payload.is_eof():
                self._payload = None
                self._phase = _IDLE
            return
        elif data and phase != _BUSY:
            if phase == _IDLE:
                self._phase = _HEAD
                self._head_bytes = 0
                self._line_len = -1
                self._arm(self._guard.limits.header_timeout, self._head_timeout)
            if self._line_len < 0:
                end = data.find(b"\n")
                if end >= 0:
                    self._line_len = self._head_bytes + end
                self._head_bytes += len(data)
        super().data_received(data)
        if self._phase == _BODY:
            self._check_size()

    def pause_reading(self) -> None:
        # The proxy, not the client, stopped the body: not a stall.
        self._stalled = True
        super().pause_reading()

    def resume_reading(self, resume_parser: bool = True) -> None:
        self._stalled = False
        self._last_data = self._loop.time()
        super().resume_reading(resume_parser)

    # -- request lifecycle (from the middleware) -------------------------------------

    def request_started(self, request: BaseRequest) -> None:
        self._cancel_timer()
        payload = request.content
        self._payload = payload
        # Part of the body, or all of it, may have arrived with the head.
        self._check_size()
        if payload.is_eof():
            self._phase = _BUSY
            return
        self._phase = _BODY
        self._last_data = self._loop.time()
        self._arm(self._guard.limits.body_timeout, self._body_timeout)

    def _check_size(self) -> None:
        payload = self._payload
        limit = self._guard.limits.max_body_size
        if payload is not None and limit and payload.total_bytes > limit:
            if payload.exception() is None:
                self._guard.bodies_too_large += 1
                self._abort_body(BodyTooLarge(limit))

    def _abort_body(self, error: ProxyError) -> None:
        """Fail the body for whoever reads it, and close once the answer is sent.

        The handler reading the body gets ``error`` and answers it; aiohttp
        must then not "linger" reading the rest of an unwanted body (it would
        hit the same error), so the connection closes right after the answer.
        """
        assert self._payload is not None
        self._payload.set_exception(error)
        self._lingering_time = 0.0
        self.close()

    def request_finished(self) -> None:
        self._cancel_timer()
        payload = self._payload
        if payload is not None and not payload.is_eof() and payload.exception() is None:
            # aiohttp drains the unread body ("lingering"): those bytes are no request head.
            self._phase = _DRAIN
            return
        self._payload = None
        self._phase = _IDLE

    # -- timers ----------------------------------------------------------------

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timeout(self) -> None:
        self._timer = None
        if self._phase != _HEAD or self.transport is None:
            return
        self._guard.header_timeouts += 1
        self._refuse(
            408,
            f"The request head did not arrive within {self._guard.limits.header_timeout:g} "
            "seconds.",
            "request_timeout",
        )

    def _body_timeout(self) -> None:
        self._timer = None
        payload = self._payload
        if self._phase != _BODY or payload is None or payload.is_eof():
            return
        timeout = self._guard.limits.body_timeout
        idle = self._loop.time() - self._last_data
        if self._stalled or idle < timeout:
            self._arm(timeout - idle if not self._stalled else timeout, self._body_timeout)
            return
        self._guard.body_timeouts += 1
        self._abort_body(BodyTimeout(timeout))

    def _refuse(self, status: int, message: str, code: str, retry_after: int = 0) -> None:
        """Answer outside any request (no handler runs) and close the connection."""
        transport = self.transport
        if transport is None:
            return
        raw = _raw_error(status, message, code)
        if retry_after:
            raw = raw.replace(b"\r\n\r\n", f"\r\nRetry-After: {retry_after}\r\n\r\n".encode(), 1)
        transport.write(raw)
        self.force_close()

    # -- errors ----------------------------------------------------------------

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Parser and handler errors as OpenAI-shaped JSON, always closing the connection."""
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        code = "bad_request"
        if status == 500:
            logger.error("unhandled error serving a request", exc_info=exc)
            message, code, type_ = "Internal error in the proxy.", "internal_error", "server_error"
        elif status == 504:
            message, code, type_ = "The proxy timed out.", "timeout", "server_error"
        else:
            type_ = "invalid_request_error"
            if isinstance(exc, LineTooLong):
                # Which line ran long: the request line, unless it ended in time.
                line_len = self._line_len
                if 0 <= line_len <= self._guard.limits.max_request_line + 1:
                    status, code = 431, "headers_too_large"
                    message = "Request header fields too large."
                else:
                    status, code = 414, "request_line_too_long"
                    message = "Request line (method and target) too long."
            elif message and "Too many headers" in message:
                status, code, message = 431, "headers_too_large", "Too many header fields."
            else:
                # Parser messages quote the offending bytes; keep them short.
                message = f"Malformed request: {(message or 'bad request')[:_ECHO_LIMIT]}"
            logger.debug("bad request from %s: %s", request.remote, exc)
        resp = error_response(
            status, type_, message, code=code, headers={"X-Edgeproxy-Region": "none"}
        )
        resp.force_close()
        return resp


class GuardedSite(web.BaseSite):
    """A TCP site serving :class:`EdgeRequestHandler` connections under one guard."""

    __slots__ = ("_host", "_port", "_guard", "_reuse_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        guard: ConnectionGuard,
        backlog: int = 128,
        shutdown_timeout: float = 60.0,
        reuse_port: bool = False,
    ) -> None:
        super().__init__(runner, backlog=backlog, shutdown_timeout=shutdown_timeout)
        self._host = host
        self._port = port
        self._guard = guard
        self._reuse_port = reuse_port

    @property
    def name(self) -> str:
        return str(URL.build(scheme="http", host=self._host, port=self._port))

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        guard = self._guard
        kwargs = guard.handler_kwargs()
        # The runner's own settings (access log off, debug) are aiohttp's defaults here.
        kwargs["access_log"] = None

        def factory() -> EdgeRequestHandler:
            return EdgeRequestHandler(server, loop=loop, guard=guard, **kwargs)

        self._server = await loop.create_server(
            factory,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            reuse_port=self._reuse_port or None,
        )
