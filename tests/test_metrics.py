"""Prometheus metrics: real traffic through the real proxy, scraped from the admin /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgeproxy import Config, EdgeProxy, RequestContext, Response, hookimpl
from edgeproxy._core.config import ConfigError
from edgeproxy._observability.metrics import LABELS, RecentTraffic, StatusCollector, flatten_status

from .conftest import ProxyFactory, RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
STREAM = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
PER_REQUEST = (
    "edgeproxy_request_duration_seconds",
    "edgeproxy_upstream_ttfb_seconds",
    "edgeproxy_client_ttfb_seconds",
    "edgeproxy_proxy_overhead_seconds",
)


class Samples:
    """A parsed scrape: ``samples[name]`` is a list of (labels, value)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.by_name.setdefault(s.name, []).append((dict(s.labels), s.value))

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        return sum(
            v
            for got, v in self.by_name.get(name, [])
            if all(got.get(k) == want for k, want in labels.items())
        )

    def series(self) -> int:
        return sum(len(v) for v in self.by_name.values())


async def scrape(proxy: EdgeProxy, accept: str | None = None) -> Samples:
    headers = {"Accept": accept} if accept else {}
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/metrics", headers=headers) as resp:
            assert resp.status == 200
            return Samples(await resp.text())


async def test_scrape_after_real_traffic_has_histograms_counters_and_labels(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", tokens=5)
    proxy = await make_proxy(
        [{"name": "ap-1", "url": region.url}],
        routes=[{"name": "chat", "path": CHAT}],
        metrics={"buckets": [0.001, 0.01, 0.1, 1.0, 10.0, 120.0]},
    )
    async with aiohttp.ClientSession() as client:
        for _ in range(3):
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.status == 200
                await resp.read()
        for _ in range(2):
            async with client.post(proxy.url + CHAT, json=STREAM) as resp:
                assert resp.status == 200
                await resp.read()
        async with client.get(proxy.url + "/status/503") as resp:
            assert resp.status == 503
        async with client.get(proxy.url + "/status/404") as resp:
            assert resp.status == 404

    # The hook runs once the response is out, maybe after the client read it.
    async def duration_count() -> float:
        return (await scrape(proxy)).value("edgeproxy_request_duration_seconds_count")

    for _ in range(500):
        if await duration_count() == 7:
            break
        await asyncio.sleep(0.02)
    m = await scrape(proxy)
    assert m.value("edgeproxy_request_duration_seconds_count") == 7

    chat = {"route": "chat", "region": "ap-1", "degraded": "no"}
    for name in PER_REQUEST:
        assert m.types[name] == "histogram"
        assert m.value(name + "_count", **chat, status_class="2xx") == 5, name
        # Every per-request series carries exactly the bounded labels.
        for labels, _ in m.by_name[name + "_count"]:
            assert set(labels) == set(LABELS)
            assert labels["cache"] in {"none", "hit", "miss", "stale", "bypass", "coalesced"}
        bounds = {labels["le"] for labels, _ in m.by_name[name + "_bucket"]}
        assert bounds == {"0.001", "0.01", "0.1", "1.0", "10.0", "120.0", "+Inf"}
    other = {"route": "default", "region": "ap-1", "degraded": "no"}
    assert m.value("edgeproxy_request_duration_seconds_count", **other, status_class="5xx") == 1
    assert m.value("edgeproxy_request_duration_seconds_count", **other, status_class="4xx") == 1
    # Buckets are cumulative: the +Inf bucket is the count.
    assert m.value("edgeproxy_request_duration_seconds_bucket", **chat, le="+Inf") == 5
    assert m.value("edgeproxy_request_duration_seconds_sum", **chat) > 0

    assert m.value("edgeproxy_tokens_total", route="chat", kind="completion") == 25
    assert m.value("edgeproxy_tokens_total", route="chat", kind="prompt") > 0
    assert m.value("edgeproxy_stream_tokens_per_second_count", route="chat") == 2
    assert m.value("edgeproxy_upstream_attempts_total", route="chat") == 5
    assert m.value("edgeproxy_response_bytes_total", route="chat", region="ap-1") > 0

    # Pulled from /status at scrape time: regions, pools, in-flight, readiness.
    assert m.types["edgeproxy_region_requests"] == "counter"
    # The GET answered 503 (a capacity answer) was tried three times on its lone region.
    assert m.value("edgeproxy_region_requests_total", region="ap-1") == 9
    assert m.value("edgeproxy_region_up", region="ap-1") == 1
    assert m.value("edgeproxy_region_pool_connections_open", region="ap-1") >= 1
    assert m.value("edgeproxy_region_pool_streams_in_use", region="ap-1") == 0
    assert m.value("edgeproxy_in_flight") == 0
    assert m.value("edgeproxy_ready") == 1
    assert m.value("edgeproxy_info", pop="edge-test") == 1

    # OpenMetrics when Prometheus asks for it.
    async with aiohttp.ClientSession() as client:
        async with client.get(
            proxy.admin_url + "/metrics", headers={"Accept": "application/openmetrics-text"}
        ) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            assert (await resp.text()).rstrip().endswith("# EOF")


class FallbackAnswer:
    """Answers for the regions when they cannot (a degraded answer)."""

    @hookimpl
    def edgeproxy_fallback(self) -> Response:
        return Response.json({"degraded": True})


async def test_failed_and_degraded_requests_are_labelled(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1")
    await region.kill()  # unreachable from the start
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}], plugins=[FallbackAnswer()])
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/v1/models") as resp:
            assert resp.status == 200
            reason = resp.headers["X-Edgeproxy-Degraded"]
    m = await scrape(proxy)
    for _ in range(200):
        if m.value("edgeproxy_request_duration_seconds_count"):
            break
        await asyncio.sleep(0.02)
        m = await scrape(proxy)
    assert m.value("edgeproxy_request_duration_seconds_count", degraded="yes") == 1
    assert m.value("edgeproxy_degraded_responses_total", reason=reason) == 1
    # No region answered: no upstream TTFB, and so no overhead to compute.
    assert m.value("edgeproxy_upstream_ttfb_seconds_count") == 0
    assert m.value("edgeproxy_client_ttfb_seconds_count", degraded="yes") == 1


