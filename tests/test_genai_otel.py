"""OpenTelemetry's GenAI semantic conventions (v1.41.0) through the real proxy: the span of
each LLM API and the GenAI metrics, attribute by attribute, against the fake regions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from edgeproxy import Config
from edgeproxy._core.config import ConfigError
from edgeproxy._observability.genai import (
    SCHEMA_URL,
    SEMCONV_VERSION,
    request_attributes,
    usage_attributes,
)
from edgeproxy._observability.tracing import otel_available

from .conftest import ProxyFactory, RegionFactory, eventually, proxy_config

pytestmark = pytest.mark.skipif(
    not otel_available(), reason="the OpenTelemetry SDK (the 'otel' extra) is not installed"
)

CHAT = "/v1/chat/completions"
GLOBAL = {"otel": True, "exporter": "global"}
TOKEN_BUCKETS = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


# -- the process's global providers (set once, shared with tests/test_tracing.py) -----------


@pytest.fixture(scope="module")
def span_exporter() -> Iterator[Any]:
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


@pytest.fixture(scope="module")
def metric_reader() -> Iterator[Any]:
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    provider = metrics.get_meter_provider()
    reader = getattr(provider, "_edgeproxy_test_reader", None)
    if reader is None:
        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
        provider._edgeproxy_test_reader = reader  # type: ignore[attr-defined]
        metrics.set_meter_provider(provider)
    assert metrics.get_meter_provider() is provider, "another global MeterProvider is set"
    yield reader


@pytest.fixture
def spans(span_exporter: Any, metric_reader: Any) -> Any:
    span_exporter.clear()
    return span_exporter


class Metrics:
    """The GenAI metrics the reader holds, each test's told apart by its request model."""

    def __init__(self, reader: Any) -> None:
        self.by_name: dict[str, Any] = {}
        data = reader.get_metrics_data()
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                if scope.scope.name == "edgeproxy.genai":
                    assert scope.scope.schema_url == SCHEMA_URL
                    for metric in scope.metrics:
                        self.by_name[metric.name] = metric

    def points(self, name: str, model: str) -> list[Any]:
        metric = self.by_name.get(name)
        if metric is None:
            return []
        return [
            p for p in metric.data.data_points if p.attributes.get("gen_ai.request.model") == model
        ]

    def unit(self, name: str) -> str:
        return str(self.by_name[name].unit)


def genai_spans(exporter: Any) -> list[Any]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.instrumentation_scope.name == "edgeproxy.genai"
    ]


async def one_genai_span(exporter: Any) -> Any:
    await eventually(lambda: len(genai_spans(exporter)) == 1)
    await eventually(
        lambda: any(s.name == "edgeproxy.request" for s in exporter.get_finished_spans())
    )
    (span,) = genai_spans(exporter)
    return span


def check_common(span: Any, exporter: Any, *, operation: str, provider: str, model: str) -> None:
    """What every GenAI span carries: its name, kind, parent and the required attributes."""
    from opentelemetry.trace import SpanKind

    assert span.name == f"{operation} {model}"
    assert span.kind == SpanKind.CLIENT
    assert span.instrumentation_scope.schema_url == SCHEMA_URL
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "edgeproxy.request"]
    # Beside the stages: a child of the request's span, within it.
    assert span.parent.span_id == root.context.span_id
    assert span.context.trace_id == root.context.trace_id
    assert root.start_time <= span.start_time <= span.end_time <= root.end_time
    attrs = span.attributes
    assert attrs["gen_ai.operation.name"] == operation
    assert attrs["gen_ai.provider.name"] == provider
    assert attrs["gen_ai.request.model"] == model


def check_server(attrs: Any, url: str) -> None:
    address, port = url.removeprefix("http://").rsplit(":", 1)
    assert attrs["server.address"] == address
    assert attrs["server.port"] == int(port) and type(attrs["server.port"]) is int


def check_histogram(metrics: Metrics, name: str, unit: str, model: str, buckets: Any) -> Any:
    """The one data point of ``name`` for ``model``, its unit and the advised buckets."""
    (point,) = metrics.points(name, model)
    assert metrics.unit(name) == unit
    assert point.count == 1
    assert tuple(point.explicit_bounds) == buckets
    return point


