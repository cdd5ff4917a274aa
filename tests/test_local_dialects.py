"""The local model answers the Responses API and Anthropic Messages in their own formats.

Real llama.cpp on the generated tiny GGUF, behind the real proxy, with every region down
(a closed port) or failing (5xx): the ladder reaches the local rung, and the official SDKs
(``responses.create``/``responses.stream``, ``messages.create``/``messages.stream``, sync
and async) read a degraded answer. A Responses request that refers to stored state is
never answered locally; non-text content is a 400 in the API's own shape. Request reading
and what the writers write through the SDKs' stream helpers are tested without a model.
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest

from edgeproxy import EdgeProxy, hookimpl
from edgeproxy._core.errors import ProxyError
from edgeproxy._local.model import parse_generation_request
from edgeproxy._protocol.dialects import MESSAGES as MESSAGES_DIALECT
from edgeproxy._protocol.dialects import RESPONSES as RESPONSES_DIALECT
from edgeproxy._protocol.dialects import AnswerText, Dialect
from edgeproxy._protocol.sse import SSEReader

from .conftest import ProxyFactory, RegionFactory, eventually

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
MODES = ["sync", "async"]
CALLS = ["create", "stream"]
USER = [{"role": "user", "content": "hello there"}]
MESSAGE = {"model": "claude-x", "max_tokens": 6, "messages": USER}
RESPONSE = {"model": "gpt-x", "input": "hello there", "max_output_tokens": 6}

needs_llama = [
    pytest.mark.model,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None,
        reason="llama-cpp-python is not installed (pip install 'edgeproxy[local]')",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None or importlib.util.find_spec("numpy") is None,
        reason="building the test model needs gguf and numpy (pip install 'edgeproxy[testing]')",
    ),
]

LocalProxyFactory = Callable[..., Awaitable[EdgeProxy]]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Finished:
    """Records each finished request's usage and degradation, as the metrics read them."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, str | None]] = []

    @hookimpl
    def edgeproxy_response_complete(self, request: Any, ctx: Any) -> None:
        self.seen.append((ctx.usage, ctx.degraded))


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from edgeproxy.testing import tiny_llama_gguf

    return tiny_llama_gguf("Q8_0")


@pytest.fixture
def local_proxy(
    tiny_model: Path, make_proxy: ProxyFactory, make_region: RegionFactory
) -> LocalProxyFactory:
    """A proxy whose regions are down (or have the ``fault``: ``5xx``, ``stall``), with the
    tiny model as its local model."""

    async def factory(
        *,
        plugins: list[object] | None = None,
        fault: str | None = None,
        regions: int = 1,
        routes: list[dict[str, Any]] | None = None,
    ) -> EdgeProxy:
        tables: list[Any] = []
        for i in range(regions):
            if fault is not None:
                tables.append(await make_region(f"r{i}", fault=fault))
            else:
                tables.append({"name": f"dead{i}", "url": f"http://127.0.0.1:{closed_port()}"})
        proxy = await make_proxy(
            tables,
            plugins=plugins or [],
            routes=routes,
            local_model={"path": str(tiny_model), "n_ctx": 512, "max_tokens": 64},
        )
        local_model = proxy.pipeline.fallback.local
        await eventually(lambda: local_model.state not in ("idle", "loading"), timeout=30.0)
        assert local_model.ready
        return proxy

    return factory


def events_of(raw: bytes) -> list[tuple[str | None, Any]]:
    reader = SSEReader()
    return [(e.event, orjson.loads(e.data)) for e in reader.feed(raw) if e.data]


# -- the SDK calls ---------------------------------------------------------------------------


