"""The fake region's OpenAI Responses API, driven directly by the official SDK and raw
HTTP: answers, streams, the per-region store behind ``previous_response_id``, and faults."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from edgeproxy.testing import FakeRegion, answer_text

RESPONSES = "/v1/responses"


def sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """The ``(event, data)`` pairs of a named-event SSE body, in order."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


@pytest.fixture
async def region() -> AsyncIterator[FakeRegion]:
    async with FakeRegion(name="r1") as region:
        yield region


@pytest.fixture
async def other() -> AsyncIterator[FakeRegion]:
    async with FakeRegion(name="r2") as region:
        yield region


@pytest.fixture
async def client(region: FakeRegion) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=region.url + "/v1", api_key="x", max_retries=0
    ) as client:
        yield client


@pytest.fixture
async def http(region: FakeRegion) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=region.url, http2=True, http1=False) as client:
        yield client


async def test_json_answer_is_the_chat_answer_to_the_conversation(
    region: FakeRegion, client: openai.AsyncOpenAI
) -> None:
    response = await client.responses.create(
        model="m", input="Say something", instructions="Be brief"
    )
    assert response.id.startswith("resp_")
    assert response.object == "response" and response.status == "completed"
    assert response.model == "m" and response.store is True
    convo = [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Say something"},
    ]
    assert response.output_text == answer_text(convo, 8)
    message = response.output[0]
    assert message.type == "message" and message.id.startswith("msg_")
    assert response.usage is not None
    assert response.usage.output_tokens == 8
    assert response.usage.total_tokens == response.usage.input_tokens + 8
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert list(region.responses) == [response.id]


async def test_stream_events_and_usage_match_the_json_answer(
    region: FakeRegion, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    whole = await client.responses.create(model="m", input="Hello", store=False)
    async with client.responses.stream(model="m", input="Hello", store=False) as stream:
        deltas = [
            event.delta async for event in stream if event.type == "response.output_text.delta"
        ]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert len(deltas) == 8
    assert final.usage == whole.usage
    assert region.responses == {}  # store=False

    raw = await http.post(RESPONSES, json={"model": "m", "input": "Hello", "stream": True})
    assert raw.headers["content-type"] == "text/event-stream"
    events = sse(raw.content)
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 8,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(data["type"] == name for name, data in events)
    assert events[0][1]["response"]["status"] == "in_progress"
    assert events[0][1]["response"]["output"] == []
    assert b"[DONE]" not in raw.content
    completed = events[-1][1]["response"]
    assert completed["usage"] == whole.usage.model_dump(exclude_none=True)  # type: ignore[union-attr]


async def test_chain_continues_the_stored_conversation(
    region: FakeRegion, client: openai.AsyncOpenAI
) -> None:
    first = await client.responses.create(model="m", input="Tell me a story")
    raw = await client.responses.with_raw_response.create(
        model="m", input="Go on", previous_response_id=first.id
    )
    second = raw.parse()
    assert second.previous_response_id == first.id
    history = [
        {"role": "user", "content": "Tell me a story"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Go on"},
    ]
    assert second.output_text == answer_text(history, 8)
    assert raw.headers["x-fake-conversation-messages"] == "3"
    # The same conversation sent whole, statelessly, gets the same answer.
    stateless = await client.responses.create(
        model="m",
        store=False,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": first.output_text}],
            },
            {"role": "user", "content": "Go on"},
        ],
    )
    assert stateless.output_text == second.output_text
    # A chain that lost its history answers differently.
    alone = await client.responses.create(model="m", input="Go on", store=False)
    assert alone.output_text != second.output_text
    counters = region.counters()
    assert counters.previous_response_hits_total == 1
    assert counters.responses_stored == counters.responses_stored_total == 2


async def test_another_region_does_not_know_the_chain(
    region: FakeRegion, other: FakeRegion, client: openai.AsyncOpenAI
) -> None:
    first = await client.responses.create(model="m", input="Remember this")
    async with openai.AsyncOpenAI(base_url=other.url + "/v1", api_key="x", max_retries=0) as far:
        with pytest.raises(openai.NotFoundError) as caught:
            await far.responses.create(model="m", input="Go on", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):
            await far.responses.retrieve(first.id)
    assert caught.value.body == {
        "message": f"Previous response with id '{first.id}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    assert other.counters().previous_response_misses_total == 1
    # A restart empties a region's store, as a server's memory.
    await region.kill()
    await region.restart()
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="m", input="Go on", previous_response_id=first.id)


