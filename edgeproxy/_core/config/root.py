"""The one typed configuration, loaded from TOML and ``EDGEPROXY_*`` variables.

Every key is a field here with a description; ``edgeproxy config-docs``
renders them and a test keeps the README's table in step. Keys mirror the
CLI flags (``[server] port`` is ``--port``). Validation collects every
problem at once and names each key with the reason, so ``check-config``
can list them all.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = [
    "AccessLogConfig",
    "AdmissionConfig",
    "AdminConfig",
    "CacheConfig",
    "Config",
    "ConfigError",
    "GeoConfig",
    "HealthConfig",
    "LimitsConfig",
    "LocalModelConfig",
    "MetricsConfig",
    "PluginsConfig",
    "PopConfig",
    "RegionConfig",
    "RouteConfig",
    "RoutingConfig",
    "ServerConfig",
    "TracingConfig",
    "UpstreamConfig",
    "load_config",
]

ENV_PREFIX = "EDGEPROXY_"
# RFC 9110 field-name token.
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")

_EU: Final = "AT BE BG HR CY CZ DK EE FI FR DE GR IE IT LV LT LU MT NL PL PT RO SK SI ES SE".split()
BUILTIN_GROUPS: Final[dict[str, frozenset[str]]] = {
    "EU": frozenset(_EU),
    "EEA": frozenset([*_EU, "IS", "LI", "NO"]),
}
"""Country groups residency rules may name without defining them."""


class ConfigError(ValueError):
    """The configuration is invalid. ``errors`` holds one ``key: reason`` line per problem."""

    def __init__(self, errors: list[str], *, source: str | None = None) -> None:
        self.errors = errors
        self.source = source
        where = f" in {source}" if source else ""
        super().__init__(f"invalid configuration{where}:\n  " + "\n  ".join(errors))


class _Section(BaseModel):
    # Unknown keys are errors: a typo like `prot = 8080` must not be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class ServerConfig(_Section):
    """The client-facing listener."""

    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(8080, ge=0, le=65535, description="Port the proxy listens on (0 picks one).")
    grace_period: float = Field(
        30.0,
        ge=0,
        description="Seconds that in-flight requests, streams included, get to finish on SIGTERM.",
    )
    preserve_host: bool = Field(
        False,
        description="Forward the client's Host header instead of rewriting it to the upstream's.",
    )
    forward_client_credentials: bool = Field(
        False,
        description=(
            "Forward the client's Authorization and api-key headers upstream. Off by default: "
            "regions get their own credentials from [[regions]]."
        ),
    )
    via_name: str = Field(
        "",
        description="Pseudonym used in the Via header; empty means the PoP name.",
    )
    backlog: int = Field(1024, ge=1, description="Listen backlog of the server socket.")
    reuse_port: bool = Field(
        False,
        description=(
            "Bind with SO_REUSEPORT, so that several edgeproxy processes (one per core) share "
            "the port and the kernel spreads connections; give each its own admin port."
        ),
    )


class AdminConfig(_Section):
    """The admin listener: health, readiness and status. Keep it off the public network."""

    enabled: bool = Field(True, description="Serve the admin listener.")
    host: str = Field(
        "127.0.0.1", description="Address of the admin listener (loopback by default)."
    )
    port: int = Field(9901, ge=0, le=65535, description="Port of the admin listener (0 picks one).")


class PopConfig(_Section):
    """Where this edge runs."""

    name: str = Field(
        "edge", min_length=1, description="Name of this PoP, shown in Via and /status."
    )
    lat: float = Field(0.0, ge=-90, le=90, description="Latitude of the PoP in degrees.")
    lon: float = Field(0.0, ge=-180, le=180, description="Longitude of the PoP in degrees.")


class UpstreamConfig(_Section):
    """Pool defaults for every region; a region may override ``http2``."""

    http2: bool = Field(
        True, description="Talk HTTP/2 to regions (h2c for http://, ALPN for https://)."
    )
    max_connections: int = Field(
        8,
        ge=1,
        description="Most connections per HTTP/2 region (each multiplexes many streams).",
    )
    http1_max_connections: int = Field(
        256,
        ge=1,
        description=(
            "Most connections per HTTP/1.1 region; each carries one request at a time, "
            "so this caps that region's concurrency, SSE streams included."
        ),
    )
    keepalive_expiry: float = Field(
        60.0, gt=0, description="Seconds an idle connection is kept before it is closed."
    )
    connect_timeout: float = Field(3.0, gt=0, description="Seconds to open a connection.")
    read_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds to wait for response headers and between body chunks.",
    )
    write_timeout: float = Field(10.0, gt=0, description="Seconds to send a request body chunk.")
    pool_timeout: float = Field(
        5.0, gt=0, description="Seconds to wait for a free connection or stream slot."
    )
    warm_connections: int = Field(
        1, ge=0, description="Connections opened per region at startup, before any request."
    )
    ping_interval: float = Field(
        15.0, gt=0, description="Seconds between HTTP/2 PINGs on idle connections."
    )
    verify_tls: bool = Field(True, description="Verify upstream TLS certificates.")
    ca_file: str | None = Field(
        None, description="CA bundle for upstream TLS; the system's if unset."
    )


class RegionConfig(_Section):
    """One regional cluster."""

    name: str = Field(
        ..., min_length=1, description="Unique region name, sent in X-Edgeproxy-Region."
    )
    url: str = Field(..., description="Base URL of the region: http:// (h2c) or https:// (ALPN).")
    http2: bool | None = Field(None, description="Override [upstream] http2 for this region.")
    urls: list[str] = Field(
        default_factory=list,
        description=(
            "More endpoints of the same region (same scheme rules as url); each gets its own "
            "pool and a request goes to the reachable endpoint with the fewest in flight."
        ),
    )
    lat: float = Field(0.0, description="Latitude of the region in degrees (-90..90).")
    lon: float = Field(0.0, description="Longitude of the region in degrees (-180..180).")
    weight: float = Field(
        1.0, description="Relative share of traffic among regions that perform alike (> 0)."
    )
    jurisdiction: str | None = Field(
        None,
        description="Legal jurisdiction of the region, e.g. 'eu' or 'us'; [geo] residency "
        "rules match it.",
    )
    tags: list[str] = Field(
        default_factory=list,
        description="More labels of the region; residency rules may name them like a jurisdiction.",
    )
    priority: int = Field(
        0,
        ge=0,
        description="Priority tier: tier 0 serves first; a higher tier gets requests only when "
        "no region of a lower tier is available, or as a failover target.",
    )
    api_key: str | None = Field(
        None,
        description="Credential sent as 'Authorization: Bearer …'. Prefer api_key_env.",
        repr=False,
    )
    api_key_env: str | None = Field(
        None, description="Name of the environment variable that holds the region's API key."
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="Extra headers injected into every upstream request to this region.",
        repr=False,
    )
    host_header: str | None = Field(
        None, description="Host (or :authority) to send; defaults to the URL's host."
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https"):
            raise ValueError("must be an http:// or https:// URL")
        if not parts.hostname:
            raise ValueError("has no host")
        try:
            parts.port  # noqa: B018 - raises on an invalid port
        except ValueError as exc:
            raise ValueError(f"has an invalid port ({exc})") from None
        if parts.query or parts.fragment:
            raise ValueError("must not have a query or fragment")
        if parts.username is not None or parts.password is not None:
            # URLs end up in errors, logs and /status: credentials belong in
            # api_key_env or headers, which are never shown.
            raise ValueError("must not contain credentials; use api_key_env or headers")
        return value

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, value: list[str]) -> list[str]:
        for index, url in enumerate(value):
            try:
                cls._check_url(url)
            except ValueError as exc:
                # By position, not by value: the URL itself may hold a secret.
                raise ValueError(f"entry {index} {exc}") from None
        return value

    @field_validator("lat")
    @classmethod
    def _check_lat(cls, value: float) -> float:
        if not (math.isfinite(value) and -90.0 <= value <= 90.0):
            raise ValueError(f"must be a latitude in degrees between -90 and 90, not {value}")
        return value

    @field_validator("lon")
    @classmethod
    def _check_lon(cls, value: float) -> float:
        if not (math.isfinite(value) and -180.0 <= value <= 180.0):
            raise ValueError(f"must be a longitude in degrees between -180 and 180, not {value}")
        return value

    @field_validator("weight")
    @classmethod
    def _check_weight(cls, value: float) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"must be a positive finite number, not {value}")
        return value

    def resolved_api_key(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The credential for this region: ``api_key``, else the variable ``api_key_env`` names."""
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            return (os.environ if environ is None else environ).get(self.api_key_env) or None
        return None


