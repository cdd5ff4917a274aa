"""The Redis tier against real Redis servers: the machine's (own key prefix) and ones
these tests start, kill, slow down and put behind TLS and a password themselves."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from edgeproxy import EdgeProxy

from .conftest import ProxyFactory, RegionFactory, eventually
from .test_cache import CHAT, cache_status, chat, post, sse_data, upstream_calls

pytestmark = pytest.mark.redis

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnRedis:
    """A redis-server of this test's own, to kill and restart on the same port."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.extra = list(extra)
        self.tls = "--tls-port" in extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        port_args = ["--port", "0", "--tls-port", str(self.port)] if self.tls else []
        args = [a for a in self.extra if a not in ("--tls-port",)] if self.tls else self.extra
        argv = [
            REDIS_SERVER,
            *(port_args or ["--port", str(self.port)]),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            *args,
        ]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def wait_ready(self) -> None:
        async def listening() -> bool:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                return False
            writer.close()
            await writer.wait_closed()
            return True

        for _ in range(200):
            if await listening():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Any]:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("no redis-server binary to start")
    servers: list[OwnRedis] = []

    async def factory(*extra: str) -> OwnRedis:
        server = OwnRedis(tmp_path, *extra)
        server.start()
        servers.append(server)
        await server.wait_ready()
        return server

    yield factory
    for server in servers:
        server.kill()


async def start(make_proxy: ProxyFactory, region_url: str, **cache: Any) -> EdgeProxy:
    """A proxy in front of ``region_url`` with this [cache] section (early refresh off)."""
    return await make_proxy(
        [{"name": "r1", "url": region_url}], cache={"xfetch_beta": 0.0, **cache}
    )


async def test_two_proxies_share_the_redis_tier(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    redis_server: str,
    redis_prefix: str,
) -> None:
    region = await make_region("r1", tokens=5)
    # Generous: this test is about sharing, not about timeouts on a busy machine.
    common = {"redis_url": redis_server, "key_prefix": redis_prefix, "redis_timeout": 2.0}
    first = await start(make_proxy, region.url, backend="redis", **common)
    second = await start(make_proxy, region.url, backend="tiered", **common)
    async with aiohttp.ClientSession() as client:
        _, headers, body = await post(client, first.url + CHAT, chat("shared"))
        assert headers["X-Edgeproxy-Cache"] == "MISS"
        await eventually(lambda: cache_status(first)["stores"] == 1)
        _, headers, again = await post(client, second.url + CHAT, chat("shared"))
        assert headers["X-Edgeproxy-Cache"] == "HIT" and again == body
        # The Redis hit filled the second proxy's memory tier.
        assert cache_status(second)["tiers"]["memory"]["entries"] == 1

        # Streams too: recorded by one proxy, replayed as SSE events by the other.
        _, headers, streamed = await post(client, second.url + CHAT, chat("sse", stream=True))
        assert headers["X-Edgeproxy-Cache"] == "MISS"
        await eventually(lambda: cache_status(second)["stores"] == 1)
        _, headers, replay = await post(client, first.url + CHAT, chat("sse", stream=True))
        assert headers["X-Edgeproxy-Cache"] == "HIT"
        assert replay == streamed and len(sse_data(replay)) == 7
    assert upstream_calls(region) == 2

    # Key names carry the prefix and hashes only, never the prompt.
    client_redis = aioredis.Redis.from_url(redis_server)
    try:
        names = [k async for k in client_redis.scan_iter(match=redis_prefix + "*")]
    finally:
        await client_redis.aclose()
    assert len(names) == 2
    assert all(b"shared" not in name and b"sse" not in name for name in names)


async def test_garbage_in_redis_is_a_miss(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    redis_server: str,
    redis_prefix: str,
) -> None:
    region = await make_region("r1")
    proxy = await start(
        make_proxy,
        region.url,
        backend="redis",
        redis_url=redis_server,
        key_prefix=redis_prefix,
        redis_timeout=2.0,
    )
    client_redis = aioredis.Redis.from_url(redis_server)
    try:
        async with aiohttp.ClientSession() as client:
            _, headers, _ = await post(client, proxy.url + CHAT, chat())
            name = redis_prefix + headers["X-Edgeproxy-Cache-Key"]
            await eventually(lambda: cache_status(proxy)["stores"] == 1)
            valid = await client_redis.get(name)
            assert valid is not None
            garbage = [b"not an entry", "text \u00e9".encode(), valid[:-3], b"EPC1\xff\xff", b""]
            for value in garbage:
                await client_redis.set(name, value, px=60_000)
                status, headers, _ = await post(client, proxy.url + CHAT, chat())
                assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
                await eventually(lambda: not proxy.pipeline.cache.coalescer.flights)
            _, headers, _ = await post(client, proxy.url + CHAT, chat())
            assert headers["X-Edgeproxy-Cache"] == "HIT"
    finally:
        await client_redis.aclose()
    assert cache_status(proxy)["errors"] == {"garbage": len(garbage)}
    assert upstream_calls(region) == 1 + len(garbage)