async def responses_call(url: str, mode: str, call: str, **extra: Any) -> dict[str, Any]:
    """One Responses request through the openai SDK: the final response (a created one, or
    the one the stream's last event carries) and the streamed text, as plain data."""
    import openai

    kwargs: dict[str, Any] = {"model": "gpt-x", "input": "hello there", **extra}

    def final(response: Any, streamed: str | None, kinds: list[str]) -> dict[str, Any]:
        return {
            "text": response.output_text,
            "status": response.status,
            "store": response.store,
            "usage": response.usage.model_dump() if response.usage is not None else None,
            "incomplete": response.incomplete_details,
            "streamed": streamed,
            "kinds": kinds,
        }

    if mode == "async":
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-x", max_retries=0)
        try:
            if call == "create":
                return final(await aclient.responses.create(**kwargs), None, [])
            deltas, kinds, last = [], [], None
            async with aclient.responses.stream(**kwargs) as s:
                async for event in s:
                    kinds.append(event.type)
                    if event.type == "response.output_text.delta":
                        deltas.append(event.delta)
                    if event.type in ("response.completed", "response.incomplete"):
                        last = event.response
            assert last is not None
            return final(last, "".join(deltas), kinds)
        finally:
            await aclient.close()

    def run() -> dict[str, Any]:
        with openai.OpenAI(base_url=url + "/v1", api_key="sk-x", max_retries=0) as client:
            if call == "create":
                return final(client.responses.create(**kwargs), None, [])
            deltas, kinds, last = [], [], None
            with client.responses.stream(**kwargs) as s:
                for event in s:
                    kinds.append(event.type)
                    if event.type == "response.output_text.delta":
                        deltas.append(event.delta)
                    if event.type in ("response.completed", "response.incomplete"):
                        last = event.response
            assert last is not None
            return final(last, "".join(deltas), kinds)

    return await asyncio.to_thread(run)


async def messages_call(url: str, mode: str, call: str, **extra: Any) -> dict[str, Any]:
    """One Messages request through the anthropic SDK: the final message, as plain data
    (a stream's through the helper's ``get_final_message``, and its text as streamed)."""
    import anthropic

    kwargs: dict[str, Any] = {**MESSAGE, **extra}

    def final(message: Any, streamed: str | None) -> dict[str, Any]:
        return {
            "text": "".join(b.text for b in message.content if b.type == "text"),
            "stop_reason": message.stop_reason,
            "stop_sequence": message.stop_sequence,
            "usage": message.usage.model_dump(),
            "model": message.model,
            "streamed": streamed,
        }

    if mode == "async":
        aclient = anthropic.AsyncAnthropic(base_url=url, api_key="sk-ant", max_retries=0)
        try:
            if call == "create":
                return final(await aclient.messages.create(**kwargs), None)
            async with aclient.messages.stream(**kwargs) as s:
                streamed = "".join([text async for text in s.text_stream])
                return final(await s.get_final_message(), streamed)
        finally:
            await aclient.close()

    def run() -> dict[str, Any]:
        with anthropic.Anthropic(base_url=url, api_key="sk-ant", max_retries=0) as client:
            if call == "create":
                return final(client.messages.create(**kwargs), None)
            with client.messages.stream(**kwargs) as s:
                streamed = "".join(s.text_stream)
                return final(s.get_final_message(), streamed)

    return await asyncio.to_thread(run)


# -- answers from the real model -------------------------------------------------------------


