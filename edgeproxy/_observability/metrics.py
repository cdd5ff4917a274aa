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

This module holds the plugin and its ``/metrics`` endpoint; the series
live in :mod:`~edgeproxy._observability.requestmetrics` and
:mod:`~edgeproxy._observability.statusmetrics`, the recent window in
:mod:`~edgeproxy._observability.recent`, multiprocess mode in
:mod:`~edgeproxy._observability.multiprocess`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import choose_encoder

from edgeproxy._core.version import __version__
from edgeproxy._observability.multiprocess import (
    MultiprocessMirror,
    SharedSeries,
    multiprocess_dir,
    shared_series,
)
from edgeproxy._observability.recent import RecentTraffic
from edgeproxy._observability.requestmetrics import LABELS, LocalSeries, Observation
from edgeproxy._observability.statusmetrics import InfoOnly, StatusCollector, flatten_status
from edgeproxy.hookspecs import hookimpl

if TYPE_CHECKING:
    from edgeproxy._core.config import Config
    from edgeproxy._core.context import RequestContext

__all__ = ["LABELS", "Metrics", "RecentTraffic", "StatusCollector", "flatten_status"]

logger = logging.getLogger("edgeproxy.metrics")

# Cache outcomes edgeproxy itself sets (X-Edgeproxy-Cache, lower-cased).
CACHE_OUTCOMES = frozenset({"hit", "miss", "stale", "bypass", "coalesced", "semantic-hit"})

# Values a label may take beyond the known ones before the rest read "other":
# a plugin setting ctx.outcome.region or ctx.outcome.cache to anything must not blow up the
# number of series.
EXTRA_LABEL_VALUES = 16

_STATUS_CLASS = {0: "none", 1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}


# -- bounded label values ----------------------------------------------------------------


class _Labels:
    """Maps a raw value to a label value from a bounded set.

    Known values map to themselves; up to ``extra`` unknown ones are admitted
    as they come, and everything after that reads ``other``.
    """

    __slots__ = ("known", "_extra")

    def __init__(
        self, known: Iterable[str], extra: int = EXTRA_LABEL_VALUES, *, upper: bool = False
    ) -> None:
        # Raw value -> label; with ``upper``, the upper-case spellings map to the
        # lower-case labels too (the cache outcomes as the stages set them).
        self.known = {v: v for v in known}
        if upper:
            self.known.update({v.upper(): v for v in list(self.known)})
        self._extra = extra

    def __call__(self, value: str) -> str:
        label = self.known.get(value)
        if label is not None:
            return label
        if self._extra > 0 and len(value) <= 64 and _LABEL_VALUE_RE.match(value):
            self._extra -= 1
            self.known[value] = value
            return value
        return "other"


_LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")


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
        self.window = RecentTraffic(self.config.window, self.config.window_step)
        self.multiprocess_dir = multiprocess_dir()
        self.registry = CollectorRegistry()
        self.collector = StatusCollector(status, config.pop.name, __version__)
        self._series: LocalSeries | SharedSeries
        self._mirror: MultiprocessMirror | None = None
        if self.multiprocess_dir is None:
            self._series = LocalSeries(self.config.buckets)
            self.registry.register(self._series)
            self.registry.register(self.collector)
        else:
            self._series = shared_series(self.config.buckets)
            self._mirror = MultiprocessMirror()
        route_names = ["default", *(r.name for r in config.routes)]
        self._route = _Labels(route_names)
        self._region = _Labels(["none", *(r.name for r in config.regions)])
        self._cache = _Labels(["none", *CACHE_OUTCOMES], upper=True)
        self._reason = _Labels([])
        # Streams continued after a break (routes' continue_on_break), and those that could
        # not be; in multiprocess mode the value goes to the shared directory.
        self._continuations = Counter(
            "edgeproxy_continuations",
            "Broken streams by continuation outcome (continued, limit, budget, failed, "
            "impossible), from the region that broke to the one that went on.",
            ("route", "from_region", "to_region", "outcome"),
            registry=self.registry if self.multiprocess_dir is None else None,
        )
        self._sync_task: asyncio.Task[None] | None = None

    def add_labels(self, config: Config) -> None:
        """A reload's new routes and regions become known label values, not spares; those
        it removed stay known (their series exist)."""
        for name in (r.name for r in config.routes):
            self._route.known.setdefault(name, name)
        for name in (r.name for r in config.regions):
            self._region.known.setdefault(name, name)

    # -- observing --------------------------------------------------------------------

    @hookimpl
    def edgeproxy_response_complete(self, ctx: RequestContext) -> None:
        self.observe(ctx)

    def observe(self, ctx: RequestContext) -> None:
        """Record one finished request in the histograms, counters and recent window."""
        # Once a request: label lookups go straight to the known values, and max(0, x)
        # is written out.
        out = ctx.outcome
        started = ctx.started
        finished = out.finished_at if out.finished_at is not None else time.monotonic()
        duration = finished - started
        if duration < 0.0:
            duration = 0.0
        name = ctx.route.name
        route = self._route.known.get(name) or self._route(name)
        name = out.region or "none"
        region = self._region.known.get(name) or self._region(name)
        name = out.cache or "none"
        cache = self._cache.known.get(name) or self._cache(name.lower())
        status = out.status
        status_class = _STATUS_CLASS.get(status // 100, "other")
        # Headers of a local answer leave with its body: its TTFB is its duration.
        ttfb: float | None = None
        if status:
            first = out.first_byte_at if out.first_byte_at is not None else finished
            ttfb = first - started if first > started else 0.0
        upstream = out.upstream_ttfb
        overhead = None
        if upstream is not None and ttfb is not None:
            overhead = ttfb - upstream if ttfb > upstream else 0.0
        prompt = completion = cached = written = 0
        rate = None
        usage = out.usage
        if usage:
            prompt = _count(usage.get("prompt_tokens"))
            completion = _count(usage.get("completion_tokens"))
            cached = _count(usage.get("cached_tokens"))
            written = _count(usage.get("cache_write_tokens"))
            if completion and out.response_is_sse and out.first_byte_at is not None:
                streamed = finished - out.first_byte_at
                if streamed > 0:
                    rate = completion / streamed
        degraded = out.degraded
        observation = Observation(
            duration,
            ttfb,
            upstream,
            overhead,
            out.bytes_out,
            out.attempts,
            prompt,
            completion,
            rate,
            self._reason(degraded) if degraded else None,
            cached,
            written,
        )
        key = (route, region, cache, "yes" if degraded else "no", status_class)
        self._series.record(key, observation)
        self.window.observe(duration, ttfb, region, cache, status >= 500, completion)
        for source, target, outcome in out.continuations:
            self._continuations.labels(
                route, self._region(source), self._region(target), outcome
            ).inc()

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
        registry.register(InfoOnly(self.collector))
        return encoder(registry)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
