"""Which regions may answer a request: the eligibility filters.

The router runs them in this order, each keeping some of the regions the one
before left, never reordering them (ordering is
:mod:`edgeproxy._routing.ranking`'s):

1. :class:`ServesModel`: the regions serving the request's model
   (:class:`~edgeproxy._routing.modelcatalog.ModelCatalog`), whatever their health:
   those that list it, and only for a name none lists, those that answer any
   name (llama.cpp's servers, ``serves_any_model``); a model no region serves
   is a 404 (:class:`~edgeproxy._routing.modelcatalog.ModelError`) naming those served;
2. :class:`Resident`: under a residency rule, only the regions it allows;
3. :class:`Owner`: for a request that only one region can answer (the owner of
   a stateful exchange), that region alone; unavailable, it is a 503
   ``owner_unavailable`` (:class:`Healthy`), never another region;
4. :class:`NotExcluded`: not the regions the caller rules out (those a broken
   stream already tried, for instance);
5. :class:`Healthy`: the available ones. When none is, a request under a
   residency rule gets a 503, and any other request keeps every region left
   (Envoy's "panic" routing: a guess beats a refusal), which the ranking then
   orders reachable first.

What a request asks, and what the filters found out on the way (the residency
rule, the panic), is one :class:`RouteQuery`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from edgeproxy._routing.owners import owner_unavailable

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext
    from edgeproxy._routing.geo import Residency
    from edgeproxy._routing.modelcatalog import ModelCatalog
    from edgeproxy._upstream.health import Health
    from edgeproxy._upstream.regions import Region

__all__ = [
    "Eligibility",
    "Healthy",
    "NotExcluded",
    "Owner",
    "Resident",
    "RouteQuery",
    "ServesModel",
]


@dataclass(slots=True)
class RouteQuery:
    """One routing decision: the request, its time, and what is known of its client.

    ``country`` and ``client_geo`` are where the client is (None: unknown, or
    not looked up: ``client_geo`` only with ``prior_from = "client"``);
    ``owner`` the one region that may answer, if any; ``exclude`` the names of
    regions ruled out. The filters fill in ``allowed`` (the region names a
    residency rule allows; None: no rule) and ``panic`` (no region was
    available, so all are kept); the ranking's score ``fresh_reports`` (some
    candidate has a fresh load report).
    """

    ctx: RequestContext | None
    now: float
    country: str | None = None
    client_geo: tuple[float, float] | None = None
    owner: str | None = None
    exclude: Collection[str] = ()
    allowed: frozenset[str] | None = None
    panic: bool = False
    fresh_reports: bool = False


class Eligibility(Protocol):
    """A filter: the regions of ``regions`` that may answer ``query``, in their order."""

    def keep(self, query: RouteQuery, regions: list[Region]) -> list[Region]: ...


class ServesModel:
    """The regions serving the request's model; raises the catalog's 400 or 404.

    The catalog alone decides which regions those are (the exact listers of a name before
    the regions that answer any name); this keeps them in the order the router has them."""

    __slots__ = ("catalog",)

    def __init__(self, catalog: ModelCatalog) -> None:
        self.catalog = catalog

    def keep(self, query: RouteQuery, regions: list[Region]) -> list[Region]:
        ctx = query.ctx
        if ctx is None:
            return regions
        serving = self.catalog.lookup(ctx)
        if serving is None:
            return regions
        return [r for r in regions if r.name in serving]


class Resident:
    """Under a residency rule for the client's country, the regions it allows."""

    __slots__ = ("residency",)

    def __init__(self, residency: Residency) -> None:
        self.residency = residency

    def keep(self, query: RouteQuery, regions: list[Region]) -> list[Region]:
        # A decision for no request (a region list asked for by itself) has no client for a
        # rule to apply to, not a client of unknown location (which the "*" rule covers).
        if query.ctx is None:
            return regions
        allowed = query.allowed = self.residency.allowed(query.country)
        if allowed is None:
            return regions
        return [r for r in regions if r.name in allowed]


class Owner:
    """Only the region named ``query.owner``, when there is one.

    A stateful exchange (a conversation or a file held by one region) can
    only be answered where its state lives; no other region is eligible,
    healthy or not, and when the owner is unavailable it is tried anyway,
    as the panic does.
    """

    __slots__ = ()

    def keep(self, query: RouteQuery, regions: list[Region]) -> list[Region]:
        owner = query.owner
        if owner is None:
            return regions
        return [r for r in regions if r.name == owner]


class NotExcluded:
    """Every region but those named in ``query.exclude``."""

    __slots__ = ()

    def keep(self, query: RouteQuery, regions: list[Region]) -> list[Region]:
        exclude = query.exclude
        if not exclude:
            return regions
        return [r for r in regions if r.name not in exclude]


class Healthy:
    """The available regions; when none is, a residency 503 or the panic."""

    __slots__ = ("health", "residency", "owner_retry_after")

    def __init__(self, health: Health, residency: Residency, owner_retry_after: int = 5) -> None:
        self.health = health
        self.residency = residency
        self.owner_retry_after = owner_retry_after

    def keep(self, query: RouteQuery, regions: list[Region]) -> list[Region]:
        available = self.health.available
        now = query.now
        # A loop, not a comprehension (a frame more), on every request's path.
        kept = []
        for region in regions:
            if available(region, now):
                kept.append(region)
        if kept:
            return kept
        allowed = query.allowed
        if allowed is not None:
            # Never a cross-border guess: the rule's own refusal.
            raise self.residency.no_region(query.country, allowed)
        if query.owner is not None:
            # The one region holding the request's state is down: trying it, or another
            # (which would answer 404), is no answer.
            raise owner_unavailable(self.owner_retry_after)
        query.panic = True
        return regions
