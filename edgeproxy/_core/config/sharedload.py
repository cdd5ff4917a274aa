"""The load view shared by every PoP and worker through Redis: ``[shared_load]``."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator, model_validator

from edgeproxy._core.config.base import Section
from edgeproxy._core.config.checks import check_redis_url
from edgeproxy._core.config.redis import (
    RedisCluster,
    RedisPassword,
    RedisPasswordEnv,
    RedisSettings,
    RedisTls,
    RedisTlsCaFile,
    RedisTlsCertFile,
    RedisTlsKeyFile,
    RedisTlsVerify,
    RedisUsername,
    check_redis_cluster,
    redis_settings,
)

__all__ = ["SharedLoadConfig"]


class SharedLoadConfig(Section):
    """Each process's load per region, published to Redis and read back from every other.

    A background task publishes, every ``interval``, this process's requests
    in flight, time-to-first-byte EWMA and request rate for each region, and
    reads those of the other processes in the same round trip. The request
    path never waits on Redis: it reads what the last round brought, and
    data older than ``ttl`` (Redis down or slow) means local values only.
    """

    redis_url: str = Field(
        "",
        description="Share the load view through this Redis: redis://host[:port][/db], "
        "rediss:// (TLS) or unix:///path/to/redis.sock[?db=N]; '' keeps the view local. "
        "Unset: [redis] url.",
        repr=False,
    )
    redis_cluster: RedisCluster = False
    redis_username: RedisUsername = None
    redis_password: RedisPassword = None
    redis_password_env: RedisPasswordEnv = None
    redis_tls: RedisTls = False
    redis_tls_ca_file: RedisTlsCaFile = None
    redis_tls_cert_file: RedisTlsCertFile = None
    redis_tls_key_file: RedisTlsKeyFile = None
    redis_tls_verify: RedisTlsVerify = True
    redis_prefix: str = Field(
        "edgeproxy:load:",
        description="Prefix of the load keys: one hash per region, <prefix>{<region>}, a field "
        "per process.",
    )
    interval: float = Field(
        0.25,
        gt=0,
        allow_inf_nan=False,
        description="Seconds between two rounds: publishing this process's load and reading "
        "the others'.",
    )
    ttl: float = Field(
        2.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a published load counts: older entries are ignored and removed, "
        "and a view not refreshed for this long falls back to local values.",
    )
    redis_timeout: float = Field(
        0.5,
        gt=0,
        allow_inf_nan=False,
        description="Seconds one round may take before it counts as a Redis failure.",
    )
    retry_max: float = Field(
        5.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest pause between rounds while Redis fails (the pause doubles from "
        "interval up to this).",
    )

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        return check_redis_url(value, allow_empty=True)

    @field_validator("redis_cluster")
    @classmethod
    def _check_redis_cluster(cls, value: bool, info: ValidationInfo) -> bool:
        return check_redis_cluster(value, info.data.get("redis_url"))

    @model_validator(mode="after")
    def _check_ttl(self) -> SharedLoadConfig:
        if self.ttl <= self.interval:
            raise ValueError("ttl must be longer than interval")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.redis_url)

    def redis_settings(self) -> RedisSettings:
        """Where the load view's Redis is and how to log in."""
        return redis_settings(self)
