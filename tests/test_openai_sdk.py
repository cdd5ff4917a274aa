"""The official ``openai`` Python SDK as the proxy's client: sync and async, JSON and streamed.

The SDK is what most applications put in front of an OpenAI-compatible
endpoint, so what it makes of the proxy's answers (its SSE parsing, its
error handling) is the test that matters. The sync client blocks, so it runs
in a worker thread while the proxy and its fake regions serve on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from aiohttp import web

from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me something deterministic"}
]
CHAT = "/v1/chat/completions"


def sdk_clients(url: str) -> tuple[openai.OpenAI, openai.AsyncOpenAI]:
    """Both clients for ``url``, with no retries of their own to hide a failure."""
    base, key = url + "/v1", "sk-test"
    return (
        openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=10.0),
        openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=10.0),
    )


def content_of(chunks: list[openai.types.chat.ChatCompletionChunk]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def unbroken_answer(region: FakeRegion) -> str:
    """The region's own answer, straight from it."""
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "messages": MESSAGES}
        async with session.post(region.url + CHAT, json=body) as response:
            text: str = (await response.json())["choices"][0]["message"]["content"]
            return text


async def test_json_and_streamed_answers_sync_and_async(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1", tokens=12, inter_token_delay=0.001)
    proxy = await make_proxy([region])
    expected = await unbroken_answer(region)
    sync, aio = sdk_clients(proxy.url)

    async with aio:
        completion = await aio.chat.completions.create(model="m", messages=MESSAGES)
        assert completion.choices[0].message.content == expected
        assert completion.choices[0].finish_reason == "stop"
        assert completion.usage is not None and completion.usage.completion_tokens == 12

        stream = await aio.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    assert content_of(chunks) == expected
    assert [c.choices[0].delta.role for c in chunks if c.choices].count("assistant") == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1

    def sync_calls() -> tuple[str | None, str]:
        with sync:
            whole = sync.chat.completions.create(model="m", messages=MESSAGES)
            streamed = sync.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            return whole.choices[0].message.content, content_of(list(streamed))

    whole, pieces = await asyncio.to_thread(sync_calls)
    assert whole == expected and pieces == expected
    assert region.requests_total == 5  # the reference answer and four through the proxy


async def test_a_broken_stream_is_an_error_to_the_sdk_not_a_clean_end(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # With no continuation, the proxy ends a stream that broke after its
    # first tokens with an ``event: error`` in the OpenAI error shape and no
    # [DONE]: the SDK raises instead of handing back a truncated answer.
    region = await make_region("r1", tokens=12, fault="reset", fault_after_tokens=3)
    proxy = await make_proxy([region])
    sync, aio = sdk_clients(proxy.url)
    received: list[str] = []
    async with aio:
        with pytest.raises(openai.APIError):
            stream = await aio.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            async for chunk in stream:
                received.append(chunk.choices[0].delta.content or "")
    assert len(received) == 3

    def sync_stream() -> None:
        with sync:
            for _ in sync.chat.completions.create(model="m", messages=MESSAGES, stream=True):
                pass

    with pytest.raises(openai.APIError):
        await asyncio.to_thread(sync_stream)


# -- SSE comments -----------------------------------------------------------------------------

CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":%s,"finish_reason":%s}]}\n\n'
)
COMMENTED_STREAM = [
    b": waiting\n\n",  # a heartbeat before the first token
    b": waiting\n\n",
    CHUNK % (b'{"role":"assistant","content":"alpha"}', b"null"),
    b": waiting\n\n",  # between events
    CHUNK % (b'{"content":" bravo"}', b"null"),
    b":no space after the colon\n\n",
    CHUNK % (b'{"content":" charlie"}', b"null"),
    b": edgeproxy continued from=r1 to=r2\n",  # a comment line inside an event block
    CHUNK % (b"{}", b'"stop"'),
    b": edgeproxy continued from=r1 to=r2\n\n",  # the continuation mark, before [DONE]
    b"data: [DONE]\n\n",
]


async def commented_answer(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for part in COMMENTED_STREAM:
        await response.write(part)
    await response.write_eof()
    return response


@pytest.fixture
async def commented_region() -> AsyncIterator[str]:
    """A tiny server whose chat stream carries SSE comments; yields its URL."""
    app = web.Application()
    app.router.add_post(CHAT, commented_answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_the_sdk_ignores_sse_comments(
    commented_region: str, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy([{"name": "r1", "url": commented_region, "http2": False}])
    # Straight from the server, and through the proxy, which may relay comments as they are.
    for url in (commented_region, proxy.url):
        sync, aio = sdk_clients(url)
        async with aio:
            stream = await aio.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            chunks = [chunk async for chunk in stream]
        assert content_of(chunks) == "alpha bravo charlie"
        assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, "stop"]

        def sync_stream(client: openai.OpenAI = sync) -> str:
            with client:
                streamed = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
                return content_of(list(streamed))

        assert await asyncio.to_thread(sync_stream) == "alpha bravo charlie"
