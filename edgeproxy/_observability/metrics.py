"""Prometheus metrics, and the recent latency percentiles of ``/status``.

Two kinds of series, both served at the admin ``/metrics``:

- *Per-request* histograms and counters, observed by :class:`Metrics`, a
  built-in plugin on the ``edgeproxy_response_complete`` hook (the same hook
  any plugin gets). Their labels are bounded: route (a ``[[routes]]`` name),
  region (a configured name), cache outcome, degraded yes/no and status
  class. Tenants and paths never become label values.
- *Component* counters and gauges, pulled at scrape time from the proxy's
  ``/status`` JSON by :class:`StatusCollector`. Every component (regions,
  pools, routing, admission, cache, fallback) already keeps its own counters
  for ``/status``; the collector turns every number it finds there into a
  series, so a component that adds a section gets metrics without touching
  this module, and a section that does not exist yet is simply absent.

With ``PROMETHEUS_MULTIPROC_DIR`` set before the process starts (one worker
process per core), prometheus-client's multiprocess mode is used: the
per-request series are written to the shared directory, each worker copies
its ``/status`` numbers there too, and any worker's ``/metrics`` serves the
sum over all of them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import values as prometheus_values
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from edgeproxy._core.version import __version__
from edgeproxy.hookspecs import hookimpl

if TYPE_CHECKING:
    from edgeproxy._core.config import Config
    from edgeproxy._core.context import RequestContext

__all__ = ["LatencyWindow", "Metrics", "StatusCollector", "flatten_status"]

logger = logging.getLogger("edgeproxy.metrics")

# The per-request labels. Each one takes few values: see _Labels.
LABELS = ("route", "region", "cache", "degraded", "status_class")

# Tokens per second of one streamed answer: a slow local model to a fast region.
TOKEN_RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)

# Cache outcomes edgeproxy itself sets (X-Edgeproxy-Cache, lower-cased).
CACHE_OUTCOMES = frozenset({"hit", "miss", "stale", "bypass", "coalesced"})

# Values a label may take beyond the known ones before the rest read "other":
# a plugin setting ctx.region or ctx.cache to anything must not blow up the
# number of series.
EXTRA_LABEL_VALUES = 16

# /status keys this module writes itself (no need to read them back).
_OWN_STATUS_KEYS = frozenset({"recent"})

_STATUS_CLASS = {0: "none", 1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}

_MULTIPROC_ENV = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def multiprocess_dir() -> str | None:
    """The multiprocess directory when prometheus-client runs in multiprocess mode."""
    path = next((os.environ[k] for k in _MULTIPROC_ENV if os.environ.get(k)), None)
    if path is None:
        return None
    # prometheus-client chooses how values are stored when it is first
    # imported; a variable set later would leave us writing nowhere.
    if prometheus_values.ValueClass is prometheus_values.MutexValue:
        logger.warning(
            "PROMETHEUS_MULTIPROC_DIR was set after prometheus_client was imported; "
            "set it before the process starts. Serving this process's metrics only."
        )
        return None
    return path


# -- the recent window behind /status ---------------------------------------------------


class _LogHistogram:
    """Counts in logarithmic buckets 4% wide: percentiles within ±2%, at a fixed size."""

    MIN = 1e-4  # 0.1 ms: anything faster reads as 0.1 ms
    RATIO = 1.04
    SIZE = 420  # up to about 20 minutes; slower still reads as 20 minutes
    _INV_LOG = 1.0 / math.log(RATIO)

    __slots__ = ("counts", "n")

    def __init__(self) -> None:
        self.counts = [0] * self.SIZE
        self.n = 0

    def add(self, seconds: float) -> None:
        if seconds <= self.MIN:
            index = 0
        else:
            index = min(self.SIZE - 1, int(math.log(seconds / self.MIN) * self._INV_LOG) + 1)
        self.counts[index] += 1
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


class LatencyWindow:
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

    def _slot(self) -> _Slot:
        epoch = int(self._clock() // self.step)
        index = epoch % self.size
        slot = self._slots[index]
        if slot is None or slot.epoch != epoch:
            slot = self._slots[index] = _Slot(epoch)
        return slot

    def observe(
        self,
        duration: float,
        ttfb: float | None,
        *,
        region: str,
        cache: str,
        error: bool,
        tokens: int = 0,
    ) -> None:
        slot = self._slot()
        slot.duration.add(duration)
        if ttfb is not None:
            slot.ttfb.add(ttfb)
        slot.cache[cache] = slot.cache.get(cache, 0) + 1
        slot.regions[region] = slot.regions.get(region, 0) + 1
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


# -- bounded label values ----------------------------------------------------------------


class _Labels:
    """Maps a raw value to a label value from a bounded set.

    Known values map to themselves; up to ``extra`` unknown ones are admitted
    as they come, and everything after that reads ``other``.
    """

    __slots__ = ("_known", "_extra")

    def __init__(self, known: Iterable[str], extra: int = EXTRA_LABEL_VALUES) -> None:
        self._known = {v: v for v in known}
        self._extra = extra

    def __call__(self, value: str) -> str:
        label = self._known.get(value)
        if label is not None:
            return label
        if self._extra > 0 and len(value) <= 64 and _LABEL_VALUE_RE.match(value):
            self._extra -= 1
            self._known[value] = value
            return value
        return "other"


_LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")


# -- component numbers from /status --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StatusSample:
    """One number found in ``/status``, named and typed for Prometheus."""

    name: str
    kind: str  # "counter" or "gauge"
    doc: str
    labels: tuple[tuple[str, str], ...]
    value: float


_NAME_RE = re.compile(r"[^a-z0-9_]+")
# A dict with more keys than this is a map keyed by data (tenants, keys),
# not a record with named fields: it would mint a series per entry.
_MAX_RECORD_KEYS = 64
_MAX_DEPTH = 4
_MAX_LIST = 256


def _metric_part(key: str) -> str:
    return _NAME_RE.sub("_", key.lower()).strip("_")


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def _typed(name: str, value: float) -> tuple[str, str, float]:
    """Prometheus conventions: ``*_total`` are counters, durations are in seconds."""
    if name.endswith("_total"):
        return name, "counter", value
    if name.endswith("_ms"):
        return name[:-3] + "_seconds", "gauge", value / 1000.0
    if name.endswith("_s"):
        return name[:-2] + "_seconds", "gauge", value
    return name, "gauge", value


def flatten_status(status: dict[str, Any], prefix: str = "edgeproxy") -> list[StatusSample]:
    """Every number in a ``/status`` document, as Prometheus samples.

    - top-level numbers and booleans: ``edgeproxy_<key>``;
    - ``regions`` (a list of objects with a ``name``): ``edgeproxy_region_<key>``
      labelled ``region``, nested objects joined with ``_``
      (``pool.connections_open`` is ``edgeproxy_region_pool_connections_open``);
      a region's ``state`` also gives ``edgeproxy_region_up`` and
      ``edgeproxy_region_state{state=...}``;
    - any other object: ``edgeproxy_<section>_<key>``; a list of objects with
      a ``name`` inside one is labelled ``name``.

    Keys ending in ``_total`` are counters, ``_ms`` and ``_s`` become
    ``_seconds``; strings are skipped. Objects with more than 64 keys are
    maps keyed by data, not records, and are skipped too, so that no tenant
    or key name can become a metric.
    """
    out: list[StatusSample] = []
    for key, value in status.items():
        if key in _OWN_STATUS_KEYS:
            continue
        part = _metric_part(key)
        if not part:
            continue
        if key == "regions" and isinstance(value, list):
            for region in value[:_MAX_LIST]:
                if isinstance(region, dict) and isinstance(region.get("name"), str):
                    _region_samples(region, prefix, out)
            continue
        number = _number(value)
        if number is not None:
            name, kind, number = _typed(f"{prefix}_{part}", number)
            out.append(StatusSample(name, kind, f"/status {key}", (), number))
        elif isinstance(value, dict):
            _walk(value, f"{prefix}_{part}", key, (), out, 1)
    return out


def _region_samples(region: dict[str, Any], prefix: str, out: list[StatusSample]) -> None:
    labels = (("region", str(region["name"])),)
    state = region.get("state")
    if isinstance(state, str):
        out.append(
            StatusSample(
                f"{prefix}_region_up",
                "gauge",
                "1 when the region is up",
                labels,
                float(state == "up"),
            )
        )
        out.append(
            StatusSample(
                f"{prefix}_region_state",
                "gauge",
                "The region's state, as a label",
                (*labels, ("state", state[:32])),
                1.0,
            )
        )
    fields = {k: v for k, v in region.items() if k not in ("name", "state")}
    _walk(fields, f"{prefix}_region", "regions[]", labels, out, 1)


def _walk(
    record: dict[str, Any],
    name: str,
    path: str,
    labels: tuple[tuple[str, str], ...],
    out: list[StatusSample],
    depth: int,
) -> None:
    if len(record) > _MAX_RECORD_KEYS or depth > _MAX_DEPTH:
        return
    for key, value in record.items():
        if not isinstance(key, str):
            continue
        part = _metric_part(key)
        if not part:
            continue
        child, where = f"{name}_{part}", f"{path}.{key}"
        number = _number(value)
        if number is not None:
            metric, kind, number = _typed(child, number)
            out.append(StatusSample(metric, kind, f"/status {where}", labels, number))
        elif isinstance(value, dict):
            _walk(value, child, where, labels, out, depth + 1)
        elif isinstance(value, list) and not labels:
            for item in value[:_MAX_LIST]:
                if isinstance(item, dict) and isinstance(item.get("name"), str):
                    fields = {k: v for k, v in item.items() if k != "name"}
                    item_labels = (("name", str(item["name"])[:64]),)
                    _walk(fields, child, f"{where}[]", item_labels, out, depth + 1)


def _families(samples: Iterable[StatusSample]) -> list[Metric]:
    """Group samples into metric families; a name seen with other label names is dropped."""
    families: dict[str, tuple[Metric, tuple[str, ...]]] = {}
    for s in samples:
        label_names = tuple(k for k, _ in s.labels)
        entry = families.get(s.name)
        if entry is None:
            family: Metric
            if s.kind == "counter":
                family = CounterMetricFamily(s.name, s.doc, labels=label_names)
            else:
                family = GaugeMetricFamily(s.name, s.doc, labels=label_names)
            entry = families[s.name] = (family, label_names)
        family, expected = entry
        if label_names != expected or (s.kind == "counter") != (family.type == "counter"):
            continue
        family.add_metric([v for _, v in s.labels], s.value)  # type: ignore[attr-defined]
    return [family for family, _ in families.values()]


class StatusCollector:
    """A prometheus-client collector reading the proxy's ``/status`` at scrape time."""

    def __init__(self, status: Callable[[], dict[str, Any]], pop: str, version: str) -> None:
        self._status = status
        self._info = {"pop": pop, "version": version}

    def describe(self) -> list[Metric]:
        # Names depend on what the components report; nothing to reserve up front.
        return []

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("edgeproxy", "This edgeproxy instance.")
        info.add_metric([], self._info)
        yield info
        try:
            status = self._status()
        except Exception:  # noqa: BLE001 - a broken section must not break the scrape
            logger.exception("/status failed while collecting metrics")
            return
        yield from _families(flatten_status(status))


