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
    Piece,
    Seam,
    StreamWriter,
    counted_io,
    loads,
    named_event,
    text_parts,
    tokens,
)
from edgeproxy._protocol.sse import SSEEvent

__all__ = [
    "COUNT_TOKENS",
    "MESSAGES",
    "MessagesDialect",
    "MessagesSeam",
    "MessagesWriter",
    "anthropic_error_type",
    "message_id",
    "tool_use_id",
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
_TEXT_DELTA: Final = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
    b'"delta":{"type":"text_delta","text":%s}}\n\n'
)
_COMMITS: Final = frozenset({"content_block_delta", "message_delta", "message_stop", "error"})


def anthropic_error_type(status: int) -> str:
    return _TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def _stop(finish: str | None, sequence: str | None) -> tuple[str, str | None]:
    """A message's ``stop_reason`` and ``stop_sequence``, from chat's finish reason and the
    client's stop sequence that ended it (if one did)."""
    if sequence is not None and (finish or "stop") == "stop":
        return "stop_sequence", sequence
    return _STOP.get(finish or "stop", "end_turn"), None


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
    """A message as events: start, its content blocks (text, and ``tool_use`` blocks whose
    input comes as ``input_json_delta`` pieces), the stop reason and usage, stop."""

    def __init__(
        self, answer: AnswerText, *, include_usage: bool = False, text_first: bool = True
    ) -> None:
        super().__init__(answer, include_usage=include_usage, text_first=text_first)
        self.blocks = 0  # the blocks started
        self.kind: str | None = None  # the type of the block open now (the last started)
        self.tools: dict[int, int] = {}  # chat's index of each call -> its block's index

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

    def _start(self, block: dict[str, Any]) -> bytes:
        """Stop the open block, if any, and start ``block`` after it."""
        out = self._stop()
        self.kind = block["type"]
        self.blocks += 1
        start = {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}
        return out + named_event("content_block_start", start)

    def _stop(self) -> bytes:
        if self.kind is None:
            return b""
        self.kind = None
        return named_event(
            "content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1}
        )

    def open(self) -> bytes:
        # The input side as counted (cache reads and writes included); no output yet.
        usage = {"input_tokens": 0, **messages_usage(self.answer.usage), "output_tokens": 0}
        start = named_event(
            "message_start", {"type": "message_start", "message": self._message(usage)}
        )
        return start + self._start({"type": "text", "text": ""}) if self.text_first else start

    def piece(self, text: str) -> bytes:
        self.text.append(text)
        # named_event's bytes for the delta, from a template: a stream writes one per token.
        delta = _TEXT_DELTA % (self.blocks - 1, orjson.dumps(text)) if self.kind == "text" else b""
        if delta:
            return delta
        out = self._start({"type": "text", "text": ""})
        return out + _TEXT_DELTA % (self.blocks - 1, orjson.dumps(text))

    def tool(self, index: int, call_id: str | None, name: str | None, arguments: str) -> bytes:
        out = b""
        block = self.tools.get(index)
        if block is None:
            tool = {"type": "tool_use", "id": call_id or tool_use_id(), "name": name or ""}
            out = self._start({**tool, "input": {}})
            block = self.tools[index] = self.blocks - 1
        if not arguments:
            return out
        delta = {"type": "input_json_delta", "partial_json": arguments}
        return out + named_event(
            "content_block_delta", {"type": "content_block_delta", "index": block, "delta": delta}
        )

    def close(self, finish: str | None, usage: dict[str, Any] | None) -> bytes:
        final = messages_usage(usage)
        reason, sequence = _stop(finish, self.answer.stop_sequence)
        counts = {"output_tokens": final.get("output_tokens", 0)}
        if self.answer.usage is None and usage is not None:
            # The stream opened before its prompt was counted: the total comes here.
            counts = {"input_tokens": final.get("input_tokens", 0), **counts}
        return b"".join(
            (
                self._stop(),
                named_event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": counts,
                    },
                ),
                named_event("message_stop", {"type": "message_stop"}),
            )
        )


