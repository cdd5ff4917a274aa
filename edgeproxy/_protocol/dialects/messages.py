"""Anthropic's Messages API (``/v1/messages``, and ``/v1/messages/count_tokens``).

A request has ``model``, ``messages`` and ``max_tokens`` (all required), the system prompt
apart in ``system``, ``temperature`` from 0 to 1. Errors are
``{"type": "error", "error": {"type", "message"}}``, the type named by the status.

A stream is named events: ``message_start`` (the message, and in its ``usage`` the input
tokens, cache reads and writes), ``content_block_start``, ``ping``s, ``content_block_delta``s
(the first content), ``content_block_stop``, ``message_delta`` (the stop reason and the
output tokens so far) and ``message_stop``. A broken stream ends with ``event: error``,
which the anthropic SDK raises as its status error. Heartbeats are ``event: ping``.
"""

from __future__ import annotations

import secrets
from typing import Any, ClassVar, Final

import orjson

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects._base import (
    AnswerText,
    Dialect,
    StreamWriter,
    counted_io,
    loads,
    tokens,
)
from edgeproxy._protocol.sse import SSEEvent

__all__ = [
    "COUNT_TOKENS",
    "MESSAGES",
    "MessagesDialect",
    "MessagesWriter",
    "anthropic_error_type",
    "message_id",
]

PING: Final = b'event: ping\ndata: {"type": "ping"}\n\n'

# Anthropic's error types by status (its clients, Claude Code among them, retry on
# overloaded_error and rate_limit_error).
_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_STOP: Final = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_FINISH: Final = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}
_COMMITS: Final = frozenset({"content_block_delta", "message_delta", "message_stop", "error"})