class _MultiprocessMirror:
    """Copies this worker's ``/status`` numbers into prometheus-client's shared files.

    Counters advance by the difference since the last copy (a value that went
    down means the component restarted: it counts from zero again). Gauges
    are summed over the live workers, except readiness-like ones (the
    minimum) and latencies and ratios (the maximum).
    """

    def __init__(self) -> None:
        self._metrics: dict[str, Counter | Gauge] = {}
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def sync(self, samples: Iterable[StatusSample]) -> None:
        for s in samples:
            metric = self._metric(s)
            if metric is None:
                continue
            child = metric.labels(*[v for _, v in s.labels]) if s.labels else metric
            if isinstance(child, Counter):
                key = (s.name, s.labels)
                last = self._last.get(key, 0.0)
                delta = s.value - last if s.value >= last else s.value
                if delta > 0:
                    child.inc(delta)
                self._last[key] = s.value
            else:
                child.set(s.value)

    def _metric(self, s: StatusSample) -> Counter | Gauge | None:
        metric = self._metrics.get(s.name)
        label_names = tuple(k for k, _ in s.labels)
        if metric is None:
            metric = _shared_status_metric(s, label_names)
            self._metrics[s.name] = metric
        if tuple(metric._labelnames) != label_names:
            return None
        return metric


