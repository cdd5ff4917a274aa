"""Cache entries: the Redis encoding, garbage detection, and stream/JSON conversions."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from edgeproxy._cache.entry import BadEntry, Entry, replay_parts, response_headers
from edgeproxy._protocol.dialects import CHAT, COMPLETIONS, EMBEDDINGS
from edgeproxy._protocol.sse import SSEEvent, SSEReader

from .conftest import FakeClock


def read(raw: list[bytes]) -> list[SSEEvent]:
    return SSEReader().feed(b"".join(raw))


def assemble(raw: list[bytes]) -> dict[str, Any] | None:
    return CHAT.assemble(read(raw))


def explode(answer: dict[str, Any], *, include_usage: bool) -> list[bytes] | None:
    dialect = COMPLETIONS if answer.get("object") == "text_completion" else CHAT
    return dialect.stream_of(answer, include_usage=include_usage)


def is_usage_event(raw: bytes) -> bool:
    (event,) = read([raw])
    return CHAT.usage_only(event)


def event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> bytes:
    return event(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 7,
            "model": "m",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
        }
    )


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Hello"}),
    chunk({"content": " world"}),
    chunk({}, "stop"),
    event(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 7,
            "model": "m",
            "choices": [],
            "usage": USAGE,
        }
    ),
    b"data: [DONE]\n\n",
]


def make_entry(kind: str = "sse", body: bytes | None = None, **kwargs: Any) -> Entry:
    return Entry.build(
        status=200,
        headers=[("Content-Type", "text/event-stream"), ("Date", "x"), ("X-Edgeproxy-Region", "r")],
        body=b"".join(STREAM) if body is None else body,
        kind=kind,
        ttl=kwargs.pop("ttl", 60.0),
        swr=kwargs.pop("swr", 10.0),
        sie=kwargs.pop("sie", 100.0),
        delta=0.25,
        region="r1",
        now=1000.0,
    )


def test_encode_decode_round_trip_drops_delivery_headers() -> None:
    entry = make_entry()
    assert entry.headers == (("content-type", "text/event-stream"),)
    back = Entry.decode(entry.encode())
    assert back == entry
    assert (back.fresh_until, back.swr_until, back.sie_until) == (1060.0, 1070.0, 1160.0)
    assert back.keep_until == 1160.0
    assert back.age(1012.7) == 12
    assert Entry.decode(bytearray(entry.encode())) == entry


def test_build_reads_its_clock_when_given_no_time() -> None:
    clock = FakeClock(start=5000.0)
    entry = Entry.build(
        status=200,
        headers=[],
        body=b"{}",
        kind="json",
        ttl=60.0,
        swr=10.0,
        sie=100.0,
        delta=0.1,
        region=None,
        clock=clock,
    )
    assert (entry.stored_at, entry.fresh_until, entry.swr_until) == (5000.0, 5060.0, 5070.0)
    assert entry.sie_until == 5160.0
    clock.advance(61.5)
    assert entry.age(clock()) == 61
    assert entry.age(4999.0) == 0  # a clock behind the storing host's: never negative


@pytest.mark.parametrize(
    "data",
    [
        None,
        "a str, as a decoding serializer would hand back",
        b"",
        b"EPC1",
        b"EPC2\x00\x00\x00\x02{}",
        b"EPC1\x00\x00\x00\x05{nope",
        b"EPC1\x00\x00\x00\x02{}body",
        b"EPC1\x00\x00\x10\x00{}",
    ],
)
def test_garbage_is_rejected(data: Any) -> None:
    with pytest.raises(BadEntry):
        Entry.decode(data)


def test_truncated_and_tampered_entries_are_rejected() -> None:
    good = make_entry().encode()
    with pytest.raises(BadEntry):
        Entry.decode(good[:-1])
    for field, value in [("s", "200"), ("s", 99), ("k", "zip"), ("t", math.inf), ("h", 5)]:
        meta_len = int.from_bytes(good[4:8], "big")
        meta = orjson.loads(good[8 : 8 + meta_len])
        meta[field] = value
        raw = orjson.dumps(meta)  # orjson writes inf as null
        with pytest.raises(BadEntry):
            Entry.decode(b"EPC1" + len(raw).to_bytes(4, "big") + raw + good[8 + meta_len :])


def test_xfetch_refreshes_earlier_as_expiry_nears() -> None:
    entry = make_entry(ttl=10.0)  # fresh until 1010, took 0.25 s to compute
    assert not entry.should_refresh_early(1000.0, 1.0, 1.0)  # -log(1) = 0: never early
    assert not entry.should_refresh_early(1000.0, 0.0, 1e-300)  # beta 0 turns it off
    assert entry.should_refresh_early(1009.9, 1.0, 0.5)  # 0.25 * 0.69 > 0.1 left
    assert not entry.should_refresh_early(1005.0, 1.0, 0.5)
    assert entry.should_refresh_early(1005.0, 1.0, 1e-10)  # rare, but possible long before


def test_a_stream_entry_reads_as_its_events_and_usage_events() -> None:
    body = b"".join(STREAM).replace(b"\n", b"\r\n")
    events = make_entry(body=body).events()
    # Each event as recorded, byte for byte (CRLF line ends kept).
    assert [e.raw for e in events] == [e.replace(b"\n", b"\r\n") for e in STREAM]
    assert [CHAT.usage_only(e) for e in events] == [False] * 4 + [True, False]
    # An unfinished end (never recorded) is one more event: the parts are the whole body.
    cut = make_entry(body=b"".join(STREAM) + b"data: {")
    assert b"".join(e.raw for e in cut.events()) == b"".join(STREAM) + b"data: {"


def test_assemble_chat_stream_with_tool_calls_and_two_choices() -> None:
    stream = [
        chunk({"role": "assistant"}),
        chunk({"tool_calls": [{"index": 0, "id": "t1", "type": "function",
                               "function": {"name": "get_", "arguments": '{"a":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": "1}"}}]}),
        chunk({"content": "other"}, index=1),
        chunk({}, "tool_calls"),
        chunk({}, "stop", index=1),
        b"data: [DONE]\n\n",
    ]  # fmt: skip
    answer = assemble(stream)
    assert answer is not None
    assert answer["object"] == "chat.completion" and answer["id"] == "c1"
    first, second = answer["choices"]
    assert first["message"]["tool_calls"] == [
        {
            "id": "t1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"a":1}'},
        }
    ]
    assert first["message"]["content"] is None and first["finish_reason"] == "tool_calls"
    assert second["message"]["content"] == "other" and second["finish_reason"] == "stop"


def test_assemble_refuses_what_it_does_not_know() -> None:
    done = b"data: [DONE]\n\n"
    assert assemble([event({"object": "something.else"}), done]) is None
    assert assemble([done]) is None
    assert assemble([event({"object": "text_completion", "choices": ["x"]}), done]) is None
    # A stream without its end, or with an error, is not an answer.
    assert assemble(STREAM[:-1]) is None
    assert assemble([*STREAM[:2], event({"error": {"message": "x"}}), done]) is None


def test_explode_then_assemble_gives_the_answer_back() -> None:
    answer = assemble(STREAM)
    assert answer is not None
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert answer["usage"] == USAGE
    events = explode(answer, include_usage=True)
    assert events is not None and events[-1] == b"data: [DONE]\n\n"
    assert len(events) == 1 + 2 + 1 + 1 + 1  # role, two words, finish, usage, DONE
    assert assemble(events) == answer
    no_usage = explode(answer, include_usage=False)
    assert no_usage is not None and not any(is_usage_event(e) for e in no_usage)

    text = {
        "id": "x",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "a b  c", "logprobs": None, "finish_reason": "length"}],
    }
    events = explode(text, include_usage=True)
    assert events is not None
    assert assemble(events) == text
    assert explode({"object": "list", "data": []}, include_usage=False) is None


def test_the_writer_and_the_chunks_of_several_choices_write_the_same_bytes() -> None:
    # One choice of text goes through chat's writer; anything more through the chunks of
    # each choice: both stream a completion the same way.
    answer = assemble(STREAM)
    assert answer is not None
    answer["system_fingerprint"] = "fp_1"
    written = CHAT.stream_of(answer, include_usage=True)
    two = {**answer, "choices": [answer["choices"][0], {**answer["choices"][0], "index": 1}]}
    chunked = CHAT.stream_of(two, include_usage=True)
    assert written is not None and chunked is not None
    first_choice = [e for e in chunked if b'"index":1' not in e]
    assert written == first_choice
    assert all(b'"system_fingerprint":"fp_1"' in e for e in written[:-1])


def test_replay_parts_in_every_direction() -> None:
    sse = make_entry()
    parts, is_sse = replay_parts(sse, wants_sse=True, include_usage=True, dialect=CHAT) or (
        [],
        False,
    )
    assert is_sse and parts == STREAM
    parts, is_sse = replay_parts(sse, wants_sse=True, include_usage=False, dialect=CHAT) or (
        [],
        False,
    )
    assert is_sse and len(parts) == len(STREAM) - 1
    parts, is_sse = replay_parts(sse, wants_sse=False, include_usage=False, dialect=CHAT) or (
        [],
        True,
    )
    assert not is_sse and orjson.loads(parts[0])["choices"][0]["message"]["content"] == (
        "Hello world"
    )
    assert dict(response_headers(sse, sse=False))["content-type"] == "application/json"

    embedding = b'{"object":"list","data":[{"embedding":[0.1]}]}'
    as_json = make_entry("json", embedding)
    for dialect in (EMBEDDINGS, CHAT):
        assert replay_parts(as_json, wants_sse=True, include_usage=False, dialect=dialect) == (
            [embedding],
            False,
        )
    assert (
        replay_parts(
            make_entry("json", b"[not json"), wants_sse=True, include_usage=False, dialect=CHAT
        )
        is None
    )
    assert (
        replay_parts(
            make_entry("sse", b"data: {}\n\n"), wants_sse=False, include_usage=False, dialect=CHAT
        )
        is None
    )
    raw = make_entry("raw", b"\x00\x01")
    assert replay_parts(raw, wants_sse=True, include_usage=True, dialect=CHAT) == (
        [b"\x00\x01"],
        False,
    )
