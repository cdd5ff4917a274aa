"""Redis connections, declared once and named, and the sections that use them.

``[redis]`` (:class:`RedisConfig`) is the connection named ``"default"``;
``[redis.connections.<name>]`` tables (:class:`RedisConnection`) declare more,
each with the same keys. A Redis-using section (:class:`RedisSection`:
``[cache]``, ``[admission]``, ``[shared_load]``, ``[stateful]``) names the one it
uses with ``redis = "<name>"``, ``"default"`` when unset.

The older spelling, a section's own ``redis_<key>`` keys (``[cache] redis_url``)
over ``[redis]``'s, still works: :func:`resolve_redis` treats those keys as the
section's implicit connection, ``[redis]`` with the section's keys in their
place. Either way it writes the resolved connection's keys into the section's
``redis_*`` fields when the whole config is validated, so every reader of a
section sees its effective keys; :func:`redis_settings` gathers them into one
:class:`RedisSettings`, which the one client builder
(``edgeproxy._shared.redisclient.make_client``) turns into a standalone or a
Redis Cluster client.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeVar, cast

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from edgeproxy._core.config.base import Section
from edgeproxy._core.config.checks import check_redis_url

__all__ = [
    "CONNECTION_KEYS",
    "DEFAULT_CONNECTION",
    "RedisConfig",
    "RedisConnection",
    "RedisSection",
    "RedisSettings",
    "check_redis_cluster",
    "redis_settings",
    "redis_url_field",
    "resolve_redis",
]

DEFAULT_CONNECTION: Final = "default"
"""The name of ``[redis]`` itself, as a section's ``redis`` key names it."""

_URL_FORMS: Final = (
    "redis://host[:port][/db], rediss:// (TLS) or unix:///path/to/redis.sock[?db=N], "
    "optionally with user:password@"
)


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


def check_redis_cluster(cluster: bool, url: str | None, *, key: str = "redis_url") -> bool:
    """A ``cluster`` key against its URL (None when that key is invalid, already reported):
    a cluster needs a TCP URL with database 0. ``ValueError`` says why, naming the URL's
    ``key``."""
    if cluster and url:
        try:
            check_redis_url(url, cluster=True)
        except ValueError as exc:
            raise ValueError(f"{key} {exc}") from None
    return cluster


def _url_checks(url: str, cluster: str) -> tuple[Any, Any]:
    """The checks of a URL key and of its cluster key, for a class whose ``url_optional``
    says whether the URL may be ''."""

    def check_url(cls: type[Any], value: str) -> str:
        return check_redis_url(value, allow_empty=cls.url_optional)

    def check_cluster(cls: type[Any], value: bool, info: ValidationInfo) -> bool:
        return check_redis_cluster(value, info.data.get(url), key=url)

    return field_validator(url)(check_url), field_validator(cluster)(check_cluster)


class RedisConnection(Section):
    """One Redis and how to log in: a ``[redis.connections.<name>]`` table.

    Sections name it with ``redis = "<name>"``; several may name the same one.
    """

    url: str = Field(
        description=f"The Redis: {_URL_FORMS}.",
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
        None, description="CA bundle that verifies the Redis server; none is the system's."
    )
    tls_cert_file: str | None = Field(
        None, description="Client certificate for Redis mutual TLS (PEM)."
    )
    tls_key_file: str | None = Field(None, description="Private key of tls_cert_file (PEM).")
    tls_verify: bool = Field(
        True, description="Verify the Redis server's certificate and host name."
    )

    # Whether url may be '' (no Redis): for [redis] alone, whose url is optional.
    url_optional: ClassVar[bool] = False

    _check_url, _check_cluster = _url_checks("url", "cluster")


# The keys of a connection, each spelt "redis_" + key in a section (the older spelling).
CONNECTION_KEYS: Final = tuple(RedisConnection.model_fields)
# Two spellings of one secret: a section that gives its own password either way takes neither
# of [redis]'s, or [redis]'s password would win over the section's password_env.
_LOGIN: Final = frozenset({"redis_password", "redis_password_env"})


