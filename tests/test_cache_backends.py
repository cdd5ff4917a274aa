"""Cache tiers: the bounded LRU memory cache, the circuit breaker, Redis options and faults."""

from __future__ import annotations

import time

import pytest

from edgeproxy._cache.backends import (
    BytesSerializer,
    CircuitBreaker,
    LRUMemoryCache,
    MemoryTier,
    RedisTier,
    TieredBackend,
    make_backend,
)
from edgeproxy._cache.entry import Entry
from edgeproxy._core.config import CacheConfig
from edgeproxy._shared.redisclient import client_options


def _redis_options(config: CacheConfig) -> dict[str, object]:
    """The pool arguments the cache's client gets from ``[cache]``."""
    return client_options(
        config.redis_settings(),
        connect_timeout=config.redis_connect_timeout,
        max_connections=config.redis_max_connections,
        pool_timeout=config.redis_timeout,
    )


class Clock:
    """A hand-driven monotonic clock: expiry and cool-downs without sleeping."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(body: bytes = b"{}", ttl: float = 60.0) -> Entry:
    return Entry.build(
        status=200,
        headers=[("content-type", "application/json")],
        body=body,
        kind="json",
        ttl=ttl,
        swr=0.0,
        sie=0.0,
        delta=0.01,
        region="r1",
    )


async def test_lru_evicts_least_recently_used_by_count() -> None:
    cache = LRUMemoryCache(max_entries=3, max_bytes=10_000)
    for key in "abc":
        await cache.set(key, key.encode())
    assert await cache.get("a") == b"a"  # a is now the most recent
    await cache.set("d", b"d")
    assert cache.keys() == ["c", "a", "d"]
    assert await cache.get("b") is None
    assert cache.evictions == 1 and len(cache) == 3


async def test_lru_evicts_by_bytes_and_refuses_what_cannot_fit() -> None:
    cache = LRUMemoryCache(max_entries=100, max_bytes=10)
    await cache.set("a", b"1234")
    await cache.set("b", b"1234")
    await cache.set("c", b"1234")  # 12 bytes: a goes
    assert cache.keys() == ["b", "c"] and cache.bytes == 8
    assert await cache.set("huge", b"x" * 11) is False
    assert await cache.get("huge") is None and cache.bytes == 8
    await cache.set("b", b"12")  # replacing a key re-weighs it
    assert cache.bytes == 6


async def test_lru_ttl_is_checked_on_read() -> None:
    clock = Clock()
    cache = LRUMemoryCache(max_entries=10, max_bytes=1000, clock=clock)
    await cache.set("k", b"v", ttl=5.0)
    await cache.set("forever", b"v")
    clock.now += 4.9
    assert await cache.exists("k")
    clock.now += 0.2
    assert await cache.get("k") is None
    assert cache.keys() == ["forever"] and cache.bytes == 1
    assert await cache.expire("forever", 1.0)
    clock.now += 2
    assert await cache.get("forever") is None


async def test_lru_keeps_the_rest_of_aiocaches_api() -> None:
    cache = LRUMemoryCache(max_entries=10, max_bytes=1000)
    await cache.add("n", 1)
    with pytest.raises(ValueError):
        await cache.add("n", 2)
    assert await cache.increment("n", 4) == 5
    assert await cache.multi_get(["n", "missing"]) == [5, None]
    await cache.multi_set([("x:1", b"a"), ("x:2", b"b"), ("y", b"c")])
    assert await cache.delete("y") == 1
    await cache.clear(namespace="x:")
    assert cache.keys() == ["n"]
    await cache.clear()
    assert len(cache) == 0 and cache.bytes == 0


async def test_memory_tier_stores_entries_until_their_last_window() -> None:
    tier = MemoryTier(max_entries=10, max_bytes=100_000)
    fresh = entry()
    assert await tier.set("k", fresh)
    assert await tier.get("k") is fresh
    assert not await tier.set("old", entry(ttl=-1.0))  # already past every window
    assert await tier.purge("k") == 1
    assert tier.status()["entries"] == 0


def test_circuit_breaker_opens_then_probes_once() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures=3, cooldown=10.0, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.failure()
    breaker.success()  # a success resets the count
    for _ in range(3):
        assert breaker.allow()
        breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    clock.now += 10.0
    assert breaker.allow()  # the one probe
    assert breaker.state == "half_open" and not breaker.allow()
    breaker.failure()  # the probe failed: open for another cooldown
    assert breaker.state == "open" and breaker.opens_total == 2
    clock.now += 10.0
    assert breaker.allow()
    breaker.abandon()  # the probe's request went away: probe again at once
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow()


def test_bytes_serializer_keeps_bytes() -> None:
    serializer = BytesSerializer()
    assert serializer.encoding is None  # what stops aiocache's Redis backend from decoding
    assert serializer.loads(serializer.dumps(b"\xff\x00")) == b"\xff\x00"
    assert serializer.loads(None) is None


def test_redis_options_for_a_unix_socket() -> None:
    from redis.asyncio import UnixDomainSocketConnection

    options = _redis_options(CacheConfig(redis_url="unix:///run/redis/redis.sock?db=3"))
    assert options["path"] == "/run/redis/redis.sock" and options["db"] == 3
    assert options["connection_class"] is UnixDomainSocketConnection
    assert "host" not in options and "port" not in options


def test_redis_options_from_url_auth_and_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    from redis.asyncio import SSLConnection

    plain = _redis_options(CacheConfig(redis_url="redis://u:p%40ss@cache.internal:6380/3"))
    assert (plain["host"], plain["port"], plain["db"]) == ("cache.internal", 6380, 3)
    assert plain["password"] == "p@ss" and plain["username"] == "u"
    assert "connection_class" not in plain
    # A busy pool waits for a free connection up to the call's timeout.
    assert plain["timeout"] == 0.25 and plain["max_connections"] == 64

    monkeypatch.setenv("REDIS_PW", "from-env")
    tls = _redis_options(
        CacheConfig(
            redis_url="rediss://cache.internal",
            redis_password_env="REDIS_PW",
            redis_username="edge",
            redis_tls_ca_file="/ca.pem",
            redis_tls_cert_file="/c.pem",
            redis_tls_key_file="/k.pem",
        )
    )
    assert tls["connection_class"] is SSLConnection
    assert tls["password"] == "from-env" and tls["port"] == 6379
    assert tls["ssl_ca_certs"] == "/ca.pem" and tls["ssl_certfile"] == "/c.pem"
    assert tls["ssl_keyfile"] == "/k.pem" and tls["ssl_cert_reqs"] == "required"
    assert tls["username"] == "edge"
    insecure = _redis_options(CacheConfig(redis_tls=True, redis_tls_verify=False))
    assert insecure["connection_class"] is SSLConnection
    assert insecure["ssl_cert_reqs"] == "none" and insecure["ssl_check_hostname"] is False


def test_redis_cluster_options_name_one_node_with_tls() -> None:
    options = _redis_options(
        CacheConfig(
            redis_url="rediss://:pw@node-1.cache.internal:7000",
            redis_cluster=True,
            redis_tls_ca_file="/ca.pem",
        )
    )
    assert (options["host"], options["port"], options["password"]) == (
        "node-1.cache.internal",
        7000,
        "pw",
    )
    assert options["ssl"] is True and options["ssl_ca_certs"] == "/ca.pem"
    # RedisCluster takes no db, no connection class and no blocking-pool timeout.
    assert not {"db", "connection_class", "timeout"} & set(options)


def test_cache_config_errors_name_the_key() -> None:
    from edgeproxy import Config
    from edgeproxy._core.config import ConfigError

    with pytest.raises(ConfigError) as info:
        Config.from_mapping(
            {
                "regions": [{"name": "r", "url": "http://127.0.0.1:1"}],
                "cache": {"redis_url": "http://x", "backend": "disk", "max_entry_bytes": 0},
                "routes": [{"name": "x", "path": "/", "cache": "never", "cache_ttl": 0}],
            },
            environ={},
        )
    errors = "\n".join(info.value.errors)
    assert "cache.redis_url: must be a redis://, rediss:// or unix:// URL" in errors
    assert "cache.backend:" in errors and "cache.max_entry_bytes:" in errors
    assert "routes[0].cache:" in errors and "routes[0].cache_ttl:" in errors


async def test_unreachable_redis_fails_open_and_opens_the_breaker() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    config = CacheConfig(
        backend="tiered", redis_url=f"redis://127.0.0.1:{port}", breaker_failures=2
    )
    backend = make_backend(config)
    assert isinstance(backend, TieredBackend)
    try:
        await backend.open()
        assert await backend.set("k", entry())  # the memory tier took it
        assert await backend.get("k") is not None
        assert await backend.get("other") is None
        redis = backend.redis
        assert isinstance(redis, RedisTier)
        for _ in range(3):
            assert await redis.get("x") is None
        status = backend.status()["redis"]
        assert status["breaker"]["state"] == "open"
        assert status["errors"]["error"] >= 2 and status["errors"]["breaker_open"] >= 1
        assert status["url"] == f"redis://127.0.0.1:{port}"
    finally:
        await backend.close()


def test_entry_size_counts_body_and_headers() -> None:
    e = entry(b"x" * 1000)
    assert 1000 < e.size < 1500
    assert time.time() < e.fresh_until
