"""Fuzz SSE handling: event splitting, the end-of-stream check, assembly, and the usage tracker.

Input: one flag byte, then an SSE body as an upstream might send it. Flag
bit 0 picks the usage tracker's mode (0: SSE, 1: JSON); the other bits give
the size of the chunks the body is fed in (1 to 128 bytes).

Property: nothing raises. ``split_events`` gives non-blank events, each
ending in one blank line and holding none inside; ``stream_complete`` and
``is_usage_event`` answer a bool; ``assemble`` gives None or a completion
with a list of choices that ``orjson`` can write (a cached stream replayed
to a client that asked for JSON), and ``explode`` of that completion
assembles back to the same messages, texts and usage. The usage tracker's
result is None or a dict, the same however the body is cut into chunks.
"""

from __future__ import annotations

import sys
from typing import Any

import orjson
from _harness import check, fuzz

from edgeproxy._protocol.usage import UsageTracker
from edgeproxy._stages.cache.entry import (
    assemble,
    explode,
    is_usage_event,
    split_events,
    stream_complete,
)


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


def _check_answer(events: list[bytes]) -> None:
    answer = assemble(events)
    if answer is None:
        return
    check(type(answer) is dict and type(answer.get("choices")) is list, "not a completion", answer)
    orjson.dumps(answer)  # what the cache sends to a client that asked for JSON
    again_events = explode(answer, include_usage=True)
    check(again_events is not None, "assembled answer does not explode", answer)
    assert again_events is not None
    again = assemble(again_events)
    if again is None:
        # No choices and no usage: the stream form is [DONE] alone, with nothing to carry.
        check(not answer["choices"] and "usage" not in answer, "no round trip", again_events)
        return
    check(_summary(again) == _summary(answer), "round trip changed the answer", answer, again)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    flags, body = data[0], data[1:]
    events = split_events(body)
    for event in events:
        check(event.endswith(b"\n\n") and event.strip(), "event shape", event)
        check(b"\n\n" not in event[:-2], "blank line inside an event", event)
        check(type(is_usage_event(event)) is bool, "is_usage_event", event)
    check(type(stream_complete(body)) is bool, "stream_complete", body)
    _check_answer(events)
    sse = not flags & 1
    whole = _usage(body, sse=sse, size=max(1, len(body)))
    cut = _usage(body, sse=sse, size=1 + (flags >> 1))
    check(whole == cut, "usage depends on chunking", whole, cut)


if __name__ == "__main__":
    fuzz(
        test_one_input,
        "edgeproxy._stages.cache.entry",
        "edgeproxy._protocol.usage",
        "edgeproxy._protocol.openai",
    )
    sys.exit(0)
