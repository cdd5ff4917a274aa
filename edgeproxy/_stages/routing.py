"""Choosing the region for a request: geo prior, peak-EWMA latency, load, weights.

For each request the router:

1. locates the client (:class:`~edgeproxy._stages.geo.GeoResolver`) and applies the
   residency rules: a request under a rule only ever sees allowed regions; then
   keeps the regions that serve the request's model
   (:class:`~edgeproxy._stages.models.ModelCatalog`);
2. keeps the regions that are available (reachable, not ejected, passing
   active checks: :class:`~edgeproxy._upstream.health.Health`); when none is, a
   request under a residency rule gets a 503, and any other request tries
   every region anyway (Envoy's "panic" routing: a guess beats a refusal);
3. scores each one: expected latency x (requests in flight + 1).
   The expected latency is the region's peak-EWMA, blended with a geo prior
   while it has few samples (so that before any traffic the nearest region
   wins), raised to the age of its oldest request still waiting for a first
   byte (a region that just stalled looks slow before any answer arrives),
   and, while the region gets no answers, fading back towards the prior (so
   that a region that was slow is probed again, one request at a time, and
   gets traffic back once it recovered). A fresh load report from the region
   (:mod:`edgeproxy._upstream.reported`) multiplies it by
   1 + ``reported_load_weight`` x its load score. The requests in flight are
   those of every process sharing the load view when it is fresh
   (:attr:`Router.load_view`), else this process's own;
4. picks the first region by power of two choices among the best priority
   tier: the regions scoring within ``[routing] equal_within`` of the best
   are equals, two of them are drawn by weight and the better one wins (so
   equals share traffic by weight, and the busier of two loses). The
   other regions follow, best first, as failover and hedge targets. With
   ``prefix_affinity``, a chat or completions request whose prompt was
   recently sent to some candidate is ranked by prefix match and load
   instead (:mod:`edgeproxy._stages.affinity`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from edgeproxy._stages.affinity import Affinity, AffinityPlan
from edgeproxy._stages.geo import GeoResolver, Residency
from edgeproxy._stages.models import ModelCatalog
from edgeproxy._upstream.regions import Region, RegionSet

if TYPE_CHECKING:
    from edgeproxy._core.config import Config
    from edgeproxy._core.context import RequestContext
    from edgeproxy._stages.loadview import LoadView

__all__ = ["Router", "great_circle_km"]

_EARTH_RADIUS_KM = 6371.0088


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Great-circle distance in kilometres (haversine)."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp = p2 - p1
    dl = math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * _EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(a)))


class Router:
    """Orders the regions a request may go to, best first.

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
        self.min_samples = routing.min_samples
        self.equal_within = routing.equal_within
        self.probe_decay = routing.probe_decay
        self.from_client = routing.prior_from == "client"
        # ms per 1000 km -> seconds per km.
        self.s_per_km = routing.ms_per_1000km / 1e6
        pop = config.pop
        for region in regions:
            region.geo_rtt = (
                great_circle_km(pop.lat, pop.lon, region.lat, region.lon) * self.s_per_km
            )
        self.geo = GeoResolver(config.geo)
        self.residency = Residency(config.geo, config.regions)
        self._rng = random.Random(seed)
        self.models = ModelCatalog(config.regions)
        self.affinity = Affinity(routing) if routing.prefix_affinity else None
        self.report_max_age = routing.load_report_max_age
        self.reported_load_weight = routing.reported_load_weight
        # The load of every process sharing a Redis ([shared_load]), set by whoever opens
        # it; None: this process's own counts.
        self.load_view: LoadView | None = None

    def close(self) -> None:
        self.geo.close()

    # -- the choice ---------------------------------------------------------------

    def plan(self, ctx: RequestContext) -> AffinityPlan | None:
        """The request's prompt key for prefix affinity; None when affinity is off or the
        request has none. Pass it to :meth:`candidates`, then to :meth:`routed`."""
        return None if self.affinity is None else self.affinity.plan(ctx)

    def routed(self, plan: AffinityPlan, region: Region) -> None:
        """``region`` gave the first byte of the request ``plan`` was made for."""
        Affinity.routed(plan, region, self.clock())

    def candidates(
        self, ctx: RequestContext | None = None, plan: AffinityPlan | None = None
    ) -> list[Region]:
        """The regions this request may use, best first (by affinity too, given a ``plan``).

        Raises a 503 :class:`ProxyError` when a residency rule applies and
        none of the regions it allows is available, and a
        :class:`~edgeproxy._stages.models.ModelError` (404) when no region serves
        the request's model. Only the regions serving the model are candidates,
        whatever their health.
        """
        now = self.clock()
        pool = self.regions.regions
        serving = self.models.lookup(ctx) if ctx is not None and self.models.active else None
        allowed: frozenset[str] | None = None
        country: str | None = None
        geo: tuple[float, float] | None = None
        if ctx is not None and (self.residency.enabled or self.from_client):
            country, geo = self.geo.locate(ctx)
            allowed = self.residency.allowed(country)
            if allowed is not None:
                pool = [r for r in pool if r.name in allowed]
            if not self.from_client:
                geo = None
        if serving is not None:
            pool = [r for r in pool if r.name in serving]
        available = [r for r in pool if self.health.available(r, now)]
        if not available:
            if allowed is not None:
                raise self.residency.no_region(country, allowed)
            # Panic: nothing is known to work, so try everything, reachable first.
            service = self.service_time()
            return sorted(pool, key=lambda r: (r.state == "down", self.score(r, now, geo, service)))
        if len(available) == 1:
            return available
        service = self.service_time()
        scored = sorted(
            ((self.score(r, now, geo, service), r) for r in available),
            key=lambda pair: (pair[1].priority, pair[0]),
        )
        if plan is not None and self.affinity is not None:
            ranked = self.affinity.rank(plan, scored, now, self.load)
            if ranked is not None:
                return ranked
        tier = scored[0][1].priority
        best = scored[0][0]
        equals = [(s, r) for s, r in scored if r.priority == tier and s <= best * self.equal_within]
        first = self._two_choices(equals) if len(equals) > 1 else scored[0][1]
        return [first, *(r for _, r in scored if r is not first)]

    def _two_choices(self, equals: list[tuple[float, Region]]) -> Region:
        """Power of two choices: draw two regions by weight, keep the better.

        Drawn with replacement, and a tie goes to the first drawn, so that
        regions that score alike share traffic in proportion to their weights.
        """
        rng = self._rng.random
        total = sum(r.weight for _, r in equals)
        picks: list[tuple[float, Region]] = []
        for _ in range(2):
            x = rng() * total
            for pair in equals:
                x -= pair[1].weight
                if x <= 0:
                    break
            picks.append(pair)
        return picks[0][1] if picks[0][0] <= picks[1][0] else picks[1][1]

    # -- the score ----------------------------------------------------------------

    def rtt_prior(self, region: Region, client_geo: tuple[float, float] | None = None) -> float:
        """Expected round trip to ``region`` from the PoP (or the client), in seconds."""
        if client_geo is None:
            return region.geo_rtt
        lat, lon = client_geo
        return great_circle_km(lat, lon, region.lat, region.lon) * self.s_per_km

    def service_time(self) -> float:
        """What answering takes once the network is accounted for, in seconds.

        Judged by the fastest region with history: the prior of a region with
        no history is this plus its own round trip, so that it is on the same
        scale as the measured EWMAs. It may be negative: where the geo model
        overestimates the round trips (regions nearer than their coordinates say),
        the offset calibrates every prior alike, so that a region whose penalty
        faded is judged like its measured peers rather than by the raw geo guess.
        """
        best: float | None = None
        for region in self.regions.regions:
            if region.latency.samples:
                service = region.latency.value - region.geo_rtt
                if best is None or service < best:
                    best = service
        return best or 0.0

    def expected_latency(
        self,
        region: Region,
        now: float,
        client_geo: tuple[float, float] | None = None,
        service: float | None = None,
    ) -> float:
        """Seconds a request to ``region`` is expected to take to its first byte."""
        if service is None:
            service = self.service_time()
        prior = max(service + self.rtt_prior(region, client_geo), 0.0)
        ewma = region.latency
        if ewma.samples == 0:
            estimate = prior
        else:
            value = ewma.value
            if value > prior:
                # No answers for a while: the penalty fades, and the region gets a probe.
                value = prior + (value - prior) * math.exp(-(now - ewma.stamp) / self.probe_decay)
            if ewma.samples < self.min_samples:
                w = ewma.samples / self.min_samples
                estimate = w * value + (1.0 - w) * prior
            else:
                estimate = value
        return max(estimate, region.oldest_pending(now))

    def in_flight(self, region: Region) -> float:
        """Requests in flight at ``region``: over every process sharing the load view while
        it is fresh, else this process's own."""
        view = self.load_view
        if view is not None:
            shared = view.global_in_flight(region.name)
            if shared is not None:
                return shared
        return region.in_flight

    def load(self, region: Region, now: float) -> float:
        """Requests ``region`` holds, for the balance guard: those in flight, or as many as
        it reports running and waiting (while its report is fresh), whichever is more."""
        seen = self.in_flight(region)
        reported = region.reported.queued(now, self.report_max_age)
        return seen if reported is None else max(seen, reported)

    def score(
        self,
        region: Region,
        now: float,
        client_geo: tuple[float, float] | None = None,
        service: float | None = None,
    ) -> float:
        """Lower is better: expected latency x (in flight + 1), the latency raised by a
        fresh load report: x (1 + reported_load_weight x its load score)."""
        # The floor keeps load counting between regions that all look instant.
        latency = max(self.expected_latency(region, now, client_geo, service), 1e-4)
        reported = region.reported.fresh_score(now, self.report_max_age)
        if reported is not None:
            latency *= 1.0 + self.reported_load_weight * reported
        return latency * (self.in_flight(region) + 1)
