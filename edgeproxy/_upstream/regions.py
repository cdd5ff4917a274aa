"""The regional clusters at run time: endpoints with warm pools, latency history, health.

A :class:`Region` is one cluster of the config: one or more endpoints (each
with its own keep-alive pool), where it is, its weight, jurisdiction, tags
and priority tier, and what the proxy has learnt about it: a peak-EWMA of its
latency, a window of recent times to first byte (for hedging), the requests
in flight and those still waiting for their first byte, its
:class:`~edgeproxy._upstream.health.RegionHealth`, the load it reports itself
(:class:`~edgeproxy._upstream.reported.ReportedLoad`), the prompt prefixes
recently routed to it (:class:`~edgeproxy._upstream.prefixindex.PrefixIndex`) and the
models its own ``/v1/models`` says it serves
(:class:`~edgeproxy._upstream.catalog.LearnedModels`).
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from typing import Any

from edgeproxy._core.config import Config, RegionConfig
from edgeproxy._core.config.upstream import HTTP2Mode
from edgeproxy._upstream.apis import ApiBook, SpokenApis
from edgeproxy._upstream.catalog import LearnedModels, ModelLearner
from edgeproxy._upstream.cooldown import Cooldowns
from edgeproxy._upstream.endpoint import Endpoint
from edgeproxy._upstream.factory import make_pool
from edgeproxy._upstream.health import Health, RegionHealth
from edgeproxy._upstream.pool import (
    PoolLimits,
    PoolStats,
    UpstreamError,
    UpstreamPool,
    split_origin,
)
from edgeproxy._upstream.prefixindex import PrefixIndex
from edgeproxy._upstream.reported import LoadScraper, ReportedLoad

__all__ = ["Endpoint", "LatencyWindow", "PeakEwma", "Region", "RegionSet", "websocket_tls"]

# How often an endpoint that could not be reached is tried again in the background.
_REWARM_INTERVAL = 2.0
# Time constant of the recent-traffic counter behind the "share" in /status.
_SHARE_DECAY = 10.0


def _ssl_context(config: Config, alpn: list[str]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=config.upstream.ca_file)
    if not config.upstream.verify_tls:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(alpn)
    return ctx


def websocket_tls(config: Config) -> ssl.SSLContext:
    """The TLS a session's WebSocket to a region takes: HTTP/1.1 (its Upgrade), verified
    as ``[upstream]`` says."""
    return _ssl_context(config, ["http/1.1"])


def _make_pool(
    config: Config, name: str, url: str, http2: HTTP2Mode, limits: PoolLimits
) -> UpstreamPool:
    origin, _ = split_origin(url)
    tls = http1_tls = None
    if origin.startswith("https:"):
        if http2 == "auto":
            # The server picks; the HTTP/1.1 pool it may pick offers nothing else, so that
            # no connection of that pool could turn out to be HTTP/2.
            tls = _ssl_context(config, ["h2", "http/1.1"])
            http1_tls = _ssl_context(config, ["http/1.1"])
        else:
            tls = _ssl_context(config, ["h2"] if http2 else ["http/1.1"])
    return make_pool(
        origin,
        http2=http2,
        limits=limits,
        ssl_context=tls,
        http1_ssl_context=http1_tls,
        label=f"region {name} ({url})",
    )


def _versions(stats: list[PoolStats]) -> str:
    """The versions of a region's endpoints, each once, in their order."""
    return ", ".join(dict.fromkeys(s.http_version for s in stats))


