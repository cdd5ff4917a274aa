"""Per-route policy: ``[[routes]]``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from edgeproxy._core.config.base import Section
from edgeproxy._core.config.checks import UrlPath
from edgeproxy._core.config.kinds import (
    CountOrZero,
    FiniteNonNegative,
    FinitePositive,
    Name,
    Positive,
)

__all__ = ["DEFAULT_FALLBACK", "PASSABLE_RESPONSE_HEADERS", "FallbackRung", "RouteConfig"]


FallbackRung = Literal["lighter", "stale", "local"]
DEFAULT_FALLBACK: tuple[FallbackRung, ...] = ("stale", "local")

# A region's response headers that a browser keeps as policy for the proxy's whole origin
# (cookies, HSTS, alternative services, site-data clearing, network error reports), or
# that report the region's load to the proxy: an operator may pass them on a route
# (pass_response_headers), no region may set them alone. Other region headers either
# always pass or never do (hop-by-hop, credentials, the proxy's own X-Edgeproxy-*).
PASSABLE_RESPONSE_HEADERS = frozenset(
    {
        "set-cookie",
        "strict-transport-security",
        "alt-svc",
        "clear-site-data",
        "nel",
        "report-to",
        "endpoint-load-metrics",
        "endpoint-load-metrics-bin",
    }
)


class RouteConfig(Section):
    """Per-route policy, matched on the request path.

    The longest ``path`` prefix that matches wins; a request that matches no
    ``[[routes]]`` entry uses a built-in route named ``default`` with every
    key at its default. Feature sections (cache, routing, admission,
    fallback) read their per-route keys from here.
    """

    name: Name = Field(..., description="Unique route name, used in metrics and logs.")
    path: UrlPath = Field(
        ..., description="Path prefix this route matches, e.g. '/v1/chat/completions'."
    )
    methods: list[str] = Field(
        default_factory=list,
        description="HTTP methods this route matches; empty means every method.",
    )
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Most extra attempts on other regions when one fails before the first "
        "byte (idempotent methods and LLM POSTs only), within [routing] retry_budget.",
    )
    deadline: Positive = Field(
        30.0,
        description="Seconds from arrival to the first response byte, all attempts and hedges "
        "included; past it the client gets 504 (or the fallback answer).",
    )
    hedge: bool = Field(
        False,
        description="Hedge requests: with no first byte after hedge_delay, send a copy to the "
        "next-best region and keep the first to answer, within [routing] hedge_budget.",
    )
    hedge_delay: float | None = Field(
        None,
        gt=0,
        description="Seconds before hedging; unset means the region's recent p95 time to first "
        "byte.",
    )
    fallback: list[FallbackRung] = Field(
        default_factory=lambda: list(DEFAULT_FALLBACK),
        description="The degradation ladder when no region can answer, in order: 'lighter' (a "
        "smaller model in the regions, from fallback_models), 'stale' (an expired cache "
        "entry) and 'local' (the [local_model]); empty turns fallback off.",
    )
    fallback_models: dict[str, list[str]] = Field(
        default_factory=dict,
        description="For the 'lighter' rung: each model's lighter models, tried in order, e.g. "
        '{ "llama-3.1-70b" = ["llama-3.1-8b"] }. A lighter model is routed like any '
        "request for it; a request too long for its context window skips it.",
    )
    larger_models: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Each model's models with larger context windows, tried in order when a "
        "region refuses a request as too long for the model (a 400 in any server's wording) "
        "or when the request is known to be longer than the model's window (context_windows, "
        "or the regions' max_model_len), e.g. "
        '{ "llama-3.1-8b" = ["llama-3.1-8b-128k"] }. The answer carries X-Edgeproxy-Model.',
    )
    lighter_when_waiting: int | None = Field(
        None,
        ge=1,
        description="With 'lighter' in fallback: send a request to its lighter model before "
        "the regions when every region that would serve its model reports (fresh, in its "
        "load reports) at least this many requests waiting. Unset: only when they fail.",
    )
    lighter_max_priority: int | None = Field(
        None,
        description="lighter_when_waiting applies only to requests of at most this priority "
        "(e.g. 0: batch and low first). Unset: every priority.",
    )
    context_windows: dict[str, int] = Field(
        default_factory=dict,
        description="Context windows (tokens) of models, where the regions' /v1/models do not "
        "report them (vLLM's max_model_len): a request longer than a lighter model's window "
        "skips that model, and one longer than its own model's goes to its larger_models.",
    )
    deadline_action: Literal["cancel", "race"] = Field(
        "cancel",
        description="No first byte by the deadline: 'cancel' the upstream attempt and answer "
        "from the fallback, or 'race' them and keep whichever produces a byte first.",
    )
    fallback_retry_after: CountOrZero = Field(
        2,
        description="Retry-After seconds of the 503 sent when neither a region nor the "
        "fallback ladder can answer.",
    )
    continue_on_break: bool = Field(
        False,
        description="Continue a stream that breaks after tokens were sent on the next-best "
        "region able to, spliced into the client's stream: chat completions by the region's "
        "continuation method (or the local model), Anthropic Messages by an assistant "
        "prefill, deterministic stateless Responses by a reissue; off: the stream ends with "
        "an error event.",
    )
    max_continuations: CountOrZero = Field(
        1,
        description="Most continuations of one streamed answer (continue_on_break), within "
        "the route's deadline and [routing] retry_budget.",
    )
    sse_heartbeat: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Seconds without a first token after which a streaming request gets its "
        "200 text/event-stream headers and a ': waiting' comment, repeated at this interval "
        "until the first token; unset: off.",
    )
    race_continuations: bool = Field(
        True,
        description="Ask the two best regions for the rest of a broken stream at once and keep "
        "the first whose leg brings a token (the other is cancelled): a leg that breaks too "
        "then costs no second wait, for one more prefill per continuation.",
    )
    compress_sse: bool = Field(
        False,
        description="Compress this route's SSE streams for clients that accept it, each event "
        "flushed as it is written ([server] compression must be on).",
    )

    cache: Literal["auto", "always", "off"] = Field(
        "auto",
        description="Hot-answer cache on this route: 'auto' caches deterministic LLM requests "
        "(temperature 0 or a seed) and GETs the upstream marks public; 'always' caches any JSON "
        "POST answer as well; 'off' neither looks up nor stores.",
    )
    semantic_cache: bool = Field(
        False,
        description="Semantic cache on this route: a cacheable request whose last user message "
        "means the same as a cached one's, all else equal (tenant, model, API, sampling, "
        "tools, system prompt, earlier turns), is answered from it, marked SEMANTIC-HIT, once "
        "the verifier finds no difference that changes the answer (negation, numbers, "
        "names, direction, target language, format). Needs the cache on.",
    )
    semantic_threshold: float = Field(
        0.68,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="Least cosine similarity of the last user messages for a semantic "
        "candidate; the verifier then decides. The default was chosen on the tune half of "
        "bench/semantic_pairs.jsonl with the static embedder.",
    )
    cache_ttl: FinitePositive = Field(
        300.0,
        description="Seconds a cached answer of this route stays fresh.",
    )
    stale_while_revalidate: FiniteNonNegative = Field(
        0.0,
        description="Seconds past cache_ttl during which the stale answer is served (marked "
        "STALE) while one background request refreshes it.",
    )
    stale_if_error: FiniteNonNegative = Field(
        0.0,
        description="Seconds past cache_ttl during which the stale answer is served, marked "
        "degraded, when every region fails or the deadline passes.",
    )

    max_in_flight: int | None = Field(
        None,
        ge=1,
        description="Most requests of this route in flight at once, within [admission] "
        "max_in_flight; unset means no route cap.",
    )
    max_queue_time: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Seconds a request of this route may wait for a slot; unset means "
        "[admission] max_queue_time.",
    )
    on_overload: Literal["shed", "degrade"] = Field(
        "shed",
        description="When the queue cannot take the request: 'shed' answers 503 with "
        "Retry-After; 'degrade' answers from the fallback ladder (stale cache, local model).",
    )
    require_json: bool | None = Field(
        None,
        description="Require a JSON object body (400 otherwise) before any upstream work; unset "
        "means yes for POSTs to OpenAI LLM endpoints (chat/completions, completions, "
        "embeddings, responses).",
    )
    check_bodies: bool = Field(
        True,
        description="Refuse with a 400 in the API's error shape, before any region is asked, "
        "an LLM request every server of its API would refuse: a field of the wrong JSON type, "
        "no model, an empty conversation, temperature or top_p out of the API's range, a "
        "token bound below 1; off: such requests go to the regions, as any other.",
    )

    rate_limit_headers: bool = Field(
        True,
        description="Tell clients where they stand against [admission]'s limits, on every "
        "answer of the route (its 429s included), in their API's own headers: OpenAI's "
        "x-ratelimit-{limit,remaining,reset}-{requests,tokens}, Anthropic's "
        "anthropic-ratelimit-* on Messages; where a region sends its own, the stricter "
        "stands. Off: the limits are not revealed (a 429 keeps Retry-After).",
    )
    responses_state: Literal["owner", "edge"] = Field(
        "owner",
        description="Where a Responses chain's state (previous_response_id) lives: 'owner', "
        "at the region that stored it only; 'edge', held by the proxy as well (each stored "
        "response's input and output items, in [stateful]'s Redis), so that a chain whose "
        "owner is down, forgot it, or cannot store goes on at another region, its input "
        "expanded (marked X-Edgeproxy-State: edge).",
    )
    websocket: Literal["realtime", "any", "off"] = Field(
        "realtime",
        description="WebSocket handshakes this route takes: 'realtime' those to a Realtime "
        "endpoint (a path ending /realtime: routed by model, metered by its events); 'any' "
        "those to any path as well (relayed as they are: routing, limits and metrics only); "
        "'off' none (a handshake is answered as a plain request).",
    )

    pass_response_headers: list[str] = Field(
        default_factory=list,
        description="Region response headers this route passes to clients, of those dropped "
        "by default: 'set-cookie', 'strict-transport-security', 'alt-svc', "
        "'clear-site-data', 'nel', 'report-to' (policy a browser keeps for the proxy's "
        "whole origin) and 'endpoint-load-metrics', 'endpoint-load-metrics-bin' (a region's "
        "load report). A region's X-Edgeproxy-* and hop-by-hop headers never pass.",
    )

    @field_validator("methods")
    @classmethod
    def _upper_methods(cls, value: list[str]) -> list[str]:
        return [m.upper() for m in value]

    @field_validator("pass_response_headers")
    @classmethod
    def _passable(cls, value: list[str]) -> list[str]:
        # One spelling for one set of names: the relay keeps a drop set per list.
        names = sorted({name.strip().lower() for name in value})
        for name in names:
            if name not in PASSABLE_RESPONSE_HEADERS:
                passable = ", ".join(sorted(PASSABLE_RESPONSE_HEADERS))
                raise ValueError(f"{name!r} is not a header a route can pass (one of {passable})")
        return names

    @field_validator("fallback")
    @classmethod
    def _unique_rungs(cls, value: list[str]) -> list[str]:
        for rung in value:
            if value.count(rung) > 1:
                raise ValueError(f"lists {rung!r} twice")
        return value

    @model_validator(mode="after")
    def _lighter_needs_models(self) -> RouteConfig:
        if "lighter" in self.fallback and not self.fallback_models:
            raise ValueError("fallback lists 'lighter' but fallback_models names no lighter model")
        for model, lighter in self.fallback_models.items():
            if model in lighter:
                raise ValueError(f"fallback_models: {model!r} lists itself as lighter")
        for model, larger in self.larger_models.items():
            if model in larger:
                raise ValueError(f"larger_models: {model!r} lists itself as larger")
        for model, window in self.context_windows.items():
            if window < 1:
                raise ValueError(f"context_windows: {model!r} must be at least 1 token")
        return self

    def matches(self, method: str, path: str) -> bool:
        """Whether a request with ``method`` and ``path`` belongs to this route.

        Prefixes match on segment boundaries: ``/v1/chat`` matches
        ``/v1/chat/completions`` but not ``/v1/chatter``.
        """
        if self.methods and method not in self.methods:
            return False
        prefix = self.path.rstrip("/")
        return not prefix or path == prefix or path.startswith(prefix + "/")
