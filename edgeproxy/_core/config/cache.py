"""The hot-answer cache: ``[cache]``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from edgeproxy._core.config.checks import check_header_name
from edgeproxy._core.config.kinds import Count, FiniteNonNegative, FinitePositive, Positive
from edgeproxy._core.config.redis import RedisSection, redis_settings, redis_url_field

__all__ = ["CacheConfig"]


class CacheConfig(RedisSection):
    """The hot-answer cache: where entries live, their bounds, and how Redis faults are contained.

    Per-route freshness (``cache``, ``cache_ttl``, ``stale_while_revalidate``,
    ``stale_if_error``) lives on ``[[routes]]``.
    """

    # The redis and tiered backends need a Redis: with none named, the local one.
    url_optional: ClassVar[bool] = False

    enabled: bool = Field(True, description="Look up and store cacheable answers.")
    backend: Literal["memory", "redis", "tiered"] = Field(
        "memory",
        description="Where entries live: 'memory' (this process, LRU-bounded), 'redis' (shared "
        "by every PoP and worker) or 'tiered' (memory, then Redis; a Redis hit fills memory).",
    )
    redis_url: str = redis_url_field(
        "Redis for the redis and tiered backends", default="redis://127.0.0.1:6379/0"
    )
    key_prefix: str = Field(
        "edgeproxy:",
        description="Prefix of every key the cache writes, so deployments can share one Redis.",
    )
    redis_timeout: FinitePositive = Field(
        0.25,
        description="Seconds one Redis call may take; past it the cache gives up on that call "
        "and the request goes upstream (fail open).",
    )
    redis_connect_timeout: FinitePositive = Field(
        0.5, description="Seconds to open a Redis connection."
    )
    redis_max_connections: Count = Field(
        64, description="Most connections in the Redis pool of each proxy process."
    )
    breaker_failures: Count = Field(
        5,
        description="Consecutive failed Redis calls (errors, timeouts) that open the circuit "
        "breaker: Redis is then not called at all for breaker_cooldown.",
    )
    breaker_cooldown: FinitePositive = Field(
        10.0,
        description="Seconds the breaker stays open before one probe call may close it again.",
    )
    max_entries: Count = Field(
        10_000, description="Most answers in the memory tier; least recently used go first."
    )
    max_bytes: Count = Field(
        256 * 2**20,
        description="Most bytes of answers in the memory tier; least recently used go first.",
    )
    max_entry_bytes: Count = Field(
        4 * 2**20,
        description="Largest answer stored; a bigger one is served but not cached (counted as "
        "too_large in /status).",
    )
    semantic_embedder: Literal["static", "gguf", "region"] = Field(
        "static",
        description="What embeds last user messages for the semantic cache (routes with "
        "semantic_cache): 'static', the wordllama model shipped in its pip package (the "
        "'semantic' extra), offline; 'gguf', the GGUF embedding model at "
        "semantic_embedder_model, through llama-cpp-python (the 'local' extra); 'region', "
        "the /v1/embeddings of the region semantic_embedder_region, asking for the model "
        "semantic_embedder_model.",
    )
    semantic_embedder_model: str = Field(
        "",
        description="For semantic_embedder 'gguf', the path of the GGUF file (relative to the "
        "config file); for 'region', the model the region is asked for.",
    )
    semantic_embedder_region: str = Field(
        "",
        description="For semantic_embedder 'region', the [[regions]] name whose /v1/embeddings "
        "embeds the questions.",
    )
    semantic_embedder_timeout: Positive = Field(
        2.0,
        description="Longest wait for one embedding (the 'gguf' and 'region' embedders); past "
        "it the semantic lookup is skipped and the request goes on.",
    )
    semantic_max_entries: Count = Field(
        100_000,
        description="Most questions the semantic index of each worker holds; the oldest go first.",
    )
    semantic_shadow: bool = Field(
        False,
        description="Semantic cache in shadow mode: would-be semantic hits are counted and "
        "logged (similarity, the verifier's verdict), never served.",
    )
    semantic_share: bool = Field(
        True,
        description="With a Redis backend, each semantic entry's question and vector are "
        "stored beside its answer, so every worker and PoP searches them, and a worker that "
        "starts warms its index from them.",
    )
    semantic_sync_interval: Positive = Field(
        2.0,
        description="Seconds between a worker's reads of the semantic entries other workers "
        "and PoPs stored in Redis (semantic_share).",
    )
    semantic_redis_search: Literal["auto", "off"] = Field(
        "auto",
        description="'auto': where the Redis server has vector search (Redis 8, or the search "
        "module) and is not a cluster, search the shared entries there, found at start; "
        "otherwise, and with 'off', each worker searches its own index.",
    )
    semantic_model_verifier: Literal["off", "local", "region"] = Field(
        "off",
        description="A model's cross-check of semantic hits, after the rule verifier passed "
        "one: asked whether the two questions have the same answer (temperature 0, a few "
        "tokens), a 'no', an unclear answer, a failure or no answer within "
        "semantic_verifier_timeout makes the lookup a miss. 'local': the [local_model]; "
        "'region': the model semantic_verifier_model, through the regions serving it; 'off': "
        "the rule verifier alone.",
    )
    semantic_verifier_model: str = Field(
        "",
        description="For semantic_model_verifier 'region', the model asked, sent over the warm "
        "pools of the regions that serve it (as a request for it would be routed).",
    )
    semantic_verifier_timeout: FinitePositive = Field(
        1.0,
        description="Longest wait for the model verifier's verdict on one candidate (a local "
        "model's queue included); past it the lookup is a miss and the request goes upstream.",
    )
    coalesce: bool = Field(
        True,
        description="Identical cacheable requests arriving while one is in flight wait for its "
        "answer (streams included) instead of going upstream.",
    )
    vary_headers: list[str] = Field(
        default_factory=list,
        description="Request headers, beyond the built-in ones (credentials, "
        "OpenAI-Organization, OpenAI-Project, OpenAI-Beta, anthropic-version, anthropic-beta), "
        "that change the answer and so are part of every POST's cache key: e.g. a header "
        "your regions read to pick a LoRA adapter. Names are case-insensitive.",
    )
    xfetch_beta: FiniteNonNegative = Field(
        1.0,
        description="Early probabilistic refresh (XFetch) against stampedes at expiry: higher "
        "refreshes hot entries earlier; 0 turns it off.",
    )

    @field_validator("vary_headers")
    @classmethod
    def _check_vary_headers(cls, value: list[str]) -> list[str]:
        names = []
        for name in value:
            if not name.strip():
                raise ValueError(f"{name!r} is not a header name")
            names.append(check_header_name(name.strip()).lower())
        return names

    @model_validator(mode="after")
    def _check_embedder(self) -> CacheConfig:
        needs = {"gguf": "semantic_embedder_model", "region": "semantic_embedder_region"}
        key = needs.get(self.semantic_embedder)
        if key is not None and not getattr(self, key):
            raise ValueError(f"semantic_embedder {self.semantic_embedder!r} needs {key}")
        if self.semantic_embedder == "region" and not self.semantic_embedder_model:
            raise ValueError("semantic_embedder 'region' needs semantic_embedder_model")
        if self.semantic_model_verifier == "region" and not self.semantic_verifier_model:
            raise ValueError("semantic_model_verifier 'region' needs semantic_verifier_model")
        return self

    @model_validator(mode="after")
    def _check_sizes(self) -> CacheConfig:
        if self.max_entry_bytes > self.max_bytes:
            raise ValueError("max_entry_bytes must not exceed max_bytes")
        return self

    def resolved_redis_password(self, environ: Mapping[str, str] | None = None) -> str | None:
        """``redis_password``, else the variable ``redis_password_env`` names, else None."""
        return redis_settings(self, environ).password
