"""``/metrics`` of ``serve --workers``: the workers' own series, summed by the supervisor
when it is scraped.

Each worker keeps its series in memory, as a single process does, and serves them on its
private admin socket; nothing is written per request beyond that. The supervisor asks
every worker at scrape time and adds them up:

- counters, histograms and summaries are summed. A worker that left (restarted,
  retired by a reload) keeps counting in the sum with the values it last reported, so a
  counter does not go back when a worker goes;
- gauges are summed over the live workers (in flight, queued, connections), except
  readiness-like ones (the minimum) and settings, latencies and ratios (the maximum);
- ``edgeproxy_info`` is the first worker's.

prometheus-client's multiprocess mode (one file per worker and metric, every
observation written through a memory map) cost about a third more CPU per request; it
remains for processes started with ``PROMETHEUS_MULTIPROC_DIR`` by something else than
the supervisor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from edgeproxy._observability.statusmetrics import gauge_combination

__all__ = ["WorkerMetrics"]

_CUMULATIVE = frozenset({"counter", "histogram", "summary"})

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


class WorkerMetrics:
    """Sums the workers' ``/metrics`` texts; remembers the counts of workers that left."""

    def __init__(self) -> None:
        # Worker -> its cumulative samples as last scraped.
        self._last: dict[Any, dict[SampleKey, float]] = {}
        # What workers that left had counted.
        self._retired: dict[SampleKey, float] = {}

    def merge(self, scraped: Iterable[tuple[Any, str]], alive: Iterable[Any]) -> list[Metric]:
        """The families of all workers' texts (``(worker, text)``), summed; ``alive`` are
        the workers still running (the others' last counts move to the retired sums)."""
        living = set(alive)
        for worker in [w for w in self._last if w not in living]:
            for key, value in self._last.pop(worker).items():
                self._retired[key] = self._retired.get(key, 0.0) + value
        families: dict[str, Metric] = {}
        values: dict[str, dict[SampleKey, list[float]]] = {}
        for worker, text in scraped:
            cumulative: dict[SampleKey, float] = {}
            for family in text_string_to_metric_families(text):
                if family.type == "unknown" and family.name.endswith("_created"):
                    continue
                known = families.get(family.name)
                if known is None:
                    known = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                    values[family.name] = {}
                elif known.type != family.type:
                    continue
                samples = values[family.name]
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    samples.setdefault(key, []).append(sample.value)
                    if family.type in _CUMULATIVE:
                        cumulative[key] = sample.value
            if worker in living:
                self._last[worker] = cumulative
        for key, value in self._retired.items():
            name = _family_of(key[0], families)
            if name is not None:
                values[name].setdefault(key, []).append(value)
        out = []
        for name, family in families.items():
            mode = "sum" if family.type in _CUMULATIVE else gauge_combination(name)
            if name == "edgeproxy_info" or family.type == "info":
                mode = "first"
            for (sample_name, labels), found in values[name].items():
                family.samples.append(Sample(sample_name, dict(labels), _combine(mode, found)))
            out.append(family)
        return out


def _combine(mode: str, found: list[float]) -> float:
    if mode == "min":
        return min(found)
    if mode == "max":
        return max(found)
    if mode == "first":
        return found[0]
    return sum(found)


def _family_of(sample: str, families: dict[str, Metric]) -> str | None:
    """The family a retired sample belongs to, while some live worker reports it."""
    for suffix in ("", "_total", "_bucket", "_count", "_sum"):
        if suffix and sample.endswith(suffix):
            name = sample[: -len(suffix)]
        elif not suffix:
            name = sample
        else:
            continue
        if name in families:
            return name
    return None