async def test_redis_killed_mid_run_fails_open_and_recovers(
    make_region: RegionFactory, make_proxy: ProxyFactory, own_redis: Any
) -> None:
    server = await own_redis()
    region = await make_region("r1")
    proxy = await start(
        make_proxy,
        region.url,
        backend="redis",
        redis_url=server.url,
        redis_timeout=0.5,
        breaker_failures=3,
        breaker_cooldown=0.3,
    )
    async with aiohttp.ClientSession() as client:

        async def ask(prompt: str) -> str:
            # A hang guard, not a timing assertion: a stuck request fails here.
            status, headers, _ = await asyncio.wait_for(
                post(client, proxy.url + CHAT, chat(prompt)), 10
            )
            assert status == 200
            await eventually(lambda: not proxy.pipeline.cache.coalescer.flights)
            return str(headers["X-Edgeproxy-Cache"])

        assert await ask("before") == "MISS"
        assert await ask("before") == "HIT"
        server.kill()
        outcomes = [await ask(f"down {i}") for i in range(8)]
        assert outcomes == ["MISS"] * 8
        status = cache_status(proxy)
        redis = status["tiers"]
        assert redis["breaker"]["opens_total"] >= 1
        errors = status["errors"]
        assert errors.get("error", 0) + errors.get("timeout", 0) >= 3
        assert errors["breaker_open"] >= 1
        assert redis["last_error"]

        # Back on the same port: after the cooldown a probe closes the breaker again.
        server.start()
        await server.wait_ready()

        async def stored_again() -> bool:
            return await ask("after") == "HIT"

        for _ in range(100):
            if await stored_again():
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the cache never used Redis again")
        assert cache_status(proxy)["tiers"]["breaker"]["state"] == "closed"


async def test_slow_redis_times_out_and_the_request_goes_upstream(
    make_region: RegionFactory, make_proxy: ProxyFactory, own_redis: Any
) -> None:
    server = await own_redis()
    region = await make_region("r1")
    proxy = await start(
        make_proxy, region.url, backend="redis", redis_url=server.url, redis_timeout=0.5
    )
    admin = aioredis.Redis.from_url(server.url)
    try:
        async with aiohttp.ClientSession() as client:
            await post(client, proxy.url + CHAT, chat())
            await eventually(lambda: cache_status(proxy)["stores"] == 1)
            # Every other client of this Redis now waits for 5 s.
            await admin.execute_command("CLIENT", "PAUSE", "5000", "ALL")
            status, headers, _ = await asyncio.wait_for(post(client, proxy.url + CHAT, chat()), 10)
            assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
    finally:
        await admin.aclose()
    assert cache_status(proxy)["errors"]["timeout"] >= 1
    assert upstream_calls(region) == 2


async def test_redis_over_tls_with_a_password(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    own_redis: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    try:
        server = await own_redis(
            "--tls-port",
            "--tls-cert-file", str(cert),
            "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(cert),
            "--tls-auth-clients", "no",
            "--requirepass", "s3cret",
        )  # fmt: skip
    except AssertionError:
        pytest.skip("this redis-server was built without TLS")
    region = await make_region("r1")
    monkeypatch.setenv("TEST_REDIS_PASSWORD", "s3cret")
    good = await start(
        make_proxy,
        region.url,
        backend="redis",
        redis_url=server.url,
        redis_password_env="TEST_REDIS_PASSWORD",
        redis_tls_ca_file=str(cert),
        redis_timeout=2.0,  # TLS handshakes on a busy 2-core machine: not what is tested
    )
    wrong = await start(
        make_proxy,
        region.url,
        backend="redis",
        redis_url=server.url.replace("rediss://", "rediss://:wrong@"),
        redis_tls_ca_file=str(cert),
    )
    async with aiohttp.ClientSession() as client:
        await post(client, good.url + CHAT, chat())
        await eventually(lambda: cache_status(good)["stores"] == 1)
        _, headers, _ = await post(client, good.url + CHAT, chat())
        assert headers["X-Edgeproxy-Cache"] == "HIT"
        # A wrong password fails open: answered from upstream, errors counted.
        status, headers, _ = await post(client, wrong.url + CHAT, chat())
        assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
    assert cache_status(good)["errors"] == {}
    assert cache_status(wrong)["errors"]["error"] >= 1
    assert "auth" in (cache_status(wrong)["tiers"]["last_error"] or "").lower()


async def test_a_busy_redis_pool_waits_instead_of_failing(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    redis_server: str,
    redis_prefix: str,
) -> None:
    region = await make_region("r1")
    proxy = await start(
        make_proxy,
        region.url,
        backend="redis",
        redis_url=redis_server,
        key_prefix=redis_prefix,
        redis_max_connections=1,
        redis_timeout=2.0,
    )
    async with aiohttp.ClientSession() as client:
        results = await asyncio.gather(
            *(post(client, proxy.url + CHAT, chat(f"prompt {i}")) for i in range(10))
        )
        assert [status for status, _, _ in results] == [200] * 10
        await eventually(lambda: cache_status(proxy)["stores"] == 10)
    assert cache_status(proxy)["errors"] == {}