class RedisConfig(RedisConnection):
    """Where Redis is and how to log in: ``[redis]``, the connection named ``"default"``,
    and ``[redis.connections.<name>]``, the others.

    The cache (``backend = "redis"`` or ``"tiered"``), the rate-limit buckets
    (``[admission]``), the shared load view (``[shared_load]``) and the owners of
    stored objects (``[stateful]``) each use the connection their ``redis`` key
    names, this one when unset.
    """

    url: str = Field(
        "",
        description=f"The Redis of every Redis-using section that names no other: {_URL_FORMS}. "
        "Set, it turns on the shared rate-limit buckets, the shared load view and the shared "
        "owners (a section's redis = '' keeps that one local) and is the cache's Redis; '' "
        "leaves each section its own default.",
        repr=False,
    )
    connections: dict[str, RedisConnection] = Field(
        default_factory=dict,
        description="More Redis connections, one [redis.connections.<name>] table each, with "
        "the keys of [redis] (url required); a section uses one with redis = '<name>'.",
    )

    url_optional: ClassVar[bool] = True

    @field_validator("connections")
    @classmethod
    def _check_names(cls, value: dict[str, RedisConnection]) -> dict[str, RedisConnection]:
        for name in value:
            if name == DEFAULT_CONNECTION or not name:
                raise ValueError(
                    f"{name!r} cannot name a connection: 'default' is [redis] itself"
                    if name
                    else "'' cannot name a connection: it means none"
                )
        return value

    def named(self, name: str) -> RedisConnection | None:
        """The connection ``name`` names: this one for ``"default"``, None for ``''``.
        ``ValueError`` for an unknown name, with the closest known one."""
        if not name:
            return None
        if name == DEFAULT_CONNECTION:
            return self
        found = self.connections.get(name)
        if found is not None:
            return found
        known = [DEFAULT_CONNECTION, *self.connections]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(
            f"unknown Redis connection {name!r}{hint} (known: {', '.join(sorted(known))})"
        )


def redis_url_field(purpose: str, default: str = "", off: str | None = None) -> Any:
    """The ``redis_url`` key of a section that uses Redis for ``purpose``: the older
    spelling of its connection's url; ``off`` says what ``''`` means there (None: refused)."""
    empty = f"; '' {off}" if off is not None else ""
    return Field(
        default,
        description=f"{purpose}: {_URL_FORMS}{empty}. Unset: [redis] url"
        + (", if set" if default else "")
        + ". The older spelling of a connection's url (see redis).",
        repr=False,
    )


# The keys a connection's descriptions name, which a section spells "redis_" + key.
_NAMED_KEYS: Final = re.compile(r"\b(url|password_env|tls_\w+)\b")
_LOGIN_UNSET: Final = "[redis] password and password_env, if {} is unset too"


def _older(key: str, unset: str | None = None) -> Any:
    """A section's ``redis_<key>``, the older spelling of its connection's ``key``: the same
    default, described as the connection's key is, with where an unset one comes from."""
    field = RedisConnection.model_fields[key]
    described = _NAMED_KEYS.sub(r"redis_\1", field.description or "")
    return Field(
        field.default,
        description=f"{described} Unset: {unset or f'[redis] {key}'}.",
        repr=field.repr,
    )


