"""Limits on what a client may send, and how slowly: the proxy's first line of defence.

Three layers, cheapest first:

* :class:`EdgeRequestHandler` (the proxy's own listener) enforces the
  connection-level limits aiohttp does not have: a cap on open connections,
  in all and from one client address, a header read timeout, three bounds on
  a body against slowloris (an idle timeout between reads, a minimum average
  rate and a total deadline), the body size of chunked uploads, and parser
  errors answered as OpenAI-shaped JSON with the precise status (414 for a
  request line too long, 431 for headers, 505 for an HTTP version it cannot
  parse).
* :func:`limits_middleware` checks the request head before any stage or
  plugin sees it: framing that could smuggle a second request past another
  hop (``Transfer-Encoding`` the proxy would not read the same way, duplicate
  ``Content-Length``), HTTP versions, request-target forms, methods that make
  no sense through a reverse proxy, header bytes that are not UTF-8,
  expectations other than ``100-continue`` (417), and a declared body over
  ``max_body_size`` (413 before reading it). A framing error closes the
  connection, since the proxy can no longer tell where the next request
  starts. What aiohttp would answer itself (its router's 404 or 405, its
  417) comes out in the same JSON shape: every answer the proxy gives itself
  carries ``X-Edgeproxy-Region`` and an HTTP/1.1 status line, whatever
  version the client sent.
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

This module holds the guarded listener (:class:`GuardedSite`). The guard its
connections share is :mod:`~edgeproxy._server.guard`'s, the handler
:mod:`~edgeproxy._server.handler`'s, the middleware :mod:`~edgeproxy._server.middleware`'s,
each importable from here too.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from aiohttp import web
from yarl import URL

from edgeproxy._protocol.bodies import BodyTimeout, BodyTooLarge
from edgeproxy._server.guard import ConnectionGuard
from edgeproxy._server.handler import EdgeRequestHandler
from edgeproxy._server.middleware import expect_handler, limits_middleware

__all__ = [
    "BodyTimeout",
    "BodyTooLarge",
    "ConnectionGuard",
    "EdgeRequestHandler",
    "GuardedSite",
    "expect_handler",
    "limits_middleware",
]


def _not_started() -> EdgeRequestHandler:
    raise RuntimeError("the site has not started")


class GuardedSite(web.BaseSite):
    """A TCP site serving :class:`EdgeRequestHandler` connections under one guard."""

    __slots__ = (
        "_guard",
        "_host",
        "_port",
        "_reuse_port",
        "_ssl",
        "handler_factory",
        "handshake_timeout",
    )

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
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner, backlog=backlog, shutdown_timeout=shutdown_timeout)
        self._host = host
        self._port = port
        self._guard = guard
        self._reuse_port = reuse_port
        self._ssl = ssl_context
        # asyncio's default (60 s) unless a subclass bounds the TLS handshake.
        self.handshake_timeout: float | None = None
        self.handler_factory: Callable[[], EdgeRequestHandler] = _not_started

    @property
    def guard(self) -> ConnectionGuard:
        """The limits and counters of this site's connections."""
        return self._guard

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl is not None else "http"
        return str(URL.build(scheme=scheme, host=self._host, port=self._port))

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

        self.handler_factory = factory
        self._server = await loop.create_server(
            self.protocol_factory(),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            reuse_port=self._reuse_port or None,
            ssl=self._ssl,
            ssl_handshake_timeout=self.handshake_timeout if self._ssl is not None else None,
        )

    def protocol_factory(self) -> Callable[[], asyncio.Protocol]:
        """What makes the protocol of each connection accepted: the HTTP/1.1 handler."""
        return self.handler_factory