class TenantAndGarbage:
    """Gives every request its own tenant, and puts junk where label values come from."""

    @hookimpl
    def edgeproxy_request_received(self, ctx: RequestContext) -> None:
        ctx.tenant = ctx.headers.get("x-tenant")

    @hookimpl(tryfirst=True)
    def edgeproxy_upstream_response(self, ctx: RequestContext) -> None:
        junk = ctx.headers.get("x-junk")
        if junk:
            ctx.cache = junk


async def test_label_cardinality_stays_bounded_under_1000_tenants_and_paths(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}], plugins=[TenantAndGarbage()])
    done = 0

    async def one(client: aiohttp.ClientSession, i: int) -> None:
        nonlocal done
        headers = {"x-tenant": f"tenant-{i:04d}"}
        if i % 10 == 0:
            headers["x-junk"] = f"junk{i}"  # 100 distinct would-be cache outcomes
        async with client.get(f"{proxy.url}/echo/path-{i:04d}", headers=headers) as resp:
            assert resp.status == 200
            await resp.read()
        done += 1

    connector = aiohttp.TCPConnector(limit=16)
    async with aiohttp.ClientSession(connector=connector) as client:
        for start in range(0, 1000, 50):
            await asyncio.gather(*(one(client, i) for i in range(start, start + 50)))
    assert done == 1000
    await eventually(lambda: proxy.status()["recent"]["requests"] == 1000)

    m = await scrape(proxy)
    assert m.value("edgeproxy_request_duration_seconds_count") == 1000
    assert "tenant-" not in m.text and "path-0" not in m.text
    label_sets = {
        tuple(sorted(labels.items()))
        for labels, _ in m.by_name["edgeproxy_request_duration_seconds_count"]
    }
    caches = {dict(labels)["cache"] for labels in label_sets}
    # The known outcomes, at most 16 newcomers, then "other" for the rest.
    assert "other" in caches
    assert len(caches - {"none", "hit", "miss", "stale", "bypass", "coalesced", "other"}) <= 16
    assert len(label_sets) <= 18
    # Hundreds of series at most, whatever the traffic.
    assert m.series() < 2000


