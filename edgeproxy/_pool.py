"""Upstream connection pools: the narrow interface the pipeline talks to.

One pool per region endpoint. A pool sends one request and hands back a
response whose body is read incrementally, so nothing is buffered whole.
HTTP/2 endpoints use :class:`edgeproxy._h2pool.H2Pool` (built directly on
``h2``; see ``bench/pool_compare.py`` for why not ``httpx``); HTTP/1.1
endpoints use :class:`AiohttpPool`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import aiohttp

Headers = list[tuple[str, str]]
Body = bytes | AsyncIterable[bytes] | None


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


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """Sizing and timeouts for one pool. All durations are seconds."""

    max_connections: int = 8
    http1_max_connections: int = 256
    keepalive_expiry: float = 60.0
    connect_timeout: float = 3.0
    read_timeout: float = 60.0
    write_timeout: float = 10.0
    pool_timeout: float = 5.0
    warm_connections: int = 1
    ping_interval: float = 15.0


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot for ``/status`` and metrics."""

    connections_open: int
    streams_in_use: int
    requests_total: int
    http_version: str


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


class AiohttpResponse:
    """:class:`UpstreamResponse` over an aiohttp client response."""

    __slots__ = ("_resp", "_pool", "status", "headers", "http_version")
    _pool: AiohttpPool | None

    def __init__(self, resp: aiohttp.ClientResponse, pool: AiohttpPool) -> None:
        self._resp = resp
        self._pool = pool
        self.status = resp.status
        self.headers: Headers = list(resp.headers.items())
        self.http_version = f"{resp.version.major}.{resp.version.minor}" if resp.version else "1.1"

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except TimeoutError as exc:
            raise UpstreamTimeout("upstream read timed out", phase="read") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamProtocolError(f"upstream body broke: {exc}") from exc

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool._in_use -= 1
            self._pool = None
        if not self._resp.content.at_eof():
            # An unfinished body cannot be reused; closing drops the connection,
            # which is how HTTP/1.1 cancels a request upstream.
            self._resp.close()
        else:
            self._resp.release()


class AiohttpPool:
    """HTTP/1.1 keep-alive pool on aiohttp's client connector."""

    def __init__(
        self,
        origin: str,
        limits: PoolLimits,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.origin = origin.rstrip("/")
        self.limits = limits
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None
        self._requests = 0
        self._in_use = 0

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # HTTP/1.1 carries one request per connection, so its cap is separate
            # from (and much higher than) HTTP/2's connection count.
            connector = aiohttp.TCPConnector(
                limit=self.limits.http1_max_connections,
                keepalive_timeout=self.limits.keepalive_expiry,
                ssl=self._ssl if self._ssl is not None else True,
                enable_cleanup_closed=False,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=self.limits.pool_timeout + self.limits.connect_timeout,
                    sock_connect=self.limits.connect_timeout,
                    sock_read=self.limits.read_timeout,
                ),
            )
        return self._session

    async def start(self) -> None:
        session = self._ensure_session()
        warm = max(0, min(self.limits.warm_connections, self.limits.http1_max_connections))
        if warm == 0:
            return
        # A cheap request per connection proves the origin answers and leaves
        # the connections idle in the pool for the first real requests.
        results = await asyncio.gather(
            *(self._warm_one(session) for _ in range(warm)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == len(results):
            err = errors[0]
            if isinstance(err, UpstreamError):
                raise err
            raise UpstreamConnectError(f"cannot warm {self.origin}: {err}") from err

    async def _warm_one(self, session: aiohttp.ClientSession) -> None:
        try:
            async with session.request("OPTIONS", self.origin + "/") as resp:
                await resp.read()
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise UpstreamConnectError(f"cannot connect to {self.origin}: {exc}") from exc
        except TimeoutError as exc:
            raise UpstreamTimeout(
                f"timed out connecting to {self.origin}", phase="connect"
            ) from exc

    async def request(
        self,
        method: str,
        target: str,
        headers: Headers,
        body: Body = None,
        *,
        authority: str | None = None,
    ) -> UpstreamResponse:
        session = self._ensure_session()
        send_headers = list(headers)
        if authority is not None:
            send_headers.append(("Host", authority))
        self._requests += 1
        try:
            resp = await session.request(
                method,
                self.origin + target,
                headers=send_headers,
                data=body,
                allow_redirects=False,
                compress=None,
            )
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamConnectError(f"cannot connect to {self.origin}: {exc}") from exc
        except aiohttp.ConnectionTimeoutError as exc:
            # Waiting for a pooled connection or opening one: nothing was sent.
            raise UpstreamTimeout(
                f"timed out connecting to {self.origin}: {exc}", phase="connect"
            ) from exc
        except aiohttp.ServerTimeoutError as exc:
            raise UpstreamTimeout(f"upstream {self.origin} timed out: {exc}", phase="read") from exc
        except TimeoutError as exc:
            raise UpstreamTimeout(f"upstream {self.origin} timed out", phase="connect") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamProtocolError(f"upstream {self.origin} failed: {exc}") from exc
        self._in_use += 1
        return AiohttpResponse(resp, self)

    def stats(self) -> PoolStats:
        open_conns = 0
        if self._session is not None:
            connector = self._session.connector
            if isinstance(connector, aiohttp.TCPConnector):
                open_conns = len(connector._acquired) + sum(  # noqa: SLF001
                    len(v)
                    for v in connector._conns.values()  # noqa: SLF001
                )
        return PoolStats(
            connections_open=open_conns,
            streams_in_use=self._in_use,
            requests_total=self._requests,
            http_version="1.1",
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def make_pool(
    origin: str,
    *,
    http2: bool,
    limits: PoolLimits,
    ssl_context: ssl.SSLContext | None = None,
) -> UpstreamPool:
    """Build the pool for one origin: HTTP/2 (h2c or TLS+ALPN) or HTTP/1.1."""
    if http2:
        from ._h2pool import H2Pool

        return H2Pool(origin, limits, ssl_context=ssl_context)
    return AiohttpPool(origin, limits, ssl_context=ssl_context)


def split_origin(url: str) -> tuple[str, str]:
    """Split ``http://host:port/base`` into the origin and a base path ('' or '/base')."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    origin = f"{parts.scheme}://{parts.netloc}"
    return origin, parts.path.rstrip("/")
