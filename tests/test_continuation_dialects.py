"""Streams of the Messages and Responses APIs that survive their region: a stream broken after
some text is continued on another region, each API its own way, and reads as one answer.

Real proxy, fake regions (one that resets its streams after a few text deltas, one sound),
and the official SDKs as the clients, sync and async: the anthropic SDK's
``messages.stream`` (continued by an assistant prefill) and the openai SDK's
``responses.stream`` (continued by reissuing a deterministic request). A Responses stream
that a reissue would not repeat (sampled) or would store twice ends with the error the SDK
raises, as without continuation. The splice's seams are also tested alone, with streams
the dialects' own writers write.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest

from edgeproxy._obtain.continuation import Splice, continuation_body
from edgeproxy._protocol.dialects import MESSAGES, RESPONSES, AnswerText
from edgeproxy._protocol.sse import SSEEvent, SSEReader, events_of
from edgeproxy.testing import FakeRegion, answer_text

from .conftest import ProxyFactory, RegionFactory, eventually

MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"
TOKENS = 20
USER = [{"role": "user", "content": "Tell me a long deterministic story"}]
PROMPT = "Tell me a long deterministic story"
EXPECTED = answer_text(USER, TOKENS)
MODES = ["sync", "async"]


def route(**keys: Any) -> dict[str, Any]:
    return {"name": "llm", "path": "/v1", "continue_on_break": True, "fallback": [], **keys}


def table(region: FakeRegion, priority: int, **keys: Any) -> dict[str, Any]:
    # A generic server: chat is not continued there, the Messages and Responses APIs are.
    return {"name": region.name, "url": region.url, "priority": priority, **keys}


async def regions(
    make_region: RegionFactory, path: str, *, overlap: int = 0
) -> tuple[FakeRegion, FakeRegion]:
    """A region resetting its ``path`` streams after 3 text deltas, and a sound one."""
    broken = await make_region(
        "broken", tokens=TOKENS, fault="reset", fault_after_tokens=3, fault_paths=[path]
    )
    sound = await make_region("sound", tokens=TOKENS, continuation_overlap=overlap)
    return broken, sound


async def raw_events(url: str, path: str, body: dict[str, Any]) -> list[SSEEvent]:
    """The events the client received; a cut stream's up to the cut."""
    reader = SSEReader()
    events: list[SSEEvent] = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as resp:
            assert resp.status == 200
            try:
                async for chunk in resp.content.iter_any():
                    events.extend(reader.feed(chunk))
            except aiohttp.ClientPayloadError:
                pass
    return events


def names(events: list[SSEEvent]) -> list[str | None]:
    return [e.event for e in events if not e.comment]


# -- Messages -------------------------------------------------------------------------------


async def messages_stream(url: str, mode: str) -> tuple[str, Any, list[str]]:
    """One streamed message through the anthropic SDK: the text of its text events, the
    final message and the types of the events it raised."""
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 100, "messages": USER}

    if mode == "async":
        aclient = anthropic.AsyncAnthropic(base_url=url, api_key="sk-ant", max_retries=0)
        try:
            async with aclient.messages.stream(**kwargs) as stream:
                seen = [event async for event in stream]
                final = await stream.get_final_message()
        finally:
            await aclient.close()
    else:

        def run() -> tuple[list[Any], Any]:
            with anthropic.Anthropic(base_url=url, api_key="sk-ant", max_retries=0) as client:
                with client.messages.stream(**kwargs) as stream:
                    return list(stream), stream.get_final_message()

        seen, final = await asyncio.to_thread(run)
    text = "".join(e.text for e in seen if e.type == "text")
    return text, final, [e.type for e in seen]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("overlap", [0, 2])
async def test_a_broken_messages_stream_is_continued_by_a_prefill(
    make_region: RegionFactory, make_proxy: ProxyFactory, mode: str, overlap: int
) -> None:
    broken, sound = await regions(make_region, MESSAGES_PATH, overlap=overlap)
    proxy = await make_proxy([table(broken, 0), table(sound, 1)], routes=[route()])
    text, final, types = await messages_stream(proxy.url, mode)
    # The text as it streamed, and the SDK's final message: the whole answer, once.
    assert text == EXPECTED
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == EXPECTED
    assert final.stop_reason == "end_turn"
    # The output tokens of both legs (a repeated overlap was generated, so counted).
    assert final.usage.output_tokens == TOKENS + overlap
    assert types.count("message_stop") == 1 and types.count("content_block_stop") == 1
    assert types.count("message_start") == 1
    # The sound region was asked for the rest, with the partial answer as a prefill.
    assert sound.requests_by_path[MESSAGES_PATH] == 1
    assert proxy.pipeline.continuation.snapshot() == {"continued": 1}


