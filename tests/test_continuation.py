"""Streams that survive their region: a chat stream broken mid-answer is continued elsewhere.

Real proxy, fake regions that behave like vLLM (``continue_final_message``),
and the official ``openai`` SDK as the client, sync and async: the spliced
stream must read as one uninterrupted answer equal to the unbroken one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from edgeproxy import Config, ConfigError, Exchange, RequestContext, hookimpl
from edgeproxy._observability.access_log import record
from edgeproxy._obtain.continuation import Splice
from edgeproxy._protocol.sse import events_of
from edgeproxy.testing import FakeRegion, answer_text

from .conftest import ProxyFactory, RegionFactory, eventually

CHAT = "/v1/chat/completions"
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a long deterministic story"}
]
TOKENS = 20
EXPECTED = answer_text(MESSAGES, TOKENS)


def route(**keys: Any) -> dict[str, Any]:
    return {"name": "chat", "path": CHAT, "continue_on_break": True, "fallback": [], **keys}


def table(region: FakeRegion, priority: int, **keys: Any) -> dict[str, Any]:
    return {
        "name": region.name,
        "url": region.url,
        "priority": priority,
        "server": "vllm",
        **keys,
    }


async def regions(make_region: RegionFactory, **breaking: Any) -> tuple[FakeRegion, FakeRegion]:
    """A region breaking its streams after 3 tokens, and a sound one to continue them."""
    broken = await make_region(
        "broken",
        tokens=TOKENS,
        fault="reset",
        fault_after_tokens=3,
        fault_paths=[CHAT],
        **breaking,
    )
    sound = await make_region("sound", tokens=TOKENS)
    return broken, sound


def sdk(url: str) -> tuple[openai.OpenAI, openai.AsyncOpenAI]:
    base, key = url + "/v1", "sk-test"
    return (
        openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=20.0),
        openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=20.0),
    )


def content(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def roles(chunks: list[Any]) -> list[str | None]:
    return [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]


async def raw_stream(url: str, body: dict[str, Any]) -> bytes:
    """The body as the client received it; a cut one (no final chunk) up to the cut."""
    received = b""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, json=body) as resp:
            assert resp.status == 200
            try:
                async for chunk in resp.content.iter_any():
                    received += chunk
            except aiohttp.ClientPayloadError:
                pass
    return received


@pytest.mark.parametrize("overlap", [0, 2])
async def test_a_stream_broken_after_3_of_20_tokens_reads_as_one_answer(
    make_region: RegionFactory, make_proxy: ProxyFactory, overlap: int
) -> None:
    broken, sound = await regions(make_region)
    sound.behavior.continuation_overlap = overlap
    proxy = await make_proxy([table(broken, 0), table(sound, 1)], routes=[route()])
    sync, aio = sdk(proxy.url)
    async with aio:
        stream = await aio.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    assert content(chunks) == EXPECTED
    assert roles(chunks) == ["assistant"]
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert {c.model for c in chunks} == {chunks[0].model}
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == TOKENS + overlap
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    def sync_stream() -> list[Any]:
        with sync:
            return list(sync.chat.completions.create(model="m", messages=MESSAGES, stream=True))

    chunks = await asyncio.to_thread(sync_stream)
    assert content(chunks) == EXPECTED and roles(chunks) == ["assistant"]

    # On the wire: one [DONE], last, after the mark; the mark is a comment, not content.
    raw = await raw_stream(proxy.url, {"model": "m", "messages": MESSAGES, "stream": True})
    assert raw.count(b"data: [DONE]") == 1 and raw.endswith(b"data: [DONE]\n\n")
    assert b"\n: edgeproxy continued from=broken to=sound\n\n" in raw
    status = proxy.pipeline.continuation.snapshot()
    assert status["continued"] == 3


async def test_the_limit_reached_ends_with_an_error_event_and_no_done(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region)
    # The continuing region breaks too: one continuation allowed, none left for it.
    sound.behavior = sound.behavior.copy(fault="reset", fault_after_tokens=2, fault_paths=(CHAT,))
    proxy = await make_proxy([table(broken, 0), table(sound, 1)], routes=[route()])
    raw = await raw_stream(proxy.url, {"model": "m", "messages": MESSAGES, "stream": True})
    assert b"event: error" in raw and b"[DONE]" not in raw
    assert b"upstream_stream_broken" in raw
    assert proxy.pipeline.continuation.snapshot() == {"continued": 1, "limit": 1}


async def test_two_continuations_when_the_route_allows_them(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, middle = await regions(make_region)
    middle.behavior = middle.behavior.copy(fault="reset", fault_after_tokens=4, fault_paths=(CHAT,))
    last = await make_region("last", tokens=TOKENS)
    proxy = await make_proxy(
        [table(broken, 0), table(middle, 1), table(last, 2)], routes=[route(max_continuations=2)]
    )
    _, aio = sdk(proxy.url)
    async with aio:
        stream = await aio.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        chunks = [chunk async for chunk in stream]
    assert content(chunks) == EXPECTED and roles(chunks) == ["assistant"]


async def test_continuation_off_is_todays_error(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region)
    proxy = await make_proxy(
        [table(broken, 0), table(sound, 1)], routes=[route(continue_on_break=False)]
    )
    raw = await raw_stream(proxy.url, {"model": "m", "messages": MESSAGES, "stream": True})
    assert b"event: error" in raw and b"[DONE]" not in raw
    assert sound.requests_by_path.get(CHAT, 0) == 0
    _, aio = sdk(proxy.url)
    async with aio:
        with pytest.raises(openai.APIError):
            stream = await aio.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            async for _ in stream:
                pass


async def test_regions_that_cannot_continue_are_skipped(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region)
    proxy = await make_proxy([table(broken, 0), table(sound, 1, server="openai")], routes=[route()])
    raw = await raw_stream(proxy.url, {"model": "m", "messages": MESSAGES, "stream": True})
    assert b"event: error" in raw and b"[DONE]" not in raw
    assert sound.requests_by_path.get(CHAT, 0) == 0


async def test_reissue_for_a_deterministic_request(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region)
    proxy = await make_proxy(
        [table(broken, 0), table(sound, 1, server="openai", continuation="reissue")],
        routes=[route()],
    )
    _, aio = sdk(proxy.url)
    async with aio:
        stream = await aio.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, temperature=0
        )
        chunks = [chunk async for chunk in stream]
    assert content(chunks) == EXPECTED and roles(chunks) == ["assistant"]
    # Not deterministic: a reissue would be another answer, so it is not continued.
    raw = await raw_stream(proxy.url, {"model": "m", "messages": MESSAGES, "stream": True})
    assert b"event: error" in raw and b"[DONE]" not in raw


async def test_a_client_leaving_during_a_continuation_cancels_both_legs(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region)
    # The continuation is slow, so the client leaves while it streams.
    sound.behavior.inter_token_delay = 0.5
    proxy = await make_proxy([table(broken, 0), table(sound, 1)], routes=[route()])
    _, aio = sdk(proxy.url)
    async with aio:
        stream = await aio.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        seen = ""
        async for chunk in stream:
            seen += content([chunk])
            if len(seen) > len(answer_text(MESSAGES, 4)):
                break  # past the seam: the second leg is streaming
        await stream.close()
    await eventually(lambda: sound.in_flight == 0 and broken.in_flight == 0)
    await eventually(lambda: proxy.pipeline.in_flight == 0)
    assert sound.requests_by_path[CHAT] == 1
    assert sound.cancelled_total >= 1


def test_continue_final_message_on_an_openai_region_is_refused_naming_the_key() -> None:
    data = {
        "regions": [
            {"name": "a", "url": "http://127.0.0.1:1"},
            {
                "name": "b",
                "url": "http://127.0.0.1:2",
                "server": "openai",
                "continuation": "continue_final_message",
            },
        ]
    }
    with pytest.raises(ConfigError) as caught:
        Config.from_mapping(data, environ={})
    assert "regions[1].continuation" in str(caught.value)
    data["regions"][1]["continuation"] = "reissue"
    assert Config.from_mapping(data, environ={}).regions[1].continuation_method == "reissue"


class Finished:
    """Keeps the access-log record of each finished request."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    @hookimpl
    def edgeproxy_response_complete(self, request: Exchange, ctx: RequestContext) -> None:
        self.records.append(record(request, ctx))