async def post(proxy: Any, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + path, json=body) as resp:
            return resp.status, await resp.read()


# -- the APIs ----------------------------------------------------------------------------


async def test_a_chat_answer_in_json(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any, metric_reader: Any
) -> None:
    model = "gpt-genai-chat"
    region = await make_region("ap-1", tokens=4)
    proxy = await make_proxy(
        [{"name": "ap-1", "url": region.url, "model_aliases": {model: "served-chat-model"}}],
        tracing=GLOBAL,
    )
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_completion_tokens": 4,
        "temperature": 0,
        "top_p": 0.5,
        "seed": 7,
        "stop": "###",
        "frequency_penalty": 0.25,
        "presence_penalty": -0.5,
        "n": 1,
        "response_format": {"type": "json_object"},
    }
    status, _ = await post(proxy, CHAT, body)
    assert status == 200
    span = await one_genai_span(spans)
    check_common(span, spans, operation="chat", provider="openai", model=model)
    attrs = span.attributes
    check_server(attrs, region.url)
    assert attrs["openai.api.type"] == "chat_completions"
    # The model the region was asked for: its alias of the client's.
    assert attrs["gen_ai.response.model"] == "served-chat-model"
    assert (
        attrs["gen_ai.request.max_tokens"] == 4 and type(attrs["gen_ai.request.max_tokens"]) is int
    )
    for key, value in (
        ("temperature", 0.0),
        ("top_p", 0.5),
        ("frequency_penalty", 0.25),
        ("presence_penalty", -0.5),
    ):
        assert attrs[f"gen_ai.request.{key}"] == value
        assert type(attrs[f"gen_ai.request.{key}"]) is float, key
    assert attrs["gen_ai.request.seed"] == 7
    assert attrs["gen_ai.request.stop_sequences"] == ("###",)
    assert attrs["gen_ai.output.type"] == "json"
    assert "gen_ai.request.choice.count" not in attrs  # n = 1 is the default
    assert "gen_ai.request.stream" not in attrs  # only a streamed request says so
    assert "gen_ai.response.time_to_first_chunk" not in attrs
    assert attrs["gen_ai.usage.input_tokens"] >= 1
    assert attrs["gen_ai.usage.output_tokens"] == 4
    assert "error.type" not in attrs
    # The proxy's own account.
    assert attrs["edgeproxy.region"] == "ap-1"
    assert attrs["edgeproxy.route"] == "default"
    assert attrs["edgeproxy.attempts"] == 1
    assert attrs["edgeproxy.hedged"] is False
    assert "edgeproxy.degraded" not in attrs

    metrics = Metrics(metric_reader)
    point = check_histogram(
        metrics, "gen_ai.client.operation.duration", "s", model, DURATION_BUCKETS
    )
    assert point.sum >= 0
    expected = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": model,
        "gen_ai.response.model": "served-chat-model",
        "server.address": attrs["server.address"],
        "server.port": attrs["server.port"],
    }
    assert dict(point.attributes) == expected
    usage = metrics.points("gen_ai.client.token.usage", model)
    assert metrics.unit("gen_ai.client.token.usage") == "{token}"
    by_type = {p.attributes["gen_ai.token.type"]: p for p in usage}
    assert set(by_type) == {"input", "output"}
    for kind, point in by_type.items():
        assert dict(point.attributes) == {**expected, "gen_ai.token.type": kind}
        assert tuple(point.explicit_bounds) == TOKEN_BUCKETS
    assert by_type["input"].sum == attrs["gen_ai.usage.input_tokens"]
    assert by_type["output"].sum == 4
    # A JSON answer has no first token the proxy can see.
    assert metrics.points("gen_ai.server.time_to_first_token", model) == []
    assert metrics.points("gen_ai.server.time_per_output_token", model) == []


