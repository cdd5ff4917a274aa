"""The hot-answer cache speaks every API: Anthropic Messages and the Responses API are
cached, replayed in their own event formats (streamed or not, whichever form was
stored) and coalesced like chat, with the official SDKs as clients.

What may be cached is each API's to say: a Messages request at temperature 0, a Responses
request that stores nothing and refers to nothing (``store: false``, no
``previous_response_id``, no ``conversation``). Upstream counters, cache headers and
``/status`` say what happened; nothing is timed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from edgeproxy import EdgeProxy, RequestContext, hookimpl
from edgeproxy._cache.entry import Entry, replay_parts
from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects import CHAT, EMBEDDINGS, MESSAGES, RESPONSES, AnswerText
from edgeproxy._protocol.sse import SSEEvent, SSEReader
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory, eventually

MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"
CHAT_PATH = "/v1/chat/completions"
USER = [{"role": "user", "content": "what is cached"}]


def calls(region: FakeRegion, path: str) -> int:
    return region.counters().requests_by_path.get(path, 0)


def cache_status(proxy: EdgeProxy) -> dict[str, Any]:
    status = proxy.status()["cache"]
    assert isinstance(status, dict)
    return status


async def stored(proxy: EdgeProxy, count: int) -> None:
    """Until ``count`` answers are stored and no flight waits on a store."""
    await eventually(
        lambda: (
            cache_status(proxy)["stores"] == count and not proxy.pipeline.cache.coalescer.flights
        )
    )


def read(raw: bytes) -> list[SSEEvent]:
    reader = SSEReader()
    events = reader.feed(raw)
    assert reader.tail == b""
    return events


@pytest.fixture
async def proxy_and_region(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> tuple[EdgeProxy, FakeRegion]:
    region = await make_region("r1", tokens=6)
    proxy = await make_proxy([region], cache={"xfetch_beta": 0.0})
    return proxy, region


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


# -- the Responses API through the openai SDK --------------------------------------------


def openai_client(proxy: EdgeProxy) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-x", max_retries=0)


async def responses_json(sdk: Any, **extra: Any) -> tuple[Any, Any]:
    """(the parsed response, the HTTP headers) of a Responses request that is not streamed."""
    raw = await sdk.responses.with_raw_response.create(
        model="m", input="what is cached", store=False, temperature=0, **extra
    )
    return raw.parse(), raw.headers


async def responses_stream(sdk: Any, **extra: Any) -> tuple[list[Any], Any]:
    """(the parsed events, the HTTP headers) of a streamed Responses request."""
    raw = await sdk.responses.with_raw_response.create(
        model="m", input="what is cached", store=False, temperature=0, stream=True, **extra
    )
    return [event async for event in raw.parse()], raw.headers


def check_responses_events(events: list[Any]) -> Any:
    """The events of one whole response, as the SDK parsed them: numbered from 0, one
    response id and one item id throughout; the response they end with."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}
    (item,) = final.output
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {item.id}
    assert {e.item.id for e in events if hasattr(e, "item")} == {item.id}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and text
    return final


async def test_a_stateless_response_is_cached_and_replayed_as_a_stream(
    proxy_and_region: tuple[EdgeProxy, FakeRegion],
) -> None:
    proxy, region = proxy_and_region
    sdk = openai_client(proxy)
    try:
        first, headers = await responses_json(sdk)
        assert headers["X-Edgeproxy-Cache"] == "MISS"
        await stored(proxy, 1)
        second, headers = await responses_json(sdk)
        assert headers["X-Edgeproxy-Cache"] == "HIT" and headers["X-Edgeproxy-Region"] == "none"
        assert second.model_dump() == first.model_dump()
        # Stored as JSON, asked for as a stream: the Responses API's own events.
        events, headers = await responses_stream(sdk)
        assert headers["X-Edgeproxy-Cache"] == "HIT"
        assert headers["Content-Type"].startswith("text/event-stream")
        final = check_responses_events(events)
        assert final.model_dump() == first.model_dump()  # it ends with the answer stored
        assert events[0].response.status == "in_progress" and not events[0].response.output
    finally:
        await sdk.close()
    assert calls(region, RESPONSES_PATH) == 1