FallbackRung = Literal["stale", "local"]
DEFAULT_FALLBACK: tuple[FallbackRung, ...] = ("stale", "local")


class RouteConfig(_Section):
    """Per-route policy, matched on the request path.

    The longest ``path`` prefix that matches wins; a request that matches no
    ``[[routes]]`` entry uses a built-in route named ``default`` with every
    key at its default. Feature sections (cache, routing, admission,
    fallback) read their per-route keys from here.
    """

    name: str = Field(..., min_length=1, description="Unique route name, used in metrics and logs.")
    path: str = Field(
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
    deadline: float = Field(
        30.0,
        gt=0,
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
        description="The degradation ladder when no region can answer, in order: 'stale' (an "
        "expired cache entry) and 'local' (the [local_model]); empty turns fallback off.",
    )
    deadline_action: Literal["cancel", "race"] = Field(
        "cancel",
        description="No first byte by the deadline: 'cancel' the upstream attempt and answer "
        "from the fallback, or 'race' them and keep whichever produces a byte first.",
    )
    fallback_retry_after: int = Field(
        2,
        ge=0,
        description="Retry-After seconds of the 503 sent when neither a region nor the "
        "fallback ladder can answer.",
    )

    cache: Literal["auto", "always", "off"] = Field(
        "auto",
        description="Hot-answer cache on this route: 'auto' caches deterministic LLM requests "
        "(temperature 0 or a seed) and GETs the upstream marks public; 'always' caches any JSON "
        "POST answer as well; 'off' neither looks up nor stores.",
    )
    cache_ttl: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a cached answer of this route stays fresh.",
    )
    stale_while_revalidate: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds past cache_ttl during which the stale answer is served (marked "
        "STALE) while one background request refreshes it.",
    )
    stale_if_error: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
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

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        return value

    @field_validator("methods")
    @classmethod
    def _upper_methods(cls, value: list[str]) -> list[str]:
        return [m.upper() for m in value]

    @field_validator("fallback")
    @classmethod
    def _unique_rungs(cls, value: list[str]) -> list[str]:
        for rung in value:
            if value.count(rung) > 1:
                raise ValueError(f"lists {rung!r} twice")
        return value

    def matches(self, method: str, path: str) -> bool:
        """Whether a request with ``method`` and ``path`` belongs to this route.

        Prefixes match on segment boundaries: ``/v1/chat`` matches
        ``/v1/chat/completions`` but not ``/v1/chatter``.
        """
        if self.methods and method not in self.methods:
            return False
        prefix = self.path.rstrip("/")
        return not prefix or path == prefix or path.startswith(prefix + "/")


