"""The dialects on their own: each API's wire semantics, read and written without a proxy.

What they write is read back by the official SDKs' own models and stream accumulators,
so that a change that the SDKs would not parse fails here first."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    MESSAGES,
    OPENAI,
    RESPONSES,
    AnswerText,
    Dialect,
    dialect_named,
)
from edgeproxy._protocol.endpoints import ENDPOINTS, dialect_for
from edgeproxy._protocol.prefix import prompt_key
from edgeproxy._protocol.sse import SSEEvent, SSEReader

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def events(data: bytes) -> list[SSEEvent]:
    reader = SSEReader()
    out = reader.feed(data)
    assert reader.tail == b""
    return out


def written(dialect: Dialect, pieces: list[str], finish: str = "stop") -> bytes:
    writer = dialect.writer(AnswerText("id-1", "m", 7, usage=USAGE), include_usage=True)
    out = writer.open()
    for piece in pieces:
        out += writer.piece(piece)
    return out + writer.close(finish, USAGE)


def test_every_endpoint_names_a_dialect_and_names_are_unique() -> None:
    names = [e.dialect.name for e in ENDPOINTS if e.dialect is not OPENAI]
    assert len(names) == len(set(names))
    for endpoint in ENDPOINTS:
        assert dialect_named(endpoint.dialect.name or None) is endpoint.dialect
    assert dialect_for("/openai/deployments/x/chat/completions") is CHAT
    assert dialect_for("/v1/messages") is MESSAGES and dialect_for("/v1/files") is OPENAI
    assert dialect_named(None) is OPENAI and dialect_named("nope") is OPENAI


BAD = [
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     "temperature", "invalid_type"),
    (CHAT, {"model": "m", "messages": []}, "messages", "empty_array"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}]}, "model", None),
    (CHAT, {"model": "m", "messages": [{}], "temperature": 2.5}, "temperature", "invalid_value"),
    (CHAT, {"model": "m", "messages": [{}], "top_p": -0.1}, "top_p", "invalid_value"),
    (CHAT, {"model": "m", "messages": [{}], "max_tokens": -1}, "max_tokens", "invalid_value"),
    (CHAT, {"model": "m", "messages": "bad"}, "messages", "invalid_type"),
    (CHAT, {"model": 3, "messages": [{}]}, "model", "invalid_type"),
    (CHAT, {"model": "m", "messages": [{}], "n": 0}, "n", "invalid_value"),
    (CHAT, {"model": "m", "messages": [{}], "max_completion_tokens": 2.5}, "max_completion_tokens",
     "invalid_type"),
    (CHAT, {"model": "", "messages": [{}]}, "model", "invalid_value"),
    (COMPLETIONS, {"model": "m", "prompt": []}, "prompt", None),
    (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens", None),
    (EMBEDDINGS, {"model": "m", "input": "x", "dimensions": 0}, "dimensions", None),
    (EMBEDDINGS, {"model": "m", "input": []}, "input", None),
    (RESPONSES, {"model": "m", "input": []}, "input", None),
    (RESPONSES, {"model": "m"}, "input", None),
    (RESPONSES, {"input": "x"}, "model", None),
    (RESPONSES, {"model": "m", "input": "x", "top_p": 1.5}, "top_p", None),
    (RESPONSES, {"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    (MESSAGES, {"model": "m", "messages": [{}]}, "max_tokens", None),
    (MESSAGES, {"model": "m", "max_tokens": 5, "messages": [{}], "temperature": 1.5},
     "temperature", None),
    (MESSAGES, {"model": "m", "max_tokens": 5, "messages": [{}], "top_k": -1}, "top_k", None),
    (MESSAGES, {"model": "m", "max_tokens": 0, "messages": [{}]}, "max_tokens", None),
]  # fmt: skip


@pytest.mark.parametrize(("dialect", "body", "param", "code"), BAD)
def test_each_dialect_refuses_what_every_server_refuses(
    dialect: Dialect, body: dict[str, Any], param: str, code: str | None
) -> None:
    err = dialect.check(body)
    assert err is not None and err.status == 400 and err.param == param, err
    if code is not None:
        assert err.code == code


GOOD = [
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}),
    (CHAT, {"model": "m", "messages": [{"role": "user"}], "max_completion_tokens": 5, "top_p": 1}),
    (COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]}),
    (EMBEDDINGS, {"model": "m", "input": ["a", "b"]}),
    (RESPONSES, {"model": "m", "input": "x", "temperature": 2}),
    (RESPONSES, {"model": "m", "previous_response_id": "resp_1", "input": "y"}),
    (MESSAGES, {"model": "m", "max_tokens": 5, "messages": [{}], "system": "s", "top_k": 3}),
    # JSON has one kind of number: an integer may come as 5.0.
    (
        CHAT,
        {"model": "m", "messages": [{"role": "user"}], "max_tokens": 5.0, "n": 1.0, "seed": 7.0},
    ),
    # Scoring a prompt: no token generated.
    (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 0, "echo": True}),
    (COMPLETIONS, {"model": "m", "prompt": ""}),
    # A stored prompt names the model and the input; a follow-up needs no new input.
    (RESPONSES, {"prompt": {"id": "pmpt_1"}}),
    (RESPONSES, {"model": "m", "previous_response_id": "resp_1", "input": []}),
    (RESPONSES, {"model": "m", "conversation": "conv_1"}),
    # Unknown fields are a server's business, not the edge's.
    (CHAT, {"model": "m", "messages": [{"role": "user"}], "chat_template_kwargs": {"x": 1}}),
]


@pytest.mark.parametrize(("dialect", "body"), GOOD)
def test_what_some_server_accepts_passes(dialect: Dialect, body: dict[str, Any]) -> None:
    assert dialect.check(body) is None


def test_error_bodies_are_in_each_apis_shape() -> None:
    err = ProxyError(503, "service_unavailable", "busy", code="overloaded")
    assert orjson.loads(CHAT.error_body(err)) == {
        "error": {"message": "busy", "type": "service_unavailable", "param": None,
                  "code": "overloaded"}
    }  # fmt: skip
    assert orjson.loads(MESSAGES.error_body(err)) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "busy"},
    }
    (event,) = events(RESPONSES.error_event(err, sequence=9))
    data = orjson.loads(event.data)
    assert event.event == "error" and data["type"] == "error" and data["sequence_number"] == 9
    assert data["code"] == "overloaded" and data["error"]["message"] == "busy"
    assert MESSAGES.heartbeat.startswith(b"event: ping") and CHAT.heartbeat.startswith(b":")


def test_a_chat_stream_commits_at_its_first_content_not_its_role() -> None:
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    tool = b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n'
    assert [CHAT.commits(e) for e in events(role + token + tool)] == [False, True, True]
    assert CHAT.commits(events(b"data: [DONE]\n\n")[0])
    assert CHAT.commits(events(b'data: {"error":{"message":"x"}}\n\n')[0])


def test_responses_and_messages_streams_commit_at_content() -> None:
    stream = written(RESPONSES, ["a", "b"])
    kinds = [(e.event, RESPONSES.commits(e)) for e in events(stream)]
    first = next(i for i, (_, commits) in enumerate(kinds) if commits)
    assert kinds[first][0] == "response.output_text.delta"
    stream = written(MESSAGES, ["a"])
    kinds = [(e.event, MESSAGES.commits(e)) for e in events(stream + MESSAGES.heartbeat)]
    first = next(i for i, (_, commits) in enumerate(kinds) if commits)
    assert kinds[first][0] == "content_block_delta"
    assert not MESSAGES.commits(events(MESSAGES.heartbeat)[0])


def test_the_responses_writer_writes_events_the_openai_sdk_validates() -> None:
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_json(e.data) for e in events(written(RESPONSES, ["Hi", "!"]))]
    assert [p.sequence_number for p in parsed] == list(range(len(parsed)))
    assert parsed[-1].type == "response.completed"
    assert parsed[-1].response.output_text == "Hi!"
    assert parsed[-1].response.usage.output_tokens == 3
    assert {p.item_id for p in parsed if hasattr(p, "item_id")} == {parsed[2].item.id}


def test_the_messages_writer_writes_events_the_anthropic_sdk_validates() -> None:
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    stream = written(MESSAGES, ["Hello", " world"], finish="length")
    parsed = [adapter.validate_json(e.data) for e in events(stream)]
    assert [p.type for p in parsed] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert parsed[5].delta.stop_reason == "max_tokens" and parsed[5].usage.output_tokens == 3


@pytest.mark.parametrize("dialect", [CHAT, RESPONSES, MESSAGES])
def test_an_answer_reads_back_as_the_text_it_says(dialect: Dialect) -> None:
    answer = dialect.answer(AnswerText("id-1", "m", 7, "Hello", "length", USAGE))
    text = dialect.text_of(answer)
    assert text is not None and (text.text, text.finish) == ("Hello", "length")
    assert dialect.counted(dialect.usage_of(answer) or {})["total_tokens"] == 8


@pytest.mark.parametrize("dialect", [CHAT, COMPLETIONS, RESPONSES, MESSAGES])
def test_a_recorded_stream_assembles_into_its_json_answer(dialect: Dialect) -> None:
    answer = dialect.assemble(events(written(dialect, ["Hel", "lo"])))
    assert answer is not None
    text = dialect.text_of(answer)
    assert text is not None and text.text == "Hello"
    # A stream without its end is not an answer.
    assert dialect.assemble(events(written(dialect, ["Hel"]))[:-1]) is None


def test_state_refs_and_what_stores() -> None:
    body: dict[str, Any] = {"model": "m", "input": "x"}
    assert RESPONSES.stores(body) and RESPONSES.state_refs(body) == []
    assert not RESPONSES.stores({**body, "store": False})
    assert RESPONSES.state_refs({**body, "previous_response_id": "resp_1"}) == [
        ("previous_response_id", "resp_1")
    ]
    assert RESPONSES.state_refs({**body, "conversation": {"id": "conv_1"}}) == [
        ("conversation", "conv_1")
    ]
    assert CHAT.state_refs({"messages": []}) == [] and not MESSAGES.stores({})
    assert RESPONSES.keeps_state and not CHAT.keeps_state and not MESSAGES.keeps_state
    # Uploaded files in the input, vector stores in file_search: held by a region too.
    body = {
        **body,
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "read this"},
                    {"type": "input_file", "file_id": "file-1"},
                ],
            }
        ],
        "tools": [{"type": "file_search", "vector_store_ids": ["vs_1", "vs_2"]}],
    }
    assert RESPONSES.state_refs(body) == [("input", "file-1"), ("tools", "vs_1"), ("tools", "vs_2")]
    assert RESPONSES.ref_not_found("input", "file-1").message == "No such File object: file-1"
    assert RESPONSES.ref_not_found("tools", "vs_1").message == (
        "No vector store found with id 'vs_1'."
    )


def test_the_404_of_each_state_ref_is_the_apis_own() -> None:
    previous = RESPONSES.ref_not_found("previous_response_id", "resp_1")
    assert (previous.status, previous.message, previous.param, previous.code) == (
        404,
        "Previous response with id 'resp_1' not found.",
        "previous_response_id",
        "previous_response_not_found",
    )
    conversation = RESPONSES.ref_not_found("conversation", "conv_1")
    assert (conversation.status, conversation.message, conversation.param, conversation.code) == (
        404,
        "Conversation with id 'conv_1' not found.",
        None,
        None,
    )
    assert conversation.type == "invalid_request_error"


def test_deterministic_and_max_tokens_by_api() -> None:
    assert CHAT.deterministic({"seed": 1}) and not RESPONSES.deterministic({"seed": 1})
    assert MESSAGES.deterministic({"temperature": 0}) and EMBEDDINGS.deterministic({})
    assert CHAT.max_tokens({"max_completion_tokens": 9, "max_tokens": 3}) == 9
    assert RESPONSES.max_tokens({"max_output_tokens": 4}) == 4
    assert MESSAGES.max_tokens({"max_tokens": 5}) == 5


def test_the_system_prompt_is_part_of_the_affinity_key_of_every_api() -> None:
    long = "word " * 200

    def key(dialect: Dialect, body: dict[str, Any]) -> Any:
        return prompt_key(body, chat=True, turns=dialect.conversation(body))

    base = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": long}]}
    same = key(MESSAGES, base)
    assert same == key(MESSAGES, dict(base))
    assert key(MESSAGES, {**base, "system": long}) != same
    responses = {"model": "m", "input": long}
    assert key(RESPONSES, responses) != key(RESPONSES, {**responses, "instructions": long})
    # The same conversation, whichever API carries it, keys the same KV cache.
    chat = {"model": "m", "messages": [{"role": "user", "content": long}]}
    assert key(CHAT, chat) == key(RESPONSES, responses) == same


@pytest.mark.parametrize("dialect", [CHAT, RESPONSES, MESSAGES])
def test_a_keep_alive_comment_commits_no_stream(dialect: Dialect) -> None:
    (comment,) = events(b": keepalive\n\n")
    assert not dialect.commits(comment)
