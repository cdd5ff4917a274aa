"""The HTTP/2 client listener (``server.http2``): jh2 reads and writes the frames, the
pipeline serves each stream, and HTTP/1.1 on the same port is the default listener's.

One listening socket serves both protocols. A connection is told apart at once: over TLS
by ALPN; in cleartext (``server.h2c``) by its first bytes, the HTTP/2 preface (prior
knowledge) or an HTTP/1.1 request asking ``Upgrade: h2c``. Every other connection is
handed, with the bytes read so far, to the aiohttp handler of the default listener
(:class:`~edgeproxy._server.listener.EdgeRequestHandler`): HTTP/1.1 here is the same code,
with the same head checks, JSON errors, 505 and limits.

An HTTP/2 connection (:class:`H2Connection`) runs jh2's state machine; each request stream
becomes an :class:`H2Exchange`, served by the pipeline in a task of its own, cancelled
when its client resets the stream or leaves. On top of jh2, with the limits of
``[limits]``:

* **stream errors stay stream errors** (RFC 9113 §8.1.1): a malformed request (a bad field
  name or value, a connection-specific field, pseudo-headers out of order or missing, a
  ``content-length`` its DATA does not match, trailers that do not end the stream) gets
  RST_STREAM ``PROTOCOL_ERROR`` on its own stream, counted as ``h2_stream_errors``; jh2's
  own checks, which end the connection, are off;
* **the stream cap**: ``h2_max_concurrent_streams`` is advertised, and a stream past it gets
  RST_STREAM ``REFUSED_STREAM`` (safe to retry), counted as ``h2_refused_streams``;
* **abuse by cost**: streams the client cancels before their answer ends, and streams the
  proxy resets before any region sees them (malformed, over the cap), each cost one; past
  ``h2_max_premature_resets`` (the count halves every 30 seconds), GOAWAY
  ``ENHANCE_YOUR_CALM`` (rapid reset, CVE-2023-44487), however many cheap requests the
  connection also sends. An answer the proxy gives itself (a 429, a 4xx) costs nothing
  here: a browser's tabs share one connection;
* **floods**: PING, SETTINGS (one per entry), PRIORITY, unknown frames and empty DATA
  frames share ``h2_max_control_frames`` per 10 seconds; WINDOW_UPDATE frames get that
  many plus four per DATA frame the proxy sent and per stream the client opened in the
  window (a client reading a long answer sends one or two per frame, and may open each
  stream's window at once): past either, GOAWAY ``ENHANCE_YOUR_CALM``;
* **flow control pushes back**: an answer the client does not take waits in a bounded
  buffer (256 KiB per stream, 1 MiB per connection, each stream 32 KiB at least), then the
  pipeline's write waits and the proxy stops reading the region; a stream whose client
  takes nothing for ``server.h2_send_stall_timeout`` is reset (``CANCEL``), counted as
  ``h2_send_stalls``; a socket the client does not read stops every stream's writes;
* **framing** (:mod:`~edgeproxy._http2.frames`): a frame declared past
  SETTINGS_MAX_FRAME_SIZE gets GOAWAY ``FRAME_SIZE_ERROR`` as its header arrives; of a
  frame not yet whole only what came is held, and a read costs what its bytes do;
* **the head deadline**: a header block must be whole within ``header_timeout`` once its
  first frame came, and so must a frame once its first byte came (a DATA frame within
  ``body_timeout``), streams open or not;
* **the header list**: SETTINGS_MAX_HEADER_LIST_SIZE is what HTTP/1.1 takes; a request past
  it, or past ``max_headers`` or ``max_header_size``, gets 431 on its stream alone;
* **idle**: a connection with no stream for ``keepalive_timeout`` gets GOAWAY and closes;
  one the client closed or reset frees its place under the caps at once;
* **WebSockets** (RFC 8441): SETTINGS_ENABLE_CONNECT_PROTOCOL is advertised, and a
  ``CONNECT`` with ``:protocol websocket`` is a WebSocket handshake
  (:mod:`~edgeproxy._server.h2websocket`): a stream like any other under these limits,
  whose DATA is bounded by the message size rather than the body's limits, and which is
  not stalled for being idle.

Request bodies are bounded as on every front end (size, stall, rate, deadline). A
request's receive window (64 KiB) is given back as the pipeline reads its body, so an
upload pushes back too.

The listener's parts: :mod:`~edgeproxy._server.h2front` tells a new connection's protocol
apart; :mod:`~edgeproxy._server.h2connection` runs one HTTP/2 connection and its streams'
lifecycle, with :mod:`~edgeproxy._server.h2flow` (the answers, flow control) and
:mod:`~edgeproxy._server.h2limits` (abuse, deadlines, idle) as its base classes, on
:mod:`~edgeproxy._server.h2serverengine` (jh2 with per-stream errors);
:mod:`~edgeproxy._server.h2exchange` is one stream as the pipeline's exchange, and
:mod:`~edgeproxy._server.h2websocket` one WebSocket's. This module
is the site that serves them. What the listener shares with the upstream pools (frames,
fields, the engine's setup, flow control) is :mod:`edgeproxy._http2`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from edgeproxy._core.errors import ProxyError
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.response import Response, StreamResponse
from edgeproxy._server.guard import ConnectionGuard
from edgeproxy._server.h2connection import H2Connection
from edgeproxy._server.h2exchange import H2Exchange
from edgeproxy._server.h2flow import CONNECTION_BUFFER, STREAM_BUFFER
from edgeproxy._server.h2front import PREFACE, Front
from edgeproxy._server.headchecks import check_head, own_answer
from edgeproxy._server.listener import GuardedSite

__all__ = [
    "CONNECTION_BUFFER",
    "PREFACE",
    "STREAM_BUFFER",
    "H2Connection",
    "H2Exchange",
    "H2Site",
    "Served",
]

logger = logging.getLogger("edgeproxy")


class Served(Protocol):
    """What the listener needs of the proxy it serves (``EdgeProxy`` is one): whether it is
    open, and the pipeline's entry."""

    @property
    def is_open(self) -> bool: ...

    async def serve_exchange(self, exchange: Exchange) -> StreamResponse: ...


