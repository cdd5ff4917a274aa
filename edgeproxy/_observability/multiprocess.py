"""prometheus-client's multiprocess mode: one worker process per core, one ``/metrics``.

With ``PROMETHEUS_MULTIPROC_DIR`` set before the process starts, the
per-request series are written to the shared directory (:class:`SharedSeries`),
each worker copies its ``/status`` numbers there too
(:class:`MultiprocessMirror`), and any worker's ``/metrics`` serves the sum
over all of them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client import values as prometheus_values

from edgeproxy._observability.requestmetrics import (
    ATTEMPTS_DOC,
    BYTES_DOC,
    DEGRADED_DOC,
    HISTOGRAMS,
    LABELS,
    RATE_DOC,
    TOKEN_RATE_BUCKETS,
    TOKENS_DOC,
    Observation,
)
from edgeproxy._observability.statusmetrics import StatusSample, gauge_combination

__all__ = ["MultiprocessMirror", "SharedSeries", "multiprocess_dir", "shared_series"]

logger = logging.getLogger("edgeproxy.metrics")

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


class MultiprocessMirror:
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
        mode = "live" + gauge_combination(s.name)  # live: of the processes running
        metric = Gauge(s.name, s.doc, label_names, registry=None, multiprocess_mode=mode)  # type: ignore[arg-type]
    _SHARED["status:" + s.name] = metric
    return metric


class SharedSeries:
    """The same series as prometheus-client metrics, for multiprocess mode's shared files."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.histograms = [
            Histogram(name, doc, LABELS, registry=None, buckets=buckets) for name, doc in HISTOGRAMS
        ]
        self.bytes = Counter("edgeproxy_response_bytes", BYTES_DOC, ("route", "region"),
                             registry=None)  # fmt: skip
        self.attempts = Counter("edgeproxy_upstream_attempts", ATTEMPTS_DOC, ("route",),
                                registry=None)  # fmt: skip
        self.degraded = Counter("edgeproxy_degraded_responses", DEGRADED_DOC,
                                ("route", "reason"), registry=None)  # fmt: skip
        self.tokens = Counter("edgeproxy_tokens", TOKENS_DOC, ("route", "region", "kind"),
                              registry=None)  # fmt: skip
        self.token_rate = Histogram("edgeproxy_stream_tokens_per_second", RATE_DOC,
                                    ("route", "region"), registry=None,
                                    buckets=TOKEN_RATE_BUCKETS)  # fmt: skip

    def record(self, key: tuple[str, ...], o: Observation) -> None:
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


def shared_series(buckets: Sequence[float]) -> SharedSeries:
    shared = _SHARED.get("request")
    if shared is None:
        shared = _SHARED["request"] = SharedSeries(buckets)
    assert isinstance(shared, SharedSeries)
    return shared
