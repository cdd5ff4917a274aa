"""The regional clusters at run time: one warmed pool each, and an up/down state."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from ._config import Config, RegionConfig
from ._pool import PoolLimits, UpstreamError, UpstreamPool, make_pool, split_origin

__all__ = ["Region", "RegionSet"]

logger = logging.getLogger("edgeproxy.regions")

# How often a region that could not be reached is tried again in the background.
_REWARM_INTERVAL = 2.0


def _ssl_context(config: Config, http2: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=config.upstream.ca_file)
    if not config.upstream.verify_tls:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"] if http2 else ["http/1.1"])
    return ctx


class Region:
    """One regional cluster: its config, its pool and what the proxy knows of its health."""

    def __init__(self, config: RegionConfig, pool: UpstreamPool, *, http2: bool) -> None:
        self.config = config
        self.name = config.name
        self.pool = pool
        self.http2 = http2
        _, self.base_path = split_origin(config.url)
        self.authority = config.host_header or urlsplit(config.url).netloc
        self.state = "unknown"
        self.last_error: str | None = None
        self.in_flight = 0
        self.requests_total = 0
        self.errors_total = 0
        self.changed_at = time.monotonic()
        api_key = config.resolved_api_key()
        self.credential_headers: list[tuple[str, str]] = [
            (k.lower(), v) for k, v in config.headers.items()
        ]
        if api_key:
            self.credential_headers.append(("authorization", f"Bearer {api_key}"))

    @property
    def up(self) -> bool:
        return self.state == "up"

    def mark_up(self) -> None:
        if self.state != "up":
            if self.state == "down":
                logger.info("region %s is reachable again", self.name)
            self.state = "up"
            self.last_error = None
            self.changed_at = time.monotonic()

    def mark_down(self, reason: str) -> None:
        self.last_error = reason
        if self.state != "down":
            logger.warning("region %s is unreachable: %s", self.name, reason)
            self.state = "down"
            self.changed_at = time.monotonic()

    def snapshot(self) -> dict[str, Any]:
        stats = self.pool.stats()
        return {
            "name": self.name,
            "url": self.config.url,
            "state": self.state,
            "last_error": self.last_error,
            "in_flight": self.in_flight,
            "requests_total": self.requests_total,
            "errors_total": self.errors_total,
            "pool": {
                "http_version": stats.http_version,
                "connections_open": stats.connections_open,
                "streams_in_use": stats.streams_in_use,
                "requests_total": stats.requests_total,
            },
        }


class RegionSet:
    """Every region of the config, opened and closed together."""

    def __init__(self, config: Config) -> None:
        self.config = config
        up = config.upstream
        limits = PoolLimits(
            max_connections=up.max_connections,
            keepalive_expiry=up.keepalive_expiry,
            connect_timeout=up.connect_timeout,
            read_timeout=up.read_timeout,
            write_timeout=up.write_timeout,
            pool_timeout=up.pool_timeout,
            warm_connections=up.warm_connections,
            ping_interval=up.ping_interval,
        )
        self.regions: list[Region] = []
        for rc in config.regions:
            http2 = up.http2 if rc.http2 is None else rc.http2
            origin, _ = split_origin(rc.url)
            tls = _ssl_context(config, http2) if origin.startswith("https:") else None
            pool = make_pool(origin, http2=http2, limits=limits, ssl_context=tls)
            self.regions.append(Region(rc, pool, http2=http2))
        self.by_name = {r.name: r for r in self.regions}
        self.warmed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    def __iter__(self) -> Iterator[Region]:
        return iter(self.regions)

    @property
    def ready(self) -> bool:
        """Pools are warm and at least one region answers."""
        return self.warmed and any(r.up for r in self.regions)

    async def open(self) -> None:
        """Warm every pool concurrently; an unreachable region is a warning, not a failure."""
        await asyncio.gather(*(self._warm(r) for r in self.regions))
        self.warmed = True

    async def _warm(self, region: Region) -> None:
        try:
            await region.pool.start()
        except UpstreamError as exc:
            region.mark_down(f"warm-up failed: {exc}")
            self.schedule_rewarm(region)
        else:
            region.mark_up()

    def schedule_rewarm(self, region: Region) -> None:
        """Keep trying a down region in the background until it answers."""
        if self._closing or any(t.get_name() == f"rewarm:{region.name}" for t in self._tasks):
            return
        task = asyncio.get_running_loop().create_task(
            self._rewarm_loop(region), name=f"rewarm:{region.name}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _rewarm_loop(self, region: Region) -> None:
        while not self._closing and region.state == "down":
            await asyncio.sleep(_REWARM_INTERVAL)
            try:
                await region.pool.start()
            except UpstreamError as exc:
                region.last_error = f"still unreachable: {exc}"
            else:
                region.mark_up()

    async def close(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.pool.aclose() for r in self.regions), return_exceptions=True)

    def snapshot(self) -> list[dict[str, Any]]:
        return [r.snapshot() for r in self.regions]
