"""The shared load view: processes sharing one Redis see each other's load per region; a Redis
that is down, frozen or away leaves every process on its local values without a wait."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from edgeproxy import Config, EdgeProxy
from edgeproxy._core.config import SharedLoadConfig
from edgeproxy._shared.loadview import LoadView, _parse
from edgeproxy._upstream.regions import RegionSet

from .conftest import FakeClock, ProxyFactory, RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
REDIS_SERVER = shutil.which("redis-server")


def regions_config(*names: str) -> Config:
    tables = [{"name": n, "url": f"http://127.0.0.1:{1 + i}"} for i, n in enumerate(names)]
    return Config.from_mapping(proxy_config(tables), environ={})


@pytest.fixture
async def region_sets() -> AsyncIterator[list[RegionSet]]:
    """Region sets (pools built, never opened) for views driven round by round."""
    made: list[RegionSet] = []
    yield made
    for regions in made:
        await regions.close()


def shared(url: str, prefix: str, **extra: Any) -> SharedLoadConfig:
    # Rounds are driven by the tests unless they say otherwise.
    values: dict[str, Any] = {
        "redis_url": url,
        "redis_prefix": prefix,
        "redis_timeout": 5.0,
        "interval": 60.0,
        "ttl": 120.0,
    }
    return SharedLoadConfig(**{**values, **extra})


# -- no Redis ------------------------------------------------------------------------


def test_entries_that_do_not_parse_are_none() -> None:
    assert _parse(b"1700000000000 3 12.500 0.7500") == (1700000000000, 3.0, 0.0125, 0.75)
    assert _parse("1700000000000 0 - 0.0000") == (1700000000000, 0.0, None, 0.0)
    for bad in (b"", b"1 2 3", b"x 1 - 1", b"1 nan - 1", b"1 -4 - 1", b"1 1 inf 1", b"1 2 3 4 5"):
        assert _parse(bad) is None, bad


async def test_a_view_without_redis_url_is_off_and_the_proxy_has_none(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region])
    assert proxy.load_view is None
    status = proxy.status()
    assert status["shared_load"] is None and "shared_load" not in status["regions"][0]


# -- one standalone Redis ------------------------------------------------------------


@pytest.mark.redis
async def test_rounds_share_in_flight_rate_and_ttft_and_age_out(
    redis_server: str, redis_prefix: str, region_sets: list[RegionSet]
) -> None:
    config = regions_config("eu", "us")
    clock = FakeClock(start=1000.0)
    region_sets += [RegionSet(config), RegionSet(config)]
    a = LoadView(shared(redis_server, redis_prefix), region_sets[0], clock=clock, process_id="a")
    b = LoadView(shared(redis_server, redis_prefix), region_sets[1], clock=clock, process_id="b")
    try:
        await a.open(background=False)
        await b.open(background=False)
        assert not a.fresh and a.global_in_flight("eu") is None  # nothing read yet
        eu_a, eu_b = region_sets[0].by_name["eu"], region_sets[1].by_name["eu"]
        eu_a.in_flight, eu_b.in_flight = 3, 5
        eu_a.latency.observe(0.2)
        eu_b.latency.observe(0.4)
        for _ in range(10):
            eu_a.count_request(0.0)
        clock.advance(1.0)
        await a.round()
        await b.round()
        await a.round()
        assert a.global_in_flight("eu") == 8 and b.global_in_flight("eu") == 8
        assert a.global_in_flight("us") == 0
        # Rate: a's requests over the second that passed, shared with b; b sent none.
        rate_a = a.global_rate("eu")
        assert (
            rate_a is not None
            and rate_a > 0
            and b.global_rate("eu") == pytest.approx(rate_a, abs=1e-3)
        )
        # TTFT weighted by rate: only a sends, so a's.
        assert b.global_ttft("eu") == pytest.approx(0.2)
        # Own counts are live, the other's as of the last round.
        eu_a.in_flight = 0
        assert a.global_in_flight("eu") == 5 and b.global_in_flight("eu") == 8
        # /status: per region, and the view itself.
        regions = [{"name": "eu"}, {"name": "us"}, {"name": "gone"}]
        a.annotate(regions)
        assert regions[0]["shared_load"] == {
            "fresh": True,
            "in_flight": 5.0,
            "requests_per_second": round(rate_a, 3),
            "ttft_ms": 200.0,
            "processes": 2,
        }
        assert "shared_load" not in regions[2]
        assert a.snapshot()["fresh"] and a.snapshot()["rounds_total"] == 2
        # No round for longer than ttl: stale, local values only.
        clock.advance(120.5)
        assert not a.fresh
        assert a.global_in_flight("eu") is None and a.region_load("eu") is None
        regions = [{"name": "eu"}]
        a.annotate(regions)
        assert regions[0]["shared_load"]["fresh"] is False
        assert regions[0]["shared_load"]["in_flight"] == 0.0  # a's own
        assert regions[0]["shared_load"]["processes"] == 1
    finally:
        await a.close()
        await b.close()
    # A process that stops cleanly takes its entries with it.
    client = aioredis.Redis.from_url(redis_server)
    try:
        assert await client.hkeys(f"{redis_prefix}{{eu}}") == []
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_old_and_broken_entries_are_dropped_on_redis_clock(
    redis_server: str, redis_prefix: str, region_sets: list[RegionSet]
) -> None:
    region_sets.append(RegionSet(regions_config("eu")))
    view = LoadView(shared(redis_server, redis_prefix, ttl=120.0), region_sets[0], process_id="me")
    key = f"{redis_prefix}{{eu}}"
    client = aioredis.Redis.from_url(redis_server)
    try:
        seconds, micros = await client.time()
        now_ms = seconds * 1000 + micros // 1000
        await client.hset(
            key,
            mapping={
                "alive": f"{now_ms} 7 10.000 1.0000",
                "gone": f"{now_ms - 200_000} 9 - 0.0000",  # older than ttl
                "junk": "not an entry",
                "bad": f"{now_ms} seven - 1",  # stamped, but not numbers
            },
        )
        await view.open(background=False)
        await view.round()
        assert view.global_in_flight("eu") == 7
        assert sorted(k.decode() for k in await client.hkeys(key)) == ["alive", "bad", "me"]
        assert view.errors.by_kind["garbage"] == 1
        # The hash expires ttl after the last write: processes that all went away leave nothing.
        assert 0 < await client.pttl(key) <= 120_000
    finally:
        await view.close()
        await client.aclose()


def _held(proxy: EdgeProxy, name: str = "r1") -> int:
    return proxy.regions.by_name[name].in_flight


@pytest.mark.redis
async def test_two_proxies_see_each_others_in_flight(
    redis_server: str,
    redis_prefix: str,
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
) -> None:
    # A region that reads each request and never answers: requests stay in flight.
    stalled = await make_region("r1", fault="stall", fault_paths=("/v1/",))
    load = {
        "redis_url": redis_server,
        "redis_prefix": redis_prefix,
        "interval": 0.05,
        "ttl": 5.0,
        "redis_timeout": 2.0,
    }
    first = await make_proxy([stalled], shared_load=load)
    second = await make_proxy([stalled], shared_load=load)
    views = [first.load_view, second.load_view]
    assert views[0] is not None and views[1] is not None
    assert views[0].process_id != views[1].process_id
    await eventually(lambda: all(v is not None and v.fresh for v in views))

    async with aiohttp.ClientSession() as client:

        async def hold(proxy: EdgeProxy) -> None:
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                await resp.read()

        held = [asyncio.create_task(hold(first)) for _ in range(3)]
        held.append(asyncio.create_task(hold(second)))
        try:
            await eventually(lambda: _held(first) == 3 and _held(second) == 1)
            # Each sees the other's requests, plus its own.
            await eventually(lambda: views[1].global_in_flight("r1") == 4)  # type: ignore[union-attr]
            await eventually(lambda: views[0].global_in_flight("r1") == 4)  # type: ignore[union-attr]
            region = second.status()["regions"][0]
            assert region["in_flight"] == 1
            assert region["shared_load"]["in_flight"] == 4
            assert region["shared_load"]["processes"] == 2
            assert region["shared_load"]["fresh"] is True
            status = second.status()["shared_load"]
            assert status["fresh"] and status["errors_total"] == 0
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        # The client went away: the requests leave, here and in the other's view.
        await eventually(lambda: _held(first) == 0 and _held(second) == 0)
        await eventually(lambda: views[1].global_in_flight("r1") == 0)  # type: ignore[union-attr]


# -- a Redis of the test's own: killed, frozen ----------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnRedis:
    """A redis-server to kill, freeze (SIGSTOP) and start again on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    async def wait_ready(self) -> None:
        client = aioredis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            for _ in range(200):
                try:
                    if await client.ping():
                        return
                except OSError:
                    pass
                except aioredis.ConnectionError:
                    pass
                await asyncio.sleep(0.05)
            raise AssertionError("redis-server did not start")
        finally:
            await client.aclose()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    if REDIS_SERVER is None:
        pytest.skip("needs the redis-server binary to kill and freeze a Redis")
    server = OwnRedis(tmp_path)
    try:
        yield server
    finally:
        server.kill()


