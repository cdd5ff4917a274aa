"""How to reach a Redis: ``[redis]``, and the connection keys each Redis-using section shares.

``[redis]`` (:class:`RedisConfig`) is the one home of the connection keys:
``url``, ``cluster``, AUTH and TLS. ``[cache]``, ``[admission]`` and
``[shared_load]`` each have the same keys again, prefixed ``redis_``
(``[cache] redis_url``), declared once here as annotated types so that their
descriptions and checks cannot drift apart; a key a section sets overrides
``[redis]``'s for that section alone. :func:`inherit_redis` writes the merged
keys into each section when the whole config is validated, so every reader
of a section sees its effective keys; :func:`redis_settings` gathers them
into one :class:`RedisSettings`, which the one client builder
(``edgeproxy._stages.redisclient.make_client``) turns into a standalone or a
Redis Cluster client.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Protocol, TypeVar, cast

from pydantic import Field, ValidationInfo, field_validator

from edgeproxy._core.config.base import Section
from edgeproxy._core.config.checks import check_redis_url

__all__ = [
    "RedisCluster",
    "RedisConfig",
    "RedisPassword",
    "RedisPasswordEnv",
    "RedisSettings",
    "RedisTls",
    "RedisTlsCaFile",
    "RedisTlsCertFile",
    "RedisTlsKeyFile",
    "RedisTlsVerify",
    "RedisUsername",
    "check_redis_cluster",
    "inherit_redis",
    "redis_settings",
]

RedisCluster = Annotated[
    bool,
    Field(
        description="redis_url is one node of a Redis Cluster: the client discovers the others "
        "and sends each key to its master (redis:// or rediss://, database 0). Unset: [redis] "
        "cluster."
    ),
]
RedisUsername = Annotated[
    str | None, Field(description="Redis ACL user name (AUTH). Unset: [redis] username.")
]
RedisPassword = Annotated[
    str | None,
    Field(
        description="Redis password (AUTH). Prefer redis_password_env. Unset, with "
        "redis_password_env unset too: [redis] password and password_env.",
        repr=False,
    ),
]
RedisPasswordEnv = Annotated[
    str | None,
    Field(
        description="Name of the environment variable that holds the Redis password. Unset, "
        "with redis_password unset too: [redis] password and password_env."
    ),
]
RedisTls = Annotated[
    bool,
    Field(description="Use TLS for a redis:// URL too (rediss:// does). Unset: [redis] tls."),
]
RedisTlsCaFile = Annotated[
    str | None,
    Field(
        description="CA bundle that verifies the Redis server; the system's if unset here and "
        "in [redis] (tls_ca_file)."
    ),
]
RedisTlsCertFile = Annotated[
    str | None,
    Field(
        description="Client certificate for Redis mutual TLS (PEM). Unset: [redis] tls_cert_file."
    ),
]
RedisTlsKeyFile = Annotated[
    str | None,
    Field(description="Private key of redis_tls_cert_file (PEM). Unset: [redis] tls_key_file."),
]
RedisTlsVerify = Annotated[
    bool,
    Field(
        description="Verify the Redis server's certificate and host name. Unset: [redis] "
        "tls_verify."
    ),
]


class RedisKeys(Protocol):
    """The connection keys of a section that talks to Redis."""

    @property
    def redis_url(self) -> str: ...
    @property
    def redis_cluster(self) -> bool: ...
    @property
    def redis_username(self) -> str | None: ...
    @property
    def redis_password(self) -> str | None: ...
    @property
    def redis_password_env(self) -> str | None: ...
    @property
    def redis_tls(self) -> bool: ...
    @property
    def redis_tls_ca_file(self) -> str | None: ...
    @property
    def redis_tls_cert_file(self) -> str | None: ...
    @property
    def redis_tls_key_file(self) -> str | None: ...
    @property
    def redis_tls_verify(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Where a Redis is and how to log in: one section's connection keys, password resolved.

    ``username`` and ``password`` are the keys' when set, else None (the URL's
    own ``user:password@`` then applies). ``repr`` leaves the URL and password out.
    """

    url: str
    cluster: bool = False
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True

    def __repr__(self) -> str:
        return f"RedisSettings(cluster={self.cluster}, tls={self.tls})"


def redis_settings(section: RedisKeys, environ: Mapping[str, str] | None = None) -> RedisSettings:
    """The :class:`RedisSettings` of a section; the password from ``redis_password_env`` when
    ``redis_password`` is unset (read from ``environ``, ``os.environ`` when None)."""
    password = section.redis_password
    if not password and section.redis_password_env:
        password = (os.environ if environ is None else environ).get(section.redis_password_env)
    return RedisSettings(
        url=section.redis_url,
        cluster=section.redis_cluster,
        username=section.redis_username or None,
        password=password or None,
        tls=section.redis_tls,
        tls_ca_file=section.redis_tls_ca_file,
        tls_cert_file=section.redis_tls_cert_file,
        tls_key_file=section.redis_tls_key_file,
        tls_verify=section.redis_tls_verify,
    )


