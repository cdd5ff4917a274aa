"""Cache keys: who may share an entry, and the digest naming it.

A key covers the path, the model, the request body with non-semantic fields
removed and JSON keys in canonical order, and its scope: the tenant, else a
hash of the client's credential, else ``pub``. So one customer's answer
never reaches another, and a request carrying an ``Authorization`` is only
ever answered from entries made with that same credential. Keys are blake2b
digests: raw prompts never appear in a backend's key names.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from edgeproxy._core.context import RequestContext
from edgeproxy._protocol.endpoints import endpoint_paths
from edgeproxy._protocol.headers import CLIENT_CREDENTIAL_HEADERS

__all__ = [
    "CACHEABLE_PATHS",
    "NON_SEMANTIC_FIELDS",
    "cache_scope",
    "default_cache_key",
    "hash_key",
    "tenant_scope",
]

CACHEABLE_PATHS = endpoint_paths("cacheable")

# Fields that do not change the answer: who asked, how it is delivered, tracing ids.
NON_SEMANTIC_FIELDS = frozenset(
    {"user", "stream", "stream_options", "request_id", "metadata", "store", "service_tier"}
)


def hash_key(material: str | bytes) -> str:
    """A fixed-size, prompt-free key for ``material``."""
    data = material.encode() if isinstance(material, str) else material
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def _short_hash(material: str) -> str:
    return hashlib.blake2b(material.encode(), digest_size=8, person=b"edgeproxy").hexdigest()


# The credential headers in the order cache_scope tries them (sorted once, here).
_CREDENTIAL_ORDER = tuple(sorted(CLIENT_CREDENTIAL_HEADERS))


def tenant_scope(tenant: str) -> str:
    """The scope, and so the key prefix (``<scope>:``), of every entry of ``tenant``."""
    return "t" + _short_hash("tenant:" + tenant)


def cache_scope(ctx: RequestContext) -> str:
    """Who may share an entry: the tenant, else the credential the client sent, else anyone.

    ``t…`` and ``k…`` are hashes, so neither tenant names nor credentials
    appear in key names.
    """
    if ctx.tenant:
        return tenant_scope(ctx.tenant)
    for name in _CREDENTIAL_ORDER:
        value = ctx.headers.get(name)
        if value:
            return "k" + _short_hash(f"credential:{name}:{value}")
    return "pub"


def _deterministic(path: str, body: dict[str, Any]) -> bool:
    if path in endpoint_paths("deterministic"):
        return True
    return _deterministic_body(body)


def _deterministic_body(body: dict[str, Any]) -> bool:
    """A request body whose answer is the same every time: a seed, or temperature 0."""
    if body.get("seed") is not None:
        return True
    temperature = body.get("temperature")
    return temperature is not None and temperature == 0


def default_cache_key(ctx: RequestContext, *, always: bool = False) -> str | None:
    """The key digest of a cacheable POST, or None when it must not be cached.

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
    return _post_digest(ctx, body)


def _post_digest(
    ctx: RequestContext, body: dict[str, Any], scope: str | None = None, path: str | None = None
) -> str:
    semantic = {k: v for k, v in body.items() if k not in NON_SEMANTIC_FIELDS}
    material = orjson.dumps(
        {
            "path": ctx.path if path is None else path,
            "model": body.get("model"),
            "body": semantic,
            "scope": cache_scope(ctx) if scope is None else scope,
        },
        option=orjson.OPT_SORT_KEYS,
    )
    return hash_key(material)


def _get_digest(ctx: RequestContext, scope: str) -> str:
    # The proxy forwards these, and the answer may depend on them.
    material = orjson.dumps(
        {
            "method": "GET",
            "target": ctx.target,
            "accept": ctx.headers.get("accept", ""),
            "accept-encoding": ctx.headers.get("accept-encoding", ""),
            "scope": scope,
        },
        option=orjson.OPT_SORT_KEYS,
    )
    return hash_key(material)
