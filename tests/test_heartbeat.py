"""Early SSE heartbeats: a streaming request with no first token gets ``: waiting`` comments.

No timing assertions: the intervals are short and the regions slow (or
stalled), and the tests check the order of what arrives and that comments
came at all, never how many or when.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson

from edgeproxy.testing import answer_text

from .conftest import ProxyFactory, RegionFactory

CHAT = "/v1/chat/completions"
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "Take your time"}
]
STREAM = {"model": "m", "messages": MESSAGES, "stream": True}
WAITING = b": waiting\n\n"


def route(**keys: Any) -> dict[str, Any]:
    return {"name": "chat", "path": CHAT, "sse_heartbeat": 0.02, "fallback": [], **keys}


async def raw_stream(url: str, body: dict[str, Any]) -> tuple[int, str, bytes]:
    received = b""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, json=body) as resp:
            try:
                async for chunk in resp.content.iter_any():
                    received += chunk
            except aiohttp.ClientPayloadError:
                pass
            return resp.status, resp.headers.get("content-type", ""), received


def events(raw: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def heartbeats_first(raw: bytes) -> list[bytes]:
    """The events after the leading heartbeats, checking there were some and none later."""
    all_events = events(raw)
    count = next(i for i, e in enumerate(all_events) if e != WAITING)
    assert count >= 1, raw[:200]
    rest = all_events[count:]
    assert WAITING not in rest
    return rest


async def test_heartbeats_then_the_answer(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("slow", ttft=0.5, tokens=6)
    proxy = await make_proxy([region], routes=[route()])
    status, content_type, raw = await raw_stream(proxy.url, STREAM)
    assert status == 200 and content_type.startswith("text/event-stream")
    rest = heartbeats_first(raw)
    assert rest[-1] == b"data: [DONE]\n\n"
    text = "".join(
        orjson.loads(e[6:])["choices"][0]["delta"].get("content", "")
        for e in rest[:-1]
        if orjson.loads(e[6:])["choices"]
    )
    assert text == answer_text(MESSAGES, 6)


async def test_the_sdk_reads_the_answer_behind_the_heartbeats(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("slow", ttft=0.3, tokens=6)
    proxy = await make_proxy([region], routes=[route()])
    base = proxy.url + "/v1"
    aio = openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=0, timeout=20)
    async with aio:
        stream = await aio.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer_text(MESSAGES, 6)

    def sync_stream() -> str:
        with openai.OpenAI(base_url=base, api_key="k", max_retries=0, timeout=20) as sync:
            stream = sync.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream)

    assert await asyncio.to_thread(sync_stream) == answer_text(MESSAGES, 6)


async def test_hedging_still_works_after_heartbeats(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    stalled = await make_region("stalled", fault="stall", fault_paths=[CHAT])
    spare = await make_region("spare", ttft=0.2, tokens=5)
    proxy = await make_proxy(
        [
            {"name": "stalled", "url": stalled.url},
            {"name": "spare", "url": spare.url, "priority": 1},
        ],
        routes=[route(hedge=True, hedge_delay=0.2)],
    )
    status, _, raw = await raw_stream(proxy.url, STREAM)
    assert status == 200
    rest = heartbeats_first(raw)
    assert rest[-1] == b"data: [DONE]\n\n"
    assert spare.requests_by_path[CHAT] == 1


async def test_heartbeats_then_an_error_event(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    stalled = await make_region("stalled", fault="stall", fault_paths=[CHAT])
    proxy = await make_proxy([stalled], routes=[route(deadline=0.4)])
    status, _, raw = await raw_stream(proxy.url, STREAM)
    assert status == 200
    rest = heartbeats_first(raw)
    assert len(rest) == 1 and rest[0].startswith(b"event: error\ndata: ")
    error = orjson.loads(rest[0].split(b"data: ", 1)[1])["error"]
    assert error["code"] == "deadline_exceeded" and error["type"] == "upstream_timeout"
    assert b"[DONE]" not in raw

    aio = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=20)
    async with aio:
        try:
            stream = await aio.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            async for _ in stream:
                pass
        except openai.APIError as exc:
            assert "deadline" in str(exc)
        else:
            raise AssertionError("the SDK took an error event for a clean end")


async def test_a_fast_answer_gets_no_heartbeat_and_its_own_headers(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("fast", tokens=4)
    proxy = await make_proxy([region], routes=[route(sse_heartbeat=30.0)])
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + CHAT, json=STREAM) as resp:
            raw = await resp.read()
            assert resp.headers["X-Edgeproxy-Region"] == "fast"
    assert WAITING not in raw and raw.endswith(b"data: [DONE]\n\n")
    # A JSON request never gets heartbeats, however slow.
    status, content_type, raw = await raw_stream(proxy.url, {**STREAM, "stream": False})
    assert status == 200 and content_type == "application/json"


async def test_a_messages_stream_gets_anthropics_ping_and_the_sdk_reads_through(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    import anthropic

    region = await make_region("slow", ttft=0.3, tokens=6)
    messages_route = {"name": "messages", "path": "/v1/messages", "sse_heartbeat": 0.02}
    proxy = await make_proxy([region], routes=[messages_route])
    body = {
        "model": "m",
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": "Take your time"}],
    }
    received = b""
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/messages", json=body) as resp:
            assert resp.status == 200
            received = await resp.read()
    ping = b'event: ping\ndata: {"type": "ping"}\n\n'
    assert received.startswith(ping) and WAITING not in received
    assert b"event: message_start" in received and received.rstrip().endswith(b'"message_stop"}')
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="k", max_retries=0)
    try:
        async with client.messages.stream(
            model="m", max_tokens=16, messages=[{"role": "user", "content": "Take your time"}]
        ) as stream:
            final = await stream.get_final_message()
    finally:
        await client.close()
    assert final.stop_reason == "end_turn" and final.content