class RoutingConfig(_Section):
    """How a region is chosen: latency history, load, geo prior, retry and hedge budgets."""

    decay: float = Field(
        10.0,
        gt=0,
        description="Seconds over which a region's peak-EWMA latency forgets old samples "
        "(a slower sample counts at once).",
    )
    min_samples: int = Field(
        3,
        ge=1,
        description="Samples before a region's own latency fully replaces its geo prior.",
    )
    ms_per_1000km: float = Field(
        10.0,
        ge=0,
        description="Geo prior: expected round-trip milliseconds per 1000 km of great-circle "
        "distance, so that before any traffic the nearest region wins.",
    )
    prior_from: Literal["pop", "client"] = Field(
        "pop",
        description="Measure the geo prior from the PoP, or from the client's location when "
        "known (a proxy serving clients from far away).",
    )
    equal_within: float = Field(
        1.5,
        ge=1,
        description="Regions whose score (latency x (in flight + 1)) is within this factor of "
        "the best are equals: two of them are drawn by weight and the better wins.",
    )
    probe_decay: float = Field(
        10.0,
        gt=0,
        description="Seconds over which the latency penalty of a region that gets no traffic "
        "fades towards its prior, so that a recovered region is probed again.",
    )
    retry_budget: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Retries may be at most this share of requests over budget_window.",
    )
    retry_budget_min: float = Field(
        1.0,
        ge=0,
        description="Retries per second allowed whatever the traffic (for quiet PoPs).",
    )
    hedge_budget: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Hedged copies may be at most this share of requests over budget_window.",
    )
    hedge_budget_min: float = Field(
        0.1,
        ge=0,
        description="Hedged copies per second allowed whatever the traffic.",
    )
    budget_window: float = Field(
        10.0, gt=0, description="Seconds over which the retry and hedge budgets are counted."
    )
    retry_statuses: list[int] = Field(
        default_factory=lambda: [502, 503, 504],
        description="Region answers that count as a failure before the first byte and are "
        "retried on the next region.",
    )

    @field_validator("retry_statuses")
    @classmethod
    def _check_statuses(cls, value: list[int]) -> list[int]:
        for status in value:
            if not 500 <= status <= 599:
                raise ValueError(f"{status} is not a 5xx status")
        return value


class HealthConfig(_Section):
    """Active health checks, passive outlier ejection and per-region circuit breakers."""

    active: bool = Field(False, description="Probe every region's health path in the background.")
    path: str = Field("/healthz", description="Path of the active health check (GET, 2xx = ok).")
    interval: float = Field(5.0, gt=0, description="Seconds between two active checks.")
    timeout: float = Field(1.0, gt=0, description="Seconds an active check may take.")
    healthy_threshold: int = Field(
        2, ge=1, description="Passed checks in a row that make an unhealthy region healthy."
    )
    unhealthy_threshold: int = Field(
        3, ge=1, description="Failed checks in a row that make a region unhealthy."
    )
    outlier_detection: bool = Field(
        True, description="Eject regions that fail requests in a row (Envoy's model)."
    )
    consecutive_failures: int = Field(
        5,
        ge=1,
        description="5xx answers or connect/reset/timeout failures in a row that eject a region.",
    )
    base_ejection_time: float = Field(
        30.0,
        gt=0,
        description="Seconds of the first ejection; each further ejection lasts one base more.",
    )
    max_ejection_time: float = Field(
        300.0, gt=0, description="Longest ejection, however often a region was ejected."
    )
    max_ejection_percent: float = Field(
        50.0,
        ge=0,
        le=100,
        description="Most regions ejected at once, in percent (at least one may always be).",
    )
    outlier_interval: float = Field(
        10.0,
        gt=0,
        description="Seconds without an ejection after which a region's ejection multiplier "
        "goes down by one.",
    )
    max_concurrent: int = Field(
        1024, ge=1, description="Circuit breaker: most requests in flight per region."
    )
    max_pending: int = Field(
        1024,
        ge=1,
        description="Circuit breaker: most requests per region still waiting for their first byte.",
    )

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        return value

    @model_validator(mode="after")
    def _check_ejection_times(self) -> HealthConfig:
        if self.max_ejection_time < self.base_ejection_time:
            raise ValueError("max_ejection_time must not be shorter than base_ejection_time")
        return self


