"""Translation: Anthropic Messages and stateless Responses requests answered by regions
that speak chat completions only, whole and streamed, tool calls, stop reasons, usage and
errors in the client's API; the APIs a region speaks configured or learnt from its 404;
a stateful request's 400; the regions that speak an API natively preferred; and every
feature of a request (failover, cache, continuation, usage) on a translated one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from edgeproxy import EdgeProxy
from edgeproxy._protocol.dialects import COUNT_TOKENS, MESSAGES, RESPONSES
from edgeproxy._protocol.sse import SSEReader
from edgeproxy._protocol.translate import Translation, translate
from edgeproxy._upstream.apis import NATIVE, TRANSLATED_TIER, UNSERVED, SpokenApis

from .conftest import CustomRegion, ProxyFactory, RegionFactory
from .test_metrics import scrape

CHAT = "/v1/chat/completions"


# -- a region that speaks chat completions only ------------------------------------------


@dataclass
class Answer:
    """What the chat-only region answers next: its text and calls, why it ends, or an
    error status and body, or a stream broken after ``break_after`` content chunks."""

    text: str = "Hello there from a chat server."
    calls: tuple[tuple[str, str, str], ...] = ()  # (id, name, arguments)
    finish: str | None = None
    status: int = 200
    error: dict[str, Any] | None = None
    break_after: int | None = None
    usage: bool = True


@dataclass
class ChatOnly:
    """llama.cpp's servers as the proxy meets them: chat completions, and FastAPI's
    ``{"detail": "Not Found"}`` for any other path."""

    name: str
    script: list[Answer] = field(default_factory=list)
    seen: list[tuple[str, Any]] = field(default_factory=list)
    url: str = ""

    def paths(self) -> list[str]:
        return [path for path, _ in self.seen]

    def bodies(self) -> list[dict[str, Any]]:
        return [body for path, body in self.seen if path == CHAT]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        if request.method == "POST" or request.path.startswith("/v1/"):
            # Not the proxy's own health checks and warm-ups.
            self.seen.append((request.path, body))
        if request.path != CHAT or request.method != "POST":
            return web.json_response({"detail": "Not Found"}, status=404)
        answer = self.script.pop(0) if self.script else Answer()
        if answer.status != 200:
            return web.json_response(answer.error or {}, status=answer.status)
        finish = answer.finish or ("tool_calls" if answer.calls else "stop")
        words = answer.text.split(" ")
        pieces = [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]
        pieces = [p for p in pieces if p]
        prompt = 7
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(pieces),
            "total_tokens": prompt + len(pieces),
        }
        head = {"id": "chatcmpl-1", "created": 1, "model": "region-model"}
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
            if answer.calls:
                message["tool_calls"] = [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                    for i, n, a in answer.calls
                ]
            out = {
                **head,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            }
            if answer.usage:
                out["usage"] = usage
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(choice: dict[str, Any] | None, **extra: Any) -> None:
            chunk = {**head, "object": "chat.completion.chunk", **extra}
            chunk["choices"] = (
                [] if choice is None else [{"index": 0, "finish_reason": None, **choice}]
            )
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")

        await send({"delta": {"role": "assistant", "content": ""}})
        for n, piece in enumerate(pieces):
            if answer.break_after is not None and n == answer.break_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            await send({"delta": {"content": piece}})
        for index, (call_id, name, arguments) in enumerate(answer.calls):
            first = {"index": index, "id": call_id, "type": "function"}
            await send(
                {"delta": {"tool_calls": [{**first, "function": {"name": name, "arguments": ""}}]}}
            )
            half = len(arguments) // 2
            for part in (arguments[:half], arguments[half:]):
                await send(
                    {"delta": {"tool_calls": [{"index": index, "function": {"arguments": part}}]}}
                )
        await send({"delta": {}, "finish_reason": finish})
        options = body.get("stream_options") or {}
        if answer.usage and options.get("include_usage"):
            await send(None, usage=usage)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
async def chat_only(custom_region: CustomRegion) -> AsyncIterator[Any]:
    async def start(name: str = "llama") -> ChatOnly:
        region = ChatOnly(name)
        region.url = await custom_region(region.app())
        return region

    yield start


def table(region: ChatOnly, **extra: Any) -> dict[str, Any]:
    # The chat-only region is aiohttp's HTTP/1.1 server.
    return {"name": region.name, "url": region.url, "http2": False, **extra}


def clients(proxy: EdgeProxy) -> tuple[anthropic.AsyncAnthropic, openai.AsyncOpenAI]:
    return (
        anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0),
        openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0),
    )


USER = [{"role": "user", "content": "Say hello."}]
WEATHER = {
    "name": "weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


# -- the requests, translated ------------------------------------------------------------


def chat_of(name: str, body: dict[str, Any], method: str = "off") -> dict[str, Any]:
    out = translate(name, body, model=None, region="llama", method=method)
    assert isinstance(out, Translation), out
    return out.body


def test_a_messages_request_becomes_a_chat_completion() -> None:
    body = {
        "model": "claude-x",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["END"],
        "metadata": {"user_id": "u-1"},
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "stream": True,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "sunny"}],
                    },
                    {"type": "text", "text": "And"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AAA"},
                    },
                ],
            },
        ],
    }
    chat = chat_of("messages", body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
            ],
        },
    ]
    assert chat["model"] == "claude-x" and chat["max_tokens"] == 64
    assert (chat["temperature"], chat["top_p"], chat["top_k"], chat["stop"]) == (
        0.2,
        0.9,
        40,
        ["END"],
    )
    assert chat["user"] == "u-1"
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "The weather in a city",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["parallel_tool_calls"] is False
    # A chat stream says its usage only when asked.
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "thinking" not in chat


def test_a_prefill_is_continued_as_the_region_continues_a_chat() -> None:
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [*USER, {"role": "assistant", "content": "Hello"}],
    }
    vllm = chat_of("messages", body, "continue_final_message")
    assert vllm["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert vllm["continue_final_message"] is True and vllm["add_generation_prompt"] is False
    llama = chat_of("messages", body, "prefill")
    assert "continue_final_message" not in llama and llama["messages"][-1]["role"] == "assistant"


def test_a_token_count_is_one_token_generated() -> None:
    body = {"model": "m", "messages": USER, "tools": [WEATHER]}
    chat = chat_of("messages.count_tokens", body)
    assert chat["max_tokens"] == 1 and "stream" not in chat and chat["tools"]
    found = translate("messages.count_tokens", body, model=None, region="r", method="off")
    assert isinstance(found, Translation)
    usage = {"usage": {"prompt_tokens": 23, "completion_tokens": 1}}
    assert found.whole(orjson.dumps(usage)) == (200, b'{"input_tokens":23}')
    # A region that counts nothing: the proxy's estimate.
    status, body_out = found.whole(b'{"choices": []}')
    assert status == 200 and orjson.loads(body_out)["input_tokens"] > 0


def test_a_stateless_responses_request_becomes_a_chat_completion() -> None:
    body = {
        "model": "gpt-4o-mini",
        "instructions": "Be brief.",
        "store": False,
        "max_output_tokens": 50,
        "temperature": 0.5,
        "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "name": "weather"},
        "text": {
            "format": {
                "type": "json_schema",
                "name": "w",
                "schema": {"type": "object"},
                "strict": True,
            }
        },
        "reasoning": {"effort": "low"},
        "tools": [
            {
                "type": "function",
                "name": "weather",
                "parameters": {"type": "object"},
                "strict": True,
            }
        ],
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Sunny."}],
            },
        ],
    }
    chat = chat_of("responses", body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "{}"},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert chat["max_tokens"] == 50 and chat["temperature"] == 0.5
    assert chat["tools"][0]["function"]["name"] == "weather"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["response_format"]["json_schema"]["name"] == "w"
    assert "reasoning" not in chat and "store" not in chat


@pytest.mark.parametrize(
    ("extra", "field_"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ],
)
def test_a_stateful_responses_request_is_refused_in_the_responses_shape(
    extra: dict[str, Any], field_: str
) -> None:
    body = {"model": "m", "input": "hi", **extra}
    err = translate("responses", body, model=None, region="llama", method="off")
    assert not isinstance(err, Translation) and err is not None
    assert (err.status, err.code, err.param) == (400, "stateful_unsupported", field_)
    assert "region llama speaks chat completions only and cannot store responses" in err.message
    shaped = orjson.loads(RESPONSES.error_body(err))
    assert shaped["error"]["code"] == "stateful_unsupported"


@pytest.mark.parametrize(
    ("name", "body", "param"),
    [
        (
            "messages",
            {
                "model": "m",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            },
            "messages[0].content[0]",
        ),
        (
            "messages",
            {
                "model": "m",
                "max_tokens": 1,
                "messages": USER,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools[0]",
        ),
        ("responses", {"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        (
            "responses",
            {
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}],
            },
            "input[0].content[0]",
        ),
    ],
)
def test_what_chat_cannot_carry_is_a_400_naming_the_field(
    name: str, body: dict[str, Any], param: str
) -> None:
    err = translate(name, body, model=None, region="llama", method="off")
    assert not isinstance(err, Translation) and err is not None
    assert (err.status, err.code, err.param) == (400, "untranslatable", param)


def test_the_region_is_sent_its_own_name_for_the_model() -> None:
    found = translate(
        "responses",
        {"model": "gpt-4o-mini", "input": "hi"},
        model="llama-3",
        region="r",
        method="off",
    )
    assert isinstance(found, Translation)
    assert found.body["model"] == "llama-3" and found.model == "gpt-4o-mini"
    assert found.target("/v1/responses") == "/v1/chat/completions"
    assert found.target("/openai/v1/responses") == "/openai/v1/chat/completions"
    messages = translate(
        "messages",
        {"model": "m", "max_tokens": 1, "messages": USER},
        model=None,
        region="r",
        method="off",
    )
    assert isinstance(messages, Translation)
    assert messages.target("/anthropic/v1/messages") == "/anthropic/v1/chat/completions"


# -- the answers, translated back --------------------------------------------------------


def completion(text: str | None, finish: str, calls: list[dict[str, Any]] | None = None) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "region-model",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16},
        }
    )


def translation(name: str, stream: bool = False, **body: Any) -> Translation:
    if name == "responses":
        request = {"model": "gpt-4o-mini", "input": "hi", "stream": stream, **body}
    else:
        request = {"model": "claude-x", "max_tokens": 9, "messages": USER, "stream": stream, **body}
    found = translate(name, request, model=None, region="r", method="off")
    assert isinstance(found, Translation)
    return found


CALL = {
    "id": "call_9",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
}


@pytest.mark.parametrize(
    ("finish", "stop_reason"),
    [("stop", "end_turn"), ("length", "max_tokens"), ("tool_calls", "tool_use")],
)
def test_a_whole_message_with_its_stop_reason(finish: str, stop_reason: str) -> None:
    calls = [CALL] if finish == "tool_calls" else None
    status, body = translation("messages").whole(completion("Hi.", finish, calls))
    message = orjson.loads(body)
    assert status == 200 and message["type"] == "message" and message["id"].startswith("msg_")
    assert message["model"] == "claude-x" and message["role"] == "assistant"
    assert message["stop_reason"] == stop_reason
    assert message["usage"] == {"input_tokens": 11, "output_tokens": 5}
    assert message["content"][0] == {"type": "text", "text": "Hi."}
    if calls:
        assert message["content"][1] == {
            "type": "tool_use",
            "id": "call_9",
            "name": "weather",
            "input": {"city": "Oslo"},
        }


def test_a_message_of_tool_calls_alone_has_no_text_block() -> None:
    _, body = translation("messages").whole(completion(None, "tool_calls", [CALL]))
    assert [b["type"] for b in orjson.loads(body)["content"]] == ["tool_use"]


@pytest.mark.parametrize(
    ("finish", "status", "reason"),
    [
        ("stop", "completed", None),
        ("length", "incomplete", "max_output_tokens"),
        ("tool_calls", "completed", None),
    ],
)
def test_a_whole_response_with_its_status(finish: str, status: str, reason: str | None) -> None:
    calls = [CALL] if finish == "tool_calls" else None
    code, body = translation("responses").whole(
        completion("Hi." if not calls else None, finish, calls)
    )
    response = orjson.loads(body)
    assert code == 200 and response["object"] == "response" and response["id"].startswith("resp_")
    assert response["status"] == status and response["store"] is False
    assert response["incomplete_details"] == ({"reason": reason} if reason else None)
    assert response["usage"]["input_tokens"] == 11 and response["usage"]["output_tokens"] == 5
    if calls:
        (item,) = response["output"]
        assert item["type"] == "function_call" and item["call_id"] == "call_9"
        assert item["name"] == "weather" and item["arguments"] == '{"city": "Oslo"}'
    else:
        assert response["output"][0]["content"][0]["text"] == "Hi."


def test_an_answer_that_is_no_completion_is_a_502_in_the_clients_shape() -> None:
    status, body = translation("messages").whole(b'{"object": "list"}')
    assert status == 502 and orjson.loads(body)["type"] == "error"


@pytest.mark.parametrize(
    ("region_body", "message"),
    [
        (
            b'{"error": {"message": "context too long", "type": "invalid_request_error"}}',
            "context too long",
        ),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b"<html>bad gateway</html>", "the region answered 400"),
    ],
)
def test_errors_in_the_clients_shape(region_body: bytes, message: str) -> None:
    messages = orjson.loads(translation("messages").error(400, region_body))
    assert messages == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": message},
    }
    responses = orjson.loads(translation("responses").error(400, region_body))
    assert responses["error"]["message"] == message
    overloaded = orjson.loads(translation("messages").error(503, region_body))
    assert overloaded["error"]["type"] == "overloaded_error"


def chat_stream(
    text: str, calls: list[tuple[str, str, str]] = (), finish: str = "stop", usage: bool = True
) -> bytes:  # type: ignore[assignment]
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "x"}

    def event(choice: dict[str, Any] | None, **extra: Any) -> bytes:
        chunk = {**head, "choices": [] if choice is None else [{"index": 0, **choice}], **extra}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    out = event({"delta": {"role": "assistant", "content": ""}})
    for word in text.split():
        out += event({"delta": {"content": word + " "}})
    for index, (call_id, name, arguments) in enumerate(calls):
        out += event(
            {
                "delta": {
                    "tool_calls": [
                        {"index": index, "id": call_id, "function": {"name": name, "arguments": ""}}
                    ]
                }
            }
        )
        out += event(
            {"delta": {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}}
        )
    out += event({"delta": {}, "finish_reason": finish})
    if usage:
        out += event(None, usage={"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15})
    return out + b"data: [DONE]\n\n"


def run_stream(
    found: Translation, body: bytes, size: int
) -> tuple[list[tuple[str | None, Any]], bytes | None]:
    stream = found.stream()
    out = b""
    for i in range(0, len(body), size):
        out += stream.feed(body[i : i + size])
    tail = stream.close()
    out += tail or b""
    events = [(e.event, orjson.loads(e.data)) for e in SSEReader().feed(out)]
    return events, tail


@pytest.mark.parametrize("size", [1, 17, 100_000])
def test_a_chat_stream_becomes_a_message_stream(size: int) -> None:
    body = chat_stream("Hello world", [("call_1", "weather", '{"city":"Rome"}')], "tool_calls")
    events, _ = run_stream(translation("messages", True), body, size)
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["message"]["model"] == "claude-x"
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert events[5][1]["content_block"] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "weather",
        "input": {},
    }
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city":"Rome"}'}
    assert events[6][1]["index"] == 1
    delta = events[8][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    # The prompt is counted at the end of a chat stream: message_delta says it.
    assert delta["usage"] == {"input_tokens": 12, "output_tokens": 3}
    # What the proxy's readers make of it: the Messages dialect's own.
    raw = [e for e in SSEReader().feed(b"".join(_raw(events)))]
    assert MESSAGES.is_end(raw[-1])


def _raw(events: list[tuple[str | None, Any]]) -> list[bytes]:
    return [
        b"event: " + str(name).encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
        for name, data in events
    ]


def test_a_message_stream_commits_at_its_first_content() -> None:
    events, _ = run_stream(translation("messages", True), chat_stream("Hi"), 100_000)
    reader = SSEReader()
    parsed = reader.feed(b"".join(_raw(events)))
    # The opening does not commit the region (failover may still go elsewhere); the text does.
    assert [MESSAGES.commits(e) for e in parsed[:2]] == [False, False]
    assert MESSAGES.commits(parsed[2])


@pytest.mark.parametrize("size", [3, 100_000])
def test_a_chat_stream_becomes_a_responses_stream(size: int) -> None:
    body = chat_stream("Hi there", [("call_1", "weather", '{"city":"Rome"}')], "tool_calls")
    events, _ = run_stream(translation("responses", True), body, size)
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    done = events[-1][1]["response"]
    assert done["status"] == "completed" and done["model"] == "gpt-4o-mini"
    assert [item["type"] for item in done["output"]] == ["message", "function_call"]
    assert done["output"][0]["content"][0]["text"] == "Hi there "
    assert (
        done["output"][1]["arguments"] == '{"city":"Rome"}'
        and done["output"][1]["call_id"] == "call_1"
    )
    assert events[10][1]["output_index"] == 1
    assert done["usage"]["input_tokens"] == 12 and done["usage"]["output_tokens"] == 3
    assert RESPONSES.assemble(SSEReader().feed(b"".join(_raw(events)))) == done


def test_a_stream_cut_at_its_length_is_incomplete() -> None:
    events, _ = run_stream(
        translation("responses", True), chat_stream("a b", finish="length"), 100_000
    )
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    events, _ = run_stream(
        translation("messages", True), chat_stream("a b", finish="length"), 100_000
    )
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_a_stream_without_usage_is_counted_by_estimate() -> None:
    events, _ = run_stream(
        translation("messages", True), chat_stream("one two three", usage=False), 100_000
    )
    usage = events[-2][1]["usage"]
    assert usage["output_tokens"] == 3 and usage["input_tokens"] > 0


def test_a_stream_that_breaks_off_before_its_end_is_broken() -> None:
    body = chat_stream("one two three")
    cut = body[: body.index(b'"finish_reason":"stop"') - 40]
    stream = translation("messages", True).stream()
    stream.feed(cut)
    assert stream.close() is None
    # Its finish came, its [DONE] did not: it is whole.
    whole = body[: body.index(b"data: [DONE]")]
    stream = translation("messages", True).stream()
    stream.feed(whole)
    assert stream.close()


def test_an_error_in_a_chat_stream_is_the_clients_error_event() -> None:
    body = chat_stream("a")[: -len(b"data: [DONE]\n\n")]
    body = (
        body.split(b"\n\n")[0]
        + b"\n\n"
        + b'data: {"error": {"message": "out of memory", "type": "server_error"}}\n\n'
    )
    events, _ = run_stream(translation("messages", True), body, 100_000)
    assert events[-1][0] == "error" and events[-1][1]["error"]["message"] == "out of memory"
    events, _ = run_stream(translation("responses", True), body, 100_000)
    assert events[-1][0] == "error" and events[-1][1]["message"] == "out of memory"


def test_the_apis_a_region_speaks() -> None:
    unknown = SpokenApis(None)
    assert unknown.learns and not unknown.lacking
    assert unknown.tier("messages", False) == NATIVE
    unknown.learn("messages", 404)
    assert unknown.lacking == {"messages", "messages.count_tokens"}
    assert unknown.tier("messages", False) == TRANSLATED_TIER
    assert unknown.book.partial
    chat = SpokenApis(["chat"])
    assert not chat.learns
    assert chat.tier("chat.completions", False) == NATIVE
    assert chat.tier("responses", False) == TRANSLATED_TIER
    assert chat.tier("responses", True) == UNSERVED
    assert chat.tier("embeddings", False) == UNSERVED
    # Without chat completions nothing can be translated.
    assert SpokenApis(["embeddings"]).tier("messages", False) == UNSERVED
    assert chat.snapshot()["translated"] == ["messages", "messages.count_tokens", "responses"]


def test_count_tokens_is_never_streamed() -> None:
    assert not COUNT_TOKENS.streams


# -- through the proxy: regions that speak chat completions only -------------------------


async def status_apis(proxy: EdgeProxy, region: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/status") as resp:
            status = await resp.json()
    return next(r for r in status["regions"] if r["name"] == region)["apis"]


async def test_a_region_learns_on_first_use_and_the_client_pays_nothing(
    chat_only: Any, make_proxy: ProxyFactory
) -> None:
    llama = await chat_only()
    proxy = await make_proxy([table(llama)])
    an, oa = clients(proxy)
    try:
        message = await an.messages.create(model="gpt-4o-mini", max_tokens=16, messages=USER)
        assert message.content[0].type == "text"
        assert message.content[0].text == "Hello there from a chat server."
        assert message.stop_reason == "end_turn"
        assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 6)
        # The 404 taught it, and the same attempt sent the translation.
        assert llama.paths() == ["/v1/messages", CHAT]
        apis = await status_apis(proxy, "llama")
        assert apis["learnt"] == {"messages": 404, "messages.count_tokens": 404}
        assert apis["translated_total"] == {"messages": 1}
        # From now on straight to chat completions, the token count too.
        await an.messages.create(model="gpt-4o-mini", max_tokens=16, messages=USER)
        counted = await an.messages.count_tokens(model="gpt-4o-mini", messages=USER)
        assert counted.input_tokens == 7
        assert llama.paths() == ["/v1/messages", CHAT, CHAT, CHAT]
        assert llama.bodies()[-1]["max_tokens"] == 1
        # The Responses API is learnt on its own first use.
        response = await oa.responses.create(model="gpt-4o-mini", input="Say hello.", store=False)
        assert response.output_text == "Hello there from a chat server."
        assert llama.paths()[-2:] == ["/v1/responses", CHAT]
        # Chat completions themselves pass as they are.
        chat = await oa.chat.completions.create(model="gpt-4o-mini", messages=USER)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == "Hello there from a chat server."
        assert llama.paths()[-1] == CHAT
    finally:
        await an.close()
        await oa.close()


async def test_a_404_of_chat_completions_too_is_the_regions_own_and_teaches_nothing(
    custom_region: CustomRegion, make_proxy: ProxyFactory
) -> None:
    seen: list[str] = []

    async def nothing(request: web.Request) -> web.Response:
        if request.method == "POST":
            seen.append(request.path)
        return web.json_response(
            {"error": {"message": "model `x` not found", "type": "not_found"}}, status=404
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", nothing)
    url = await custom_region(app)
    proxy = await make_proxy([{"name": "r", "url": url, "http2": False}])
    async with aiohttp.ClientSession() as client:
        body = {"model": "x", "max_tokens": 5, "messages": USER}
        async with client.post(proxy.url + "/v1/messages", json=body) as resp:
            assert resp.status == 404
            assert "model `x` not found" in await resp.text()
    assert seen == ["/v1/messages", CHAT]
    assert (await status_apis(proxy, "r"))["lacking"] == []


async def test_configured_apis_translate_from_the_first_request(
    chat_only: Any, make_proxy: ProxyFactory
) -> None:
    llama = await chat_only()
    proxy = await make_proxy([table(llama, apis=["chat"])])
    an, oa = clients(proxy)
    try:
        async with an.messages.stream(model="gpt-4o-mini", max_tokens=16, messages=USER) as stream:
            texts = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(texts) == "Hello there from a chat server."
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == 6
        assert final.usage.input_tokens == 7
        events = await oa.responses.create(
            model="gpt-4o-mini", input="hi", store=False, stream=True
        )
        kinds = []
        async for event in events:
            kinds.append(event.type)
            if event.type == "response.completed":
                assert event.response.output_text == "Hello there from a chat server."
                assert event.response.usage is not None
                assert event.response.usage.output_tokens == 6
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert llama.paths() == [CHAT, CHAT]
        assert (await status_apis(proxy, "llama"))["configured"] == ["chat"]
    finally:
        await an.close()
        await oa.close()


async def test_tool_calls_both_ways_with_the_sdks(chat_only: Any, make_proxy: ProxyFactory) -> None:
    llama = await chat_only()
    proxy = await make_proxy([table(llama, apis=["chat"])])
    an, oa = clients(proxy)
    call = ("call_7", "weather", '{"city": "Lima"}')
    llama.script = [Answer(text="", calls=(call,)), Answer(text="", calls=(call,))]
    llama.script += [Answer(text="", calls=(call,)), Answer(text="", calls=(call,))]
    try:
        tools: Any = [WEATHER]
        message = await an.messages.create(model="m", max_tokens=32, messages=USER, tools=tools)
        assert message.stop_reason == "tool_use"
        (block,) = message.content
        assert block.type == "tool_use" and block.input == {"city": "Lima"} and block.id == "call_7"
        async with an.messages.stream(
            model="m", max_tokens=32, messages=USER, tools=tools
        ) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use"
        assert [b.type for b in final.content] == ["tool_use"]
        assert final.content[0].input == {"city": "Lima"}  # type: ignore[union-attr]
        # The result goes back as chat's tool message.
        follow: Any = [
            *USER,
            {"role": "assistant", "content": [block.model_dump()]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "call_7", "content": "12C"}],
            },
        ]
        await an.messages.create(model="m", max_tokens=32, messages=follow, tools=tools)
        assert llama.bodies()[-1]["messages"][-1] == {
            "role": "tool",
            "tool_call_id": "call_7",
            "content": "12C",
        }
        functions: Any = [
            {"type": "function", "name": "weather", "parameters": WEATHER["input_schema"]}
        ]
        response = await oa.responses.create(
            model="m", input="weather?", tools=functions, store=False
        )
        (item,) = response.output
        assert item.type == "function_call" and item.call_id == "call_7"
        assert json.loads(item.arguments) == {"city": "Lima"}
        again = await oa.responses.create(
            model="m",
            store=False,
            tools=functions,
            input=[
                {"role": "user", "content": "weather?"},
                {
                    "type": "function_call",
                    "call_id": "call_7",
                    "name": "weather",
                    "arguments": item.arguments,
                },
                {"type": "function_call_output", "call_id": "call_7", "output": "12C"},
            ],
        )
        assert again.output_text == "Hello there from a chat server."
        assert llama.bodies()[-1]["messages"][-1] == {
            "role": "tool",
            "tool_call_id": "call_7",
            "content": "12C",
        }
    finally:
        await an.close()
        await oa.close()


async def test_a_regions_error_reaches_each_sdk_in_its_own_shape(
    chat_only: Any, make_proxy: ProxyFactory
) -> None:
    llama = await chat_only()
    proxy = await make_proxy([table(llama, apis=["chat"])])
    an, oa = clients(proxy)
    error = {
        "error": {
            "message": "Requested tokens exceed context window of 256",
            "type": "invalid_request_error",
        }
    }
    llama.script = [Answer(status=400, error=error), Answer(status=400, error=error)]
    try:
        with pytest.raises(anthropic.BadRequestError) as raised:
            await an.messages.create(model="m", max_tokens=16, messages=USER)
        assert raised.value.body == {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "Requested tokens exceed context window of 256",
            },
        }
        with pytest.raises(openai.BadRequestError) as bad:
            await oa.responses.create(model="m", input="hi", store=False, stream=True)
        assert "exceed context window" in bad.value.message
    finally:
        await an.close()
        await oa.close()


async def test_a_stateful_request_gets_a_clear_400(
    chat_only: Any, make_proxy: ProxyFactory
) -> None:
    llama = await chat_only()
    proxy = await make_proxy([table(llama, apis=["chat"])])
    _, oa = clients(proxy)
    try:
        with pytest.raises(openai.BadRequestError) as bad:
            await oa.responses.create(model="m", input="and then?", previous_response_id="resp_1")
        assert bad.value.code == "stateful_unsupported"
        assert "speaks chat completions only and cannot store responses" in bad.value.message
        # ... and so does a read of a stored response.
        async with aiohttp.ClientSession() as client:
            async with client.get(proxy.url + "/v1/responses/resp_1") as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["code"] == "stateful_unsupported"
        assert llama.seen == []
    finally:
        await oa.close()


async def test_a_region_speaking_the_api_is_preferred_and_failover_reaches_the_other(
    chat_only: Any, make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    llama = await chat_only()
    native = await make_region("native", tokens=3)
    proxy = await make_proxy([table(llama, apis=["chat"]), {"name": "native", "url": native.url}])
    an, oa = clients(proxy)
    try:
        for _ in range(6):
            raw = await an.messages.with_raw_response.create(model="m", max_tokens=8, messages=USER)
            assert raw.headers["x-edgeproxy-region"] == "native"
        assert llama.seen == []
        # A stateful request never goes to the region that cannot store.
        await oa.responses.create(model="m", input="hi")
        assert llama.seen == []
        # The native region fails before its first token: the translation answers.
        native.behavior.fault = "5xx"
        native.behavior.fault_status = 503
        raw = await an.messages.with_raw_response.create(model="m", max_tokens=8, messages=USER)
        assert raw.headers["x-edgeproxy-region"] == "llama"
        parsed = await raw.parse()
        assert parsed.content[0].text == "Hello there from a chat server."  # type: ignore[union-attr]
        assert raw.headers["x-edgeproxy-attempts"] == "2"
    finally:
        await an.close()
        await oa.close()


async def test_failover_between_two_translated_regions_for_each_api(
    chat_only: Any, make_proxy: ProxyFactory
) -> None:
    one, two = await chat_only("one"), await chat_only("two")
    busy = Answer(status=503, error={"error": {"message": "busy", "type": "server_error"}})
    # One is the nearer (tried first), and refuses everything before its first token.
    near = {"lat": 1.35, "lon": 103.82}
    far = {"lat": 50.0, "lon": 8.0}
    asks = {
        "messages": lambda an, oa: an.messages.create(model="m", max_tokens=8, messages=USER),
        "messages stream": lambda an, oa: an.messages.create(
            model="m", max_tokens=8, messages=USER, stream=True
        ),
        "responses": lambda an, oa: oa.responses.create(model="m", input="hi", store=False),
        "responses stream": lambda an, oa: oa.responses.create(
            model="m", input="hi", store=False, stream=True
        ),
    }
    for name, ask in asks.items():
        one.script = [busy]
        proxy = await make_proxy(
            [table(one, apis=["chat"], **near), table(two, apis=["chat"], **far)]
        )
        an, oa = clients(proxy)
        before = (len(one.seen), len(two.seen))
        try:
            answer = await ask(an, oa)
            if hasattr(answer, "__aiter__"):
                async for _ in answer:
                    pass
        finally:
            await an.close()
            await oa.close()
        assert (len(one.seen), len(two.seen)) == (before[0] + 1, before[1] + 1), name


async def test_usage_of_translated_answers_is_counted(
    chat_only: Any, make_proxy: ProxyFactory
) -> None:
    llama = await chat_only()
    proxy = await make_proxy([table(llama, apis=["chat"])])
    an, oa = clients(proxy)
    try:
        await an.messages.create(model="m", max_tokens=16, messages=USER)
        async with an.messages.stream(model="m", max_tokens=16, messages=USER) as stream:
            await stream.get_final_message()
        await oa.responses.create(model="m", input="hi", store=False)
        events = await oa.responses.create(model="m", input="hi", store=False, stream=True)
        async for _ in events:
            pass
        # The token count costs nothing.
        await an.messages.count_tokens(model="m", messages=USER)
    finally:
        await an.close()
        await oa.close()

    async def counted() -> tuple[float, float]:
        m = await scrape(proxy)
        return (
            m.value("edgeproxy_tokens_total", region="llama", kind="prompt"),
            m.value("edgeproxy_tokens_total", region="llama", kind="completion"),
        )

    for _ in range(100):
        if await counted() == (4 * 7, 4 * 6):
            break
        await asyncio.sleep(0.05)
    assert await counted() == (4 * 7, 4 * 6)


async def test_a_translated_answer_is_cached_in_the_clients_shape(
    chat_only: Any, make_proxy: ProxyFactory
) -> None:
    llama = await chat_only()
    proxy = await make_proxy([table(llama, apis=["chat"])], cache={"enabled": True})
    body = {"model": "m", "max_tokens": 16, "temperature": 0, "messages": USER}
    async with aiohttp.ClientSession() as client:
        answers = []
        for _ in range(2):
            async with client.post(proxy.url + "/v1/messages", json=body) as resp:
                assert resp.status == 200
                answers.append((resp.headers.get("X-Edgeproxy-Cache"), await resp.json()))
        # The stored answer replayed as a stream, in the Messages API.
        async with client.post(proxy.url + "/v1/messages", json={**body, "stream": True}) as resp:
            streamed = await resp.read()
    assert [cache for cache, _ in answers] == ["MISS", "HIT"]
    assert answers[0][1] == answers[1][1] and answers[1][1]["type"] == "message"
    assert b"event: message_start" in streamed and b"Hello" in streamed
    assert len(llama.bodies()) <= 2


async def test_a_broken_translated_stream_is_continued_by_the_other_region(
    chat_only: Any, make_proxy: ProxyFactory
) -> None:
    one, two = await chat_only("one"), await chat_only("two")
    proxy = await make_proxy(
        [
            table(one, apis=["chat"], server="llama.cpp", lat=1.35, lon=103.82),
            table(two, apis=["chat"], server="vllm", lat=50.0, lon=8.0),
        ],
        routes=[{"name": "all", "path": "/", "continue_on_break": True}],
    )
    one.script = [Answer(text="one two three four five six", break_after=3)]
    two.script = [Answer(text="four five six")]
    an, _ = clients(proxy)
    try:
        async with an.messages.stream(model="m", max_tokens=32, messages=USER) as stream:
            final = await stream.get_final_message()
    finally:
        await an.close()
    assert final.content[0].text == "one two three four five six"  # type: ignore[union-attr]
    # The other region was sent chat's continuation: the partial answer as the final
    # assistant message, with vLLM's switches.
    leg = two.bodies()[-1]
    assert leg["messages"][-1] == {"role": "assistant", "content": "one two three"}
    assert leg["continue_final_message"] is True


async def test_the_lighter_model_is_translated_too(
    chat_only: Any, make_proxy: ProxyFactory
) -> None:
    big, small = await chat_only("big"), await chat_only("small")
    proxy = await make_proxy(
        [table(big, apis=["chat"], models=["big"]), table(small, apis=["chat"], models=["small"])],
        routes=[
            {
                "name": "all",
                "path": "/",
                "fallback": ["lighter"],
                "fallback_models": {"big": ["small"]},
            }
        ],
    )
    big.script = [Answer(status=503, error={"error": {"message": "down"}})] * 4
    an, _ = clients(proxy)
    try:
        raw = await an.messages.with_raw_response.create(model="big", max_tokens=8, messages=USER)
    finally:
        await an.close()
    message = await raw.parse()
    assert message.content[0].text == "Hello there from a chat server."  # type: ignore[union-attr]
    assert message.model == "small"
    assert raw.headers["x-edgeproxy-degraded"] == "lighter-model"
    assert small.bodies()[0]["model"] == "small"


def test_the_writers_text_deltas_are_the_events_named_event_writes() -> None:
    from edgeproxy._protocol.dialects import AnswerText
    from edgeproxy._protocol.dialects._base import named_event

    text = 'a "quoted" \n ü \u2028 piece'
    messages = MESSAGES.writer(AnswerText("msg_1", "m", 0))
    messages.open()
    assert messages.piece(text) == named_event(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
    )
    responses = RESPONSES.writer(AnswerText("resp_1", "m", 0))
    responses.open()
    sequence = responses.sequence  # type: ignore[attr-defined]
    item = responses.item_id  # type: ignore[attr-defined]
    assert responses.piece(text) == named_event(
        "response.output_text.delta",
        {
            "type": "response.output_text.delta",
            "sequence_number": sequence,
            "item_id": item,
            "output_index": 0,
            "content_index": 0,
            "delta": text,
            "logprobs": [],
        },
    )
