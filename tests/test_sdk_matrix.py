"""The official SDKs through the proxy, for the Responses API and Anthropic Messages: every
call (``create`` and ``stream``), sync and async, in the ways a stream can go: a chain of
turns, a cut stream (the SDK raises its own API error: not a JSON decoding error, not a
silent end) and heartbeats before a slow first token. The local model's answers and the
continuation of a broken stream have their own files (test_local_dialects.py,
test_continuation_dialects.py), with the same SDK calls."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from .conftest import ProxyFactory, RegionFactory

MODES = ["sync", "async"]
CALLS = ["create", "stream"]
USER = [{"role": "user", "content": "hello there"}]


async def responses_turn(url: str, mode: str, call: str, previous: str | None) -> tuple[str, str]:
    """One Responses turn through the openai SDK: the answer's text and id."""
    import openai

    extra: dict[str, Any] = {"previous_response_id": previous} if previous else {}
    if mode == "async":
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-x", max_retries=0)
        try:
            if call == "create":
                answer = await aclient.responses.create(model="m", input="hello", **extra)
            else:
                async with aclient.responses.stream(model="m", input="hello", **extra) as s:
                    async for _ in s:
                        pass
                    answer = await s.get_final_response()
        finally:
            await aclient.close()
        return answer.output_text, answer.id

    def run() -> tuple[str, str]:
        with openai.OpenAI(base_url=url + "/v1", api_key="sk-x", max_retries=0) as client:
            if call == "create":
                answer = client.responses.create(model="m", input="hello", **extra)
            else:
                with client.responses.stream(model="m", input="hello", **extra) as s:
                    for _ in s:
                        pass
                    answer = s.get_final_response()
            return answer.output_text, answer.id

    return await asyncio.to_thread(run)


async def messages_turn(url: str, mode: str, call: str) -> tuple[str, str]:
    """One Messages turn through the anthropic SDK: the text and the stop reason."""
    import anthropic

    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 16, "messages": USER}

    def text(message: Any) -> tuple[str, str]:
        return "".join(b.text for b in message.content if b.type == "text"), message.stop_reason

    if mode == "async":
        aclient = anthropic.AsyncAnthropic(base_url=url, api_key="sk-ant", max_retries=0)
        try:
            if call == "create":
                return text(await aclient.messages.create(**kwargs))
            async with aclient.messages.stream(**kwargs) as s:
                async for _ in s:
                    pass
                return text(await s.get_final_message())
        finally:
            await aclient.close()

    def run() -> tuple[str, str]:
        with anthropic.Anthropic(base_url=url, api_key="sk-ant", max_retries=0) as client:
            if call == "create":
                return text(client.messages.create(**kwargs))
            with client.messages.stream(**kwargs) as s:
                for _ in s:
                    pass
                return text(s.get_final_message())

    return await asyncio.to_thread(run)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call", CALLS)
async def test_responses_chains_through_the_sdk(
    make_region: RegionFactory, make_proxy: ProxyFactory, mode: str, call: str
) -> None:
    a = await make_region("a", tokens=4)
    b = await make_region("b", tokens=4)
    proxy = await make_proxy([a, b])
    previous: str | None = None
    for _ in range(3):
        text, previous = await responses_turn(proxy.url, mode, call, previous)
        assert text
    # Each follow-up went where its previous response was stored: no turn failed.
    assert a.requests_total + b.requests_total == 3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call", CALLS)
async def test_messages_through_the_sdk(
    make_region: RegionFactory, make_proxy: ProxyFactory, mode: str, call: str
) -> None:
    region = await make_region("r", tokens=5)
    proxy = await make_proxy([region])
    text, stop = await messages_turn(proxy.url, mode, call)
    assert text and stop == "end_turn"


@pytest.mark.parametrize("mode", MODES)
async def test_a_cut_responses_stream_raises_the_sdks_api_error(
    make_region: RegionFactory, make_proxy: ProxyFactory, mode: str
) -> None:
    import openai

    region = await make_region("r", tokens=12, fault="reset", fault_after_tokens=3)
    proxy = await make_proxy([region])
    with pytest.raises(openai.APIError) as caught:
        await responses_turn(proxy.url, mode, "stream", None)
    # The SDK's own error for an error event, not a decoding error or a connection error.
    assert type(caught.value) is openai.APIError
    assert "broke the stream" in caught.value.message


@pytest.mark.parametrize("mode", MODES)
async def test_a_cut_messages_stream_raises_the_sdks_api_error(
    make_region: RegionFactory, make_proxy: ProxyFactory, mode: str
) -> None:
    import anthropic

    region = await make_region("r", tokens=12, fault="reset", fault_after_tokens=3)
    proxy = await make_proxy([region])
    with pytest.raises(anthropic.APIStatusError) as caught:
        await messages_turn(proxy.url, mode, "stream")
    body = caught.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "api_error"


@pytest.mark.parametrize("mode", MODES)
async def test_heartbeats_before_a_slow_first_token_reach_both_sdks(
    make_region: RegionFactory, make_proxy: ProxyFactory, mode: str
) -> None:
    region = await make_region("slow", ttft=0.3, tokens=4)
    routes = [
        {"name": "responses", "path": "/v1/responses", "sse_heartbeat": 0.02},
        {"name": "messages", "path": "/v1/messages", "sse_heartbeat": 0.02},
    ]
    proxy = await make_proxy([region], routes=routes)
    text, _ = await responses_turn(proxy.url, mode, "stream", None)
    assert text
    text, stop = await messages_turn(proxy.url, mode, "stream")
    assert text and stop == "end_turn"
