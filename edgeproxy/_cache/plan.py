"""What the cache does with one cacheable request (:class:`CachePlan`: key, lookup,
coalescing, the answer's form, freshness windows), and the ``Cache-Control``
directives that decide it.
"""

from __future__ import annotations

import dataclasses

from edgeproxy._core.context import RequestContext
from edgeproxy._protocol.dialects import OPENAI, Dialect, dialect_named
from edgeproxy._protocol.endpoints import dialect_for
from edgeproxy._protocol.headers import CLIENT_CREDENTIAL_HEADERS

__all__ = ["CachePlan"]


def _directives(values: list[str]) -> dict[str, str | None]:
    """``Cache-Control`` directives, lower-cased: ``{"max-age": "60", "public": None}``."""
    out: dict[str, str | None] = {}
    for value in values:
        for part in value.split(","):
            name, _, arg = part.strip().partition("=")
            if name:
                out[name.lower()] = arg.strip().strip('"') if arg else None
    return out


def _seconds(value: str | None) -> float | None:
    if value is None or not value.isdigit():
        return None
    return float(value)


@dataclasses.dataclass(slots=True)
class CachePlan:
    """What the cache does with one cacheable request."""

    key: str
    """The entry's name in the backends: ``<scope>:<digest>``."""
    method: str
    lookup: bool
    """False when the client asked for a fresh answer (``no-cache``): store, but do not serve."""
    coalesce: bool
    wants_sse: bool
    include_usage: bool
    ttl: float
    swr: float
    sie: float
    credentials: bool
    dialect: Dialect = OPENAI
    """The request's API: how its answers are recorded, replayed and converted."""


def request_dialect(ctx: RequestContext) -> Dialect:
    """The API ``ctx`` speaks: the one its facts name, once it has entered."""
    facts = ctx.facts
    return dialect_named(facts.dialect) if facts is not None else dialect_for(ctx.path)


def _plan_for_ctx(ctx: RequestContext, key: str, *, coalesce: bool) -> CachePlan:
    wants_sse = include_usage = fresh_only = credentials = False
    dialect = request_dialect(ctx)
    body = ctx.json if ctx.method == "POST" else None
    if isinstance(body, dict):
        wants_sse = dialect.streams and dialect.stream(body)
        include_usage = dialect.include_usage(body)
    headers = ctx.headers
    if "cache-control" in headers:
        request_cc = _directives(headers.getall("cache-control"))
        fresh_only = "no-cache" in request_cc or request_cc.get("max-age") == "0"
    for name in CLIENT_CREDENTIAL_HEADERS:
        if headers.get(name):
            credentials = True
            break
    route = ctx.route
    # Positional, in the fields' order: matching ten keywords costs more, once a request.
    return CachePlan(
        key,
        ctx.method,
        not fresh_only,
        coalesce and ctx.method == "POST",
        wants_sse,
        include_usage,
        route.cache_ttl,
        route.stale_while_revalidate,
        route.stale_if_error,
        credentials,
        dialect,
    )
