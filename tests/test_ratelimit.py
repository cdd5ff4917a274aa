"""Rate limits through the real server: local buckets, Redis-shared buckets, Redis outages."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from edgeproxy import EdgeProxy, hookimpl
from edgeproxy._admission.ratelimit import (
    Charge,
    Limit,
    LocalBuckets,
    RateLimiter,
    RedisBuckets,
)
from edgeproxy._core.config import AdmissionConfig, RedisSettings

from .conftest import ProxyFactory, RegionFactory, eventually

CHAT = "/v1/chat/completions"


def chat_body(content: str = "hello", max_tokens: int = 2) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }


async def post(
    client: aiohttp.ClientSession, proxy: EdgeProxy, headers: dict[str, str], body: Any = None
) -> tuple[int, CIMultiDict[str], Any]:
    async with client.post(proxy.url + CHAT, json=body or chat_body(), headers=headers) as resp:
        return resp.status, CIMultiDict(resp.headers), await resp.json()


def key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{name}"}


async def settled(proxy: EdgeProxy) -> None:
    """Wait until every request finished, token settlement included."""
    await eventually(lambda: proxy.pipeline.in_flight == 0)


# -- through the proxy, local buckets -------------------------------------------------


async def test_burst_past_the_rate_gets_429_with_retry_after(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy(
        [{"name": "r1", "url": region.url}],
        admission={"key_requests_per_second": 0.5, "key_burst": 3},
    )
    async with aiohttp.ClientSession() as client:
        statuses = [(await post(client, proxy, key("burst")))[0] for _ in range(3)]
        assert statuses == [200, 200, 200]
        rejected = [await post(client, proxy, key("burst")) for _ in range(2)]
        # Another key under its limit is untouched by the first one's burst.
        for _ in range(3):
            assert (await post(client, proxy, key("calm")))[0] == 200
        for status, headers, data in rejected:
            assert status == 429
            assert data["error"]["code"] == "rate_limit_exceeded"
            assert data["error"]["type"] == "requests"
            assert set(data["error"]) == {"message", "type", "param", "code"}
            retry_after = int(headers["Retry-After"])
            # One request costs 1 token at 0.5/s: at most 2 s away.
            assert 1 <= retry_after <= 2
            assert headers["RateLimit-Limit"] == "3"
            assert headers["RateLimit-Remaining"] == "0"
            assert headers["RateLimit-Reset"] == str(retry_after)
            assert headers["RateLimit-Policy"] == '3;w=6;comment="key-requests"'
            assert headers["X-Request-Id"]
        # Retry-After is enough: after it, the key is served again.
        await asyncio.sleep(int(rejected[-1][1]["Retry-After"]))
        assert (await post(client, proxy, key("burst")))[0] == 200
    # Rejected requests never reached the region.
    assert region.requests_by_path[CHAT] == 3 + 3 + 1
    snapshot = proxy.status()["admission"]["rate_limit"]
    assert snapshot["rejected"] == {"key-requests": 2}
    assert snapshot["backend"] == "local"


async def test_tenant_set_by_a_plugin_keys_the_limit(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    class Tenant:
        @hookimpl
        def edgeproxy_request_received(self, ctx: Any) -> None:
            ctx.tenant = ctx.headers.get("x-team")

    region = await make_region("r1")
    proxy = await make_proxy(
        [{"name": "r1", "url": region.url}],
        plugins=[Tenant()],
        admission={"key_requests_per_second": 0.1, "key_burst": 2},
    )
    async with aiohttp.ClientSession() as client:
        # Different API keys, one tenant: one bucket.
        team = {"x-team": "blue"}
        assert (await post(client, proxy, {**team, **key("a")}))[0] == 200
        assert (await post(client, proxy, {**team, **key("b")}))[0] == 200
        assert (await post(client, proxy, {**team, **key("c")}))[0] == 429
        assert (await post(client, proxy, {"x-team": "red"}))[0] == 200


async def test_per_ip_limit_trusts_forwarded_for_only_from_trusted_proxies(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    limits = {"ip_requests_per_second": 0.1, "ip_burst": 2}
    trusting = await make_proxy(
        [{"name": "r1", "url": region.url}],
        admission={**limits, "trusted_proxies": ["127.0.0.0/8"]},
    )
    untrusting = await make_proxy([{"name": "r1", "url": region.url}], admission=limits)
    async with aiohttp.ClientSession() as client:
        one = {"X-Forwarded-For": "203.0.113.5"}
        two = {"X-Forwarded-For": "198.51.100.7, 203.0.113.6"}
        assert [(await post(client, trusting, one))[0] for _ in range(3)] == [200, 200, 429]
        # Another client behind the same trusted proxy has its own bucket.
        assert (await post(client, trusting, two))[0] == 200
        # Spoofing a left-hand hop does not buy a new bucket.
        spoof = {"X-Forwarded-For": "10.9.9.9, 203.0.113.5"}
        assert (await post(client, trusting, spoof))[0] == 429
        # From an untrusted peer the header is ignored: everyone is 127.0.0.1.
        statuses = [(await post(client, untrusting, h))[0] for h in (one, two, {})]
        assert statuses == [200, 200, 429]


async def test_tokens_per_minute_are_estimated_then_settled(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    # 60 tokens per minute: one a second, a bucket of 60.
    proxy = await make_proxy(
        [{"name": "r1", "url": region.url}], admission={"key_tokens_per_minute": 60}
    )
    long_prompt = chat_body("x" * 200, max_tokens=2)  # estimated at 54 tokens, uses 3
    async with aiohttp.ClientSession() as client:
        # Twice the estimate would not fit in 60: the second passes because the
        # first was settled down to its real usage.
        for _ in range(2):
            assert (await post(client, proxy, key("t"), long_prompt))[0] == 200
            await settled(proxy)
        # A short prompt with a long answer is settled up: the bucket is near empty.
        assert (await post(client, proxy, key("t"), chat_body("hi", max_tokens=50)))[0] == 200
        await settled(proxy)
        status, headers, data = await post(client, proxy, key("t"), long_prompt)
        assert status == 429
        assert data["error"]["type"] == "tokens"
        assert int(headers["Retry-After"]) >= 30
        assert headers["RateLimit-Policy"] == '60;w=60;comment="key-tokens"'
        # Non-LLM paths cost no tokens.
        async with client.get(proxy.url + "/echo/x", headers=key("t")) as resp:
            assert resp.status == 200


async def test_shed_requests_get_their_quota_back(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy(
        [{"name": "r1", "url": region.url}],
        admission={
            "key_requests_per_second": 0.1,
            "key_burst": 2,
            "max_in_flight": 1,
            "max_queue": 0,
        },
    )
    async with aiohttp.ClientSession() as client:
        slow = asyncio.create_task(
            client.get(proxy.url + "/echo/x?chunks=4&delay=0.3", headers=key("q"))
        )
        await eventually(lambda: proxy.pipeline.admission.in_flight == 1)
        assert (await post(client, proxy, key("q")))[0] == 503
        resp = await slow
        await resp.read()
        resp.release()
        # The slot is freed once the handler is done, which may be just after the client
        # read the last byte.
        await eventually(lambda: proxy.pipeline.admission.in_flight == 0)
        # The shed request did not use the key's second token.
        assert (await post(client, proxy, key("q")))[0] == 200
        assert (await post(client, proxy, key("q")))[0] == 429


# -- Redis ----------------------------------------------------------------------------


@pytest.mark.redis
async def test_two_workers_share_a_redis_limit(
    make_region: RegionFactory, make_proxy: ProxyFactory, redis_server: str, redis_prefix: str
) -> None:
    region = await make_region("r1")
    admission = {
        "key_requests_per_second": 0.1,
        "key_burst": 3,
        "redis_url": redis_server,
        "redis_prefix": redis_prefix,
        "redis_timeout": 2.0,
    }
    first = await make_proxy([{"name": "r1", "url": region.url}], admission=admission)
    second = await make_proxy([{"name": "r1", "url": region.url}], admission=admission)
    async with aiohttp.ClientSession() as client:
        statuses = [
            (await post(client, first, key("shared")))[0],
            (await post(client, second, key("shared")))[0],
            (await post(client, first, key("shared")))[0],
            (await post(client, second, key("shared")))[0],
            (await post(client, first, key("shared")))[0],
        ]
    assert statuses == [200, 200, 200, 429, 429]
    for proxy in (first, second):
        assert proxy.status()["admission"]["rate_limit"]["backend"] == "redis"
    # The raw key never becomes a Redis key.
    import redis.asyncio as aioredis

    client_ = aioredis.Redis.from_url(redis_server)
    try:
        keys = [k.decode() async for k in client_.scan_iter(match=redis_prefix + "*")]
    finally:
        await client_.aclose()
    assert keys and all("sk-shared" not in k for k in keys)


@pytest.mark.redis
async def test_lua_script_is_atomic_under_concurrency(redis_server: str, redis_prefix: str) -> None:
    limit = Limit("key-requests", "key", "requests", 0.001, 5)
    buckets = [RedisBuckets(RedisSettings(redis_server), redis_prefix, 5.0) for _ in range(2)]
    try:
        charges = [Charge(limit, "key-requests:atomic", 1.0)]
        decisions = await asyncio.gather(*(buckets[i % 2].run("take", charges) for i in range(20)))
        assert sum(d.allowed for d in decisions) == 5
        refused = [d for d in decisions if not d.allowed]
        assert all(d.limit == limit and d.wait > 0 for d in refused)
        # Settling refunds (never above the bucket size) and charges.
        await buckets[0].run("settle", [Charge(limit, "key-requests:atomic", -2.0)])
        decisions = await asyncio.gather(*(buckets[1].run("take", charges) for _ in range(3)))
        assert [d.allowed for d in decisions].count(True) == 2
    finally:
        for b in buckets:
            await b.aclose()


@pytest.fixture
def own_redis(tmp_path: Any) -> Iterator[tuple[str, Any]]:
    """A redis-server of this test's own, which the test may kill and start again."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs the redis-server binary to kill and restart a Redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(tmp_path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(proc)
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            import time

            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop() -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    start()
    control = type("Control", (), {"start": staticmethod(start), "stop": staticmethod(stop)})
    try:
        yield f"redis://127.0.0.1:{port}/0", control
    finally:
        stop()


