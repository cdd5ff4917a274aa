"""The per-request Prometheus series: their definitions, and their in-process collector.

Histograms and counters with bounded labels (see ``LABELS``), observed by
:class:`~edgeproxy._observability.metrics.Metrics` once per finished request.
In one process they are kept by :class:`LocalSeries`; in multiprocess mode the
same series are prometheus-client metrics writing to the shared files
(:class:`~edgeproxy._observability.multiprocess.SharedSeries`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

__all__ = [
    "ATTEMPTS_DOC",
    "BYTES_DOC",
    "DEGRADED_DOC",
    "HISTOGRAMS",
    "LABELS",
    "RATE_DOC",
    "TOKENS_DOC",
    "TOKEN_RATE_BUCKETS",
    "LocalSeries",
    "Observation",
]

# The per-request labels. Each one takes few values: see _Labels.
LABELS = ("route", "region", "cache", "degraded", "status_class")

# Tokens per second of one streamed answer: a slow local model to a fast region.
TOKEN_RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)

HISTOGRAMS = (
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
BYTES_DOC = "Response body bytes sent to clients."
ATTEMPTS_DOC = "Requests sent to regions, retries and hedges included."
DEGRADED_DOC = "Answers given in degraded mode (stale cache, local model, plugin), by reason."
TOKENS_DOC = (
    "LLM tokens of answered requests, from the regions' usage reports: kind prompt, completion, "
    "and of the prompt's, cached_prompt (read from the prompt cache) and cache_write."
)
RATE_DOC = "Completion tokens per second of each streamed (SSE) answer, first byte to last."


@dataclass(slots=True)
class Observation:
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
    cached_tokens: int = 0
    """Of the prompt's, those read from the region's prompt cache."""
    cache_write_tokens: int = 0
    """Of the prompt's, those written to it (Anthropic counts them apart)."""


class _Cell:
    """The series of one label combination: bucket counts (not cumulative) and sums."""

    __slots__ = (
        "counts",
        "sums",
        "bytes",
        "attempts",
        "prompt",
        "completion",
        "cached",
        "cache_write",
        "rate",
        "rate_sum",
    )

    def __init__(self, buckets: int) -> None:
        self.counts = [[0] * (buckets + 1) for _ in HISTOGRAMS]
        self.sums = [0.0] * len(HISTOGRAMS)
        self.bytes = 0
        self.attempts = 0
        self.prompt = 0
        self.completion = 0
        self.cached = 0
        self.cache_write = 0
        self.rate = [0] * (len(TOKEN_RATE_BUCKETS) + 1)
        self.rate_sum = 0.0


class LocalSeries:
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

    def record(self, key: tuple[str, ...], o: Observation) -> None:
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = _Cell(len(self.bounds))
        bounds, counts, sums = self.bounds, cell.counts, cell.sums
        # The four histograms (HISTOGRAMS' order), unrolled: this runs once a request.
        duration = o.duration
        counts[0][bisect_left(bounds, duration)] += 1
        sums[0] += duration
        value = o.upstream_ttfb
        if value is not None:
            counts[1][bisect_left(bounds, value)] += 1
            sums[1] += value
        value = o.client_ttfb
        if value is not None:
            counts[2][bisect_left(bounds, value)] += 1
            sums[2] += value
        value = o.overhead
        if value is not None:
            counts[3][bisect_left(bounds, value)] += 1
            sums[3] += value
        cell.bytes += o.bytes_out
        cell.attempts += o.attempts
        cell.prompt += o.prompt_tokens
        cell.completion += o.completion_tokens
        cell.cached += o.cached_tokens
        cell.cache_write += o.cache_write_tokens
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
        for i, (name, doc) in enumerate(HISTOGRAMS):
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
            if cell.cached or cell.cache_write:
                # Of the prompt's: read from the region's prompt cache, and written to it.
                _add(sums["tokens"], (route, region, "cached_prompt"), cell.cached)
                _add(sums["tokens"], (route, region, "cache_write"), cell.cache_write)
            if any(cell.rate):
                counts, total = rates.get((route, region), ([0] * len(cell.rate), 0.0))
                rates[(route, region)] = (
                    [a + b for a, b in zip(counts, cell.rate, strict=True)],
                    total + cell.rate_sum,
                )
        for name, doc, labels, values in (
            ("edgeproxy_response_bytes", BYTES_DOC, ("route", "region"), sums["bytes"]),
            ("edgeproxy_upstream_attempts", ATTEMPTS_DOC, ("route",), sums["attempts"]),
            ("edgeproxy_tokens", TOKENS_DOC, ("route", "region", "kind"), sums["tokens"]),
            ("edgeproxy_degraded_responses", DEGRADED_DOC, ("route", "reason"), self.degraded),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            for label_values, value in values.items():
                if value:
                    counter.add_metric(list(label_values), value)
            yield counter
        rate_les = [_le(b) for b in TOKEN_RATE_BUCKETS] + ["+Inf"]
        family = HistogramMetricFamily("edgeproxy_stream_tokens_per_second", RATE_DOC,
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