async def test_a_continuation_is_counted_in_the_metrics_and_the_access_log(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region)
    finished = Finished()
    proxy = await make_proxy(
        [table(broken, 0), table(sound, 1)], routes=[route()], plugins=[finished]
    )
    await raw_stream(proxy.url, {"model": "m", "messages": MESSAGES, "stream": True})
    entry = finished.records[-1]
    assert entry["continued"] == 1
    assert (entry["continued_from"], entry["continued_to"]) == ("broken", "sound")
    assert entry["region"] == "sound" and entry["status"] == 200
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.admin_url + "/metrics") as resp:
            text = await resp.text()
    assert (
        'edgeproxy_continuations_total{from_region="broken",outcome="continued",'
        'route="chat",to_region="sound"} 1.0' in text
    )
    # An answer that was not continued has no such fields.
    broken.behavior.fault = None
    await raw_stream(proxy.url, {"model": "m", "messages": MESSAGES, "stream": True})
    assert "continued" not in finished.records[-1]


def _event(
    content: str | None = None, *, role: bool = False, finish: str | None = None, leg: int = 0
) -> bytes:
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    chunk = {
        "id": f"chatcmpl-leg{leg}",
        "object": "chat.completion.chunk",
        "created": 7 + leg,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _texts(raw: bytes) -> str:
    out = ""
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            out += orjson.loads(event[6:])["choices"][0]["delta"].get("content", "")
    return out


@pytest.mark.parametrize(
    ("sent", "continuation", "expected"),
    [
        # A server repeating the end of the partial answer: the repeat is cut.
        ("the quick brown fox", [" brown fox", " jumps"], " jumps"),
        # An answer that says a word twice at the seam keeps both.
        ("we said cedar", [" cedar", " again"], " cedar again"),
        ("one two", [" three"], " three"),
    ],
)
def test_the_seam_trims_a_repeat_but_not_a_word_said_twice(
    sent: str, continuation: list[str], expected: str
) -> None:
    splice = Splice({"messages": [], "stream": True})
    first = splice.feed(events_of(_event("", role=True) + _event(sent)))
    assert _texts(first) == sent
    splice.broke("a")
    splice.start_leg("a", "b", "continue_final_message")
    raw = splice.feed(events_of(_event("", role=True, leg=1)))
    for piece in continuation:
        raw += splice.feed(events_of(_event(piece, leg=1)))
    raw += splice.feed(events_of(_event(finish="stop", leg=1) + b"data: [DONE]\n\n"))
    raw += splice.finish()
    assert _texts(raw) == expected
    assert b'"role"' not in raw and raw.endswith(b"data: [DONE]\n\n")
    # The first leg's id and created throughout.
    assert b'"chatcmpl-leg0"' in raw and b"leg1" not in raw and b'"created":8' not in raw


async def test_the_next_leg_comes_from_the_requests_own_ranking(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # The request is ranked once; the break draws the next region from that same plan
    # (less the region that broke), not from a second ranking.
    broken, sound = await regions(make_region)
    proxy = await make_proxy([table(broken, 0), table(sound, 1)], routes=[route()])
    router = proxy.pipeline.router
    ranked = router.route
    plans: list[Any] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        plan = ranked(*args, **kwargs)
        plans.append(plan)
        return plan

    router.route = counting  # type: ignore[method-assign]
    raw = await raw_stream(proxy.url, {"model": "m", "messages": MESSAGES, "stream": True})
    assert b"\n: edgeproxy continued from=broken to=sound\n\n" in raw
    assert len(plans) == 1
    assert [r.name for r in plans[0].regions] == ["broken", "sound"]