async def test_a_streamed_response_is_replayed_as_recorded_and_as_json(
    proxy_and_region: tuple[EdgeProxy, FakeRegion], client: aiohttp.ClientSession
) -> None:
    proxy, region = proxy_and_region
    sdk = openai_client(proxy)
    try:
        events, headers = await responses_stream(sdk)
        assert headers["X-Edgeproxy-Cache"] == "MISS"
        recorded = check_responses_events(events)
        await stored(proxy, 1)
        events, headers = await responses_stream(sdk)
        assert headers["X-Edgeproxy-Cache"] == "HIT"
        assert check_responses_events(events).model_dump() == recorded.model_dump()
        # Recorded as a stream, asked for as JSON: the response it ended with.
        answer, headers = await responses_json(sdk)
        assert headers["X-Edgeproxy-Cache"] == "HIT"
        assert headers["Content-Type"].startswith("application/json")
        assert answer.model_dump() == recorded.model_dump()
        assert answer.output_text == recorded.output_text
    finally:
        await sdk.close()
    assert calls(region, RESPONSES_PATH) == 1
    # Replayed as recorded, numbered from 0 (the same client: the same scope).
    body = {"model": "m", "input": "what is cached", "store": False, "temperature": 0}
    async with client.post(
        proxy.url + RESPONSES_PATH,
        json={**body, "stream": True},
        headers={"Authorization": "Bearer sk-x"},
    ) as resp:
        assert resp.headers["X-Edgeproxy-Cache"] == "HIT"
        replay = await resp.read()
    numbers = [orjson.loads(e.data)["sequence_number"] for e in read(replay)]
    assert numbers == list(range(len(numbers)))


async def test_a_response_that_stores_or_refers_to_state_is_never_cached(
    proxy_and_region: tuple[EdgeProxy, FakeRegion],
) -> None:
    proxy, region = proxy_and_region
    sdk = openai_client(proxy)
    try:
        for _ in range(2):
            raw = await sdk.responses.with_raw_response.create(
                model="m", input="what is cached", store=True, temperature=0
            )
            assert raw.headers["X-Edgeproxy-Cache"] == "BYPASS"
            assert raw.parse().output_text
        # Not asking is asking to store: the API's default.
        raw = await sdk.responses.with_raw_response.create(
            model="m", input="what is cached", temperature=0
        )
        assert raw.headers["X-Edgeproxy-Cache"] == "BYPASS"
        # A chain refers to what the region stored: its answer is its own.
        first_id = raw.parse().id
        for _ in range(2):
            raw = await sdk.responses.with_raw_response.create(
                model="m", input="and then", store=False, temperature=0,
                previous_response_id=first_id,
            )  # fmt: skip
            assert raw.headers["X-Edgeproxy-Cache"] == "BYPASS"
        # Stateless but sampled: not deterministic.
        for _ in range(2):
            raw = await sdk.responses.with_raw_response.create(
                model="m", input="what is cached", store=False, temperature=0.8
            )
            assert raw.headers["X-Edgeproxy-Cache"] == "BYPASS"
    finally:
        await sdk.close()
    assert calls(region, RESPONSES_PATH) == 7
    reasons = cache_status(proxy)["bypass_reasons"]
    assert reasons == {"stateful": 5, "not_deterministic": 2}
    assert cache_status(proxy)["stores"] == 0


def test_what_each_api_may_cache() -> None:
    body: dict[str, Any] = {"model": "m", "input": "x", "temperature": 0}
    assert not RESPONSES.cacheable(body)  # stored by default
    assert RESPONSES.cacheable({**body, "store": False})
    for state in (
        {"previous_response_id": "resp_1"},
        {"conversation": "conv_1"},
        {"conversation": {"id": "conv_1"}},
        {"background": True},
    ):
        assert not RESPONSES.cacheable({**body, "store": False, **state}), state
    assert not RESPONSES.cacheable({**body, "store": False, "temperature": 1})
    messages = {"model": "m", "max_tokens": 5, "messages": USER}
    assert MESSAGES.cacheable({**messages, "temperature": 0})
    assert not MESSAGES.cacheable(messages)  # Anthropic's default temperature is 1
    assert not MESSAGES.cacheable({**messages, "temperature": 0.5})
    assert not MESSAGES.cacheable({**messages, "seed": 7})  # no seed in Messages
    assert CHAT.cacheable({"seed": 7}) and CHAT.cacheable({"temperature": 0, "store": True})
    assert EMBEDDINGS.cacheable({"input": "x"})