async def test_status_has_recent_latency_percentiles(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", tokens=3)
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}])
    async with aiohttp.ClientSession() as client:
        for _ in range(20):
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                await resp.read()
        await eventually(lambda: proxy.status()["recent"]["requests"] == 20)
        async with client.get(proxy.admin_url + "/status") as resp:
            status = await resp.json()
    recent = status["recent"]
    assert recent["window_s"] == 300 and recent["step_s"] == 10
    lat = recent["latency_ms"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"]
    assert 0 < recent["ttfb_ms"]["p50"]
    assert recent["regions"] == {"ap-1": 20}
    assert recent["errors"] == 0
    assert recent["tokens_per_s"] > 0
    assert len(recent["series"]) == 30
    assert sum(p["requests"] for p in recent["series"]) == 20
    last = [p for p in recent["series"] if p["requests"]]
    assert last and last[-1]["p99_ms"] is not None


async def test_each_proxy_has_its_own_registry(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1")
    busy = await make_proxy([{"name": "ap-1", "url": region.url}])
    idle = await make_proxy([{"name": "ap-1", "url": region.url}])
    async with aiohttp.ClientSession() as client:
        async with client.get(busy.url + "/v1/models") as resp:
            await resp.read()
    await eventually(lambda: busy.status()["recent"]["requests"] == 1)
    assert (await scrape(busy)).value("edgeproxy_request_duration_seconds_count") == 1
    assert (await scrape(idle)).value("edgeproxy_request_duration_seconds_count") == 0
    assert busy.metrics is not None and idle.metrics is not None
    assert busy.metrics.registry is not idle.metrics.registry


async def test_metrics_can_be_turned_off(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}], metrics={"enabled": False})
    assert proxy.metrics is None
    assert "edgeproxy.metrics" not in proxy.plugins.names()
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/v1/models") as resp:
            assert resp.status == 200
        async with client.get(proxy.admin_url + "/metrics") as resp:
            assert resp.status == 404
        async with client.get(proxy.admin_url + "/status") as resp:
            assert (await resp.json())["recent"] is None


async def test_a_metrics_fault_never_fails_a_request(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}])
    assert proxy.metrics is not None

    def broken(ctx: RequestContext) -> None:
        raise ValueError("metrics bug")

    # Injected: no real input makes the observer fail.
    monkeypatch.setattr(proxy.metrics, "observe", broken)
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/v1/models") as resp:
            assert resp.status == 200
            await resp.read()
    await eventually(lambda: "metrics bug" in caplog.text)
    assert "edgeproxy.metrics" in caplog.text


def test_latency_window_percentiles_rotation_and_hit_ratio() -> None:
    now = [1000.0]
    window = RecentTraffic(60, 10, clock=lambda: now[0])
    for ms in range(1, 101):
        window.observe(ms / 1000, ms / 2000, region="r1", cache="miss", error=ms > 98, tokens=3)
    for _ in range(3):
        window.observe(0.0001, None, region="r2", cache="hit", error=False)
    window.observe(0.002, None, region="r2", cache="stale", error=False)
    snap = window.snapshot()
    assert snap["requests"] == 104
    assert snap["errors"] == 2
    # Logarithmic buckets 4% wide: within ±3% of the exact order statistics.
    assert snap["latency_ms"]["p50"] == pytest.approx(48, rel=0.03)
    assert snap["latency_ms"]["p95"] == pytest.approx(95, rel=0.03)
    assert snap["latency_ms"]["p99"] == pytest.approx(99, rel=0.03)
    assert snap["cache"]["hit_ratio"] == pytest.approx(4 / 104, rel=1e-3)
    assert snap["regions"] == {"r1": 100, "r2": 4}
    assert snap["tokens_per_s"] == pytest.approx(300 / 60)
    assert len(snap["series"]) == 6 and snap["series"][-1]["requests"] == 104

    now[0] += 30  # three slots later: the old slot is still in the window
    window.observe(0.5, 0.1, region="r1", cache="none", error=False)
    snap = window.snapshot()
    assert snap["requests"] == 105
    assert [p["requests"] for p in snap["series"]] == [0, 0, 104, 0, 0, 1]

    now[0] += 60  # everything before has left the window
    snap = window.snapshot()
    assert snap["requests"] == 0
    assert snap["latency_ms"] == {"p50": None, "p95": None, "p99": None}
    assert snap["cache"]["hit_ratio"] is None


