"""``http2 = "auto"``: the HTTP version of one origin, found on its first connection.

Over TLS, ALPN decides: the connection offers ``h2`` and ``http/1.1`` and the server
picks. In cleartext the pool opens an h2c connection with prior knowledge; a server that
refuses the preface (closes, answers it with an HTTP/1.x status line such as uvicorn's
404 for ``PRI *``, or with anything but HTTP/2 frames) is spoken HTTP/1.1 from then on.
A server that only closed, without saying what it speaks, is tried over HTTP/1.1 before
that is settled; one that cannot be reached at all leaves it open for the next try.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Coroutine
from typing import Any

from edgeproxy._core.types import Body, Headers
from edgeproxy._upstream.h2pool import H2Pool
from edgeproxy._upstream.http1 import AiohttpPool
from edgeproxy._upstream.pool import (
    PoolLimits,
    PoolStats,
    UpstreamConnectError,
    UpstreamError,
    UpstreamNotHTTP2,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
    copy_error,
)

__all__ = ["AutoPool"]

# The regions' logger: what a region speaks is news about the region.
logger = logging.getLogger("edgeproxy.regions")


class AutoPool:
    """:class:`~edgeproxy._upstream.pool.UpstreamPool` for an origin whose HTTP version is
    found rather than configured; then an :class:`H2Pool` or an :class:`AiohttpPool`
    carries every request.

    The first :meth:`start` or :meth:`request` finds the version; everything that arrives
    meanwhile waits for that one answer (at most ``connect_timeout`` per version tried),
    and a caller that gives up does not stop it for the others. Once found,
    :meth:`request` hands each request to the chosen pool as it is.

    ``ssl_context`` must offer ``h2`` and ``http/1.1`` by ALPN; ``http1_ssl_context``,
    offering only ``http/1.1``, is the HTTP/1.1 pool's (``ssl_context`` when None).
    ``label`` names the endpoint in the log.
    """

    def __init__(
        self,
        origin: str,
        limits: PoolLimits,
        *,
        ssl_context: ssl.SSLContext | None = None,
        http1_ssl_context: ssl.SSLContext | None = None,
        label: str | None = None,
    ) -> None:
        self.origin = origin.rstrip("/")
        self.limits = limits
        self.label = label or self.origin
        self._tls = self.origin.startswith("https:")
        self._ssl = ssl_context
        self._h2 = H2Pool(self.origin, limits, ssl_context=ssl_context)
        self._http1_ssl = http1_ssl_context if http1_ssl_context is not None else ssl_context
        self._http1: AiohttpPool | None = None
        self._pool: UpstreamPool | None = None
        self.detected = "pending"
        self._finding: asyncio.Task[UpstreamPool] | None = None
        self._closed = False

    async def start(self) -> None:
        pool = self._pool
        if pool is None:
            pool = await self._found()
        # The pool found warms its connections; a second start of the one that was
        # just tried opens nothing it already has.
        try:
            await pool.start()
        except UpstreamNotHTTP2:
            if pool is not self._h2 or self._pool is not pool:
                raise
        else:
            return
        # It spoke HTTP/2 when it was found and refuses it now, with no connection left
        # (this is how a down endpoint is tried again): a server of another kind took its
        # place, and the version is found again.
        self._pool = None
        self.detected = "pending"
        self._h2 = H2Pool(self.origin, self.limits, ssl_context=self._ssl)
        await pool.aclose()
        pool = await self._found()
        await pool.start()

    def request(
        self,
        method: str,
        target: str,
        headers: Headers,
        body: Body = None,
        *,
        authority: str | None = None,
    ) -> Coroutine[Any, Any, UpstreamResponse]:
        pool = self._pool
        if pool is not None:
            # The chosen pool's own coroutine: no frame of ours per request.
            return pool.request(method, target, headers, body, authority=authority)
        return self._request_when_found(method, target, headers, body, authority)

    async def _request_when_found(
        self, method: str, target: str, headers: Headers, body: Body, authority: str | None
    ) -> UpstreamResponse:
        pool = await self._found()
        return await pool.request(method, target, headers, body, authority=authority)

    def stats(self) -> PoolStats:
        pool = self._pool
        if pool is None:
            return PoolStats(0, 0, 0, "unknown", self.detected)
        s = pool.stats()
        return PoolStats(
            s.connections_open, s.streams_in_use, s.requests_total, s.http_version, self.detected
        )

    async def aclose(self) -> None:
        self._closed = True
        task = self._finding
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._h2.aclose()
        if self._http1 is not None:
            await self._http1.aclose()

    # -- finding the version -------------------------------------------------------

    async def _found(self) -> UpstreamPool:
        if self._closed:
            raise UpstreamProtocolError(f"pool for {self.origin} is closed")
        task = self._finding
        if task is None:
            task = asyncio.get_running_loop().create_task(self._find())
            task.add_done_callback(self._find_done)
            self._finding = task
        try:
            # Shielded: a request cancelled while it waits must not cancel the search
            # that the others, and the warm-up, wait for.
            return await asyncio.shield(task)
        except UpstreamError as exc:
            raise copy_error(exc) from None

    def _find_done(self, task: asyncio.Task[UpstreamPool]) -> None:
        if self._finding is task:
            self._finding = None
        if not task.cancelled():
            # Every waiter may have left: the failure is theirs to see, not the loop's.
            task.exception()

    async def _find(self) -> UpstreamPool:
        try:
            await self._h2.start(at_least=1)
        except UpstreamNotHTTP2 as refused:
            return await self._fall_back(refused)
        self._settle(self._h2, "ALPN chose h2" if self._tls else "h2c preface accepted")
        return self._h2

    async def _fall_back(self, refused: UpstreamNotHTTP2) -> UpstreamPool:
        http1 = AiohttpPool(self.origin, self.limits, ssl_context=self._http1_ssl)
        if not refused.http1:
            # It said nothing of what it speaks: HTTP/1.1 must answer before it is settled.
            try:
                async with asyncio.timeout(self.limits.connect_timeout):
                    await http1.start(at_least=1)
            except (UpstreamError, TimeoutError) as exc:
                await http1.aclose()
                why = "timed out" if isinstance(exc, TimeoutError) else str(exc)
                raise UpstreamConnectError(
                    f"{self.origin} {refused.what}, and HTTP/1.1 failed too: {why}"
                ) from exc
            except BaseException:
                await http1.aclose()
                raise
        self._http1 = http1
        self._settle(http1, refused.what)
        await self._h2.aclose()
        return http1

    def _settle(self, pool: UpstreamPool, how: str) -> None:
        self._pool = pool
        self.detected = how
        if pool is self._h2:
            logger.info("%s speaks HTTP/2 (%s); using HTTP/2", self.label, how)
        else:
            logger.info("%s speaks HTTP/1.1 only (%s); using HTTP/1.1", self.label, how)