class TestSDKs:
    pytestmark = needs_llama

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("call", CALLS)
    async def test_responses_through_the_openai_sdk(
        self, local_proxy: LocalProxyFactory, mode: str, call: str
    ) -> None:
        finished = Finished()
        proxy = await local_proxy(plugins=[finished])
        answer = await responses_call(proxy.url, mode, call, max_output_tokens=6)
        assert answer["text"]
        # The tiny model never ends by itself: the answer stops at its bound, as the API says.
        assert answer["status"] == "incomplete"
        assert answer["incomplete"].reason == "max_output_tokens"
        assert answer["store"] is False  # answered, never stored
        usage = answer["usage"]
        assert usage["input_tokens"] > 0 and usage["output_tokens"] == 6
        assert usage["total_tokens"] == usage["input_tokens"] + 6
        if call == "stream":
            assert answer["streamed"] == answer["text"]
            assert answer["kinds"][:2] == ["response.created", "response.in_progress"]
            assert answer["kinds"][-1] == "response.incomplete"
        # Counted as a region's answer in the API is: its own fields, chat's beside them.
        await eventually(lambda: bool(finished.seen))
        counted, degraded = finished.seen[-1]
        assert degraded == "local-model"
        assert counted["input_tokens"] == usage["input_tokens"]
        assert counted["completion_tokens"] == 6
        assert counted["prompt_tokens"] == usage["input_tokens"]

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("call", CALLS)
    async def test_messages_through_the_anthropic_sdk(
        self, local_proxy: LocalProxyFactory, mode: str, call: str
    ) -> None:
        finished = Finished()
        proxy = await local_proxy(plugins=[finished], fault="5xx")
        answer = await messages_call(proxy.url, mode, call)
        assert answer["text"]
        assert answer["stop_reason"] == "max_tokens"
        assert answer["model"] == proxy.pipeline.fallback.local.model_name
        usage = answer["usage"]
        assert usage["input_tokens"] > 0 and usage["output_tokens"] == 6
        if call == "stream":
            assert answer["streamed"] == answer["text"]
        await eventually(lambda: bool(finished.seen))
        counted, degraded = finished.seen[-1]
        assert degraded == "local-model"
        assert counted["input_tokens"] == usage["input_tokens"]
        assert counted["output_tokens"] == counted["completion_tokens"] == 6
        assert counted["total_tokens"] == usage["input_tokens"] + 6

    @pytest.mark.parametrize("api", ["responses", "messages"])
    async def test_a_stream_after_heartbeats_goes_on_with_the_local_answer(
        self, local_proxy: LocalProxyFactory, api: str
    ) -> None:
        finished = Finished()
        # The region stalls: heartbeats (200 sent), then the deadline, then the local model.
        route = {"name": "all", "path": "/", "sse_heartbeat": 0.02, "deadline": 0.4}
        proxy = await local_proxy(plugins=[finished], fault="stall", routes=[route])
        if api == "messages":
            answer = await messages_call(proxy.url, "async", "stream")
            assert answer["stop_reason"] == "max_tokens"
        else:
            answer = await responses_call(proxy.url, "async", "stream", max_output_tokens=6)
            assert answer["kinds"][-1] == "response.incomplete"
        assert answer["text"] and answer["streamed"] == answer["text"]
        await eventually(lambda: bool(finished.seen))
        counted, degraded = finished.seen[-1]
        assert degraded == "local-model" and counted["completion_tokens"] == 6
        # On the wire: the API's own heartbeats first, then its own events.
        dialect, path, body = (
            (MESSAGES_DIALECT, MESSAGES, MESSAGE)
            if api == "messages"
            else (RESPONSES_DIALECT, RESPONSES, RESPONSE)
        )
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + path, json={**body, "stream": True}) as resp:
                raw = await resp.read()
        assert raw.startswith(dialect.heartbeat)
        first = raw.replace(dialect.heartbeat, b"").split(b"\n", 1)[0]
        assert first == (
            b"event: message_start" if api == "messages" else b"event: response.created"
        )

    @pytest.mark.parametrize("call", CALLS)
    async def test_a_messages_stop_sequence_is_named(
        self, local_proxy: LocalProxyFactory, call: str
    ) -> None:
        proxy = await local_proxy()
        # Greedy sampling gives the same answer each time: stop at a piece of it.
        # (temperature is no longer a parameter of this SDK's calls: sent as an extra.)
        greedy = {"extra_body": {"temperature": 0}, "max_tokens": 10}
        full = (await messages_call(proxy.url, "async", "create", **greedy))["text"]
        stop = full.strip()[-3:]
        stopped = await messages_call(proxy.url, "async", call, **greedy, stop_sequences=[stop])
        assert stopped["stop_reason"] == "stop_sequence"
        assert stopped["stop_sequence"] == stop
        assert stop not in stopped["text"] and full.startswith(stopped["text"])