async def test_retrieve_input_items_cancel_and_delete(
    region: FakeRegion, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    conversation = (await client.conversations.create()).id
    first = await client.responses.create(
        model="m",
        input=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
        conversation=conversation,
    )
    got = await client.responses.retrieve(first.id)
    assert got == first
    assert got.conversation is not None and got.conversation.id == conversation
    items = await client.responses.input_items.list(first.id)
    texts = [item.content[0].text for item in items.data]  # type: ignore[union-attr]
    assert texts == ["two", "one"]  # newest first, as OpenAI lists them
    page = (await http.get(f"{RESPONSES}/{first.id}/input_items?order=asc&limit=1")).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert page["first_id"] == page["last_id"] == page["data"][0]["id"]
    assert (await client.responses.cancel(first.id)).id == first.id
    deleted = await http.delete(f"{RESPONSES}/{first.id}")
    assert deleted.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    missing = await http.get(f"{RESPONSES}/{first.id}")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "response_not_found"
    assert (await http.delete(f"{RESPONSES}/{first.id}")).status_code == 404
    counters = region.counters()
    assert counters.response_lookups_total == 5
    assert counters.response_lookup_misses_total == 2


async def test_store_is_bounded_and_can_be_cleared() -> None:
    async with (
        FakeRegion(name="small", responses_capacity=3) as region,
        httpx.AsyncClient(base_url=region.url) as http,
    ):
        ids = []
        for i in range(5):
            response = await http.post(RESPONSES, json={"model": "m", "input": f"turn {i}"})
            ids.append(response.json()["id"])
        assert list(region.responses) == ids[2:]
        assert region.counters().responses_evicted_total == 2
        oldest = await http.post(
            RESPONSES, json={"model": "m", "input": "x", "previous_response_id": ids[0]}
        )
        assert oldest.status_code == 404
        region.clear_responses()
        assert region.responses == {}


async def test_max_output_tokens_makes_an_incomplete_prefix(client: openai.AsyncOpenAI) -> None:
    whole = await client.responses.create(model="m", input="Hi", store=False)
    short = await client.responses.create(model="m", input="Hi", max_output_tokens=3)
    assert short.status == "incomplete"
    assert short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text.startswith(short.output_text)
    assert short.usage is not None and short.usage.output_tokens == 3


async def test_cached_tokens_from_the_kv_model() -> None:
    long_input = " ".join(f"w{i}" for i in range(80))
    async with (
        FakeRegion(name="kv", kv_capacity_blocks=256) as region,
        openai.AsyncOpenAI(base_url=region.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        first = await client.responses.create(model="m", input=long_input)
        second = await client.responses.create(
            model="m", input="and more", previous_response_id=first.id
        )
    assert first.usage is not None and second.usage is not None
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens >= 64
    assert second.usage.input_tokens > second.usage.input_tokens_details.cached_tokens


async def test_fault_5xx_has_the_openai_shape(
    region: FakeRegion, client: openai.AsyncOpenAI
) -> None:
    region.configure(fault="5xx", fault_status=503)
    with pytest.raises(openai.InternalServerError) as caught:
        await client.responses.create(model="m", input="Hi")
    assert caught.value.status_code == 503
    assert isinstance(caught.value.body, dict) and caught.value.body["type"] == "server_error"
    assert region.responses == {}


@pytest.mark.parametrize("after", [0, 3])
async def test_fault_reset_after_n_deltas(
    region: FakeRegion, http: httpx.AsyncClient, after: int
) -> None:
    """``fault_after_tokens=0`` breaks the stream between ``response.created`` and the
    first delta; a broken response is not stored."""
    region.configure(fault="reset", fault_after_tokens=after)
    received = b""
    with pytest.raises(httpx.RemoteProtocolError):
        async with http.stream(
            "POST", RESPONSES, json={"model": "m", "input": "Hi", "stream": True}
        ) as response:
            assert response.status_code == 200
            async for chunk in response.aiter_raw():
                received += chunk
    names = [name for name, _ in sse(received)]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[4:] == ["response.output_text.delta"] * after
    assert region.responses == {}
    assert region.counters().tokens_sent_total == after


async def test_fault_stream_error_sends_an_error_event(
    region: FakeRegion, http: httpx.AsyncClient
) -> None:
    region.configure(fault="stream_error", fault_after_tokens=2)
    raw = await http.post(RESPONSES, json={"model": "m", "input": "Hi", "stream": True})
    events = sse(raw.content)
    assert [name for name, _ in events][4:] == ["response.output_text.delta"] * 2 + ["error"]
    assert events[-1][1]["sequence_number"] == len(events) - 1
    assert events[-1][1]["code"] == "server_error"
    # A JSON answer has no such event: it gets the 5xx.
    assert (await http.post(RESPONSES, json={"model": "m", "input": "Hi"})).status_code == 503


async def test_fault_stream_error_on_chat_is_vllm_shaped(
    region: FakeRegion, client: openai.AsyncOpenAI
) -> None:
    """Chat streams get the in-band error as vLLM sends it; the SDK raises it."""
    region.configure(fault="stream_error", fault_after_tokens=1)
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], stream=True
    )
    received = []
    with pytest.raises(openai.APIError, match="injected error after 1 tokens"):
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    assert len(received) == 1


async def test_fault_stall_body_stalls_after_response_created(region: FakeRegion) -> None:
    region.configure(fault="stall_body")
    async with httpx.AsyncClient(base_url=region.url, timeout=httpx.Timeout(5.0, read=0.5)) as http:
        received = b""
        with pytest.raises(httpx.ReadTimeout):
            async with http.stream(
                "POST", RESPONSES, json={"model": "m", "input": "Hi", "stream": True}
            ) as response:
                async for chunk in response.aiter_raw():
                    received += chunk
    assert sse(received)[0][0] == "response.created"
    assert "response.output_text.delta" not in received.decode()
    await region.wait_until(lambda c: c.in_flight == 0)
    assert region.counters().cancelled_total == 1


async def test_bad_requests(http: httpx.AsyncClient) -> None:
    assert (await http.post(RESPONSES, json={"model": "m"})).status_code == 400
    bad = await http.post(RESPONSES, json={"model": "m", "input": "x", "max_output_tokens": "5"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_output_tokens"
    assert (await http.get(RESPONSES)).status_code == 405
    assert (await http.post(f"{RESPONSES}/resp_1/nothing")).status_code == 404
