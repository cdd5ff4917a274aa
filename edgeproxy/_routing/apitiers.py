"""Routing by the APIs regions speak: a region that speaks a request's API before one that
needs it translated (:mod:`edgeproxy._protocol.translate`), and neither before one that
cannot answer it at all.

Each region's tier for a request (:meth:`~edgeproxy._upstream.apis.SpokenApis.tier`) is
``native`` (it speaks the API, or may: not known yet), ``translated`` (it speaks chat
completions only, and the request can be translated) or ``unserved`` (it lacks the API,
and the request cannot be translated: a stateful Responses request, or an API other than
Messages and Responses). The router keeps the unserved regions only when no other may
answer (:func:`served`: the attempt then answers the client why, in its API); the ranking
orders by the tier right after the priority tier (:func:`tiers`), like the load tiers.

All of it is asked only while some region of the set lacks an API
(:class:`~edgeproxy._upstream.apis.ApiBook`): other deployments pay one attribute check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgeproxy._protocol.dialects import dialect_named
from edgeproxy._upstream.apis import UNSERVED

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext
    from edgeproxy._upstream.regions import Region

__all__ = ["served", "tiers"]


def _asked(ctx: RequestContext | None) -> tuple[str | None, bool]:
    """The request's endpoint and whether it needs stored state; None for a request of
    no LLM API (or no request)."""
    facts = ctx.facts if ctx is not None else None
    name = facts.dialect if facts is not None else None
    if ctx is None or name is None or ctx.method != "POST":
        return None, False
    body = ctx.json
    return name, isinstance(body, dict) and dialect_named(name).stateful(body)


def tiers(ctx: RequestContext | None, regions: list[Region]) -> list[int] | None:
    """Each region's tier for ``ctx``, in order; None when they are all alike."""
    name, stateful = _asked(ctx)
    if name is None:
        return None
    out = [region.apis.tier(name, stateful) for region in regions]
    return out if any(out) and min(out) != max(out) else None


def served(ctx: RequestContext | None, regions: list[Region]) -> list[Region]:
    """``regions`` without those that cannot answer ``ctx``, unless none other can."""
    found = tiers(ctx, regions)
    if found is None or min(found) == UNSERVED:
        return regions
    return [region for region, tier in zip(regions, found, strict=True) if tier != UNSERVED]
