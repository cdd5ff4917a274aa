"""Every client API on real llama.cpp regions: llama-cpp-python's OpenAI server speaks chat
completions only, and the proxy translates the Anthropic SDK's Messages requests (streamed,
whole, token counts) and the openai SDK's stateless Responses requests for it, learning
on first use that it lacks them; with one of two servers killed, each API fails over to
the other; usage is counted for each.

The servers run the tiny generated GGUF model (``llama_servers`` in ``conftest.py``): their
answers are random words, so the tests read the shape of each answer, not its text.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from edgeproxy import EdgeProxy

from .conftest import LlamaServers, ProxyFactory, needs_llama_server
from .test_metrics import scrape

pytestmark = needs_llama_server

# llama-cpp-python's server answers any model name with its model, and the proxy sends it
# the names no region lists: the clients' usual name works as it is.
MODEL = "gpt-4o-mini"
USER: Any = [{"role": "user", "content": "Say hello."}]
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence"}


def regions(*urls: str) -> list[dict[str, Any]]:
    # The first is the nearer: it is tried first while it answers.
    places = [(1.35, 103.82), (50.0, 8.0)]
    return [
        {"name": f"llama{i}", "url": url, "lat": lat, "lon": lon}
        for i, (url, (lat, lon)) in enumerate(zip(urls, places, strict=False))
    ]


UPSTREAM = {"read_timeout": 60.0}
"""``http2`` left unset: its default ("auto") finds that these uvicorn servers speak
HTTP/1.1 only."""


async def start_proxy(make_proxy: ProxyFactory, urls: list[str]) -> EdgeProxy:
    return await make_proxy(regions(*urls), upstream=UPSTREAM)


def clients(proxy: EdgeProxy) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    return (
        openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0),
        anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0),
    )


async def chat(oa: openai.AsyncOpenAI, _: anthropic.AsyncAnthropic) -> str | None:
    done = await oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=USER, max_tokens=8
    )
    answer = done.parse()  # the openai SDK parses a raw response at once
    assert answer.choices[0].finish_reason in ("stop", "length")
    return done.headers.get("x-edgeproxy-region")


async def chat_stream(oa: openai.AsyncOpenAI, _: anthropic.AsyncAnthropic) -> str | None:
    raw = await oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=USER, max_tokens=8, stream=True
    )
    finish = None
    async for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish in ("stop", "length")
    return raw.headers.get("x-edgeproxy-region")


async def responses(oa: openai.AsyncOpenAI, _: anthropic.AsyncAnthropic) -> str | None:
    raw = await oa.responses.with_raw_response.create(
        model=MODEL, input="Say hello.", max_output_tokens=16, store=False
    )
    response = raw.parse()
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output[0].type == "message"
    assert response.usage is not None and response.usage.input_tokens > 0
    return raw.headers.get("x-edgeproxy-region")


async def responses_stream(oa: openai.AsyncOpenAI, _: anthropic.AsyncAnthropic) -> str | None:
    raw = await oa.responses.with_raw_response.create(
        model=MODEL, input="Say hello.", max_output_tokens=16, store=False, stream=True
    )
    kinds = []
    async for event in raw.parse():
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            assert event.response.usage is not None
            assert event.response.usage.output_tokens > 0
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    return raw.headers.get("x-edgeproxy-region")


async def messages(_: openai.AsyncOpenAI, an: anthropic.AsyncAnthropic) -> str | None:
    raw = await an.messages.with_raw_response.create(model=MODEL, max_tokens=8, messages=USER)
    message = await raw.parse()
    assert message.type == "message" and message.stop_reason in STOP_REASONS
    assert message.content[0].type == "text"
    assert message.usage.input_tokens > 0
    return raw.headers.get("x-edgeproxy-region")


async def messages_stream(_: openai.AsyncOpenAI, an: anthropic.AsyncAnthropic) -> str | None:
    async with an.messages.stream(model=MODEL, max_tokens=8, messages=USER) as stream:
        final = await stream.get_final_message()
        region = stream.response.headers.get("x-edgeproxy-region")
    assert final.stop_reason in STOP_REASONS
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0
    return region


async def count_tokens(_: openai.AsyncOpenAI, an: anthropic.AsyncAnthropic) -> str | None:
    raw = await an.messages.with_raw_response.count_tokens(model=MODEL, messages=USER)
    counted = await raw.parse()
    assert counted.input_tokens > 0
    return raw.headers.get("x-edgeproxy-region")


Ask = Callable[[openai.AsyncOpenAI, anthropic.AsyncAnthropic], Awaitable[str | None]]
ASKS: dict[str, Ask] = {
    "chat": chat,
    "chat stream": chat_stream,
    "responses": responses,
    "responses stream": responses_stream,
    "messages": messages,
    "messages stream": messages_stream,
    "count_tokens": count_tokens,
}


async def tokens(proxy: EdgeProxy) -> tuple[float, float]:
    m = await scrape(proxy)
    return (
        m.value("edgeproxy_tokens_total", kind="prompt"),
        m.value("edgeproxy_tokens_total", kind="completion"),
    )


async def region_apis(proxy: EdgeProxy) -> dict[str, Any]:
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/status") as resp:
            status = await resp.json()
    return {r["name"]: r["apis"] for r in status["regions"]}


async def test_every_client_api_on_llama_cpp_python_servers(
    llama_servers: LlamaServers, make_proxy: ProxyFactory
) -> None:
    urls = list(await asyncio.gather(llama_servers(), llama_servers()))
    proxy = await start_proxy(make_proxy, urls)
    oa, an = clients(proxy)
    counted: dict[str, tuple[float, float]] = {}
    try:
        for name, ask in ASKS.items():
            before = await tokens(proxy)
            assert await ask(oa, an) in ("llama0", "llama1"), name
            for _ in range(100):
                after = await tokens(proxy)
                if after != before:
                    break
                await asyncio.sleep(0.02)
            counted[name] = (after[0] - before[0], after[1] - before[1])
    finally:
        await oa.close()
        await an.close()
    # Usage is counted for every API the region answers with it (llama-cpp-python's chat
    # streams carry none, whatever the request asks); a token count is never charged.
    for name in ("chat", "responses", "responses stream", "messages", "messages stream"):
        prompt, completion = counted[name]
        assert prompt > 0 and completion > 0, (name, counted)
    assert counted["count_tokens"] == (0, 0)
    # Each server learnt from its 404 what it lacks, where it was asked (the ranking shares
    # the requests between the two): every Messages and Responses request was translated.
    apis = await region_apis(proxy)
    translated: set[str] = set().union(*(a["translated_total"] for a in apis.values()))
    assert translated == {"messages", "messages.count_tokens", "responses"}
    for learnt in apis.values():
        assert set(learnt["learnt"].values()) <= {404}
        assert set(learnt["translated_total"]) <= set(learnt["lacking"])


def _kill_server(url: str) -> None:
    """Kill the llama.cpp server this test started at ``url``: the child of this process
    whose command line names its port."""
    port = url.rsplit(":", 1)[1]
    mine = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = stat.rsplit(")", 1)[1].split()[1]
        if (
            parent == mine
            and b"--port" in args
            and args[args.index(b"--port") + 1] == port.encode()
        ):
            os.kill(int(entry.name), signal.SIGKILL)
            return
    raise AssertionError(f"no server of this test at {url}")


@pytest.mark.parametrize("learns", [True, False], ids=["learnt", "configured"])
async def test_each_api_fails_over_when_a_server_is_killed(
    llama_servers: LlamaServers, make_proxy: ProxyFactory, learns: bool
) -> None:
    doomed, alive = await asyncio.gather(llama_servers(), llama_servers())
    # A proxy of its own for each API, each with both servers up and the doomed one its
    # first choice (the nearer): each API's first request after the kill meets it dead.
    proxies = {}
    for name in ASKS:
        tables = regions(doomed, alive)
        if not learns:
            for table in tables:
                table["apis"] = ["chat", "completions", "embeddings"]
        proxies[name] = await make_proxy(tables, upstream=UPSTREAM)
    _kill_server(doomed)
    for name, ask in ASKS.items():
        proxy = proxies[name]
        oa, an = clients(proxy)
        try:
            assert await ask(oa, an) == "llama1", name
        finally:
            await oa.close()
            await an.close()
        dead = proxy.regions.by_name["llama0"]
        assert dead.requests_total == 1 and dead.errors_total == 1, name
