"""Named Redis connections: ``[redis.connections.<name>]`` declared once, named by each
section's ``redis`` key; a section's own ``redis_*`` keys are the older spelling."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from edgeproxy._cache.backends import RedisTier
from edgeproxy._cache.entry import Entry
from edgeproxy._core.config import Config, ConfigError, iter_config_keys

MINIMAL: dict[str, Any] = {"regions": [{"name": "r1", "url": "http://127.0.0.1:9"}]}
SECTIONS = ("cache", "admission", "shared_load", "stateful")
SHARED: dict[str, Any] = {
    "url": "rediss://shared.internal:6380/0",
    "cluster": True,
    "username": "edge",
    "password_env": "SHARED_PW",
    "tls_ca_file": "/ca.pem",
}


def load(environ: dict[str, str] | None = None, **data: Any) -> Config:
    return Config.from_mapping({**MINIMAL, **data}, environ={} if environ is None else environ)


def errors(environ: dict[str, str] | None = None, **data: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(
            {**MINIMAL, **data}, environ={} if environ is None else environ, source="edge.toml"
        )
    assert info.value.source == "edge.toml"
    return info.value.errors


def test_a_section_uses_the_connection_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARED_PW", "from-env")
    config = load(
        redis={"url": "redis://default:6379/1", "connections": {"shared": SHARED}},
        cache={"backend": "redis", "redis": "shared"},
    )
    settings = config.cache.redis_settings()
    assert settings.url == "rediss://shared.internal:6380/0" and settings.cluster
    assert (settings.username, settings.password) == ("edge", "from-env")
    assert settings.tls_ca_file == "/ca.pem"
    # The others name none: [redis], the connection called 'default'.
    for section in ("admission", "shared_load", "stateful"):
        assert getattr(config, section).redis_url == "redis://default:6379/1"
        assert not getattr(config, section).redis_cluster


def test_default_names_redis_itself_and_is_what_an_unset_redis_means() -> None:
    named = load(
        redis={"url": "redis://default:6379/1", "tls": True}, admission={"redis": "default"}
    )
    unset = load(redis={"url": "redis://default:6379/1", "tls": True})
    assert named.admission.redis_settings() == unset.admission.redis_settings()
    assert named.admission.redis_url == "redis://default:6379/1" and named.admission.redis_tls
    # Without a [redis] url each section keeps its default: the cache's local Redis, the
    # others none.
    bare = load(cache={"redis": "default"}, shared_load={"redis": "default"})
    assert bare.cache.redis_url == "redis://127.0.0.1:6379/0"
    assert bare.shared_load.redis_url == "" and not bare.shared_load.enabled


def test_an_empty_name_keeps_a_section_off_redis() -> None:
    config = load(redis={"url": "redis://default:6379/1", "tls": True}, shared_load={"redis": ""})
    assert config.shared_load.redis_url == "" and not config.shared_load.enabled
    assert not config.shared_load.redis_tls
    assert config.admission.redis_url == "redis://default:6379/1"


def test_two_sections_share_one_connection() -> None:
    config = load(
        redis={"connections": {"shared": SHARED, "other": {"url": "redis://other:6379/0"}}},
        admission={"redis": "shared"},
        stateful={"redis": "shared"},
        shared_load={"redis": "other"},
    )
    assert config.admission.redis_settings() == config.stateful.redis_settings()
    assert config.admission.redis_url == "rediss://shared.internal:6380/0"
    assert config.shared_load.redis_url == "redis://other:6379/0"
    # Each section keeps its own keys of how it uses the connection.
    assert config.admission.redis_prefix != config.stateful.redis_prefix
    assert config.cache.redis_url == "redis://127.0.0.1:6379/0"


def test_an_unknown_name_is_an_error_with_the_closest_one() -> None:
    assert errors(redis={"connections": {"shared": SHARED}}, cache={"redis": "shraed"}) == [
        "cache.redis: unknown Redis connection 'shraed'; did you mean 'shared'? "
        "(known: default, shared)"
    ]
    assert errors(stateful={"redis": "nowhere"}) == [
        "stateful.redis: unknown Redis connection 'nowhere' (known: default)"
    ]


def test_an_unknown_name_from_the_environment_names_the_variable() -> None:
    found = errors(
        environ={"EDGEPROXY_ADMISSION__REDIS": "shard"}, redis={"connections": {"shared": SHARED}}
    )
    assert found == [
        "admission.redis (from the environment variable EDGEPROXY_ADMISSION__REDIS): unknown "
        "Redis connection 'shard'; did you mean 'shared'? (known: default, shared)"
    ]


def test_a_name_beside_the_sections_own_keys_is_an_error_naming_both() -> None:
    assert errors(
        redis={"connections": {"shared": SHARED}},
        cache={"redis": "shared", "redis_url": "redis://c:6379/0", "redis_tls": True},
    ) == [
        "cache.redis: names the connection 'shared', and cache.redis_url, cache.redis_tls give "
        "the section one of its own (the older spelling): set one or the other"
    ]


@pytest.mark.parametrize(
    ("connections", "error"),
    [
        (
            {"default": {"url": "redis://h"}},
            "redis.connections: 'default' cannot name a connection: 'default' is [redis] itself",
        ),
        ({"x": {"tls": True}}, "redis.connections.x.url: Field required"),
        (
            {"x": {"url": ""}},
            "redis.connections.x.url: must be a redis://, rediss:// or unix:// URL",
        ),
        (
            {"x": {"url": "redis://h/2", "cluster": True}},
            "redis.connections.x.cluster: url names database 2: a Redis Cluster has database 0 "
            "only",
        ),
        (
            {"x": {"url": "redis://h", "tsl": True}},
            "redis.connections.x.tsl: unknown key; did you mean 'tls'?",
        ),
    ],
)
def test_connections_are_checked_where_declared(connections: dict[str, Any], error: str) -> None:
    assert errors(redis={"connections": connections}) == [error]


def test_the_older_spelling_still_works_as_an_implicit_connection() -> None:
    config = load(
        redis={"url": "redis://default:6379/2", "username": "edge", "connections": {"s": SHARED}},
        cache={"redis_url": "redis://c:6379/3", "redis_tls": True},
        shared_load={"redis_url": ""},
    )
    assert config.cache.redis_url == "redis://c:6379/3" and config.cache.redis_tls
    # Keys the section leaves unset are [redis]'s, never a named connection's.
    assert config.cache.redis_username == "edge" and not config.cache.redis_cluster
    assert config.shared_load.redis_url == "" and not config.shared_load.enabled
    assert config.cache.model_fields_set == {"redis_url", "redis_tls"}


def test_a_dumped_config_validates_to_the_same_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor hands its workers the config as JSON: they must see the same Redis."""
    monkeypatch.setenv("SHARED_PW", "pw")
    config = load(
        redis={"url": "redis://default:6379/0", "connections": {"shared": SHARED}},
        cache={"redis": "shared"},
        admission={"redis_tls": True},
        stateful={"redis": ""},
    )
    dumped = config.model_dump(mode="json")
    assert "redis_url" not in dumped["cache"] and dumped["cache"]["redis"] == "shared"
    again = Config.from_mapping(dumped, environ={})
    assert again == config
    for section in SECTIONS:
        assert getattr(again, section).redis_settings() == getattr(config, section).redis_settings()