# -- Messages through the anthropic SDK ---------------------------------------------------


def anthropic_client(proxy: EdgeProxy, api_key: str = "sk-ant") -> Any:
    import anthropic

    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key=api_key, max_retries=0)


# The sampling parameters go as extra_body: this SDK's create() no longer names them.
GREEDY = {"temperature": 0}


async def message_json(sdk: Any, **extra: Any) -> tuple[Any, Any]:
    raw = await sdk.messages.with_raw_response.create(
        model="m", max_tokens=16, messages=USER, extra_body=GREEDY, **extra
    )
    return await raw.parse(), raw.headers


async def message_stream(sdk: Any, **extra: Any) -> tuple[list[Any], Any]:
    raw = await sdk.messages.with_raw_response.create(
        model="m", max_tokens=16, messages=USER, extra_body=GREEDY, stream=True, **extra
    )
    return [event async for event in await raw.parse()], raw.headers


def check_message_events(events: list[Any]) -> tuple[str, Any, Any]:
    """The events of one whole message, as the SDK parsed them: (its text, its id, the
    stop reason and the output tokens)."""
    kinds = [e.type for e in events if e.type != "ping"]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.usage.input_tokens > 0
    delta = next(e for e in events if e.type == "message_delta")
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    return text, start.id, (delta.delta.stop_reason, delta.usage.output_tokens)


async def test_a_deterministic_message_is_cached_and_replayed_as_a_stream(
    proxy_and_region: tuple[EdgeProxy, FakeRegion],
) -> None:
    proxy, region = proxy_and_region
    sdk = anthropic_client(proxy)
    try:
        first, headers = await message_json(sdk)
        assert headers["X-Edgeproxy-Cache"] == "MISS"
        await stored(proxy, 1)
        second, headers = await message_json(sdk)
        assert headers["X-Edgeproxy-Cache"] == "HIT" and headers["X-Edgeproxy-Region"] == "none"
        assert second.model_dump() == first.model_dump()
        # Stored as JSON, asked for as a stream: Messages' own events.
        events, headers = await message_stream(sdk)
        assert headers["X-Edgeproxy-Cache"] == "HIT"
        text, message_id, (stop, output) = check_message_events(events)
        assert text == first.content[0].text and message_id == first.id
        assert (stop, output) == (first.stop_reason, first.usage.output_tokens)
        assert events[0].message.usage.input_tokens == first.usage.input_tokens
    finally:
        await sdk.close()
    assert calls(region, MESSAGES_PATH) == 1


async def test_a_streamed_message_is_replayed_as_recorded_and_as_json(
    proxy_and_region: tuple[EdgeProxy, FakeRegion],
) -> None:
    proxy, region = proxy_and_region
    sdk = anthropic_client(proxy)
    try:
        events, headers = await message_stream(sdk, system="answer briefly")
        assert headers["X-Edgeproxy-Cache"] == "MISS"
        recorded = check_message_events(events)
        await stored(proxy, 1)
        events, headers = await message_stream(sdk, system="answer briefly")
        assert headers["X-Edgeproxy-Cache"] == "HIT"
        assert check_message_events(events) == recorded
        # Recorded as a stream, asked for as JSON: the message it amounts to.
        answer, headers = await message_json(sdk, system="answer briefly")
        assert headers["X-Edgeproxy-Cache"] == "HIT"
        text, message_id, (stop, output) = recorded
        assert answer.type == "message" and answer.content[0].text == text
        assert answer.id == message_id
        assert (answer.stop_reason, answer.usage.output_tokens) == (stop, output)
        assert answer.usage.input_tokens == events[0].message.usage.input_tokens
    finally:
        await sdk.close()
    assert calls(region, MESSAGES_PATH) == 1