async def test_a_continued_messages_stream_on_the_wire(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region, MESSAGES_PATH)
    proxy = await make_proxy([table(broken, 0), table(sound, 1)], routes=[route()])
    body = {"model": "m", "max_tokens": 100, "messages": USER, "stream": True}
    events = await raw_events(proxy.url, MESSAGES_PATH, body)
    sent = names(events)
    # One message: one start, one text block, no ping or opening of the second leg, one
    # message_delta and one message_stop, last.
    assert sent.count("message_start") == 1 and sent.count("content_block_start") == 1
    assert sent.count("ping") == 1  # the first leg's
    assert sent.count("message_delta") == 1 and sent[-2:] == ["message_delta", "message_stop"]
    deltas = [orjson.loads(e.data) for e in events if e.event == "content_block_delta"]
    assert {d["index"] for d in deltas} == {0}
    assert "".join(d["delta"]["text"] for d in deltas) == EXPECTED
    assert any(e.comment and b"continued from=broken to=sound" in e.raw for e in events)
    [final] = [orjson.loads(e.data) for e in events if e.event == "message_delta"]
    assert final["usage"] == {"output_tokens": TOKENS}


async def test_a_region_set_off_does_not_continue_messages(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region, MESSAGES_PATH)
    proxy = await make_proxy(
        [table(broken, 0), table(sound, 1, continuation="off")], routes=[route()]
    )
    with pytest.raises(anthropic.APIStatusError) as caught:
        await messages_stream(proxy.url, "async")
    body = caught.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "api_error"
    assert sound.requests_by_path.get(MESSAGES_PATH, 0) == 0


async def test_a_raced_messages_continuation_is_won_by_the_region_that_brings_text(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region, MESSAGES_PATH)
    # Ranked before the sound region, it takes the request and never answers.
    stalled = await make_region("stalled", fault="stall", fault_paths=[MESSAGES_PATH])
    proxy = await make_proxy(
        [table(broken, 0), table(stalled, 1), table(sound, 2)],
        routes=[route(race_continuations=True, deadline=60.0)],
    )
    text, final, types = await messages_stream(proxy.url, "async")
    assert text == EXPECTED and final.content[0].text == EXPECTED
    assert types.count("message_stop") == 1
    assert stalled.requests_by_path[MESSAGES_PATH] == 1
    await eventually(lambda: stalled.in_flight == 0)


# -- Responses ------------------------------------------------------------------------------


async def responses_stream(url: str, mode: str, **extra: Any) -> tuple[list[Any], Any]:
    """One streamed response through the openai SDK: its events and the final response."""
    kwargs: dict[str, Any] = {"model": "m", "input": PROMPT, **extra}
    if mode == "async":
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-x", max_retries=0)
        try:
            async with aclient.responses.stream(**kwargs) as stream:
                seen = [event async for event in stream]
                return seen, await stream.get_final_response()
        finally:
            await aclient.close()

    def run() -> tuple[list[Any], Any]:
        with openai.OpenAI(base_url=url + "/v1", api_key="sk-x", max_retries=0) as client:
            with client.responses.stream(**kwargs) as stream:
                return list(stream), stream.get_final_response()

    return await asyncio.to_thread(run)


DETERMINISTIC: dict[str, Any] = {"temperature": 0, "store": False}


