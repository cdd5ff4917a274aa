"""A request every server of its API would refuse is refused at the edge: a 400 in the API's
own error shape, before any region is asked, and counted against none.

Each API's checks are its dialect's (edgeproxy/_protocol/dialects); these tests send the
requests through a real proxy to a real fake region, and through the official SDKs, which
raise their own ``BadRequestError`` on them.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from edgeproxy import EdgeProxy
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
EMBEDDINGS = "/v1/embeddings"
HI = [{"role": "user", "content": "hi"}]

GOOD: dict[str, dict[str, Any]] = {
    CHAT: {"model": "fake-llm", "messages": HI, "max_tokens": 4},
    COMPLETIONS: {"model": "fake-llm", "prompt": "hi", "max_tokens": 4},
    RESPONSES: {"model": "fake-llm", "input": "hi", "max_output_tokens": 4},
    MESSAGES: {"model": "fake-llm", "messages": HI, "max_tokens": 4},
    EMBEDDINGS: {"model": "fake-llm", "input": "hi"},
}
DROP = object()  # a field left out of the good body

# (path, what changes in its good body, the param named, the code of OpenAI's shape)
BAD = [
    (CHAT, {"temperature": "hot"}, "temperature", "invalid_type"),
    (CHAT, {"messages": []}, "messages", "empty_array"),
    (CHAT, {"model": DROP}, "model", "missing_required_parameter"),
    (CHAT, {"temperature": 2.5}, "temperature", "invalid_value"),
    (CHAT, {"top_p": 1.5}, "top_p", "invalid_value"),
    (CHAT, {"max_tokens": -1}, "max_tokens", "invalid_value"),
    (CHAT, {"n": 0}, "n", "invalid_value"),
    (CHAT, {"messages": "bad"}, "messages", "invalid_type"),
    # A chat request with no conversation: llama.cpp answered it 200, OpenAI refuses it.
    (CHAT, {"messages": DROP}, "messages", "missing_required_parameter"),
    (CHAT, {"messages": ["hi"]}, "messages[0]", "invalid_type"),
    (CHAT, {"messages": [*HI, {"content": "x"}]}, "messages[1].role", "missing_required_parameter"),
    (CHAT, {"messages": [{"role": 1, "content": "x"}]}, "messages[0].role", "invalid_type"),
    (CHAT, {"model": 5}, "model", "invalid_type"),
    (CHAT, {"stream": "yes"}, "stream", "invalid_type"),
    (CHAT, {"top_p": "x"}, "top_p", "invalid_type"),
    (CHAT, {"max_tokens": 2.5}, "max_tokens", "invalid_type"),
    (CHAT, {"max_completion_tokens": "4"}, "max_completion_tokens", "invalid_type"),
    (CHAT, {"n": 1.5}, "n", "invalid_type"),
    (CHAT, {"seed": "1"}, "seed", "invalid_type"),
    (CHAT, {"stop": 5}, "stop", "invalid_type"),
    (CHAT, {"stop": ["a", 1]}, "stop[1]", "invalid_type"),
    (CHAT, {"tools": {"type": "function"}}, "tools", "invalid_type"),
    (CHAT, {"tools": ["f"]}, "tools[0]", "invalid_type"),
    (CHAT, {"tool_choice": 1}, "tool_choice", "invalid_type"),
    (CHAT, {"response_format": "json"}, "response_format", "invalid_type"),
    (CHAT, {"stream_options": True}, "stream_options", "invalid_type"),
    (CHAT, {"user": 5}, "user", "invalid_type"),
    (CHAT, {"logprobs": "yes"}, "logprobs", "invalid_type"),
    (CHAT, {"top_logprobs": "2"}, "top_logprobs", "invalid_type"),
    (CHAT, {"top_logprobs": -1}, "top_logprobs", "invalid_value"),
    (CHAT, {"presence_penalty": "x"}, "presence_penalty", "invalid_type"),
    (CHAT, {"frequency_penalty": [1]}, "frequency_penalty", "invalid_type"),
    (CHAT, {"logit_bias": []}, "logit_bias", "invalid_type"),
    (CHAT, {"parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_type"),
    (COMPLETIONS, {"temperature": "hot"}, "temperature", "invalid_type"),
    (COMPLETIONS, {"prompt": []}, "prompt", "empty_array"),
    (COMPLETIONS, {"model": DROP}, "model", "missing_required_parameter"),
    (COMPLETIONS, {"temperature": -0.5}, "temperature", "invalid_value"),
    (COMPLETIONS, {"max_tokens": -1}, "max_tokens", "invalid_value"),
    (RESPONSES, {"temperature": "hot"}, "temperature", "invalid_type"),
    (RESPONSES, {"input": []}, "input", "empty_array"),
    (RESPONSES, {"input": DROP}, "input", "missing_required_parameter"),
    (RESPONSES, {"model": DROP}, "model", "missing_required_parameter"),
    (RESPONSES, {"temperature": 2.5}, "temperature", "invalid_value"),
    (RESPONSES, {"max_output_tokens": -1}, "max_output_tokens", "invalid_value"),
    (MESSAGES, {"temperature": "hot"}, "temperature", "invalid_type"),
    (MESSAGES, {"messages": []}, "messages", "empty_array"),
    (MESSAGES, {"model": DROP}, "model", "missing_required_parameter"),
    (MESSAGES, {"max_tokens": DROP}, "max_tokens", "missing_required_parameter"),
    (MESSAGES, {"temperature": 1.5}, "temperature", "invalid_value"),
    (MESSAGES, {"max_tokens": -1}, "max_tokens", "invalid_value"),
    (EMBEDDINGS, {"input": 5}, "input", "invalid_type"),
    (EMBEDDINGS, {"input": []}, "input", "empty_array"),
    (EMBEDDINGS, {"model": DROP}, "model", "missing_required_parameter"),
    (EMBEDDINGS, {"dimensions": 0}, "dimensions", "invalid_value"),
]


# A chat request with every typed field given, each well: nothing of it is refused.
FULL_CHAT: dict[str, Any] = {
    "model": "fake-llm",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "ipython", "content": "a role of a chat template's own"},
    ],
    "stream": False,
    "temperature": 0,
    "top_p": 1.0,
    "max_tokens": 4,
    "max_completion_tokens": 4,
    "n": 1,
    "seed": 7,
    "stop": ["\n\n", "END"],
    "user": "u-1",
    "metadata": {"k": "v"},
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "stream_options": None,
    "logprobs": False,
    "top_logprobs": 0,
    "presence_penalty": 0.5,
    "frequency_penalty": -1,
    "logit_bias": {"50256": -100},
    "parallel_tool_calls": True,
    "store": False,
    "reasoning_effort": "low",
}


def bad_body(path: str, change: dict[str, Any]) -> dict[str, Any]:
    body = {**GOOD[path], **change}
    return {key: value for key, value in body.items() if value is not DROP}


def untouched(region: FakeRegion, proxy: EdgeProxy) -> None:
    """The region was never asked, and the proxy holds nothing against it."""
    assert region.requests_total == 0, region.requests_by_path
    (status,) = proxy.status()["regions"]
    assert status["requests_total"] == 0 and status["errors_total"] == 0
    assert status["health"]["failures"]["recent"] == 0


async def test_each_apis_refused_bodies_get_400_in_its_shape_and_no_region_hears_of_them(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region])
    async with aiohttp.ClientSession() as client:
        for path, change, param, code in BAD:
            async with client.post(proxy.url + path, json=bad_body(path, change)) as resp:
                assert resp.status == 400, (path, change)
                assert resp.headers["X-Edgeproxy-Region"] == "none"
                body = await resp.json()
            if path == MESSAGES:
                assert body["type"] == "error" and set(body) == {"type", "error"}
                assert body["error"]["type"] == "invalid_request_error"
                assert param in body["error"]["message"], body
            else:
                error = body["error"]
                assert set(body) == {"error"} and set(error) == {"message", "type", "param", "code"}
                assert (error["type"], error["param"], error["code"]) == (
                    "invalid_request_error",
                    param,
                    code,
                ), (path, change, error)
                assert param in error["message"]
    untouched(region, proxy)
    assert proxy.status()["admission"]["invalid_total"] == len(BAD)
    # What a server may take goes on: the good bodies are answered by the region.
    async with aiohttp.ClientSession() as client:
        for path, body in GOOD.items():
            async with client.post(proxy.url + path, json=body) as resp:
                assert resp.status == 200, (path, await resp.text())
        async with client.post(proxy.url + CHAT, json=FULL_CHAT) as resp:
            assert resp.status == 200, await resp.text()
        async with client.post(proxy.url + CHAT, json={**FULL_CHAT, "stop": "END"}) as resp:
            assert resp.status == 200, await resp.text()
    assert sum(region.requests_by_path.values()) == len(GOOD) + 2


async def test_refused_bodies_are_charged_to_no_rate_limit(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    # One request a key, for a long while: a refused body must not spend it.
    proxy = await make_proxy([region], admission={"key_requests_per_second": 0.001})
    headers = {"Authorization": "Bearer sk-1"}
    async with aiohttp.ClientSession() as client:
        for _ in range(3):
            body = bad_body(CHAT, {"temperature": "hot"})
            async with client.post(proxy.url + CHAT, json=body, headers=headers) as resp:
                assert resp.status == 400
        async with client.post(proxy.url + CHAT, json=GOOD[CHAT], headers=headers) as resp:
            assert resp.status == 200


async def test_a_route_with_check_bodies_off_sends_them_on(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    routes = [{"name": "lax", "path": "/v1/chat", "check_bodies": False}]
    proxy = await make_proxy([region], routes=routes)
    async with aiohttp.ClientSession() as client:
        # The fake region (as vLLM) ignores a temperature it cannot read.
        body = bad_body(CHAT, {"temperature": "hot"})
        async with client.post(proxy.url + CHAT, json=body) as resp:
            assert resp.status == 200
        # Other routes still check.
        body = bad_body(COMPLETIONS, {"temperature": "hot"})
        async with client.post(proxy.url + COMPLETIONS, json=body) as resp:
            assert resp.status == 400
    assert region.requests_by_path == {CHAT: 1}


async def test_the_openai_sdk_raises_bad_request_on_each_refused_body(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region])
    async with openai.AsyncOpenAI(
        base_url=proxy.url + "/v1", api_key="sk-x", max_retries=0
    ) as client:
        calls = [
            lambda: client.chat.completions.create(
                model="fake-llm",
                messages=HI,  # type: ignore[arg-type]
                temperature="hot",  # type: ignore[arg-type]
            ),
            lambda: client.chat.completions.create(model="fake-llm", messages=[]),
            lambda: client.chat.completions.create(model=openai.omit, messages=HI),  # type: ignore[arg-type]
            lambda: client.chat.completions.create(model="fake-llm", messages=openai.omit),  # type: ignore[arg-type]
            lambda: client.chat.completions.create(
                model="fake-llm",
                messages=[{"content": "hi"}],  # type: ignore[list-item]
            ),
            lambda: client.chat.completions.create(
                model="fake-llm",
                messages=HI,  # type: ignore[arg-type]
                stream="yes",  # type: ignore[call-overload]
            ),
            lambda: client.chat.completions.create(
                model="fake-llm",
                messages=HI,  # type: ignore[arg-type]
                temperature=2.5,
            ),
            lambda: client.chat.completions.create(
                model="fake-llm",
                messages=HI,  # type: ignore[arg-type]
                max_tokens=-1,
            ),
            lambda: client.completions.create(model="fake-llm", prompt="hi", temperature=3),
            lambda: client.completions.create(model="fake-llm", prompt=[]),
            lambda: client.responses.create(model="fake-llm", input=[]),
            lambda: client.responses.create(model="fake-llm", input="hi", temperature=2.5),
            lambda: client.responses.create(model="fake-llm", input="hi", max_output_tokens=-1),
            lambda: client.responses.create(input="hi"),
            lambda: client.embeddings.create(model="fake-llm", input=[]),
            lambda: client.embeddings.create(model=openai.omit, input="hi"),  # type: ignore[arg-type]
        ]
        for call in calls:
            with pytest.raises(openai.BadRequestError) as caught:
                await call()
            assert caught.value.status_code == 400
            assert caught.value.type == "invalid_request_error" and caught.value.param
        # A stream asked for is refused the same way, before any event.
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="fake-llm", messages=[], stream=True)
    untouched(region, proxy)


async def test_the_anthropic_sdk_raises_bad_request_on_each_refused_body(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region])
    async with anthropic.AsyncAnthropic(
        base_url=proxy.url, api_key="sk-ant", max_retries=0
    ) as client:
        messages = client.messages
        calls = [
            # The SDK no longer names the sampling parameters; servers still read them.
            lambda: messages.create(
                model="fake-llm",
                max_tokens=4,
                messages=HI,  # type: ignore[arg-type]
                extra_body={"temperature": "hot"},
            ),
            lambda: messages.create(model="fake-llm", max_tokens=4, messages=[]),
            lambda: messages.create(model=anthropic.omit, max_tokens=4, messages=HI),  # type: ignore[arg-type]
            # null is no value: as if left out (the SDK reads max_tokens itself).
            lambda: messages.create(
                model="fake-llm",
                max_tokens=4,
                messages=HI,  # type: ignore[arg-type]
                extra_body={"max_tokens": None},
            ),
            lambda: messages.create(
                model="fake-llm",
                max_tokens=4,
                messages=HI,  # type: ignore[arg-type]
                extra_body={"temperature": 1.5},
            ),
            lambda: messages.create(model="fake-llm", max_tokens=-1, messages=HI),  # type: ignore[arg-type]
            lambda: messages.count_tokens(model="fake-llm", messages=[]),
        ]
        for call in calls:
            with pytest.raises(anthropic.BadRequestError) as caught:
                await call()
            assert caught.value.status_code == 400
            assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        with pytest.raises(anthropic.BadRequestError):
            async with messages.stream(model="fake-llm", max_tokens=4, messages=[]) as stream:
                await stream.get_final_message()
    untouched(region, proxy)