async def test_a_sampled_message_is_never_cached(
    proxy_and_region: tuple[EdgeProxy, FakeRegion],
) -> None:
    proxy, region = proxy_and_region
    sdk = anthropic_client(proxy)
    try:
        for sampling in ({"temperature": 0.7}, {"temperature": 0.7}, {"top_k": 1}, {}):
            raw = await sdk.messages.with_raw_response.create(
                model="m", max_tokens=16, messages=USER, extra_body=sampling
            )
            assert raw.headers["X-Edgeproxy-Cache"] == "BYPASS"
            assert (await raw.parse()).content[0].text
    finally:
        await sdk.close()
    assert calls(region, MESSAGES_PATH) == 4
    assert cache_status(proxy)["bypass_reasons"] == {"not_deterministic": 4}


async def test_the_system_prompt_and_the_api_key_are_part_of_a_messages_key(
    proxy_and_region: tuple[EdgeProxy, FakeRegion],
) -> None:
    proxy, region = proxy_and_region
    outcomes: list[str] = []
    asked = 0
    asks: list[tuple[str, dict[str, Any]]] = [
        ("sk-ant-a", {}),
        ("sk-ant-a", {"system": "be terse"}),
        ("sk-ant-a", {"system": [{"type": "text", "text": "be terse"}]}),
        ("sk-ant-b", {}),
        ("sk-ant-a", {"system": "be terse"}),
        ("sk-ant-a", {}),
    ]
    for api_key, extra in asks:
        sdk = anthropic_client(proxy, api_key)
        try:
            _, headers = await message_json(sdk, **extra)
        finally:
            await sdk.close()
        outcomes.append(headers["X-Edgeproxy-Cache"])
        asked += headers["X-Edgeproxy-Cache"] == "MISS"
        await stored(proxy, asked)
    assert outcomes == ["MISS", "MISS", "MISS", "MISS", "HIT", "HIT"]
    assert calls(region, MESSAGES_PATH) == 4


async def test_no_two_apis_share_an_entry_whatever_the_key_hook_says(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    class OneKey:
        @hookimpl
        def edgeproxy_cache_key(self, default_key: str) -> str:
            return "everything"

    region = await make_region("r1", tokens=4)
    proxy = await make_proxy([region], cache={"xfetch_beta": 0.0}, plugins=[OneKey()])
    requests = [
        (CHAT_PATH, {"model": "m", "temperature": 0, "messages": USER}),
        (MESSAGES_PATH, {"model": "m", "temperature": 0, "max_tokens": 8, "messages": USER}),
        (RESPONSES_PATH, {"model": "m", "temperature": 0, "store": False, "input": "x"}),
    ]
    keys = set()
    for n, (path, body) in enumerate(requests, start=1):
        async with client.post(proxy.url + path, json=body) as resp:
            assert resp.status == 200 and resp.headers["X-Edgeproxy-Cache"] == "MISS"
            keys.add(resp.headers["X-Edgeproxy-Cache-Key"])
        await stored(proxy, n)
    assert len(keys) == 3
    for path, body in requests:
        async with client.post(proxy.url + path, json=body) as resp:
            assert resp.headers["X-Edgeproxy-Cache"] == "HIT"
            answer = await resp.json()
        assert ("choices" in answer, answer.get("type"), answer.get("object")) == {
            CHAT_PATH: (True, None, "chat.completion"),
            MESSAGES_PATH: (False, "message", None),
            RESPONSES_PATH: (False, None, "response"),
        }[path]


# -- coalescing ------------------------------------------------------------------------------


class HoldLeader:
    """Holds the first upstream request of a key until ``followers`` requests follow it;
    then, with ``fault``, makes the region break the stream it sends."""

    def __init__(self, proxy_box: list[EdgeProxy], region: FakeRegion, followers: int) -> None:
        self.box = proxy_box
        self.region = region
        self.followers = followers
        self.fault: dict[str, Any] | None = None
        self.calls = 0

    @hookimpl
    async def edgeproxy_upstream_request(self, ctx: RequestContext) -> None:
        self.calls += 1
        if self.calls > 1:
            self.region.configure(fault=None)
            return
        flights = self.box[0].pipeline.cache.coalescer.flights
        await eventually(lambda: flights[ctx.cache_key or ""].followers == self.followers)
        if self.fault is not None:
            self.region.configure(**self.fault)


async def coalesced(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], count: int
) -> list[tuple[str, bytes, bool]]:
    """``count`` identical streamed requests at once: (cache outcome, body, whether the
    body ended cleanly) of each."""

    async def one() -> tuple[str, bytes, bool]:
        async with client.post(url, json=body) as resp:
            data = b""
            try:
                async for chunk in resp.content.iter_any():
                    data += chunk
            except aiohttp.ClientPayloadError:
                return resp.headers["X-Edgeproxy-Cache"], data, False
            return resp.headers["X-Edgeproxy-Cache"], data, True

    return list(await asyncio.gather(*(one() for _ in range(count))))


