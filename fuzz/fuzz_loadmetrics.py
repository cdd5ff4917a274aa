"""Fuzz the load parsers: ORCA ``endpoint-load-metrics`` headers and ``/metrics`` scrapes.

Input: the bytes are a Prometheus ``/metrics`` body for ``parse_scrape``,
and each of their lines (split on ``\\n``), decoded as aiohttp decodes header
values (UTF-8 with surrogates for bad bytes), is an ``endpoint-load-metrics``
value for ``parse_load_header``. So a seed holds a few header values, one
per line, or a scrape body, or both.

Property: neither parser raises. A header gives None or a ``LoadReport``
whose values are finite and in range (utilisations of the KV cache and of
memory in [0, 1], queues and the other ORCA fields >= 0, no -0.0, at most
``MAX_FIELDS`` named metrics with valid names), the same report when parsed
again, and the same report read back from ``format_load_header`` in both
forms when that fits in ``MAX_HEADER_LEN``. A scrape gives a ``Scrape``
whose ``skipped`` is at most the number of lines, whose report (if any)
carries only the queue, running and KV-cache fields in range, the same
for ``bytes``, ``bytearray`` and ``memoryview``. ``load_score`` of any
report is None or in [0, 1], and ``Freshness`` answers a bool.
"""

from __future__ import annotations

import math
import sys

from _harness import check, fuzz

from edgeproxy._protocol.loadmetrics import (
    MAX_FIELDS,
    MAX_HEADER_LEN,
    Freshness,
    LoadReport,
    Scrape,
    format_load_header,
    load_score,
    parse_load_header,
    parse_scrape,
)

_UNIT = ("kv_cache_utilization", "mem_utilization")
_NON_NEGATIVE = (
    "num_requests_waiting",
    "num_requests_running",
    "cpu_utilization",
    "application_utilization",
    "rps_fractional",
    "eps",
)
_FRESHNESS = Freshness(max_age=2.0)


def _check_report(report: LoadReport) -> None:
    check(type(report) is LoadReport, "not a report", report)
    for field in _UNIT + _NON_NEGATIVE:
        value = getattr(report, field)
        if value is None:
            continue
        high = 1.0 if field in _UNIT else math.inf
        check(type(value) is float and 0.0 <= value <= high, "out of range", field, value)
        check(value != math.inf and math.copysign(1.0, value) == 1.0, "inf or -0.0", field, value)
    check(len(report.named) <= MAX_FIELDS, "too many named metrics", len(report.named))
    check(list(report.named) == sorted(report.named), "named not sorted", report.named)
    for name, value in report.named:
        check(type(name) is str and name, "named metric name", name)
        check(type(value) is float and math.isfinite(value), "named metric value", name, value)
    check(not report.empty, "an empty report handed out", report)
    score = load_score(report)
    check(score is None or 0.0 <= score <= 1.0, "load score", score, report)
    tiny = load_score(report, max_waiting_hint=1e-300)  # waiting / hint overflows to inf
    check(tiny is None or 0.0 <= tiny <= 1.0, "load score with a tiny hint", tiny, report)


def _check_header(value: str) -> None:
    report = parse_load_header(value)
    if report is None:
        return
    _check_report(report)
    check(parse_load_header(value) == report, "not deterministic", value)
    for form in ("TEXT", "JSON"):
        text = format_load_header(report, form)
        if len(text) <= MAX_HEADER_LEN:
            check(parse_load_header(text) == report, "does not read back", form, text, report)


def _check_scrape(data: bytes) -> None:
    scrape = parse_scrape(data)
    check(type(scrape) is Scrape, "not a scrape", scrape)
    check(type(scrape.skipped) is int, "skipped", scrape.skipped)
    check(0 <= scrape.skipped <= data.count(b"\n") + 1, "skipped", scrape.skipped)
    check(scrape.oversized is False, "oversized", len(data))
    if scrape.report is not None:
        _check_report(scrape.report)
        report = scrape.report
        others = (report.cpu_utilization, report.mem_utilization, report.application_utilization)
        others += (report.rps_fractional, report.eps)
        check(all(v is None for v in others) and not report.named, "not a gauge", report)
    for buffer in (bytearray(data), memoryview(data)):
        check(parse_scrape(buffer) == scrape, "depends on the buffer type", type(buffer))


def test_one_input(data: bytes) -> None:
    for line in data.split(b"\n"):
        _check_header(line.decode("utf-8", "surrogateescape"))
    _check_scrape(data)
    stamp = float(len(data))
    for now in (stamp, stamp + 2.0, stamp + 3.0, stamp - 1.0, math.nan):
        check(type(_FRESHNESS.usable(stamp, now)) is bool, "freshness", stamp, now)


if __name__ == "__main__":
    fuzz(test_one_input, "edgeproxy._protocol.loadmetrics")
    sys.exit(0)
