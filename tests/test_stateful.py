"""Stateful requests go to the region that holds their state: Responses API chains
(``previous_response_id``) and ``/v1/responses/{id}`` across PoPs that share Redis, the
API's own 404 for an unknown id, and 503 while the owner region is down."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from edgeproxy import EdgeProxy
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory

RESPONSES = "/v1/responses"


async def create(
    client: aiohttp.ClientSession, proxy: EdgeProxy, body: dict[str, Any]
) -> tuple[int, dict[str, Any], Any]:
    async with client.post(
        proxy.url + RESPONSES, data=orjson.dumps(body), headers={"content-type": "application/json"}
    ) as resp:
        return resp.status, await resp.json(content_type=None), resp.headers


async def three_regions(make_region: RegionFactory) -> list[FakeRegion]:
    return [await make_region(f"r{i}", tokens=4) for i in range(3)]


def tables(regions: list[FakeRegion]) -> list[dict[str, Any]]:
    # Equally near: without the owner rule, follow-ups would spread over all three.
    return [{"name": r.name, "url": r.url, "lat": 1.3, "lon": 103.8} for r in regions]


@pytest.fixture
async def two_pops(
    make_region: RegionFactory, make_proxy: ProxyFactory, redis_server: str, redis_prefix: str
) -> AsyncIterator[tuple[list[FakeRegion], list[EdgeProxy]]]:
    regions = await three_regions(make_region)
    stateful = {"redis_url": redis_server, "redis_prefix": redis_prefix + "owner:"}
    pops = [await make_proxy(tables(regions), stateful=stateful) for _ in range(2)]
    yield regions, pops


async def test_chains_follow_their_region_from_any_pop(
    two_pops: tuple[list[FakeRegion], list[EdgeProxy]],
) -> None:
    regions, pops = two_pops
    rng = random.Random(7)
    failed = 0
    owners: list[str] = []
    async with aiohttp.ClientSession() as client:
        for chain in range(200):
            previous: str | None = None
            region_of_chain: str | None = None
            for turn in range(3):
                body: dict[str, Any] = {"model": "fake-llm", "input": f"chain {chain} turn {turn}"}
                if previous is not None:
                    body["previous_response_id"] = previous
                status, answer, headers = await create(client, rng.choice(pops), body)
                if status != 200:
                    failed += 1
                    break
                previous = answer["id"]
                region = headers["X-Edgeproxy-Region"]
                assert region_of_chain in (None, region)
                region_of_chain = region
                # The region answered the whole conversation: 2 messages a turn before.
                assert headers["x-fake-conversation-messages"] == str(2 * turn + 1)
            assert region_of_chain is not None
            owners.append(region_of_chain)
    assert failed == 0
    # The chains' first turns spread: the rule pins follow-ups, not first requests.
    assert len(set(owners)) > 1
    hits = sum(r.counters().previous_response_hits_total for r in regions)
    misses = sum(r.counters().previous_response_misses_total for r in regions)
    assert (hits, misses) == (400, 0)
    for pop in pops:
        stateful = pop.status()["stateful"]
        assert stateful["shared"] and stateful["unknown_total"] == 0


async def test_a_chain_whose_region_is_down_gets_503_and_the_others_go_on(
    two_pops: tuple[list[FakeRegion], list[EdgeProxy]],
) -> None:
    regions, pops = two_pops
    by_name = {r.name: r for r in regions}
    async with aiohttp.ClientSession() as client:
        chains: list[tuple[str, str]] = []
        for i in range(12):
            status, answer, headers = await create(
                client, pops[i % 2], {"model": "fake-llm", "input": f"first {i}"}
            )
            assert status == 200
            chains.append((answer["id"], headers["X-Edgeproxy-Region"]))
        down = chains[0][1]
        await by_name[down].kill()
        outcomes: dict[str, list[int]] = {"down": [], "up": []}
        for i, (previous, owner) in enumerate(chains):
            body = {"model": "fake-llm", "input": "next", "previous_response_id": previous}
            status, answer, headers = await create(client, pops[(i + 1) % 2], body)
            if owner == down:
                assert status == 503, answer
                assert answer["error"]["code"] == "owner_unavailable"
                assert int(headers["Retry-After"]) > 0
                # No address or detail of the region reaches the client.
                assert by_name[down].url not in orjson.dumps(answer).decode()
            else:
                assert status == 200, answer
            outcomes["down" if owner == down else "up"].append(status)
    assert outcomes["down"] and outcomes["up"]
    # Nothing was sent to a region that would have answered 404.
    assert sum(r.counters().previous_response_misses_total for r in regions if r.running) == 0


async def test_an_unknown_id_gets_the_apis_own_404(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    regions = await three_regions(make_region)
    proxy = await make_proxy(tables(regions))
    async with aiohttp.ClientSession() as client:
        body = {"model": "fake-llm", "input": "x", "previous_response_id": "resp_nobody"}
        status, answer, _ = await create(client, proxy, body)
        assert status == 404
        assert answer["error"]["code"] == "previous_response_not_found"
        assert answer["error"]["param"] == "previous_response_id"
        async with client.get(proxy.url + RESPONSES + "/resp_nobody") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "response_not_found"
    assert sum(r.requests_total for r in regions) == 0


async def test_get_and_delete_go_to_the_owner_and_stateless_requests_route_freely(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    regions = await three_regions(make_region)
    proxy = await make_proxy(tables(regions))  # no Redis: this process's memory
    async with aiohttp.ClientSession() as client:
        status, answer, headers = await create(client, proxy, {"model": "fake-llm", "input": "a"})
        assert status == 200
        object_id, owner = answer["id"], headers["X-Edgeproxy-Region"]
        for _ in range(6):
            async with client.get(proxy.url + RESPONSES + "/" + object_id) as resp:
                assert resp.status == 200 and resp.headers["X-Edgeproxy-Region"] == owner
                assert (await resp.json())["id"] == object_id
        async with client.get(proxy.url + f"{RESPONSES}/{object_id}/input_items") as resp:
            assert resp.status == 200 and resp.headers["X-Edgeproxy-Region"] == owner
        async with client.delete(proxy.url + RESPONSES + "/" + object_id) as resp:
            assert resp.status == 200 and (await resp.json())["deleted"] is True
        # store: false asks no region to keep anything: nothing is remembered.
        known = proxy.status()["stateful"]["remembered_total"]
        status, _, _ = await create(
            client, proxy, {"model": "fake-llm", "input": "b", "store": False}
        )
        assert status == 200
        assert proxy.status()["stateful"]["remembered_total"] == known


async def test_streamed_chains_are_remembered_from_response_created(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    import openai

    regions = await three_regions(make_region)
    proxy = await make_proxy(tables(regions))
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-x", max_retries=0)
    try:
        previous: str | None = None
        for turn in range(3):
            kwargs: dict[str, Any] = {"model": "fake-llm", "input": f"turn {turn}"}
            if previous is not None:
                kwargs["previous_response_id"] = previous
            async with client.responses.stream(**kwargs) as events:
                final = await events.get_final_response()
            previous = final.id
            # Sync and non-streamed: the same chain goes on.
            follow = await client.responses.create(
                model="fake-llm", input="and?", previous_response_id=previous
            )
            assert follow.previous_response_id == previous
    finally:
        await client.close()
    assert sum(r.counters().previous_response_misses_total for r in regions) == 0


async def test_with_one_region_an_id_made_elsewhere_still_reaches_it(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("only", tokens=4)
    proxy = await make_proxy([region])
    async with aiohttp.ClientSession() as client:
        # Made directly at the region, so the proxy never saw it.
        async with client.post(
            region.url + RESPONSES, json={"model": "fake-llm", "input": "direct"}
        ) as resp:
            made = (await resp.json())["id"]
        body = {"model": "fake-llm", "input": "next", "previous_response_id": made}
        status, _, headers = await create(client, proxy, body)
        assert status == 200 and headers["X-Edgeproxy-Region"] == "only"


async def test_with_redis_down_a_pop_keeps_the_owners_it_made(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there once the socket closes
    regions = await three_regions(make_region)
    proxy = await make_proxy(
        tables(regions),
        stateful={"redis_url": f"redis://127.0.0.1:{closed}/0", "redis_timeout": 0.2},
    )
    async with aiohttp.ClientSession() as client:
        previous = None
        for turn in range(3):
            body: dict[str, Any] = {"model": "fake-llm", "input": f"turn {turn}"}
            if previous is not None:
                body["previous_response_id"] = previous
            status, answer, _ = await create(client, proxy, body)
            assert status == 200, answer
            previous = answer["id"]
    stateful = proxy.status()["stateful"]
    assert stateful["redis_errors_total"] >= 3 and stateful["unknown_total"] == 0
