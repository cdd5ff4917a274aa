"""One URL of a region (:class:`Endpoint`), and a region as the requests it makes in
the background see it (:class:`RegionEndpoints`): the health checks and the load scrapes.

Below :mod:`edgeproxy._upstream.regions`, which holds both in its regions, so that
:mod:`~edgeproxy._upstream.health` and :mod:`~edgeproxy._upstream.reported` name them
without importing the module that imports them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol
from urllib.parse import urlsplit

from edgeproxy._upstream.pool import UpstreamPool, split_origin

__all__ = ["Endpoint", "RegionEndpoints"]

# The regions' logger: an endpoint's reachability is news about its region.
logger = logging.getLogger("edgeproxy.regions")


class Endpoint:
    """One URL of a region, with its own pool and reachability."""

    def __init__(self, region_name: str, url: str, pool: UpstreamPool, host_header: str | None):
        self.region_name = region_name
        self.url = url
        self.pool = pool
        _, self.base_path = split_origin(url)
        self.authority = host_header or urlsplit(url).netloc
        self.state = "unknown"
        self.last_error: str | None = None
        self.in_flight = 0
        self.changed_at = time.monotonic()

    @property
    def up(self) -> bool:
        return self.state == "up"

    def mark_up(self) -> None:
        if self.state != "up":
            if self.state == "down":
                logger.info("region %s (%s) is reachable again", self.region_name, self.url)
            self.state = "up"
            self.last_error = None
            self.changed_at = time.monotonic()

    def mark_down(self, reason: str) -> None:
        self.last_error = reason
        if self.state != "down":
            logger.warning("region %s (%s) is unreachable: %s", self.region_name, self.url, reason)
            self.state = "down"
            self.changed_at = time.monotonic()


class RegionEndpoints(Protocol):
    """A region as a background request to it sees it: its name, its endpoints and the
    credentials it is sent (a ``Region`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def endpoints(self) -> Sequence[Endpoint]: ...

    @property
    def credential_headers(self) -> Sequence[tuple[str, str]]: ...
