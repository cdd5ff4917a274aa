"""The proof that Responses API chains follow their region from any PoP: three fake regions
behind two proxies sharing one Redis, as two PoPs would, and the official openai SDK.

200 chains of three turns each, every turn sent to a PoP drawn at random: no follow-up
fails, and no region is ever asked for a response it does not hold. Then the owner region
of some chains dies mid-chain: those chains get OpenAI's 503 with ``Retry-After``, and the
others go on."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import openai
import pytest

from edgeproxy import EdgeProxy
from edgeproxy.testing import FakeRegion

CHAINS = 200
TURNS = 3
# Chains in flight at once: enough to mix the PoPs' traffic, few enough for two cores.
CONCURRENCY = 8


async def turn(
    client: openai.AsyncOpenAI, text: str, previous: str | None
) -> tuple[str, str, str | None]:
    """One turn: the response's id, the region that answered, its previous id."""
    kwargs: dict[str, Any] = {"model": "fake-llm", "input": text}
    if previous is not None:
        kwargs["previous_response_id"] = previous
    raw = await client.responses.with_raw_response.create(**kwargs)
    response = raw.parse()
    return response.id, raw.headers["x-edgeproxy-region"], response.previous_response_id


async def test_200_chains_of_three_turns_through_random_pops_never_fail(
    two_pops: tuple[list[FakeRegion], list[openai.AsyncOpenAI], list[EdgeProxy]],
) -> None:
    regions, clients, pops = two_pops
    rng = random.Random(27)
    # Drawn up front, so that the draw does not depend on how the chains interleave.
    draws = [[rng.randrange(len(clients)) for _ in range(TURNS)] for _ in range(CHAINS)]
    failed: list[str] = []
    owners: list[str] = []
    gate = asyncio.Semaphore(CONCURRENCY)

    async def chain(index: int) -> None:
        async with gate:
            previous: str | None = None
            owner: str | None = None
            for number, pop in enumerate(draws[index]):
                try:
                    object_id, region, chained = await turn(
                        clients[pop], f"chain {index} turn {number}", previous
                    )
                except openai.APIError as exc:
                    failed.append(f"chain {index} turn {number}: {exc}")
                    return
                assert chained == previous
                assert owner in (None, region), f"chain {index} moved from {owner} to {region}"
                owner, previous = region, object_id
            assert owner is not None
            owners.append(owner)

    await asyncio.gather(*(chain(i) for i in range(CHAINS)))
    assert failed == []
    # Both PoPs carried turns, and the chains' first turns spread over the regions: the
    # rule pins follow-ups, not first requests.
    assert {pop for draw in draws for pop in draw[1:]} == {0, 1}
    assert len(set(owners)) > 1
    hits = sum(r.counters().previous_response_hits_total for r in regions)
    misses = sum(r.counters().previous_response_misses_total for r in regions)
    assert (hits, misses) == (CHAINS * (TURNS - 1), 0)
    for pop in pops:
        stateful = pop.status()["stateful"]
        assert stateful["shared"] and stateful["unknown_total"] == 0


async def test_chains_whose_region_dies_mid_chain_get_503_and_the_others_go_on(
    two_pops: tuple[list[FakeRegion], list[openai.AsyncOpenAI], list[EdgeProxy]],
) -> None:
    regions, clients, _ = two_pops
    by_name = {r.name: r for r in regions}
    rng = random.Random(2027)
    chains: list[tuple[str, str]] = []  # (last response id, owner)
    for index in range(24):
        previous: str | None = None
        owner = ""
        for number in range(2):
            previous, owner, _ = await turn(
                clients[rng.randrange(2)], f"chain {index} turn {number}", previous
            )
        assert previous is not None
        chains.append((previous, owner))
    dead = chains[0][1]
    await by_name[dead].kill()
    outcomes: dict[str, int] = {"unavailable": 0, "went_on": 0}
    for index, (previous, owner) in enumerate(chains):
        client = clients[rng.randrange(2)]
        if owner == dead:
            with pytest.raises(openai.InternalServerError) as caught:
                await turn(client, f"chain {index} turn 2", previous)
            error = caught.value
            assert error.status_code == 503
            assert int(error.response.headers["retry-after"]) > 0
            assert (error.type, error.code) == ("service_unavailable", "owner_unavailable")
            body = error.response.json()
            assert set(body) == {"error"}
            assert set(body["error"]) == {"message", "type", "param", "code"}
            # No address or name of the region reaches the client.
            assert by_name[dead].url not in error.response.text
            assert dead not in body["error"]["message"]
            outcomes["unavailable"] += 1
        else:
            _, region, chained = await turn(client, f"chain {index} turn 2", previous)
            assert (region, chained) == (owner, previous)
            outcomes["went_on"] += 1
    assert outcomes["unavailable"] and outcomes["went_on"]
    # Nothing was sent to a region that would have answered 404.
    assert sum(r.counters().previous_response_misses_total for r in regions if r.running) == 0
