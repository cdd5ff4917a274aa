"""Stateful ownership under load and through Redis outages: two proxies sharing one Redis,
as two PoPs would, in front of fake regions.

300 Responses chains created at once through one PoP all continue at once through the
other; a request naming hundreds of objects does not starve the others; an owner made
while Redis is frozen is written once it thaws; and while Redis cannot answer, a
continuation gets a retryable 503 in the API's shape, never the 404 of a lost chain."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from edgeproxy import EdgeProxy
from edgeproxy._core.config import StatefulConfig
from edgeproxy._routing.owners import Missing, Owner, Owners
from edgeproxy.testing import FakeRegion

from .conftest import FakeClock, ProxyFactory, RegionFactory, eventually

RESPONSES = "/v1/responses"
CHAINS = 300
REDIS_SERVER = "/usr/bin/redis-server"


def tables(regions: list[FakeRegion]) -> list[dict[str, Any]]:
    # Equally near: without the owner rule, follow-ups would spread over all three.
    return [{"name": r.name, "url": r.url, "lat": 1.3, "lon": 103.8} for r in regions]


async def post(
    client: aiohttp.ClientSession, proxy: EdgeProxy, body: dict[str, Any]
) -> tuple[int, dict[str, Any], Any]:
    # A generous ceiling, not a timing assertion: nothing may hang on a frozen Redis.
    async with asyncio.timeout(60):
        async with client.post(
            proxy.url + RESPONSES,
            data=orjson.dumps(body),
            headers={"content-type": "application/json", "authorization": "Bearer sk-a"},
        ) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers


wrong_404s: list[Any] = []


async def post_retrying(
    client: aiohttp.ClientSession, proxy: EdgeProxy, body: dict[str, Any]
) -> tuple[int, dict[str, Any], Any]:
    """``post`` as an SDK sends it: a retryable 503 (owners not looked up in time, on a
    machine starved of CPU) is sent again after its Retry-After, up to five times; a 404
    never is, and is recorded."""
    for _ in range(5):
        status, answer, headers = await post(client, proxy, body)
        if status == 404:
            wrong_404s.append(answer)
        if status != 503 or "Retry-After" not in headers:
            break
        await asyncio.sleep(min(float(headers["Retry-After"]), 3.0))
    return status, answer, headers


def follow_up(previous: str) -> dict[str, Any]:
    return {"model": "fake-llm", "input": "and then?", "previous_response_id": previous}


async def test_300_chains_created_at_once_all_continue_at_once_through_the_other_pop(
    make_region: RegionFactory, make_proxy: ProxyFactory, redis_server: str, redis_prefix: str
) -> None:
    regions = [await make_region(f"r{i}", tokens=2) for i in range(3)]
    stateful = {"redis_url": redis_server, "redis_prefix": redis_prefix + "owner:"}
    made, other = [await make_proxy(tables(regions), stateful=stateful) for _ in range(2)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        created = await asyncio.gather(
            *(
                post(client, made, {"model": "fake-llm", "input": f"chain {i}"})
                for i in range(CHAINS)
            )
        )
        assert [status for status, _, _ in created] == [200] * CHAINS
        continued = await asyncio.gather(
            *(post_retrying(client, other, follow_up(answer["id"])) for _, answer, _ in created)
        )
    statuses = [status for status, _, _ in continued]
    assert statuses.count(404) == 0
    assert statuses == [200] * CHAINS, [a for s, a, _ in continued if s != 200][:3]
    assert not wrong_404s
    for (_, first, made_at), (_, second, went_to) in zip(created, continued, strict=True):
        assert second["previous_response_id"] == first["id"]
        assert went_to["X-Edgeproxy-Region"] == made_at["X-Edgeproxy-Region"]
    assert sum(r.counters().previous_response_misses_total for r in regions) == 0
    assert other.status()["stateful"]["unknown_total"] == 0


async def test_a_request_naming_hundreds_of_objects_starves_no_other(
    make_region: RegionFactory, make_proxy: ProxyFactory, redis_server: str, redis_prefix: str
) -> None:
    regions = [await make_region(f"r{i}", tokens=2) for i in range(2)]
    # A small pool: one request's 500 lookups would take every connection at once.
    stateful = {
        "redis_url": redis_server,
        "redis_prefix": redis_prefix + "owner:",
        "redis_max_connections": 3,
        "max_refs": 600,
        # Wide: this test is about every request being served right, on a machine that may
        # be starved of CPU. That a lookup is not queued behind a whole flood is shown
        # without a clock by test_a_lookup_waits_for_one_batch_of_a_flood_not_all_of_it.
        "redis_timeout": 30.0,
        "redis_pool_timeout": 60.0,
    }
    made, other = [await make_proxy(tables(regions), stateful=stateful) for _ in range(2)]
    many = {
        "model": "fake-llm",
        "input": "search",
        "tools": [{"type": "file_search", "vector_store_ids": [f"vs_{i}" for i in range(500)]}],
    }
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        chains = [
            answer["id"]
            for _, answer, _ in await asyncio.gather(
                *(post(client, made, {"model": "fake-llm", "input": f"c{i}"}) for i in range(40))
            )
        ]
        # The flood first, then the flood again with the continuations.
        flood = await asyncio.gather(*(post(client, other, many) for _ in range(4)))
        outcomes = await asyncio.gather(
            *(post(client, other, many) for _ in range(4)),
            *(post(client, other, follow_up(chain)) for chain in chains),
        )
    flood += outcomes[:4]
    legit = outcomes[4:]
    # The 500 stores are nobody's: the API's 404, for the first one the body names.
    for status, answer, _ in flood:
        assert status == 404 and "vs_0" in answer["error"]["message"]
    assert [status for status, _, _ in legit] == [200] * len(chains)
    assert other.status()["stateful"]["lookup_failed_total"] == 0


async def test_a_request_naming_more_objects_than_max_refs_gets_400(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    regions = [await make_region(f"r{i}") for i in range(2)]
    proxy = await make_proxy(tables(regions), stateful={"max_refs": 10})

    def searching(stores: list[str]) -> dict[str, Any]:
        return {
            "model": "fake-llm",
            "input": "x",
            "tools": [{"type": "file_search", "vector_store_ids": stores}],
        }

    async with aiohttp.ClientSession() as client:
        status, answer, _ = await post(client, proxy, searching([f"vs_{i}" for i in range(11)]))
        assert status == 400
        assert set(answer) == {"error"}
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["code"] == "too_many_references"
        # The same id named again counts once.
        status, answer, _ = await post(client, proxy, searching(["vs_same"] * 11))
        assert status == 404 and answer["error"]["code"] != "too_many_references"
    assert sum(r.requests_total for r in regions) == 0


# -- Redis outages ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FrozenRedis:
    """A redis-server of this test's own, to freeze (SIGSTOP) and thaw."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def wait_ready(self) -> None:
        client = aioredis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            for _ in range(200):
                try:
                    if await client.ping():
                        return
                except (OSError, aioredis.ConnectionError):
                    pass
                await asyncio.sleep(0.05)
            raise AssertionError("redis-server did not start")
        finally:
            await client.aclose()

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.thaw()
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def frozen_redis(tmp_path: Path) -> Iterator[FrozenRedis]:
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("needs the redis-server binary to freeze a Redis")
    server = FrozenRedis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


