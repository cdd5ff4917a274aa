"""Tracing: W3C traceparent through the real proxy, and OpenTelemetry spans when enabled."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from edgeproxy import Config, EdgeProxy, Response, hookimpl
from edgeproxy._observability.tracing import Tracing, otel_available

from .conftest import ProxyFactory, RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT_RE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

needs_otel = pytest.mark.skipif(
    not otel_available(), reason="the OpenTelemetry SDK (the 'otel' extra) is not installed"
)


async def echo(
    proxy: EdgeProxy, headers: dict[str, str] | None = None, path: str = "/echo/trace"
) -> dict[str, str]:
    """The headers the region received for one request through the proxy."""
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + path, headers=headers or {}) as resp:
            assert resp.status == 200
            payload = await resp.json()
    return {k: v for k, v in payload["headers"]}


def log_lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


async def test_traceparent_round_trip(
    make_region: RegionFactory, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    region = await make_region("ap-1")
    log = tmp_path / "access.jsonl"
    proxy = await make_proxy(
        [{"name": "ap-1", "url": region.url}],
        access_log={"enabled": True, "path": str(log)},
    )

    # Continued: same trace id, the proxy's own span as parent, flags and tracestate kept.
    sent = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "vendor=abc"}
    got = await echo(proxy, sent)
    m = TRACEPARENT_RE.match(got["traceparent"])
    assert m is not None, got["traceparent"]
    assert m.group(1) == TRACE_ID
    assert m.group(2) != CLIENT_SPAN and m.group(2) != "0" * 16
    assert m.group(3) == "01"
    assert got["tracestate"] == "vendor=abc"

    # An unsampled caller stays unsampled.
    got = await echo(proxy, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-00"})
    assert got["traceparent"].endswith("-00")

    # None, or an invalid one: a new trace starts, and upstream still gets one.
    fresh = TRACEPARENT_RE.match((await echo(proxy))["traceparent"])
    bogus = TRACEPARENT_RE.match(
        (await echo(proxy, {"traceparent": f"00-{'0' * 32}-{CLIENT_SPAN}-01"}))["traceparent"]
    )
    assert fresh is not None and bogus is not None
    assert len({fresh.group(1), bogus.group(1), TRACE_ID}) == 3

    # The access log names the same traces, so every hop's logs can be joined.
    await eventually(lambda: len(log_lines(log)) == 4)
    assert [line["trace_id"] for line in log_lines(log)] == [
        TRACE_ID,
        TRACE_ID,
        fresh.group(1),
        bogus.group(1),
    ]


# -- OpenTelemetry -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def span_exporter() -> Iterator[Any]:
    """The in-memory exporter behind the process's global TracerProvider (set once)."""
    if not otel_available():
        pytest.skip("the OpenTelemetry SDK (the 'otel' extra) is not installed")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    exporter = getattr(provider, "_edgeproxy_test_exporter", None)
    if exporter is None:
        provider = TracerProvider()
        exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        provider._edgeproxy_test_exporter = exporter  # type: ignore[attr-defined]
        trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider() is provider, "another global TracerProvider is set"
    yield exporter


@pytest.fixture
def spans(span_exporter: Any) -> Any:
    span_exporter.clear()
    return span_exporter


