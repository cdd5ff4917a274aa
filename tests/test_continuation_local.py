"""Continuation onto the local model: real llama.cpp on the generated tiny GGUF.

The local model is the last rung of a continuation: it gets the conversation
with the partial answer as the prefix of its own, and its tokens are spliced
into the client's stream like a region's.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from edgeproxy import Config, EdgeProxy
from edgeproxy.testing import answer_text

from .conftest import RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a long deterministic story"}
]

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None,
        reason="llama-cpp-python is not installed (pip install 'edgeproxy[local]')",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None,
        reason="building the test model needs gguf and numpy (pip install 'edgeproxy[testing]')",
    ),
]

ProxyMaker = Callable[..., Awaitable[EdgeProxy]]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from edgeproxy.testing import tiny_llama_gguf

    return tiny_llama_gguf("Q4_0")


@pytest.fixture
async def proxy_with(tiny_model: Path) -> AsyncIterator[ProxyMaker]:
    started: list[EdgeProxy] = []

    async def factory(regions: list[dict[str, Any]], routes: list[dict[str, Any]]) -> EdgeProxy:
        data = proxy_config(
            regions, local_model={"path": str(tiny_model), "n_ctx": 256, "max_tokens": 16}
        )
        data["routes"] = routes
        proxy = EdgeProxy(Config.from_mapping(data, environ={}))
        await proxy.start()
        started.append(proxy)
        local = proxy.pipeline.fallback.local
        await eventually(lambda: local.state not in ("idle", "loading"))
        assert local.ready, local.error
        return proxy

    yield factory
    for proxy in started:
        await proxy.stop(grace=2.0)


async def test_a_broken_stream_is_continued_by_the_local_model(
    make_region: RegionFactory, proxy_with: ProxyMaker
) -> None:
    broken = await make_region(
        "broken", tokens=20, fault="reset", fault_after_tokens=3, fault_paths=[CHAT]
    )
    proxy = await proxy_with(
        [{"name": "broken", "url": broken.url, "server": "vllm"}],
        [{"name": "chat", "path": CHAT, "continue_on_break": True, "fallback": ["local"]}],
    )
    aio = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=60)
    async with aio:
        stream = await aio.chat.completions.create(
            model="m",
            messages=MESSAGES,
            stream=True,
            max_tokens=12,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The region's first 3 tokens, then whatever the tiny model made of them.
    assert text.startswith(answer_text(MESSAGES, 3))
    assert len(text) > len(answer_text(MESSAGES, 3))
    assert [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role] == [
        "assistant"
    ]
    assert len({c.id for c in chunks}) == 1 and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens >= 4
    assert proxy.pipeline.continuation.counts[("chat", "broken", "local", "continued")] == 1
    local = proxy.pipeline.fallback.local
    await eventually(lambda: local.busy == 0)  # the slot comes back once its thread ends


async def test_heartbeats_then_the_local_model(
    make_region: RegionFactory, proxy_with: ProxyMaker
) -> None:
    """A stalled region past the deadline, heartbeats meanwhile: the local model answers in the
    response the heartbeats started."""
    stalled = await make_region("stalled", fault="stall", fault_paths=[CHAT])
    proxy = await proxy_with(
        [{"name": "stalled", "url": stalled.url}],
        [{"name": "chat", "path": CHAT, "sse_heartbeat": 0.02, "deadline": 0.4}],
    )
    body = {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 6}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + CHAT, json=body) as resp:
            assert resp.status == 200
            raw = await resp.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[0] == b": waiting"
    answer = events[events.index(next(e for e in events if e != b": waiting")) :]
    assert b": waiting" not in answer
    assert answer[-1] == b"data: [DONE]"
    first = orjson.loads(answer[0].removeprefix(b"data: "))
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["model"] == proxy.pipeline.fallback.local.model_name
    local = proxy.pipeline.fallback.local
    await eventually(lambda: local.busy == 0)  # the slot comes back once its thread ends