class TestWire:
    pytestmark = needs_llama

    async def test_json_answers_are_marked_degraded(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy()
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + MESSAGES, json=MESSAGE) as resp:
                assert resp.status == 200
                assert resp.headers["X-Edgeproxy-Degraded"] == "local-model"
                assert resp.headers["X-Edgeproxy-Region"] == "local"
                assert "X-Request-Id" in resp.headers
                message = await resp.json()
            request = {**RESPONSE, "store": True, "instructions": "be brief"}
            async with client.post(proxy.url + RESPONSES, json=request) as resp:
                assert resp.status == 200
                assert resp.headers["X-Edgeproxy-Degraded"] == "local-model"
                # Asked to be stored, it is not: said in the warning and in the answer.
                assert "store" in resp.headers["X-Edgeproxy-Warning"]
                response = await resp.json()
        assert message["type"] == "message" and message["id"].startswith("msg_")
        assert message["content"][0]["type"] == "text" and message["content"][0]["text"]
        assert response["object"] == "response" and response["id"].startswith("resp_")
        assert response["store"] is False
        assert response["output"][0]["content"][0]["text"]
        assert proxy.pipeline.owners.snapshot()["known"] == 0

    async def test_streams_are_the_apis_own_events(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy()
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + MESSAGES, json={**MESSAGE, "stream": True}) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                assert resp.headers["X-Edgeproxy-Degraded"] == "local-model"
                messages = events_of(await resp.read())
            async with client.post(
                proxy.url + RESPONSES, json={**RESPONSE, "stream": True}
            ) as resp:
                assert resp.headers["X-Edgeproxy-Degraded"] == "local-model"
                responses = events_of(await resp.read())
        names = [name for name, _ in messages]
        assert names[:2] == ["message_start", "content_block_start"]
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert messages[0][1]["message"]["usage"]["input_tokens"] > 0
        assert messages[-2][1]["usage"]["output_tokens"] == 6
        sequence = [data["sequence_number"] for _, data in responses]
        assert sequence == list(range(len(responses)))
        assert all(name == data["type"] for name, data in responses)
        assert responses[-1][1]["response"]["usage"]["output_tokens"] == 6

    async def test_a_stored_state_reference_is_never_answered_locally(
        self, local_proxy: LocalProxyFactory
    ) -> None:
        # Two regions: an id no process knows is the API's own 404, before any region.
        proxy = await local_proxy(regions=2)
        local = proxy.pipeline.fallback.local
        async with aiohttp.ClientSession() as client:
            chained = {**RESPONSE, "previous_response_id": "resp_unknown"}
            async with client.post(proxy.url + RESPONSES, json=chained) as resp:
                assert resp.status == 404
                assert "X-Edgeproxy-Degraded" not in resp.headers
                error = (await resp.json())["error"]
        assert error["code"] == "previous_response_not_found"
        assert error["param"] == "previous_response_id"
        assert local.requests_total == 0

    @pytest.mark.parametrize(
        "refers",
        [
            {"previous_response_id": "resp_1"},
            {"conversation": "conv_1"},
            {"conversation": {"id": "conv_1"}},
            {"background": True},
            {"prompt": {"id": "pmpt_1"}},
            {"input": [{"type": "item_reference", "id": "msg_1"}]},
        ],
        ids=["previous", "conversation", "conversation-object", "background", "prompt", "item"],
    )
    async def test_a_request_on_stored_state_gets_the_regions_error(
        self, local_proxy: LocalProxyFactory, refers: dict[str, Any]
    ) -> None:
        # One region, down: it would be the owner; the local model has none of the state.
        proxy = await local_proxy()
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + RESPONSES, json={**RESPONSE, **refers}) as resp:
                # The region's own failure, as without a local model.
                assert resp.status == 502
                assert "X-Edgeproxy-Degraded" not in resp.headers
                assert (await resp.json())["error"]["code"] == "bad_gateway"
        assert proxy.pipeline.fallback.local.requests_total == 0

    async def test_non_text_content_is_a_400_in_the_apis_shape(
        self, local_proxy: LocalProxyFactory
    ) -> None:
        import anthropic
        import openai

        proxy = await local_proxy()
        image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
        tool = {"type": "function_call_output", "call_id": "c1", "output": "42"}
        picture = {"type": "input_image", "image_url": "https://example.com/a.png"}
        async with aiohttp.ClientSession() as client:
            message = {**MESSAGE, "messages": [{"role": "user", "content": [image]}]}
            async with client.post(proxy.url + MESSAGES, json=message) as resp:
                assert resp.status == 400
                anthropic_error = await resp.json()
            answers = []
            for given in (
                [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, picture]}],
                [{"role": "user", "content": "hi"}, tool],
            ):
                async with client.post(
                    proxy.url + RESPONSES, json={**RESPONSE, "input": given}
                ) as resp:
                    assert resp.status == 400
                    answers.append((await resp.json())["error"])
        assert anthropic_error["type"] == "error"
        assert anthropic_error["error"]["type"] == "invalid_request_error"
        assert "'image'" in anthropic_error["error"]["message"]
        assert "text only" in anthropic_error["error"]["message"]
        assert answers[0]["type"] == "invalid_request_error"
        assert answers[0]["param"] == "input[0].content[1]"
        assert "'input_image'" in answers[0]["message"]
        assert (
            answers[1]["param"] == "input[1]" and "'function_call_output'" in answers[1]["message"]
        )
        # The SDKs raise their own 400s for them.
        with pytest.raises(anthropic.BadRequestError):
            await messages_call(proxy.url, "async", "create", messages=message["messages"])
        with pytest.raises(openai.BadRequestError):
            await responses_call(
                proxy.url, "async", "stream", input=[{"role": "user", "content": [picture]}]
            )
        local = proxy.pipeline.fallback.local
        await eventually(lambda: local.busy == 0)


# -- request reading (no model needed) -------------------------------------------------------