def anthropic_error_type(status: int) -> str:
    return _TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def messages_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """Chat's ``usage`` in Anthropic's shape (its own fields, when it has them)."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    if "input_tokens" in usage:
        return usage
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
    }


class MessagesWriter(StreamWriter):
    """A message as events: start, one text block, the stop reason and usage, stop."""

    def _message(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.answer.id,
            "type": "message",
            "role": "assistant",
            "model": self.answer.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }

    def open(self) -> bytes:
        usage = messages_usage(self.answer.usage)
        start = self._message({"input_tokens": usage.get("input_tokens", 0), "output_tokens": 0})
        return _event("message_start", {"type": "message_start", "message": start}) + _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        )

    def piece(self, text: str) -> bytes:
        self.text.append(text)
        return _event(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": text},
            },
        )

    def close(self, finish: str | None, usage: dict[str, Any] | None) -> bytes:
        final = messages_usage(usage)
        return b"".join(
            (
                _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                _event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": _STOP.get(finish or "stop", "end_turn"),
                            "stop_sequence": None,
                        },
                        "usage": {"output_tokens": final.get("output_tokens", 0)},
                    },
                ),
                _event("message_stop", {"type": "message_stop"}),
            )
        )


class MessagesDialect(Dialect):
    """``/v1/messages``."""

    name = "messages"
    anthropic = True
    prompt_keys: ClassVar[tuple[str, ...]] = ("system",)
    continuation: ClassVar[str | None] = "prefill"
    heartbeat = PING
    writer = MessagesWriter
    required: ClassVar[tuple[str, ...]] = ("model", "messages", "max_tokens")
    ranges: ClassVar[dict[str, tuple[float, float]]] = {"temperature": (0, 1), "top_p": (0, 1)}
    minimums: ClassVar[dict[str, int]] = {"top_k": 0}
    types: ClassVar[dict[str, tuple[type, ...]]] = {
        "model": (str,),
        "messages": (list,),
        "system": (str, list),
        "max_tokens": (int,),
        "stream": (bool,),
        "stop_sequences": (list,),
        "top_k": (int,),
        "metadata": (dict,),
        "tools": (list,),
        "tool_choice": (dict,),
        "thinking": (dict,),
    }

    def conversation(self, body: dict[str, Any]) -> list[Any]:
        turns = super().conversation(body)
        system = body.get("system")
        return [{"role": "system", "content": system}, *turns] if system else turns

    def deterministic(self, body: dict[str, Any]) -> bool:
        return body.get("temperature") == 0

    # -- streams -----------------------------------------------------------------------------

    def commits(self, event: SSEEvent) -> bool:
        name = event.event
        if name is None:
            return not event.comment
        return name in _COMMITS

    def usage_of(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        usage = obj.get("usage")
        if isinstance(usage, dict):
            return usage
        message = obj.get("message")
        if isinstance(message, dict):
            usage = message.get("usage")
            if isinstance(usage, dict):
                return usage
        return None

    def counted(self, usage: dict[str, Any]) -> dict[str, Any]:
        # Anthropic counts cache reads and writes apart from input_tokens.
        if "prompt_tokens" in usage:
            return usage
        prompt = (
            tokens(usage.get("input_tokens"))
            + tokens(usage.get("cache_read_input_tokens"))
            + tokens(usage.get("cache_creation_input_tokens"))
        )
        return counted_io(usage, prompt)

    def merge_usage(self, old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
        # Split over message_start (input, cache) and message_delta (output so far): the
        # later value of each field wins.
        return {**old, **new} if old is not None else dict(new)

    def is_end(self, event: SSEEvent) -> bool:
        return event.event == "message_stop"

    def is_error(self, event: SSEEvent) -> bool:
        return event.event == "error"

    # -- what the proxy writes ---------------------------------------------------------------

    def error_body(self, err: ProxyError) -> bytes:
        return orjson.dumps(
            {
                "type": "error",
                "error": {"type": anthropic_error_type(err.status), "message": err.message},
            }
        )

    def error_event(self, err: ProxyError, *, sequence: int = 0) -> bytes:
        return b"event: error\ndata: " + self.error_body(err) + b"\n\n"

    def answer(self, text: AnswerText) -> dict[str, Any]:
        return {
            "id": text.id,
            "type": "message",
            "role": "assistant",
            "model": text.model,
            "content": [{"type": "text", "text": text.text}],
            "stop_reason": _STOP.get(text.finish or "stop", "end_turn"),
            "stop_sequence": None,
            "usage": messages_usage(text.usage),
        }

    def text_of(self, answer: dict[str, Any]) -> AnswerText | None:
        if answer.get("type") != "message":
            return None
        blocks = answer.get("content")
        if not isinstance(blocks, list):
            return None
        text = []
        for block in blocks:
            if not isinstance(block, dict) or block.get("type") != "text":
                return None
            if not isinstance(block.get("text"), str):
                return None
            text.append(block["text"])
        usage = answer.get("usage")
        return AnswerText(
            str(answer.get("id") or message_id()),
            str(answer.get("model") or ""),
            0,
            "".join(text),
            _FINISH.get(str(answer.get("stop_reason")), "stop"),
            usage if isinstance(usage, dict) else None,
        )

    def assemble(self, events: list[SSEEvent]) -> dict[str, Any] | None:
        message: dict[str, Any] | None = None
        blocks: dict[int, list[str]] = {}
        usage: dict[str, Any] = {}
        stopped = False
        for event in events:
            name = event.event
            if name is None or name == "ping":
                continue
            obj = loads(event.data)
            if not isinstance(obj, dict):
                return None
            if name == "message_start":
                message = obj.get("message")
                if not isinstance(message, dict):
                    return None
                usage.update(message.get("usage") or {})
            elif name == "content_block_start":
                block = obj.get("content_block")
                if not isinstance(block, dict) or block.get("type") != "text":
                    return None
                blocks[obj.get("index", len(blocks))] = [block.get("text") or ""]
            elif name == "content_block_delta":
                delta = obj.get("delta")
                if not isinstance(delta, dict) or delta.get("type") != "text_delta":
                    return None
                blocks.setdefault(obj.get("index", 0), []).append(delta.get("text") or "")
            elif name == "message_delta" and message is not None:
                delta = obj.get("delta")
                if isinstance(delta, dict):
                    message.update(delta)
                usage.update(obj.get("usage") or {})
            elif name == "message_stop":
                stopped = True
            elif name == "error":
                return None
        if message is None or not stopped:
            return None
        return {
            **message,
            "content": [{"type": "text", "text": "".join(blocks[i])} for i in sorted(blocks)],
            "usage": usage,
        }


class CountTokensDialect(MessagesDialect):
    """``/v1/messages/count_tokens``: a Messages request without ``max_tokens``, answered with
    its input tokens; never streamed, never charged."""

    name = "messages.count_tokens"
    streams = False
    required: ClassVar[tuple[str, ...]] = ("model", "messages")


MESSAGES: Final = MessagesDialect()
COUNT_TOKENS: Final = CountTokensDialect()
