"""The fake region reports its prefix-cache hits in each API's usage, as the servers do:
chat and completions' ``prompt_tokens_details.cached_tokens``, the Responses API's
``input_tokens_details.cached_tokens``, Anthropic's ``cache_read_input_tokens`` and
``cache_creation_input_tokens``; read through the official SDKs, and by the proxy."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from edgeproxy.testing import FakeRegion
from tests.conftest import ProxyFactory

# Words of at most four letters are one token each to the fake's KV model, as to the
# chat usage's word count: the two counts agree, and the usage shows the KV hit as it is.
LONG = " ".join(f"w{i}" for i in range(100))
BLOCK = 16


@pytest.fixture
async def region() -> AsyncIterator[FakeRegion]:
    async with FakeRegion(name="kv", kv_capacity_blocks=512, kv_block_size=BLOCK) as region:
        yield region


@pytest.fixture
async def oai(region: FakeRegion) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=region.url + "/v1", api_key="x", max_retries=0
    ) as client:
        yield client


@pytest.fixture
async def claude(region: FakeRegion) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=region.url, api_key="x", max_retries=0) as client:
        yield client


def chat_messages(question: str = "why") -> list[Any]:
    return [{"role": "system", "content": LONG}, {"role": "user", "content": question}]


async def test_chat_json_reports_the_kv_hit(region: FakeRegion, oai: openai.AsyncOpenAI) -> None:
    first = await oai.chat.completions.create(model="m", messages=chat_messages())
    raw = await oai.chat.completions.with_raw_response.create(model="m", messages=chat_messages())
    second = raw.parse()
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # vLLM recomputes the last block: every whole block but that one is read.
    assert details.cached_tokens == (second.usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
    assert details.cached_tokens == int(raw.headers["x-fake-kv-cached-tokens"])
    assert region.counters().cached_tokens_total == details.cached_tokens


async def test_chat_stream_usage_chunk_reports_the_kv_hit(oai: openai.AsyncOpenAI) -> None:
    async def usage() -> Any:
        stream = await oai.chat.completions.create(
            model="m",
            messages=chat_messages(),
            stream=True,
            stream_options={"include_usage": True},
        )
        last = None
        async for chunk in stream:
            last = chunk.usage or last
        return last

    first, second = await usage(), await usage()
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens >= 5 * BLOCK
    assert second.prompt_tokens_details.cached_tokens < second.prompt_tokens


async def test_completions_report_the_kv_hit(oai: openai.AsyncOpenAI) -> None:
    first = await oai.completions.create(model="m", prompt=LONG)
    second = await oai.completions.create(model="m", prompt=LONG)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 96  # 100 tokens: 6 blocks

    stream = await oai.completions.create(
        model="m", prompt=LONG, stream=True, stream_options={"include_usage": True}
    )
    usages = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens_details is not None
    assert usages[0].prompt_tokens_details.cached_tokens == 96


async def test_long_words_keep_the_cached_share_of_the_kv_model() -> None:
    # Ten-letter words are three KV tokens each but one word of the chat usage: the hit is
    # shown in the usage's count, never more than its prompt.
    text = " ".join(f"word{i:06d}" for i in range(60))
    messages = [{"role": "user", "content": text}]
    async with (
        FakeRegion(name="kv", kv_capacity_blocks=512) as region,
        openai.AsyncOpenAI(base_url=region.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        raw = await client.chat.completions.with_raw_response.create(
            model="m",
            messages=messages,  # type: ignore[arg-type]
        )
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    kv_prompt = int(raw.headers["x-fake-kv-prompt-tokens"])
    kv_cached = int(raw.headers["x-fake-kv-cached-tokens"])
    assert kv_prompt > usage.prompt_tokens
    assert cached == kv_cached * usage.prompt_tokens // kv_prompt
    assert 0 < cached < usage.prompt_tokens


async def test_responses_report_the_kv_hit(oai: openai.AsyncOpenAI) -> None:
    first = await oai.responses.create(model="m", input=LONG, store=False)
    second = await oai.responses.create(model="m", input=LONG, store=False)
    assert first.usage is not None and second.usage is not None
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens == 96

    completed = None
    stream = await oai.responses.create(model="m", input=LONG, store=False, stream=True)
    async for event in stream:
        if event.type == "response.completed":
            completed = event.response
    assert completed is not None and completed.usage is not None
    assert completed.usage.input_tokens_details.cached_tokens == 96


def anthropic_body(*, marked: bool, question: str = "why") -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": LONG}
    if marked:
        block["cache_control"] = {"type": "ephemeral"}
    return {
        "model": "claude-fake",
        "max_tokens": 64,
        "system": [block],
        "messages": [{"role": "user", "content": question}],
    }


async def test_messages_report_cache_reads_and_writes(claude: anthropic.AsyncAnthropic) -> None:
    counted = await claude.messages.count_tokens(
        model="claude-fake", system=LONG, messages=[{"role": "user", "content": "why"}]
    )
    whole = counted.input_tokens

    first = (await claude.messages.create(**anthropic_body(marked=True))).usage
    # Nothing read; every whole block of the prompt written.
    assert first.cache_read_input_tokens == 0
    assert first.cache_creation_input_tokens == whole // BLOCK * BLOCK > 0
    assert first.input_tokens == whole - first.cache_creation_input_tokens

    second = (await claude.messages.create(**anthropic_body(marked=True))).usage
    assert second.cache_read_input_tokens == (whole - 1) // BLOCK * BLOCK > 0
    assert second.cache_creation_input_tokens == 0
    assert second.input_tokens == whole - second.cache_read_input_tokens

    # A new question after the breakpoint reads the prefix and writes nothing before it.
    other = (await claude.messages.create(**anthropic_body(marked=True, question="how"))).usage
    assert other.cache_read_input_tokens == second.cache_read_input_tokens
    assert other.cache_creation_input_tokens == 0


async def test_messages_without_breakpoint_write_nothing(claude: anthropic.AsyncAnthropic) -> None:
    first = (await claude.messages.create(**anthropic_body(marked=False))).usage
    second = (await claude.messages.create(**anthropic_body(marked=False))).usage
    assert first.cache_creation_input_tokens == second.cache_creation_input_tokens == 0
    assert first.cache_read_input_tokens == 0
    assert second.cache_read_input_tokens is not None and second.cache_read_input_tokens > 0


async def test_messages_stream_reports_the_cache(claude: anthropic.AsyncAnthropic) -> None:
    async def usage() -> anthropic.types.Usage:
        async with claude.messages.stream(**anthropic_body(marked=True)) as stream:
            return (await stream.get_final_message()).usage

    first, second = await usage(), await usage()
    assert first.cache_read_input_tokens == 0
    assert first.cache_creation_input_tokens is not None and first.cache_creation_input_tokens > 0
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0
    assert first.input_tokens + first.cache_creation_input_tokens == (
        second.input_tokens + second.cache_read_input_tokens
    )


async def test_a_region_without_a_prefix_cache_reports_none() -> None:
    async with (
        FakeRegion(name="plain") as region,
        openai.AsyncOpenAI(base_url=region.url + "/v1", api_key="x", max_retries=0) as oai,
        anthropic.AsyncAnthropic(base_url=region.url, api_key="x", max_retries=0) as claude,
    ):
        for _ in range(2):
            chat = await oai.chat.completions.create(model="m", messages=chat_messages())
            message = await claude.messages.create(**anthropic_body(marked=True))
    assert chat.usage is not None and chat.usage.prompt_tokens_details is None
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.cache_creation_input_tokens == 0


async def test_the_proxy_counts_the_cached_tokens(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy([region])
    read: list[int] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            chat = {"model": "m", "messages": chat_messages()}
            async with session.post(proxy.url + "/v1/chat/completions", json=chat) as r:
                assert r.status == 200
                read.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
            async with session.post(
                proxy.url + "/v1/messages", json=anthropic_body(marked=True)
            ) as r:
                assert r.status == 200
                read.append(json.loads(await r.read())["usage"]["cache_read_input_tokens"])
    # The Messages request's prompt is the chat's: the region holds it from the first one.
    assert read[0] == 0 and all(n > 0 for n in read[1:])
    status = proxy.regions.by_name["kv"].snapshot()
    assert status["prompt_cache"]["cached_tokens_total"] == sum(read)
