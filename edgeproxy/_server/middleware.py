"""The limits middleware (:func:`limits_middleware`: the request-head checks before any
stage or plugin sees a request) and the ``Expect`` handler that goes with it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_writer import HttpVersion11
from aiohttp.typedefs import Middleware

from edgeproxy._core.config import LimitsConfig
from edgeproxy._server.handler import EdgeRequestHandler
from edgeproxy._server.headchecks import check_request_head, http_exception_error, own_error

__all__ = ["expect_handler", "limits_middleware"]


def expect_handler(limits: LimitsConfig) -> Callable[[web.Request], Awaitable[None]]:
    """The route's ``Expect`` handler: ``100 Continue`` only for a head the proxy accepts.

    aiohttp calls it before any middleware; it never answers itself, so that
    :func:`limits_middleware` gives every refusal (a 417 for an unknown
    expectation, a 413 for a declared body too large...) in the one JSON
    shape, and a client waiting to send a body it must not send is not invited to.
    """

    async def edgeproxy_expect(request: web.Request) -> None:
        if request.version != HttpVersion11 or check_request_head(request, limits) is not None:
            return
        if request.headers.get("Expect", "").strip().lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            # The 100 is no part of the answer (aiohttp's own handler does the same).
            request.writer.output_size = 0

    return edgeproxy_expect


def limits_middleware(limits: LimitsConfig, server: str = "edgeproxy") -> Middleware:
    """The request-head checks, and the per-request hooks of :class:`EdgeRequestHandler`;
    ``server``: the Server header of the refusals (``""``: none)."""

    @web.middleware
    async def edgeproxy_limits(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # Mounted in a host application, its own server runs without these timers.
        protocol = request.protocol if isinstance(request.protocol, EdgeRequestHandler) else None
        if protocol is not None:
            # First: the head's timer stops here, whoever answers (a refusal too).
            protocol.request_started(request)
        try:
            error = check_request_head(request, limits)
            if error is not None:
                if protocol is not None:
                    # A declared body over the limit counts as one that grows past it.
                    protocol.head_refused(error)
                return own_error(error, server=server)
            try:
                return await handler(request)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                return own_error(http_exception_error(exc), server=server)
            except asyncio.CancelledError:
                if protocol is not None:
                    protocol.request_cancelled(request)
                raise
        finally:
            if protocol is not None:
                protocol.request_finished()

    return edgeproxy_limits