class MessagesSeam(Seam):
    """A message continued across legs, by an assistant prefill: the client's one message
    (its ``message_start`` and text block), into which each later leg's text goes on.

    A later leg's ``message_start``, ``ping``s and the ``content_block_start`` of its first
    block (the prefilled one) are dropped; its blocks are renumbered after the client's (its
    first is the client's text block, or the next one when that block was already
    stopped); its ``message_delta`` is held and written once at the end with the output
    tokens summed over the legs, then one ``message_stop``.
    """

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.index = 0  # the client's text block
        self.open = False  # ... not stopped yet
        self.merge = False  # the current leg's first block goes on in the client's
        self.base = 0  # the current leg's block i is the client's block base + i
        self.delta: dict[str, Any] | None = None  # the last leg's message_delta
        self.done = False  # ... and its message_stop

    def first(self, event: SSEEvent) -> Piece:
        name = event.event
        if name not in _SEAM_EVENTS:
            return Piece()
        obj = loads(event.data)
        if not isinstance(obj, dict):
            return Piece()
        if name == "content_block_start":
            block = obj.get("content_block")
            if isinstance(block, dict) and block.get("type") == "text" and not self.open:
                self.index, self.open = _index(obj), True
                return Piece(text=str(block.get("text") or ""))
            return Piece(other=True)
        if name == "content_block_delta":
            delta = obj.get("delta")
            if (
                isinstance(delta, dict)
                and delta.get("type") == "text_delta"
                and self.open
                and _index(obj) == self.index
            ):
                return Piece(text=str(delta.get("text") or ""))
            return Piece(other=True)
        if name == "content_block_stop":
            if _index(obj) == self.index:
                self.open = False
            return Piece()
        return Piece(finish=True)  # message_delta, message_stop: the message ended

    def start_leg(self) -> None:
        self.merge = self.open
        self.base = self.index if self.open else self.index + 1
        self.delta = None
        self.done = False

    def later(self, event: SSEEvent) -> Piece:
        name = event.event
        if name == "error":
            return Piece("raw")
        if name not in _SEAM_EVENTS and name != "message_start":
            return Piece()  # ping, and anything this splice does not know
        obj = loads(event.data)
        if not isinstance(obj, dict):
            return Piece()
        if name == "message_start":
            message = obj.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            return Piece(usage=usage if isinstance(usage, dict) else None)
        if name == "message_delta":
            self.delta = obj
            usage = obj.get("usage")
            return Piece("hold", obj, finish=True, usage=usage if isinstance(usage, dict) else None)
        if name == "message_stop":
            self.done = True
            return Piece("hold", obj, finish=True)
        index = _index(obj)
        obj["index"] = self.base + index
        if name == "content_block_start":
            if index == 0 and self.merge:
                return Piece()  # the prefilled block: the client's goes on
            block = obj.get("content_block")
            text = isinstance(block, dict) and block.get("type") == "text"
            return Piece("pass", obj, other=not text)
        if name == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta":
                return Piece("text", obj, text=str(delta.get("text") or ""))
            return Piece("pass", obj, other=True)
        return Piece("pass", obj)  # content_block_stop

    def write(self, piece: Piece, text: str) -> bytes:
        obj = piece.obj
        kind = obj.get("type")
        if kind == "content_block_delta":
            obj["delta"]["text"] = piece.text
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if isinstance(block, dict) and block.get("type") == "text":
                self.index, self.open = obj["index"], True
        elif kind == "content_block_stop" and obj["index"] == self.index:
            self.open = False
        return named_event(str(kind), obj)

    def close(self, usage: dict[str, Any] | None, text: str) -> bytes:
        out = b""
        delta = self.delta
        if delta is not None:
            if usage is not None:
                # The client read the input tokens in its message_start; the output is
                # every leg's.
                delta["usage"] = {"output_tokens": usage["completion_tokens"]}
            out += named_event("message_delta", delta)
        if self.done:
            out += named_event("message_stop", {"type": "message_stop"})
        return out


_SEAM_EVENTS: Final = frozenset(
    {
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    }
)


def _content(text: AnswerText) -> list[dict[str, Any]]:
    """A message's content blocks: its text (unless it only calls functions), then a
    ``tool_use`` block per call, its arguments parsed as the input."""
    blocks: list[dict[str, Any]] = []
    if text.text or not text.calls:
        blocks.append({"type": "text", "text": text.text})
    for call in text.calls:
        parsed = loads(call.arguments.encode()) if call.arguments else {}
        tool = {"type": "tool_use", "id": call.id or tool_use_id(), "name": call.name}
        blocks.append({**tool, "input": parsed if isinstance(parsed, dict) else {}})
    return blocks


def _index(obj: dict[str, Any]) -> int:
    index = obj.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else 0


