"""OpenTelemetry's GenAI semantic conventions for the proxy's LLM requests.

:class:`~edgeproxy._observability.tracing.Tracing` reads a finished request with
:func:`describe`, then makes its GenAI span from :func:`span_attributes` and records
:class:`GenAIMetrics`. Names, types and values follow one version of the conventions,
:data:`SEMCONV_VERSION` (the last release of ``open-telemetry/semantic-conventions`` that
defines the GenAI ones, the spans, ``gen_ai.client.token.usage`` and the server metrics
among them); the proxy's own facts go under ``edgeproxy.``.

Nothing here reads a response body: what the answer says comes from the request's
outcome (its usage, status, timings), and the model that answered from what the proxy
asked of the region that answered (a region's ``model_aliases``, the ladder's lighter
model, the local model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

from edgeproxy._protocol.endpoints import openai_endpoint

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext

__all__ = [
    "SCHEMA_URL",
    "SEMCONV_VERSION",
    "GenAIMetrics",
    "Operation",
    "describe",
    "server_of",
    "span_attributes",
]

SEMCONV_VERSION: Final = "1.41.0"
"""The version of OpenTelemetry's semantic conventions the GenAI telemetry follows."""
SCHEMA_URL: Final = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"

# The endpoint's name -> gen_ai.operation.name, the provider of its API, openai.api.type.
# The Responses API and Messages are chat operations; a Realtime session holds many
# responses, which no well-known operation describes, so it gets a value of its own.
_APIS: Final[dict[str, tuple[str, str, str | None]]] = {
    "chat.completions": ("chat", "openai", "chat_completions"),
    "completions": ("text_completion", "openai", None),
    "embeddings": ("embeddings", "openai", None),
    "responses": ("chat", "openai", "responses"),
    "messages": ("chat", "anthropic", None),
    "realtime": ("realtime", "openai", "realtime"),
}

# The buckets the conventions advise, for each metric.
_TOKEN_BUCKETS: Final = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
_DURATION_BUCKETS: Final = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
_TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
_TPOT_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip

# Answers no model produced for this request: its tokens were not spent again.
_FROM_CACHE: Final = frozenset({"HIT", "STALE", "COALESCED"})

# error.type of an answer that began well and ended early (outcome.error), by its start.
_EARLY_ENDS: Final = (
    ("upstream broke mid-body", "upstream_broken"),
    ("client disconnected", "client_disconnected"),
    ("cut at the end of the shutdown", "shutdown"),
)


def server_of(url: str) -> tuple[str, int] | None:
    """``server.address`` and ``server.port`` of a region's URL."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        return None
    try:
        port = parts.port
    except ValueError:
        return None
    return host, port if port is not None else (443 if parts.scheme == "https" else 80)


@dataclass(slots=True)
class Operation:
    """What the GenAI conventions say of one finished request."""

    name: str
    """``gen_ai.operation.name``."""
    dialect: str
    """The endpoint's name (``chat.completions``...): which API's fields to read."""
    provider: str
    api_type: str | None
    request_model: str | None
    response_model: str | None
    server: tuple[str, int] | None
    error_type: str | None
    from_model: bool
    """The answer was produced for this request (not served from the cache)."""

    @property
    def span_name(self) -> str:
        model = self.request_model
        return f"{self.name} {model}" if model else self.name

    def key_attributes(self) -> dict[str, Any]:
        """The attributes a sampler may look at, given when the span starts; the metrics'."""
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": self.name,
            "gen_ai.provider.name": self.provider,
        }
        if self.request_model:
            attrs["gen_ai.request.model"] = self.request_model
        if self.server is not None:
            attrs["server.address"], attrs["server.port"] = self.server
        return attrs


def describe(
    ctx: RequestContext,
    *,
    sent: dict[str, str | None],
    servers: dict[str, tuple[str, int] | None],
    providers: dict[str, str],
    local_model: str | None,
) -> Operation | None:
    """The GenAI operation ``ctx`` was, or None for a request of no LLM API.

    ``sent``: by region, the model last asked of it for this request; ``servers``: each
    region's address; ``providers``: ``[tracing] genai_providers``; ``local_model``: the
    local model's name.
    """
    facts = ctx.facts
    if facts is not None:
        dialect = facts.dialect
        model = facts.model
    else:
        # Refused before its facts were fixed (admission): what its path and body say.
        endpoint = openai_endpoint(ctx.path)
        dialect = endpoint.name if endpoint is not None else None
        body = ctx.json if ctx.body_read else None
        named = body.get("model") if isinstance(body, dict) else None
        model = named if isinstance(named, str) else None
    api = _APIS.get(dialect) if dialect is not None else None
    if api is None or dialect is None:
        return None
    name, provider, api_type = api
    out = ctx.outcome
    region = out.region
    if region is not None:
        provider = providers.get(region, provider)
    cache = out.cache
    from_cache = cache in _FROM_CACHE or out.degraded == "stale-cache"
    # The model that answered: the stored answer's own word where the edge keeps it, else
    # what was asked of the region that answered (its alias of the client's model, or the
    # ladder's lighter one), the local model, or, from the cache, the model asked for.
    # An error answer came from no model.
    answered: str | None = None
    stored = out.stored
    if not 0 < out.status < 400 or out.degraded == "plugin":
        answered = None
    elif stored is not None and isinstance(stored.get("model"), str):
        answered = stored["model"]
    elif out.degraded == "local-model":
        answered = local_model
    elif region is not None and sent.get(region) is not None:
        answered = sent[region]
    else:
        answered = ctx.model or model
    return Operation(
        name=name,
        dialect=dialect,
        provider=provider,
        api_type=api_type,
        request_model=model,
        response_model=answered,
        # Only a region this request was sent to: a cached answer contacted none.
        server=(
            servers.get(region)
            if region is not None and region in sent and out.degraded != "local-model"
            else None
        ),
        error_type=error_type(ctx),
        from_model=not from_cache and out.degraded != "plugin",
    )