# Gauges that are settings, latencies or ratios rather than amounts: over
# several workers the largest value says more than their sum.
_NOT_ADDITIVE = ("ewma", "_seconds", "ratio", "max_", "weight", "priority", "share", "limit")

# Multiprocess mode keeps one metric object per name and process: two objects
# with one name would overwrite each other's values in the shared files.
_SHARED: dict[str, Any] = {}


def _shared_status_metric(s: StatusSample, label_names: tuple[str, ...]) -> Counter | Gauge:
    existing = _SHARED.get("status:" + s.name)
    if existing is not None:
        assert isinstance(existing, Counter | Gauge)
        return existing
    metric: Counter | Gauge
    if s.kind == "counter":
        metric = Counter(s.name, s.doc, label_names, registry=None)
    else:
        mode = "livesum"  # in flight, queued, connections: they add up over workers
        if s.name.endswith(("_up", "_ready", "_warm", "_available", "_enabled")):
            mode = "livemin"
        elif any(part in s.name for part in _NOT_ADDITIVE):
            mode = "livemax"
        metric = Gauge(s.name, s.doc, label_names, registry=None, multiprocess_mode=mode)  # type: ignore[arg-type]
    _SHARED["status:" + s.name] = metric
    return metric


# -- per-request series --------------------------------------------------------------------

