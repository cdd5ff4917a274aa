"""The load view shared by every PoP and worker through Redis: ``[shared_load]``."""

from __future__ import annotations

from pydantic import Field, model_validator

from edgeproxy._core.config.kinds import FinitePositive
from edgeproxy._core.config.redis import RedisSection, redis_url_field

__all__ = ["SharedLoadConfig"]


class SharedLoadConfig(RedisSection):
    """Each process's load per region, published to Redis and read back from every other.

    A background task publishes, every ``interval``, this process's requests
    in flight, time-to-first-byte EWMA and request rate for each region, and
    reads those of the other processes in the same round trip. The request
    path never waits on Redis: it reads what the last round brought, and
    data older than ``ttl`` (Redis down or slow) means local values only.
    """

    redis_url: str = redis_url_field(
        "Share the load view through this Redis", off="keeps the view local"
    )
    redis_prefix: str = Field(
        "edgeproxy:load:",
        description="Prefix of the load keys: one hash per region, <prefix>{<region>}, a field "
        "per process.",
    )
    interval: FinitePositive = Field(
        0.25,
        description="Seconds between two rounds: publishing this process's load and reading "
        "the others'.",
    )
    ttl: FinitePositive = Field(
        2.0,
        description="Seconds a published load counts: older entries are ignored and removed, "
        "and a view not refreshed for this long falls back to local values.",
    )
    redis_timeout: FinitePositive = Field(
        0.5,
        description="Seconds one round may take before it counts as a Redis failure.",
    )
    retry_max: FinitePositive = Field(
        5.0,
        description="Longest pause between rounds while Redis fails (the pause doubles from "
        "interval up to this).",
    )

    @model_validator(mode="after")
    def _check_ttl(self) -> SharedLoadConfig:
        if self.ttl <= self.interval:
            raise ValueError("ttl must be longer than interval")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.redis_url)
