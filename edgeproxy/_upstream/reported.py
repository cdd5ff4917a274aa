"""Load the regions report themselves: the ``endpoint-load-metrics`` header and ``/metrics``.

A model server knows what the proxy cannot see: the requests other clients
sent it, its waiting queue, how full its KV cache is. Per region
(``[[regions]] load_reporting``):

* ``"auto"`` (the default): an ``endpoint-load-metrics`` header (ORCA, as
  vLLM writes it) on a region's answer is read; the proxy does not ask for it;
* ``"header"``: every request to the region asks for it
  (``endpoint-load-metrics-format: TEXT``), and answers are read;
* ``"scrape"``: the region's Prometheus endpoint (``metrics_path``, on
  every endpoint of the region) is polled every ``[routing]
  load_scrape_interval`` through its warm pools, and vLLM's or SGLang's
  queue, running and KV-cache gauges read (headers are read too);
* ``"off"``: nothing is read.

The parsers are :mod:`edgeproxy._protocol.loadmetrics`. A report is folded
into a load score in [0, 1] (:func:`~edgeproxy._protocol.loadmetrics.load_score`:
the mean of the waiting queue over ``[routing] load_queue_saturation`` and the
KV-cache utilisation) and used by the router while it is younger than
``[routing] load_report_max_age``. A malformed header or scrape changes
nothing and is counted (``invalid_total``, in ``/status`` and ``/metrics``);
a scrape that fails (connection, timeout, a non-2xx status) is counted too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from edgeproxy._core.types import Headers
from edgeproxy._protocol.loadmetrics import (
    MAX_SCRAPE_BYTES,
    LoadReport,
    Scrape,
    load_score,
    parse_load_header,
    parse_scrape,
)
from edgeproxy._upstream.endpoint import Endpoint, RegionEndpoints
from edgeproxy._upstream.pool import UpstreamError
from edgeproxy._upstream.regiontasks import RegionTasks

if TYPE_CHECKING:
    from edgeproxy._core.config import RegionConfig

__all__ = [
    "LOAD_FORMAT_HEADER",
    "LOAD_HEADER",
    "LoadScraper",
    "ReportedLoad",
    "ScrapedRegion",
    "merge_reports",
    "without_load_header",
]

logger = logging.getLogger("edgeproxy.regions")

LOAD_HEADER = "endpoint-load-metrics"
LOAD_FORMAT_HEADER = "endpoint-load-metrics-format"
_LOAD_HEADER_LEN = len(LOAD_HEADER)


class ReportedLoad:
    """The last usable load report of one region, when it came, and the reports refused.

    ``score`` is the report's load in [0, 1] (None: the report says nothing
    the score reads); ``stamp`` when it came (monotonic seconds, the caller's).
    """

    __slots__ = (
        "queue_saturation",
        "report",
        "score",
        "stamp",
        "source",
        "reports_total",
        "invalid_total",
        "last_invalid",
        "scrapes_total",
        "scrape_failures_total",
        "skipped_lines_total",
    )

    def __init__(self, queue_saturation: float = 16.0) -> None:
        self.queue_saturation = queue_saturation
        self.report: LoadReport | None = None
        self.score: float | None = None
        self.stamp = 0.0
        self.source: str | None = None
        self.reports_total = 0
        self.invalid_total = 0
        self.last_invalid: str | None = None
        self.scrapes_total = 0
        self.scrape_failures_total = 0
        self.skipped_lines_total = 0

    # -- what came in ----------------------------------------------------------------

    def from_headers(self, headers: Headers, clock: Callable[[], float]) -> None:
        """Read the ``endpoint-load-metrics`` header of an answer, if it has one, dated by
        ``clock`` (the router's: read only when there is a header)."""
        value: str | None = None
        count = 0
        for name, item in headers:
            if len(name) == _LOAD_HEADER_LEN and name.lower() == LOAD_HEADER:
                value = item
                count += 1
        if count == 0:
            return
        if count > 1 or value is None:
            self.refused("header", f"{count} {LOAD_HEADER} headers")
            return
        self.observe_header(value, clock())

    def observe_header(self, value: str, now: float) -> bool:
        """One ``endpoint-load-metrics`` value; False (and counted) when it is unusable."""
        report = parse_load_header(value)
        if report is None:
            self.refused("header", _excerpt(value))
            return False
        self.accept(report, now, "header")
        return True

    def observe_scrape(self, scrape: Scrape, now: float) -> bool:
        """One parsed ``/metrics`` body; False (and counted) when it gave no report."""
        self.scrapes_total += 1
        self.skipped_lines_total += scrape.skipped
        if scrape.report is None:
            reason = "body too large" if scrape.oversized else "no usable load gauge"
            self.refused("scrape", reason)
            return False
        self.accept(scrape.report, now, "scrape")
        return True

    def accept(self, report: LoadReport, now: float, source: str) -> None:
        self.report = report
        self.score = load_score(report, max_waiting_hint=self.queue_saturation)
        self.stamp = now
        self.source = source
        self.reports_total += 1

    def refused(self, source: str, reason: str) -> None:
        self.invalid_total += 1
        self.last_invalid = f"{source}: {reason}"

    # -- what the router reads -----------------------------------------------------------

    def fresh(self, now: float, max_age: float) -> LoadReport | None:
        """The last report, if it is at most ``max_age`` seconds old (and not from the future)."""
        if self.report is None or not 0.0 <= now - self.stamp <= max_age:
            return None
        return self.report

    def fresh_score(self, now: float, max_age: float) -> float | None:
        """The load score of the last report while it is fresh; None otherwise."""
        if self.score is None or not 0.0 <= now - self.stamp <= max_age:
            return None
        return self.score

    def queued(self, now: float, max_age: float) -> float | None:
        """Requests the region says it holds (running + waiting) while fresh; None otherwise."""
        report = self.fresh(now, max_age)
        if report is None:
            return None
        parts = (report.num_requests_running, report.num_requests_waiting)
        if parts == (None, None):
            return None
        return sum(p for p in parts if p is not None)

    def snapshot(self, now: float, max_age: float) -> dict[str, Any]:
        report = self.fresh(now, max_age)
        return {
            "fresh": report is not None,
            "source": self.source,
            "age_s": round(now - self.stamp, 3) if self.report is not None else None,
            "score": None if report is None or self.score is None else round(self.score, 4),
            "kv_cache_utilization": None if report is None else report.kv_cache_utilization,
            "num_requests_waiting": None if report is None else report.num_requests_waiting,
            "num_requests_running": None if report is None else report.num_requests_running,
            "reports_total": self.reports_total,
            "invalid_total": self.invalid_total,
            "last_invalid": self.last_invalid,
            "scrapes_total": self.scrapes_total,
            "scrape_failures_total": self.scrape_failures_total,
            "skipped_lines_total": self.skipped_lines_total,
        }


def without_load_header(headers: Headers) -> Headers:
    """``headers`` without ``endpoint-load-metrics``."""
    return [
        (name, value)
        for name, value in headers
        if len(name) != _LOAD_HEADER_LEN or name.lower() != LOAD_HEADER
    ]


def _excerpt(value: str, limit: int = 80) -> str:
    text = value if len(value) <= limit else value[:limit] + "..."
    return "malformed: " + text.encode("ascii", "backslashreplace").decode("ascii")


def merge_reports(reports: Iterable[LoadReport]) -> LoadReport | None:
    """One region's load from the reports of its endpoints: queues add up, the KV cache
    utilisation is their mean (endpoints alike), ORCA's other fields are dropped."""
    reports = list(reports)
    if not reports:
        return None
    if len(reports) == 1:
        return reports[0]

    def total(field: str) -> float | None:
        values = [getattr(r, field) for r in reports if getattr(r, field) is not None]
        return sum(values) if values else None

    kv = [r.kv_cache_utilization for r in reports if r.kv_cache_utilization is not None]
    merged = LoadReport(
        kv_cache_utilization=min(1.0, sum(kv) / len(kv)) if kv else None,
        num_requests_waiting=total("num_requests_waiting"),
        num_requests_running=total("num_requests_running"),
    )
    return None if merged.empty else merged


class ScrapedRegion(RegionEndpoints, Protocol):
    """A region as the load scraper sees it: a Protocol, as
    :mod:`edgeproxy._upstream.regions` imports this module to give each region its
    :class:`ReportedLoad`."""

    @property
    def config(self) -> RegionConfig: ...

    @property
    def reported(self) -> ReportedLoad: ...


class LoadScraper:
    """Polls the Prometheus endpoint of every region with ``load_reporting = "scrape"``.

    One task per region, started by :meth:`start` and cancelled by
    :meth:`close`; requests go through the endpoints' warm pools, with the
    region's credentials. ``clock`` dates the reports (the router's clock).
    """

    def __init__(
        self,
        regions: Iterable[ScrapedRegion],
        *,
        interval: float,
        timeout: float,
        clock: Callable[[], float],
    ) -> None:
        self.regions = [r for r in regions if r.config.load_reporting == "scrape"]
        self.interval = interval
        self.timeout = timeout
        self.clock = clock
        self._scrapers: RegionTasks[ScrapedRegion] = RegionTasks(
            "load-scrape", self.scrape, interval
        )

    def start(self) -> None:
        self._scrapers.start(self.regions)

    async def close(self) -> None:
        await self._scrapers.close()

    async def scrape(self, region: ScrapedRegion) -> bool:
        """Scrape every endpoint of ``region`` once and apply the result; True when it gave a
        report."""
        bodies = await asyncio.gather(*(self._fetch(region, e) for e in region.endpoints))
        load = region.reported
        now = self.clock()
        fetched = [b for b in bodies if b is not None]
        if not fetched:
            return False
        scrapes = [parse_scrape(body) for body in fetched]
        reports = [s.report for s in scrapes if s.report is not None]
        skipped = sum(s.skipped for s in scrapes)
        merged = merge_reports(reports)
        oversized = any(s.oversized for s in scrapes)
        return load.observe_scrape(Scrape(merged, skipped, oversized and merged is None), now)

    async def _fetch(self, region: ScrapedRegion, endpoint: Endpoint) -> bytes | None:
        """The body of one endpoint's metrics page, or None (counted) when it failed."""
        path = region.config.metrics_path
        headers = [("user-agent", "edgeproxy-load"), *region.credential_headers]
        body = bytearray()
        try:
            async with asyncio.timeout(self.timeout):
                resp = await endpoint.pool.request(
                    "GET", endpoint.base_path + path, headers, None, authority=endpoint.authority
                )
                try:
                    if not 200 <= resp.status < 300:
                        raise _ScrapeFailed(f"status {resp.status}")
                    async for chunk in resp.aiter_bytes():
                        body += chunk
                        if len(body) > MAX_SCRAPE_BYTES:
                            break  # parse_scrape refuses it as oversized
                finally:
                    await resp.aclose()
        except (TimeoutError, UpstreamError, _ScrapeFailed) as exc:
            region.reported.scrape_failures_total += 1
            logger.debug(
                "region %s: scraping %s%s failed: %s", region.name, endpoint.url, path, exc
            )
            return None
        return bytes(body)


class _ScrapeFailed(Exception):
    pass