_HISTOGRAMS = (
    (
        "edgeproxy_request_duration_seconds",
        "From the request's arrival to the end of its response (the last byte of a stream).",
    ),
    (
        "edgeproxy_upstream_ttfb_seconds",
        "From sending the answering attempt to a region to its response headers.",
    ),
    (
        "edgeproxy_client_ttfb_seconds",
        "From the request's arrival to the response headers going out to the client "
        "(a local answer's headers leave with its body).",
    ),
    (
        "edgeproxy_proxy_overhead_seconds",
        "The proxy's own share of the client TTFB: client TTFB minus upstream TTFB "
        "(admission queueing, plugins and failed attempts included).",
    ),
)
_BYTES_DOC = "Response body bytes sent to clients."
_ATTEMPTS_DOC = "Requests sent to regions, retries and hedges included."
_DEGRADED_DOC = "Answers given in degraded mode (stale cache, local model, plugin), by reason."
_TOKENS_DOC = "LLM tokens of answered requests, from the regions' usage reports."
_RATE_DOC = "Completion tokens per second of each streamed (SSE) answer, first byte to last."


@dataclass(slots=True)
class _Observation:
    """What one finished request adds to the per-request series (seconds, counts)."""

    duration: float
    client_ttfb: float | None
    upstream_ttfb: float | None
    overhead: float | None
    bytes_out: int
    attempts: int
    prompt_tokens: int
    completion_tokens: int
    token_rate: float | None
    reason: str | None