async def _chat(client: aiohttp.ClientSession, proxy: EdgeProxy) -> int:
    # A generous ceiling, not a timing assertion: a request that waited on Redis
    # would hang as long as Redis is frozen.
    async with asyncio.timeout(20):
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            await resp.read()
            return resp.status


@pytest.mark.redis
async def test_frozen_then_killed_redis_leaves_routing_local_and_requests_unhurt(
    own_redis: OwnRedis,
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    own_redis.start()
    await own_redis.wait_ready()
    near, far = await make_region("near"), await make_region("far")
    proxy = await make_proxy(
        [
            {"name": "near", "url": near.url, "lat": 1.3, "lon": 103.8},
            {"name": "far", "url": far.url, "lat": 50.1, "lon": 8.7},
        ],
        shared_load={
            "redis_url": own_redis.url,
            "interval": 0.05,
            "ttl": 0.5,
            "redis_timeout": 0.3,
            "retry_max": 0.2,
        },
    )
    view = proxy.load_view
    assert view is not None
    await eventually(lambda: view.fresh)
    caplog.set_level(logging.WARNING, logger="edgeproxy.loadview")
    async with aiohttp.ClientSession() as client:
        assert await _chat(client, proxy) == 200
        assert view.global_in_flight("near") == 0

        # Frozen: rounds time out, the view goes stale, requests never wait on it.
        own_redis.signal(signal.SIGSTOP)
        assert await _chat(client, proxy) == 200
        await eventually(lambda: not view.fresh and view.errors.total >= 2)
        assert view.global_in_flight("near") is None
        assert [await _chat(client, proxy) for _ in range(3)] == [200, 200, 200]
        status = proxy.status()
        assert status["shared_load"]["fresh"] is False
        assert status["shared_load"]["errors"].get("timeout", 0) >= 1
        assert all(r["shared_load"]["fresh"] is False for r in status["regions"])
        assert status["ready"]
        # Logged once, however many rounds failed.
        failures = [r for r in caplog.records if "failed" in r.getMessage()]
        assert len(failures) == 1, [r.getMessage() for r in caplog.records]

        # Thawed: shared again.
        own_redis.signal(signal.SIGCONT)
        await eventually(lambda: view.fresh)
        assert any("answers again" in r.getMessage() for r in caplog.records)

        # Killed: connection errors this time; still local, still answering.
        errors = view.errors.total
        own_redis.kill()
        await eventually(lambda: not view.fresh and view.errors.total > errors)
        assert [await _chat(client, proxy) for _ in range(3)] == [200, 200, 200]
        assert near.requests_total + far.requests_total >= 8

        # Back on the same port: the retries find it.
        own_redis.start()
        await own_redis.wait_ready()
        await eventually(lambda: view.fresh)
        assert await _chat(client, proxy) == 200


@pytest.mark.redis
async def test_unreachable_redis_at_startup_does_not_hold_the_start(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy(
        [region],
        shared_load={
            "redis_url": f"redis://127.0.0.1:{_free_port()}/0",
            "interval": 0.05,
            "ttl": 0.5,
            "retry_max": 0.1,
        },
    )
    view = proxy.load_view
    assert view is not None
    async with aiohttp.ClientSession() as client:
        assert await _chat(client, proxy) == 200
    await eventually(lambda: view.errors.total >= 2)
    assert not view.fresh and view.global_in_flight("r1") is None
    assert proxy.status()["shared_load"]["last_error"]