def test_the_reference_lists_the_connection_keys() -> None:
    docs = {key: description for key, _type, _default, description in iter_config_keys()}
    for key in ("url", "cluster", "password_env", "tls_verify"):
        assert docs[f"redis.connections.<name>.{key}"]
    for section in SECTIONS:
        assert "[redis.connections.<name>]" in docs[f"{section}.redis"]
        assert "older spelling" in docs[f"{section}.redis_url"]


@pytest.mark.redis
async def test_a_cache_naming_a_connection_talks_to_that_redis(
    redis_server: str, redis_prefix: str
) -> None:
    config = load(
        # [redis] points nowhere: only the named connection can reach the server.
        redis={"url": "redis://127.0.0.1:9/0", "connections": {"local": {"url": redis_server}}},
        cache={"backend": "redis", "redis": "local", "key_prefix": redis_prefix},
    )
    tier = RedisTier(config.cache)
    stored = Entry.build(
        status=200,
        headers=[("content-type", "application/json")],
        body=b'{"ok": true}',
        kind="json",
        ttl=60.0,
        swr=0.0,
        sie=0.0,
        delta=0.01,
        region="r1",
    )
    try:
        assert await tier.set("k1", stored)
        found = await tier.get("k1")
        assert found is not None and found.body == b'{"ok": true}'
    finally:
        await tier.close()
    client = aioredis.Redis.from_url(redis_server)
    try:
        names = [name async for name in client.scan_iter(match=redis_prefix + "*")]
    finally:
        await client.aclose()
    assert names == [(redis_prefix + "k1").encode()]
