"""How to reach a Redis: the connection keys every Redis-using section shares.

``[cache]``, ``[admission]`` and ``[shared_load]`` each have a ``redis_url``
and the same connection keys (cluster, AUTH, TLS), declared once here as
annotated types so that their descriptions and checks cannot drift apart.
:func:`redis_settings` gathers them into one :class:`RedisSettings`, which
the one client builder (``edgeproxy._stages.redisclient.make_client``) turns
into a standalone or a Redis Cluster client.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Protocol

from pydantic import Field

from edgeproxy._core.config.checks import check_redis_url

__all__ = [
    "RedisCluster",
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
    "redis_settings",
]

RedisCluster = Annotated[
    bool,
    Field(
        description="redis_url is one node of a Redis Cluster: the client discovers the others "
        "and sends each key to its master (redis:// or rediss://, database 0)."
    ),
]
RedisUsername = Annotated[str | None, Field(description="Redis ACL user name (AUTH).")]
RedisPassword = Annotated[
    str | None,
    Field(description="Redis password (AUTH). Prefer redis_password_env.", repr=False),
]
RedisPasswordEnv = Annotated[
    str | None,
    Field(description="Name of the environment variable that holds the Redis password."),
]
RedisTls = Annotated[bool, Field(description="Use TLS for a redis:// URL too (rediss:// does).")]
RedisTlsCaFile = Annotated[
    str | None,
    Field(description="CA bundle that verifies the Redis server; the system's if unset."),
]
RedisTlsCertFile = Annotated[
    str | None, Field(description="Client certificate for Redis mutual TLS (PEM).")
]
RedisTlsKeyFile = Annotated[
    str | None, Field(description="Private key of redis_tls_cert_file (PEM).")
]
RedisTlsVerify = Annotated[
    bool, Field(description="Verify the Redis server's certificate and host name.")
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


def check_redis_cluster(cluster: bool, url: str | None) -> bool:
    """A section's ``redis_cluster`` against its ``redis_url`` (None when that key is invalid,
    already reported): a cluster needs a TCP URL with database 0. ``ValueError`` says why."""
    if cluster and url:
        try:
            check_redis_url(url, cluster=True)
        except ValueError as exc:
            raise ValueError(f"redis_url {exc}") from None
    return cluster