@pytest.mark.parametrize("mode", MODES)
async def test_a_deterministic_responses_stream_is_continued_by_a_reissue(
    make_region: RegionFactory, make_proxy: ProxyFactory, mode: str
) -> None:
    broken, sound = await regions(make_region, RESPONSES_PATH)
    proxy = await make_proxy([table(broken, 0), table(sound, 1)], routes=[route()])
    seen, final = await responses_stream(proxy.url, mode, **DETERMINISTIC)
    assert final.output_text == EXPECTED
    types = [e.type for e in seen]
    assert types.count("response.created") == 1 and types.count("response.completed") == 1
    assert types[-1] == "response.completed"
    numbers = [e.sequence_number for e in seen]
    assert numbers == sorted(set(numbers))  # increasing, none twice
    # One response id and one item id throughout.
    created = next(e for e in seen if e.type == "response.created")
    assert final.id == created.response.id
    assert {e.item_id for e in seen if e.type == "response.output_text.delta"} == {
        final.output[0].id
    }
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == EXPECTED
    assert sound.requests_by_path[RESPONSES_PATH] == 1


async def test_a_continued_responses_stream_on_the_wire(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region, RESPONSES_PATH)
    proxy = await make_proxy([table(broken, 0), table(sound, 1)], routes=[route()])
    body = {"model": "m", "input": PROMPT, "stream": True, **DETERMINISTIC}
    events = [e for e in await raw_events(proxy.url, RESPONSES_PATH, body) if not e.comment]
    data = [orjson.loads(e.data) for e in events]
    # The client's numbers run on without a gap, across the seam.
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    sent = names(events)
    for once in (
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ):
        assert sent.count(once) == 1, once
    response_id = data[0]["response"]["id"]
    item_id = data[sent.index("response.output_item.added")]["item"]["id"]
    done = data[-1]["response"]
    assert done["id"] == response_id and done["output"][0]["id"] == item_id
    assert done["output"][0]["content"][0]["text"] == EXPECTED
    assert data[sent.index("response.output_text.done")]["text"] == EXPECTED
    assert {d["item_id"] for d in data if "item_id" in d} == {item_id}
    # The legs' usage summed: the reissue's whole answer and the broken leg's 3 deltas.
    assert done["usage"]["output_tokens"] == TOKENS + 3
    assert done["usage"]["total_tokens"] == (
        done["usage"]["input_tokens"] + done["usage"]["output_tokens"]
    )


async def test_a_responses_stream_past_its_continuations_ends_numbered_in_sequence(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region, RESPONSES_PATH)
    # The continuing region breaks too, later: one continuation allowed, none left for it.
    sound.behavior = sound.behavior.copy(
        fault="reset", fault_after_tokens=6, fault_paths=(RESPONSES_PATH,)
    )
    proxy = await make_proxy([table(broken, 0), table(sound, 1)], routes=[route()])
    body = {"model": "m", "input": PROMPT, "stream": True, **DETERMINISTIC}
    events = [e for e in await raw_events(proxy.url, RESPONSES_PATH, body) if not e.comment]
    data = [orjson.loads(e.data) for e in events]
    assert events[-1].event == "error" and data[-1]["code"] == "upstream_stream_broken"
    # The error event takes the next number of the client's stream.
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    deltas = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    assert deltas == answer_text(USER, 6)  # the reissue's first 3 tokens skipped, 3 new
    assert proxy.pipeline.continuation.snapshot() == {"continued": 1, "limit": 1}


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"store": False}, id="sampled"),
        pytest.param({"temperature": 0}, id="stored"),
    ],
)
async def test_a_responses_stream_a_reissue_would_not_repeat_ends_in_the_sdks_error(
    make_region: RegionFactory, make_proxy: ProxyFactory, extra: dict[str, Any]
) -> None:
    broken, sound = await regions(make_region, RESPONSES_PATH)
    proxy = await make_proxy([table(broken, 0), table(sound, 1)], routes=[route()])
    for mode in MODES:
        with pytest.raises(openai.APIError) as caught:
            await responses_stream(proxy.url, mode, **extra)
        assert type(caught.value) is openai.APIError
        assert "broke the stream" in caught.value.message
    assert sound.requests_by_path.get(RESPONSES_PATH, 0) == 0
    assert proxy.pipeline.continuation.snapshot() == {}


# -- the seams alone ------------------------------------------------------------------------


def _answer(text: str = "") -> AnswerText:
    return AnswerText("id-leg", "m", 7, text, "stop", {"prompt_tokens": 5, "completion_tokens": 3})


def _said(raw: bytes, event: str, read: Any) -> str:
    """The text the ``event`` events of ``raw`` carry, as ``read`` finds it in each."""
    return "".join(read(orjson.loads(e.data)) for e in SSEReader().feed(raw) if e.event == event)