class GeoConfig(_Section):
    """Where clients are, and which regions may serve them (data residency)."""

    country_headers: list[str] = Field(
        default_factory=lambda: ["CF-IPCountry"],
        description="Headers holding the client's ISO country code, first match wins.",
    )
    geo_header: str = Field(
        "X-Client-Geo",
        description="Header holding the client's 'lat,lon' in degrees; '' to ignore it.",
    )
    trusted_peers: list[str] = Field(
        default_factory=list,
        description="Addresses or CIDR networks whose geo headers are believed; empty trusts "
        "every peer.",
    )
    maxmind_db: str | None = Field(
        None,
        description="MaxMind GeoLite2/GeoIP2 .mmdb file for clients without geo headers "
        "(needs the maxminddb package).",
    )
    residency: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Country code (or group such as 'EU', or '*' for every other client) -> "
        "jurisdictions, tags or region names allowed to serve it.",
    )
    country_groups: dict[str, list[str]] = Field(
        default_factory=dict,
        description="More country groups for residency keys, name -> country codes ('EU' and "
        "'EEA' are built in).",
    )

    @field_validator("trusted_peers")
    @classmethod
    def _check_peers(cls, value: list[str]) -> list[str]:
        import ipaddress

        for peer in value:
            try:
                ipaddress.ip_network(peer, strict=False)
            except ValueError:
                raise ValueError(f"{peer!r} is not an address or network") from None
        return value

    @field_validator("country_groups")
    @classmethod
    def _check_groups(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, countries in value.items():
            for code in countries:
                if len(code) != 2 or not code.isalpha():
                    raise ValueError(f"{name}: {code!r} is not a two-letter country code")
            out[name.upper()] = [c.upper() for c in countries]
        return out

    @model_validator(mode="after")
    def _check_residency_keys(self) -> GeoConfig:
        groups = set(BUILTIN_GROUPS) | set(self.country_groups)
        rules: dict[str, list[str]] = {}
        for key, allowed in self.residency.items():
            name = key.upper()
            if name != "*" and name not in groups and not (len(name) == 2 and name.isalpha()):
                raise ValueError(
                    f"residency: {key!r} is not a country code, a country group or '*'"
                )
            if not allowed:
                raise ValueError(f"residency.{key}: lists no jurisdiction or region")
            rules[name] = allowed
        # Assigning through __dict__ keeps validate_assignment from re-running this validator.
        self.__dict__["residency"] = rules
        return self


class LocalModelConfig(_Section):
    """The local llama.cpp model that answers when no region can (the ``local`` extra)."""

    path: str | None = Field(
        None,
        description="GGUF model file; unset turns the local model off. A relative path "
        "resolves against the config file's folder.",
    )
    n_gpu_layers: int = Field(
        0,
        ge=-1,
        description="Layers offloaded to the GPU (needs llama-cpp-python built with CUDA); "
        "-1 offloads all, 0 runs on the CPU.",
    )
    n_ctx: int = Field(
        4096, ge=64, description="Context window in tokens: the prompt plus the answer."
    )
    n_threads: int | None = Field(
        None, ge=1, description="CPU threads per generation; unset lets llama.cpp choose."
    )
    n_batch: int = Field(512, ge=1, description="Prompt tokens evaluated per batch.")
    chat_format: str = Field(
        "",
        description="Chat template: empty uses the model's own (GGUF tokenizer.chat_template); "
        "else a llama-cpp-python format name such as 'chatml', 'llama-3' or 'gemma'.",
    )
    max_tokens: int = Field(
        512,
        ge=1,
        description="Most tokens in one answer; a request asking for more gets this many.",
    )
    model_name: str = Field(
        "", description="Model name in answers; empty means 'local/<file name without .gguf>'."
    )
    concurrency: int = Field(
        1,
        ge=1,
        description="Generations at once; each has its own llama.cpp context and worker thread.",
    )
    max_queue: int = Field(
        16, ge=0, description="Requests that may wait for a generation slot; more get 503 now."
    )
    max_queue_wait: float = Field(
        5.0,
        ge=0,
        description="Seconds a request may wait for a generation slot before 503 with Retry-After.",
    )
    on_overflow: Literal["truncate", "refuse"] = Field(
        "truncate",
        description="A prompt longer than the context allows: 'truncate' drops the oldest "
        "messages (then tokens), 'refuse' answers 400 context_length_exceeded.",
    )
    ready_requires_model: bool = Field(
        False,
        description="Keep /readyz at 503 until the local model is loaded (and while it failed).",
    )

    @model_validator(mode="after")
    def _answer_fits(self) -> LocalModelConfig:
        if self.max_tokens >= self.n_ctx:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must be smaller than n_ctx ({self.n_ctx}), "
                "leaving room for the prompt"
            )
        return self


