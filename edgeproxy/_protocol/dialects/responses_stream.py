"""The Responses API's answers as the proxy writes them (part of its dialect,
:mod:`edgeproxy._protocol.dialects.responses`): the response object, its output items (a
message of output text, ``function_call`` items) and the stream of events that carries
them, whole or piece by piece.
"""

from __future__ import annotations

import secrets
from typing import Any, Final

import orjson

from edgeproxy._protocol.dialects._base import AnswerText, StreamWriter, ToolCall, named_event

__all__ = [
    "INCOMPLETE",
    "ResponseText",
    "ResponsesWriter",
    "output_items",
    "response_id",
    "response_object",
    "responses_usage",
]

_TEXT_DELTA: Final = (
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"sequence_number":%d%s,"content_index":0,"delta":%s,"logprobs":[]}\n\n'
)
# Chat's finish reasons as a response's status and why it is incomplete.
INCOMPLETE: Final = {"length": "max_output_tokens", "content_filter": "content_filter"}


def response_id() -> str:
    return "resp_" + secrets.token_hex(24)


def _item_id(prefix: str) -> str:
    return prefix + secrets.token_hex(24)


def responses_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's ``usage`` in the Responses API's shape (its own fields, when it has them)."""
    if usage is None:
        return None
    if "input_tokens" in usage:
        return usage
    prompt = usage.get("prompt_tokens", 0)
    completion = usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response_object(text: AnswerText, status: str, output: list[Any], usage: Any) -> dict[str, Any]:
    """A response of the proxy's own (stored nowhere) saying ``output``."""
    return {
        "id": text.id,
        "object": "response",
        "created_at": text.created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "metadata": {},
        "model": text.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "store": False,
        "temperature": None,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
        "truncation": "disabled",
        "usage": responses_usage(usage),
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, status: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _function_call(call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "id": _item_id("fc_"),
        "type": "function_call",
        "status": status,
        "arguments": call.arguments,
        "call_id": call.id or _item_id("call_"),
        "name": call.name,
    }


def output_items(text: AnswerText, item_id: str | None = None) -> list[dict[str, Any]]:
    """A whole answer's output: its message (unless it only calls functions), then a
    ``function_call`` item per call."""
    items = []
    if text.text or not text.calls:
        items.append(_message(item_id or _item_id("msg_"), "completed", text.text))
    items.extend(_function_call(call, "completed") for call in text.calls)
    return items


class ResponseText(AnswerText):
    """What a whole response says, with the response itself and its message item's id: a
    stream written of it ends with that very response, and its events name that item."""

    __slots__ = ("response", "item_id")

    def __init__(
        self, *args: Any, response: dict[str, Any], item_id: str | None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.response = response
        self.item_id = item_id


class ResponsesWriter(StreamWriter):
    """A response as events: created, in progress, its output items (a message of output
    text, ``function_call`` items with their arguments in pieces), each added, filled and
    done in turn, then the end.

    Each event's ``sequence_number`` is the next from 0; every event names the response's
    one id and its item's."""

    def __init__(
        self, answer: AnswerText, *, include_usage: bool = False, text_first: bool = True
    ) -> None:
        super().__init__(answer, include_usage=include_usage, text_first=text_first)
        self.sequence = 0
        given = answer.item_id if isinstance(answer, ResponseText) else None
        self.item_id = given or _item_id("msg_")  # the first message's
        self.output: list[dict[str, Any]] = []  # the items done
        self.item: dict[str, Any] | None = None  # the item open now
        self.said: list[str] = []  # ... its text, a message's
        self.calls: dict[int, dict[str, Any]] = {}  # chat's index of each call -> its item
        self.index: dict[str, int] = {}  # each item's output_index
        self.where: bytes | None = None  # the open message's item_id and output_index, as JSON

    def _next(self, name: str, fields: dict[str, Any]) -> bytes:
        data = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return named_event(name, data)

    def _response(self, status: str, output: list[Any], usage: Any) -> dict[str, Any]:
        answer = self.answer
        if isinstance(answer, ResponseText):
            # The response as it was, before it had any output.
            return {
                **answer.response,
                "status": status,
                "incomplete_details": None,
                "output": output,
                "usage": responses_usage(usage),
            }
        return response_object(answer, status, output, usage)

    def _add(self, item: dict[str, Any]) -> bytes:
        """``item`` opens, at the next place of the output."""
        index = self.index[item["id"]] = len(self.output)
        self.item = item
        return self._next("response.output_item.added", {"output_index": index, "item": item})

    def _open_message(self) -> bytes:
        item_id = self.item_id if not self.index else _item_id("msg_")
        self.where = None
        out = self._add(_message(item_id, "in_progress", None))
        self.said = []
        where = {"item_id": item_id, "output_index": self.index[item_id], "content_index": 0}
        return out + self._next("response.content_part.added", {**where, "part": _text_part("")})

    def _done(self, replaced: dict[str, Any] | None = None) -> bytes:
        """The item open now is done (``replaced``: a whole response's own message)."""
        item, self.item = self.item, None
        if item is None:
            return b""
        index = self.index[item["id"]]
        if item["type"] == "function_call":
            done = {**item, "status": "completed"}
            self.output.append(done)
            arguments = {
                "item_id": item["id"],
                "output_index": index,
                "arguments": item["arguments"],
            }
            return self._next("response.function_call_arguments.done", arguments) + self._next(
                "response.output_item.done", {"output_index": index, "item": done}
            )
        text = "".join(self.said)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        done = replaced or _message(item["id"], "completed", text)
        self.output.append(done)
        return b"".join(
            (
                self._next("response.output_text.done", {**where, "text": text, "logprobs": []}),
                self._next("response.content_part.done", {**where, "part": _text_part(text)}),
                self._next("response.output_item.done", {"output_index": index, "item": done}),
            )
        )

    def open(self) -> bytes:
        created = self._response("in_progress", [], None)
        out = self._next("response.created", {"response": created}) + self._next(
            "response.in_progress", {"response": created}
        )
        return out + self._open_message() if self.text_first else out

    def piece(self, text: str) -> bytes:
        self.text.append(text)
        item = self.item
        out = b""
        if item is None or item["type"] != "message":
            out = self._done() + self._open_message()
            item = self.item
            assert item is not None
        self.said.append(text)
        where = self.where
        if where is None:
            index = self.index[item["id"]]
            where = self.where = b',"item_id":%s,"output_index":%d' % (
                orjson.dumps(item["id"]),
                index,
            )
        # _next's bytes for the delta, from a template: a stream writes one per token.
        sequence = self.sequence
        self.sequence = sequence + 1
        return out + _TEXT_DELTA % (sequence, where, orjson.dumps(text))

    def tool(self, index: int, call_id: str | None, name: str | None, arguments: str) -> bytes:
        item = self.calls.get(index)
        out = b""
        if item is None:
            out = self._done()
            item = self.calls[index] = _function_call(
                ToolCall(call_id or "", name or "", ""), "in_progress"
            )
            out += self._add(dict(item))
            self.item = item
        if not arguments:
            return out
        item["arguments"] += arguments
        delta = {"item_id": item["id"], "output_index": self.index[item["id"]], "delta": arguments}
        return out + self._next("response.function_call_arguments.delta", delta)

    def close(self, finish: str | None, usage: dict[str, Any] | None) -> bytes:
        text = "".join(self.text)
        reason = INCOMPLETE.get(finish or "")
        answer = self.answer
        if isinstance(answer, ResponseText) and text == answer.text and finish == answer.finish:
            # The stream of a whole response ends with that response, as it was.
            done = answer.response
            out = self._done(done["output"][0])
        else:
            out = self._done()
            done = self._response("incomplete" if reason else "completed", self.output, usage)
            if reason:
                done["incomplete_details"] = {"reason": reason}
        end = "response.incomplete" if reason else "response.completed"
        return out + self._next(end, {"response": done})
