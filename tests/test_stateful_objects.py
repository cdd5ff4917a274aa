"""Conversations, files, batches and vector stores live in the region that made them: made
through one PoP, every request for them through the other lands on that region; an id no
process knows gets the API's own 404 without a region being asked; while the owner is down,
503 with ``Retry-After``. Through the official openai SDK, with two PoPs sharing Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from multidict import CIMultiDict

from edgeproxy._core.config import RouteConfig
from edgeproxy._core.context import RequestContext, start_context
from edgeproxy._obtain.attempt import Attempt
from edgeproxy._obtain.failover import AttemptResponse
from edgeproxy._protocol.dialects import OPENAI
from edgeproxy._protocol.dialects import RESPONSES as RESPONSES_DIALECT
from edgeproxy._protocol.headers import trace_context
from edgeproxy._protocol.objects import BATCHES, FILES, RESPONSES, VECTOR_STORES, object_path
from edgeproxy._routing.owners import created_id, stateful_request
from edgeproxy._upstream.pool import UpstreamError
from edgeproxy.testing import FakeRegion

from .conftest import Pops, ProxyFactory, RegionFactory


def region_of(raw: Any) -> str:
    return str(raw.headers["x-edgeproxy-region"])


def misses(regions: list[FakeRegion]) -> int:
    """The requests a region answered 404 for an object it does not hold."""
    return sum(r.counters().object_lookup_misses_total for r in regions if r.running)


async def upload(client: openai.AsyncOpenAI, content: bytes, name: str = "a.jsonl") -> Any:
    return await client.files.with_raw_response.create(file=(name, content), purpose="batch")


async def test_files_and_their_content_from_the_other_pop(two_pops: Pops) -> None:
    regions, (a, b), _ = two_pops
    owners: set[str] = set()
    for index in range(6):
        content = f'{{"line": {index}}}\n'.encode()
        made = await upload(a, content)
        file, owner = made.parse(), region_of(made)
        assert file.id.startswith("file-")
        owners.add(owner)
        got = await b.files.with_raw_response.retrieve(file.id)
        assert (region_of(got), got.parse().id) == (owner, file.id)
        body = await b.files.with_raw_response.content(file.id)
        assert (region_of(body), body.content) == (owner, content)
    assert len(owners) > 1  # creates spread: only what refers to a file is pinned
    # A multipart upload too big to be held streams through; its answer still names the owner.
    big = b"x" * (300 * 1024)
    made = await upload(b, big, "big.bin")
    owner = region_of(made)
    body = await a.files.with_raw_response.content(made.parse().id)
    assert (region_of(body), len(body.content)) == (owner, len(big))
    deleted = await a.files.with_raw_response.delete(made.parse().id)
    assert region_of(deleted) == owner and deleted.parse().deleted
    assert misses(regions) == 0


async def test_batches_go_to_their_input_file_and_stay_there(two_pops: Pops) -> None:
    regions, (a, b), _ = two_pops
    for index in range(4):
        made = await upload(a, f'{{"custom_id": "{index}"}}\n'.encode())
        file_id, owner = made.parse().id, region_of(made)
        # Created through the other PoP: the batch goes where its input file is.
        raw = await b.batches.with_raw_response.create(
            input_file_id=file_id, endpoint="/v1/responses", completion_window="24h"
        )
        batch = raw.parse()
        assert batch.id.startswith("batch_") and region_of(raw) == owner
        got = await a.batches.with_raw_response.retrieve(batch.id)
        assert (region_of(got), got.parse().input_file_id) == (owner, file_id)
        cancelled = await b.batches.with_raw_response.cancel(batch.id)
        assert (region_of(cancelled), cancelled.parse().status) == (owner, "cancelling")
    assert misses(regions) == 0


async def test_vector_stores_their_files_and_searches(two_pops: Pops) -> None:
    regions, (a, b), _ = two_pops
    for index in range(4):
        made = await upload(a, f"the answer is {index}".encode(), "notes.txt")
        file_id, owner = made.parse().id, region_of(made)
        raw = await b.vector_stores.with_raw_response.create(name=f"vs{index}", file_ids=[file_id])
        store = raw.parse()
        assert store.id.startswith("vs_") and region_of(raw) == owner
        found = await a.vector_stores.with_raw_response.search(store.id, query="answer")
        assert region_of(found) == owner
        assert [hit.file_id for hit in found.parse().data] == [file_id]
        other = await upload(b, b"more notes", "more.txt")
        if region_of(other) == owner:
            added = await a.vector_stores.files.with_raw_response.create(
                vector_store_id=store.id, file_id=other.parse().id
            )
            assert region_of(added) == owner
        listed = await b.vector_stores.files.with_raw_response.list(vector_store_id=store.id)
        assert region_of(listed) == owner
        batch = await a.vector_stores.file_batches.with_raw_response.create(
            vector_store_id=store.id, file_ids=[file_id]
        )
        assert region_of(batch) == owner and batch.parse().status == "completed"
        deleted = await b.vector_stores.with_raw_response.delete(store.id)
        assert region_of(deleted) == owner and deleted.parse().deleted
    assert misses(regions) == 0


async def test_responses_go_to_the_files_and_vector_stores_they_read(two_pops: Pops) -> None:
    regions, (a, b), _ = two_pops
    for index in range(4):
        made = await upload(a, f"notes {index}".encode(), "notes.txt")
        file_id, owner = made.parse().id, region_of(made)
        store = (await a.vector_stores.create(file_ids=[file_id])).id
        part = {"type": "input_file", "file_id": file_id}
        raw = await b.responses.with_raw_response.create(
            model="fake-llm",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "sum up"}, part]}],
        )
        assert region_of(raw) == owner
        raw = await b.responses.with_raw_response.create(
            model="fake-llm",
            input="what do the notes say?",
            tools=[{"type": "file_search", "vector_store_ids": [store]}],
        )
        assert region_of(raw) == owner
        # The answer is the chain's start: its follow-up stays there.
        follow = await a.responses.with_raw_response.create(
            model="fake-llm", input="and?", previous_response_id=raw.parse().id
        )
        assert region_of(follow) == owner
    assert misses(regions) == 0


async def test_a_file_held_by_another_region_than_the_vector_store_is_the_apis_404(
    two_pops: Pops,
) -> None:
    regions, (a, b), _ = two_pops
    made = await upload(a, b"first")
    owner = region_of(made)
    while True:  # a file in another region
        other = await upload(a, b"second")
        if region_of(other) != owner:
            break
    store = (await b.vector_stores.create(file_ids=[made.parse().id])).id
    before = sum(r.requests_total for r in regions)
    with pytest.raises(openai.NotFoundError) as caught:
        await a.vector_stores.files.create(vector_store_id=store, file_id=other.parse().id)
    sent = caught.value.response.json()["error"]
    assert sent["message"] == f"No such File object: {other.parse().id}"
    # No region was asked: the one holding the store would not find the file.
    assert sum(r.requests_total for r in regions) == before
    assert misses(regions) == 0


async def test_conversations_from_either_pop_and_responses_in_them(two_pops: Pops) -> None:
    regions, (a, b), _ = two_pops
    for index in range(4):
        made = await a.conversations.with_raw_response.create(
            items=[{"type": "message", "role": "user", "content": f"hello {index}"}],
            metadata={"n": str(index)},
        )
        conversation, owner = made.parse(), region_of(made)
        assert conversation.id.startswith("conv_")
        got = await b.conversations.with_raw_response.retrieve(conversation.id)
        assert (region_of(got), got.parse().metadata) == (owner, {"n": str(index)})
        # A Responses request names it as a string or as {"id": ...}; through either PoP.
        for client, ref in ((b, conversation.id), (a, {"id": conversation.id})):
            raw = await client.responses.with_raw_response.create(
                model="fake-llm", input="and then?", conversation=ref
            )
            assert region_of(raw) == owner
            assert raw.parse().conversation is not None
        items = await b.conversations.items.with_raw_response.list(conversation.id)
        assert region_of(items) == owner
        # The first message, then each turn's input and answer.
        assert len(items.parse().data) == 5
        first = items.parse().data[0].id
        item = await a.conversations.items.with_raw_response.retrieve(
            first, conversation_id=conversation.id
        )
        assert region_of(item) == owner
        added = await a.conversations.items.with_raw_response.create(
            conversation.id, items=[{"type": "message", "role": "user", "content": "more"}]
        )
        assert region_of(added) == owner
        updated = await b.conversations.with_raw_response.update(
            conversation.id, metadata={"n": "updated"}
        )
        assert region_of(updated) == owner
        deleted = await a.conversations.with_raw_response.delete(conversation.id)
        assert region_of(deleted) == owner and deleted.parse().deleted
    assert misses(regions) == 0


async def test_unknown_ids_get_each_apis_own_404_and_no_region_is_asked(two_pops: Pops) -> None:
    regions, (a, _), (pop, _) = two_pops
    cases = [
        (
            a.conversations.retrieve("conv_nobody"),
            "Conversation with id 'conv_nobody' not found.",
            None,
        ),
        (
            a.responses.create(model="fake-llm", input="x", conversation="conv_nobody"),
            "Conversation with id 'conv_nobody' not found.",
            None,
        ),
        (a.files.retrieve("file-nobody"), "No such File object: file-nobody", "id"),
        (a.files.content("file-nobody"), "No such File object: file-nobody", "id"),
        (a.batches.retrieve("batch_nobody"), "No batch found with id 'batch_nobody'.", None),
        (a.batches.cancel("batch_nobody"), "No batch found with id 'batch_nobody'.", None),
        (
            a.batches.create(
                input_file_id="file-nobody", endpoint="/v1/responses", completion_window="24h"
            ),
            "No such File object: file-nobody",
            "id",
        ),
        (
            a.vector_stores.retrieve("vs_nobody"),
            "No vector store found with id 'vs_nobody'.",
            None,
        ),
        (
            a.vector_stores.search("vs_nobody", query="q"),
            "No vector store found with id 'vs_nobody'.",
            None,
        ),
        (
            a.vector_stores.create(file_ids=["file-nobody"]),
            "No such File object: file-nobody",
            "id",
        ),
    ]
    for call, message, param in cases:
        with pytest.raises(openai.NotFoundError) as caught:
            await call
        sent = caught.value.response.json()
        assert sent == {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": None,
            }
        }
    assert sum(r.requests_total for r in regions) == 0
    assert pop.status()["stateful"]["unknown_total"] == len(cases)


async def test_objects_whose_region_is_down_get_503_and_the_others_go_on(two_pops: Pops) -> None:
    regions, (a, b), _ = two_pops
    by_name = {r.name: r for r in regions}
    made: list[tuple[str, str, str]] = []  # (kind, id, owner)
    for index in range(9):
        file = await upload(a, f"file {index}".encode())
        made.append(("file", file.parse().id, region_of(file)))
        conversation = await b.conversations.with_raw_response.create()
        made.append(("conversation", conversation.parse().id, region_of(conversation)))
    store = await b.vector_stores.with_raw_response.create(file_ids=[made[0][1]])
    made.append(("vector_store", store.parse().id, region_of(store)))
    dead = made[0][2]
    await by_name[dead].kill()
    seen = {"down": 0, "up": 0}
    for kind, object_id, owner in made:
        if kind == "file":
            call = b.files.with_raw_response.retrieve(object_id)
        elif kind == "conversation":
            call = a.conversations.with_raw_response.retrieve(object_id)
        else:
            call = a.vector_stores.with_raw_response.retrieve(object_id)
        if owner == dead:
            with pytest.raises(openai.InternalServerError) as caught:
                await call
            error = caught.value
            assert error.status_code == 503 and error.code == "owner_unavailable"
            assert int(error.response.headers["retry-after"]) > 0
            assert by_name[dead].url not in error.response.text
            seen["down"] += 1
        else:
            raw = await call
            assert region_of(raw) == owner
            seen["up"] += 1
    assert seen["down"] and seen["up"]
    assert misses(regions) == 0


async def test_with_one_region_an_object_made_elsewhere_still_reaches_it(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("only", tokens=3)
    proxy = await make_proxy([region])
    async with aiohttp.ClientSession() as session:
        async with session.post(region.url + "/v1/conversations", json={}) as resp:
            made = (await resp.json())["id"]  # made directly at the region: the proxy never saw it
        async with session.get(f"{proxy.url}/v1/conversations/{made}") as resp:
            assert resp.status == 200 and resp.headers["X-Edgeproxy-Region"] == "only"


def context(method: str, path: str, body: bytes = b"", ctype: str = "") -> RequestContext:
    headers: CIMultiDict[str] = CIMultiDict({"content-type": ctype} if ctype else {})
    ctx = start_context(
        "r", trace_context(None), method, path, headers, "192.0.2.1", 0.0,
        RouteConfig(name="default", path="/"), "http", "1.1", "h",
    )  # fmt: skip
    ctx.body = body
    ctx.body_read = True
    return ctx


def test_paths_of_stored_objects() -> None:
    found = object_path("/v1/files/file-1/content")
    assert found is not None and (found.kind, found.object_id, found.rest) == (
        FILES,
        "file-1",
        "content",
    )
    found = object_path("/openai/v1/vector_stores/vs_1/files/file-2")
    assert found is not None and (found.kind, found.object_id, found.rest) == (
        VECTOR_STORES,
        "vs_1",
        "files/file-2",
    )
    found = object_path("/v1/batches")
    assert found is not None and (found.kind, found.object_id) == (BATCHES, None)
    found = object_path("/v1/responses/resp_1/input_items")
    assert found is not None and (found.kind, found.object_id) == (RESPONSES, "resp_1")
    # Endpoints under a collection, other paths: nothing stored is named.
    for path in ("/v1/responses/input_tokens", "/v1/filesystem", "/v1/chat/completions", "/x"):
        assert object_path(path) is None


def test_what_a_request_refers_to_and_makes() -> None:
    def refs(ctx: RequestContext) -> tuple[list[str], bool] | None:
        ctx.fix(None if "/responses" not in ctx.path else "responses")
        state = stateful_request(ctx)
        return None if state is None else ([ref.id for ref in state.refs], state.creates)

    json = "application/json"
    assert refs(context("POST", "/v1/chat/completions", b"{}", json)) is None
    assert refs(context("GET", "/v1/files")) is None  # a list: any region
    assert refs(context("POST", "/v1/files", b"--b\r\n", "multipart/form-data; boundary=b")) == (
        [],
        True,
    )
    body = b'{"input_file_id": "file-1", "endpoint": "/v1/responses"}'
    assert refs(context("POST", "/v1/batches", body, json)) == (["file-1"], True)
    body = b'{"file_ids": ["file-1", "file-2"]}'
    assert refs(context("POST", "/v1/vector_stores", body, json)) == (["file-1", "file-2"], True)
    body = b'{"file_id": "file-3"}'
    assert refs(context("POST", "/v1/vector_stores/vs_1/files", body, json)) == (
        ["vs_1", "file-3"],
        False,
    )
    assert refs(context("DELETE", "/v1/conversations/conv_1/items/msg_1")) == (["conv_1"], False)
    body = b'{"model": "m", "input": "x", "conversation": {"id": "conv_1"}}'
    assert refs(context("POST", "/v1/responses", body, json)) == (["conv_1"], True)
    body = b'{"model": "m", "input": "x", "store": false}'
    assert refs(context("POST", "/v1/responses", body, json)) is None


class _Response:
    """The upstream response an attempt holds (its head; the body is the attempt's)."""

    status = 200
    headers: list[tuple[str, str]] = []
    http_version = "1.1"


async def _chunks(rest: list[bytes | Exception]) -> AsyncIterator[bytes]:
    for chunk in rest:
        if isinstance(chunk, Exception):
            raise chunk
        yield chunk


def answer_of(proxy: Any, first: bytes, rest: list[bytes | Exception]) -> AttemptResponse:
    """An attempt at the proxy's one region, as the attempt loop leaves it after its first
    chunk, with the rest of the body to come from ``rest``: real objects, as the compiled
    build takes no stand-ins for them."""
    region = proxy.regions.by_name["r"]
    attempt = Attempt(proxy.pipeline.failover, region, "primary", set())
    attempt.response = _Response()
    attempt.first, attempt.iterator = first, _chunks(rest)
    return AttemptResponse(attempt, 1)


async def test_a_created_objects_answer_in_pieces_is_read_on_until_its_id(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # A region may send a JSON answer in several pieces: its id is read whole, and the
    # pieces are kept to be relayed as they came.
    region = await make_region("r")
    proxy = await make_proxy([{"name": "r", "url": region.url}])
    answer = answer_of(proxy, b'{"id": "file-', [b'1", "object": ', b'"file"}'])
    assert created_id(OPENAI, answer.attempt.first or b"", sse=False) is None
    whole = await answer.read_more(1024)
    assert created_id(OPENAI, whole, sse=False) == "file-1"
    assert answer.attempt.eof and answer.attempt.first == b'{"id": "file-1", "object": "file"}'
    # Bounded: what is past the limit is left to stream.
    answer = answer_of(proxy, b"[", [b"1" * 10, b"2" * 10, b"3"])
    assert await answer.read_more(15) == b"[" + b"1" * 10 + b"2" * 10
    assert not answer.attempt.eof
    # A break is raised, counted against the region, and what came is kept.
    errors = proxy.regions.by_name["r"].errors_total
    answer = answer_of(proxy, b'{"id"', [b": ", UpstreamError("reset")])
    with pytest.raises(UpstreamError):
        await answer.read_more(1024)
    assert answer.attempt.first == b'{"id": '
    assert proxy.regions.by_name["r"].errors_total == errors + 1


def test_a_stream_announces_the_stored_response_in_its_first_event() -> None:
    created = (
        b"event: response.created\n"
        b'data: {"type": "response.created", "response": {"id": "resp_1"}}\n\n'
    )
    assert created_id(RESPONSES_DIALECT, created, sse=True) == "resp_1"
    assert created_id(OPENAI, created, sse=True) is None  # only the Responses API's does
    # Its type in its data alone, as some servers send it.
    data_only = b'data: {"type": "response.created", "response": {"id": "resp_2"}}\n\n'
    assert created_id(RESPONSES_DIALECT, data_only, sse=True) == "resp_2"
    assert (
        created_id(RESPONSES_DIALECT, b"event: response.in_progress\ndata: {}\n\n", sse=True)
        is None
    )
