"""Tracing: W3C trace context always, OpenTelemetry spans when asked for.

*Always*, with no dependency: each request continues the caller's
``traceparent`` (same trace id) or starts a trace, and the region receives a
``traceparent`` whose parent is the proxy's own span
(:func:`edgeproxy._protocol.headers.trace_context`). The access log records the trace
id, so a slow request can be found in the logs of every hop.

*With* ``[tracing] otel = true`` and the ``otel`` extra installed
(``pip install 'edgeproxy[otel]'``), :class:`Tracing`, a built-in plugin,
makes OpenTelemetry spans from the pipeline's hooks:

``edgeproxy.request`` (server span)
    from arrival to the last byte; children:
``edgeproxy.admission``
    from the ``request_received`` hook to the next stage;
``edgeproxy.cache``
    cacheable requests, from the key to routing (or to the end, on a hit);
``edgeproxy.routing``
    from the route hook to the first attempt;
``edgeproxy.upstream`` (client span), one per attempt
    the region receives this span as its parent in ``traceparent``; the
    answering attempt lasts until the last byte, a failed one until the
    pipeline moved on (the next attempt, the fallback, or the end);
``edgeproxy.fallback``
    when the regions could not answer, with the reason;
``{gen_ai.operation.name} {gen_ai.request.model}`` (``chat gpt-4o``)
    with ``[tracing] genai`` (the default), an LLM request as OpenTelemetry's GenAI
    semantic conventions describe it (:mod:`edgeproxy._observability.genai`), from
    arrival to the last byte, beside the stages; the GenAI metrics go through a
    MeterProvider of their own (``genai_metrics``).

Spans are made from timestamps the hooks leave in ``ctx.extra``, so the
pipeline carries no tracing code; each finished span is handed to a batch
processor that exports from its own thread.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from edgeproxy._core.types import TraceContext
from edgeproxy._core.version import __version__
from edgeproxy._observability.genai import (
    SCHEMA_URL,
    GenAIMetrics,
    describe,
    server_of,
    span_attributes,
)
from edgeproxy.hookspecs import hookimpl

if TYPE_CHECKING:
    from edgeproxy._core.config import TracingConfig
    from edgeproxy._core.context import RequestContext, UpstreamReply
    from edgeproxy._core.protocols import ProxyView
    from edgeproxy._upstream.regions import Region

__all__ = ["Tracing", "otel_available"]

logger = logging.getLogger("edgeproxy.tracing")

_STATE_KEY = "edgeproxy.trace"
_ERROR_LIMIT = 256


def otel_available() -> bool:
    """Whether the OpenTelemetry SDK (the ``otel`` extra) is installed."""
    return importlib.util.find_spec("opentelemetry.sdk") is not None


@dataclass(slots=True)
class _Attempt:
    span: Any
    region: str
    started: float
    answered: bool = False


@dataclass(slots=True)
class _RequestTrace:
    """What the hooks saw of one request, turned into spans when it completes."""

    root: Any
    offset_ns: int  # wall-clock minus monotonic nanoseconds, at arrival
    received_at: float
    cache_at: float | None = None
    route_at: float | None = None
    fallback_at: float | None = None
    fallback_reason: str | None = None
    attempts: list[_Attempt] = field(default_factory=list)
    # By region, the model last asked of it (its alias of the client's): the GenAI
    # response model. Kept for unsampled requests too, whose metrics still count.
    sent: dict[str, str | None] = field(default_factory=dict)

    def ns(self, monotonic: float) -> int:
        return int(monotonic * 1e9) + self.offset_ns


class Tracing:
    """The built-in OpenTelemetry plugin; see the module docstring for its spans.

    The tracer provider is opened in the proxy's lifespan
    (``edgeproxy_startup``) and flushed and closed at ``edgeproxy_shutdown``,
    unless ``exporter = "global"``, where the application owns it.
    """

    def __init__(self, config: TracingConfig, *, pop: str = "edge") -> None:
        self.config = config
        self.pop = pop
        self.tracer: Any = None
        self._provider: Any = None
        # The GenAI conventions' span tracer (its schema URL names their version), metrics.
        self.genai_tracer: Any = None
        self.genai_metrics: GenAIMetrics | None = None
        self._meter_provider: Any = None
        # server.address and server.port by region name, and the URL they came from.
        self._servers: dict[str, tuple[str, int] | None] = {}
        self._urls: dict[str, str] = {}
        self._local_model: str | None = None

    @classmethod
    def from_config(cls, config: TracingConfig, *, pop: str = "edge") -> Tracing | None:
        """The plugin when ``otel`` is on and the SDK is installed; else None (with a warning)."""
        if not config.otel:
            return None
        if not otel_available():
            logger.warning(
                "tracing.otel is on but the OpenTelemetry SDK is not installed "
                "(pip install 'edgeproxy[otel]'): no spans; traceparent is still propagated"
            )
            return None
        return cls(config, pop=pop)

    # -- lifespan ------------------------------------------------------------------------

    @hookimpl
    def edgeproxy_startup(self, proxy: ProxyView) -> None:
        if self.tracer is not None:
            return
        from opentelemetry import trace

        local = proxy.config.local_model
        if local.path:
            # As the local model names itself.
            stem = PurePath(local.path).name.removesuffix(".gguf")
            self._local_model = local.model_name or f"local/{stem}"
        if self.config.exporter == "global":
            self.tracer = trace.get_tracer("edgeproxy", __version__)
            if self.config.genai:
                self.genai_tracer = trace.get_tracer(
                    "edgeproxy.genai", __version__, schema_url=SCHEMA_URL
                )
            self._start_metrics(None)
            return
        try:
            provider = self._make_provider()
        except Exception as exc:  # noqa: BLE001 - tracing must not stop the proxy
            logger.error(
                "tracing disabled: cannot set up the %s exporter: %s", self.config.exporter, exc
            )
            return
        self._provider = provider
        self.tracer = provider.get_tracer("edgeproxy", __version__)
        if self.config.genai:
            self.genai_tracer = provider.get_tracer(
                "edgeproxy.genai", __version__, schema_url=SCHEMA_URL
            )
        self._start_metrics(provider.resource)

    def _start_metrics(self, resource: Any) -> None:
        """The GenAI metrics, on the application's MeterProvider ('global') or one of ours."""
        cfg = self.config
        if not (cfg.genai and cfg.genai_metrics):
            return
        from opentelemetry import metrics

        if cfg.exporter == "global":
            meter = metrics.get_meter("edgeproxy.genai", __version__, schema_url=SCHEMA_URL)
        else:
            try:
                provider = self._make_meter_provider(resource)
            except Exception as exc:  # noqa: BLE001 - metrics must not stop the proxy
                logger.error("GenAI metrics disabled: cannot set up their exporter: %s", exc)
                return
            self._meter_provider = provider
            meter = provider.get_meter("edgeproxy.genai", __version__, schema_url=SCHEMA_URL)
        self.genai_metrics = GenAIMetrics(meter)

    def _make_meter_provider(self, resource: Any) -> Any:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        cfg = self.config
        exporter: Any
        if cfg.exporter == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            exporter = ConsoleMetricExporter()
        elif cfg.otlp_protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as GrpcExporter,
            )

            exporter = GrpcExporter(
                endpoint=cfg.otlp_metrics_endpoint or cfg.otlp_endpoint,
                headers=cfg.otlp_headers or None,
                timeout=cfg.otlp_timeout,
            )
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter as HttpExporter,
            )

            endpoint = cfg.otlp_metrics_endpoint
            traces = cfg.otlp_endpoint
            if endpoint is None and traces is not None and traces.endswith("/v1/traces"):
                endpoint = traces.removesuffix("/v1/traces") + "/v1/metrics"
            exporter = HttpExporter(
                endpoint=endpoint, headers=cfg.otlp_headers or None, timeout=cfg.otlp_timeout
            )
        # A thread of the reader's collects and exports: requests only add to histograms.
        reader = PeriodicExportingMetricReader(
            exporter, export_interval_millis=cfg.metrics_export_interval * 1000
        )
        return MeterProvider(metric_readers=[reader], resource=resource, shutdown_on_exit=False)

    def _make_provider(self) -> Any:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        cfg = self.config
        resource = Resource.create({"service.name": cfg.service_name, "edgeproxy.pop": self.pop})
        provider = TracerProvider(
            resource=resource,
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
            shutdown_on_exit=False,
        )
        exporter: Any
        if cfg.exporter == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporter = ConsoleSpanExporter()
        elif cfg.otlp_protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            exporter = GrpcExporter(
                endpoint=cfg.otlp_endpoint,
                headers=cfg.otlp_headers or None,
                timeout=cfg.otlp_timeout,
            )
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            exporter = HttpExporter(
                endpoint=cfg.otlp_endpoint,
                headers=cfg.otlp_headers or None,
                timeout=cfg.otlp_timeout,
            )
        # Batched: the event loop only queues a finished span; a thread exports.
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return provider

    @hookimpl
    async def edgeproxy_shutdown(self) -> None:
        provider, self._provider = self._provider, None
        meters, self._meter_provider = self._meter_provider, None
        self.tracer = self.genai_tracer = None
        self.genai_metrics = None
        # Both flush what is queued: blocking, so off the event loop.
        if provider is not None:
            await asyncio.to_thread(provider.shutdown)
        if meters is not None:
            await asyncio.to_thread(meters.shutdown)

    # -- request hooks -----------------------------------------------------------------

    @hookimpl(tryfirst=True)
    def edgeproxy_request_received(self, ctx: RequestContext) -> None:
        self._begin(ctx)

    @hookimpl(tryfirst=True)
    def edgeproxy_cache_key(self, ctx: RequestContext) -> None:
        state = ctx.extra.get(_STATE_KEY)
        if state is not None and state.cache_at is None:
            state.cache_at = time.monotonic()

    @hookimpl(tryfirst=True)
    def edgeproxy_route(self, ctx: RequestContext) -> None:
        state = ctx.extra.get(_STATE_KEY)
        if state is not None and state.route_at is None:
            state.route_at = time.monotonic()

    @hookimpl(trylast=True)
    def edgeproxy_upstream_request(
        self, ctx: RequestContext, region: Region, headers: list[tuple[str, str]]
    ) -> None:
        state: _RequestTrace | None = ctx.extra.get(_STATE_KEY)
        if state is None:
            return
        if self.genai_tracer is not None or self.genai_metrics is not None:
            self._sent(ctx, region, state)
        if not state.root.is_recording():
            return
        from opentelemetry import trace

        span = self.tracer.start_span(
            "edgeproxy.upstream",
            context=trace.set_span_in_context(state.root),
            kind=trace.SpanKind.CLIENT,
            attributes={
                "edgeproxy.region": region.name,
                "edgeproxy.attempt": len(state.attempts) + 1,
                "server.address": region.authority,
                "http.request.method": ctx.method,
            },
        )
        state.attempts.append(_Attempt(span, region.name, time.monotonic()))
        # The region's spans hang under this attempt, not under the whole request.
        sc = span.get_span_context()
        value = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{ctx.trace.flags}"
        for i, (name, _) in enumerate(headers):
            if name == "traceparent":
                headers[i] = ("traceparent", value)
                break
        else:
            headers.append(("traceparent", value))

    def _sent(self, ctx: RequestContext, region: Region, state: _RequestTrace) -> None:
        """What the GenAI telemetry needs of an attempt: the region's address and the model
        it was asked for (its alias of the client's, as the forwarder sends it)."""
        config = region.config
        name = region.name
        if self._urls.get(name) != config.url:
            # Once per region (and again when a reload gives it another URL).
            self._urls[name] = config.url
            self._servers[name] = server_of(config.url)
        model = ctx.model
        aliased = config.model_aliases.get(model) if model is not None else None
        if aliased is None and model is None and ctx.facts is not None:
            model = ctx.facts.model
        state.sent[name] = aliased or model

    @hookimpl(tryfirst=True)
    def edgeproxy_upstream_response(
        self, ctx: RequestContext, region: Region, reply: UpstreamReply
    ) -> None:
        state: _RequestTrace | None = ctx.extra.get(_STATE_KEY)
        if state is None:
            return
        for attempt in reversed(state.attempts):
            if attempt.region == region.name and not attempt.answered:
                attempt.answered = True
                attempt.span.set_attribute("http.response.status_code", reply.status)
                attempt.span.add_event("response headers")
                if reply.status >= 500:
                    from opentelemetry.trace import Status, StatusCode

                    attempt.span.set_status(Status(StatusCode.ERROR, f"HTTP {reply.status}"))
                break

    @hookimpl(tryfirst=True)
    def edgeproxy_fallback(self, ctx: RequestContext, reason: str) -> None:
        state = ctx.extra.get(_STATE_KEY)
        if state is not None and state.fallback_at is None:
            state.fallback_at = time.monotonic()
            state.fallback_reason = reason

    @hookimpl
    def edgeproxy_response_complete(self, ctx: RequestContext) -> None:
        state: _RequestTrace | None = ctx.extra.pop(_STATE_KEY, None)
        if state is None:
            # Answered before the received hook ran (a body that could not be read).
            state = self._begin(ctx)
            if state is None:
                return
        try:
            self._finish(ctx, state)
        except Exception:  # noqa: BLE001 - a tracing bug must not reach the client
            logger.exception("making the spans of request %s failed", ctx.request_id)

    # -- spans -------------------------------------------------------------------------

    def _begin(self, ctx: RequestContext) -> _RequestTrace | None:
        if self.tracer is None or _STATE_KEY in ctx.extra:
            return None
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

        parent = None
        # Embedded in an instrumented app, the app's server span is the parent;
        # otherwise the caller's traceparent, when it sent one.
        if not trace.get_current_span().get_span_context().is_valid and ctx.trace.parent_id:
            incoming = SpanContext(
                trace_id=int(ctx.trace.trace_id, 16),
                span_id=int(ctx.trace.parent_id, 16),
                is_remote=True,
                trace_flags=TraceFlags(int(ctx.trace.flags, 16) & TraceFlags.SAMPLED),
                trace_state=TraceState.from_header(ctx.headers.getall("tracestate", [])),
            )
            parent = trace.set_span_in_context(NonRecordingSpan(incoming))
        offset_ns = time.time_ns() - time.monotonic_ns()
        root = self.tracer.start_span(
            "edgeproxy.request",
            context=parent,
            kind=trace.SpanKind.SERVER,
            start_time=int(ctx.started * 1e9) + offset_ns,
            attributes={
                "http.request.method": ctx.method,
                "url.path": ctx.path,
                "http.route": ctx.route.name,
                "edgeproxy.request_id": ctx.request_id,
                "edgeproxy.pop": self.pop,
            },
        )
        # From here on the request's trace is the span's: the region, the
        # access log and the response agree with the exported trace.
        sc = root.get_span_context()
        # A no-op tracer ('global' with no provider set) hands back an invalid
        # span, or the caller's own: keep the proxy's ids then.
        caller = int(ctx.trace.parent_id, 16) if ctx.trace.parent_id else None
        if sc.is_valid and sc.span_id != caller:
            ctx.trace = TraceContext(
                trace_id=f"{sc.trace_id:032x}",
                span_id=f"{sc.span_id:016x}",
                parent_id=ctx.trace.parent_id,
                flags="01" if sc.trace_flags.sampled else "00",
            )
        state = _RequestTrace(root, offset_ns, time.monotonic())
        ctx.extra[_STATE_KEY] = state
        return state

    def _finish(self, ctx: RequestContext, state: _RequestTrace) -> None:
        out = ctx.outcome
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        root = state.root
        finished = out.finished_at if out.finished_at is not None else time.monotonic()
        if self.genai_tracer is not None or self.genai_metrics is not None:
            try:
                self._genai(ctx, state, finished)
            except Exception:  # noqa: BLE001 - the request's own spans still end
                logger.exception("the GenAI telemetry of request %s failed", ctx.request_id)
        if not root.is_recording():
            root.end(end_time=state.ns(finished))
            return
        parent = trace.set_span_in_context(root)
        first_attempt = state.attempts[0].started if state.attempts else None

        def child(name: str, start: float, end: float, **attributes: Any) -> Any:
            span = self.tracer.start_span(
                name,
                context=parent,
                start_time=state.ns(start),
                attributes={k: v for k, v in attributes.items() if v is not None},
            )
            return span, state.ns(max(start, end))

        def next_mark(after: float, *marks: float | None) -> float:
            return min([m for m in marks if m is not None and m >= after] or [finished])

        received = state.received_at
        admission_end = next_mark(
            received, state.cache_at, state.route_at, first_attempt, state.fallback_at
        )
        spans = [child("edgeproxy.admission", received, admission_end)]
        if state.cache_at is not None:
            end = next_mark(state.cache_at, state.route_at, first_attempt, state.fallback_at)
            spans.append(
                child("edgeproxy.cache", state.cache_at, end, **{"edgeproxy.cache": out.cache})
            )
        if state.route_at is not None:
            end = next_mark(state.route_at, first_attempt, state.fallback_at)
            spans.append(child("edgeproxy.routing", state.route_at, end))
        if state.fallback_at is not None:
            spans.append(
                child(
                    "edgeproxy.fallback",
                    state.fallback_at,
                    finished,
                    **{
                        "edgeproxy.reason": state.fallback_reason,
                        "edgeproxy.degraded": out.degraded,
                    },
                )
            )
        for span, end_ns in spans:
            span.end(end_time=end_ns)

        for i, attempt in enumerate(state.attempts):
            if attempt.answered:
                end = finished
            else:
                later = state.attempts[i + 1].started if i + 1 < len(state.attempts) else None
                end = next_mark(attempt.started, later, state.fallback_at)
                attempt.span.set_status(Status(StatusCode.ERROR, "no response"))
            attempt.span.end(end_time=state.ns(max(end, attempt.started)))

        root.set_attribute("http.response.status_code", out.status)
        root.set_attribute("edgeproxy.attempts", out.attempts)
        for key, value in (
            ("edgeproxy.region", out.region),
            ("edgeproxy.cache", out.cache),
            ("edgeproxy.degraded", out.degraded),
        ):
            if value is not None:
                root.set_attribute(key, value)
        if out.error:
            root.set_attribute("edgeproxy.error", out.error[:_ERROR_LIMIT])
        if out.status >= 500 or (out.status == 0 and out.error):
            root.set_status(
                Status(
                    StatusCode.ERROR,
                    (out.error or f"HTTP {out.status}")[:_ERROR_LIMIT],
                )
            )
        root.end(end_time=state.ns(finished))

    def _genai(self, ctx: RequestContext, state: _RequestTrace, finished: float) -> None:
        """The request's GenAI span (beside the stages, under the request's span) and
        metrics, when it was one of an LLM API."""
        op = describe(
            ctx,
            sent=state.sent,
            servers=self._servers,
            providers=self.config.genai_providers,
            local_model=self._local_model,
        )
        if op is None:
            return
        if self.genai_metrics is not None:
            self.genai_metrics.record(op, ctx, finished)
        tracer = self.genai_tracer
        if tracer is None or not state.root.is_recording():
            return
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        # In the proxy's own process the local model is no remote call.
        local = ctx.outcome.degraded == "local-model" and not state.sent
        span = tracer.start_span(
            op.span_name,
            context=trace.set_span_in_context(state.root),
            kind=SpanKind.INTERNAL if local else SpanKind.CLIENT,
            start_time=state.ns(ctx.started),
            attributes=op.key_attributes(),
        )
        span.set_attributes(span_attributes(op, ctx))
        if op.error_type is not None:
            span.set_status(Status(StatusCode.ERROR, op.error_type))
        span.end(end_time=state.ns(max(finished, ctx.started)))