def _block_text(raw: bytes) -> str:
    return _said(raw, "content_block_delta", lambda d: d["delta"]["text"])


def test_a_messages_prefill_leaves_trailing_whitespace_out_and_the_seam_puts_it_back() -> None:
    body = {"model": "m", "max_tokens": 50, "messages": USER, "stream": True}
    splice = Splice(body, MESSAGES)
    first = MESSAGES.writer(_answer())
    sent = splice.feed(events_of(first.open() + first.piece("Hello there.") + first.piece("\n\n")))
    assert _block_text(sent) == "Hello there.\n\n"
    splice.broke("a")
    # The prefill ends without the blank line, as Anthropic requires; the tokens are spent.
    leg = continuation_body(splice, "prefill")
    assert leg["messages"][-1] == {"role": "assistant", "content": "Hello there."}
    assert leg["max_tokens"] == 48 and body["max_tokens"] == 50
    splice.start_leg("a", "b", "prefill")
    second = MESSAGES.writer(_answer())
    raw = splice.feed(
        events_of(second.open() + second.piece("\n\nGeneral") + second.piece(" Kenobi."))
    )
    raw += splice.feed(
        events_of(second.close("stop", {"prompt_tokens": 9, "completion_tokens": 2}))
    )
    raw += splice.finish()
    # The new leg's blank line was the client's already.
    assert _block_text(raw) == "General Kenobi."
    sent_names = [e.event for e in SSEReader().feed(raw) if not e.comment]
    assert sent_names == [
        *["content_block_delta"] * 2,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_a_messages_stream_broken_after_its_block_stopped_goes_on_in_a_new_block() -> None:
    splice = Splice({"model": "m", "max_tokens": 50, "messages": USER}, MESSAGES)
    first = MESSAGES.writer(_answer())
    stop = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    splice.feed(events_of(first.open() + first.piece("One two three four") + stop))
    splice.broke("a")
    splice.start_leg("a", "b", "prefill")
    second = MESSAGES.writer(_answer())
    raw = splice.feed(events_of(second.open() + second.piece(" five")))
    raw += splice.feed(events_of(second.close("stop", None))) + splice.finish()
    events = [e for e in SSEReader().feed(raw) if not e.comment]
    starts = [orjson.loads(e.data) for e in events if e.event == "content_block_start"]
    assert [s["index"] for s in starts] == [1]
    deltas = [orjson.loads(e.data) for e in events if e.event == "content_block_delta"]
    assert [(d["index"], d["delta"]["text"]) for d in deltas] == [(1, " five")]


def test_a_responses_reissue_after_the_text_was_done_sends_each_closing_event_once() -> None:
    body = {"model": "m", "input": PROMPT, "temperature": 0, "store": False}
    splice = Splice(body, RESPONSES)
    first = RESPONSES.writer(_answer())
    head = first.open() + first.piece("alpha") + first.piece(" bravo")
    closing = first.close("stop", None)
    # The first leg got as far as its text's done events, not its response.completed.
    sent = splice.feed(events_of(head + closing[: closing.index(b"event: response.completed")]))
    assert _said(sent, "response.output_text.done", lambda d: d["text"]) == "alpha bravo"
    splice.broke("a")
    assert continuation_body(splice, "reissue") == body
    splice.start_leg("a", "b", "reissue")
    second = RESPONSES.writer(AnswerText("resp_other", "m", 9, "", "stop", None))
    raw = splice.feed(events_of(second.open() + second.piece("alpha") + second.piece(" bravo")))
    raw += splice.feed(
        events_of(second.close("stop", {"prompt_tokens": 4, "completion_tokens": 2}))
    )
    raw += splice.finish()
    events = [e for e in SSEReader().feed(raw) if not e.comment]
    # The reissue's repeat is skipped, its done events were sent already: only the end.
    assert [e.event for e in events] == ["response.completed"]
    done = orjson.loads(events[0].data)
    assert done["sequence_number"] == 9  # after 4 opening events, 2 deltas, 3 done events
    assert done["response"]["id"] == "id-leg"
    assert done["response"]["output"][0]["id"] == first.item_id
    assert done["response"]["output"][0]["content"][0]["text"] == "alpha bravo"
    assert splice.sequence == 10
