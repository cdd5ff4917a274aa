"""``[redis]``: one home for the Redis connection keys, each section's ``redis_*`` overriding it."""

from __future__ import annotations

from typing import Any

import pytest

from edgeproxy._admission.ratelimit import RateLimiter
from edgeproxy._cache.backends import RedisTier
from edgeproxy._core.config import Config, ConfigError, iter_config_keys
from edgeproxy._shared.redisclient import client_options

MINIMAL: dict[str, Any] = {"regions": [{"name": "r1", "url": "http://127.0.0.1:9"}]}
SECTIONS = ("cache", "admission", "shared_load")


def load(environ: dict[str, str] | None = None, **data: Any) -> Config:
    return Config.from_mapping({**MINIMAL, **data}, environ={} if environ is None else environ)


def options(config: Config, section: str) -> dict[str, Any]:
    """The client options the section's Redis client is built with."""
    settings = getattr(config, section).redis_settings()
    return client_options(settings, connect_timeout=1.0)


def test_only_redis_serves_every_section(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_REDIS_PW", "from-env")
    config = load(
        redis={
            "url": "rediss://redis.internal:6380/1",
            "username": "edge",
            "password_env": "EDGE_REDIS_PW",
            "tls_ca_file": "/ca.pem",
        }
    )
    for section in SECTIONS:
        assert getattr(config, section).redis_url == "rediss://redis.internal:6380/1"
        found = options(config, section)
        assert (found["host"], found["port"], found["db"]) == ("redis.internal", 6380, 1)
        assert (found["username"], found["password"]) == ("edge", "from-env")
        assert found["ssl_ca_certs"] == "/ca.pem"
    # A URL is what turns the shared buckets and the shared load view on.
    assert config.shared_load.enabled


def test_a_section_key_overrides_redis_even_when_set_to_its_default() -> None:
    config = load(
        redis={"url": "redis://shared:6379/2", "tls": True, "username": "edge"},
        cache={"redis_url": "redis://127.0.0.1:6379/0", "redis_tls": False},
        shared_load={"redis_url": ""},
    )
    # The cache names its own URL and TLS, both the defaults, and keeps them.
    assert config.cache.redis_url == "redis://127.0.0.1:6379/0"
    assert not config.cache.redis_tls
    assert config.cache.redis_username == "edge"
    assert (config.admission.redis_url, config.admission.redis_tls) == (
        "redis://shared:6379/2",
        True,
    )
    # An empty URL in a section keeps that one local.
    assert config.shared_load.redis_url == ""
    assert not config.shared_load.enabled
    assert config.shared_load.redis_tls


def test_a_sections_own_password_either_way_wins_over_redis(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CACHE_PW", "cache-secret")
    config = load(
        redis={"url": "redis://shared:6379/0", "password": "shared-secret"},
        cache={"redis_password_env": "CACHE_PW"},
    )
    assert config.cache.redis_settings().password == "cache-secret"
    assert config.admission.redis_settings().password == "shared-secret"


def test_old_style_section_keys_alone_work_as_before() -> None:
    data: dict[str, dict[str, Any]] = {
        "cache": {"backend": "redis", "redis_url": "redis://c:6379/3", "redis_tls": True},
        "admission": {"redis_url": "redis://a:6379/0", "redis_password": "pw"},
        "shared_load": {"redis_url": "unix:///run/redis.sock?db=2"},
    }
    config = load(**data)
    assert config.cache.redis_url == "redis://c:6379/3" and config.cache.redis_tls
    assert config.admission.redis_settings().password == "pw"
    assert config.shared_load.redis_url == "unix:///run/redis.sock?db=2"
    for section in SECTIONS:
        assert getattr(config, section).model_fields_set == set(data[section])
    # Without [redis] every section keeps its defaults: the cache's local Redis, the
    # others off.
    defaults = load()
    assert defaults.cache.redis_url == "redis://127.0.0.1:6379/0"
    assert defaults.admission.redis_url == defaults.shared_load.redis_url == ""
    assert not defaults.shared_load.enabled


def test_environment_overrides_redis_and_the_section_keys() -> None:
    config = load(
        environ={
            "EDGEPROXY_REDIS__URL": "redis://from-env:6379/0",
            "EDGEPROXY_REDIS__TLS": "true",
            "EDGEPROXY_ADMISSION__REDIS_URL": "redis://admission-env:6379/0",
        },
        shared_load={"redis_url": "redis://file:6379/0"},
    )
    assert config.cache.redis_url == "redis://from-env:6379/0"
    assert config.admission.redis_url == "redis://admission-env:6379/0"
    # The section's key wins over [redis], whichever of them the environment set.
    assert config.shared_load.redis_url == "redis://file:6379/0"
    assert all(getattr(config, section).redis_tls for section in SECTIONS)
    overridden = load(
        environ={"EDGEPROXY_SHARED_LOAD__REDIS_URL": "''"},
        redis={"url": "redis://file:6379/0"},
    )
    assert overridden.shared_load.redis_url == ""


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (
            {"redis": {"url": "http://h"}},
            "redis.url: must be a redis://, rediss:// or unix:// URL, or ''",
        ),
        (
            {"redis": {"url": "redis://h/2", "cluster": True}},
            "redis.cluster: url names database 2: a Redis Cluster has database 0 only",
        ),
        (
            {"redis": {"url": "redis://h/2"}, "admission": {"redis_cluster": True}},
            "admission.redis_cluster: redis.url names database 2: a Redis Cluster has "
            "database 0 only",
        ),
        (
            {"redis": {"cluster": True}, "cache": {"redis_url": "unix:///r.sock"}},
            "cache.redis_url: is a Unix socket: a Redis Cluster is reached by redis:// or "
            "rediss:// (redis.cluster is true)",
        ),
        ({"redis": {"redis_url": "redis://h"}}, "redis.redis_url: unknown key"),
    ],
)
def test_errors_name_the_key_and_the_source(data: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_mapping({**MINIMAL, **data}, environ={}, source="edge.toml")
    assert info.value.errors == [error]
    assert info.value.source == "edge.toml"


def test_the_password_stays_out_of_errors_and_reprs() -> None:
    with pytest.raises(ConfigError) as info:
        load(redis={"url": "redis://u:s3cret@h:99999"})
    assert "s3cret" not in str(info.value)
    config = load(redis={"url": "redis://u:s3cret@h", "password": "s3cret"})
    assert "s3cret" not in repr(config.redis) and "s3cret" not in repr(config.cache)


def test_a_dumped_config_validates_to_the_same_one() -> None:
    """The supervisor hands its workers the config as JSON: they must see the same Redis."""
    config = load(redis={"url": "redis://shared:6379/0", "tls": True}, cache={"redis_tls": False})
    again = Config.from_mapping(config.model_dump(mode="json"), environ={})
    assert again == config
    assert again.admission.redis_tls and not again.cache.redis_tls


def test_the_reference_lists_the_redis_keys() -> None:
    docs = {key: description for key, _type, _default, description in iter_config_keys()}
    assert {f"redis.{key}" for key in ("url", "cluster", "password_env", "tls_verify")} <= set(docs)
    assert "Unset: [redis] cluster" in docs["cache.redis_cluster"]


@pytest.mark.redis
async def test_every_client_reaches_the_redis_only_redis_names(
    redis_server: str, redis_prefix: str
) -> None:
    config = load(
        redis={"url": redis_server},
        cache={"backend": "redis"},
        admission={"key_requests_per_second": 5.0, "redis_prefix": redis_prefix},
    )
    tier = RedisTier(config.cache)
    try:
        assert await tier.client.ping()
    finally:
        await tier.close()
    limiter = RateLimiter(config.admission)
    await limiter.open()
    try:
        assert limiter.redis is not None and limiter.redis_up
    finally:
        await limiter.close()