def check_redis_cluster(cluster: bool, url: str | None, *, key: str = "redis_url") -> bool:
    """A section's ``redis_cluster`` against its ``redis_url`` (None when that key is invalid,
    already reported): a cluster needs a TCP URL with database 0. ``ValueError`` says why,
    naming the URL's ``key``."""
    if cluster and url:
        try:
            check_redis_url(url, cluster=True)
        except ValueError as exc:
            raise ValueError(f"{key} {exc}") from None
    return cluster


class RedisConfig(Section):
    """Where Redis is and how to log in, for every section that uses it: ``[redis]``.

    The cache (``backend = "redis"`` or ``"tiered"``), the rate-limit buckets
    (``[admission]``) and the shared load view (``[shared_load]``) all use this
    Redis. Each of them may override any key for itself with its own
    ``redis_<key>`` (``[cache] redis_url``); a key set in neither place keeps the
    section's default.
    """

    url: str = Field(
        "",
        description="The Redis of every Redis-using section: redis://host[:port][/db], "
        "rediss:// (TLS) or unix:///path/to/redis.sock[?db=N], optionally with "
        "user:password@. Set, it turns on the shared rate-limit buckets and the shared load "
        "view (a section's redis_url = '' keeps that one local) and is the cache's Redis; '' "
        "leaves each section its own redis_url.",
        repr=False,
    )
    cluster: bool = Field(
        False,
        description="url is one node of a Redis Cluster: the client discovers the others and "
        "sends each key to its master (redis:// or rediss://, database 0).",
    )
    username: str | None = Field(None, description="Redis ACL user name (AUTH).")
    password: str | None = Field(
        None, description="Redis password (AUTH). Prefer password_env.", repr=False
    )
    password_env: str | None = Field(
        None, description="Name of the environment variable that holds the Redis password."
    )
    tls: bool = Field(False, description="Use TLS for a redis:// URL too (rediss:// does).")
    tls_ca_file: str | None = Field(
        None, description="CA bundle that verifies the Redis server; the system's if unset."
    )
    tls_cert_file: str | None = Field(
        None, description="Client certificate for Redis mutual TLS (PEM)."
    )
    tls_key_file: str | None = Field(None, description="Private key of tls_cert_file (PEM).")
    tls_verify: bool = Field(
        True, description="Verify the Redis server's certificate and host name."
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return check_redis_url(value, allow_empty=True)

    @field_validator("cluster")
    @classmethod
    def _check_cluster(cls, value: bool, info: ValidationInfo) -> bool:
        return check_redis_cluster(value, info.data.get("url"), key="url")


# The [redis] keys, each overridden by the section key "redis_" + key.
_SHARED_KEYS: Final = frozenset(RedisConfig.model_fields)
# Two spellings of one secret: a section that gives its own password either way takes neither
# of [redis]'s, or [redis]'s password would win over the section's password_env.
_LOGIN: Final = frozenset({"redis_password", "redis_password_env"})

_S = TypeVar("_S", bound=Section)


def inherit_redis(name: str, section: _S, shared: RedisConfig) -> _S:
    """``section`` (the config's ``[name]``) with ``shared``'s keys in place of those it leaves
    unset; ``section`` itself when it takes none.

    "Unset" is what the file and the environment did not name (pydantic's
    ``model_fields_set``), so a section key set to its default still wins. An empty
    ``[redis] url`` is unset too. The result keeps the section's own ``model_fields_set``,
    so merging again (a config validated anew) gives the same keys. ``ValueError``, naming
    both keys, when a key taken from ``[redis]`` does not fit one the section sets (a
    cluster with a database other than 0).
    """
    own = section.model_fields_set
    update: dict[str, Any] = {}
    for key in shared.model_fields_set & _SHARED_KEYS:
        target = "redis_" + key
        if (
            target in own
            or (target in _LOGIN and own & _LOGIN)
            or (key == "url" and not shared.url)
        ):
            continue
        update[target] = getattr(shared, key)
    if not update:
        return section
    keys = cast("RedisKeys", section)
    cluster = update.get("redis_cluster", keys.redis_cluster)
    url = update.get("redis_url", keys.redis_url)
    if cluster and url:
        # Both from [redis] were checked there; both from the section, by the section.
        try:
            check_redis_url(url, cluster=True)
        except ValueError as exc:
            if "redis_url" in update:
                raise ValueError(f"{name}.redis_cluster: redis.url {exc}") from None
            raise ValueError(f"{name}.redis_url: {exc} (redis.cluster is true)") from None
    merged = type(section).model_construct(_fields_set=set(own), **{**section.__dict__, **update})
    return cast("_S", merged)