def error_type(ctx: RequestContext) -> str | None:
    """``error.type``: the status sent for an error answer; for an answer that began and
    ended early, why (``upstream_broken``, ``client_disconnected``, ``shutdown``,
    ``_OTHER``); None for a complete answer."""
    out = ctx.outcome
    if out.status >= 400:
        return str(out.status)
    error = out.error
    if not error:
        return None
    for start, kind in _EARLY_ENDS:
        if error.startswith(start):
            return kind
    return "_OTHER"


# -- span attributes -----------------------------------------------------------------------


def span_attributes(op: Operation, ctx: RequestContext) -> dict[str, Any]:
    """The GenAI span's attributes besides :meth:`Operation.key_attributes`."""
    out = ctx.outcome
    attrs: dict[str, Any] = {}
    if op.api_type is not None:
        attrs["openai.api.type"] = op.api_type
    if op.response_model:
        attrs["gen_ai.response.model"] = op.response_model
    stored = out.stored
    if stored is not None and isinstance(stored.get("id"), str):
        attrs["gen_ai.response.id"] = stored["id"]
    if op.error_type is not None:
        attrs["error.type"] = op.error_type
    facts = ctx.facts
    if facts is not None and facts.stream:
        attrs["gen_ai.request.stream"] = True
        if out.first_byte_at is not None and op.error_type is None:
            attrs["gen_ai.response.time_to_first_chunk"] = max(0.0, out.first_byte_at - ctx.started)
    body = ctx.json if ctx.body_read else None
    if isinstance(body, dict):
        attrs.update(request_attributes(op.dialect, body))
    attrs.update(usage_attributes(op.dialect, out.usage))
    # The proxy's own account of the request.
    attrs["edgeproxy.route"] = ctx.route.name
    attrs["edgeproxy.attempts"] = out.attempts
    attrs["edgeproxy.hedged"] = out.hedged
    for key, value in (
        ("edgeproxy.region", out.region),
        ("edgeproxy.cache", out.cache),
        ("edgeproxy.degraded", out.degraded),
    ):
        if value is not None:
            attrs[key] = value
    if out.continuations:
        attrs["edgeproxy.continuations"] = len(out.continuations)
        attrs["edgeproxy.continued_to"] = out.continuations[-1].target
    if out.usage is not None and out.usage.get("estimated") is True:
        attrs["edgeproxy.usage_estimated"] = True
    return attrs


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _double(value: Any) -> float | None:
    if type(value) in (int, float) and math.isfinite(value):
        return float(value)
    return None


