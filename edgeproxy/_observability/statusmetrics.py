"""Component counters and gauges, pulled at scrape time from the proxy's ``/status`` JSON.

Every component (regions, pools, routing, admission, cache, fallback) already
keeps its own counters for ``/status``; :func:`flatten_status` turns every
number it finds there into a Prometheus sample and :class:`StatusCollector`
serves them, so a component that adds a section gets metrics without touching
this module, and a section that does not exist yet is simply absent.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)

__all__ = [
    "InfoOnly",
    "StatusCollector",
    "StatusSample",
    "flatten_status",
    "gauge_combination",
    "websocket_families",
]

logger = logging.getLogger("edgeproxy.metrics")

# /status keys the metrics plugin writes itself (no need to read them back), or that have
# series of their own below (their histograms are no flat numbers).
_OWN_STATUS_KEYS = frozenset({"recent", "websocket"})


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


# Gauges that are settings, latencies or ratios rather than amounts: over several
# processes the largest value says more than their sum.
_NOT_ADDITIVE = ("ewma", "_seconds", "ratio", "max_", "weight", "priority", "share", "limit")
_READINESS = ("_up", "_ready", "_warm", "_available", "_enabled")


def gauge_combination(name: str) -> str:
    """How a gauge of several processes combines: ``"sum"`` for amounts (in flight,
    queued, connections), ``"min"`` for readiness, ``"max"`` for settings, latencies
    and ratios. The supervisor's sum and prometheus-client's multiprocess mode agree."""
    if name.endswith(_READINESS):
        return "min"
    if any(part in name for part in _NOT_ADDITIVE):
        return "max"
    return "sum"


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
        cache = status.get("cache")
        if isinstance(cache, dict) and isinstance(cache.get("semantic"), dict):
            yield from semantic_families(cache["semantic"])
        if isinstance(status.get("websocket"), dict):
            yield from websocket_families(status["websocket"])


def _histogram(name: str, doc: str, section: dict[str, Any], key: str) -> Iterator[Metric]:
    buckets = section.get(f"{key}_histogram")
    if isinstance(buckets, list):
        histogram = HistogramMetricFamily(name, doc)
        histogram.add_metric(
            [],
            [(str(le), float(count)) for le, count in buckets],
            float(section.get(f"{key}_seconds_sum", 0.0)),
        )
        yield histogram


def websocket_families(ws: dict[str, Any]) -> Iterator[Metric]:
    """The WebSocket sessions' series, from ``/status``'s ``websocket``: sessions open and
    their length, refusals by reason, messages and bytes each way, and for the Realtime
    API the responses and the time from a ``response.create`` to its first delta."""
    name = "edgeproxy_websocket"
    opened = GaugeMetricFamily(f"{name}_sessions_open", "WebSocket sessions open now.")
    opened.add_metric([], float(ws.get("open", 0)))
    yield opened
    for key, metric, doc in (
        ("opened_total", "sessions", "WebSocket sessions accepted."),
        ("failovers_total", "failovers", "Session handshakes a region failed, tried elsewhere."),
        ("responses_total", "realtime_responses", "Realtime responses done (response.done)."),
    ):
        family = CounterMetricFamily(f"{name}_{metric}", doc)
        family.add_metric([], float(ws.get(key, 0)))
        yield family
    refused = CounterMetricFamily(
        f"{name}_refused", "Session handshakes refused, by reason.", labels=["reason"]
    )
    reasons = ws.get("refused")
    for reason, count in reasons.items() if isinstance(reasons, dict) else ():
        refused.add_metric([str(reason)[:32]], float(count))
    yield refused
    for unit, doc in (("messages", "Messages relayed"), ("bytes", "Bytes of messages relayed")):
        family = CounterMetricFamily(
            f"{name}_{unit}", f"{doc}: in, from clients; out, to clients.", labels=["direction"]
        )
        for direction in ("in", "out"):
            family.add_metric([direction], float(ws.get(f"{unit}_{direction}_total", 0)))
        yield family
    yield from _histogram(
        f"{name}_session_duration_seconds", "Length of the sessions that ended.", ws, "duration"
    )
    yield from _histogram(
        f"{name}_realtime_first_delta_seconds",
        "Seconds from a Realtime response.create to the response's first delta.",
        ws,
        "first_delta",
    )


def semantic_families(semantic: dict[str, Any]) -> Iterator[Metric]:
    """The semantic cache's series, from ``/status``'s ``cache.semantic``: counters by
    outcome, candidates the verifier rejected and lookups skipped by reason, and the
    lookup time as a histogram."""
    name = "edgeproxy_semantic_cache"
    for key, doc in (
        ("lookups", "Semantic lookups (after an exact miss on a route with semantic_cache)."),
        ("hits", "Requests answered from a semantic match."),
        ("misses", "Semantic lookups that found no verified, fresh match."),
        ("shadow_hits", "Would-be semantic hits in shadow mode (not served)."),
    ):
        family = CounterMetricFamily(f"{name}_{key}", doc)
        family.add_metric([], float(semantic.get(key, 0)))
        yield family
    for key, doc in (
        ("rejected", "Candidates above the threshold the verifier rejected, by reason."),
        ("skipped", "Semantic lookups skipped, by reason."),
    ):
        family = CounterMetricFamily(f"{name}_{key}", doc, labels=["reason"])
        counts = semantic.get(key)
        for reason, count in counts.items() if isinstance(counts, dict) else ():
            family.add_metric([str(reason)[:32]], float(count))
        yield family
    entries = GaugeMetricFamily(f"{name}_entries", "Questions in this worker's semantic index.")
    entries.add_metric([], float(semantic.get("entries", 0)))
    yield entries
    yield from _histogram(
        f"{name}_lookup_seconds",
        "Semantic lookup time: embedding, search, verification.",
        semantic,
        "lookup",
    )
    model = semantic.get("model_verifier")
    if isinstance(model, dict):
        yield from _model_verifier_families(name, model)


def _model_verifier_families(name: str, model: dict[str, Any]) -> Iterator[Metric]:
    """The model verifier's verdicts (``yes`` keeps a hit; ``no``, ``unclear``,
    ``error`` and ``timeout`` make it a miss) and the time they took."""
    verdicts = model.get("verdicts")
    counts = verdicts if isinstance(verdicts, dict) else {}
    family = CounterMetricFamily(
        f"{name}_model_verdicts",
        "Verdicts of the semantic cache's model verifier on candidates the rules passed.",
        labels=["verdict"],
    )
    for verdict, count in counts.items():
        family.add_metric([str(verdict)[:16]], float(count))
    yield family
    seconds = SummaryMetricFamily(
        f"{name}_model_verifier_seconds", "Time the model verifier took for a verdict."
    )
    seconds.add_metric([], int(sum(counts.values())), float(model.get("seconds_sum", 0.0)))
    yield seconds


class InfoOnly:
    """The ``edgeproxy_info`` series alone (the rest comes from the shared files)."""

    def __init__(self, collector: StatusCollector) -> None:
        self._collector = collector

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("edgeproxy", "This edgeproxy instance.")
        info.add_metric([], self._collector._info)
        yield info