class _Cell:
    """The series of one label combination: bucket counts (not cumulative) and sums."""

    __slots__ = ("counts", "sums", "bytes", "attempts", "prompt", "completion", "rate", "rate_sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [[0] * (buckets + 1) for _ in _HISTOGRAMS]
        self.sums = [0.0] * len(_HISTOGRAMS)
        self.bytes = 0
        self.attempts = 0
        self.prompt = 0
        self.completion = 0
        self.rate = [0] * (len(TOKEN_RATE_BUCKETS) + 1)
        self.rate_sum = 0.0


class _LocalSeries:
    """The per-request series of one proxy in plain lists, turned into metrics at scrape time.

    prometheus-client's Histogram takes a lock and walks its buckets on every
    observation; with four histograms and a few counters per request that
    was the larger part of the cost of metrics. The event loop is the only
    writer here and scrapes run on it too, so plain integers do, at a tenth
    of the cost.
    """

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = list(buckets)
        self.cells: dict[tuple[str, ...], _Cell] = {}
        self.degraded: dict[tuple[str, str], int] = {}

    def record(self, key: tuple[str, ...], o: _Observation) -> None:
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = _Cell(len(self.bounds))
        bounds, counts, sums = self.bounds, cell.counts, cell.sums
        for i, value in enumerate((o.duration, o.upstream_ttfb, o.client_ttfb, o.overhead)):
            if value is not None:
                counts[i][bisect_left(bounds, value)] += 1
                sums[i] += value
        cell.bytes += o.bytes_out
        cell.attempts += o.attempts
        cell.prompt += o.prompt_tokens
        cell.completion += o.completion_tokens
        if o.token_rate is not None:
            cell.rate[bisect_left(TOKEN_RATE_BUCKETS, o.token_rate)] += 1
            cell.rate_sum += o.token_rate
        if o.reason is not None:
            reason_key = (key[0], o.reason)
            self.degraded[reason_key] = self.degraded.get(reason_key, 0) + 1

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        cells = list(self.cells.items())
        les = [_le(b) for b in self.bounds] + ["+Inf"]
        for i, (name, doc) in enumerate(_HISTOGRAMS):
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            for key, cell in cells:
                if any(cell.counts[i]):
                    family.add_metric(list(key), _cumulative(les, cell.counts[i]), cell.sums[i])
            yield family
        sums: dict[str, dict[tuple[str, ...], float]] = {
            "bytes": {}, "attempts": {}, "tokens": {}
        }  # fmt: skip
        rates: dict[tuple[str, str], tuple[list[int], float]] = {}
        for (route, region, *_), cell in cells:
            _add(sums["bytes"], (route, region), cell.bytes)
            _add(sums["attempts"], (route,), cell.attempts)
            _add(sums["tokens"], (route, region, "prompt"), cell.prompt)
            _add(sums["tokens"], (route, region, "completion"), cell.completion)
            if any(cell.rate):
                counts, total = rates.get((route, region), ([0] * len(cell.rate), 0.0))
                rates[(route, region)] = (
                    [a + b for a, b in zip(counts, cell.rate, strict=True)],
                    total + cell.rate_sum,
                )
        for name, doc, labels, values in (
            ("edgeproxy_response_bytes", _BYTES_DOC, ("route", "region"), sums["bytes"]),
            ("edgeproxy_upstream_attempts", _ATTEMPTS_DOC, ("route",), sums["attempts"]),
            ("edgeproxy_tokens", _TOKENS_DOC, ("route", "region", "kind"), sums["tokens"]),
            ("edgeproxy_degraded_responses", _DEGRADED_DOC, ("route", "reason"), self.degraded),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            for label_values, value in values.items():
                if value:
                    counter.add_metric(list(label_values), value)
            yield counter
        rate_les = [_le(b) for b in TOKEN_RATE_BUCKETS] + ["+Inf"]
        family = HistogramMetricFamily("edgeproxy_stream_tokens_per_second", _RATE_DOC,
                                       labels=("route", "region"))  # fmt: skip
        for label_values, (counts, total) in rates.items():
            family.add_metric(list(label_values), _cumulative(rate_les, counts), total)
        yield family


def _le(bound: float) -> str:
    """A bucket bound as prometheus-client writes it (``0.001``, ``120.0``)."""
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]


def _add(into: dict[tuple[str, ...], float], key: tuple[str, ...], value: float) -> None:
    into[key] = into.get(key, 0) + value


def _cumulative(les: list[str], counts: list[int]) -> list[tuple[str, float]]:
    out = []
    running = 0
    for le, count in zip(les, counts, strict=True):
        running += count
        out.append((le, float(running)))
    return out


class _SharedSeries:
    """The same series as prometheus-client metrics, for multiprocess mode's shared files."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.histograms = [
            Histogram(name, doc, LABELS, registry=None, buckets=buckets)
            for name, doc in _HISTOGRAMS
        ]
        self.bytes = Counter("edgeproxy_response_bytes", _BYTES_DOC, ("route", "region"),
                             registry=None)  # fmt: skip
        self.attempts = Counter("edgeproxy_upstream_attempts", _ATTEMPTS_DOC, ("route",),
                                registry=None)  # fmt: skip
        self.degraded = Counter("edgeproxy_degraded_responses", _DEGRADED_DOC,
                                ("route", "reason"), registry=None)  # fmt: skip
        self.tokens = Counter("edgeproxy_tokens", _TOKENS_DOC, ("route", "region", "kind"),
                              registry=None)  # fmt: skip
        self.token_rate = Histogram("edgeproxy_stream_tokens_per_second", _RATE_DOC,
                                    ("route", "region"), registry=None,
                                    buckets=TOKEN_RATE_BUCKETS)  # fmt: skip

    def record(self, key: tuple[str, ...], o: _Observation) -> None:
        route, region = key[0], key[1]
        values = (o.duration, o.upstream_ttfb, o.client_ttfb, o.overhead)
        for histogram, value in zip(self.histograms, values, strict=True):
            if value is not None:
                histogram.labels(*key).observe(value)
        if o.bytes_out:
            self.bytes.labels(route, region).inc(o.bytes_out)
        if o.attempts:
            self.attempts.labels(route).inc(o.attempts)
        if o.prompt_tokens:
            self.tokens.labels(route, region, "prompt").inc(o.prompt_tokens)
        if o.completion_tokens:
            self.tokens.labels(route, region, "completion").inc(o.completion_tokens)
        if o.token_rate is not None:
            self.token_rate.labels(route, region).observe(o.token_rate)
        if o.reason is not None:
            self.degraded.labels(route, o.reason).inc()


def _shared_series(buckets: Sequence[float]) -> _SharedSeries:
    shared = _SHARED.get("request")
    if shared is None:
        shared = _SHARED["request"] = _SharedSeries(buckets)
    assert isinstance(shared, _SharedSeries)
    return shared


class Metrics:
    """The built-in metrics plugin of one proxy, and its ``/metrics`` endpoint.

    Registered like any plugin; it observes each finished request on
    ``edgeproxy_response_complete``. Each proxy has its own
    :class:`~prometheus_client.CollectorRegistry` (``metrics.registry``), so
    several proxies in one process keep apart, unless multiprocess mode
    shares them between processes.
    """

    def __init__(self, config: Config, status: Callable[[], dict[str, Any]]) -> None:

        self.config = config.metrics
        self._status = status
        self.window = LatencyWindow(self.config.window, self.config.window_step)
        self.multiprocess_dir = multiprocess_dir()
        self.registry = CollectorRegistry()
        self.collector = StatusCollector(status, config.pop.name, __version__)
        self._series: _LocalSeries | _SharedSeries
        self._mirror: _MultiprocessMirror | None = None
        if self.multiprocess_dir is None:
            self._series = _LocalSeries(self.config.buckets)
            self.registry.register(self._series)
            self.registry.register(self.collector)
        else:
            self._series = _shared_series(self.config.buckets)
            self._mirror = _MultiprocessMirror()
        route_names = ["default", *(r.name for r in config.routes)]
        self._route = _Labels(route_names)
        self._region = _Labels(["none", *(r.name for r in config.regions)])
        self._cache = _Labels(["none", *CACHE_OUTCOMES])
        self._reason = _Labels([])
        self._sync_task: asyncio.Task[None] | None = None

    # -- observing --------------------------------------------------------------------

    @hookimpl
    def edgeproxy_response_complete(self, ctx: RequestContext) -> None:
        self.observe(ctx)

    def observe(self, ctx: RequestContext) -> None:
        """Record one finished request in the histograms, counters and recent window."""
        finished = ctx.finished_at if ctx.finished_at is not None else time.monotonic()
        duration = max(0.0, finished - ctx.started)
        route = self._route(ctx.route.name)
        region = self._region(ctx.region or "none")
        cache = self._cache((ctx.cache or "none").lower())
        status_class = _STATUS_CLASS.get(ctx.status // 100, "other")
        # Headers of a local answer leave with its body: its TTFB is its duration.
        ttfb: float | None = None
        if ctx.status:
            first = ctx.first_byte_at if ctx.first_byte_at is not None else finished
            ttfb = max(0.0, first - ctx.started)
        upstream = ctx.upstream_ttfb
        overhead = None
        if upstream is not None and ttfb is not None:
            overhead = max(0.0, ttfb - upstream)
        prompt = completion = 0
        rate = None
        usage = ctx.usage
        if usage:
            prompt = _count(usage.get("prompt_tokens"))
            completion = _count(usage.get("completion_tokens"))
            if completion and ctx.response_is_sse and ctx.first_byte_at is not None:
                streamed = finished - ctx.first_byte_at
                if streamed > 0:
                    rate = completion / streamed
        observation = _Observation(
            duration,
            ttfb,
            upstream,
            overhead,
            ctx.bytes_out,
            ctx.attempts,
            prompt,
            completion,
            rate,
            self._reason(ctx.degraded) if ctx.degraded else None,
        )
        key = (route, region, cache, "yes" if ctx.degraded else "no", status_class)
        self._series.record(key, observation)
        self.window.observe(
            duration,
            ttfb,
            region=region,
            cache=cache,
            error=ctx.status >= 500,
            tokens=completion,
        )

    def recent(self) -> dict[str, Any]:
        """Traffic and latency percentiles over the last ``metrics.window`` seconds."""
        return self.window.snapshot()

    # -- lifespan ---------------------------------------------------------------------

    @hookimpl
    def edgeproxy_startup(self) -> None:
        if self._mirror is not None and self._sync_task is None:
            self._sync_task = asyncio.get_running_loop().create_task(
                self._sync_loop(), name="edgeproxy-metrics-sync"
            )

    @hookimpl
    async def edgeproxy_shutdown(self) -> None:
        task, self._sync_task = self._sync_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self._sync()
            # The worker is leaving: its live gauges leave with it (counters and
            # histograms stay, as Prometheus expects of counters).
            from prometheus_client.multiprocess import mark_process_dead

            await asyncio.to_thread(mark_process_dead, os.getpid(), self.multiprocess_dir)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.multiprocess_sync_interval)
            self._sync()

    def _sync(self) -> None:
        if self._mirror is None:
            return
        try:
            self._mirror.sync(flatten_status(self._status()))
        except Exception:  # noqa: BLE001 - metrics must never take the worker down
            logger.exception("copying /status into the multiprocess metrics failed")

    # -- /metrics ----------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.Response:
        """``GET /metrics``: the Prometheus text format, or OpenMetrics when asked for."""
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        if self._mirror is None:
            body = encoder(self.registry)
        else:
            # Fresh numbers from this worker, then the files of all of them,
            # read off the event loop.
            self._sync()
            body = await asyncio.to_thread(self._render_multiprocess, encoder)
        response = web.Response(body=body, headers={"Content-Type": content_type})
        response.enable_compression()
        return response

    def _render_multiprocess(self, encoder: Callable[[Any], bytes]) -> bytes:
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        registry.register(_InfoOnly(self.collector))
        return encoder(registry)


class _InfoOnly:
    """The ``edgeproxy_info`` series alone (the rest comes from the shared files)."""

    def __init__(self, collector: StatusCollector) -> None:
        self._collector = collector

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("edgeproxy", "This edgeproxy instance.")
        info.add_metric([], self._collector._info)
        yield info


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
