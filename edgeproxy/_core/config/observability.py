"""What the proxy reports: ``[metrics]``, ``[tracing]`` and ``[access_log]``."""

from __future__ import annotations

import math
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, ValidationInfo, field_validator

from edgeproxy._core.config.base import Section
from edgeproxy._core.config.checks import one_of
from edgeproxy._core.config.kinds import Count, Name, Positive, Share

__all__ = ["DEFAULT_LATENCY_BUCKETS", "AccessLogConfig", "MetricsConfig", "TracingConfig"]


# Latency buckets for LLM traffic: a cached answer takes a millisecond, a long
# generation two minutes.
DEFAULT_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class MetricsConfig(Section):
    """Prometheus metrics at the admin ``/metrics``, recent latency percentiles in ``/status``."""

    enabled: bool = Field(
        True,
        description=(
            "Observe every request (histograms, /status percentiles) and serve Prometheus "
            "metrics at the admin /metrics."
        ),
    )
    buckets: list[float] = Field(
        default_factory=lambda: list(DEFAULT_LATENCY_BUCKETS),
        description="Upper bounds, in seconds, of the latency histograms' buckets.",
    )
    window: float = Field(
        300.0,
        description="Seconds of history behind the latency percentiles and charts of /status.",
    )
    window_step: float = Field(
        10.0, description="Seconds per point of the latency series in /status."
    )
    multiprocess_sync_interval: Positive = Field(
        1.0,
        description=(
            "With PROMETHEUS_MULTIPROC_DIR set (one process per core): seconds between copies "
            "of this worker's /status counters into the shared metric files."
        ),
    )

    @field_validator("buckets")
    @classmethod
    def _check_buckets(cls, value: list[float]) -> list[float]:
        if not value:
            raise ValueError("must list at least one bucket")
        if any(not math.isfinite(b) or b <= 0 for b in value):
            raise ValueError("must be positive finite numbers of seconds")
        if any(b >= c for b, c in zip(value, value[1:], strict=False)):
            raise ValueError("must be strictly increasing")
        return value

    @field_validator("window")
    @classmethod
    def _check_window(cls, value: float) -> float:
        if not math.isfinite(value) or not 10 <= value <= 86400:
            raise ValueError("must be between 10 and 86400 seconds")
        return value

    @field_validator("window_step")
    @classmethod
    def _check_step(cls, value: float, info: ValidationInfo) -> float:
        if not math.isfinite(value) or value < 1:
            raise ValueError("must be at least 1 second")
        window = info.data.get("window")
        if window is not None:
            if value > window:
                raise ValueError("must not be longer than metrics.window")
            if window / value > 1000:
                raise ValueError("must be at least metrics.window / 1000 (too many points)")
        return value


class TracingConfig(Section):
    """OpenTelemetry spans. W3C ``traceparent`` is propagated whether or not they are on."""

    otel: bool = Field(
        False,
        description=(
            "Make OpenTelemetry spans: the request, admission, cache, routing, each upstream "
            "attempt and the fallback (needs the 'otel' extra)."
        ),
    )
    exporter: Annotated[str, one_of("otlp", "console", "global")] = Field(
        "otlp",
        description=(
            "'otlp' (batched OTLP export), 'console' (spans printed, for debugging) or 'global' "
            "(the application's own global TracerProvider, when embedding)."
        ),
    )
    otlp_endpoint: str | None = Field(
        None,
        description=(
            "OTLP traces endpoint, e.g. 'http://collector:4318/v1/traces'; unset uses the "
            "OTEL_EXPORTER_OTLP_* environment variables and the exporter's default."
        ),
    )
    otlp_protocol: Annotated[str, one_of("http/protobuf", "grpc")] = Field(
        "http/protobuf", description="'http/protobuf' or 'grpc'."
    )
    otlp_headers: dict[str, str] = Field(
        default_factory=dict,
        description="Headers sent with every OTLP export, e.g. a collector API key.",
        repr=False,
    )
    otlp_timeout: Positive = Field(10.0, description="Seconds one OTLP export may take.")
    service_name: Name = Field(
        "edgeproxy", description="The spans' service.name resource attribute."
    )
    sample_ratio: Share = Field(
        1.0,
        description="Share of new traces recorded; a caller's sampled flag is always followed.",
    )
    genai: bool = Field(
        True,
        description=(
            "With otel: a span per LLM request named '{gen_ai.operation.name} "
            "{gen_ai.request.model}' with the attributes of OpenTelemetry's GenAI semantic "
            "conventions (v1.41.0), beside the edgeproxy.* spans, which stay as they are."
        ),
    )
    genai_metrics: bool = Field(
        True,
        description=(
            "With otel and genai: the GenAI metrics (gen_ai.client.token.usage, "
            "gen_ai.client.operation.duration, gen_ai.server.time_to_first_token, "
            "gen_ai.server.time_per_output_token) through an OpenTelemetry MeterProvider, "
            "exported as the spans are; the Prometheus metrics do not change."
        ),
    )
    genai_providers: dict[str, str] = Field(
        default_factory=dict,
        description=(
            'gen_ai.provider.name by region name, e.g. {"eu-azure" = "azure.ai.openai"}; '
            "a region not named here reports the provider of the API the client spoke "
            "('openai', or 'anthropic' for Messages). Names of no region are ignored."
        ),
    )
    otlp_metrics_endpoint: str | None = Field(
        None,
        description=(
            "OTLP metrics endpoint, e.g. 'http://collector:4318/v1/metrics'; unset: "
            "otlp_endpoint with /v1/traces turned into /v1/metrics (grpc: the same "
            "endpoint), else the OTEL_EXPORTER_OTLP_* environment variables."
        ),
    )
    metrics_export_interval: Positive = Field(
        60.0, description="Seconds between two exports of the GenAI metrics."
    )

    @field_validator("genai_providers")
    @classmethod
    def _check_providers(cls, value: dict[str, str]) -> dict[str, str]:
        for region, provider in value.items():
            if not provider.strip():
                raise ValueError(f"region {region!r} names an empty provider")
        return value

    @field_validator("otlp_endpoint", "otlp_metrics_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("must be an http:// or https:// URL")
        return value


class AccessLogConfig(Section):
    """The JSON-lines access log (``edgeproxy.plugins.access_log``, built in)."""

    enabled: bool = Field(
        False,
        description=(
            "Write one JSON line per request: ids, route, region, attempts, cache outcome, "
            "status, bytes, timings and degraded reason; never prompts or answers."
        ),
    )
    path: str = Field(
        "-", description="File to append to; '-' sends lines to the 'edgeproxy.access' logger."
    )
    queue_size: Count = Field(
        10000,
        description=(
            "Lines waiting for the writer thread at most; beyond that lines are dropped "
            "(and counted) rather than slow requests down."
        ),
    )

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a file path, or '-' for the edgeproxy.access logger")
        return value
