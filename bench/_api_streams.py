"""Canned streams of the OpenAI Responses API and Anthropic's Messages API for ``instr.py``.

Each stream is what the API sends for a short text answer of ``tokens`` deltas, with the
same token text as ``instr.py``'s chat stream (`` tok000000``...), event by event:

* Responses: ``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``, one
  ``response.output_text.delta`` per token (``sequence_number`` counting on), then
  ``response.output_text.done``, ``response.content_part.done``,
  ``response.output_item.done`` and ``response.completed`` with ``usage``;
* Messages: ``message_start``, ``content_block_start``, ``ping``, one
  ``content_block_delta`` per token, ``content_block_stop``, ``message_delta`` (with
  ``usage``) and ``message_stop``.

nginx paces a static file by bytes (``limit_rate``) in writes of ``sendfile_max_chunk``
bytes, so one event per write needs events of one length. Every event is padded to the
length ``unit`` of the longest one that does not carry the whole answer (JSON whitespace
before its closing brace: the event keeps the ``event:`` line and the one ``data:`` line
servers send). The events that repeat the whole answer (the Responses API's four ``done``
and ``completed`` events) cannot be that short: each is padded to a whole number of units,
so it takes a few writes and the writes after it stay aligned. Over HTTP/1.1 nginx writes
the response head first, paced the same way: a head longer than one write shares its last
write with the body, and then the first event is padded so that the two end on a unit
(``body_h1``), as the chat stream's leading comment does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOKEN = " tok%06d"  # as instr.py's chat chunks
CREATED_AT = 1700000000
RESPONSE_ID = "resp_68b9f2c4a1e08190a3d5c2b7e6f41d0b0c9a8e7f6d5c4b3a"
ITEM_ID = "msg_68b9f2c4b7d48190b1e2d3c4a5f60718293a4b5c6d7e8f90"
MESSAGE_ID = "msg_01XFDUDYJgAACzvnptvVoYEL"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _dumps(payload) + b"\n\n"


@dataclass(frozen=True)
class ApiStream:
    """One API's canned stream: its events unpadded, and which repeat the whole answer."""

    kind: str  # the --only name: "responses", "messages"
    path: str  # the API's path
    location: str  # the nginx location its file is served under
    events: tuple[bytes, ...]
    whole: tuple[bool, ...]  # the event repeats the whole answer: may take several writes

    @property
    def unit(self) -> int:
        """Bytes of every event (and of every write): the longest one not ``whole``."""
        return max(len(e) for e, w in zip(self.events, self.whole, strict=True) if not w)

    def body(self, first_len: int | None = None) -> bytes:
        """The stream, each event padded to ``unit`` bytes (a whole event to a multiple);
        the first event to ``first_len`` bytes when given."""
        unit = self.unit
        out = []
        for i, (event, whole) in enumerate(zip(self.events, self.whole, strict=True)):
            size = -(-len(event) // unit) * unit if whole else unit
            if i == 0 and first_len is not None:
                size = first_len
            out.append(pad(event, size))
        return b"".join(out)

    def body_h1(self, head_len: int, head_cl: int) -> bytes:
        """The stream for HTTP/1.1, whose head (``head_len`` bytes, measured with a body of
        ``head_cl`` bytes) nginx writes first, paced like the body: a head that fits in one
        write goes alone, and the body's writes start with it; a longer one is cut into
        writes whose last piece goes out with the body's first bytes, so the first event is
        padded for that piece and it to fill whole writes."""
        unit, first = self.unit, len(self.events[0])
        body = self.body()
        for _ in range(4):  # the head's Content-Length changes with the body
            head = head_len - len(str(head_cl)) + len(str(len(body)))
            if head <= unit:
                new = self.body()
            else:
                new = self.body(-(-(head + first) // unit) * unit - head)
            if len(new) == len(body):
                return new
            body = new
        raise AssertionError("the head length did not settle")

    @property
    def count(self) -> int:
        return len(self.events)


def pad(event: bytes, size: int) -> bytes:
    """``event`` (``...data: {...}\\n\\n``) grown to ``size`` bytes by JSON whitespace."""
    extra = size - len(event)
    if extra < 0:
        raise ValueError(f"an event of {len(event)} bytes does not fit in {size}")
    if not event.endswith(b"}\n\n"):
        raise ValueError("not an event with a JSON object")
    return event[:-3] + b" " * extra + event[-3:]


def _text(tokens: int) -> str:
    return "".join(TOKEN % i for i in range(tokens))


def responses_stream(tokens: int, *, model: str = "bench") -> ApiStream:
    """A Responses API stream of ``tokens`` output text deltas."""
    text = _text(tokens)
    seq = 0
    events: list[bytes] = []
    whole: list[bool] = []

    def add(name: str, carries: bool = False, **fields: Any) -> None:
        nonlocal seq
        events.append(_event(name, {"type": name, "sequence_number": seq, **fields}))
        whole.append(carries)
        seq += 1

    def part(value: str) -> dict[str, Any]:
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": value}

    def item(done: bool) -> dict[str, Any]:
        return {
            "id": ITEM_ID,
            "type": "message",
            "status": "completed" if done else "in_progress",
            "content": [part(text)] if done else [],
            "role": "assistant",
        }

    def response(done: bool) -> dict[str, Any]:
        usage = {
            "input_tokens": 2,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": tokens + 2,
        }
        return {
            "id": RESPONSE_ID,
            "object": "response",
            "created_at": CREATED_AT,
            "status": "completed" if done else "in_progress",
            "background": False,
            "completed_at": CREATED_AT + 2 if done else None,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "max_output_tokens": tokens,
            "max_tool_calls": None,
            "model": model,
            "output": [item(True)] if done else [],
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "prompt_cache_key": None,
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": None,
            "service_tier": "default",
            "store": True,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "tool_choice": "auto",
            "tools": [],
            "top_logprobs": 0,
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": usage if done else None,
            "user": None,
            "metadata": {},
        }

    where: dict[str, Any] = {"item_id": ITEM_ID, "output_index": 0, "content_index": 0}
    add("response.created", response=response(False))
    add("response.in_progress", response=response(False))
    add("response.output_item.added", output_index=0, item=item(False))
    add("response.content_part.added", **where, part=part(""))
    for i in range(tokens):
        add("response.output_text.delta", **where, delta=TOKEN % i, logprobs=[])
    add("response.output_text.done", True, **where, text=text, logprobs=[])
    add("response.content_part.done", True, **where, part=part(text))
    add("response.output_item.done", True, output_index=0, item=item(True))
    add("response.completed", True, response=response(True))
    return ApiStream("responses", "/v1/responses", "/sse-responses/", tuple(events), tuple(whole))


def messages_stream(tokens: int, *, model: str = "claude-bench") -> ApiStream:
    """An Anthropic Messages stream of ``tokens`` text deltas."""
    start = {
        "type": "message_start",
        "message": {
            "id": MESSAGE_ID,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": 2,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 1,
                "service_tier": "standard",
            },
        },
    }
    events = [
        _event("message_start", start),
        _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        _event("ping", {"type": "ping"}),
    ]
    for i in range(tokens):
        delta = {"type": "text_delta", "text": TOKEN % i}
        events.append(
            _event(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
            )
        )
    events += [
        _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": tokens},
            },
        ),
        _event("message_stop", {"type": "message_stop"}),
    ]
    return ApiStream(
        "messages", "/v1/messages", "/sse-messages/", tuple(events), (False,) * len(events)
    )


def responses_request(tokens: int, model: str = "m") -> bytes:
    """A streamed Responses request for ``tokens`` tokens (the fake region honours it)."""
    return _dumps(
        {
            "model": model,
            "input": "hello there",
            "temperature": 1,
            "stream": True,
            "max_output_tokens": tokens,
        }
    )


def messages_request(tokens: int, model: str = "m") -> bytes:
    """A streamed Messages request for ``tokens`` tokens."""
    return _dumps(
        {
            "model": model,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": "hello there"}],
            "temperature": 1,
            "stream": True,
        }
    )


MESSAGES_HEADERS = {"anthropic-version": "2023-06-01"}
