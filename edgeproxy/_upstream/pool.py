"""Upstream connection pools: the narrow interface the pipeline talks to.

One pool per region endpoint. A pool sends one request and hands back a
response whose body is read incrementally, so nothing is buffered whole.
HTTP/2 endpoints use :class:`edgeproxy._upstream.h2pool.H2Pool` (built directly on
``h2``; see ``bench/pool_compare.py`` for why not ``httpx``); HTTP/1.1
endpoints use :class:`edgeproxy._upstream.http1.AiohttpPool`; ``http2 = "auto"``
endpoints use :class:`edgeproxy._upstream.autopool.AutoPool`, which finds which of the
two the origin speaks and then hands every request to it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from edgeproxy._core.types import Body, Headers


class UpstreamError(Exception):
    """Base class for failures talking to an upstream.

    ``retryable`` is true when the upstream certainly did not start
    processing the request (connect failure, refused stream, GOAWAY before the
    stream was accepted), so a retry elsewhere cannot duplicate work.
    """

    retryable: bool = False


class UpstreamConnectError(UpstreamError):
    """The connection could not be opened (refused, DNS, TLS handshake)."""

    retryable = True


class UpstreamNotHTTP2(UpstreamConnectError):
    """The origin would not speak HTTP/2 on a new connection: in cleartext it refused the
    h2c preface (closed, or answered it with something else), over TLS ALPN chose another
    protocol. ``http1`` is true when it showed that it speaks HTTP/1.x (a status line, or
    ALPN without h2); ``what`` is what it did, without the origin or the advice."""

    def __init__(self, origin: str, what: str, *, http1: bool = False) -> None:
        # Operators meet this as a region that cannot be reached: the advice names the key.
        if http1:
            message = f"{origin} speaks HTTP/1.1 only ({what}); set `http2 = false`"
        else:
            message = f"{origin} {what}; if it speaks HTTP/1.1 only, set `http2 = false`"
        super().__init__(message + " or leave it `auto`")
        self.origin = origin
        self.what = what
        self.http1 = http1

    @classmethod
    def from_reply(
        cls, origin: str, head: bytes, exc: BaseException | None = None
    ) -> UpstreamNotHTTP2:
        """The refusal of an h2c preface, from the bytes the origin sent before its
        SETTINGS (``head``) and the error, if any, that ended the connection."""
        if head.startswith(b"HTTP/"):
            line = head.split(b"\r\n", 1)[0][:80].decode("latin-1")
            return cls(origin, f"it answered the HTTP/2 preface with {line!r}", http1=True)
        if head:
            return cls(origin, f"answered the HTTP/2 preface with something else ({head[:16]!r})")
        why = f" ({exc})" if exc else ""
        return cls(origin, f"closed the connection on the HTTP/2 preface{why}")


class UpstreamTimeout(UpstreamError):
    """A connect, read, write or pool timeout expired."""

    def __init__(self, message: str, *, phase: str) -> None:
        super().__init__(message)
        self.phase = phase
        self.retryable = phase in ("connect", "pool")


class UpstreamProtocolError(UpstreamError):
    """The connection broke or the peer misbehaved (reset, GOAWAY, bad frames)."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


def copy_error(err: UpstreamError) -> UpstreamError:
    """The same failure as a new instance, for each of the requests one failure ends:
    tracebacks and ``__context__`` must not get stitched together across tasks."""
    if isinstance(err, UpstreamTimeout):
        return UpstreamTimeout(str(err), phase=err.phase)
    if isinstance(err, UpstreamProtocolError):
        return UpstreamProtocolError(str(err), retryable=err.retryable)
    if isinstance(err, UpstreamNotHTTP2):
        return UpstreamNotHTTP2(err.origin, err.what, http1=err.http1)
    return type(err)(str(err))


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """Sizing and timeouts for one pool. All durations are seconds."""

    max_connections: int = 8
    http1_max_connections: int = 256
    keepalive_expiry: float = 60.0
    connect_timeout: float = 3.0
    read_timeout: float = 60.0
    stream_idle_timeout: float = 30.0
    write_timeout: float = 10.0
    pool_timeout: float = 5.0
    warm_connections: int = 1
    ping_interval: float = 15.0


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot for ``/status`` and metrics.

    ``http_version`` is the version in use, ``"2"`` or ``"1.1"`` (``"unknown"`` while
    ``http2 = "auto"`` has not found it yet); ``detected`` says how ``auto`` found it, and
    is None where the config set the version.
    """

    connections_open: int
    streams_in_use: int
    requests_total: int
    http_version: str
    detected: str | None = None


class UpstreamResponse(Protocol):
    """A response whose headers have arrived and whose body is still streaming."""

    status: int
    headers: Headers
    http_version: str

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """Yield body chunks as they arrive. Raises :class:`UpstreamError` on a broken body."""
        ...

    async def aclose(self) -> None:
        """Release the stream. Before the body ended, this cancels the request upstream."""
        ...


class UpstreamPool(Protocol):
    """A keep-alive pool to one upstream origin (scheme, host, port)."""

    async def start(self) -> None:
        """Open ``warm_connections`` connections. Raises :class:`UpstreamError` if none opens."""
        ...

    async def request(
        self,
        method: str,
        target: str,
        headers: Headers,
        body: Body = None,
        *,
        authority: str | None = None,
    ) -> UpstreamResponse:
        """Send a request and return once response headers have arrived.

        ``target`` is the path with its query string. ``headers`` must not
        contain hop-by-hop headers or ``Host``; ``authority`` sets the Host
        (HTTP/1.1) or ``:authority`` (HTTP/2), defaulting to the origin's.
        """
        ...

    def stats(self) -> PoolStats: ...

    async def aclose(self) -> None: ...


def split_origin(url: str) -> tuple[str, str]:
    """Split ``http://host:port/base`` into the origin and a base path ('' or '/base')."""
    parts = urlsplit(url)
    origin = f"{parts.scheme}://{parts.netloc}"
    return origin, parts.path.rstrip("/")