async def test_limits_fall_back_to_local_when_redis_dies(
    make_region: RegionFactory, make_proxy: ProxyFactory, own_redis: tuple[str, Any]
) -> None:
    url, control = own_redis
    region = await make_region("r1")
    proxy = await make_proxy(
        [{"name": "r1", "url": region.url}],
        admission={
            "key_requests_per_second": 0.1,
            "key_burst": 2,
            "redis_url": url,
            "redis_timeout": 1.0,
            "redis_retry_interval": 0.2,
        },
    )
    rate = proxy.pipeline.admission.rate
    async with aiohttp.ClientSession() as client:
        assert [(await post(client, proxy, key("k")))[0] for _ in range(3)] == [200, 200, 429]
        assert rate.snapshot()["backend"] == "redis"
        control.stop()
        # Redis is gone: no request fails for it, and the local buckets still limit.
        statuses = [(await post(client, proxy, key("k")))[0] for _ in range(3)]
        assert statuses == [200, 200, 429]
        snapshot = proxy.status()["admission"]["rate_limit"]
        assert snapshot["backend"] == "local (redis down)"
        assert snapshot["redis_errors"] >= 1
        # Redis comes back (empty): the limits are shared through it again.
        control.start()
        await eventually(lambda: rate.snapshot()["backend"] == "redis")
        assert [(await post(client, proxy, key("k")))[0] for _ in range(3)] == [200, 200, 429]