class CacheConfig(_Section):
    """The hot-answer cache: where entries live, their bounds, and how Redis faults are contained.

    Per-route freshness (``cache``, ``cache_ttl``, ``stale_while_revalidate``,
    ``stale_if_error``) lives on ``[[routes]]``.
    """

    enabled: bool = Field(True, description="Look up and store cacheable answers.")
    backend: Literal["memory", "redis", "tiered"] = Field(
        "memory",
        description="Where entries live: 'memory' (this process, LRU-bounded), 'redis' (shared "
        "by every PoP and worker) or 'tiered' (memory, then Redis; a Redis hit fills memory).",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis for the redis and tiered backends: redis:// or rediss:// (TLS), "
        "optionally with user:password@ and a /db number.",
        repr=False,
    )
    key_prefix: str = Field(
        "edgeproxy:",
        description="Prefix of every key the cache writes, so deployments can share one Redis.",
    )
    redis_username: str | None = Field(None, description="Redis ACL user name (AUTH).")
    redis_password: str | None = Field(
        None, description="Redis password (AUTH). Prefer redis_password_env.", repr=False
    )
    redis_password_env: str | None = Field(
        None, description="Name of the environment variable that holds the Redis password."
    )
    redis_tls: bool = Field(False, description="Use TLS for a redis:// URL too (rediss:// does).")
    redis_tls_ca_file: str | None = Field(
        None, description="CA bundle that verifies the Redis server; the system's if unset."
    )
    redis_tls_cert_file: str | None = Field(
        None, description="Client certificate for Redis mutual TLS (PEM)."
    )
    redis_tls_key_file: str | None = Field(
        None, description="Private key of redis_tls_cert_file (PEM)."
    )
    redis_tls_verify: bool = Field(
        True, description="Verify the Redis server's certificate and host name."
    )
    redis_timeout: float = Field(
        0.25,
        gt=0,
        allow_inf_nan=False,
        description="Seconds one Redis call may take; past it the cache gives up on that call "
        "and the request goes upstream (fail open).",
    )
    redis_connect_timeout: float = Field(
        0.5, gt=0, allow_inf_nan=False, description="Seconds to open a Redis connection."
    )
    redis_max_connections: int = Field(
        64, ge=1, description="Most connections in the Redis pool of each proxy process."
    )
    breaker_failures: int = Field(
        5,
        ge=1,
        description="Consecutive failed Redis calls (errors, timeouts) that open the circuit "
        "breaker: Redis is then not called at all for breaker_cooldown.",
    )
    breaker_cooldown: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds the breaker stays open before one probe call may close it again.",
    )
    max_entries: int = Field(
        10_000, ge=1, description="Most answers in the memory tier; least recently used go first."
    )
    max_bytes: int = Field(
        256 * 2**20,
        ge=1,
        description="Most bytes of answers in the memory tier; least recently used go first.",
    )
    max_entry_bytes: int = Field(
        4 * 2**20,
        ge=1,
        description="Largest answer stored; a bigger one is served but not cached (counted as "
        "too_large in /status).",
    )
    coalesce: bool = Field(
        True,
        description="Identical cacheable requests arriving while one is in flight wait for its "
        "answer (streams included) instead of going upstream.",
    )
    xfetch_beta: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="Early probabilistic refresh (XFetch) against stampedes at expiry: higher "
        "refreshes hot entries earlier; 0 turns it off.",
    )

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError("must be a redis:// or rediss:// URL")
        if not parts.hostname:
            raise ValueError("has no host")
        try:
            parts.port  # noqa: B018 - raises on an invalid port
        except ValueError as exc:
            raise ValueError(f"has an invalid port ({exc})") from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"database must be a number, not {db!r}")
        return value

    @model_validator(mode="after")
    def _check_sizes(self) -> CacheConfig:
        if self.max_entry_bytes > self.max_bytes:
            raise ValueError("max_entry_bytes must not exceed max_bytes")
        return self

    def resolved_redis_password(self, environ: Mapping[str, str] | None = None) -> str | None:
        """``redis_password``, else the variable ``redis_password_env`` names, else None."""
        if self.redis_password:
            return self.redis_password
        if self.redis_password_env:
            return (os.environ if environ is None else environ).get(self.redis_password_env)
        return None


