"""Responses chains held at the edge (a route's ``responses_state = "edge"``), against fake
regions that keep their stored responses as vLLM and OpenAI do.

A chain goes to the region that stored its previous response while that region is up and
keeps responses; the edge takes it on (the chain's whole input, sent to whichever region
the router picks, marked ``X-Edgeproxy-State: edge``) when the owner is down, forgot it,
or keeps none. The edge answers retrieval while the owner cannot, deletes its own copy
with the owner's, keeps each scope's chains to that scope, and shares them through Redis.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from edgeproxy import EdgeProxy, hookimpl
from edgeproxy.testing import FakeRegion

from .conftest import (
    CustomRegion,
    FakeClock,
    ProxyFactory,
    RegionFactory,
    eventually,
    free_port,
)

MODEL = "fake-llm"
# The PoP is at lat 1.35 lon 103.82: a region here ranks first, one in Europe after it.
NEAR = {"lat": 1.3, "lon": 103.8}
FAR = {"lat": 50.0, "lon": 8.0}
EDGE = [{"name": "responses", "path": "/", "responses_state": "edge"}]
NO_RESCUE = {"owner_unavailable": 0, "owner_cannot_store": 0, "owner_forgot": 0, "edge_holds": 0}


def table(region: FakeRegion, where: dict[str, float], **extra: Any) -> dict[str, Any]:
    return {"name": region.name, "url": region.url, **where, **extra}


class Answer(NamedTuple):
    """One turn as the client saw it."""

    id: str
    text: str
    headers: dict[str, str]
    """Lower-cased names."""


@pytest.fixture
async def sdk() -> AsyncIterator[list[openai.AsyncOpenAI]]:
    """The SDK clients a test opens (append to it); all closed afterwards."""
    opened: list[openai.AsyncOpenAI] = []
    yield opened
    for client in opened:
        await client.close()


def client_of(
    opened: list[openai.AsyncOpenAI], proxy: EdgeProxy, key: str = "sk-a", **headers: str
) -> openai.AsyncOpenAI:
    client = openai.AsyncOpenAI(
        base_url=proxy.url + "/v1", api_key=key, max_retries=0, default_headers=headers
    )
    opened.append(client)
    return client


async def turn(
    client: openai.AsyncOpenAI, text: str, previous: str | None, *, stream: bool = False
) -> Answer:
    """One turn through the SDK, JSON or streamed."""
    more: dict[str, Any] = {"previous_response_id": previous} if previous else {}
    if stream:
        events = await client.responses.create(model=MODEL, input=text, stream=True, **more)
        async with events:
            completed = None
            async for event in events:
                if event.type == "response.completed":
                    completed = event.response
            headers = {k.lower(): v for k, v in events.response.headers.items()}
        assert completed is not None, "the stream ended without response.completed"
        return Answer(completed.id, completed.output_text, headers)
    raw = await client.responses.with_raw_response.create(model=MODEL, input=text, **more)
    response = raw.parse()
    return Answer(response.id, response.output_text, {k.lower(): v for k, v in raw.headers.items()})


async def http(
    method: str, url: str, body: dict[str, Any] | None = None, **headers: str
) -> tuple[int, Any, dict[str, str]]:
    """One plain request: its status, JSON answer (None when not JSON) and headers."""
    async with aiohttp.ClientSession() as session:
        if body is not None:
            headers = {"content-type": "application/json", **headers}
        async with session.request(
            method, url, data=None if body is None else orjson.dumps(body), headers=headers
        ) as resp:
            raw = await resp.read()
            try:
                answer = orjson.loads(raw)
            except orjson.JSONDecodeError:
                answer = None
            return resp.status, answer, {k.lower(): v for k, v in resp.headers.items()}


def texts(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(role, text)`` of each message item, its text parts joined."""
    out = []
    for item in items:
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        out.append((str(item.get("role")), str(content)))
    return out