async def test_unreachable_redis_at_startup_means_local_limits(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    region = await make_region("r1")
    proxy = await make_proxy(
        [{"name": "r1", "url": region.url}],
        admission={
            "key_requests_per_second": 0.1,
            "key_burst": 1,
            "redis_url": f"redis://127.0.0.1:{dead}/0",
            "redis_retry_interval": 60,
        },
    )
    async with aiohttp.ClientSession() as client:
        assert [(await post(client, proxy, key("k")))[0] for _ in range(2)] == [200, 429]
    assert proxy.status()["admission"]["rate_limit"]["backend"] == "local (redis down)"


# -- units ----------------------------------------------------------------------------


def test_local_buckets_take_settle_and_forget() -> None:
    limit = Limit("ip-requests", "ip", "requests", 1.0, 2.0)
    buckets = LocalBuckets(max_buckets=2)
    a = [Charge(limit, "ip-requests:a", 1.0)]
    assert buckets.take(a, now=0.0).allowed
    assert buckets.take(a, now=0.0).allowed
    refused = buckets.take(a, now=0.0)
    assert not refused.allowed and refused.wait == pytest.approx(1.0)
    assert buckets.take(a, now=1.0).allowed  # refilled one
    buckets.settle([Charge(limit, "ip-requests:a", -5.0)], now=1.0)  # refund, capped at 2
    assert buckets.take(a, now=1.0).allowed and buckets.take(a, now=1.0).allowed
    assert not buckets.take(a, now=1.0).allowed
    # All or nothing across buckets.
    tokens = Limit("ip-tokens", "ip", "tokens", 1.0, 10.0)
    both = [Charge(limit, "ip-requests:b", 1.0), Charge(tokens, "ip-tokens:b", 50.0)]
    assert buckets.take(both, now=0.0).allowed  # a cost above the size passes a full bucket
    refused = buckets.take(both, now=0.0)
    assert not refused.allowed and refused.limit == tokens
    # Only max_buckets are kept; the oldest is forgotten.
    assert len(buckets) == 2


def test_limits_from_config() -> None:
    limiter = RateLimiter(
        AdmissionConfig(key_requests_per_second=5, ip_tokens_per_minute=600, key_burst=0)
    )
    assert limiter.enabled and limiter.counts_tokens
    names = {lim.name: lim for lim in (*limiter.key_limits, *limiter.ip_limits)}
    assert names["key-requests"].burst == 5  # one second's worth
    assert names["ip-tokens"].rate == 10 and names["ip-tokens"].burst == 600
    assert not RateLimiter(AdmissionConfig()).enabled


async def test_redis_unused_without_limits(redis_server: str) -> None:
    limiter = RateLimiter(AdmissionConfig(redis_url=redis_server))
    await limiter.open()
    assert limiter.redis is None
    await limiter.close()