def test_a_messages_request_is_read_as_text_turns() -> None:
    req = parse_generation_request(
        MESSAGES,
        {
            "model": "m",
            "system": [
                {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}
            ],
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "go on"},
            ],
            "max_tokens": 12,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u"},
            "tools": [],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
    )
    assert req.dialect is MESSAGES_DIALECT and req.chat
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "go on"},
    ]
    assert req.max_tokens == 12 and req.stop == ["END"]
    assert req.sampling == {"temp": 0.5, "top_p": 0.9, "top_k": 5}
    assert req.ignored == ["thinking"]


def test_a_responses_request_is_read_as_text_turns() -> None:
    req = parse_generation_request(
        RESPONSES,
        {
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "developer", "content": "no lists"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                },
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
                {"role": "user", "content": "more"},
            ],
            "max_output_tokens": 9,
            "temperature": 1.5,
            "store": True,
            "stream": True,
            "text": {"format": {"type": "text"}},
            "tools": [{"type": "web_search"}],
        },
    )
    assert req.dialect is RESPONSES_DIALECT and req.stream and req.include_usage
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "no lists"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    assert req.max_tokens == 9 and req.sampling == {"temp": 1.5}
    assert req.ignored == ["store", "tools"]
    plain = parse_generation_request(RESPONSES, {"model": "m", "input": "hi", "store": False})
    assert plain.messages == [{"role": "user", "content": "hi"}] and plain.ignored == []


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (MESSAGES, {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
         "messages[0].content[0]"),
        (MESSAGES, {"system": [{"type": "image"}], "messages": USER}, "system[0]"),
        (MESSAGES, {"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        (MESSAGES, {"messages": []}, "messages"),
        (RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
         "input[0].content[0]"),
        (RESPONSES, {"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
        (RESPONSES, {"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (RESPONSES, {"input": 3}, "input"),
    ],
)  # fmt: skip
def test_what_the_local_model_cannot_read_is_a_400_naming_the_field(
    path: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ProxyError) as info:
        parse_generation_request(path, {"model": "m", "max_tokens": 4, **body})
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    assert info.value.param == param


def test_out_of_range_sampling_is_a_400_by_the_apis_range() -> None:
    with pytest.raises(ProxyError) as info:
        parse_generation_request(MESSAGES, {**MESSAGE, "temperature": 1.5})
    assert "temperature" in info.value.message
    assert parse_generation_request(RESPONSES, {**RESPONSE, "temperature": 1.5}).sampling


# -- what the writers write, through the SDKs' own stream helpers -----------------------------


def written(dialect: Dialect, pieces: list[str], finish: str, **answer: Any) -> bytes:
    head = AnswerText("x", "local/m", 7, usage={"prompt_tokens": 5, "completion_tokens": 0})
    for key, value in answer.items():
        setattr(head, key, value)
    writer = dialect.writer(head, include_usage=True)
    out = writer.open()
    for piece in pieces:
        out += writer.piece(piece)
    usage = {"prompt_tokens": 5, "completion_tokens": len(pieces), "total_tokens": 5 + len(pieces)}
    return out + writer.close(finish, usage)


def transport(body: bytes, http: Any = httpx) -> Any:
    """A transport that answers every request with ``body`` as an SSE stream (``http``: the
    HTTP package the SDK uses)."""

    def handler(request: Any) -> Any:
        return http.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return http.MockTransport(handler)


def test_the_openai_stream_helper_reads_a_written_response() -> None:
    import openai

    head_id = RESPONSES_DIALECT.answer_id()
    body = written(RESPONSES_DIALECT, ["Hel", "lo"], "stop", id=head_id)
    http = httpx.Client(transport=transport(body))
    with openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=http) as client:
        with client.responses.stream(model="m", input="hi") as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello"
    assert final.id == head_id and final.status == "completed" and final.store is False
    assert final.usage is not None and final.usage.input_tokens == 5
    assert final.usage.output_tokens == 2


def test_the_anthropic_stream_helper_reads_a_written_message() -> None:
    import anthropic

    # This anthropic SDK runs on its own fork of httpx.
    http_package: Any = pytest.importorskip("httpx2")
    body = written(MESSAGES_DIALECT, ["Hel", "lo"], "stop", stop_sequence="END")
    http = http_package.Client(transport=transport(body, http_package))
    with anthropic.Anthropic(base_url="http://x", api_key="k", http_client=http) as client:
        with client.messages.stream(model="m", max_tokens=4, messages=USER) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert text == "Hello" and final.content[0].type == "text"
    assert final.content[0].text == "Hello"
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")
    assert (final.usage.input_tokens, final.usage.output_tokens) == (5, 2)
