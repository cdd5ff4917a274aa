"""The order of the regions a request may use: the ranking policies.

Eligibility (:mod:`edgeproxy._routing.eligibility`) decides which regions may
answer; ranking puts those in order, best first. Priority tiers
(``[[regions]] priority``) always come first, then, while some region lacks an API, the
regions speaking the request's API before those it is translated for
(:mod:`edgeproxy._routing.apitiers`). Within a tier the policies
``[routing] rank`` lists decide in turn, each breaking the ties the ones
before it leave (by default ``["reported_load", "affinity", "latency"]``):

* ``reported_load`` (:class:`LoadTiers`): a fresh load report
  (:mod:`edgeproxy._upstream.reported`) with ``load_tier_queue`` requests
  or more waiting puts the region one load tier down, twice as many two
  tiers, and so on. Requests waiting at a model server cost every newcomer
  their queueing time, seconds where latencies differ by milliseconds, while
  the latency estimate is a peak-EWMA that one slow answer raises several
  fold: so a region saying requests queue there comes after a twin saying
  they do not, whatever the latencies. A stale report sets no tier. When no
  region has a tier, the policy has no say.
* ``affinity`` (:class:`PrefixRank`, with ``prefix_affinity``): the prefix
  match weighed against load, :mod:`edgeproxy._routing.affinity`; no say for
  a request without a prompt key, when no candidate holds any of it, or when
  the balance guard sets it aside.
* ``latency`` (:class:`TwoChoices`, always last): the score, lowest first.
  The regions tied with the best on everything before and scoring within
  ``equal_within`` of it are equals: two are drawn by weight and the better
  one goes first (power of two choices), so that equals share traffic by
  weight and the busier of two loses.

The score (:class:`Scorer`) is expected latency x (requests in flight + 1),
from these signals:

* the **peak-EWMA** of the region's latency, blended with the **geo prior**
  (:class:`GeoPrior`: the service time measured elsewhere plus the round
  trip its distance suggests) while it has few samples, so that before any
  traffic the nearest region wins; raised to the age of its oldest request
  still waiting for a first byte (a region that just stalled looks slow
  before any answer arrives); and, while the region gets no answers, fading
  back towards the prior (a region that was slow is probed again, one
  request at a time, and gets traffic back once it recovered);
* a fresh **load report** multiplies it by 1 + ``reported_load_weight`` x
  its load score (the load within a tier);
* the requests in flight are those of every process sharing the **shared
  load view** (:class:`~edgeproxy._shared.loadview.LoadView`) while it is
  fresh, else this process's own.

When no region is available (the panic), the ranking is the score alone,
reachable regions first, whatever the tiers.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any, Protocol

from edgeproxy._routing.affinity import Affinity
from edgeproxy._routing.apitiers import tiers

if TYPE_CHECKING:
    from edgeproxy._core.config import Config, RoutingConfig
    from edgeproxy._routing.affinity import AffinityPlan
    from edgeproxy._routing.eligibility import RouteQuery
    from edgeproxy._shared.loadview import LoadView
    from edgeproxy._upstream.apis import ApiBook
    from edgeproxy._upstream.regions import Region, RegionSet

__all__ = [
    "GeoPrior",
    "LoadTiers",
    "PrefixRank",
    "RankPolicy",
    "Ranking",
    "Scorer",
    "TwoChoices",
    "great_circle_km",
]

_EARTH_RADIUS_KM = 6371.0088
# The floor keeps load counting between regions that all look instant.
_MIN_LATENCY = 1e-4

ClientGeo = tuple[float, float] | None
"""Where the client is, ``(lat, lon)``, for a geo prior from the client; None: from the PoP."""


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Great-circle distance in kilometres (haversine)."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp = p2 - p1
    dl = math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * _EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(a)))


# -- the score -----------------------------------------------------------------------


class GeoPrior:
    """Expected round trips by great-circle distance, ``ms_per_1000km`` per 1000 km.

    Each region's round trip from the PoP is computed once, as ``region.geo_rtt``;
    from a client's location (``prior_from = "client"``), per request.
    """

    __slots__ = ("s_per_km",)

    def __init__(self, config: Config, regions: RegionSet) -> None:
        # ms per 1000 km -> seconds per km.
        self.s_per_km = config.routing.ms_per_1000km / 1e6
        pop = config.pop
        for region in regions:
            region.geo_rtt = (
                great_circle_km(pop.lat, pop.lon, region.lat, region.lon) * self.s_per_km
            )

    def rtt(self, region: Region, client_geo: ClientGeo = None) -> float:
        """Expected round trip to ``region`` from the PoP (or the client), in seconds."""
        if client_geo is None:
            return region.geo_rtt
        lat, lon = client_geo
        return great_circle_km(lat, lon, region.lat, region.lon) * self.s_per_km


class Scorer:
    """The score of a region: expected latency x (requests in flight + 1), lower is better."""

    __slots__ = (
        "regions",
        "prior",
        "min_samples",
        "probe_decay",
        "report_max_age",
        "reported_load_weight",
        "load_view",
    )

    def __init__(self, config: Config, regions: RegionSet) -> None:
        routing = config.routing
        self.regions = regions
        self.prior = GeoPrior(config, regions)
        self.min_samples = routing.min_samples
        self.probe_decay = routing.probe_decay
        self.report_max_age = routing.load_report_max_age
        self.reported_load_weight = routing.reported_load_weight
        # The load of every process sharing a Redis ([shared_load]), set by whoever opens
        # it; None: this process's own counts.
        self.load_view: LoadView | None = None

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
        self, region: Region, now: float, client_geo: ClientGeo = None, service: float | None = None
    ) -> float:
        """Seconds a request to ``region`` is expected to take to its first byte."""
        if service is None:
            service = self.service_time()
        rtt = region.geo_rtt if client_geo is None else self.prior.rtt(region, client_geo)
        prior = max(service + rtt, 0.0)
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
        self, region: Region, now: float, client_geo: ClientGeo = None, service: float | None = None
    ) -> float:
        """Lower is better: expected latency x (in flight + 1), the latency raised by a
        fresh load report: x (1 + reported_load_weight x its load score)."""
        if service is None:
            service = self.service_time()
        return self.scores([region], now, client_geo, service)[0][0]

    def scores(
        self,
        regions: list[Region],
        now: float,
        client_geo: ClientGeo,
        service: float,
        query: RouteQuery | None = None,
    ) -> list[tuple[float, Region]]:
        """:meth:`score` of each region, as (score, region); notes in ``query`` whether any
        has a fresh load report."""
        expected = self.expected_latency
        max_age = self.report_max_age
        weight = self.reported_load_weight
        view = self.load_view
        fresh = False
        scored: list[tuple[float, Region]] = []
        # ReportedLoad.fresh_score and in_flight, inlined: this runs for every candidate of
        # every request.
        for region in regions:
            latency = expected(region, now, client_geo, service)
            if latency < _MIN_LATENCY:
                latency = _MIN_LATENCY
            reported = region.reported
            load = reported.score
            if load is not None and 0.0 <= now - reported.stamp <= max_age:
                latency *= 1.0 + weight * load
                fresh = True
            if view is None:
                scored.append((latency * (region.in_flight + 1), region))
            else:
                scored.append((latency * (self.in_flight(region) + 1), region))
        if fresh and query is not None:
            query.fresh_reports = True
        return scored


# -- the policies --------------------------------------------------------------------


class RankPolicy(Protocol):
    """One of ``[routing] rank`` before ``latency``: a sort key per candidate."""

    def keys(
        self, query: RouteQuery, scored: list[tuple[float, Region]], plan: AffinityPlan | None
    ) -> list[float] | None:
        """One key per candidate of ``scored`` ((score, region), in that order), lower
        first; None when the policy has no say for this request (every key equal)."""
        ...


class LoadTiers:
    """``reported_load``: the load tier of each region's fresh report, 0 without one.

    Tier ``n`` holds the queues of ``load_tier_queue`` x 2^(n-1) up to twice
    that: doubling buckets, so that two regions with long queues of about the
    same length are told apart by their latencies, not by a few requests more.
    """

    __slots__ = ("max_age", "step")

    def __init__(self, routing: RoutingConfig) -> None:
        self.max_age = routing.load_report_max_age
        self.step = routing.load_tier_queue

    def tier(self, region: Region, now: float) -> int:
        """The load tier of ``region``'s report at ``now``."""
        return int(self.tiers([(0.0, region)], now)[0])

    def tiers(self, scored: list[tuple[float, Region]], now: float) -> list[float]:
        """The load tier of each region of ``scored`` ((score, region))."""
        max_age = self.max_age
        step = self.step
        tiers: list[float] = []
        for _, region in scored:
            reported = region.reported
            report = reported.report
            if report is None or not 0.0 <= now - reported.stamp <= max_age:
                tiers.append(0)
                continue
            waiting = report.num_requests_waiting
            tiers.append(
                0 if waiting is None or waiting < step else int(waiting // step).bit_length()
            )
        return tiers

    def keys(
        self, query: RouteQuery, scored: list[tuple[float, Region]], plan: AffinityPlan | None
    ) -> list[float] | None:
        # Most requests find no fresh report anywhere (the score looked already).
        if not query.fresh_reports:
            return None
        tiers = self.tiers(scored, query.now)
        return tiers if any(tiers) else None


class PrefixRank:
    """``affinity``: the prefix match weighed against load (:meth:`Affinity.keys`)."""

    __slots__ = ("affinity", "scorer")

    def __init__(self, affinity: Affinity, scorer: Scorer) -> None:
        self.affinity = affinity
        self.scorer = scorer

    def keys(
        self, query: RouteQuery, scored: list[tuple[float, Region]], plan: AffinityPlan | None
    ) -> list[float] | None:
        if plan is None:
            return None
        return self.affinity.keys(plan, scored, query.now, self.scorer.load)


class TwoChoices:
    """``latency``: power of two choices among the equals at the top of the ranking."""

    __slots__ = ("equal_within", "_rng")

    def __init__(self, routing: RoutingConfig, seed: int | None = None) -> None:
        self.equal_within = routing.equal_within
        self._rng = random.Random(seed)

    def pick(self, equals: list[tuple[float, Region]]) -> Region:
        """Draw two regions by weight, keep the better.

        Drawn with replacement, and a tie goes to the first drawn, so that
        regions that score alike share traffic in proportion to their weights.
        """
        rng = self._rng.random
        total = sum([r.weight for _, r in equals])
        x = rng() * total
        for one in equals:
            x -= one[1].weight
            if x <= 0:
                break
        x = rng() * total
        for two in equals:
            x -= two[1].weight
            if x <= 0:
                break
        return one[1] if one[0] <= two[0] else two[1]


def _tier_then_score(pair: tuple[float, Region]) -> tuple[int, float]:
    return pair[1].priority, pair[0]


def _to_front(ordered: list[Region], first: Region) -> None:
    if ordered[0] is not first:
        ordered.remove(first)
        ordered.insert(0, first)


def _reachable_then_score(pair: tuple[float, Region]) -> tuple[bool, float]:
    return pair[1].state == "down", pair[0]


class Ranking:
    """The eligible regions of one request, best first, by the ``[routing] rank`` policies."""

    __slots__ = ("scorer", "policies", "latency", "apis")

    def __init__(
        self,
        routing: RoutingConfig,
        scorer: Scorer,
        affinity: Affinity | None,
        *,
        seed: int | None = None,
        apis: ApiBook | None = None,
    ) -> None:
        self.scorer = scorer
        # Whether some region lacks an API: then those speaking the request's come first.
        self.apis = apis
        policies: list[RankPolicy] = []
        for name in routing.rank:
            if name == "reported_load":
                policies.append(LoadTiers(routing))
            elif name == "affinity" and affinity is not None:
                policies.append(PrefixRank(affinity, scorer))
        self.policies = tuple(policies)
        self.latency = TwoChoices(routing, seed)

    def order(
        self, query: RouteQuery, regions: list[Region], plan: AffinityPlan | None
    ) -> list[Region]:
        """``regions`` (eligible, in any order) best first; ``plan`` is the request's prompt
        key, for affinity."""
        if len(regions) == 1 and not query.panic:
            return regions
        scorer = self.scorer
        scored = scorer.scores(regions, query.now, query.client_geo, scorer.service_time(), query)
        if query.panic:
            # Nothing is known to work, so try everything, reachable first.
            return [r for _, r in sorted(scored, key=_reachable_then_score)]
        columns: list[list[float]] = []
        apis = self.apis
        if apis is not None and apis.partial:
            # The API tier, after the priority tier: native, then translated.
            api_tiers = tiers(query.ctx, [region for _, region in scored])
            if api_tiers is not None:
                columns.append([float(tier) for tier in api_tiers])
        for policy in self.policies:
            column = policy.keys(query, scored, plan)
            if column is not None:
                columns.append(column)
        equal_within = self.latency.equal_within
        if not columns:
            scored.sort(key=_tier_then_score)
            tier = scored[0][1].priority
            best = scored[0][0] * equal_within
            equals = [(s, r) for s, r in scored if r.priority == tier and s <= best]
            ordered = [r for _, r in scored]
            if len(equals) > 1:
                _to_front(ordered, self.latency.pick(equals))
            return ordered
        # Lexicographic: the tier, then each policy's key in turn, then the score, then the
        # eligible order (so that a full tie never compares two regions).
        keys: list[tuple[Any, ...]]  # the tier, the policies' keys, the score, the index
        if len(columns) == 1:
            column = columns[0]
            keys = [(pair[1].priority, column[i], pair[0], i) for i, pair in enumerate(scored)]
        else:
            keys = [
                (pair[1].priority, *[c[i] for c in columns], pair[0], i)
                for i, pair in enumerate(scored)
            ]
        keys.sort()
        top = keys[0]
        lead = top[:-2]
        best = top[-2] * equal_within
        equals = [scored[top[-1]]]
        for key in keys[1:]:
            if key[-2] > best or key[:-2] != lead:
                break
            equals.append(scored[key[-1]])
        ordered = [scored[key[-1]][1] for key in keys]
        first = ordered[0]
        if len(equals) > 1:
            first = self.latency.pick(equals)
            _to_front(ordered, first)
        if plan is not None and first in plan.matched:
            plan.chosen = first
        return ordered