async def test_a_streamed_chat_answer_with_usage(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any, metric_reader: Any
) -> None:
    model = "gpt-genai-stream"
    region = await make_region("ap-1", tokens=5)
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}], tracing=GLOBAL)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "stream it"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 5,
        "stop": ["a", "b"],
    }
    status, raw = await post(proxy, CHAT, body)
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    span = await one_genai_span(spans)
    check_common(span, spans, operation="chat", provider="openai", model=model)
    attrs = span.attributes
    assert attrs["gen_ai.request.stream"] is True
    ttfc = attrs["gen_ai.response.time_to_first_chunk"]
    assert type(ttfc) is float and ttfc >= 0
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.request.stop_sequences"] == ("a", "b")
    assert attrs["gen_ai.response.model"] == model
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert "edgeproxy.usage_estimated" not in attrs

    metrics = Metrics(metric_reader)
    ttft = check_histogram(metrics, "gen_ai.server.time_to_first_token", "s", model, TTFT_BUCKETS)
    tpot = check_histogram(metrics, "gen_ai.server.time_per_output_token", "s", model, TPOT_BUCKETS)
    for point in (ttft, tpot):
        assert point.sum >= 0
        assert point.attributes["gen_ai.operation.name"] == "chat"
        assert point.attributes["gen_ai.provider.name"] == "openai"
        assert point.attributes["gen_ai.response.model"] == model
        assert "error.type" not in point.attributes
    check_histogram(metrics, "gen_ai.client.operation.duration", "s", model, DURATION_BUCKETS)
    output = [
        p
        for p in metrics.points("gen_ai.client.token.usage", model)
        if p.attributes["gen_ai.token.type"] == "output"
    ]
    assert [p.sum for p in output] == [5]


async def test_a_responses_request(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any, metric_reader: Any
) -> None:
    model = "gpt-genai-responses"
    region = await make_region("ap-1", tokens=3)
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}], tracing=GLOBAL)
    body = {
        "model": model,
        "input": "say something",
        "max_output_tokens": 16,
        "temperature": 0.7,
        "store": False,
        "text": {"format": {"type": "text"}},
    }
    status, _ = await post(proxy, "/v1/responses", body)
    assert status == 200
    span = await one_genai_span(spans)
    # The Responses API is a chat operation of OpenAI's, told apart by openai.api.type.
    check_common(span, spans, operation="chat", provider="openai", model=model)
    attrs = span.attributes
    check_server(attrs, region.url)
    assert attrs["openai.api.type"] == "responses"
    assert attrs["gen_ai.request.max_tokens"] == 16
    assert attrs["gen_ai.request.temperature"] == 0.7
    assert attrs["gen_ai.output.type"] == "text"
    assert attrs["gen_ai.response.model"] == model
    # input_tokens counts the cached ones, which are also given apart.
    assert attrs["gen_ai.usage.input_tokens"] >= 1
    assert attrs["gen_ai.usage.output_tokens"] == 3
    assert 0 <= attrs["gen_ai.usage.cache_read.input_tokens"] <= attrs["gen_ai.usage.input_tokens"]

    metrics = Metrics(metric_reader)
    sums = {
        p.attributes["gen_ai.token.type"]: p.sum
        for p in metrics.points("gen_ai.client.token.usage", model)
    }
    assert sums == {"input": attrs["gen_ai.usage.input_tokens"], "output": 3}


async def test_an_anthropic_messages_request(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any, metric_reader: Any
) -> None:
    model = "claude-genai"
    region = await make_region("ap-1", tokens=6)
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}], tracing=GLOBAL)
    body = {
        "model": model,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": "hello claude"}],
        "temperature": 1,
        "top_k": 5,
        "stop_sequences": ["END"],
    }
    status, _ = await post(proxy, "/v1/messages", body)
    assert status == 200
    span = await one_genai_span(spans)
    # Anthropic's Messages API: a chat operation, provider anthropic.
    check_common(span, spans, operation="chat", provider="anthropic", model=model)
    attrs = span.attributes
    assert "openai.api.type" not in attrs
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.request.temperature"] == 1.0
    assert type(attrs["gen_ai.request.temperature"]) is float
    assert attrs["gen_ai.request.top_k"] == 5.0 and type(attrs["gen_ai.request.top_k"]) is float
    assert attrs["gen_ai.request.stop_sequences"] == ("END",)
    # Anthropic counts cache reads and writes apart from input_tokens: the sum is given.
    cache_read = attrs["gen_ai.usage.cache_read.input_tokens"]
    cache_creation = attrs["gen_ai.usage.cache_creation.input_tokens"]
    assert attrs["gen_ai.usage.input_tokens"] >= cache_read + cache_creation
    assert attrs["gen_ai.usage.output_tokens"] == 6

    metrics = Metrics(metric_reader)
    (point,) = metrics.points("gen_ai.client.operation.duration", model)
    assert point.attributes["gen_ai.provider.name"] == "anthropic"
    assert point.attributes["gen_ai.operation.name"] == "chat"


