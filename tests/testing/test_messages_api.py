"""The fake region's Anthropic Messages API, driven directly by the official SDK (sync and
async) and raw HTTP: answers, streams, prefill continuations, errors and faults."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import httpx
import pytest

from edgeproxy.testing import FakeRegion, answer_text

MESSAGES = "/v1/messages"
ASK = [{"role": "user", "content": "Say something deterministic"}]


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


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "claude-fake", "max_tokens": 1024, "messages": ASK, **extra}


@pytest.fixture
async def region() -> AsyncIterator[FakeRegion]:
    async with FakeRegion(name="r1") as region:
        yield region


@pytest.fixture
async def client(region: FakeRegion) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=region.url, api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture
async def http(region: FakeRegion) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=region.url, http2=True, http1=False) as client:
        yield client


async def test_json_answer_and_headers_seen(
    region: FakeRegion, client: anthropic.AsyncAnthropic
) -> None:
    message = await client.messages.create(
        model="claude-fake",
        max_tokens=1024,
        system=[{"type": "text", "text": "Be brief"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        extra_headers={"anthropic-beta": "fake-beta-1", "anthropic-version": "2023-06-01"},
    )
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "claude-fake"
    convo = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hello"}]
    text = message.content[0]
    assert text.type == "text" and text.text == answer_text(convo, 8)
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens == 8
    assert message.usage.cache_read_input_tokens == 0
    assert region.anthropic_version == "2023-06-01"
    assert region.anthropic_beta == "fake-beta-1"
    counted = await client.messages.count_tokens(
        model="claude-fake",
        system="Be brief",
        messages=[{"role": "user", "content": "Hello"}],
    )
    assert counted.input_tokens == message.usage.input_tokens
    assert region.anthropic_version is not None  # the SDK's own


async def test_stream_matches_the_json_answer(
    client: anthropic.AsyncAnthropic, http: httpx.AsyncClient
) -> None:
    whole = await client.messages.create(**body())
    async with client.messages.stream(**body()) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert len(texts) == 8
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.stop_reason == "end_turn"

    raw = await http.post(MESSAGES, json=body(stream=True))
    events = sse(raw.content)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * 8,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["output_tokens"] == 1
    assert events[-2][1]["usage"] == {"output_tokens": 8}
    assert all(data["type"] == name for name, data in events)


def test_sync_client_streams_with_create(region: FakeRegion) -> None:
    with anthropic.Anthropic(base_url=region.url, api_key="x", max_retries=0) as client:
        whole = client.messages.create(**body())
        stream = client.messages.create(**body(), stream=True)
        kinds = []
        text = ""
        with stream:
            for event in stream:
                kinds.append(event.type)
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    text += event.delta.text
    assert text == whole.content[0].text  # type: ignore[union-attr]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


async def test_max_tokens_and_stop_sequences(client: anthropic.AsyncAnthropic) -> None:
    whole = (await client.messages.create(**body())).content[0].text  # type: ignore[union-attr]
    short = await client.messages.create(**{**body(), "max_tokens": 3})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert whole.startswith(short.content[0].text)  # type: ignore[union-attr]
    stop = whole.split()[3]
    stopped = await client.messages.create(**body(stop_sequences=[stop]))
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == whole[: whole.index(stop)]  # type: ignore[union-attr]


@pytest.mark.parametrize("cut", [0, 2, 5])
async def test_prefill_continues_the_unbroken_answer(
    client: anthropic.AsyncAnthropic, cut: int
) -> None:
    whole = (await client.messages.create(**body())).content[0].text  # type: ignore[union-attr]
    words = whole.split(" ")
    partial = " ".join(words[:cut]) if cut else ""
    if cut == 5:
        partial = partial[:-2]  # inside a token
    prefilled = [*ASK, {"role": "assistant", "content": partial}]
    rest = await client.messages.create(**body(messages=prefilled))
    assert partial + rest.content[0].text == whole  # type: ignore[union-attr]
    assert rest.stop_reason == "end_turn"


async def test_cache_read_tokens_from_the_kv_model() -> None:
    long_text = " ".join(f"w{i}" for i in range(80))
    first = [{"role": "user", "content": long_text}]
    async with (
        FakeRegion(name="kv", kv_capacity_blocks=256) as region,
        anthropic.AsyncAnthropic(base_url=region.url, api_key="x", max_retries=0) as client,
    ):
        one = await client.messages.create(**body(messages=first))
        answer = one.content[0].text  # type: ignore[union-attr]
        turn = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "go"}]
        two = await client.messages.create(**body(messages=turn))
        counted = await client.messages.count_tokens(model="m", messages=turn)  # type: ignore[arg-type]
    assert one.usage.cache_read_input_tokens == 0
    assert two.usage.cache_read_input_tokens is not None
    assert two.usage.cache_read_input_tokens >= 64
    assert two.usage.input_tokens + two.usage.cache_read_input_tokens == counted.input_tokens


async def test_errors_have_the_anthropic_shape(http: httpx.AsyncClient) -> None:
    missing = await http.post(MESSAGES, json={"model": "m", "messages": ASK})
    assert missing.status_code == 400
    error = missing.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]
    bad_role = await http.post(MESSAGES, json=body(messages=[{"role": "tool", "content": "x"}]))
    assert bad_role.json()["error"]["type"] == "invalid_request_error"
    not_json = await http.post(MESSAGES, content=b"{")
    assert not_json.status_code == 400 and not_json.json()["type"] == "error"


@pytest.mark.parametrize(
    ("status", "kind", "error"),
    [
        (529, "overloaded_error", anthropic.APIStatusError),
        (503, "overloaded_error", anthropic.InternalServerError),
        (500, "api_error", anthropic.InternalServerError),
    ],
)
async def test_fault_5xx_has_the_anthropic_shape(
    region: FakeRegion,
    client: anthropic.AsyncAnthropic,
    status: int,
    kind: str,
    error: type[Exception],
) -> None:
    region.configure(fault="5xx", fault_status=status)
    with pytest.raises(error) as caught:
        await client.messages.create(**body())
    assert isinstance(caught.value, anthropic.APIStatusError)
    assert caught.value.status_code == status
    assert caught.value.body == {
        "type": "error",
        "error": {"type": kind, "message": f"fake region r1: injected {status}"},
    }


@pytest.mark.parametrize("after", [0, 3])
async def test_fault_reset_after_n_deltas(region: FakeRegion, after: int) -> None:
    """``fault_after_tokens=0`` breaks the stream after ``message_start`` (and the
    opening block), before any ``content_block_delta``; over HTTP/1.1 here."""
    region.configure(fault="reset", fault_after_tokens=after)
    received = b""
    async with aiohttp.ClientSession() as h1:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with h1.post(region.url + MESSAGES, json=body(stream=True)) as response:
                assert response.status == 200
                async for chunk in response.content.iter_any():
                    received += chunk
    names = [name for name, _ in sse(received)]
    assert (
        names == ["message_start", "content_block_start", "ping"] + ["content_block_delta"] * after
    )


async def test_fault_reset_seen_by_the_sdk(
    region: FakeRegion, client: anthropic.AsyncAnthropic
) -> None:
    region.configure(fault="reset", fault_after_tokens=2)
    texts: list[str] = []
    with pytest.raises(anthropic.APIConnectionError):
        async with client.messages.stream(**body()) as stream:
            async for text in stream.text_stream:
                texts.append(text)
    assert len(texts) == 2


async def test_fault_stream_error_sends_overloaded_event(
    region: FakeRegion, client: anthropic.AsyncAnthropic, http: httpx.AsyncClient
) -> None:
    region.configure(fault="stream_error", fault_after_tokens=2, fault_status=529)
    raw = await http.post(MESSAGES, json=body(stream=True))
    events = sse(raw.content)
    assert [name for name, _ in events][3:] == ["content_block_delta"] * 2 + ["error"]
    assert events[-1][1]["type"] == "error"
    assert events[-1][1]["error"]["type"] == "overloaded_error"
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with client.messages.stream(**body()) as stream:
            async for _ in stream:
                pass
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"]["type"] == "overloaded_error"


async def test_fault_stall_ends_when_the_client_gives_up(region: FakeRegion) -> None:
    region.configure(fault="stall")
    async with anthropic.AsyncAnthropic(
        base_url=region.url, api_key="x", max_retries=0, timeout=0.5
    ) as client:
        with pytest.raises(anthropic.APITimeoutError):
            await client.messages.create(**body())
    await region.wait_until(lambda c: c.in_flight == 0)
    assert region.counters().cancelled_total == 1