async def region_input(region: FakeRegion, response_id: str) -> list[tuple[str, str]]:
    """The input the region itself stored for ``response_id``, oldest first."""
    status, listed, _ = await http(
        "GET", f"{region.url}/v1/responses/{response_id}/input_items?order=asc&limit=100"
    )
    assert status == 200, listed
    return texts(listed["data"])


def chains(proxy: EdgeProxy) -> dict[str, Any]:
    snapshot: dict[str, Any] | None = proxy.status()["chains"]
    assert snapshot is not None
    return snapshot


async def edge_pair(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> tuple[FakeRegion, FakeRegion, EdgeProxy, openai.AsyncOpenAI]:
    """Two regions, ``a`` nearer than ``b``, behind a proxy whose route holds chains at the
    edge, and a client of it."""
    a, b = await make_region("a", tokens=3), await make_region("b", tokens=3)
    proxy = await make_proxy([table(a, NEAR), table(b, FAR)], routes=EDGE)
    return a, b, proxy, client_of(sdk, proxy)


async def known_down(proxy: EdgeProxy, region: FakeRegion) -> None:
    """Wait until the proxy knows ``region`` (killed) is down: its next request fails
    over, marking it so."""
    await eventually(lambda: proxy.regions.by_name[region.name].state == "down")


# -- 1. the owner dies mid-chain ---------------------------------------------------------


async def test_a_five_turn_chain_goes_on_at_another_region_when_its_owner_dies(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    a, b = await make_region("a", tokens=4), await make_region("b", tokens=4)
    proxy = await make_proxy([table(a, NEAR), table(b, FAR)], routes=EDGE)
    client = client_of(sdk, proxy)
    questions = [f"question {n}: what about {n * 7}?" for n in range(1, 6)]
    streamed = [False, True, False, True, False]

    # The same conversation, never broken: what each turn answers when its owner lives.
    control: list[Answer] = []
    for question, stream in zip(questions, streamed, strict=True):
        control.append(
            await turn(client, question, control[-1].id if control else None, stream=stream)
        )
        assert control[-1].headers["x-edgeproxy-region"] == "a"

    answers: list[Answer] = []
    for n, (question, stream) in enumerate(zip(questions, streamed, strict=True)):
        if n == 3:
            await a.kill()
        answers.append(
            await turn(client, question, answers[-1].id if answers else None, stream=stream)
        )

    assert [x.headers["x-edgeproxy-region"] for x in answers] == ["a", "a", "a", "b", "b"]
    assert [x.headers.get("x-edgeproxy-state") for x in answers] == [None] * 3 + ["edge", None]
    # The same conversation: every turn answers what the unbroken chain answered.
    assert [x.text for x in answers] == [x.text for x in control]
    assert [x.headers["x-fake-conversation-digest"] for x in answers] == [
        x.headers["x-fake-conversation-digest"] for x in control
    ]
    # Turn 4 reached b as the chain's whole input: each turn's question, then its answer.
    whole = [
        pair
        for q, x in zip(questions[:3], answers[:3], strict=True)
        for pair in (("user", q), ("assistant", x.text))
    ]
    assert await region_input(b, answers[3].id) == [*whole, ("user", questions[3])]
    # Turn 5 went on at b by b's own store: no rescue, only its own input sent.
    assert await region_input(b, answers[4].id) == [("user", questions[4])]
    assert b.counters().previous_response_hits_total == 1
    assert b.counters().previous_response_misses_total == 0
    status = chains(proxy)
    assert status["rescued"] == {**NO_RESCUE, "owner_unavailable": 1}
    assert status["held_total"] == 10
    assert status["holding"] is True and status["shared"] is False


# -- 2. a store that forgets -------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
async def test_an_owner_that_forgot_the_chain_is_rescued_by_the_edge(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    sdk: list[openai.AsyncOpenAI],
    stream: bool,
) -> None:
    a, b, proxy, client = await edge_pair(make_region, make_proxy, sdk)
    first = await turn(client, "remember the number 42", None, stream=stream)
    second = await turn(client, "and add one", first.id, stream=stream)
    a.clear_responses()  # a vLLM restarted: its memory is gone, its address the same

    third = await turn(client, "what is it now?", second.id, stream=stream)

    assert third.headers["x-edgeproxy-state"] == "edge"
    assert a.counters().previous_response_misses_total == 1
    assert await region_input(a, third.id) == [
        ("user", "remember the number 42"),
        ("assistant", first.text),
        ("user", "and add one"),
        ("assistant", second.text),
        ("user", "what is it now?"),
    ]
    assert chains(proxy)["rescued"] == {**NO_RESCUE, "owner_forgot": 1}
    # The region stored the rescued turn: the chain goes on there as usual.
    fourth = await turn(client, "thanks", third.id, stream=stream)
    assert "x-edgeproxy-state" not in fourth.headers
    assert chains(proxy)["rescued"] == {**NO_RESCUE, "owner_forgot": 1}


def llama_server_later(answered: list[dict[str, Any]]) -> web.Application:
    """A region that kept responses until llama-server replaced it at the same address:
    it answers a first turn, and refuses a previous_response_id with llama-server's 400."""

    async def create(request: web.Request) -> web.Response:
        body = await request.json()
        answered.append(body)
        if "previous_response_id" in body:
            refusal = {
                "code": 400,
                "message": "llama.cpp does not support 'previous_response_id'.",
                "type": "invalid_request_error",
            }
            return web.json_response({"error": refusal}, status=400)
        n = len(answered)
        return web.json_response(
            {
                "id": f"resp_llama{n}",
                "object": "response",
                "created_at": 1,
                "status": "completed",
                "model": MODEL,
                "output": [
                    {
                        "type": "message",
                        "id": f"msg_llama{n}",
                        "role": "assistant",
                        "status": "completed",
                        "content": [
                            {"type": "output_text", "text": f"answer {n}", "annotations": []}
                        ],
                    }
                ],
                "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/responses", create)
    return app


async def test_an_owners_400_about_previous_response_id_is_rescued_by_the_edge(
    custom_region: CustomRegion, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    answered: list[dict[str, Any]] = []
    url = await custom_region(llama_server_later(answered))
    proxy = await make_proxy([{"name": "l", "url": url, **NEAR}], routes=EDGE)
    client = client_of(sdk, proxy)
    first = await turn(client, "hello", None)

    second = await turn(client, "and again", first.id)

    assert second.headers["x-edgeproxy-state"] == "edge"
    assert "previous_response_id" not in answered[-1]
    assert texts(answered[-1]["input"]) == [
        ("user", "hello"),
        ("assistant", "answer 1"),
        ("user", "and again"),
    ]
    assert sum(chains(proxy)["rescued"].values()) == 1


async def test_an_owners_other_error_reaches_the_client_whole(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    a, b = await make_region("a", tokens=3), await make_region("b", tokens=3)
    proxy = await make_proxy([table(a, NEAR), table(b, FAR)], routes=EDGE)
    status, first, _ = await http(
        "POST", proxy.url + "/v1/responses", {"model": MODEL, "input": "hello"}
    )
    assert status == 200
    bad = {"model": MODEL, "input": [42], "previous_response_id": first["id"]}
    status, mine, headers = await http("POST", proxy.url + "/v1/responses", bad)
    _, theirs, _ = await http("POST", a.url + "/v1/responses", bad)

    assert status == 400
    assert headers["x-edgeproxy-region"] == "a"
    assert "x-edgeproxy-state" not in headers
    assert mine == theirs  # the owner's answer, whole
    assert chains(proxy)["rescued"] == NO_RESCUE


# -- 3. a region that keeps no responses -------------------------------------------------


@pytest.mark.parametrize(
    "keeps_none",
    [{"stores_responses": False}, {"server": "llama.cpp"}],
    ids=["stores_responses=false", "llama.cpp"],
)
async def test_a_region_that_keeps_no_responses_gets_every_turn_whole(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    sdk: list[openai.AsyncOpenAI],
    keeps_none: dict[str, Any],
) -> None:
    llama = await make_region("llama", tokens=3)
    proxy = await make_proxy([table(llama, NEAR, **keeps_none)], routes=EDGE)
    client = client_of(sdk, proxy)
    answers = [await turn(client, "one", None)]
    for n, question in enumerate(["two", "three", "four"]):
        answers.append(await turn(client, question, answers[-1].id, stream=n % 2 == 1))
        assert answers[-1].headers["x-edgeproxy-state"] == "edge"

    assert "x-edgeproxy-state" not in answers[0].headers
    # The region never saw a previous_response_id: the edge sent each turn whole.
    counters = llama.counters()
    assert counters.previous_response_hits_total == 0
    assert counters.previous_response_misses_total == 0
    assert await region_input(llama, answers[-1].id) == [
        ("user", "one"),
        ("assistant", answers[0].text),
        ("user", "two"),
        ("assistant", answers[1].text),
        ("user", "three"),
        ("assistant", answers[2].text),
        ("user", "four"),
    ]
    status = chains(proxy)
    assert status["rescued"] == {**NO_RESCUE, "owner_cannot_store": 3}
    assert status["held_total"] == 4


# -- 4. retrieve and delete --------------------------------------------------------------


async def test_retrieval_and_deletion_are_answered_by_the_edge_while_the_owner_is_down(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    a, b, proxy, client = await edge_pair(make_region, make_proxy, sdk)
    first = await turn(client, "hello there", None)
    second = await turn(client, "tell me more", first.id, stream=True)
    url = f"{proxy.url}/v1/responses/{second.id}"
    status, original, _ = await http("GET", url, authorization="Bearer sk-a")
    assert status == 200
    await a.kill()
    # A request that finds a unreachable marks it down (a retrieval right after the kill:
    # test_a_retrieval_right_after_the_owner_died_is_answered_by_the_edge).
    await turn(client, "a new chain", None)
    await known_down(proxy, a)

    held = await client.responses.retrieve(second.id)
    status, held_json, headers = await http("GET", url, authorization="Bearer sk-a")
    status_items, items, _ = await http("GET", url + "/input_items", authorization="Bearer sk-a")

    assert (held.id, held.output_text) == (second.id, second.text)
    assert status == 200
    assert headers["x-edgeproxy-region"] == "none"  # the edge's own answer
    assert held_json["id"] == original["id"]
    assert held_json["output"] == original["output"]
    assert status_items == 200
    assert items["object"] == "list"
    assert texts(items["data"])[0] == ("user", "tell me more")  # newest first
    assert chains(proxy)["answered_total"] == 3

    await client.responses.delete(second.id)  # the SDK reads {"deleted": true} as None

    assert chains(proxy)["deleted_total"] == 1
    status, answer, _ = await http("GET", url, authorization="Bearer sk-a")
    # No longer the edge's to answer: the usual answer while its owner is down (which may
    # hold it still).
    assert status == 503
    assert answer["error"]["code"] == "owner_unavailable"
    status, _, _ = await http("GET", url + "/input_items", authorization="Bearer sk-a")
    assert status == 503


async def test_the_edges_input_items_are_in_the_shape_the_owner_answered(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    a, b, proxy, client = await edge_pair(make_region, make_proxy, sdk)
    first = await turn(client, "hello there", None)
    url = f"{proxy.url}/v1/responses/{first.id}/input_items"
    _, owners, _ = await http("GET", url, authorization="Bearer sk-a")
    await a.kill()
    await turn(client, "a new chain", None)
    await known_down(proxy, a)

    status, edges, _ = await http("GET", url, authorization="Bearer sk-a")

    assert status == 200
    assert all(isinstance(item.get("id"), str) for item in edges["data"])
    assert isinstance(edges["first_id"], str) and isinstance(edges["last_id"], str)
    unnamed = [{k: v for k, v in item.items() if k != "id"} for item in owners["data"]]
    assert [{k: v for k, v in item.items() if k != "id"} for item in edges["data"]] == unnamed


async def test_the_edge_answers_delete_in_the_api_shape_while_the_owner_is_down(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    a, b, proxy, client = await edge_pair(make_region, make_proxy, sdk)
    first = await turn(client, "hello there", None)
    await a.kill()
    await turn(client, "a new chain", None)
    await known_down(proxy, a)

    status, answer, _ = await http(
        "DELETE", f"{proxy.url}/v1/responses/{first.id}", authorization="Bearer sk-a"
    )

    assert (status, answer) == (200, {"id": first.id, "object": "response", "deleted": True})
    # Gone from the edge: continuing it now is never a rescue, only its owner's way.
    with pytest.raises(openai.APIStatusError) as caught:
        await turn(client, "and then?", first.id)
    assert caught.value.status_code == 503
    assert chains(proxy)["rescued"] == NO_RESCUE
    assert chains(proxy)["deleted_total"] == 1


async def test_a_delete_with_the_owner_up_goes_to_it_and_the_edge_copy_goes_too(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    a, b, proxy, client = await edge_pair(make_region, make_proxy, sdk)
    first = await turn(client, "hello there", None)
    second = await turn(client, "more", first.id)

    await client.responses.delete(second.id)

    assert second.id not in a.responses  # the owner deleted its own
    assert first.id in a.responses
    status = chains(proxy)
    assert (status["deleted_total"], status["answered_total"]) == (1, 0)
    # With the owner down, the deleted response is not the edge's to answer, nor to go on.
    await a.kill()
    await turn(client, "a new chain", None)
    await known_down(proxy, a)
    with pytest.raises(openai.APIStatusError) as caught:
        await client.responses.retrieve(second.id)
    assert caught.value.status_code == 503
    with pytest.raises(openai.APIStatusError) as caught:
        await turn(client, "and then?", second.id)
    assert caught.value.status_code == 503
    # Its parent, not deleted, still is.
    assert (await client.responses.retrieve(first.id)).output_text == first.text
    assert chains(proxy)["answered_total"] == 1
    assert chains(proxy)["rescued"] == NO_RESCUE


async def test_a_retrieval_after_the_owner_forgot_is_answered_by_the_edge(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    a, b, proxy, client = await edge_pair(make_region, make_proxy, sdk)
    first = await turn(client, "hello there", None, stream=True)
    a.clear_responses()

    held = await client.responses.retrieve(first.id)

    assert (held.id, held.output_text) == (first.id, first.text)
    assert a.counters().responses_stored == 0
    assert chains(proxy)["answered_total"] == 1


async def test_a_retrieval_right_after_the_owner_died_is_answered_by_the_edge(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    a, b, proxy, client = await edge_pair(make_region, make_proxy, sdk)
    first = await turn(client, "hello there", None)
    await a.kill()

    held = await client.responses.retrieve(first.id)

    assert (held.id, held.output_text) == (first.id, first.text)


# -- 5. tenants --------------------------------------------------------------------------


class Tenant:
    """The tenant is the client's X-Tenant header."""

    @hookimpl
    def edgeproxy_request_received(self, request: Any, ctx: Any) -> None:
        ctx.tenant = ctx.headers.get("x-tenant")


@pytest.mark.parametrize("by", ["tenant", "credentials"])
async def test_another_scope_never_continues_nor_reads_a_chain_the_edge_holds(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    sdk: list[openai.AsyncOpenAI],
    by: str,
) -> None:
    a, b = await make_region("a", tokens=3), await make_region("b", tokens=3)
    plugins = [Tenant()] if by == "tenant" else []
    proxy = await make_proxy([table(a, NEAR), table(b, FAR)], routes=EDGE, plugins=plugins)
    if by == "tenant":  # the same key: only the tenant tells them apart
        alice = client_of(sdk, proxy, "sk-shared", **{"x-tenant": "alice"})
        mallory = client_of(sdk, proxy, "sk-shared", **{"x-tenant": "mallory"})
    else:
        alice, mallory = client_of(sdk, proxy, "sk-alice"), client_of(sdk, proxy, "sk-mallory")
    first = await turn(alice, "my secret is swordfish", None)
    second = await turn(alice, "keep it", first.id, stream=True)
    await a.kill()
    await turn(alice, "a new chain", None)
    await known_down(proxy, a)

    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as caught:
            await turn(mallory, "what was the secret?", second.id, stream=stream)
        assert "swordfish" not in str(caught.value.body)
    with pytest.raises(openai.NotFoundError) as caught:
        await mallory.responses.retrieve(second.id)
    assert "swordfish" not in str(caught.value.body)
    with pytest.raises(openai.NotFoundError):
        await mallory.responses.input_items.list(second.id)
    with pytest.raises(openai.NotFoundError):
        await mallory.responses.delete(second.id)
    status = chains(proxy)
    assert status["rescued"] == NO_RESCUE
    assert status["answered_total"] == 0
    assert status["deleted_total"] == 0
    assert b.counters().responses_stored == 1  # alice's new chain only

    # Alice, still, goes on with her chain.
    third = await turn(alice, "what was it?", second.id)
    assert third.headers["x-edgeproxy-state"] == "edge"
    assert chains(proxy)["rescued"] == {**NO_RESCUE, "owner_unavailable": 1}


# -- 6. Redis ----------------------------------------------------------------------------


async def test_a_chain_made_through_one_pop_is_rescued_by_another_through_redis(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    sdk: list[openai.AsyncOpenAI],
    redis_server: str,
    redis_prefix: str,
) -> None:
    a, b = await make_region("a", tokens=3), await make_region("b", tokens=3)
    regions = [table(a, NEAR), table(b, FAR)]
    stateful = {
        "redis_url": redis_server,
        "redis_prefix": redis_prefix + "owner:",
        "edge_prefix": redis_prefix + "chain:",
    }
    made = await make_proxy(regions, routes=EDGE, stateful=stateful, pop={"name": "sin"})
    other = await make_proxy(regions, routes=EDGE, stateful=stateful, pop={"name": "sin-2"})
    first = await turn(client_of(sdk, made), "hello from one PoP", None)
    second = await turn(client_of(sdk, made), "and again", first.id, stream=True)
    # The hold is written once the answer was relayed (see
    # test_a_chain_continued_through_another_pop_at_once_is_held_before_its_id_is_out).
    await eventually(lambda: chains(made)["held_total"] == 2)
    await a.kill()

    third = await turn(client_of(sdk, other), "and from the other", second.id)

    assert third.headers["x-edgeproxy-region"] == "b"
    assert third.headers["x-edgeproxy-state"] == "edge"
    assert await region_input(b, third.id) == [
        ("user", "hello from one PoP"),
        ("assistant", first.text),
        ("user", "and again"),
        ("assistant", second.text),
        ("user", "and from the other"),
    ]
    assert chains(other)["rescued"] == {**NO_RESCUE, "owner_unavailable": 1}
    assert chains(other)["shared"] is True
    # The other PoP held the rescued turn in Redis: the first goes on from it.
    await eventually(lambda: chains(other)["held_total"] == 1)
    await b.kill()
    await a.restart()  # empty: its store was lost with it
    fourth = await turn(client_of(sdk, made), "still there?", third.id)
    assert fourth.headers["x-edgeproxy-region"] == "a"
    assert fourth.headers["x-edgeproxy-state"] == "edge"
    assert len(await region_input(a, fourth.id)) == 7


async def test_a_chain_continued_through_another_pop_at_once_is_held_before_its_id_is_out(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    sdk: list[openai.AsyncOpenAI],
    redis_server: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = await make_region("a", tokens=3), await make_region("b", tokens=3)
    regions = [table(a, NEAR), table(b, FAR)]
    stateful = {
        "redis_url": redis_server,
        "redis_prefix": redis_prefix + "owner:",
        "edge_prefix": redis_prefix + "chain:",
    }
    made = await make_proxy(regions, routes=EDGE, stateful=stateful, pop={"name": "sin"})
    other = await make_proxy(regions, routes=EDGE, stateful=stateful, pop={"name": "sin-2"})
    # A Redis write slower than the client's next request. Bounded: a proxy that holds the
    # turn before the client has its id waits for it, then answers.
    store = made.pipeline.chains.store
    written = asyncio.Event()
    put = store.put

    async def slow_put(held: Any) -> bool:
        try:
            await asyncio.wait_for(written.wait(), 5.0)
        except TimeoutError:
            pass
        return await put(held)

    monkeypatch.setattr(store, "put", slow_put)
    try:
        first = await turn(client_of(sdk, made), "hello", None)
        await a.kill()
        second = await turn(client_of(sdk, other), "and again", first.id)
    finally:
        written.set()
        await eventually(lambda: chains(made)["held_total"] == 1)
    assert second.headers["x-edgeproxy-state"] == "edge"


async def test_with_redis_down_nothing_is_held_and_chains_go_on_at_their_owner(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    a, b = await make_region("a", tokens=3), await make_region("b", tokens=3)
    closed = f"redis://127.0.0.1:{free_port()}/0"
    proxy = await make_proxy(
        [table(a, NEAR), table(b, FAR)], routes=EDGE, stateful={"redis_url": closed}
    )
    # A clock that stands still: Redis, once failed, is not tried again during the test.
    proxy.pipeline.chains.store.clock = FakeClock()
    client = client_of(sdk, proxy)
    assert chains(proxy)["holding"] is True

    answers = [await turn(client, "one", None)]
    # The turn is held once answered: the write fails after the client has its answer.
    await eventually(lambda: chains(proxy)["holding"] is False)
    for question, stream in [("two", True), ("three", False)]:
        answers.append(await turn(client, question, answers[-1].id, stream=stream))
    await eventually(lambda: chains(proxy)["not_held"]["redis_down"] == 3)

    assert [x.headers["x-edgeproxy-region"] for x in answers] == ["a"] * 3
    assert all("x-edgeproxy-state" not in x.headers for x in answers)
    assert a.counters().previous_response_hits_total == 2
    status = chains(proxy)
    assert status["held_total"] == 0
    assert status["not_held"]["redis_down"] == 3
    assert status["rescued"] == NO_RESCUE
    # Nothing held: a chain whose owner died has nowhere else to go.
    await a.kill()
    with pytest.raises(openai.APIStatusError) as caught:
        await turn(client, "four", answers[-1].id)
    assert caught.value.status_code == 503
    assert chains(proxy)["rescued"] == NO_RESCUE


# -- 7. the default route ----------------------------------------------------------------


async def test_the_default_route_holds_no_chain(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    a, b = await make_region("a", tokens=3), await make_region("b", tokens=3)
    proxy = await make_proxy([table(a, NEAR), table(b, FAR)])
    client = client_of(sdk, proxy)
    first = await turn(client, "one", None)
    second = await turn(client, "two", first.id, stream=True)
    await a.kill()

    with pytest.raises(openai.APIStatusError) as caught:
        await turn(client, "three", second.id)

    assert caught.value.status_code == 503
    assert "x-edgeproxy-state" not in second.headers
    assert proxy.status()["chains"] is None
    assert proxy.pipeline.chains.store.held_total == 0
    assert b.counters().responses_stored == 0


# -- conversations ------------------------------------------------------------------------


async def say(client: openai.AsyncOpenAI, text: str, conversation: str) -> Any:
    return await client.responses.with_raw_response.create(
        model=MODEL, input=text, conversation=conversation
    )


async def test_a_conversation_goes_on_at_the_edge_once_its_owner_is_gone(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    a, b, proxy, client = await edge_pair(make_region, make_proxy, sdk)
    made = await client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "my name is Ada"}]
    )
    first = await say(client, "remember the number 42", made.id)
    second = await say(client, "and add one", made.id)
    assert first.headers.get("x-edgeproxy-region") == "a"
    assert second.headers.get("x-edgeproxy-state") is None
    await a.kill()

    third = await say(client, "what is my name?", made.id)
    assert third.headers.get("x-edgeproxy-state") == "edge"
    assert third.headers.get("x-edgeproxy-region") == "b"
    # Region b was sent the whole conversation: the first items, both turns, the question.
    answered = third.parse()
    status, items, _ = await http("GET", f"{b.url}/v1/responses/{answered.id}/input_items")
    texts = json.dumps(items)
    assert status == 200
    for said in ("my name is Ada", "remember the number 42", "and add one", "what is my name?"):
        assert said in texts

    # Taken on, the conversation stays with the edge, even once its owner is back: the
    # owner's copy lacks the turn the edge went on with.
    await a.restart()
    await eventually(lambda: proxy.regions.by_name["a"].state == "up")
    fourth = await say(client, "and now?", made.id)
    assert fourth.headers.get("x-edgeproxy-state") == "edge"
    assert chains(proxy)["rescued"]["owner_unavailable"] == 1
    assert chains(proxy)["rescued"]["edge_holds"] == 1


async def test_a_conversations_items_are_answered_by_the_edge_while_its_owner_is_down(
    make_region: RegionFactory, make_proxy: ProxyFactory, sdk: list[openai.AsyncOpenAI]
) -> None:
    a, b, proxy, client = await edge_pair(make_region, make_proxy, sdk)
    made = await client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "hello"}]
    )
    await say(client, "a question", made.id)
    url = f"{proxy.url}/v1/conversations/{made.id}"
    status, owners, _ = await http(
        "POST",
        url + "/items",
        {"items": [{"type": "message", "role": "user", "content": "one more"}]},
        authorization="Bearer sk-a",
    )
    assert status == 200
    await a.kill()
    await turn(client_of(sdk, proxy, "sk-a"), "a new chain", None)
    await known_down(proxy, a)

    status, items, _ = await http("GET", url + "/items", authorization="Bearer sk-a")
    assert status == 200
    texts = json.dumps(items)
    for said in ("hello", "a question", "one more"):
        assert said in texts
    assert all(isinstance(item["id"], str) for item in items["data"])
    # Another caller's scope never reads it.
    status, _, _ = await http("GET", url + "/items", authorization="Bearer sk-b")
    assert status in (404, 503)
    status, gone, _ = await http("DELETE", url, authorization="Bearer sk-a")
    assert (status, gone) == (
        200,
        {"id": made.id, "object": "conversation.deleted", "deleted": True},
    )


@pytest.mark.parametrize(
    ("bound", "reason"),
    [({"edge_max_turns": 2}, "too_many_turns"), ({"edge_max_chain_bytes": 2500}, "too_long")],
)
async def test_a_chain_past_its_bounds_is_held_no_further(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    sdk: list[openai.AsyncOpenAI],
    bound: dict[str, int],
    reason: str,
) -> None:
    a, b = await make_region("a", tokens=3), await make_region("b", tokens=3)
    proxy = await make_proxy([table(a, NEAR), table(b, FAR)], routes=EDGE, stateful=bound)
    client = client_of(sdk, proxy)
    previous = None
    for i in range(4):
        previous = (await turn(client, f"turn {i} " + "words " * 40, previous)).id
    status = chains(proxy)
    # What a client can make the edge hold is bounded: the turns past it are not held...
    assert status["not_held"][reason] >= 1
    assert status["held_total"] < 4
    assert status["largest_chain_bytes"] <= bound.get("edge_max_chain_bytes", 10**9)
    # ...and the chain goes on at its owner alone: with it gone, no rescue, the 503.
    await a.kill()
    with pytest.raises(openai.APIStatusError) as caught:
        await turn(client, "and then?", previous)
    assert caught.value.status_code == 503
    assert chains(proxy)["rescued"] == NO_RESCUE
