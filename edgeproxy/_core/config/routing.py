"""Region choice and region health: ``[routing]`` and ``[health]``."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from edgeproxy._core.config.base import Section
from edgeproxy._core.config.checks import HeaderName, UrlPath
from edgeproxy._core.config.kinds import (
    Count,
    CountOrZero,
    FiniteNonNegative,
    FinitePositive,
    NonNegative,
    Positive,
    Share,
)

__all__ = ["HealthConfig", "RoutingConfig"]

# In the order rank applies them by default.
RankPolicyName = Literal["reported_load", "affinity", "latency"]
_DEFAULT_RANK: tuple[RankPolicyName, ...] = get_args(RankPolicyName)


class RoutingConfig(Section):
    """How a region is chosen: latency history, load, geo prior, retry and hedge budgets."""

    decay: Positive = Field(
        10.0,
        description="Seconds over which a region's peak-EWMA latency forgets old samples "
        "(a slower sample counts at once).",
    )
    min_samples: Count = Field(
        3,
        description="Samples before a region's own latency fully replaces its geo prior.",
    )
    ms_per_1000km: NonNegative = Field(
        10.0,
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
    probe_decay: Positive = Field(
        10.0,
        description="Seconds over which the latency penalty of a region that gets no traffic "
        "fades towards its prior, so that a recovered region is probed again.",
    )
    rank: list[RankPolicyName] = Field(
        default_factory=lambda: list(_DEFAULT_RANK),
        description="The ranking policies, in the order they decide within a priority tier, "
        "each breaking the ties of those before it: 'reported_load' (the load tiers of fresh "
        "reports: load_tier_queue), 'affinity' (the prefix match weighed against load, with "
        "prefix_affinity), 'latency' (the score, power of two choices among equals; last).",
    )
    retry_budget: Share = Field(
        0.2,
        description="Retries may be at most this share of requests over budget_window.",
    )
    retry_budget_min: NonNegative = Field(
        1.0,
        description="Retries per second allowed whatever the traffic (for quiet PoPs).",
    )
    hedge_budget: Share = Field(
        0.05,
        description="Hedged copies may be at most this share of requests over budget_window.",
    )
    hedge_budget_min: NonNegative = Field(
        0.1,
        description="Hedged copies per second allowed whatever the traffic.",
    )
    budget_window: Positive = Field(
        10.0, description="Seconds over which the retry and hedge budgets are counted."
    )
    retry_statuses: list[int] = Field(
        default_factory=lambda: [502, 503, 504],
        description="Region answers that count as a failure before the first byte and are "
        "retried on the next region.",
    )
    models_fetch_timeout: Positive = Field(
        2.0,
        description="GET /v1/models: seconds to fetch the list of each region with no models "
        "configured, to merge it into the proxy's answer.",
    )
    models_cache_ttl: NonNegative = Field(
        10.0,
        description="GET /v1/models: seconds a merged list with fetched parts is reused before "
        "the regions are asked again.",
    )

    # -- prefix (KV-cache) affinity: docs/routing.md#prefix-affinity --------------------
    prefix_affinity: bool = Field(
        False,
        description="Send chat and completions requests whose prompt starts like an earlier "
        "one to the region that answered it (its KV cache holds that prefix), weighed against "
        "load: prefix_weight, load_weight, balance_*_threshold.",
    )
    prefix_block_chars: Count = Field(
        256,
        description="Prompts are hashed in blocks of this many characters (256: about 64 "
        "tokens); only whole blocks count.",
    )
    prefix_max_blocks: int = Field(
        64,
        ge=1,
        le=4096,
        description="Blocks hashed per prompt, from its start (64 x 256 characters: the "
        "first 16 KiB); the rest of a longer prompt is not looked at.",
    )
    prefix_index_size: Count = Field(
        32768,
        description="Block hashes remembered per region (least recently routed out first); "
        "about 100 bytes each.",
    )
    prefix_index_ttl: FinitePositive = Field(
        300.0,
        description="Seconds a block routed to a region counts as still in its KV cache.",
    )
    prefix_weight: FiniteNonNegative = Field(
        3.0,
        description="Weight of the prefix match (matched blocks / prompt blocks, 0 to 1) in "
        "the affinity score.",
    )
    load_weight: FiniteNonNegative = Field(
        4.0,
        description="Weight of the load (best score / region's score, 0 to 1, score being "
        "expected latency x (in flight + 1)) in the affinity score.",
    )
    balance_abs_threshold: FiniteNonNegative = Field(
        64.0,
        description="Balance guard: when the most and least loaded candidates differ by more "
        "than this many requests, and by more than balance_rel_threshold, load alone routes.",
    )
    balance_rel_threshold: float = Field(
        1.5,
        ge=1,
        allow_inf_nan=False,
        description="Balance guard: ... and the most loaded one holds more than this many "
        "times the least loaded one's requests.",
    )
    session_header: HeaderName = Field(
        "X-Session-Id",
        description="Request header carrying a session key: the requests of one session "
        "stick to one region (with prefix_affinity); '' for none.",
    )
    session_from_user: bool = Field(
        True,
        description="Without a session header, the body's 'user' member is the session key.",
    )
    # -- prompt-cache affinity: docs/routing.md#prompt-cache-affinity -------------------
    prompt_cache_affinity: bool = Field(
        True,
        description="With prefix_affinity, a request stating its cache intent (OpenAI's "
        "prompt_cache_key, Anthropic's cache_control breakpoints) is keyed by it, not by its "
        "prompt's blocks: the requests naming one cache, within one tenant or credential "
        "scope, go to the region that answered the last of them while it holds it.",
    )
    prompt_cache_ttl: FinitePositive = Field(
        300.0,
        description="Seconds a cache key stays with its region after the last request naming "
        "it (the providers' default cache lifetime: 5 minutes).",
    )
    prompt_cache_ttl_extended: FinitePositive = Field(
        3600.0,
        description="The same for an Anthropic breakpoint asking the extended TTL "
        "(a cache_control with ttl '1h').",
    )
    prompt_cache_index_size: Count = Field(
        65536,
        description="Cache keys remembered, over all regions (least recently routed out "
        "first); about 150 bytes each.",
    )
    # -- load reported by the regions: docs/routing.md#load-reported-by-the-regions -----
    load_report_max_age: FinitePositive = Field(
        5.0,
        description="Seconds a region's load report (header or scrape) is used; an older one "
        "is ignored, and the proxy's own in-flight count alone judges the load.",
    )
    load_scrape_interval: FinitePositive = Field(
        1.0,
        description="Seconds between two polls of the metrics_path of each region with "
        "load_reporting = 'scrape'.",
    )
    load_scrape_timeout: FinitePositive = Field(
        1.0, description="Seconds one metrics poll may take."
    )
    load_queue_saturation: FinitePositive = Field(
        16.0,
        description="A reported waiting queue this long counts as a saturated region (load "
        "score: the mean of waiting / this, capped at 1, and the KV-cache utilisation).",
    )
    reported_load_weight: FiniteNonNegative = Field(
        4.0,
        description="A fresh load report multiplies a region's expected latency by "
        "1 + this x its load score (0 to 1): 4 makes a saturated region look 5 times slower.",
    )
    load_tier_queue: FinitePositive = Field(
        4.0,
        description="A fresh report of at least this many waiting requests puts a region one "
        "load tier down, twice as many two tiers, and so on: with 'reported_load' in rank, a "
        "lower tier comes first whatever the latencies.",
    )

    @field_validator("rank")
    @classmethod
    def _check_rank(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("a policy is listed twice")
        if not value or value[-1] != "latency":
            raise ValueError("must end with 'latency', the one policy that orders every region")
        return value

    @model_validator(mode="after")
    def _check_affinity_ranked(self) -> RoutingConfig:
        if self.prefix_affinity and "affinity" not in self.rank:
            raise ValueError("prefix_affinity needs 'affinity' in rank, where it is to decide")
        return self

    @model_validator(mode="after")
    def _check_prompt_cache_ttls(self) -> RoutingConfig:
        if self.prompt_cache_ttl_extended < self.prompt_cache_ttl:
            raise ValueError("prompt_cache_ttl_extended must not be shorter than prompt_cache_ttl")
        return self

    @field_validator("retry_statuses")
    @classmethod
    def _check_statuses(cls, value: list[int]) -> list[int]:
        for status in value:
            if not 500 <= status <= 599:
                raise ValueError(f"{status} is not a 5xx status")
        return value


class HealthConfig(Section):
    """Active health checks, passive outlier ejection and per-region circuit breakers."""

    active: bool = Field(False, description="Probe every region's health path in the background.")
    path: UrlPath = Field(
        "/healthz", description="Path of the active health check (GET, 2xx = ok)."
    )
    interval: Positive = Field(5.0, description="Seconds between two active checks.")
    timeout: Positive = Field(1.0, description="Seconds an active check may take.")
    healthy_threshold: Count = Field(
        2, description="Passed checks in a row that make an unhealthy region healthy."
    )
    unhealthy_threshold: Count = Field(
        3, description="Failed checks in a row that make a region unhealthy."
    )
    outlier_detection: bool = Field(
        True, description="Eject regions that fail requests in a row (Envoy's model)."
    )
    consecutive_failures: Count = Field(
        5,
        description="5xx answers or connect/reset/timeout failures in a row that eject a region.",
    )
    base_ejection_time: Positive = Field(
        30.0,
        description="Seconds of the first ejection; each further ejection lasts one base more.",
    )
    max_ejection_time: Positive = Field(
        300.0, description="Longest ejection, however often a region was ejected."
    )
    max_ejection_percent: float = Field(
        50.0,
        ge=0,
        le=100,
        description="Most regions ejected at once, in percent (at least one may always be).",
    )
    outlier_interval: Positive = Field(
        10.0,
        description="Seconds without an ejection after which a region's ejection multiplier "
        "goes down by one.",
    )
    min_failing_callers: Count = Field(
        3,
        description="A region's 5xx answers count against its health and latency only while "
        "this many distinct callers (tenants, API keys, else client IPs) got them within "
        "failure_window; fewer are the callers' fault (1: every 5xx counts, as Envoy does).",
    )
    failure_window: Positive = Field(
        30.0,
        description="Seconds over which a region's 5xx answers and their distinct callers are "
        "counted (min_failing_callers).",
    )
    poison_ttl: Positive = Field(
        300.0,
        description="Seconds a request body that got 5xx answers from two regions is known as "
        "poison: the same body gets 502 upstream_rejected_request at once, with no attempt.",
    )
    poison_strikes: CountOrZero = Field(
        5,
        description="Poison requests from one caller within poison_ttl after which its "
        "requests get 429 until the oldest fades (0: never).",
    )
    max_concurrent: Count = Field(
        1024, description="Circuit breaker: most requests in flight per region."
    )
    max_pending: Count = Field(
        1024,
        description="Circuit breaker: most requests per region still waiting for their first byte.",
    )

    @model_validator(mode="after")
    def _check_ejection_times(self) -> HealthConfig:
        if self.max_ejection_time < self.base_ejection_time:
            raise ValueError("max_ejection_time must not be shorter than base_ejection_time")
        return self