class PeakEwma:
    """Peak-sensitive exponentially weighted moving average of a latency, in seconds.

    A sample above the average replaces it at once, so a region that turns
    slow is avoided after one slow answer; faster samples pull it down with
    weight ``1 - exp(-dt / decay)``, ``dt`` being the time since the previous
    sample, so the average forgets over about ``decay`` seconds.

    A sample is dated ``now`` when given, else by ``clock`` (monotonic seconds).
    """

    __slots__ = ("decay", "value", "stamp", "samples", "clock")

    def __init__(self, decay: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.decay = decay
        self.value = 0.0
        self.stamp = 0.0
        self.samples = 0
        self.clock = clock

    def observe(self, sample: float, now: float | None = None) -> None:
        if now is None:
            now = self.clock()
        if self.samples == 0 or sample > self.value:
            self.value = sample
        else:
            w = math.exp(-max(now - self.stamp, 0.0) / self.decay)
            self.value = self.value * w + sample * (1.0 - w)
        self.stamp = now
        self.samples += 1


class LatencyWindow:
    """The last few hundred times to first byte, for a p95 that follows recent behaviour."""

    __slots__ = ("_values", "_p95", "_fresh")

    def __init__(self, size: int = 256) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self._p95: float | None = None
        self._fresh = 0

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        self._values.append(value)
        self._fresh += 1

    def p95(self) -> float | None:
        if not self._values:
            return None
        # Sorting a few hundred floats per sample would be waste: refresh every 16.
        if self._p95 is None or self._fresh >= 16:
            ordered = sorted(self._values)
            self._p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
            self._fresh = 0
        return self._p95


class Region:
    """One regional cluster: its config, endpoints, latency history and health."""

    def __init__(
        self,
        config: RegionConfig,
        endpoints: list[Endpoint],
        *,
        http2: HTTP2Mode,
        decay: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        prefix_index: PrefixIndex | None = None,
        queue_saturation: float = 16.0,
    ) -> None:
        self.config = config
        self.name = config.name
        self.endpoints = endpoints
        self.http2 = http2
        self.lat = config.lat
        self.lon = config.lon
        self.weight = config.weight
        self.jurisdiction = config.jurisdiction
        self.tags = frozenset(config.tags)
        self.priority = config.priority
        self.in_flight = 0
        # Requests sent and still waiting for their first byte, by attempt id: the
        # oldest one's age is a lower bound of the latency the region has now.
        self.pending_since: dict[int, float] = {}
        self.requests_total = 0
        self.errors_total = 0
        self.retries_total = 0
        self.hedges_total = 0
        self.latency = PeakEwma(decay, clock=clock)
        self.ttfb = LatencyWindow()
        self.health = RegionHealth()
        # Models the region said to hold off (429, 503, 529 with or without Retry-After).
        self.cooldowns = Cooldowns()
        # Load the region reports itself (ORCA header, /metrics), and whether to read it.
        self.reported = ReportedLoad(queue_saturation)
        self.reads_load = config.load_reporting != "off"
        self.asks_load = config.load_reporting == "header"
        # Prompt blocks recently routed here (prefix affinity), and the requests with a
        # prompt key it answered: all of them, and those affinity sent (a prefix matched).
        self.prefix_index = prefix_index or PrefixIndex(32768, 300.0)
        # The models it serves by its own /v1/models, when it lists none in the config.
        self.learned = LearnedModels(config.learns_models)
        # The APIs it speaks (configured or learnt), and its requests translated for it.
        self.apis = SpokenApis(config.apis)
        # The prompt tokens of its answers, and of those the ones read from its prompt cache.
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.affinity_requests_total = 0
        self.affinity_hits_total = 0
        self.affinity_balanced_total = 0
        # Expected round trip from the PoP, set by the router from the geo prior.
        self.geo_rtt = 0.0
        self._recent = 0.0
        self._recent_at = 0.0
        api_key = config.resolved_api_key()
        self.credential_headers: list[tuple[str, str]] = [
            (k.lower(), v) for k, v in config.headers.items()
        ]
        if api_key:
            self.credential_headers.append(("authorization", f"Bearer {api_key}"))

    # -- compatibility with single-endpoint code --------------------------------

    @property
    def pool(self) -> UpstreamPool:
        """The first endpoint's pool."""
        return self.endpoints[0].pool

    @property
    def base_path(self) -> str:
        return self.endpoints[0].base_path

    @property
    def authority(self) -> str:
        return self.endpoints[0].authority

    # -- reachability -------------------------------------------------------------

    @property
    def state(self) -> str:
        """``up`` when an endpoint answers, ``down`` when none does, else ``unknown``."""
        endpoints = self.endpoints
        if len(endpoints) == 1:
            return endpoints[0].state  # asked on every routing decision: no set for one
        states = {e.state for e in endpoints}
        if "up" in states:
            return "up"
        if states == {"down"}:
            return "down"
        return "unknown"

    @property
    def up(self) -> bool:
        return self.state == "up"

    @property
    def last_error(self) -> str | None:
        return next((e.last_error for e in self.endpoints if e.last_error), None)

    def mark_up(self) -> None:
        for endpoint in self.endpoints:
            endpoint.mark_up()

    def mark_down(self, reason: str) -> None:
        for endpoint in self.endpoints:
            endpoint.mark_down(reason)

    def pick_endpoint(self, exclude: Collection[Endpoint] = ()) -> Endpoint:
        """The reachable endpoint with the fewest requests in flight, avoiding ``exclude``."""
        endpoints = self.endpoints
        if len(endpoints) == 1:
            return endpoints[0]
        fresh = [e for e in endpoints if e not in exclude] or endpoints
        usable = [e for e in fresh if e.state != "down"] or fresh
        return min(usable, key=lambda e: e.in_flight)

    # -- load and latency -------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self.pending_since)

    def oldest_pending(self, now: float) -> float:
        """Age of the oldest request still waiting for its first byte (0 when none)."""
        for started in self.pending_since.values():
            return now - started
        return 0.0

    def count_request(self, now: float) -> None:
        self.requests_total += 1
        self._recent = self._recent * math.exp(-(now - self._recent_at) / _SHARE_DECAY) + 1.0
        self._recent_at = now

    def recent_requests(self, now: float) -> float:
        return self._recent * math.exp(-(now - self._recent_at) / _SHARE_DECAY)

    # -- counters: changed only through these methods ------------------------------------

    def attempt_started(self, endpoint: Endpoint, attempt_id: int, kind: str, now: float) -> None:
        """An attempt went to ``endpoint``: in flight and waiting for its first byte.

        ``kind`` is ``first``, ``retry`` (after a failure) or ``hedge`` (a racing copy).
        """
        self.in_flight += 1
        endpoint.in_flight += 1
        self.pending_since[attempt_id] = now
        self.count_request(now)
        if kind == "retry":
            self.retries_total += 1
        elif kind == "hedge":
            self.hedges_total += 1

    def attempt_answered(self, attempt_id: int) -> None:
        """The attempt stopped waiting for its first byte: it came, or the attempt ended."""
        self.pending_since.pop(attempt_id, None)

    def attempt_released(self, endpoint: Endpoint) -> None:
        """The attempt's response was closed (or it never got one): no longer in flight."""
        self.in_flight -= 1
        endpoint.in_flight -= 1

    def record_error(self) -> None:
        """An attempt failed, before its first byte or in the middle of its body."""
        self.errors_total += 1

    def record_overflow(self) -> None:
        """The circuit breaker turned a request away: the region is at its concurrency limit."""
        self.health.overflows_total += 1

    def snapshot(self) -> dict[str, Any]:
        pools = [e.pool.stats() for e in self.endpoints]
        return {
            "name": self.name,
            "url": self.config.url,
            "urls": [e.url for e in self.endpoints],
            "state": self.state,
            "last_error": self.last_error,
            "jurisdiction": self.jurisdiction,
            "tags": sorted(self.tags),
            "priority": self.priority,
            "weight": self.weight,
            "in_flight": self.in_flight,
            "pending": self.pending,
            "requests_total": self.requests_total,
            "errors_total": self.errors_total,
            "retries_total": self.retries_total,
            "hedges_total": self.hedges_total,
            "latency": {
                "ewma_ms": round(self.latency.value * 1000, 3) if self.latency.samples else None,
                "p95_ttfb_ms": _ms(self.ttfb.p95()),
                "samples": self.latency.samples,
                "geo_rtt_ms": round(self.geo_rtt * 1000, 3),
            },
            "prompt_cache": {
                "prompt_tokens_total": self.prompt_tokens_total,
                "cached_tokens_total": self.cached_tokens_total,
                "hit_ratio": round(self.cached_tokens_total / self.prompt_tokens_total, 4)
                if self.prompt_tokens_total
                else None,
            },
            "affinity": {
                "index_size": len(self.prefix_index),
                "requests_total": self.affinity_requests_total,
                "hits_total": self.affinity_hits_total,
                "balanced_total": self.affinity_balanced_total,
                "hit_share": round(self.affinity_hits_total / self.affinity_requests_total, 4)
                if self.affinity_requests_total
                else 0.0,
            },
            "pool": {
                "http2": self.http2,
                "http_version": _versions(pools),
                "connections_open": sum(p.connections_open for p in pools),
                "streams_in_use": sum(p.streams_in_use for p in pools),
                "requests_total": sum(p.requests_total for p in pools),
            },
            "endpoints": [
                {
                    "url": e.url,
                    "state": e.state,
                    "last_error": e.last_error,
                    "in_flight": e.in_flight,
                    "http_version": p.http_version,
                    "http_version_detected": p.detected,
                }
                for e, p in zip(self.endpoints, pools, strict=True)
            ],
        }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


class RegionSet:
    """Every region of the config, opened and closed together, with their health checks.

    ``clock`` (monotonic seconds) is the one the latency history, the health
    policy and :meth:`snapshot` read; the router takes it from here.
    """

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        up = config.upstream
        limits = PoolLimits(
            max_connections=up.max_connections,
            http1_max_connections=up.http1_max_connections,
            keepalive_expiry=up.keepalive_expiry,
            connect_timeout=up.connect_timeout,
            read_timeout=up.read_timeout,
            stream_idle_timeout=up.stream_idle_timeout,
            write_timeout=up.write_timeout,
            pool_timeout=up.pool_timeout,
            warm_connections=up.warm_connections,
            ping_interval=up.ping_interval,
        )
        routing = config.routing
        self.regions: list[Region] = []
        for rc in config.regions:
            http2 = up.http2 if rc.http2 is None else rc.http2
            endpoints = []
            for url in [rc.url, *rc.urls]:
                pool = _make_pool(config, rc.name, url, http2, limits)
                endpoints.append(Endpoint(rc.name, url, pool, rc.host_header))
            self.regions.append(
                Region(
                    rc,
                    endpoints,
                    http2=http2,
                    decay=routing.decay,
                    clock=clock,
                    prefix_index=PrefixIndex(routing.prefix_index_size, routing.prefix_index_ttl),
                    queue_saturation=routing.load_queue_saturation,
                )
            )
        self.by_name = {r.name: r for r in self.regions}
        # Whether any region lacks an API: routing asks this before asking each region.
        self.apis = ApiBook.of(self.regions)
        self.health = Health(config.health, self.regions, clock=clock)
        self.scraper = LoadScraper(
            self.regions,
            interval=routing.load_scrape_interval,
            timeout=routing.load_scrape_timeout,
            clock=lambda: self.clock(),
        )
        # The regions' own model lists, asked at open and refreshed in the background.
        self.learner = ModelLearner(
            self.regions, timeout=routing.models_fetch_timeout, clock=lambda: self.clock()
        )
        self.warmed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    def __iter__(self) -> Iterator[Region]:
        return iter(self.regions)

    def __len__(self) -> int:
        return len(self.regions)

    @property
    def ready(self) -> bool:
        """Pools are warm and at least one region answers."""
        return self.warmed and any(r.up for r in self.regions)

    async def open(self) -> None:
        """Warm every pool concurrently, ask the regions that learn their models for their
        lists, then start the health checks and the background refreshes.

        An unreachable region is a warning, not a failure: it is retried in the
        background until it answers (and serves every model until its list comes).
        """
        await asyncio.gather(*(self._warm(e) for r in self.regions for e in r.endpoints))
        self.warmed = True
        self.health.start()
        self.scraper.start()
        await self.learner.open()

    async def _warm(self, endpoint: Endpoint) -> None:
        try:
            await endpoint.pool.start()
        except UpstreamError as exc:
            endpoint.mark_down(f"warm-up failed: {exc}")
            self.schedule_rewarm(endpoint)
        else:
            endpoint.mark_up()

    def schedule_rewarm(self, endpoint: Endpoint) -> None:
        """Keep trying a down endpoint in the background until it answers."""
        name = f"rewarm:{endpoint.url}"
        if self._closing or any(t.get_name() == name for t in self._tasks):
            return
        task = asyncio.get_running_loop().create_task(self._rewarm_loop(endpoint), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _rewarm_loop(self, endpoint: Endpoint) -> None:
        while not self._closing and endpoint.state == "down":
            await asyncio.sleep(_REWARM_INTERVAL)
            try:
                await endpoint.pool.start()
            except UpstreamError as exc:
                endpoint.last_error = f"still unreachable: {exc}"
            else:
                endpoint.mark_up()

    async def close(self) -> None:
        self._closing = True
        await self.health.close()
        await self.scraper.close()
        await self.learner.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(
            *(e.pool.aclose() for r in self.regions for e in r.endpoints), return_exceptions=True
        )

    def snapshot(self) -> list[dict[str, Any]]:
        now = self.clock()
        recent = {r.name: r.recent_requests(now) for r in self.regions}
        total = sum(recent.values())
        out = []
        for region in self.regions:
            data = region.snapshot()
            data["share"] = round(recent[region.name] / total, 4) if total else 0.0
            data["health"] = self.health.snapshot(region, now)
            data["reported_load"] = region.reported.snapshot(
                now, self.config.routing.load_report_max_age
            )
            data["models"] = region.learned.snapshot(now)
            data["apis"] = region.apis.snapshot()
            data["cooldowns"] = region.cooldowns.snapshot(now)
            out.append(data)
        return out