async def test_an_embeddings_request(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any, metric_reader: Any
) -> None:
    model = "embed-genai"
    region = await make_region("ap-1")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}], tracing=GLOBAL)
    body = {"model": model, "input": "embed me", "encoding_format": "float", "dimensions": 8}
    status, _ = await post(proxy, "/v1/embeddings", body)
    assert status == 200
    span = await one_genai_span(spans)
    check_common(span, spans, operation="embeddings", provider="openai", model=model)
    attrs = span.attributes
    check_server(attrs, region.url)
    assert attrs["gen_ai.request.encoding_formats"] == ("float",)
    assert attrs["gen_ai.embeddings.dimension.count"] == 8
    assert attrs["gen_ai.usage.input_tokens"] >= 1
    assert "gen_ai.usage.output_tokens" not in attrs
    assert "gen_ai.request.temperature" not in attrs

    metrics = Metrics(metric_reader)
    (point,) = metrics.points("gen_ai.client.token.usage", model)
    assert point.attributes["gen_ai.token.type"] == "input"
    assert point.attributes["gen_ai.operation.name"] == "embeddings"
    assert metrics.points("gen_ai.server.time_to_first_token", model) == []


async def test_a_failing_region_is_an_error(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any, metric_reader: Any
) -> None:
    from opentelemetry.trace import StatusCode

    model = "gpt-genai-broken"
    region = await make_region("ap-1", fault="5xx", fault_status=502)
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}], tracing=GLOBAL)
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    status, _ = await post(proxy, CHAT, body)
    assert status == 502
    span = await one_genai_span(spans)
    check_common(span, spans, operation="chat", provider="openai", model=model)
    attrs = span.attributes
    assert attrs["error.type"] == "502"
    assert span.status.status_code == StatusCode.ERROR
    assert "gen_ai.response.model" not in attrs  # no model answered
    assert "gen_ai.usage.input_tokens" not in attrs
    check_server(attrs, region.url)  # the region it was sent to

    metrics = Metrics(metric_reader)
    (point,) = metrics.points("gen_ai.client.operation.duration", model)
    assert point.attributes["error.type"] == "502"
    assert "gen_ai.response.model" not in point.attributes
    assert metrics.points("gen_ai.client.token.usage", model) == []
    assert metrics.points("gen_ai.server.time_to_first_token", model) == []


# -- switches and other requests -------------------------------------------------------------


