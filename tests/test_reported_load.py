"""Load reported by the regions: the endpoint-load-metrics header and /metrics scrapes move
traffic away from a loaded region; stale reports are ignored; malformed ones are ignored and
counted; the shared load view's global in-flight count replaces the local one."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from edgeproxy import Config, EdgeProxy
from edgeproxy._protocol.loadmetrics import LoadReport, Scrape
from edgeproxy._routing.ranking import LoadTiers
from edgeproxy._routing.router import Router
from edgeproxy._upstream.regions import RegionSet
from edgeproxy._upstream.reported import ReportedLoad, merge_reports, without_load_header
from edgeproxy.testing import LOAD_METRICS_FAULTS, Behavior, FakeRegion

from .conftest import FakeClock, ProxyFactory, RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
BODY = {"model": "fake-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
VLLM_TEXT = "TEXT named_metrics.kv_cache_usage_perc=0.5, named_metrics.num_requests_waiting=8.0"


# -- the per-region state ----------------------------------------------------------------------


def test_a_report_is_read_scored_and_fresh_for_max_age() -> None:
    load = ReportedLoad(queue_saturation=16.0)
    assert load.fresh(0.0, 5.0) is None and load.fresh_score(0.0, 5.0) is None
    assert load.observe_header(VLLM_TEXT, now=10.0)
    # (8 / 16 + 0.5) / 2
    assert load.fresh_score(12.0, 5.0) == pytest.approx(0.5)
    assert load.queued(12.0, 5.0) == 8.0
    assert load.fresh_score(15.0, 5.0) == pytest.approx(0.5)
    assert load.fresh_score(15.1, 5.0) is None  # stale
    assert load.fresh_score(9.0, 5.0) is None  # from the future: clocks mixed up
    assert load.observe_header(
        'JSON {"named_metrics": {"kv_cache_usage_perc": 1.0, "num_requests_waiting": 40.0}}',
        now=20.0,
    )
    assert load.fresh_score(20.0, 5.0) == pytest.approx(1.0)
    snap = load.snapshot(20.0, 5.0)
    assert snap["fresh"] and snap["source"] == "header" and snap["reports_total"] == 2
    assert snap["kv_cache_utilization"] == 1.0 and snap["invalid_total"] == 0


def test_a_malformed_report_is_counted_and_changes_nothing() -> None:
    load = ReportedLoad()
    assert load.observe_header(VLLM_TEXT, now=1.0)
    for bad in (
        "TEXT named_metrics.kv_cache_usage_perc=nan",
        "TEXT named_metrics.kv_cache_usage_perc=1.5",
        "TEXT named_metrics.num_requests_waiting=-1",
        "JSON {",
        "garbage",
        "x" * 10_000,
    ):
        assert not load.observe_header(bad, now=2.0)
    assert load.invalid_total == 6 and load.reports_total == 1
    assert load.stamp == 1.0 and load.fresh_score(2.0, 5.0) == pytest.approx(0.5)
    assert load.last_invalid is not None and len(load.last_invalid) < 120
    # Two header lines are ambiguous: refused.
    load.from_headers(
        [("Endpoint-Load-Metrics", VLLM_TEXT), ("endpoint-load-metrics", "x")], lambda: 3.0
    )
    assert load.invalid_total == 7
    # None at all: nothing happens.
    load.from_headers([("content-type", "application/json")], lambda: 3.0)
    assert load.invalid_total == 7 and load.reports_total == 1
    load.from_headers([("ENDPOINT-LOAD-METRICS", VLLM_TEXT)], lambda: 3.0)
    assert load.reports_total == 2 and load.stamp == 3.0
    # A scrape with no usable gauge is refused; skipped lines are counted.
    assert not load.observe_scrape(Scrape(None, skipped=3), now=4.0)
    assert not load.observe_scrape(Scrape(None, oversized=True), now=4.0)
    assert load.invalid_total == 9 and load.skipped_lines_total == 3 and load.scrapes_total == 2


def test_the_reports_of_several_endpoints_merge() -> None:
    a = LoadReport(kv_cache_utilization=0.2, num_requests_waiting=3.0)
    b = LoadReport(kv_cache_utilization=0.6, num_requests_waiting=1.0, num_requests_running=4.0)
    merged = merge_reports([a, b])
    assert merged is not None
    assert merged.kv_cache_utilization == pytest.approx(0.4)
    assert merged.num_requests_waiting == 4.0 and merged.num_requests_running == 4.0
    assert merge_reports([a]) is a and merge_reports([]) is None
    assert merge_reports([LoadReport(cpu_utilization=0.5)] * 2) is None


def test_the_load_header_is_taken_off() -> None:
    headers = [("content-type", "x"), ("Endpoint-Load-Metrics", VLLM_TEXT), ("x-a", "b")]
    assert without_load_header(headers) == [("content-type", "x"), ("x-a", "b")]


# -- the score -------------------------------------------------------------------------------


class StubView:
    """A shared load view: a global in-flight count per region, or None (not fresh)."""

    def __init__(self, counts: dict[str, float | None]) -> None:
        self.counts = counts

    def global_in_flight(self, region_name: str) -> float | None:
        return self.counts.get(region_name)


async def test_a_fresh_report_raises_the_score_and_a_stale_one_does_not() -> None:
    clock = FakeClock(100.0)
    config = Config.from_mapping(
        proxy_config(
            [
                {"name": "a", "url": "http://127.0.0.1:9"},
                {"name": "b", "url": "http://127.0.0.1:9"},
            ],
            routing={"load_report_max_age": 2.0, "reported_load_weight": 4.0},
        ),
        environ={},
    )
    regions = RegionSet(config, clock=clock)
    try:
        for region in regions:
            region.endpoints[0].mark_up()
            for i in range(5):
                region.latency.observe(0.05, now=90.0 + i)
        router = Router(config, regions, seed=3, clock=clock)
        a, b = regions.by_name["a"], regions.by_name["b"]
        base = router.score(a, clock())
        assert base == pytest.approx(router.score(b, clock()))
        # Saturated: a long queue and a full KV cache make it look 5 times slower.
        a.reported.observe_header(
            "TEXT named_metrics.kv_cache_usage_perc=1.0, named_metrics.num_requests_waiting=99.0",
            clock(),
        )
        assert router.score(a, clock()) == pytest.approx(5 * base)
        assert all(router.candidates()[0] is b for _ in range(50))
        clock.advance(2.5)  # stale: the proxy's own view again
        assert router.score(a, clock()) == pytest.approx(router.score(b, clock()))
        assert Counter(router.candidates()[0].name for _ in range(400))["a"] > 100
        # The shared load view's global in-flight count replaces the local one while fresh.
        view = StubView({"a": 9.0, "b": None})
        router.load_view = view  # type: ignore[assignment]
        assert router.in_flight(a) == 9.0 and router.in_flight(b) == 0
        assert router.score(a, clock()) == pytest.approx(10 * router.score(b, clock()))
        assert router.load(a, clock()) == 9.0
        view.counts["a"] = None
        assert router.in_flight(a) == 0
    finally:
        await regions.close()


TWINS = [
    {"name": "loaded", "url": "http://127.0.0.1:9"},
    {"name": "twin", "url": "http://127.0.0.1:9"},
]


def _twins(clock: FakeClock, **routing: Any) -> tuple[Router, RegionSet]:
    """Two regions in one place, each with 5 answers of 50 ms, and a router on ``clock``."""
    config = Config.from_mapping(proxy_config(TWINS, routing=routing), environ={})
    regions = RegionSet(config, clock=clock)
    for region in regions:
        region.endpoints[0].mark_up()
        for i in range(5):
            region.latency.observe(0.05, now=clock() - 10.0 + i)
    return Router(config, regions, seed=3, clock=clock), regions


def _queues(regions: RegionSet, now: float, **waiting: float) -> None:
    for name, queue in waiting.items():
        regions.by_name[name].reported.observe_header(
            "TEXT named_metrics.kv_cache_usage_perc=0.7, "
            f"named_metrics.num_requests_waiting={queue}",
            now,
        )


def _noisy_choices(router: Router, regions: RegionSet, clock: FakeClock, n: int) -> Counter[str]:
    """``n`` decisions, 50 ms apart, each after a new answer from both regions: the loaded one
    answers in about 50 ms, its twin up to 5 times slower (a busy machine's stalls), which
    the peak-EWMA takes at once."""
    noise = random.Random(7)
    loaded, twin = regions.by_name["loaded"], regions.by_name["twin"]
    counts: Counter[str] = Counter()
    for _ in range(n):
        clock.advance(0.05)
        loaded.latency.observe(0.05 * noise.uniform(0.9, 1.1))
        twin.latency.observe(0.05 * noise.uniform(1.0, 5.0))
        first = router.route().first
        assert first is not None
        counts[first.name] += 1
    return counts


async def test_a_deep_reported_queue_outweighs_any_latency_noise_until_it_is_stale() -> None:
    clock = FakeClock(100.0)
    router, regions = _twins(clock)  # the defaults: load_report_max_age 5 s
    try:
        # 60 requests wait at one region, none at its twin, and the twin looks up to 5x slower.
        _queues(regions, clock(), loaded=60.0, twin=0.0)
        assert _noisy_choices(router, regions, clock, 40)["loaded"] <= 2
        # Stale (older than load_report_max_age): ignored, and latency routes again.
        clock.advance(5.0)
        assert router.load(regions.by_name["loaded"], clock()) == 0
        assert _noisy_choices(router, regions, clock, 40)["loaded"] >= 36
    finally:
        await regions.close()


async def test_without_load_tiers_latency_noise_outweighs_a_deep_queue() -> None:
    # The weighting alone (rank without reported_load): the queue only makes the region look
    # 4.4 times slower, and the noise on its twin reaches 5 times.
    clock = FakeClock(100.0)
    router, regions = _twins(clock, rank=["latency"])
    try:
        _queues(regions, clock(), loaded=60.0, twin=0.0)
        assert _noisy_choices(router, regions, clock, 40)["loaded"] > 2
    finally:
        await regions.close()


async def test_load_tiers_double_and_ties_are_left_to_latency() -> None:
    clock = FakeClock(100.0)
    router, regions = _twins(clock)
    tiers = LoadTiers(router.config.routing)  # load_tier_queue = 4
    loaded, twin = regions.by_name["loaded"], regions.by_name["twin"]
    try:
        for queue, tier in [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (15, 2), (16, 3), (60, 4)]:
            _queues(regions, clock(), loaded=float(queue))
            assert tiers.tier(loaded, clock()) == tier, queue
        # A short queue sets no tier: its report only raises the latency estimate, and the
        # twin, twice as slow, stays behind.
        twin.latency.observe(0.1)
        _queues(regions, clock(), loaded=3.0, twin=0.0)
        assert {router.route().first for _ in range(20)} == {loaded}
        # Queues of about the same length share a tier: latency decides between them.
        _queues(regions, clock(), loaded=60.0, twin=50.0)
        assert tiers.tier(loaded, clock()) == tiers.tier(twin, clock()) == 4
        assert {router.route().first for _ in range(20)} == {loaded}
        # A report without a queue (KV utilisation only) sets no tier either.
        twin.reported.observe_header("TEXT named_metrics.kv_cache_usage_perc=0.9", clock())
        assert tiers.tier(twin, clock()) == 0
        assert {router.route().first for _ in range(20)} == {twin}
    finally:
        await regions.close()


# -- through the real proxy ------------------------------------------------------------------


@pytest.fixture
async def llm_regions() -> AsyncIterator[Callable[..., Awaitable[FakeRegion]]]:
    started: list[FakeRegion] = []

    async def factory(name: str, **options: Any) -> FakeRegion:
        behavior = options.pop("behavior", Behavior(ttft=0.01, inter_token_delay=0.05))
        region = FakeRegion(
            name=name, behavior=behavior, kv_capacity_blocks=64, kv_block_size=16, **options
        )
        await region.start()
        started.append(region)
        return region

    yield factory
    for region in started:
        await region.stop()


class HeldStream:
    """A long stream sent straight to a fake region: its prompt and completion hold most of
    the region's KV cache until closed."""

    def __init__(self, client: aiohttp.ClientSession, region: FakeRegion) -> None:
        self.client = client
        self.region = region
        self.resp: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> HeldStream:
        body = {
            "model": "fake-llm",
            "messages": [{"role": "user", "content": "word " * 700}],
            "max_tokens": 300,
            "stream": True,
        }
        self.resp = await self.client.post(self.region.url + CHAT, json=body)
        assert self.resp.status == 200
        await self.resp.content.readany()  # generating
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.resp is not None
        self.resp.close()


async def served(proxy: EdgeProxy, n: int, *, stripped: bool = True) -> Counter[str]:
    """Send ``n`` chats; count who served them. ``stripped``: the proxy asked the regions for
    their load, so the client (which did not) never sees the header."""
    counts: Counter[str] = Counter()
    async with aiohttp.ClientSession() as client:
        for _ in range(n):
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
                counts[resp.headers["X-Edgeproxy-Region"]] += 1
                if stripped:
                    assert "endpoint-load-metrics" not in resp.headers
    return counts


def loaded(load: ReportedLoad, above: float) -> Callable[[], bool]:
    return lambda: load.score is not None and load.score > above


async def status(proxy: EdgeProxy) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/status") as resp:
            return {r["name"]: r for r in (await resp.json())["regions"]}


async def test_load_headers_move_traffic_away_from_a_loaded_region(
    llm_regions: Callable[..., Awaitable[FakeRegion]], make_proxy: ProxyFactory
) -> None:
    busy, idle = await llm_regions("busy"), await llm_regions("idle")
    clock = FakeClock.following(time.monotonic)
    proxy = await make_proxy(
        [
            {"name": "busy", "url": busy.url, "load_reporting": "header"},
            {"name": "idle", "url": idle.url, "load_reporting": "header"},
        ],
        # The clock follows real time (the pools and health checks need it), so the report's
        # age is set far beyond what 30 requests take on a loaded machine; the test ages it
        # by advancing the clock. The default weight makes a region whose KV cache is 70%
        # full look 2.4 times slower, which one latency spike on idle (a busy machine's
        # stall) can outweigh; this weight keeps the test about the report alone.
        routing={"load_report_max_age": 120.0, "reported_load_weight": 40.0},
        # A client may read the reports only where its route passes them.
        routes=[{"name": "all", "path": "/", "pass_response_headers": ["endpoint-load-metrics"]}],
        clock=clock,
    )
    async with aiohttp.ClientSession() as client:
        async with HeldStream(client, busy):
            counts = await served(proxy, 30)
            # Its first answer says its KV cache is nearly full: no more after that.
            assert 1 <= counts["busy"] <= 3, counts
            regions = await status(proxy)
            report = regions["busy"]["reported_load"]
            assert report["fresh"] and report["source"] == "header"
            assert report["kv_cache_utilization"] > 0.6 and report["invalid_total"] == 0
            assert regions["idle"]["reported_load"]["kv_cache_utilization"] < 0.1
            # A client asking for the header itself gets it (on a route that passes it).
            async with client.post(
                proxy.url + CHAT, json=BODY, headers={"endpoint-load-metrics-format": "JSON"}
            ) as resp:
                assert resp.headers["endpoint-load-metrics"].startswith("JSON ")
        # The stream is over, but the report says busy until it is stale: then the proxy's
        # own count judges again, both share traffic, and the next reports say idle.
        await eventually(lambda: busy.in_flight == 0)  # the region saw the stream go
        clock.advance(121.0)
        counts = await served(proxy, 40)
        # Both take traffic again; how it splits is the latency estimates' call, which a
        # loaded machine moves, so no share is asserted.
        assert counts["busy"] >= 1 and counts["idle"] >= 1, counts
        # (The request that carries a report holds a block of its own.)
        assert (await status(proxy))["busy"]["reported_load"]["kv_cache_utilization"] < 0.1


async def test_scraped_gauges_move_traffic_away_from_a_loaded_region(
    llm_regions: Callable[..., Awaitable[FakeRegion]], make_proxy: ProxyFactory
) -> None:
    busy = await llm_regions("busy")
    idle = await llm_regions("idle", metrics_flavor="sglang")
    broken = await llm_regions("broken")
    proxy = await make_proxy(
        [
            {"name": "busy", "url": busy.url, "load_reporting": "scrape"},
            {"name": "idle", "url": idle.url, "load_reporting": "scrape"},
            {"name": "broken", "url": broken.url, "load_reporting": "scrape", "metrics_path": "/x"},
        ],
        # The weight keeps one latency spike on idle (a busy machine's stall) from
        # outweighing the report, as in the test above.
        routing={"load_scrape_interval": 0.05, "reported_load_weight": 40.0},
    )
    by_name = proxy.regions.by_name
    async with aiohttp.ClientSession() as client:
        async with HeldStream(client, busy):
            await eventually(loaded(by_name["busy"].reported, 0.3))
            broken.configure(fault="5xx")  # out of the way
            counts = await served(proxy, 20)
            assert counts["busy"] == 0 and counts["idle"] == 20, counts
            broken.configure(fault=None)
        await eventually(lambda: by_name["busy"].reported.score == 0.0)
        counts = await served(proxy, 40)
        # It takes traffic again; how much is the latency estimates' call, which a loaded
        # machine moves.
        assert counts["busy"] >= 1, counts
    regions = await status(proxy)
    assert regions["idle"]["reported_load"]["source"] == "scrape"
    assert regions["idle"]["reported_load"]["fresh"]
    assert regions["busy"]["reported_load"]["scrapes_total"] >= 2
    assert regions["broken"]["reported_load"]["scrape_failures_total"] >= 1
    assert not regions["broken"]["reported_load"]["fresh"]
    assert busy.requests_by_path.get("/metrics", 0) >= 2


@pytest.mark.parametrize("fault", sorted(LOAD_METRICS_FAULTS - {"many"}))
async def test_malformed_load_headers_are_ignored_and_counted(
    fault: str, llm_regions: Callable[..., Awaitable[FakeRegion]], make_proxy: ProxyFactory
) -> None:
    region = await llm_regions("r1", behavior=Behavior(load_metrics_fault=fault))  # type: ignore[arg-type]
    proxy = await make_proxy([{"name": "r1", "url": region.url, "load_reporting": "header"}])
    counts = await served(proxy, 3)
    assert counts == {"r1": 3}
    load = proxy.regions.by_name["r1"].reported
    assert load.report is None and load.reports_total == 0
    assert load.invalid_total == 3, load.last_invalid
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/metrics") as resp:
            text = await resp.text()
    line = next(
        line
        for line in text.splitlines()
        if line.startswith("edgeproxy_region_reported_load_invalid_total{")
    )
    assert 'region="r1"' in line and math.isclose(float(line.rsplit(" ", 1)[1]), 3.0)


async def test_reports_are_not_read_or_asked_for_when_off(
    llm_regions: Callable[..., Awaitable[FakeRegion]], make_proxy: ProxyFactory
) -> None:
    always = await llm_regions("always", load_metrics_always="TEXT")
    off = await llm_regions("off", load_metrics_always="TEXT")
    quiet = await llm_regions("quiet")
    proxy = await make_proxy(
        [
            {"name": "always", "url": always.url},  # auto: read, not asked for
            {"name": "off", "url": off.url, "load_reporting": "off"},
            {"name": "quiet", "url": quiet.url},  # auto, and the region sends nothing
        ]
    )
    await served(proxy, 30, stripped=False)
    regions = proxy.regions.by_name
    assert regions["always"].reported.reports_total >= 1
    assert regions["off"].reported.reports_total == 0
    assert regions["quiet"].reported.reports_total == 0
    assert all(r.reported.invalid_total == 0 for r in proxy.regions)


async def test_a_header_block_past_the_transport_limits_fails_over(
    llm_regions: Callable[..., Awaitable[FakeRegion]], make_proxy: ProxyFactory
) -> None:
    """10,000 named metrics (about 280 kB) are past HTTP/2's header list limit: the transport
    refuses the answer as any oversized header block, before any parser sees it, and the
    request goes to the next region. (A header that fits, with more than MAX_FIELDS metrics,
    is refused by the parser: tests/test_loadmetrics.py.)"""
    many = await llm_regions("many", behavior=Behavior(load_metrics_fault="many"))
    clean = await llm_regions("clean")
    proxy = await make_proxy(
        [
            {"name": "many", "url": many.url, "load_reporting": "header", "weight": 100},
            {"name": "clean", "url": clean.url, "load_reporting": "header", "weight": 0.01},
        ]
    )
    counts = await served(proxy, 5)
    assert counts == {"clean": 5}
    assert proxy.regions.by_name["many"].reported.report is None
    assert proxy.regions.by_name["clean"].reported.reports_total == 5


def test_a_header_with_too_many_fields_is_refused_and_counted() -> None:
    load = ReportedLoad()
    fields = ", ".join(f"named_metrics.m{i}={i}.0" for i in range(100))
    assert len(fields) < 4096
    assert not load.observe_header("TEXT " + fields, now=1.0)
    assert load.invalid_total == 1 and load.report is None


@pytest.mark.redis
async def test_the_shared_load_views_global_in_flight_moves_traffic(
    redis_server: str,
    redis_prefix: str,
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
) -> None:
    """Another proxy holds requests at r1: this one sees them through the shared load view
    and sends its own elsewhere, though it has none in flight anywhere itself."""
    r1 = await make_region("r1", fault="stall", fault_paths=(CHAT,))  # chats stay in flight
    r2 = await make_region("r2")
    load = {
        "redis_url": redis_server,
        "redis_prefix": redis_prefix,
        "interval": 0.05,
        "ttl": 5.0,
        "redis_timeout": 2.0,
    }
    other = await make_proxy([r1], shared_load=load)
    proxy = await make_proxy([r1, r2], shared_load=load)
    router = proxy.pipeline.router
    assert router.load_view is proxy.load_view is not None

    async def completions(n: int) -> Counter[str]:
        counts: Counter[str] = Counter()
        async with aiohttp.ClientSession() as client:
            for _ in range(n):
                body = {"model": "fake-llm", "prompt": "hi", "max_tokens": 2}
                async with client.post(proxy.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    counts[resp.headers["X-Edgeproxy-Region"]] += 1
        return counts

    async with aiohttp.ClientSession() as client:

        async def hold() -> None:
            async with client.post(other.url + CHAT, json=BODY) as resp:
                await resp.read()

        held = [asyncio.create_task(hold()) for _ in range(3)]
        try:
            await eventually(lambda: router.in_flight(proxy.regions.by_name["r1"]) == 3)
            assert proxy.regions.by_name["r1"].in_flight == 0
            counts = await completions(20)
            assert counts == {"r2": 20}, counts
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
    await eventually(lambda: router.in_flight(proxy.regions.by_name["r1"]) == 0)
    counts = await completions(40)
    assert counts["r1"] >= 5, counts