class H2Site(GuardedSite):
    """The client listener with ``server.http2``: HTTP/2 connections here, HTTP/1.1 ones
    to the default listener's handler, under one guard."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        guard: ConnectionGuard,
        proxy: Served,
        send_stall_timeout: float,
        backlog: int = 128,
        reuse_port: bool = False,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(
            runner,
            host,
            port,
            guard=guard,
            backlog=backlog,
            reuse_port=reuse_port,
            ssl_context=ssl_context,
        )
        self.proxy = proxy
        self.send_stall_timeout = send_stall_timeout
        self.connections: set[H2Connection] = set()
        limits = guard.limits
        self.upgrade_head_max = limits.max_request_line + limits.max_header_size * 4
        self.handshake_timeout = limits.header_timeout

    def protocol_factory(self) -> Callable[[], asyncio.Protocol]:
        # Each connection starts as a front, which picks its protocol.
        return functools.partial(Front, self)

    async def stop(self) -> None:
        """Stop accepting; HTTP/2 clients get GOAWAY (the streams they have finish)."""
        await super().stop()
        for conn in list(self.connections):
            conn.goaway()

    def close_connections(self) -> None:
        """Close every HTTP/2 connection still open (after the drain)."""
        for conn in list(self.connections):
            conn.close()
        self.connections.clear()

    async def serve(self, stream: H2Exchange) -> None:
        """One request stream, through the pipeline; its answer goes back on it."""
        proxy = self.proxy
        try:
            if not proxy.is_open:
                closed = ProxyError(
                    503, "service_unavailable", "The proxy is not open.", code="not_open"
                )
                answer: StreamResponse = own_answer(closed)
            else:
                error = stream.refusal or check_head(
                    stream.method, stream.target, stream.headers, 1, self.guard.limits
                )
                if error is not None:
                    self.guard.count_body_error(error)
                    answer = own_answer(error)
                else:
                    answer = await proxy.serve_exchange(stream)
            if not answer.prepared and not stream.started and not stream.gone:
                if type(answer) is Response:
                    await stream.start(answer.status, answer.headers, len(answer.body), False)
                    await stream.end(answer.body)
                else:
                    await answer.prepare(stream)
                    await answer.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            if not stream.gone:
                stream.abort()
            current = asyncio.current_task()
            if current is not None and current.cancelling() and not stream.gone:
                raise
        except Exception:
            logger.exception("HTTP/2 stream %d failed", stream.id)
            stream.abort()
        finally:
            conn = stream._conn
            if not stream.answered and not stream.gone:
                stream.abort()
            if stream.unacked:
                conn.acknowledge(stream.id, stream.unacked)
                stream.unacked = 0
            if stream.answered and not stream.out:
                conn._drop(stream)