async def test_genai_off_keeps_the_stages_alone(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any, metric_reader: Any
) -> None:
    model = "gpt-genai-off"
    region = await make_region("ap-1")
    proxy = await make_proxy(
        [{"name": "ap-1", "url": region.url}], tracing={**GLOBAL, "genai": False}
    )
    status, _ = await post(
        proxy, CHAT, {"model": model, "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 200
    await eventually(lambda: any(s.name == "edgeproxy.request" for s in spans.get_finished_spans()))
    names = {s.name for s in spans.get_finished_spans()}
    assert {"edgeproxy.request", "edgeproxy.upstream"} <= names
    assert genai_spans(spans) == []
    assert Metrics(metric_reader).points("gen_ai.client.operation.duration", model) == []


async def test_a_configured_provider_and_a_request_of_no_llm_api(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any, metric_reader: Any
) -> None:
    model = "gpt-genai-azure"
    region = await make_region("eu-azure")
    proxy = await make_proxy(
        [{"name": "eu-azure", "url": region.url}],
        tracing={**GLOBAL, "genai_providers": {"eu-azure": "azure.ai.openai"}},
    )
    # Plain HTTP through the proxy: its spans, no GenAI one.
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/echo/x") as resp:
            assert resp.status == 200
    await eventually(lambda: any(s.name == "edgeproxy.request" for s in spans.get_finished_spans()))
    assert genai_spans(spans) == []
    spans.clear()
    status, _ = await post(
        proxy, CHAT, {"model": model, "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 200
    span = await one_genai_span(spans)
    check_common(span, spans, operation="chat", provider="azure.ai.openai", model=model)
    (point,) = Metrics(metric_reader).points("gen_ai.client.operation.duration", model)
    assert point.attributes["gen_ai.provider.name"] == "azure.ai.openai"


async def test_a_cache_hit_spends_no_tokens(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any, metric_reader: Any
) -> None:
    model = "gpt-genai-cached"
    region = await make_region("ap-1", tokens=3)
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}], tracing=GLOBAL)
    body = {"model": model, "temperature": 0, "messages": [{"role": "user", "content": "same"}]}
    for _ in range(2):
        status, _ = await post(proxy, CHAT, body)
        assert status == 200
    await eventually(lambda: len(genai_spans(spans)) == 2)
    miss, hit = sorted(genai_spans(spans), key=lambda s: s.start_time)
    assert miss.attributes["edgeproxy.cache"] == "MISS"
    assert hit.attributes["edgeproxy.cache"] == "HIT"
    assert miss.attributes["gen_ai.usage.output_tokens"] == 3
    # No region was contacted for the hit, and no tokens were spent on it.
    assert "gen_ai.usage.output_tokens" not in hit.attributes
    assert hit.attributes["gen_ai.response.model"] == model
    assert "server.address" not in hit.attributes
    assert hit.attributes["edgeproxy.attempts"] == 0
    metrics = Metrics(metric_reader)
    # The hit's duration is the operation's too, without a server.
    durations = metrics.points("gen_ai.client.operation.duration", model)
    assert sorted("server.address" in p.attributes for p in durations) == [False, True]
    assert [p.count for p in durations] == [1, 1]
    output = [
        p
        for p in metrics.points("gen_ai.client.token.usage", model)
        if p.attributes["gen_ai.token.type"] == "output"
    ]
    assert [(p.count, p.sum) for p in output] == [(1, 3)]


async def test_a_realtime_session(
    make_region: RegionFactory, make_proxy: ProxyFactory, spans: Any, metric_reader: Any
) -> None:
    import openai

    model = "gpt-realtime-genai"
    region = await make_region("r1", tokens=4, inter_token_delay=0.0, model=model)
    proxy = await make_proxy([region], tracing=GLOBAL)
    item: Any = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "hello"}],
    }
    sdk = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0)
    async with sdk as client, client.realtime.connect(model=model) as conn:
        await conn.conversation.item.create(item=item)
        await conn.response.create()
        async for event in conn:
            if event.type == "response.done":
                break
    span = await one_genai_span(spans)
    # A session of many responses: an operation of its own, from handshake to close.
    check_common(span, spans, operation="realtime", provider="openai", model=model)
    attrs = span.attributes
    check_server(attrs, region.url)
    assert attrs["openai.api.type"] == "realtime"
    assert attrs["gen_ai.response.model"] == model
    assert attrs["gen_ai.usage.output_tokens"] == 4
    assert "error.type" not in attrs
    metrics = Metrics(metric_reader)
    sums = {
        p.attributes["gen_ai.token.type"]: p.sum
        for p in metrics.points("gen_ai.client.token.usage", model)
    }
    assert sums["output"] == 4 and sums["input"] >= 1
    (point,) = metrics.points("gen_ai.client.operation.duration", model)
    assert point.attributes["gen_ai.operation.name"] == "realtime"
    assert metrics.points("gen_ai.server.time_to_first_token", model) == []