def _strings(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _output_type(format_type: Any) -> str | None:
    if format_type in ("json_object", "json_schema"):
        return "json"
    return "text" if format_type == "text" else None


def request_attributes(dialect: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request's parameters as the conventions name them, read from its JSON body."""
    attrs: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        if value is not None:
            attrs[key] = value

    if dialect == "embeddings":
        put("gen_ai.embeddings.dimension.count", _int(body.get("dimensions")))
        put("gen_ai.request.encoding_formats", _strings(body.get("encoding_format")))
        return attrs
    if dialect == "realtime":
        return attrs
    for name in ("temperature", "top_p"):
        put(f"gen_ai.request.{name}", _double(body.get(name)))
    if dialect == "messages":
        put("gen_ai.request.max_tokens", _int(body.get("max_tokens")))
        put("gen_ai.request.top_k", _double(body.get("top_k")))
        put("gen_ai.request.stop_sequences", _strings(body.get("stop_sequences")))
        return attrs
    service_tier = body.get("service_tier")
    if isinstance(service_tier, str) and service_tier != "auto":
        attrs["openai.request.service_tier"] = service_tier
    if dialect == "responses":
        put("gen_ai.request.max_tokens", _int(body.get("max_output_tokens")))
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        put("gen_ai.output.type", _output_type(fmt.get("type") if isinstance(fmt, dict) else None))
        conversation = body.get("conversation")
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
        if isinstance(conversation, str) and conversation:
            attrs["gen_ai.conversation.id"] = conversation
        return attrs
    # Chat completions and (legacy) completions.
    limit = _int(body.get("max_completion_tokens"))
    put("gen_ai.request.max_tokens", limit if limit is not None else _int(body.get("max_tokens")))
    for name in ("frequency_penalty", "presence_penalty"):
        put(f"gen_ai.request.{name}", _double(body.get(name)))
    put("gen_ai.request.seed", _int(body.get("seed")))
    put("gen_ai.request.stop_sequences", _strings(body.get("stop")))
    choices = _int(body.get("n"))
    if choices is not None and choices != 1:
        attrs["gen_ai.request.choice.count"] = choices
    fmt = body.get("response_format")
    put("gen_ai.output.type", _output_type(fmt.get("type") if isinstance(fmt, dict) else None))
    return attrs


def _detail(usage: dict[str, Any], holder: str, key: str) -> int | None:
    details = usage.get(holder)
    return _int(details.get(key)) if isinstance(details, dict) else None


def tokens(dialect: str, usage: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """Input tokens (cached ones included) and output tokens of a counted answer's usage;
    None for a count the usage lacks, or only estimated."""
    if not usage or usage.get("estimated") is True:
        return None, None
    # The dialects' own counts (prompt_tokens) already sum what an API counts apart:
    # Anthropic's cache reads and writes, for one.
    output = None if dialect == "embeddings" else _int(usage.get("completion_tokens"))
    return _int(usage.get("prompt_tokens")), output


def usage_attributes(dialect: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    """``gen_ai.usage.*`` of the answer's usage, in each API's own detail fields."""
    attrs: dict[str, Any] = {}
    input_tokens, output_tokens = tokens(dialect, usage)
    if usage is None or input_tokens is None and output_tokens is None:
        return attrs
    if input_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = input_tokens
    if output_tokens is not None:
        attrs["gen_ai.usage.output_tokens"] = output_tokens
    cache_read = cache_creation = reasoning = None
    if dialect == "messages":
        cache_read = _int(usage.get("cache_read_input_tokens"))
        cache_creation = _int(usage.get("cache_creation_input_tokens"))
    elif dialect == "responses":
        cache_read = _detail(usage, "input_tokens_details", "cached_tokens")
        cache_creation = _detail(usage, "input_tokens_details", "cache_write_tokens")
        reasoning = _detail(usage, "output_tokens_details", "reasoning_tokens")
    elif dialect == "realtime":
        cache_read = _int(usage.get("cached_tokens"))
    else:
        cache_read = _detail(usage, "prompt_tokens_details", "cached_tokens")
        reasoning = _detail(usage, "completion_tokens_details", "reasoning_tokens")
    for key, value in (
        ("gen_ai.usage.cache_read.input_tokens", cache_read),
        ("gen_ai.usage.cache_creation.input_tokens", cache_creation),
        ("gen_ai.usage.reasoning.output_tokens", reasoning),
    ):
        if value is not None:
            attrs[key] = value
    return attrs


# -- metrics ---------------------------------------------------------------------------------


class GenAIMetrics:
    """The GenAI metrics' instruments on one meter, and what a finished request records."""

    def __init__(self, meter: Any) -> None:
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
        )
        self.duration = meter.create_histogram(
            "gen_ai.client.operation.duration",
            unit="s",
            description="GenAI operation duration.",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self.time_to_first_token = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS,
        )
        self.time_per_output_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description=(
                "Time per output token generated after the first token for successful responses."
            ),
            explicit_bucket_boundaries_advisory=_TPOT_BUCKETS,
        )

    def record(self, op: Operation, ctx: RequestContext, finished: float) -> None:
        out = ctx.outcome
        attrs = op.key_attributes()
        if op.response_model:
            attrs["gen_ai.response.model"] = op.response_model
        duration = max(0.0, finished - ctx.started)
        if op.error_type is None:
            self.duration.record(duration, attrs)
        else:
            self.duration.record(duration, {**attrs, "error.type": op.error_type})
        if not op.from_model:
            # Served from the cache: no tokens spent, and no model's latency to report.
            return
        input_tokens, output_tokens = tokens(op.dialect, out.usage)
        if input_tokens is not None:
            self.token_usage.record(input_tokens, {**attrs, "gen_ai.token.type": "input"})
        if output_tokens is not None:
            self.token_usage.record(output_tokens, {**attrs, "gen_ai.token.type": "output"})
        first = out.first_byte_at
        # The first token is known only where the answer streams; a Realtime session's
        # first byte is no answer's first token.
        if (
            op.error_type is not None
            or first is None
            or not out.response_is_sse
            or op.dialect in ("embeddings", "realtime")
        ):
            return
        self.time_to_first_token.record(max(0.0, first - ctx.started), attrs)
        if output_tokens is not None and output_tokens > 1:
            per_token = max(0.0, finished - first) / (output_tokens - 1)
            self.time_per_output_token.record(per_token, attrs)
