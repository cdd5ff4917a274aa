"""One routing decision as a value: the eligible regions, best first, and its affinity plan.

:meth:`Router.route <edgeproxy._routing.router.Router.route>` makes one per
request. Failover walks its regions in order; continuation and hedging draw
the next candidates from the same ranking (:meth:`RoutePlan.without`,
:meth:`RoutePlan.after`) instead of routing again, so that a second look
neither reshuffles the order (the power of two choices draws again) nor
costs a second ranking. :meth:`RoutePlan.routed` records, once the first
byte came, that the region answering now holds the request's prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from edgeproxy._routing.affinity import Affinity

if TYPE_CHECKING:
    from edgeproxy._routing.affinity import AffinityPlan
    from edgeproxy._upstream.regions import Region

__all__ = ["RoutePlan", "route_plan"]


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The regions a request may use, best first, and what ranked them.

    ``regions``: the eligible regions in their rank (empty: none may answer);
    ``affinity``: the request's prompt key and what affinity decided (None:
    affinity off, or no prompt key); ``panic``: no region was available, so
    every eligible one is here, reachable first; ``clock``: the router's,
    which dates :meth:`routed`. The plan never changes; :meth:`without` and
    :meth:`after` give new ones sharing its affinity plan.
    """

    regions: tuple[Region, ...]
    affinity: AffinityPlan | None = None
    panic: bool = False
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    def __iter__(self) -> Iterator[Region]:
        return iter(self.regions)

    def __len__(self) -> int:
        return len(self.regions)

    @property
    def first(self) -> Region | None:
        """The best region, or None when none may answer."""
        return self.regions[0] if self.regions else None

    def without(self, *regions: Region | str) -> RoutePlan:
        """The same ranking without ``regions`` (regions or their names)."""
        names = {r if isinstance(r, str) else r.name for r in regions}
        return replace(self, regions=tuple(r for r in self.regions if r.name not in names))

    def after(self, region: Region | str) -> RoutePlan:
        """The regions ranked after ``region``: the next candidates once it is in use.

        A region that is not in the plan (a hook put it first) skips nothing.
        """
        name = region if isinstance(region, str) else region.name
        for i, candidate in enumerate(self.regions):
            if candidate.name == name:
                return replace(self, regions=self.regions[i + 1 :])
        return self

    def routed(self, region: Region) -> None:
        """``region`` gave the request its first byte: with affinity, it now holds the
        prompt (whichever region it is: failover and hedges included)."""
        if self.affinity is not None:
            Affinity.routed(self.affinity, region, self.clock())


# One plan a request: built slot by slot, as the frozen dataclass's own __init__ goes
# through object.__setattr__ once a field (about half the cost of routing one region).
_new_plan = object.__new__
_set_regions = RoutePlan.__dict__["regions"].__set__
_set_affinity = RoutePlan.__dict__["affinity"].__set__
_set_panic = RoutePlan.__dict__["panic"].__set__
_set_clock = RoutePlan.__dict__["clock"].__set__


def route_plan(
    regions: tuple[Region, ...],
    affinity: AffinityPlan | None,
    panic: bool,
    clock: Callable[[], float],
) -> RoutePlan:
    """``RoutePlan(regions, affinity, panic, clock)``, built at a fraction of the cost."""
    plan: RoutePlan = _new_plan(RoutePlan)
    _set_regions(plan, regions)
    _set_affinity(plan, affinity)
    _set_panic(plan, panic)
    _set_clock(plan, clock)
    return plan