def test_flatten_status_names_types_units_and_bounds() -> None:
    status = {
        "pop": "edge-x",
        "ready": True,
        "uptime_s": 12.5,
        "in_flight": 3,
        "recent": {"requests": 99},  # written by the metrics module itself
        "regions": [
            {
                "name": "eu",
                "state": "down",
                "url": "http://eu",
                "requests_total": 7,
                "latency": {"ewma_ms": 250.0},
                "pool": {"connections_open": 2, "http_version": "2"},
            }
        ],
        "cache": {"hits_total": 5, "misses_total": 2, "hit_ratio": 0.71, "backend": "redis"},
        "admission": {
            "queue_depth": 4,
            "tenants": {f"tenant-{i}": {"tokens": i} for i in range(500)},  # a map: skipped
            "routes": [{"name": "chat", "rejected_total": 9}],
        },
        "broken": float("nan"),
    }
    samples = {(s.name, s.labels): s for s in flatten_status(status)}
    names = {name for name, _ in samples}
    assert ("edgeproxy_ready", ()) in samples
    assert samples[("edgeproxy_uptime_seconds", ())].value == 12.5
    assert samples[("edgeproxy_in_flight", ())].value == 3
    eu = (("region", "eu"),)
    assert samples[("edgeproxy_region_up", eu)].value == 0
    assert samples[("edgeproxy_region_state", (*eu, ("state", "down")))].value == 1
    assert samples[("edgeproxy_region_requests_total", eu)].kind == "counter"
    assert samples[("edgeproxy_region_latency_ewma_seconds", eu)].value == 0.25
    assert samples[("edgeproxy_region_pool_connections_open", eu)].value == 2
    assert samples[("edgeproxy_cache_hits_total", ())].kind == "counter"
    assert samples[("edgeproxy_cache_hit_ratio", ())].kind == "gauge"
    assert samples[("edgeproxy_admission_queue_depth", ())].value == 4
    assert samples[("edgeproxy_admission_routes_rejected_total", (("name", "chat"),))].value == 9
    assert not any("tenant" in n or "recent" in n or "broken" in n for n in names)
    assert not any("pop" in n or "url" in n or "backend" in n for n in names)


def test_collector_tolerates_missing_sections_and_a_failing_status() -> None:
    families = list(StatusCollector(lambda: {"pop": "p"}, "p", "1").collect())
    assert [f.name for f in families] == ["edgeproxy"]  # the info series only

    def broken() -> dict[str, Any]:
        raise RuntimeError("half-built component")

    families = list(StatusCollector(broken, "p", "1").collect())
    assert [f.name for f in families] == ["edgeproxy"]


@pytest.mark.parametrize(
    ("section", "values", "error"),
    [
        ("metrics", {"buckets": [0.1, 0.05]}, "metrics.buckets: must be strictly increasing"),
        ("metrics", {"buckets": [0, 1]}, "metrics.buckets: must be positive finite"),
        ("metrics", {"window": 5}, "metrics.window: must be between 10 and 86400"),
        ("metrics", {"window": 60, "window_step": 120}, "metrics.window_step: must not be longer"),
        ("metrics", {"multiprocess_sync_interval": 0}, "metrics.multiprocess_sync_interval"),
        ("tracing", {"exporter": "zipkin"}, "tracing.exporter: must be 'otlp', 'console'"),
        ("tracing", {"otlp_endpoint": "collector:4318"}, "tracing.otlp_endpoint: must be an"),
        ("tracing", {"sample_ratio": 2}, "tracing.sample_ratio"),
        ("access_log", {"path": " "}, "access_log.path: must be a file path"),
        ("access_log", {"queue_size": 0}, "access_log.queue_size"),
        ("metrics", {"bukkets": []}, "metrics.bukkets: unknown key"),
    ],
)
def test_config_errors_name_the_key_and_the_reason(
    section: str, values: dict[str, Any], error: str
) -> None:
    data = proxy_config([{"name": "r", "url": "http://127.0.0.1:1"}], **{section: values})
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(data, environ={})
    assert any(line.startswith(error) for line in info.value.errors), info.value.errors


