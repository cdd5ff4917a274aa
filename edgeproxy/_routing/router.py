"""Choosing the region for a request: one routing seam, eligibility then ranking.

For each request :meth:`Router.route`:

1. locates the client (:class:`~edgeproxy._routing.geo.GeoResolver`) when a
   residency rule or the geo prior (``prior_from = "client"``) needs it;
2. runs the eligibility filters (:mod:`edgeproxy._routing.eligibility`),
   which decide which regions may answer: the model catalog, residency, the
   owner of a stateful request, the regions the caller excludes, and health
   (with the panic when none is available, and residency's 503 when no
   allowed region is); then, while some region lacks an API, not the regions
   that cannot answer the request's (:mod:`edgeproxy._routing.apitiers`);
3. ranks what is left (:mod:`edgeproxy._routing.ranking`) by the policies
   ``[routing] rank`` lists (after the regions speaking the request's API natively,
   before those it is translated for): load tiers from fresh reports, prefix affinity,
   and the score (peak-EWMA and geo prior, requests in flight over the shared
   load view, the reported load) with the power of two choices among equals;
4. returns one :class:`~edgeproxy._routing.routeplan.RoutePlan`: the regions
   best first and the request's affinity plan, from which failover,
   continuation and hedging draw their candidates.

:meth:`Router.plan`, :meth:`Router.candidates` and :meth:`Router.routed` are
the same seam in the older three steps.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from edgeproxy._routing.affinity import Affinity, AffinityPlan
from edgeproxy._routing.apitiers import served
from edgeproxy._routing.eligibility import (
    Eligibility,
    Healthy,
    NotExcluded,
    Owner,
    Resident,
    RouteQuery,
    ServesModel,
)
from edgeproxy._routing.geo import GeoResolver, Residency
from edgeproxy._routing.modelcatalog import ModelCatalog
from edgeproxy._routing.ranking import Ranking, Scorer, great_circle_km
from edgeproxy._routing.routeplan import RoutePlan, route_plan
from edgeproxy._upstream.regions import Region, RegionSet

if TYPE_CHECKING:
    from edgeproxy._core.config import Config
    from edgeproxy._core.context import RequestContext
    from edgeproxy._shared.loadview import LoadView

__all__ = ["RoutePlan", "Router", "great_circle_km"]

# A request's RouteQuery is built without its __init__ (see Router.route).
_new = object.__new__
# Router.route's default: the affinity plan is made there.
_OWN: object = object()


class Router:
    """Orders the regions a request may use, best first.

    ``clock`` (monotonic seconds) dates each choice; by default the regions'
    own (:attr:`RegionSet.clock <edgeproxy._upstream.regions.RegionSet.clock>`),
    which their latency history and health policy read too.
    """

    def __init__(
        self,
        config: Config,
        regions: RegionSet,
        *,
        seed: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.regions = regions
        self.health = regions.health
        self.clock: Callable[[], float] = regions.clock if clock is None else clock
        routing = config.routing
        self.from_client = routing.prior_from == "client"
        self.geo = GeoResolver(config.geo)
        self.residency = Residency(config.geo, config.regions)
        self.models = ModelCatalog(config.regions, regions.learner)
        self.affinity = Affinity(routing) if routing.prefix_affinity else None
        self.scorer = Scorer(config, regions)
        # The score and its parts, as /status, the tests and plugins have read them here.
        self.rtt_prior = self.scorer.prior.rtt
        self.service_time = self.scorer.service_time
        self.expected_latency = self.scorer.expected_latency
        self.in_flight = self.scorer.in_flight
        self.load = self.scorer.load
        self.score = self.scorer.score
        self.ranking = Ranking(routing, self.scorer, self.affinity, seed=seed, apis=regions.apis)
        # Whether any region lacks an API (asked before any region is).
        self.apis = regions.apis
        # In this order: the model's 404 comes before residency's 503, and health judges
        # only what the others left (so that its panic never leaves their bounds).
        catalog: list[Eligibility] = [ServesModel(self.models)] if self.models.active else []
        rules: list[Eligibility] = [Resident(self.residency)] if self.residency.enabled else []
        healthy = Healthy(self.health, self.residency, config.stateful.retry_after)
        self.filters: tuple[Eligibility, ...] = (*catalog, *rules, Owner(), NotExcluded(), healthy)
        # A request naming no owner and excluding nothing skips those two filters.
        self._plain_filters: tuple[Eligibility, ...] = (*catalog, *rules, healthy)
        self._locates = self.residency.enabled or self.from_client

    @property
    def load_view(self) -> LoadView | None:
        """The load of every process sharing a Redis ([shared_load]), set by whoever opens
        it; None: this process's own counts."""
        return self.scorer.load_view

    @load_view.setter
    def load_view(self, view: LoadView | None) -> None:
        self.scorer.load_view = view

    def close(self) -> None:
        self.geo.close()

    # -- the choice ---------------------------------------------------------------

    def route(
        self,
        ctx: RequestContext | None = None,
        *,
        exclude: Collection[Region | str] = (),
        owner: str | None = None,
        affinity: AffinityPlan | None | object = _OWN,
    ) -> RoutePlan:
        """The regions this request may use, ranked, with its affinity plan.

        ``exclude``: regions (or their names) it must not use; ``owner``: the
        one region that may answer it, healthy or not (a stateful request's);
        ``affinity``: the request's prompt key made beforehand (by default, made here).
        Raises a 503 :class:`ProxyError` when a residency rule applies and none
        of the regions it allows is available, and a
        :class:`~edgeproxy._routing.modelcatalog.ModelError` (404) when no region
        serves the request's model. Only the regions serving the model are
        candidates, whatever their health.
        """
        plan: AffinityPlan | None
        if affinity is _OWN:
            plan = None if ctx is None or self.affinity is None else self.affinity.plan(ctx)
        else:
            assert affinity is None or isinstance(affinity, AffinityPlan)
            plan = affinity
        # The query built slot by slot: the dataclass's own __init__ is a call more, on
        # every request's path.
        query: RouteQuery = _new(RouteQuery)
        query.ctx = ctx
        query.now = self.clock()
        query.country = query.client_geo = query.allowed = None
        query.owner = owner
        query.exclude = (
            frozenset(r if isinstance(r, str) else r.name for r in exclude) if exclude else ()
        )
        query.panic = query.fresh_reports = False
        if ctx is not None and self._locates:
            country, geo = self.geo.locate(ctx)
            query.country = country
            if self.from_client:
                query.client_geo = geo
        regions = self.regions.regions
        filters = self.filters if owner or exclude else self._plain_filters
        for eligible in filters:
            regions = eligible.keep(query, regions)
        if self.apis.partial and len(regions) > 1:
            # Not those lacking the request's API when it cannot be translated for them.
            regions = served(ctx, regions)
        if len(regions) != 1 or query.panic:  # one eligible region: nothing to rank
            regions = self.ranking.order(query, regions, plan)
        return route_plan(tuple(regions), plan, query.panic, self.clock)

    def plan(self, ctx: RequestContext) -> AffinityPlan | None:
        """The request's prompt key for prefix affinity; None when affinity is off or the
        request has none. Pass it to :meth:`candidates`, then to :meth:`routed`."""
        return None if self.affinity is None else self.affinity.plan(ctx)

    def routed(self, plan: AffinityPlan | RoutePlan, region: Region) -> None:
        """``region`` gave the first byte of the request ``plan`` was made for."""
        if isinstance(plan, RoutePlan):
            plan.routed(region)
        else:
            Affinity.routed(plan, region, self.clock())

    def candidates(
        self, ctx: RequestContext | None = None, plan: AffinityPlan | None = None
    ) -> list[Region]:
        """The regions this request may use, best first (by affinity too, given a ``plan``):
        :meth:`route`'s regions, with the affinity plan made beforehand."""
        return list(self.route(ctx, affinity=plan).regions)
