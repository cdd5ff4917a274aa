"""Token usage of every API the regions speak, read as the answer streams past: chat's
shape, the Responses API's and Anthropic Messages', each given to the readers (metrics,
token limits, the access log) with chat's fields beside the API's own."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from edgeproxy import EdgeProxy
from edgeproxy._admission.ratelimit import api_key
from edgeproxy._protocol import dialects
from edgeproxy._protocol.bodies import estimate_prompt_tokens
from edgeproxy._protocol.endpoints import MESSAGES, MESSAGES_COUNT_TOKENS, openai_endpoint
from edgeproxy._protocol.sse import SSEReader, events_of
from edgeproxy._protocol.usage import UsageTracker

from .conftest import ProxyFactory, RegionFactory, eventually
from .test_metrics import scrape


async def settled(proxy: EdgeProxy) -> None:
    """Wait until every request finished, token settlement included."""
    await eventually(lambda: proxy.pipeline.in_flight == 0)


def sse(*events: tuple[str | None, dict[str, Any]]) -> bytes:
    out = b""
    for name, data in events:
        if name is not None:
            out += b"event: " + name.encode() + b"\n"
        out += b"data: " + orjson.dumps(data) + b"\n\n"
    return out


RESPONSE = {"id": "resp_1", "object": "response", "status": "in_progress", "usage": None}
RESPONSES_STREAM = sse(
    ("response.created", {"type": "response.created", "sequence_number": 0, "response": RESPONSE}),
    (
        "response.output_text.delta",
        {"type": "response.output_text.delta", "sequence_number": 1, "delta": '"usage" hi'},
    ),
    (
        "response.completed",
        {
            "type": "response.completed",
            "sequence_number": 2,
            "response": {
                **RESPONSE,
                "status": "completed",
                "usage": {
                    "input_tokens": 12,
                    "input_tokens_details": {"cached_tokens": 4},
                    "output_tokens": 7,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": 19,
                },
            },
        },
    ),
)
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
MESSAGES_STREAM = sse(
    (
        "message_start",
        {
            "type": "message_start",
            "message": {
                **MESSAGE,
                "usage": {
                    "input_tokens": 10,
                    "output_tokens": 1,
                    "cache_creation_input_tokens": 3,
                    "cache_read_input_tokens": 20,
                },
            },
        },
    ),
    ("ping", {"type": "ping"}),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
    ),
    (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 9},
        },
    ),
    ("message_stop", {"type": "message_stop"}),
)


def feed(tracker: UsageTracker, body: bytes, size: int) -> dict[str, Any] | None:
    """``body`` in pieces of ``size``, each with the events it completes, as the
    Responder's one parse reads them."""
    reader = SSEReader()
    for i in range(0, len(body), size):
        piece = body[i : i + size]
        tracker.feed(piece, reader.feed(piece))
    return tracker.result()


@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
def test_a_responses_stream_is_counted_from_response_completed(size: int) -> None:
    usage = feed(UsageTracker(sse=True, dialect=dialects.RESPONSES), RESPONSES_STREAM, size)
    assert usage is not None
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        12,
        7,
        19,
    )
    assert usage["input_tokens_details"] == {"cached_tokens": 4}


@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
def test_a_messages_stream_sums_message_start_and_message_delta(size: int) -> None:
    usage = feed(UsageTracker(sse=True, dialect=dialects.MESSAGES), MESSAGES_STREAM, size)
    assert usage is not None
    # Anthropic counts cache reads and writes apart from input_tokens: the prompt is all three.
    assert usage["prompt_tokens"] == 10 + 3 + 20
    assert usage["completion_tokens"] == 9  # message_delta's count replaces the start's 1
    assert usage["total_tokens"] == 42
    assert usage["cache_read_input_tokens"] == 20 and usage["input_tokens"] == 10


def test_json_answers_of_each_api() -> None:
    chat = {"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    responses = {"object": "response", "usage": {"input_tokens": 5, "output_tokens": 6}}
    messages = {
        "type": "message",
        "usage": {
            "input_tokens": 2,
            "output_tokens": 4,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 1,
        },
    }
    cases = (
        (chat, dialects.CHAT, (3, 2, 5)),
        (responses, dialects.RESPONSES, (5, 6, 11)),
        (messages, dialects.MESSAGES, (3, 4, 7)),
    )
    for answer, dialect, expected in cases:
        usage = feed(UsageTracker(sse=False, dialect=dialect), orjson.dumps(answer), 5)
        assert usage is not None
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
            expected
        )


def test_a_chat_stream_is_read_as_before() -> None:
    chunk = {"choices": [{"delta": {"content": "x"}}], "usage": None}
    last = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    body = sse((None, chunk), (None, last)) + b"data: [DONE]\n\n"
    assert feed(UsageTracker(sse=True), body, 3) == last["usage"]


def test_messages_endpoints_are_in_the_table_and_count_tokens_is_never_charged() -> None:
    assert openai_endpoint("/v1/messages") is MESSAGES
    assert openai_endpoint("/anthropic/v1/messages") is MESSAGES
    assert openai_endpoint("/v1/messages/count_tokens") is MESSAGES_COUNT_TOKENS
    # The Assistants API creates thread messages: not Anthropic's, and never retried.
    assert openai_endpoint("/v1/threads/t_1/messages") is None
    assert MESSAGES.usage and not MESSAGES_COUNT_TOKENS.usage
    assert UsageTracker.for_response("/v1/messages", "text/event-stream", 200) is not None
    assert UsageTracker.for_response("/v1/messages/count_tokens", "application/json", 200) is None