def by_name(finished: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for span in finished:
        out.setdefault(span.name, []).append(span)
    return out


@needs_otel
async def test_spans_for_each_stage_are_exported(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any
) -> None:
    from opentelemetry.trace import SpanKind, StatusCode

    region = await make_region("ap-1", tokens=3)
    proxy = await make_proxy(
        [{"name": "ap-1", "url": region.url}],
        tracing={"otel": True, "exporter": "global"},
    )
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as client:
        headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
        async with client.post(proxy.url + CHAT, json=body, headers=headers) as resp:
            assert resp.status == 200
            await resp.read()
    await eventually(lambda: "edgeproxy.request" in by_name(spans.get_finished_spans()))
    named = by_name(spans.get_finished_spans())

    (root,) = named["edgeproxy.request"]
    assert root.kind == SpanKind.SERVER
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN and root.parent.is_remote
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["http.route"] == "default"
    assert root.attributes["edgeproxy.region"] == "ap-1"
    assert root.status.status_code != StatusCode.ERROR

    for name in ("edgeproxy.admission", "edgeproxy.cache", "edgeproxy.routing"):
        assert name in named, sorted(named)
    (attempt,) = named["edgeproxy.upstream"]
    assert attempt.kind == SpanKind.CLIENT
    assert attempt.attributes["edgeproxy.region"] == "ap-1"
    assert attempt.attributes["edgeproxy.attempt"] == 1
    assert attempt.attributes["http.response.status_code"] == 200
    children = [s for s in spans.get_finished_spans() if s is not root]
    for span in children:
        assert span.context.trace_id == root.context.trace_id
        assert span.parent.span_id == root.context.span_id, span.name
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time, span.name
    # Stages follow each other: admission, then the cache, then routing, then the region.
    order = [named[n][0].start_time for n in ("edgeproxy.admission", "edgeproxy.cache")]
    order += [named["edgeproxy.routing"][0].start_time, attempt.start_time]
    assert order == sorted(order)


@needs_otel
async def test_the_region_hangs_its_spans_under_the_attempt(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy(
        [{"name": "ap-1", "url": region.url}],
        tracing={"otel": True, "exporter": "global"},
    )
    got = await echo(proxy)
    await eventually(lambda: "edgeproxy.request" in by_name(spans.get_finished_spans()))
    named = by_name(spans.get_finished_spans())
    (attempt,) = named["edgeproxy.upstream"]
    (root,) = named["edgeproxy.request"]
    assert (
        got["traceparent"] == f"00-{root.context.trace_id:032x}-{attempt.context.span_id:016x}-01"
    )
    assert root.parent is None  # no caller trace: the proxy's span is the root


class FallbackAnswer:
    @hookimpl
    def edgeproxy_fallback(self) -> Response:
        return Response.json({"degraded": True})


@needs_otel
async def test_failed_attempt_and_fallback_spans(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any
) -> None:
    from opentelemetry.trace import StatusCode

    dead = await make_region("ap-2")
    await dead.kill()
    proxy = await make_proxy(
        [{"name": "ap-2", "url": dead.url}],
        plugins=[FallbackAnswer()],
        tracing={"otel": True, "exporter": "global"},
    )
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/v1/models") as resp:
            assert resp.status == 200
            degraded = resp.headers["X-Edgeproxy-Degraded"]
    await eventually(lambda: "edgeproxy.request" in by_name(spans.get_finished_spans()))
    named = by_name(spans.get_finished_spans())
    (root,) = named["edgeproxy.request"]
    (fallback,) = named["edgeproxy.fallback"]
    assert fallback.attributes["edgeproxy.degraded"] == degraded
    assert fallback.attributes["edgeproxy.reason"]
    assert root.attributes["edgeproxy.degraded"] == degraded
    for attempt in named.get("edgeproxy.upstream", []):
        assert attempt.status.status_code == StatusCode.ERROR
        assert attempt.end_time <= fallback.start_time


@needs_otel
async def test_an_unsampled_caller_exports_nothing(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any, tmp_path: Path
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy(
        [{"name": "ap-1", "url": region.url}],
        tracing={"otel": True, "exporter": "global"},
    )
    got = await echo(proxy, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-00"})
    assert got["traceparent"].startswith(f"00-{TRACE_ID}-") and got["traceparent"].endswith("-00")
    # A sampled request after it is exported: the unsampled one was simply not recorded.
    await echo(proxy, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    await eventually(lambda: "edgeproxy.request" in by_name(spans.get_finished_spans()))
    assert len(by_name(spans.get_finished_spans())["edgeproxy.request"]) == 1


@needs_otel
async def test_otlp_http_export_reaches_a_collector(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    received: list[ExportTraceServiceRequest] = []
    seen_headers: list[str | None] = []

    async def export(request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        seen_headers.append(request.headers.get("x-collector-key"))
        return web.Response(body=b"", content_type="application/x-protobuf")

    collector = web.Application()
    collector.router.add_post("/v1/traces", export)
    runner = web.AppRunner(collector, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        region = await make_region("ap-1")
        proxy = await make_proxy(
            [{"name": "ap-1", "url": region.url}],
            tracing={
                "otel": True,
                "exporter": "otlp",
                "otlp_endpoint": f"http://{host}:{port}/v1/traces",
                "otlp_headers": {"x-collector-key": "k1"},
                "service_name": "edge-under-test",
            },
        )
        await echo(proxy)
        # Shutdown flushes the batch processor (from a thread: the loop keeps serving).
        await proxy.stop(grace=2.0)
        assert received, "nothing exported"
        names = set()
        services = set()
        for message in received:
            for resource_spans in message.resource_spans:
                for attr in resource_spans.resource.attributes:
                    if attr.key == "service.name":
                        services.add(attr.value.string_value)
                for scope_spans in resource_spans.scope_spans:
                    names |= {span.name for span in scope_spans.spans}
        assert {"edgeproxy.request", "edgeproxy.routing", "edgeproxy.upstream"} <= names
        assert services == {"edge-under-test"}
        assert seen_headers and set(seen_headers) == {"k1"}
    finally:
        await runner.cleanup()


async def test_otel_missing_still_propagates_traceparent(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Uninstalling the SDK is not an option in a test run; pretend it is missing.
    monkeypatch.setattr("edgeproxy._observability.tracing.otel_available", lambda: False)
    caplog.set_level(logging.WARNING, logger="edgeproxy.tracing")
    region = await make_region("ap-1")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}], tracing={"otel": True})
    assert proxy.tracing is None
    assert "not installed" in caplog.text
    got = await echo(proxy, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    assert got["traceparent"].startswith(f"00-{TRACE_ID}-")


def test_tracing_is_off_by_default() -> None:
    config = Config.from_mapping(proxy_config([{"name": "r", "url": "http://r"}]), environ={})
    assert Tracing.from_config(config.tracing) is None


@needs_otel
def test_a_no_op_tracer_leaves_the_w3c_context_alone() -> None:
    # exporter = "global" in an app that never set a provider: OpenTelemetry's no-op tracer.
    from multidict import CIMultiDict
    from opentelemetry.trace import NoOpTracer

    from edgeproxy._core.context import RequestContext
    from edgeproxy._protocol.headers import trace_context

    config = Config.from_mapping(proxy_config([{"name": "r", "url": "http://r"}]), environ={})
    tracing = Tracing(config.tracing)
    tracing.tracer = NoOpTracer()
    incoming = trace_context(f"00-{TRACE_ID}-{CLIENT_SPAN}-01")
    ctx = RequestContext(
        request_id="r1",
        trace=incoming,
        method="GET",
        target="/",
        headers=CIMultiDict(),
        client_ip=None,
        started=0.0,
        route=config.route_for("GET", "/"),
    )
    tracing.edgeproxy_request_received(ctx)
    assert ctx.trace == incoming
    ctx.finished_at = 1.0
    tracing.edgeproxy_response_complete(ctx)  # ends the no-op span quietly
