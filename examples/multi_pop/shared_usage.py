"""Per-tenant usage shared by every PoP through Redis.

Each PoP counts, per tenant, requests and the token usage the regions report,
in one Redis hash per tenant (``<prefix>usage:<tenant>``). Any PoP, or a
billing job, reads the same totals. Redis trouble never touches a request:
writes run in the background with a short timeout, and failures are counted
and logged.

    [plugins]
    enabled = ["examples/multi_pop/shared_usage.py"]

    [plugins.settings.shared_usage]
    redis_url = "redis://127.0.0.1:6379/0"
    prefix = "edgeproxy:"
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web

from edgeproxy import RequestContext, hookimpl

logger = logging.getLogger("edgeproxy.examples.shared_usage")


class SharedUsage:
    def __init__(self, redis_url: str, prefix: str = "edgeproxy:", pop: str = "") -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.pop = pop
        self.client: aioredis.Redis | None = None
        self.errors = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @hookimpl
    async def edgeproxy_startup(self, proxy: Any) -> None:
        self.pop = self.pop or proxy.config.pop.name
        self.client = aioredis.Redis.from_url(
            self.redis_url, socket_timeout=0.25, socket_connect_timeout=0.25
        )

    @hookimpl
    async def edgeproxy_shutdown(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    @hookimpl
    def edgeproxy_response_complete(self, request: web.Request, ctx: RequestContext) -> None:
        if self.client is None or ctx.status != 200:
            return
        task = asyncio.get_running_loop().create_task(self._record(ctx.tenant, ctx.usage))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _record(self, tenant: str | None, usage: dict[str, Any] | None) -> None:
        assert self.client is not None
        key = f"{self.prefix}usage:{tenant or 'anonymous'}"
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hincrby(key, "requests", 1)
                pipe.hincrby(key, f"requests:{self.pop}", 1)
                for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
                    value = (usage or {}).get(field)
                    if isinstance(value, int):
                        pipe.hincrby(key, field, value)
                await pipe.execute()
        except (aioredis.RedisError, OSError) as exc:
            self.errors += 1
            logger.warning("usage not recorded in Redis: %s", exc)

    async def totals(self, tenant: str) -> dict[str, int]:
        """The shared totals of ``tenant``, as every PoP sees them."""
        assert self.client is not None
        raw = await self.client.hgetall(f"{self.prefix}usage:{tenant}")
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


def edgeproxy_plugin(settings: dict[str, Any]) -> SharedUsage:
    return SharedUsage(
        str(settings.get("redis_url", "redis://127.0.0.1:6379/0")),
        prefix=str(settings.get("prefix", "edgeproxy:")),
        pop=str(settings.get("pop", "")),
    )