class PluginsConfig(_Section):
    """Plugins to load, with their settings under ``[plugins.settings.NAME]``."""

    enabled: list[str] = Field(
        default_factory=list,
        description="Plugins by dotted module path or .py file path, loaded at app creation.",
    )
    entry_points: bool = Field(
        True,
        description="Also load plugins registered in the 'edgeproxy.plugins' entry-point group.",
    )
    fail_open: list[str] = Field(
        default_factory=list,
        description="Plugins whose request-time errors are logged and skipped instead of a 500.",
    )
    settings: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-plugin settings, keyed by the plugin's name."
    )


# Latency buckets for LLM traffic: a cached answer takes a millisecond, a long
# generation two minutes.
DEFAULT_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class MetricsConfig(_Section):
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
    multiprocess_sync_interval: float = Field(
        1.0,
        gt=0,
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


class TracingConfig(_Section):
    """OpenTelemetry spans. W3C ``traceparent`` is propagated whether or not they are on."""

    otel: bool = Field(
        False,
        description=(
            "Make OpenTelemetry spans: the request, admission, cache, routing, each upstream "
            "attempt and the fallback (needs the 'otel' extra)."
        ),
    )
    exporter: str = Field(
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
    otlp_protocol: str = Field("http/protobuf", description="'http/protobuf' or 'grpc'.")
    otlp_headers: dict[str, str] = Field(
        default_factory=dict,
        description="Headers sent with every OTLP export, e.g. a collector API key.",
        repr=False,
    )
    otlp_timeout: float = Field(10.0, gt=0, description="Seconds one OTLP export may take.")
    service_name: str = Field(
        "edgeproxy", min_length=1, description="The spans' service.name resource attribute."
    )
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of new traces recorded; a caller's sampled flag is always followed.",
    )

    @field_validator("exporter")
    @classmethod
    def _check_exporter(cls, value: str) -> str:
        if value not in ("otlp", "console", "global"):
            raise ValueError("must be 'otlp', 'console' or 'global'")
        return value

    @field_validator("otlp_protocol")
    @classmethod
    def _check_protocol(cls, value: str) -> str:
        if value not in ("http/protobuf", "grpc"):
            raise ValueError("must be 'http/protobuf' or 'grpc'")
        return value

    @field_validator("otlp_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("must be an http:// or https:// URL")
        return value


class AccessLogConfig(_Section):
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
    queue_size: int = Field(
        10000,
        ge=1,
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


class AdmissionConfig(_Section):
    """Admission control: rate limits, in-flight caps, the priority queue and load shedding.

    A request passes, in order: the token buckets of its API key or tenant
    and of its client IP (429 past them), then the global and per-route
    in-flight caps. Beyond a cap it waits in a priority queue, higher
    priority first, for at most ``max_queue_time``; past ``max_queue`` the
    lowest priority is shed with a 503 and Retry-After, or, on a route with
    ``on_overload = "degrade"``, answered by the fallback ladder.
    """

    max_in_flight: int = Field(
        0, ge=0, description="Most requests in flight at once over every route; 0 means no cap."
    )
    max_queue: int = Field(
        1000,
        ge=0,
        description="Most requests waiting for a slot; when full, the lowest priority is shed "
        "(503). 0 sheds at once.",
    )
    max_queue_time: float = Field(
        5.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds a request may wait for a slot before a 503; a route's "
        "max_queue_time or deadline may shorten it.",
    )
    priority_header: str = Field(
        "X-Priority",
        description="Request header with an integer priority (-9999..9999, higher first), used "
        "when no plugin set ctx.priority; '' ignores it.",
    )
    deadline_header: str = Field(
        "X-Request-Timeout-Ms",
        description="Header sent upstream with the milliseconds left of the route's deadline "
        "when the request leaves the queue (a client's own is replaced); '' sends none.",
    )
    key_header: str = Field(
        "Authorization",
        description="Header whose value, hashed, keys the per-key rate limits when no plugin "
        "set a tenant; '' keys them by tenant only.",
    )
    key_requests_per_second: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Requests per second per API key or tenant; 0 means no limit.",
    )
    key_burst: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Requests a key may send at once (bucket size); 0 means one second's worth.",
    )
    key_tokens_per_minute: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="LLM tokens per minute per API key or tenant: the prompt estimate is "
        "charged up front, then settled with the upstream's usage; 0 means no limit.",
    )
    ip_requests_per_second: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Requests per second per client IP; 0 means no limit.",
    )
    ip_burst: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Requests an IP may send at once (bucket size); 0 means one second's worth.",
    )
    ip_tokens_per_minute: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="LLM tokens per minute per client IP, settled like key_tokens_per_minute; "
        "0 means no limit.",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Networks (CIDR) of proxies in front of this one: X-Forwarded-For is "
        "believed only from them when finding the client IP.",
    )
    redis_url: str = Field(
        "",
        description="Share the buckets between workers and PoPs through this Redis "
        "(redis://, rediss:// or unix://); '' keeps them in the process.",
        repr=False,
    )
    redis_prefix: str = Field("edgeproxy:rl:", description="Prefix of the bucket keys in Redis.")
    redis_timeout: float = Field(
        0.25,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a Redis call may take before the request is limited locally.",
    )
    redis_retry_interval: float = Field(
        5.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds between attempts to reach Redis again once it failed; buckets are "
        "local meanwhile.",
    )
    max_local_buckets: int = Field(
        100_000,
        ge=1,
        description="Most keys and IPs tracked in the process; the least recently seen go first.",
    )

    @field_validator("priority_header", "deadline_header", "key_header")
    @classmethod
    def _check_header_name(cls, value: str) -> str:
        if value and not _HEADER_NAME_RE.fullmatch(value):
            raise ValueError("must be an HTTP header name, or '' to turn it off")
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _check_networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is not an IP address or CIDR network") from None
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        if value and urlsplit(value).scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must be a redis://, rediss:// or unix:// URL, or ''")
        return value


