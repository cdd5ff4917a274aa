"""The recent window behind ``/status``: traffic and latency percentiles of the last minutes.

Fed by :class:`~edgeproxy._observability.metrics.Metrics` on every finished
request; ``/status`` (its ``recent`` section) and the status page read it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = ["RecentTraffic"]


class _LogHistogram:
    """Counts in logarithmic buckets 4% wide: percentiles within ±2%, at a fixed size."""

    MIN: Final = 1e-4  # 0.1 ms: anything faster reads as 0.1 ms
    RATIO: Final = 1.04
    SIZE: Final = 420  # up to about 20 minutes; slower still reads as 20 minutes
    _INV_LOG: Final = 1.0 / math.log(RATIO)

    __slots__ = ("counts", "n")

    def __init__(self) -> None:
        self.counts = [0] * self.SIZE
        self.n = 0

    def add(self, seconds: float) -> None:
        self.counts[_bucket(seconds)] += 1
        self.n += 1

    def merge(self, other: _LogHistogram) -> None:
        counts = self.counts
        for i, c in enumerate(other.counts):
            if c:
                counts[i] += c
        self.n += other.n

    def quantiles(self, qs: Sequence[float]) -> list[float | None]:
        """The values below which each share ``q`` of the observations fall, in seconds."""
        if not self.n:
            return [None] * len(qs)
        out: list[float | None] = []
        ranks = [max(1.0, q * self.n) for q in qs]
        seen = 0
        index = 0
        for rank in ranks:
            while seen + self.counts[index] < rank and index < self.SIZE - 1:
                seen += self.counts[index]
                index += 1
            out.append(self._value(index))
        return out

    def _value(self, index: int) -> float:
        # The geometric middle of the bucket.
        if index == 0:
            return self.MIN
        return float(self.MIN * self.RATIO ** (index - 0.5))


_MIN = _LogHistogram.MIN
_LAST = _LogHistogram.SIZE - 1
_INV_LOG = _LogHistogram._INV_LOG
_log = math.log


def _bucket(seconds: float) -> int:
    """The index of ``seconds`` in a :class:`_LogHistogram`."""
    if seconds <= _MIN:
        return 0
    index = int(_log(seconds / _MIN) * _INV_LOG) + 1
    return index if index < _LAST else _LAST


class _Slot:
    __slots__ = ("epoch", "duration", "ttfb", "cache", "regions", "errors", "tokens")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.duration = _LogHistogram()
        self.ttfb = _LogHistogram()
        self.cache: dict[str, int] = {}
        self.regions: dict[str, int] = {}
        self.errors = 0
        self.tokens = 0


_QUANTILES = (0.5, 0.95, 0.99)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


class RecentTraffic:
    """Latency percentiles and traffic over the last ``window`` seconds, in ``step`` slots.

    Cheap to feed (a logarithm and a few increments per request) and fixed in
    size, whatever the traffic: ``/status`` and the status page read it.
    """

    def __init__(
        self, window: float, step: float, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.step = step
        self.size = max(1, math.ceil(window / step))
        self.window = self.size * step
        self._clock = clock
        self._slots: list[_Slot | None] = [None] * self.size
        # The slot being filled and the clock readings it covers: [_start, _end).
        self._current: _Slot | None = None
        self._start = self._end = 0.0

    def _slot(self) -> _Slot:
        now = self._clock()
        slot = self._current
        if slot is not None and self._start <= now < self._end:
            return slot
        epoch = int(now // self.step)
        index = epoch % self.size
        slot = self._slots[index]
        if slot is None or slot.epoch != epoch:
            slot = self._slots[index] = _Slot(epoch)
        self._current = slot
        self._start = epoch * self.step
        self._end = self._start + self.step
        return slot

    def observe(
        self,
        duration: float,
        ttfb: float | None,
        region: str,
        cache: str,
        error: bool,
        tokens: int = 0,
    ) -> None:
        now = self._clock()
        slot = self._current
        if slot is None or not self._start <= now < self._end:
            slot = self._slot()
        # The histograms' add() and _bucket(), inlined: this runs once a request.
        hist = slot.duration
        if duration <= _MIN:
            hist.counts[0] += 1
        else:
            index = int(_log(duration / _MIN) * _INV_LOG) + 1
            hist.counts[index if index < _LAST else _LAST] += 1
        hist.n += 1
        if ttfb is not None:
            hist = slot.ttfb
            if ttfb <= _MIN:
                hist.counts[0] += 1
            else:
                index = int(_log(ttfb / _MIN) * _INV_LOG) + 1
                hist.counts[index if index < _LAST else _LAST] += 1
            hist.n += 1
        counts = slot.cache
        counts[cache] = counts.get(cache, 0) + 1
        counts = slot.regions
        counts[region] = counts.get(region, 0) + 1
        if error:
            slot.errors += 1
        slot.tokens += tokens

    def snapshot(self) -> dict[str, Any]:
        """The ``recent`` section of ``/status``: totals, percentiles, and one point per slot."""
        now_epoch = int(self._clock() // self.step)
        duration = _LogHistogram()
        ttfb = _LogHistogram()
        cache: dict[str, int] = {}
        regions: dict[str, int] = {}
        errors = tokens = 0
        series = []
        for epoch in range(now_epoch - self.size + 1, now_epoch + 1):
            slot = self._slots[epoch % self.size]
            if slot is None or slot.epoch != epoch:
                series.append(
                    {"t": epoch * self.step, "requests": 0, "errors": 0}
                    | {f"p{round(q * 100)}_ms": None for q in _QUANTILES}
                )
                continue
            duration.merge(slot.duration)
            ttfb.merge(slot.ttfb)
            for k, v in slot.cache.items():
                cache[k] = cache.get(k, 0) + v
            for k, v in slot.regions.items():
                regions[k] = regions.get(k, 0) + v
            errors += slot.errors
            tokens += slot.tokens
            point: dict[str, Any] = {
                "t": epoch * self.step,
                "requests": slot.duration.n,
                "errors": slot.errors,
            }
            for q, value in zip(_QUANTILES, slot.duration.quantiles(_QUANTILES), strict=True):
                point[f"p{round(q * 100)}_ms"] = _ms(value)
            series.append(point)
        lookups = sum(cache.get(k, 0) for k in ("hit", "stale", "miss", "coalesced"))
        served = cache.get("hit", 0) + cache.get("stale", 0)
        return {
            "window_s": self.window,
            "step_s": self.step,
            "requests": duration.n,
            "errors": errors,
            "latency_ms": _percentiles(duration),
            "ttfb_ms": _percentiles(ttfb),
            "cache": {**cache, "hit_ratio": round(served / lookups, 4) if lookups else None},
            "regions": regions,
            "tokens_per_s": round(tokens / self.window, 3),
            "series": series,
        }


def _percentiles(hist: _LogHistogram) -> dict[str, float | None]:
    return {
        f"p{round(q * 100)}": _ms(v)
        for q, v in zip(_QUANTILES, hist.quantiles(_QUANTILES), strict=True)
    }