@pytest.mark.parametrize("path", [MESSAGES_PATH, RESPONSES_PATH])
async def test_followers_of_a_stream_get_it_in_its_own_format(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession, path: str
) -> None:
    region = await make_region("r1", tokens=8, inter_token_delay=0.01)
    box: list[EdgeProxy] = []
    hold = HoldLeader(box, region, followers=4)
    box.append(await make_proxy([region], cache={"xfetch_beta": 0.0}, plugins=[hold]))
    body: dict[str, Any] = {"model": "m", "temperature": 0, "stream": True}
    if path == MESSAGES_PATH:
        body |= {"max_tokens": 16, "messages": USER}
    else:
        body |= {"input": "what is cached", "store": False}
    results = await coalesced(client, box[0].url + path, body, 5)
    assert sorted(o for o, _, _ in results) == ["COALESCED"] * 4 + ["MISS"]
    assert all(clean for _, _, clean in results)
    assert len({data for _, data, _ in results}) == 1
    dialect = MESSAGES if path == MESSAGES_PATH else RESPONSES
    events = read(results[0][1])
    assert dialect.is_end(events[-1])
    assert dialect.assemble(events) is not None
    assert calls(region, path) == 1


@pytest.mark.parametrize("path", [MESSAGES_PATH, RESPONSES_PATH])
async def test_followers_of_a_broken_stream_end_with_their_apis_error_event(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession, path: str
) -> None:
    region = await make_region("r1", tokens=12, inter_token_delay=0.01)
    box: list[EdgeProxy] = []
    hold = HoldLeader(box, region, followers=3)
    hold.fault = {"fault": "reset", "fault_after_tokens": 3}
    box.append(
        await make_proxy(
            [region],
            cache={"xfetch_beta": 0.0},
            plugins=[hold],
            routes=[{"name": "all", "path": "/", "retries": 0}],
        )
    )
    body: dict[str, Any] = {"model": "m", "temperature": 0, "stream": True}
    if path == MESSAGES_PATH:
        body |= {"max_tokens": 16, "messages": USER}
    else:
        body |= {"input": "what is cached", "store": False}
    results = await coalesced(client, box[0].url + path, body, 4)
    assert sorted(o for o, _, _ in results) == ["COALESCED"] * 3 + ["MISS"]
    dialect = MESSAGES if path == MESSAGES_PATH else RESPONSES
    for outcome, data, clean in results:
        if outcome == "MISS":
            continue  # the relay's own end of a broken stream (test_anthropic_errors.py...)
        assert not clean
        events = read(data)
        *sent, last = events
        assert sent and not any(dialect.is_end(e) for e in sent)
        assert last.event == "error" and dialect.is_error(last)
        error = ProxyError(
            502, "upstream_error", "the upstream stream broke", code="upstream_stream_broken"
        )
        # The API's own error event; a Responses one numbered after the events sent.
        assert last.raw == dialect.error_event(error, sequence=len(sent))
        if dialect is RESPONSES:
            numbers = [orjson.loads(e.data)["sequence_number"] for e in events]
            assert numbers == list(range(len(events)))
    assert cache_status(box[0])["stores"] == 0