class LimitsConfig(_Section):
    """What a client may send, and how slowly; enforced by the proxy's own listener."""

    max_request_line: int = Field(
        8190,
        ge=256,
        le=1_048_576,
        description="Longest request line (method, target, version) in bytes; longer gets 414.",
    )
    max_header_size: int = Field(
        8190,
        ge=256,
        le=1_048_576,
        description="Longest header field in bytes; longer gets 431.",
    )
    max_headers: int = Field(
        100, ge=8, le=10_000, description="Most header fields in a request; more gets 431."
    )
    max_body_size: int = Field(
        10 * 1024 * 1024,
        ge=0,
        description="Largest request body in bytes; larger gets 413, before it is read when "
        "Content-Length says so. 0 means no limit.",
    )
    header_timeout: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a client has to send a whole request head, from its first byte "
        "(or from connecting); then 408 and the connection closes.",
    )
    body_timeout: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds the request body may stall between two reads (slowloris); then "
        "408 and the connection closes.",
    )
    keepalive_timeout: float = Field(
        75.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds an idle keep-alive connection is kept open.",
    )
    max_connections: int = Field(
        10_000,
        ge=1,
        description="Most client connections open at once; more get 503 and are closed.",
    )


class Config(_Section):
    """The whole edgeproxy configuration."""

    server: ServerConfig = Field(default_factory=ServerConfig, description="Client listener.")
    admin: AdminConfig = Field(default_factory=AdminConfig, description="Admin listener.")
    pop: PopConfig = Field(default_factory=PopConfig, description="This PoP.")
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig, description="Pool defaults.")
    regions: list[RegionConfig] = Field(
        default_factory=list, description="The regional clusters, one [[regions]] table each."
    )
    routes: list[RouteConfig] = Field(
        default_factory=list,
        description="Per-route policy, one [[routes]] table each; longest path prefix wins.",
    )
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Hot-answer cache.")
    plugins: PluginsConfig = Field(default_factory=PluginsConfig, description="Plugins.")
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="Prometheus metrics and /status percentiles."
    )
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="Tracing.")
    access_log: AccessLogConfig = Field(
        default_factory=AccessLogConfig, description="The JSON-lines access log."
    )
    local_model: LocalModelConfig = Field(
        default_factory=LocalModelConfig, description="The local fallback model."
    )
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig, description="Region choice, retries and hedging."
    )
    health: HealthConfig = Field(
        default_factory=HealthConfig, description="Health checks, ejection, breakers."
    )
    geo: GeoConfig = Field(default_factory=GeoConfig, description="Client geo and residency.")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="Rate limits, in-flight caps, queueing."
    )
    limits: LimitsConfig = Field(
        default_factory=LimitsConfig, description="Input limits and slow-client timeouts."
    )
    # Relative plugin file paths resolve against the config file's folder.
    _base_dir: Path | None = PrivateAttr(default=None)
    _default_route: RouteConfig = PrivateAttr(
        default_factory=lambda: RouteConfig(name="default", path="/")
    )

    @property
    def base_dir(self) -> Path | None:
        """The folder of the file this config was loaded from, if any."""
        return self._base_dir

    @model_validator(mode="after")
    def _check_regions(self) -> Config:
        if not self.regions:
            raise ValueError("regions: at least one [[regions]] entry is required")
        seen: set[str] = set()
        for region in self.regions:
            if region.name in seen:
                raise ValueError(f"regions: duplicate region name {region.name!r}")
            seen.add(region.name)
        names: set[str] = set()
        for route in self.routes:
            if route.name in names:
                raise ValueError(f"routes: duplicate route name {route.name!r}")
            names.add(route.name)
        return self

    @model_validator(mode="after")
    def _check_residency(self) -> Config:
        known = {r.name for r in self.regions}
        for region in self.regions:
            known.update(region.tags)
            if region.jurisdiction:
                known.add(region.jurisdiction)
        for key, allowed in self.geo.residency.items():
            for name in allowed:
                if name not in known:
                    raise ValueError(
                        f"geo.residency.{key}: unknown region or jurisdiction {name!r} "
                        f"(known: {', '.join(sorted(known))})"
                    )
        return self

    def route_for(self, method: str, path: str) -> RouteConfig:
        """The route a request belongs to: the longest matching prefix, else ``default``."""
        best: RouteConfig | None = None
        for route in self.routes:
            if route.matches(method, path) and (best is None or len(route.path) > len(best.path)):
                best = route
        if best is not None:
            return best
        # A plain attribute read: pydantic's private attributes go through
        # __getattr__, which is slow on a per-request path.
        return self.__pydantic_private__["_default_route"]  # type: ignore[no-any-return,index]

    def region(self, name: str) -> RegionConfig:
        """The region called ``name``; ``KeyError`` if there is none."""
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(name)


