"""A region's word that it is out of capacity for a model: 429 and 503 with ``Retry-After``.

A region that answers 429 (too many requests), 503 or 529 (overloaded) for a model gets
nothing more for that model until the wait it named has passed: ``Retry-After`` in
seconds or as an HTTP date. Without one, a persistent refusal is backed off
exponentially with jitter (:data:`BACKOFF_BASE` seconds doubled per refusal in a row, up
to :data:`BACKOFF_MAX`), so the proxy never hammers a region that keeps refusing; an
answer for the model ends the run.

Times are the region set's clock (monotonic seconds); the tests inject one. The table is
per region and bounded by the models the region is asked for.
"""

from __future__ import annotations

import math
import random
import time
from email.utils import parsedate_to_datetime
from typing import Any

__all__ = ["BACKOFF_BASE", "BACKOFF_MAX", "Cooldowns", "retry_after_seconds", "soonest"]

BACKOFF_BASE = 1.0
BACKOFF_MAX = 60.0
# A Retry-After longer than this is read as this: a region cannot park a model for a day.
_LONGEST = 3600.0
# Models remembered per region; past it the one that ends first is forgotten.
_KEPT = 1024


def retry_after_seconds(value: str | None, *, now: float | None = None) -> float | None:
    """The seconds a ``Retry-After`` value asks for (delay-seconds or an HTTP date, RFC
    9110 §10.2.3), capped at an hour; None when absent or unreadable. ``now``: the wall
    clock (Unix seconds) an HTTP date is measured from."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), _LONGEST)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    wall = time.time() if now is None else now
    return min(max(0.0, when.timestamp() - wall), _LONGEST)


class _Cooling:
    __slots__ = ("until", "status", "refusals")

    def __init__(self) -> None:
        self.until = 0.0
        self.status = 0
        self.refusals = 0


class Cooldowns:
    """The models one region asked the proxy to hold off, and until when."""

    __slots__ = ("_models", "refusals_total")

    def __init__(self) -> None:
        self._models: dict[str, _Cooling] = {}
        self.refusals_total = 0

    def __bool__(self) -> bool:
        return bool(self._models)

    def until(self, model: str) -> float:
        """When the region may be asked for ``model`` again (0: now)."""
        cooling = self._models.get(model)
        return 0.0 if cooling is None else cooling.until

    def status(self, model: str) -> int:
        """The status of the refusal that set ``model``'s wait (429, 503, 529), or 0."""
        cooling = self._models.get(model)
        return 0 if cooling is None else cooling.status

    def refused(
        self,
        model: str,
        status: int,
        retry_after: float | None,
        now: float,
        *,
        jitter: float | None = None,
    ) -> float:
        """The region refused ``model`` with ``status``: hold it off for ``retry_after``
        seconds, else for the backoff of this many refusals in a row. Returns the wait.
        ``jitter`` (0 to 1): the random share of the backoff, drawn when None."""
        self.refusals_total += 1
        cooling = self._models.get(model)
        if cooling is None:
            if len(self._models) >= _KEPT:
                del self._models[min(self._models, key=lambda m: self._models[m].until)]
            cooling = self._models[model] = _Cooling()
        cooling.refusals += 1
        wait: float
        if retry_after is None:
            backoff = min(BACKOFF_BASE * 2.0 ** (cooling.refusals - 1), BACKOFF_MAX)
            share = random.random() if jitter is None else jitter
            # Half fixed, half random: callers that were refused together spread out.
            wait = backoff * (0.5 + 0.5 * share)
        else:
            wait = retry_after
        cooling.until = max(cooling.until, now + wait)
        cooling.status = status
        return wait

    def answered(self, model: str) -> None:
        """The region answered ``model``: its run of refusals is over."""
        if self._models:
            self._models.pop(model, None)

    def snapshot(self, now: float) -> dict[str, Any]:
        """For ``/status``: the models held off now, with the seconds left."""
        return {
            "refusals_total": self.refusals_total,
            "models": {
                model: {"status": c.status, "for_s": round(c.until - now, 3)}
                for model, c in sorted(self._models.items())
                if c.until > now
            },
        }


def soonest(waits: list[float]) -> int:
    """Whole seconds until the soonest of ``waits`` (at least 1): a Retry-After to trust."""
    return max(1, math.ceil(min(waits))) if waits else 1
