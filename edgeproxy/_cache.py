"""The hot-answer cache: which requests are cacheable, and their keys.

A key covers the path, the model, the request body with non-semantic fields
removed and JSON keys in canonical order, and the tenant, so one customer's
answer never reaches another. Keys are blake2b digests: raw prompts never
appear in a backend's key names.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from aiohttp import web

    from ._pipeline import RequestContext
    from ._plugins import Plugins

__all__ = ["CacheStage", "default_cache_key", "hash_key"]

CACHEABLE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})

# Fields that do not change the answer: who asked, how it is delivered, tracing ids.
NON_SEMANTIC_FIELDS = frozenset(
    {"user", "stream", "stream_options", "request_id", "metadata", "store", "service_tier"}
)


def hash_key(material: str | bytes) -> str:
    """A fixed-size, prompt-free key for ``material``."""
    data = material.encode() if isinstance(material, str) else material
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def _deterministic(path: str, body: dict[str, Any]) -> bool:
    if path == "/v1/embeddings":
        return True
    if body.get("seed") is not None:
        return True
    temperature = body.get("temperature")
    return temperature is not None and temperature == 0


def default_cache_key(ctx: RequestContext, *, always: bool = False) -> str | None:
    """The key of a cacheable request, or None when it must not be cached.

    Cacheable: POSTs to the OpenAI completion and embedding routes whose JSON
    body is deterministic (``temperature`` 0 or a ``seed``), or any such POST
    when ``always``. Never: ``Cache-Control: no-store``.
    """
    if ctx.method != "POST" or ctx.path not in CACHEABLE_PATHS:
        return None
    if "no-store" in ctx.headers.get("cache-control", "").lower():
        return None
    body = ctx.json
    if not isinstance(body, dict):
        return None
    if not always and not _deterministic(ctx.path, body):
        return None
    semantic = {k: v for k, v in body.items() if k not in NON_SEMANTIC_FIELDS}
    material = orjson.dumps(
        {"path": ctx.path, "model": body.get("model"), "body": semantic, "tenant": ctx.tenant},
        option=orjson.OPT_SORT_KEYS,
    )
    return hash_key(material)


class CacheStage:
    """Works out the cache key of each request, letting plugins override it."""

    def __init__(self, plugins: Plugins) -> None:
        self.plugins = plugins

    async def key(self, request: web.Request, ctx: RequestContext) -> str | None:
        key = default_cache_key(ctx)
        if key is None:
            return None
        if self.plugins.has("edgeproxy_cache_key"):
            custom = await self.plugins.call_first(
                "edgeproxy_cache_key", request=request, ctx=ctx, default_key=key
            )
            if custom is not None:
                key = hash_key("custom:" + str(custom))
        return key