def _format_errors(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = ""
        for part in err["loc"]:
            if isinstance(part, int):
                loc += f"[{part}]"
            else:
                # A key that is empty or not a bare TOML key is shown quoted, as TOML writes it.
                name = str(part)
                if not name or not name.replace("_", "").replace("-", "").isalnum():
                    name = '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
                loc += f".{name}" if loc else name
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        if loc:
            lines.append(f"{loc}: {msg}")
        else:
            lines.append(msg)
    return lines


def _coerce_env_value(raw: str) -> Any:
    """Parse an environment value as a TOML value, falling back to a plain string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _apply_env(data: dict[str, Any], environ: Mapping[str, str]) -> None:
    """Apply ``EDGEPROXY_SECTION__KEY`` and ``EDGEPROXY_REGIONS__<name|index>__KEY`` overrides."""
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        value = _coerce_env_value(raw)
        if path[0] == "regions" and len(path) == 3:
            regions = data.setdefault("regions", [])
            target = None
            if path[1].isdigit() and int(path[1]) < len(regions):
                target = regions[int(path[1])]
            else:
                for region in regions:
                    if str(region.get("name", "")).lower().replace("-", "_") == path[1]:
                        target = region
            if target is not None:
                target[path[2]] = value
            continue
        if len(path) == 2:
            section = data.setdefault(path[0], {})
            if isinstance(section, dict):
                section[path[1]] = value


def config_from_mapping(
    data: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    source: str | None = None,
) -> Config:
    """Validate a parsed TOML mapping (plus environment overrides) into a :class:`Config`."""
    merged: dict[str, Any] = _deep_copy(data)
    _apply_env(merged, os.environ if environ is None else environ)
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc), source=source) from None


def _deep_copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> Config:
    """Load and validate a TOML config file. Raises :class:`ConfigError` naming every bad key."""
    source = os.fspath(path)
    try:
        raw = Path(source).read_bytes()
    except OSError as exc:
        raise ConfigError(
            [f"cannot read config file: {exc.strerror or exc}"], source=source
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config file is not UTF-8: {exc}"], source=source) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"TOML syntax error: {exc}"], source=source) from None
    config = config_from_mapping(data, environ=environ, source=source)
    config._base_dir = Path(source).resolve().parent
    return config


def iter_config_keys() -> Iterator[tuple[str, str, str, str]]:
    """Yield ``(key, type, default, description)`` for every documented key."""
    sections: list[tuple[str, type[BaseModel]]] = [
        ("server", ServerConfig),
        ("admin", AdminConfig),
        ("pop", PopConfig),
        ("upstream", UpstreamConfig),
        ("regions", RegionConfig),
        ("routes", RouteConfig),
        ("plugins", PluginsConfig),
        ("cache", CacheConfig),
        ("metrics", MetricsConfig),
        ("tracing", TracingConfig),
        ("access_log", AccessLogConfig),
        ("local_model", LocalModelConfig),
        ("routing", RoutingConfig),
        ("health", HealthConfig),
        ("geo", GeoConfig),
        ("admission", AdmissionConfig),
        ("limits", LimitsConfig),
    ]
    for section, model in sections:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            type_name = getattr(annotation, "__name__", None) or str(annotation)
            type_name = (
                str(annotation).replace("typing.", "") if "[" in str(annotation) else type_name
            )
            if field.is_required():
                default = "required"
            elif field.default_factory is not None:
                default = repr(field.default_factory())  # type: ignore[call-arg]
            else:
                default = repr(field.default)
            yield f"{section}.{name}", type_name, default, field.description or ""


def config_docs_markdown() -> str:
    """A markdown table of every config key, for the README."""
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key, type_name, default, desc in iter_config_keys():
        rows.append(f"| `{key}` | `{type_name}` | `{default}` | {desc} |")
    return "\n".join(rows)
