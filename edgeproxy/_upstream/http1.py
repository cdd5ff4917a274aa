"""The HTTP/1.1 keep-alive pool, on aiohttp's client, for regions without HTTP/2."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import aiohttp

from edgeproxy._core.types import Body, Headers
from edgeproxy._upstream.pool import (
    PoolLimits,
    PoolStats,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
)

__all__ = ["AiohttpPool", "AiohttpResponse"]


_VERSIONS = {aiohttp.HttpVersion10: "1.0", aiohttp.HttpVersion11: "1.1"}


class _Chunks:
    """The body as it arrives, aiohttp's errors turned into ours: aiohttp's ``iter_any``
    in one iterator, where an async generator around it was a second layer per chunk."""

    __slots__ = ("_content",)

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._content.readany()
        except aiohttp.EofStream:
            raise StopAsyncIteration from None
        except TimeoutError as timed_out:
            raise UpstreamTimeout("upstream read timed out", phase="read") from timed_out
        except aiohttp.ClientError as broke:
            raise UpstreamProtocolError(f"upstream body broke: {broke}") from broke
        if not chunk:
            raise StopAsyncIteration
        return chunk


class AiohttpResponse:
    """:class:`UpstreamResponse` over an aiohttp client response."""

    __slots__ = ("_resp", "_pool", "status", "headers", "http_version")
    _pool: AiohttpPool | None

    def __init__(self, resp: aiohttp.ClientResponse, pool: AiohttpPool) -> None:
        self._resp = resp
        self._pool = pool
        self.status = resp.status
        self.headers: Headers = list(resp.headers.items())
        version = resp.version
        self.http_version = (
            _VERSIONS.get(version) or f"{version.major}.{version.minor}" if version else "1.1"
        )

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return _Chunks(self._resp.content)

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

    async def start(self, *, at_least: int = 0) -> None:
        """Open ``warm_connections`` connections, or ``at_least`` (whoever must know the
        origin answers HTTP/1.1 asks for one), each with a request answered."""
        session = self._ensure_session()
        warm = max(at_least, min(self.limits.warm_connections, self.limits.http1_max_connections))
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
        except TimeoutError as timed_out:
            raise UpstreamTimeout(
                f"timed out connecting to {self.origin}", phase="connect"
            ) from timed_out

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
        # A name of its own per clause: the compiled build types each by its first clause.
        except aiohttp.ClientConnectorError as refused:
            raise UpstreamConnectError(f"cannot connect to {self.origin}: {refused}") from refused
        except aiohttp.ConnectionTimeoutError as waited:
            # Waiting for a pooled connection or opening one: nothing was sent.
            raise UpstreamTimeout(
                f"timed out connecting to {self.origin}: {waited}", phase="connect"
            ) from waited
        except aiohttp.ServerTimeoutError as slow:
            raise UpstreamTimeout(
                f"upstream {self.origin} timed out: {slow}", phase="read"
            ) from slow
        except TimeoutError as timed_out:
            raise UpstreamTimeout(
                f"upstream {self.origin} timed out", phase="connect"
            ) from timed_out
        except aiohttp.ClientError as failed:
            raise UpstreamProtocolError(f"upstream {self.origin} failed: {failed}") from failed
        if not 200 <= resp.status <= 599:
            # aiohttp returns a 101 (it skips other 1xx) and any three-digit
            # status as the final answer; neither can be relayed.
            resp.close()
            raise UpstreamProtocolError(f"upstream {self.origin} answered status {resp.status}")
        idle = self.limits.stream_idle_timeout
        if idle != self.limits.read_timeout:
            # The session's read timeout covered the wait for the headers; the body's
            # chunks get the stream idle timeout (aiohttp's setting for this response,
            # reset for the connection's next request).
            connection = resp.connection
            if (
                connection is not None
                and connection.protocol is not None
                and not resp.content.at_eof()
            ):
                connection.protocol.read_timeout = idle
                connection.protocol.start_timeout()
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