class RedisSection(Section):
    """A section that talks to Redis: the connection its ``redis`` key names, or, in the
    older spelling, its own ``redis_<key>`` keys over ``[redis]``'s.

    After :func:`resolve_redis` the ``redis_*`` fields hold the effective keys of the
    connection, whichever spelling chose it.
    """

    redis: str | None = Field(
        None,
        description="The Redis connection this section uses: 'default' ([redis]) or the name "
        "of a [redis.connections.<name>] table; '' none (the section's own default: local, "
        "or the cache's 127.0.0.1). Unset: 'default', or the section's own redis_* keys (the "
        "older spelling) if it sets any; setting both is an error.",
    )
    redis_url: str = redis_url_field("This section's Redis", off="keeps it local")
    redis_cluster: bool = _older("cluster")
    redis_username: str | None = _older("username")
    redis_password: str | None = _older("password", _LOGIN_UNSET.format("redis_password_env"))
    redis_password_env: str | None = _older("password_env", _LOGIN_UNSET.format("redis_password"))
    redis_tls: bool = _older("tls")
    redis_tls_ca_file: str | None = _older("tls_ca_file")
    redis_tls_cert_file: str | None = _older("tls_cert_file")
    redis_tls_key_file: str | None = _older("tls_key_file")
    redis_tls_verify: bool = _older("tls_verify")

    # Whether redis_url may be '' (no Redis: the section keeps its state in the process).
    url_optional: ClassVar[bool] = True

    _check_url, _check_cluster = _url_checks("redis_url", "redis_cluster")

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A section that names its connection is dumped as it was written: its redis_* keys
        # are the connection's, and validated again beside its name they would be an error.
        data = handler(self)
        if self.redis is not None and isinstance(data, dict):
            for key in CONNECTION_KEYS:
                data.pop("redis_" + key, None)
        return data

    def redis_settings(self) -> RedisSettings:
        """Where this section's Redis is and how to log in."""
        return redis_settings(self)


def redis_settings(
    section: RedisSection, environ: Mapping[str, str] | None = None
) -> RedisSettings:
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


_S = TypeVar("_S", bound=RedisSection)


def resolve_redis(name: str, section: _S, redis: RedisConfig) -> _S:
    """``section`` (the config's ``[name]``) with the keys of its connection in its
    ``redis_*`` fields; ``section`` itself when they are already there.

    The connection is the one ``section.redis`` names; unset, ``[redis]`` with the keys the
    section sets itself (the older spelling) in their place, even those set to their
    default: "set" is what the file and the environment named (pydantic's
    ``model_fields_set``). An empty url is no url: the section keeps its own default.
    The result keeps the section's own ``model_fields_set``, so resolving again (a config
    validated anew) gives the same keys. ``ValueError``, naming the keys, for an unknown
    connection, for a name beside ``redis_*`` keys of the section's own, and for a key taken
    from ``[redis]`` that does not fit one the section sets (a cluster with a database
    other than 0).
    """
    own = section.model_fields_set
    given = [key for key in CONNECTION_KEYS if "redis_" + key in own]
    where = "redis"
    if section.redis is None:
        connection: RedisConnection | None = redis
    elif given:
        keys = ", ".join(f"{name}.redis_{key}" for key in given)
        raise ValueError(
            f"{name}.redis: names the connection {section.redis!r}, and {keys} give the section "
            "one of its own (the older spelling): set one or the other"
        )
    else:
        try:
            connection = redis.named(section.redis)
        except ValueError as exc:
            raise ValueError(f"{name}.redis: {exc}") from None
        if section.redis != DEFAULT_CONNECTION:
            where = f"redis.connections.{section.redis}"
    fields = type(section).model_fields
    update: dict[str, Any] = {}
    taken: set[str] = set()
    for key in CONNECTION_KEYS:
        target = "redis_" + key
        if target in own:
            continue
        value = fields[target].get_default(call_default_factory=True)
        if (
            connection is not None
            and key in connection.model_fields_set
            and not (target in _LOGIN and own & _LOGIN)
            and not (key == "url" and not connection.url)
        ):
            value = getattr(connection, key)
            taken.add(target)
        update[target] = value
    if all(getattr(section, key) == value for key, value in update.items()):
        return section
    cluster = update.get("redis_cluster", section.redis_cluster)
    url = update.get("redis_url", section.redis_url)
    if cluster and url and len(taken & {"redis_cluster", "redis_url"}) == 1:
        # One from the connection, one from the section: each was checked alone.
        try:
            check_redis_url(url, cluster=True)
        except ValueError as exc:
            if "redis_url" in taken:
                raise ValueError(f"{name}.redis_cluster: {where}.url {exc}") from None
            raise ValueError(f"{name}.redis_url: {exc} ({where}.cluster is true)") from None
    merged = type(section).model_construct(_fields_set=set(own), **{**section.__dict__, **update})
    return cast("_S", merged)