def test_the_system_prompt_of_a_messages_request_is_estimated() -> None:
    body = {"system": "x" * 400, "messages": [{"role": "user", "content": "hi"}]}
    assert estimate_prompt_tokens(body) >= 100


def test_the_api_key_is_read_from_x_api_key_when_there_is_no_authorization() -> None:
    assert api_key({"x-api-key": "sk-ant"}, "Authorization") == "sk-ant"
    assert api_key({"Authorization": "Bearer a", "x-api-key": "b"}, "Authorization") == "Bearer a"
    assert api_key({"x-api-key": "sk-ant"}, "X-Tenant-Key") is None
    assert api_key({"x-api-key": "sk-ant"}, "") is None


# -- end to end: the official SDKs through the proxy, the fake region's usage ------------


async def test_token_counters_equal_the_regions_usage_for_every_api(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    import anthropic
    import openai

    region = await make_region("r1", tokens=6)
    proxy = await make_proxy([region])
    oa = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0)
    an = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0)
    want = {"prompt": 0, "completion": 0}

    def add(prompt: int, completion: int) -> None:
        want["prompt"] += prompt
        want["completion"] += completion

    messages: Any = [{"role": "user", "content": "count my tokens please"}]
    try:
        chat = await oa.chat.completions.create(model="fake-llm", messages=messages)
        assert chat.usage is not None
        add(chat.usage.prompt_tokens, chat.usage.completion_tokens)
        chunks = await oa.chat.completions.create(
            model="fake-llm",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in chunks:
            if chunk.usage is not None:
                add(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        done = await oa.completions.create(model="fake-llm", prompt="count my tokens")
        assert done.usage is not None
        add(done.usage.prompt_tokens, done.usage.completion_tokens)
        response = await oa.responses.create(model="fake-llm", input="count my tokens")
        assert response.usage is not None
        add(response.usage.input_tokens, response.usage.output_tokens)
        async with oa.responses.stream(model="fake-llm", input="count them again") as events:
            final = await events.get_final_response()
        assert final.usage is not None
        add(final.usage.input_tokens, final.usage.output_tokens)
        message = await an.messages.create(model="fake-llm", max_tokens=16, messages=messages)
        usage = message.usage
        add(
            usage.input_tokens
            + (usage.cache_read_input_tokens or 0)
            + (usage.cache_creation_input_tokens or 0),
            usage.output_tokens,
        )
        async with an.messages.stream(
            model="fake-llm", max_tokens=16, messages=[{"role": "user", "content": "again"}]
        ) as stream:
            streamed = await stream.get_final_message()
        usage = streamed.usage
        add(
            usage.input_tokens
            + (usage.cache_read_input_tokens or 0)
            + (usage.cache_creation_input_tokens or 0),
            usage.output_tokens,
        )
        # Counting a Messages request's tokens is passed through and charged nothing.
        counted = await an.messages.count_tokens(model="fake-llm", messages=messages)
        assert counted.input_tokens > 0
    finally:
        await oa.close()
        await an.close()
    assert want["prompt"] > 0 and want["completion"] > 0

    async def counted() -> tuple[float, float]:
        m = await scrape(proxy)
        return (
            m.value("edgeproxy_tokens_total", kind="prompt"),
            m.value("edgeproxy_tokens_total", kind="completion"),
        )

    for _ in range(100):
        if await counted() == (want["prompt"], want["completion"]):
            break
        await asyncio.sleep(0.05)
    assert await counted() == (want["prompt"], want["completion"])


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_tokens_per_minute_limit_holds_on_responses_and_messages(
    make_region: RegionFactory, make_proxy: ProxyFactory, api: str
) -> None:
    import anthropic
    import openai

    region = await make_region("r1", tokens=40)
    # 60 tokens a minute: each answer of 40 tokens is settled against the key's bucket.
    proxy = await make_proxy([region], admission={"key_tokens_per_minute": 60})
    oa = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-one", max_retries=0)
    an = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-ant-one", max_retries=0)

    async def once() -> None:
        if api == "responses":
            await oa.responses.create(model="fake-llm", input="hi")
        else:
            await an.messages.create(
                model="fake-llm", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
            )

    limited = openai.RateLimitError if api == "responses" else anthropic.RateLimitError
    try:
        refused = False
        for _ in range(5):
            try:
                await once()
            except limited:
                refused = True
                break
            await settled(proxy)
        assert refused, "the answers' tokens were never charged"
    finally:
        await oa.close()
        await an.close()


def test_a_chat_stream_with_no_usage_is_counted_by_estimate() -> None:
    """llama-cpp-python's server never sends usage in a stream: a token per content event,
    the prompt estimated, and the count marked as an estimate."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there, how are you"}]}
    tracker = UsageTracker.for_response("/v1/chat/completions", "text/event-stream", 200, body)
    assert tracker is not None
    for word in ("one", "two", "three"):
        tracker.feed(b'data: {"choices":[{"delta":{"content":"' + word.encode() + b'"}}]}\n\n')
    tracker.feed(b"data: [DONE]\n\n")
    usage = tracker.result()
    assert usage is not None and usage["estimated"] is True
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] > 0
    # A stream that counts itself is taken at its word.
    counted = UsageTracker.for_response("/v1/chat/completions", "text/event-stream", 200, body)
    assert counted is not None
    counted.feed(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
    last = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n'
    counted.feed(last, events_of(last))
    assert counted.result() == {"prompt_tokens": 5, "completion_tokens": 1}
