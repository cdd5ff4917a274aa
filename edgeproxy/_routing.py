"""Choosing the region for a request."""

from __future__ import annotations

import math

from ._config import PopConfig
from ._regions import Region, RegionSet

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

    Regions believed up come first, nearest to the PoP first; regions believed
    down follow, so that a request still has somewhere to go when every
    region's state is stale.
    """

    def __init__(self, regions: RegionSet, pop: PopConfig) -> None:
        self.regions = regions
        self.distance_km = {
            r.name: great_circle_km(pop.lat, pop.lon, r.config.lat, r.config.lon) for r in regions
        }

    def candidates(self) -> list[Region]:
        return sorted(self.regions, key=lambda r: (not r.up, self.distance_km[r.name]))