class MessagesDialect(Dialect):
    """``/v1/messages``."""

    name = "messages"
    anthropic = True
    prompt_keys: ClassVar[tuple[str, ...]] = ("system",)
    continuation: ClassVar[str | None] = "prefill"
    seam = MessagesSeam
    heartbeat = PING
    usage_inside: ClassVar[str | None] = "message"
    writer = MessagesWriter
    unstreamable_as_json = False
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

    def cache_intent(self, body: dict[str, Any]) -> list[tuple[Any, bool | None]] | None:
        """The blocks Anthropic caches, in its order: ``tools``, the ``system`` blocks, then
        each message's content blocks (a string is one text block), up to the last carrying
        ``cache_control``, whose ``"ttl": "1h"`` marks the extended TTL. Each block is taken
        without its ``cache_control``: a breakpoint that moves changes no prefix."""
        tools = body.get("tools")
        groups: list[tuple[Any, Any]] = [("tools", tools if isinstance(tools, list) else None)]
        groups.append(("system", body.get("system")))
        for message in super().conversation(body):
            if isinstance(message, dict):
                groups.append((message.get("role"), message.get("content")))
        blocks: list[tuple[Any, bool | None]] = []
        end = 0
        for where, value in groups:
            if isinstance(value, str):
                value = [{"type": "text", "text": value}]
            elif not isinstance(value, list):
                continue
            for block in value:
                control = block.get("cache_control") if isinstance(block, dict) else None
                if isinstance(control, dict):
                    block = {k: v for k, v in block.items() if k != "cache_control"}
                    blocks.append(([where, block], control.get("ttl") == "1h"))
                    end = len(blocks)
                else:
                    blocks.append(([where, block], None))
        return blocks[:end] if end else None

    def text_turns(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        """``system`` (a string or text blocks) as the system prompt, then ``messages``, each
        ``user`` or ``assistant`` with a string ``content`` or a list of text blocks. Any
        other block (an image, a document, a tool use or result, thinking) is a 400."""
        turns: list[tuple[str, str]] = []
        system = body.get("system")
        if isinstance(system, (str, list)):
            text = text_parts(self, "system", system, ("text",), "blocks")
            if text:
                turns.append(("system", text))
        elif system is not None:
            raise self.invalid(
                "system must be a string or a list of text blocks", "system", "invalid_type"
            )
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise self.invalid("messages must be a list of messages", "messages", "invalid_type")
        if not messages:
            raise self.invalid("messages must not be empty", "messages", "empty_array")
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict):
                raise self.invalid(f"{where} must be an object", where, "invalid_type")
            role = message.get("role")
            if role not in ("user", "assistant"):
                raise self.invalid(
                    f"{where}.role must be 'user' or 'assistant'", f"{where}.role", "invalid_value"
                )
            content = message.get("content")
            if not isinstance(content, (str, list)):
                raise self.invalid(
                    f"{where}.content must be a string or a list of text blocks",
                    f"{where}.content",
                    "invalid_type",
                )
            turns.append((role, text_parts(self, f"{where}.content", content, ("text",), "blocks")))
        return turns

    def deterministic(self, body: dict[str, Any]) -> bool:
        return body.get("temperature") == 0

    def include_usage(self, body: dict[str, Any]) -> bool:
        return True  # message_start and message_delta always carry it

    def continuable(self, body: dict[str, Any]) -> bool:
        # Anthropic refuses an assistant prefill with extended thinking on.
        thinking = body.get("thinking")
        return (
            self.streams
            and isinstance(body.get("messages"), list)
            and (not isinstance(thinking, dict) or thinking.get("type") in (None, "disabled"))
        )

    def prefilled(self, text: str) -> str:
        # "final assistant content cannot end with trailing whitespace", Anthropic says.
        return text.rstrip()

    def continuation_body(self, body: dict[str, Any], text: str, method: str) -> dict[str, Any]:
        """The conversation with the partial answer as an assistant prefill, which the
        Messages API continues natively: a final assistant message, or the client's own
        prefill with the answer's text after it."""
        out = dict(body)
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        if isinstance(last, dict) and last.get("role") == "assistant":
            content = last.get("content")
            if isinstance(content, str):
                content = self.prefilled(content + text)
            elif isinstance(content, list):
                content = [*content, {"type": "text", "text": self.prefilled(text)}]
            else:
                content = self.prefilled(text)
            messages[-1] = {**last, "content": content}
        else:
            messages.append({"role": "assistant", "content": self.prefilled(text)})
        out["messages"] = messages
        return out

    # -- streams -----------------------------------------------------------------------------

    def commits(self, event: SSEEvent) -> bool:
        name = event.event
        if name is None:
            return not event.comment
        return name in _COMMITS

    def counted(self, usage: dict[str, Any]) -> dict[str, Any]:
        # Anthropic counts cache reads and writes apart from input_tokens.
        if "prompt_tokens" in usage:
            return usage
        read = tokens(usage.get("cache_read_input_tokens"))
        written = tokens(usage.get("cache_creation_input_tokens"))
        out = counted_io(usage, tokens(usage.get("input_tokens")) + read + written)
        out["cached_tokens"] = read
        out["cache_write_tokens"] = written
        return out

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

    def answer_id(self) -> str:
        return message_id()

    def own_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return messages_usage(usage)

    def answer(self, text: AnswerText) -> dict[str, Any]:
        reason, sequence = _stop(text.finish, text.stop_sequence)
        return {
            "id": text.id,
            "type": "message",
            "role": "assistant",
            "model": text.model,
            "content": _content(text),
            "stop_reason": reason,
            "stop_sequence": sequence,
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
        sequence = answer.get("stop_sequence")
        return AnswerText(
            str(answer.get("id") or message_id()),
            str(answer.get("model") or ""),
            0,
            "".join(text),
            _FINISH.get(str(answer.get("stop_reason")), "stop"),
            usage if isinstance(usage, dict) else None,
            sequence if isinstance(sequence, str) else None,
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
    continuation: ClassVar[str | None] = None
    required: ClassVar[tuple[str, ...]] = ("model", "messages")


MESSAGES: Final = MessagesDialect()
COUNT_TOKENS: Final = CountTokensDialect()
