"""Fuzz SSE handling: reading events, the end of a stream, assembly, and the usage tracker.

Input: one flag byte, then an SSE body as an upstream might send it. Flag
bit 0 picks the usage tracker's mode (0: SSE, 1: JSON); the other bits give
the size of the chunks the body is fed in (1 to 128 bytes).

Property: nothing raises. The events ``SSEReader`` reads, and its tail, are the
body byte for byte; each dialect's ``is_end``, ``is_error`` and ``usage_only``
answer a bool; each dialect's ``assemble`` gives None or an answer that ``orjson``
can write (a cached stream replayed to a client that asked for JSON), and the
stream ``stream_of`` writes of that answer assembles back to the same one (for chat:
the same messages, texts and usage; for the others: the same text). The usage
tracker's result is None or a dict, the same however the body is cut into chunks.
"""

from __future__ import annotations

import sys
from typing import Any

import orjson
from _harness import check, fuzz

from edgeproxy._protocol.dialects import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Dialect
from edgeproxy._protocol.sse import SSEEvent, SSEEventTooLarge, SSEReader
from edgeproxy._protocol.usage import UsageTracker


def _usage(body: bytes, *, sse: bool, size: int) -> dict[str, Any] | None:
    tracker = UsageTracker(sse=sse)
    for start in range(0, len(body), size):
        tracker.feed(body[start : start + size])
    result = tracker.result()
    check(result is None or type(result) is dict, "usage not a dict", result)
    return result


def _summary(answer: dict[str, Any]) -> list[Any]:
    """What a stream carries of a completion: per choice its text, tool calls and finish."""
    out: list[Any] = []
    for choice in answer["choices"]:
        message = choice.get("message") or {}
        out.append(
            (
                choice.get("index"),
                message.get("role"),
                message.get("content") or "",
                message.get("tool_calls"),
                choice.get("text"),
                choice.get("finish_reason"),
            )
        )
    return [answer.get("usage"), out]


def _read(body: bytes) -> list[SSEEvent]:
    return SSEReader(max_event=len(body) + 1).feed(body)


def _check_chat(dialect: Dialect, events: list[SSEEvent]) -> None:
    answer = dialect.assemble(events)
    if answer is None:
        return
    check(type(answer) is dict and type(answer.get("choices")) is list, "not a completion", answer)
    orjson.dumps(answer)  # what the cache sends to a client that asked for JSON
    again_events = dialect.stream_of(answer, include_usage=True)
    check(again_events is not None, "assembled answer does not stream", answer)
    assert again_events is not None
    again = dialect.assemble(_read(b"".join(again_events)))
    if again is None:
        # No choices and no usage: the stream form is [DONE] alone, with nothing to carry.
        check(not answer["choices"] and "usage" not in answer, "no round trip", again_events)
        return
    check(_summary(again) == _summary(answer), "round trip changed the answer", answer, again)


def _check_other(dialect: Dialect, events: list[SSEEvent]) -> None:
    answer = dialect.assemble(events)
    if answer is None:
        return
    check(type(answer) is dict, "not an answer", answer)
    orjson.dumps(answer)
    text = dialect.text_of(answer)
    if text is None:
        return
    again_events = dialect.stream_of(answer, include_usage=True)
    check(again_events is not None, "an answer with text does not stream", answer)
    assert again_events is not None
    again = dialect.assemble(_read(b"".join(again_events)))
    check(again is not None, "its stream does not assemble", again_events)
    assert again is not None
    again_text = dialect.text_of(again)
    check(
        again_text is not None and again_text.text == text.text,
        "round trip changed the text",
        answer,
        again,
    )


def test_one_input(data: bytes) -> None:
    if not data:
        return
    flags, body = data[0], data[1:]
    reader = SSEReader()
    try:
        events = reader.feed(body)
    except SSEEventTooLarge:
        return
    check(b"".join(e.raw for e in events) + reader.tail == body, "events lose bytes", body)
    for dialect in (CHAT, RESPONSES, MESSAGES):
        for event in events:
            check(type(dialect.is_end(event)) is bool, "is_end", event)
            check(type(dialect.is_error(event)) is bool, "is_error", event)
            check(type(dialect.usage_only(event)) is bool, "usage_only", event)
    _check_chat(CHAT, events)
    _check_chat(COMPLETIONS, events)
    _check_other(RESPONSES, events)
    _check_other(MESSAGES, events)
    sse = not flags & 1
    whole = _usage(body, sse=sse, size=max(1, len(body)))
    cut = _usage(body, sse=sse, size=1 + (flags >> 1))
    check(whole == cut, "usage depends on chunking", whole, cut)


if __name__ == "__main__":
    fuzz(
        test_one_input,
        "edgeproxy._protocol.sse",
        "edgeproxy._protocol.dialects",
        "edgeproxy._protocol.usage",
        "edgeproxy._protocol.openai",
    )
    sys.exit(0)