async def test_otlp_export_of_the_genai_metrics(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    received: list[Any] = []

    async def export(request: web.Request) -> web.Response:
        message = ExportMetricsServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    collector = web.Application()
    collector.router.add_post("/v1/metrics", export)
    collector.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(collector, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        region = await make_region("ap-1")
        proxy = await make_proxy(
            [{"name": "ap-1", "url": region.url}],
            # The metrics endpoint is the traces' with /v1/metrics for /v1/traces.
            tracing={"otel": True, "otlp_endpoint": f"http://{host}:{port}/v1/traces"},
        )
        body = {"model": "gpt-otlp", "messages": [{"role": "user", "content": "x"}]}
        status, _ = await post(proxy, CHAT, body)
        assert status == 200
        # Shutdown collects and exports what the reader holds.
        await proxy.stop(grace=2.0)
        names = set()
        for message in received:
            for resource_metrics in message.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    assert scope_metrics.schema_url == SCHEMA_URL
                    names |= {m.name for m in scope_metrics.metrics}
        assert {"gen_ai.client.operation.duration", "gen_ai.client.token.usage"} <= names
    finally:
        await runner.cleanup()


# -- the readers of bodies and usage -----------------------------------------------------------


def test_the_config_keys() -> None:
    regions = [{"name": "r", "url": "http://127.0.0.1:1"}]
    config = Config.from_mapping(proxy_config(regions), environ={})
    assert config.tracing.genai is True and config.tracing.genai_metrics is True
    assert config.tracing.genai_providers == {}
    assert config.tracing.metrics_export_interval == 60.0
    for values, error in (
        ({"otlp_metrics_endpoint": "collector:4318"}, "tracing.otlp_metrics_endpoint: must be"),
        ({"genai_providers": {"r": " "}}, "tracing.genai_providers: "),
        ({"metrics_export_interval": 0}, "tracing.metrics_export_interval"),
    ):
        with pytest.raises(ConfigError) as info:
            Config.from_mapping(proxy_config(regions, tracing=values), environ={})
        assert any(line.startswith(error) for line in info.value.errors), info.value.errors


def test_the_pinned_version() -> None:
    assert SEMCONV_VERSION == "1.41.0"
    assert SCHEMA_URL.endswith("/1.41.0")


def test_request_parameters_of_odd_values_are_left_out() -> None:
    body = {
        "temperature": True,  # a boolean is no number
        "top_p": "0.5",
        "max_tokens": 1.5,
        "seed": None,
        "stop": ["ok", 3],
        "n": 3,
        "service_tier": "flex",
        "response_format": {"type": "json_schema"},
    }
    assert request_attributes("chat.completions", body) == {
        "gen_ai.request.choice.count": 3,
        "openai.request.service_tier": "flex",
        "gen_ai.output.type": "json",
    }
    assert request_attributes("responses", {"conversation": {"id": "conv_1"}}) == {
        "gen_ai.conversation.id": "conv_1"
    }


def test_usage_details_of_each_api() -> None:
    chat = {
        "prompt_tokens": 100,
        "completion_tokens": 20,
        "prompt_tokens_details": {"cached_tokens": 40},
        "completion_tokens_details": {"reasoning_tokens": 12},
    }
    assert usage_attributes("chat.completions", chat) == {
        "gen_ai.usage.input_tokens": 100,
        "gen_ai.usage.output_tokens": 20,
        "gen_ai.usage.cache_read.input_tokens": 40,
        "gen_ai.usage.reasoning.output_tokens": 12,
    }
    responses = {
        "prompt_tokens": 50,
        "completion_tokens": 9,
        "input_tokens": 50,
        "input_tokens_details": {"cached_tokens": 10},
        "output_tokens_details": {"reasoning_tokens": 4},
    }
    assert usage_attributes("responses", responses) == {
        "gen_ai.usage.input_tokens": 50,
        "gen_ai.usage.output_tokens": 9,
        "gen_ai.usage.cache_read.input_tokens": 10,
        "gen_ai.usage.reasoning.output_tokens": 4,
    }
    # The dialect's counted usage: prompt_tokens = input + cache reads + cache writes.
    messages = {
        "input_tokens": 5,
        "cache_read_input_tokens": 30,
        "cache_creation_input_tokens": 7,
        "output_tokens": 2,
        "prompt_tokens": 42,
        "completion_tokens": 2,
    }
    assert usage_attributes("messages", messages) == {
        "gen_ai.usage.input_tokens": 42,
        "gen_ai.usage.output_tokens": 2,
        "gen_ai.usage.cache_read.input_tokens": 30,
        "gen_ai.usage.cache_creation.input_tokens": 7,
    }
    # An estimate is no count: nothing is reported.
    estimated = {"prompt_tokens": 3, "completion_tokens": 4, "estimated": True}
    assert usage_attributes("chat.completions", estimated) == {}
    assert usage_attributes("embeddings", {"prompt_tokens": 6, "total_tokens": 6}) == {
        "gen_ai.usage.input_tokens": 6
    }
