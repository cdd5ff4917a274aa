"""Region health: active checks, passive outlier ejection, circuit breakers.

Three independent signals keep a region out of the candidate list:

* **Active checks** (``[health] active``): a background ``GET`` of
  ``[health] path`` on every endpoint, every ``interval``; ``unhealthy_threshold``
  failures in a row make the region unhealthy, ``healthy_threshold`` passes
  in a row make it healthy again.
* **Outlier ejection**, Envoy's model: ``consecutive_failures`` 5xx answers or
  connect/reset/timeout failures in a row eject the region for
  ``base_ejection_time`` times the number of times it was ejected (capped at
  ``max_ejection_time``); every ``outlier_interval`` without an ejection
  takes one off that count. At most ``max_ejection_percent`` of the regions
  are ejected at once (at least one may always be), so a bad threshold cannot
  empty the list.
* **Circuit breakers**: a region with ``max_concurrent`` requests in flight, or
  ``max_pending`` still waiting for their first byte, takes no more until
  some finish; the request goes to the next region instead.

Unlike Envoy, a passing active check does not lift an ejection: an LLM
cluster's health endpoint often answers while its inference path fails.

Unlike Envoy too, a 5xx answer is not always the region's fault: a malformed request
makes several servers answer 500, so one client could otherwise eject a healthy region,
or make it look slow enough to send everyone's traffic far away. But blame needs
evidence: a region's 5xx answer is the caller's own (:meth:`Health.blame`) only when the
same region served another caller within ``failure_window`` and fewer than
``min_failing_callers`` distinct callers got 5xx answers in that window. Without that
evidence (one caller, a sidecar's app, seeing an outage) the failure is the region's, as
it is for every caller while its active check fails. The capacity statuses (503, and
Anthropic's 529 overloaded) and transport failures (connect, reset, timeout) always
count: no request causes those. A passing active check is no evidence: an LLM cluster's
health endpoint often answers while its inference path fails.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from edgeproxy._upstream.endpoint import Endpoint, RegionEndpoints
from edgeproxy._upstream.pool import UpstreamError
from edgeproxy._upstream.regiontasks import RegionTasks

if TYPE_CHECKING:
    from edgeproxy._core.config import HealthConfig

__all__ = ["CAPACITY_STATUSES", "Caller", "Health", "HealthRegion", "RegionHealth"]

Caller = str | int
"""A caller as health tells callers apart: any stable identity (a name, or its hash)."""

# A region out of capacity says so: 429 (too many requests), 503, and 529 (Anthropic's
# overloaded). None of them is ever a request's fault.
CAPACITY_STATUSES = frozenset({429, 503, 529})

logger = logging.getLogger("edgeproxy.health")


@dataclass(slots=True)
class RegionHealth:
    """What the health machinery knows about one region."""

    active_ok: bool | None = None  # None: not checked (yet)
    active_passes: int = 0
    active_failures: int = 0
    last_check_error: str | None = None
    consecutive_failures: int = 0
    ejected: bool = False
    ejected_until: float = 0.0
    ejections_total: int = 0
    multiplier: int = 0
    overflows_total: int = 0
    last_ejection_reason: str | None = None
    # 5xx answers within [health] failure_window: when each came, and each caller's latest
    # (oldest first). Bounded: a flood from one caller cannot grow them.
    failures: deque[float] = field(default_factory=lambda: deque(maxlen=_FAILURES_KEPT))
    failing_callers: OrderedDict[Caller, float] = field(default_factory=OrderedDict)
    failures_counted_total: int = 0
    failures_callers_total: int = 0  # not counted: too few callers got them
    # The evidence that the region serves others: the two latest distinct callers it
    # answered (below 500), and when. Two slots, so that one of them is always another
    # caller than the failing one.
    served_by: Caller | None = None
    served_at: float = -math.inf
    served_by_other: Caller | None = None
    served_other_at: float = -math.inf
    # The latest penalty fed to the latency estimate (a failure counted as a slow answer).
    latency_penalty: float = 0.0
    latency_penalty_at: float | None = None


_FAILURES_KEPT = 1024
_CALLERS_KEPT = 256


class HealthRegion(RegionEndpoints, Protocol):
    """A region as its health policy sees it: a Protocol, as
    :mod:`edgeproxy._upstream.regions` imports this module to give each region its
    :class:`RegionHealth`."""

    @property
    def state(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def pending(self) -> int: ...

    @property
    def health(self) -> RegionHealth: ...


class Health:
    """The health policy of a set of regions, and the active checkers' tasks.

    ``clock`` (monotonic seconds) dates the ejections :meth:`record` makes when
    it is given no ``now``; the same clock must give the ``now`` of
    :meth:`available` and :meth:`snapshot`.
    """

    def __init__(
        self,
        config: HealthConfig,
        regions: Sequence[HealthRegion],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.regions = regions
        self.clock = clock
        # The first checks are spread over a quarter interval, so that regions are not
        # all probed in the same instant.
        self._checkers: RegionTasks[HealthRegion] = RegionTasks(
            "health", self.check, config.interval, first_delay=config.interval / 4
        )

    # -- what the router asks ----------------------------------------------

    def available(self, region: HealthRegion, now: float) -> bool:
        """Reachable, not ejected, and not failing its active checks."""
        if region.state == "down":
            return False
        health = region.health
        if health.ejected and self._still_ejected(region, now):
            return False
        return health.active_ok is not False

    def overloaded(self, region: HealthRegion) -> bool:
        """The region's circuit breaker is open: too many in flight, or waiting."""
        return (
            region.in_flight >= self.config.max_concurrent
            or region.pending >= self.config.max_pending
        )

    # -- whose fault a 5xx is ----------------------------------------------------

    def served(self, region: HealthRegion, caller: Caller, now: float | None = None) -> None:
        """``region`` answered ``caller`` (a status below 500): evidence for :meth:`blame`
        that it serves, should another caller's 5xx come."""
        health = region.health
        if caller != health.served_by:
            health.served_by_other = health.served_by
            health.served_other_at = health.served_at
            health.served_by = caller
        health.served_at = self.clock() if now is None else now

    def served_others(self, region: HealthRegion, caller: Caller, now: float) -> bool:
        """Whether ``region`` answered a caller other than ``caller`` within the window."""
        health = region.health
        horizon = now - self.config.failure_window
        if health.served_by != caller:
            return health.served_by is not None and health.served_at >= horizon
        return health.served_by_other is not None and health.served_other_at >= horizon

    def blame(
        self, region: HealthRegion, caller: Caller, now: float | None = None, *, status: int = 500
    ) -> bool:
        """A 5xx answer (``status``) of ``region`` to ``caller``: whether it counts against
        the region (its health, its errors and its latency), or is the caller's own.

        It is the caller's own only with evidence: the region served another caller within
        ``failure_window``, fewer than ``min_failing_callers`` distinct callers got 5xx
        answers from it in that window (this one included), and its active check does not
        fail. A capacity status (503, 529) always counts."""
        now = self.clock() if now is None else now
        health = region.health
        callers = self._failing(health, now)
        health.failures.append(now)
        callers.pop(caller, None)
        callers[caller] = now
        if len(callers) > _CALLERS_KEPT:
            callers.popitem(last=False)
        if (
            status in CAPACITY_STATUSES
            or self._counts(health, callers)
            or not self.served_others(region, caller, now)
        ):
            health.failures_counted_total += 1
            return True
        health.failures_callers_total += 1
        return False

    def _counts(self, health: RegionHealth, callers: OrderedDict[Caller, float]) -> bool:
        """Whether the region's 5xx answers count against it whoever gets them: enough
        distinct callers got them, or its active check confirms it fails."""
        minimum = self.config.min_failing_callers
        return minimum <= 1 or len(callers) >= minimum or health.active_ok is False

    def _failing(self, health: RegionHealth, now: float) -> OrderedDict[Caller, float]:
        """The callers that got 5xx answers within the window (older ones forgotten)."""
        horizon = now - self.config.failure_window
        failures, callers = health.failures, health.failing_callers
        while failures and failures[0] < horizon:
            failures.popleft()
        while callers and next(iter(callers.values())) < horizon:
            callers.popitem(last=False)
        return callers

    def penalized(self, region: HealthRegion, penalty: float, now: float) -> None:
        """A failure counted against ``region`` was fed to its latency as ``penalty``
        seconds (for /status: why traffic moved)."""
        health = region.health
        health.latency_penalty = penalty
        health.latency_penalty_at = now

    # -- passive outlier detection ---------------------------------------------

    def record(self, region: HealthRegion, *, failed: bool, now: float | None = None) -> None:
        """One request's outcome: a 5xx or a transport failure, or anything else."""
        health = region.health
        if not failed:
            health.consecutive_failures = 0
            return
        health.consecutive_failures += 1
        if (
            self.config.outlier_detection
            and health.consecutive_failures >= self.config.consecutive_failures
        ):
            now = self.clock() if now is None else now
            if not (health.ejected and self._still_ejected(region, now)):
                self._eject(region, now)

    def _still_ejected(self, region: HealthRegion, now: float) -> bool:
        health = region.health
        if now < health.ejected_until:
            return True
        health.ejected = False
        health.consecutive_failures = 0
        logger.info("region %s is back from ejection", region.name)
        return False

    def _eject(self, region: HealthRegion, now: float) -> None:
        health = region.health
        ejected = sum(1 for r in self.regions if r.health.ejected and self._still_ejected(r, now))
        percent = self.config.max_ejection_percent
        limit = max(1, math.floor(len(self.regions) * percent / 100)) if percent > 0 else 0
        if ejected >= limit:
            return
        # Good behaviour since the last ejection ended earns the multiplier back.
        if health.multiplier and health.ejected_until:
            calm = max(0.0, now - health.ejected_until)
            health.multiplier = max(
                0, health.multiplier - int(calm // self.config.outlier_interval)
            )
        health.multiplier += 1
        duration = min(
            self.config.base_ejection_time * health.multiplier, self.config.max_ejection_time
        )
        health.ejected = True
        health.ejected_until = now + duration
        health.ejections_total += 1
        callers = len(self._failing(health, now))
        health.last_ejection_reason = (
            f"{self.config.consecutive_failures} failures in a row; "
            f"{callers} distinct callers got 5xx in the last {self.config.failure_window:g}s"
        )
        health.consecutive_failures = 0
        logger.warning(
            "region %s ejected for %.1fs after %d failures in a row (ejection #%d)",
            region.name,
            duration,
            self.config.consecutive_failures,
            health.ejections_total,
        )

    # -- active checks ------------------------------------------------------

    def start(self) -> None:
        """Start one active checker per region, when ``[health] active`` is on."""
        if self.config.active:
            self._checkers.start(self.regions)

    async def close(self) -> None:
        await self._checkers.close()

    async def check(self, region: HealthRegion) -> bool:
        """Run one active check of every endpoint of ``region`` and apply the result."""
        errors = await asyncio.gather(
            *(self._check_endpoint(region, ep) for ep in region.endpoints)
        )
        passed = any(e is None for e in errors)
        self._apply_check(region, passed, next((e for e in errors if e is not None), None))
        return passed

    async def _check_endpoint(self, region: HealthRegion, endpoint: Endpoint) -> str | None:
        headers = [("user-agent", "edgeproxy-health"), *region.credential_headers]
        try:
            async with asyncio.timeout(self.config.timeout):
                resp = await endpoint.pool.request(
                    "GET",
                    endpoint.base_path + self.config.path,
                    headers,
                    None,
                    authority=endpoint.authority,
                )
                try:
                    async for _ in resp.aiter_bytes():
                        pass
                finally:
                    await resp.aclose()
        except TimeoutError:
            error = f"health check timed out after {self.config.timeout:g}s"
        except UpstreamError as exc:
            error = f"health check failed: {exc}"
            if exc.retryable:
                endpoint.mark_down(error)
        else:
            if 200 <= resp.status < 300:
                endpoint.mark_up()
                return None
            error = f"health check answered {resp.status}"
        return error

    def _apply_check(self, region: HealthRegion, passed: bool, error: str | None) -> None:
        health = region.health
        if passed:
            health.active_passes += 1
            health.active_failures = 0
            health.last_check_error = None
            if health.active_ok is not True and (
                health.active_ok is None or health.active_passes >= self.config.healthy_threshold
            ):
                if health.active_ok is False:
                    logger.info("region %s passes its health checks again", region.name)
                health.active_ok = True
        else:
            health.active_failures += 1
            health.active_passes = 0
            health.last_check_error = error
            if health.active_ok is not False and (
                health.active_failures >= self.config.unhealthy_threshold
            ):
                logger.warning("region %s fails its health checks: %s", region.name, error)
                health.active_ok = False

    # -- status ---------------------------------------------------------------

    def snapshot(self, region: HealthRegion, now: float) -> dict[str, Any]:
        health = region.health
        callers = self._failing(health, now)
        ejected = health.ejected and self._still_ejected(region, now)
        if not self.config.active:
            active = "off"
        else:
            active = {None: "unknown", True: "healthy", False: "unhealthy"}[health.active_ok]
        return {
            "available": self.available(region, now),
            "active": active,
            "last_check_error": health.last_check_error,
            "ejected": ejected,
            "ejected_for_s": round(health.ejected_until - now, 3) if ejected else 0.0,
            "ejections_total": health.ejections_total,
            "consecutive_failures": health.consecutive_failures,
            "last_ejection_reason": health.last_ejection_reason,
            "failures": {
                # Why traffic moved, or did not: the 5xx answers within the window, how
                # many callers got them, and whether they count against the region.
                "recent": len(health.failures),
                "callers": len(callers),
                "counted": self._counts(health, callers),
                "counted_total": health.failures_counted_total,
                "callers_own_total": health.failures_callers_total,
                "window_s": self.config.failure_window,
            },
            "latency_penalty_ms": round(health.latency_penalty * 1000, 3),
            "latency_penalty_age_s": round(now - health.latency_penalty_at, 3)
            if health.latency_penalty_at is not None
            else None,
            "breaker_open": self.overloaded(region),
            "breaker_overflows_total": health.overflows_total,
        }