async def test_owners_made_while_redis_is_frozen_are_written_once_it_thaws(
    make_region: RegionFactory, make_proxy: ProxyFactory, frozen_redis: FrozenRedis
) -> None:
    await frozen_redis.wait_ready()
    regions = [await make_region(f"r{i}", tokens=2) for i in range(3)]
    stateful = {"redis_url": frozen_redis.url, "redis_timeout": 0.2}
    made, other = [await make_proxy(tables(regions), stateful=stateful) for _ in range(2)]
    clock = FakeClock.following(other.pipeline.owners.clock)
    other.pipeline.owners.clock = clock
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        frozen_redis.freeze()
        created = await asyncio.gather(
            *(post(client, made, {"model": "fake-llm", "input": f"c{i}"}) for i in range(20))
        )
        # Made and answered: the region holds them, Redis does not know them yet.
        assert [status for status, _, _ in created] == [200] * 20
        ids = [answer["id"] for _, answer, _ in created]
        assert made.status()["stateful"]["pending_writes"] == 20
        # Redis cannot say where they are: retryable 503 in OpenAI's shape, never a 404.
        for object_id in ids[:5]:
            status, answer, headers = await post(client, other, follow_up(object_id))
            assert status == 503, answer
            assert set(answer) == {"error"}
            assert set(answer["error"]) == {"message", "type", "param", "code"}
            assert answer["error"]["type"] == "service_unavailable"
            assert answer["error"]["code"] == "owner_lookup_failed"
            assert int(headers["Retry-After"]) > 0
        # The PoP that made them still knows them.
        status, _, _ = await post(client, made, follow_up(ids[0]))
        assert status == 200
        frozen_redis.thaw()
        owners = made.pipeline.owners
        await eventually(lambda: owners.snapshot()["pending_writes"] == 0, timeout=20)
        assert owners.write_retries_total > 0
        clock.advance(60)  # past the other PoP's pause on a failing Redis
        continued = await asyncio.gather(*(post(client, other, follow_up(i)) for i in ids[1:]))
    assert [status for status, _, _ in continued] == [200] * 19
    assert sum(r.counters().previous_response_misses_total for r in regions) == 0


# -- the owner map on its own ------------------------------------------------------------


def _closed_port_url() -> str:
    return f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens once the socket closes