def test_environment_overrides_reach_the_new_sections() -> None:
    data = proxy_config([{"name": "r", "url": "http://127.0.0.1:1"}])
    config = Config.from_mapping(
        data,
        environ={
            "EDGEPROXY_METRICS__ENABLED": "false",
            "EDGEPROXY_ACCESS_LOG__PATH": "/var/log/edge.jsonl",
            "EDGEPROXY_TRACING__SAMPLE_RATIO": "0.25",
        },
    )
    assert config.metrics.enabled is False
    assert config.access_log.path == "/var/log/edge.jsonl"
    assert config.tracing.sample_ratio == 0.25


# -- multiprocess mode -------------------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import asyncio, json, sys
    from edgeproxy import EdgeProxy
    from edgeproxy import Config

    async def main():
        data = json.loads(sys.argv[1])
        proxy = EdgeProxy(Config.from_mapping(data, environ={}))
        await proxy.start()
        print(json.dumps({"url": proxy.url, "admin": proxy.admin_url}), flush=True)
        # Serve until the test closes stdin.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await proxy.stop(grace=2.0)

    asyncio.run(main())
    """
)


async def test_multiprocess_workers_are_summed_by_any_worker(
    make_region: RegionFactory, tmp_path: Path
) -> None:
    region = await make_region("ap-1")
    shared = tmp_path / "prometheus"
    shared.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)}
    data = proxy_config(
        [{"name": "ap-1", "url": region.url}], metrics={"multiprocess_sync_interval": 0.1}
    )
    workers = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WORKER,
            json.dumps(data),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        urls = []
        for worker in workers:
            assert worker.stdout is not None
            line = await asyncio.wait_for(worker.stdout.readline(), 60)
            urls.append(json.loads(line))
        async with aiohttp.ClientSession() as client:
            for i in range(5):
                async with client.get(urls[i % 2]["url"] + "/v1/models") as resp:
                    assert resp.status == 200

            async def scrape_worker(n: int) -> Samples:
                async with client.get(urls[n]["admin"] + "/metrics") as resp:
                    assert resp.status == 200
                    return Samples(await resp.text())

            for _ in range(300):
                m = await scrape_worker(0)
                # Each worker syncs its counters and its live gauges on its own schedule.
                if (
                    m.value("edgeproxy_request_duration_seconds_count") == 5
                    and m.value("edgeproxy_region_requests_total") == 5
                    and m.value("edgeproxy_region_pool_connections_open", region="ap-1") >= 2
                ):
                    break
                await asyncio.sleep(0.05)
            # Three requests went to worker 0 and two to worker 1: worker 0 shows all five.
            assert m.value("edgeproxy_request_duration_seconds_count", route="default") == 5
            assert m.value("edgeproxy_region_requests_total", region="ap-1") == 5
            assert m.value("edgeproxy_region_pool_connections_open", region="ap-1") >= 2
            assert m.value("edgeproxy_info") == 1
            other = await scrape_worker(1)
            assert other.value("edgeproxy_request_duration_seconds_count") == 5

        # Worker 1 leaves: its counts stay (counters never go back), its live gauges go.
        assert workers[1].stdin is not None
        workers[1].stdin.close()
        assert await asyncio.wait_for(workers[1].wait(), 30) == 0
        async with aiohttp.ClientSession() as client:
            async with client.get(urls[0]["admin"] + "/metrics") as resp:
                m = Samples(await resp.text())
        assert m.value("edgeproxy_request_duration_seconds_count") == 5
        assert m.value("edgeproxy_region_requests_total") == 5
        assert m.value("edgeproxy_region_pool_connections_open", region="ap-1") >= 1
    finally:
        for worker in workers:
            if worker.returncode is None:
                if worker.stdin is not None and not worker.stdin.is_closing():
                    worker.stdin.close()
                try:
                    await asyncio.wait_for(worker.wait(), 15)
                except TimeoutError:
                    worker.kill()
                    await worker.wait()