# -- the conversions, without a proxy ----------------------------------------------------


def entry_of(kind: str, body: bytes) -> Entry:
    return Entry.build(
        status=200,
        headers=[("content-type", "text/event-stream" if kind == "sse" else "application/json")],
        body=body,
        kind=kind,
        ttl=60.0,
        swr=0.0,
        sie=0.0,
        delta=0.1,
        region="r1",
        now=1000.0,
    )


MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "m",
    "content": [{"type": "text", "text": "one two three"}],
    "stop_reason": "stop_sequence",
    "stop_sequence": "four",
    "usage": {
        "input_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 3,
    },
}


def test_a_stored_message_streams_and_assembles_back_to_itself() -> None:
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    parts, sse = replay_parts(
        entry_of("json", orjson.dumps(MESSAGE)), wants_sse=True, include_usage=False,
        dialect=MESSAGES,
    ) or ([], False)  # fmt: skip
    assert sse and len(parts) == 2 + 3 + 3  # start, block start; a word each; the end
    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    parsed = [adapter.validate_json(e.data) for e in read(b"".join(parts))]
    assert parsed[-2].delta.stop_reason == "stop_sequence"
    assert parsed[-2].delta.stop_sequence == "four"
    # The stop sequence, the cache reads and the ids survive the round trip.
    again = replay_parts(
        entry_of("sse", b"".join(parts)), wants_sse=False, include_usage=False, dialect=MESSAGES
    )
    assert again is not None and orjson.loads(again[0][0]) == MESSAGE


def test_a_stored_response_streams_numbered_and_ends_with_itself() -> None:
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    text = AnswerText("resp_1", "m", 7, "one two", "stop", {"prompt_tokens": 2,
                      "completion_tokens": 2, "total_tokens": 4})  # fmt: skip
    stored = {**RESPONSES.answer(text), "instructions": "be brief", "temperature": 0.0}
    parts, sse = replay_parts(
        entry_of("json", orjson.dumps(stored)), wants_sse=True, include_usage=False,
        dialect=RESPONSES,
    ) or ([], False)  # fmt: skip
    assert sse
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_json(e.data) for e in read(b"".join(parts))]
    assert [p.sequence_number for p in parsed] == list(range(len(parsed)))
    assert parsed[0].response.instructions == "be brief"  # the stored response's own fields
    item_id = stored["output"][0]["id"]
    assert {p.item_id for p in parsed if hasattr(p, "item_id")} == {item_id}
    assert orjson.loads(read(b"".join(parts))[-1].data)["response"] == stored


def test_an_answer_its_dialect_cannot_stream_is_a_miss_for_a_stream() -> None:
    tool_use = {
        **MESSAGE,
        "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
        "stop_reason": "tool_use",
    }
    entry = entry_of("json", orjson.dumps(tool_use))
    assert replay_parts(entry, wants_sse=True, include_usage=False, dialect=MESSAGES) is None
    # As JSON it is replayed as stored.
    assert replay_parts(entry, wants_sse=False, include_usage=False, dialect=MESSAGES) == (
        [entry.body],
        False,
    )
    reasoning = {
        **RESPONSES.answer(AnswerText("resp_1", "m", 7, "x")),
        "output": [{"type": "reasoning", "id": "rs_1", "summary": []}],
    }
    entry = entry_of("json", orjson.dumps(reasoning))
    assert replay_parts(entry, wants_sse=True, include_usage=False, dialect=RESPONSES) is None
    # A recorded stream that did not end (never stored, but not trusted either) is a miss
    # for JSON.
    cut = b"".join(MESSAGES.written(AnswerText("msg_1", "m", 0, "a b")))
    cut = cut[: cut.index(b"event: message_stop")]
    assert (
        replay_parts(entry_of("sse", cut), wants_sse=False, include_usage=False, dialect=MESSAGES)
        is None
    )