async def test_unknown_is_not_failed() -> None:
    # Without Redis, this process is the whole map: an id it never made is unknown.
    alone = Owners(StatefulConfig())
    await alone.open()
    alone.remember("resp_mine", "r1", "pub")
    assert await alone.owner("resp_mine") == Owner("r1", "pub")
    assert await alone.owner("resp_other") is Missing.UNKNOWN
    await alone.close()
    # With a Redis that cannot answer, an id this process does not know could be anyone's.
    shared = Owners(StatefulConfig(redis_url=_closed_port_url(), redis_timeout=0.2))
    await shared.open()
    try:
        shared.remember("resp_mine", "r1", "pub")
        found = await shared.lookup(["resp_mine", "resp_other", "resp_mine"])
        assert found == {"resp_mine": Owner("r1", "pub"), "resp_other": Missing.FAILED}
        assert shared.lookup_failed_total == 1
    finally:
        await shared.close()


async def test_the_write_queue_is_bounded_and_keeps_the_newest() -> None:
    clock = FakeClock(100.0)
    owners = Owners(
        StatefulConfig(redis_url=_closed_port_url(), redis_timeout=0.2, write_queue=3),
        clock=clock,
    )
    await owners.open()
    try:
        waits = [owners.remember(f"resp_{i}", "r1", "pub") for i in range(5)]
        assert owners.writes_dropped_total == 2
        assert list(owners._pending) == ["resp_2", "resp_3", "resp_4"]
        # A caller waiting on a dropped entry stops waiting; the others wait for Redis, at
        # most redis_timeout.
        assert all(w is not None for w in waits)
        assert waits[0] is not None and waits[0].done()
        await asyncio.gather(*(w for w in waits if w is not None))
        await eventually(lambda: owners.write_retries_total >= 1)
        # Still known here, every one of them.
        found = await owners.lookup(f"resp_{i}" for i in range(5))
        assert all(isinstance(owner, Owner) for owner in found.values())
    finally:
        await owners.close()


async def test_a_blocking_pool_serves_a_burst_past_its_size(
    redis_server: str, redis_prefix: str
) -> None:
    # The point is that a burst waits for the two connections instead of failing; the
    # timeouts are wide so that a loaded CI machine's slow round trips cannot fail it.
    config = StatefulConfig(
        redis_url=redis_server,
        redis_prefix=redis_prefix + "owner:",
        redis_max_connections=2,
        redis_timeout=30.0,
        redis_pool_timeout=60.0,
    )
    maker, reader = Owners(config), Owners(config)
    await maker.open()
    await reader.open()
    try:
        waits = [maker.remember(f"resp_{i}", "r1", "pub") for i in range(200)]
        await asyncio.gather(*(w for w in waits if w is not None))
        assert maker.snapshot()["pending_writes"] == 0
        found = await asyncio.gather(*(reader.owner(f"resp_{i}") for i in range(200)))
        assert found == [Owner("r1", "pub")] * 200
        assert reader.lookup_failed_total == 0 and reader.redis_errors_total == 0
    finally:
        await maker.close()
        await reader.close()


class _GatedRedis:
    """The owners' Redis client, logging each read as it starts (its slot already taken)
    and holding every read until ``gate`` opens: the order in which reads get a slot is
    then fixed, whatever the machine's speed."""

    def __init__(self, real: Any, gate: asyncio.Event, log: list[str]) -> None:
        self.real, self.gate, self.log = real, gate, log

    async def get(self, key: str) -> Any:
        self.log.append(key.rsplit(":", 1)[-1])
        await self.gate.wait()
        return await self.real.get(key)

    def pipeline(self, transaction: bool = False) -> Any:
        pipe = self.real.pipeline(transaction=transaction)
        real_execute, log, gate = pipe.execute, self.log, self.gate

        async def execute() -> Any:
            log.append("batch")
            await gate.wait()
            return await real_execute()

        pipe.execute = execute
        return pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


async def test_a_lookup_waits_for_one_batch_of_a_flood_not_all_of_it(
    redis_server: str, redis_prefix: str
) -> None:
    # Two slots for reads, four lookups of 500 unknown ids (five batches each) under way:
    # a one-id lookup that comes now takes the next free slot after those already waiting,
    # not after the flood's twenty batches.
    config = StatefulConfig(
        redis_url=redis_server,
        redis_prefix=redis_prefix + "owner:",
        redis_max_connections=3,
        redis_timeout=30.0,
        redis_pool_timeout=60.0,
    )
    owners = Owners(config)
    await owners.open()
    gate, log, real = asyncio.Event(), [], owners.redis
    owners.redis = _GatedRedis(real, gate, log)  # type: ignore[assignment]
    try:
        floods = [
            asyncio.ensure_future(owners.lookup(f"vs_{n}_{i}" for i in range(500)))
            for n in range(4)
        ]
        await eventually(lambda: log == ["batch", "batch"])
        single = asyncio.ensure_future(owners.owner("resp_single"))
        await asyncio.sleep(0)
        gate.set()
        found = await asyncio.gather(*floods)
        assert await single is Missing.UNKNOWN
        assert all(set(f.values()) == {Missing.UNKNOWN} for f in found)
        assert log.count("batch") == 20
        # Two batches read while it queued, then the two floods that queued before it.
        assert log.index("resp_single") <= 4
        assert owners.lookup_failed_total == 0
    finally:
        owners.redis = real
        await owners.close()
