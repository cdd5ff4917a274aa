"""OpenAI's Responses API (``/v1/responses``).

A request's prompt is its ``instructions`` and ``input`` (a string or a list of
items); it refers to stored state through ``previous_response_id`` and
``conversation``, and asks the region to store its answer unless ``store`` is false.

A stream is named events (``event: response.output_text.delta`` and its ``data``), each
with a ``sequence_number`` that increases from 0. It opens with ``response.created`` and
``response.in_progress`` before the model produced anything; its first content is a text,
refusal or tool-call delta, or an output item done; it ends with ``response.completed``
(``.incomplete``, ``.failed``), whose ``response`` is the whole answer, usage included
(``input_tokens``, cached ones among them, and ``output_tokens``). A broken stream ends
with an ``error`` event.
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

__all__ = ["RESPONSES", "ResponsesDialect", "ResponsesWriter", "response_id"]

_ENDS: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})
# Chat's finish reasons as a response's status and why it is incomplete.
_INCOMPLETE: Final = {"length": "max_output_tokens", "content_filter": "content_filter"}


def response_id() -> str:
    return "resp_" + secrets.token_hex(24)


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


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


class ResponsesWriter(StreamWriter):
    """A response as events: created, in progress, one message item of output text, the end."""

    def __init__(self, answer: AnswerText, *, include_usage: bool = False) -> None:
        super().__init__(answer, include_usage=include_usage)
        self.sequence = 0
        self.item_id = "msg_" + secrets.token_hex(24)

    def _next(self, name: str, fields: dict[str, Any]) -> bytes:
        data = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return _event(name, data)

    def _response(self, status: str, output: list[Any], usage: Any) -> dict[str, Any]:
        return RESPONSES.response_object(self.answer, status, output, usage)

    def _item(self, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [_text_part(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def open(self) -> bytes:
        created = self._response("in_progress", [], None)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return b"".join(
            (
                self._next("response.created", {"response": created}),
                self._next("response.in_progress", {"response": created}),
                self._next(
                    "response.output_item.added",
                    {"output_index": 0, "item": self._item("in_progress", None)},
                ),
                self._next("response.content_part.added", {**where, "part": _text_part("")}),
            )
        )

    def piece(self, text: str) -> bytes:
        self.text.append(text)
        return self._next(
            "response.output_text.delta",
            {
                "item_id": self.item_id,
                "output_index": 0,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            },
        )

    def close(self, finish: str | None, usage: dict[str, Any] | None) -> bytes:
        text = "".join(self.text)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        item = self._item("completed", text)
        reason = _INCOMPLETE.get(finish or "")
        done = self._response("incomplete" if reason else "completed", [item], usage)
        if reason:
            done["incomplete_details"] = {"reason": reason}
        return b"".join(
            (
                self._next("response.output_text.done", {**where, "text": text, "logprobs": []}),
                self._next("response.content_part.done", {**where, "part": _text_part(text)}),
                self._next("response.output_item.done", {"output_index": 0, "item": item}),
                self._next(
                    "response.incomplete" if reason else "response.completed", {"response": done}
                ),
            )
        )


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesDialect(Dialect):
    """``/v1/responses``."""

    name = "responses"
    max_tokens_keys: ClassVar[tuple[str, ...]] = ("max_output_tokens",)
    prompt_keys: ClassVar[tuple[str, ...]] = ("instructions", "input")
    turns: ClassVar[str | None] = "input"
    continuation: ClassVar[str | None] = "reissue"
    writer = ResponsesWriter
    required: ClassVar[tuple[str, ...]] = ("model",)
    types: ClassVar[dict[str, tuple[type, ...]]] = {
        "model": (str,),
        "input": (str, list),
        "instructions": (str,),
        "stream": (bool,),
        "store": (bool,),
        "background": (bool,),
        "max_output_tokens": (int,),
        "max_tool_calls": (int,),
        "previous_response_id": (str,),
        "conversation": (str, dict),
        "metadata": (dict,),
        "tools": (list,),
        "tool_choice": (str, dict),
        "parallel_tool_calls": (bool,),
        "text": (dict,),
        "reasoning": (dict,),
        "truncation": (str,),
        "include": (list,),
        "user": (str,),
        "prompt": (dict,),
    }

    def prompt(self, body: dict[str, Any]) -> list[Any]:
        return [body[key] for key in self.prompt_keys if key in body]

    def conversation(self, body: dict[str, Any]) -> list[Any]:
        turns: list[Any] = []
        instructions = body.get("instructions")
        if instructions:
            turns.append({"role": "system", "content": instructions})
        given = body.get("input")
        if isinstance(given, str):
            turns.append({"role": "user", "content": given})
        elif isinstance(given, list):
            turns.extend(given[:10_000])
        return turns

    def deterministic(self, body: dict[str, Any]) -> bool:
        return body.get("temperature") == 0

    def state_refs(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        refs: list[tuple[str, str]] = []
        previous = body.get("previous_response_id")
        if isinstance(previous, str) and previous:
            refs.append(("previous_response_id", previous))
        conversation = body.get("conversation")
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
        if isinstance(conversation, str) and conversation:
            refs.append(("conversation", conversation))
        return refs

    def stores(self, body: dict[str, Any]) -> bool:
        return body.get("store") is not False or bool(body.get("conversation"))

    def requires(self, body: dict[str, Any]) -> tuple[str, ...]:
        # A stored prompt (``prompt``) may name the model.
        return () if body.get("prompt") is not None else self.required

    def needs_turns(self, body: dict[str, Any]) -> bool:
        # A follow-up of a stored response or conversation, or a stored prompt, has a
        # conversation already: its input may be left out, or empty.
        return not (
            body.get("previous_response_id") or body.get("conversation") or body.get("prompt")
        )

    def check(self, body: dict[str, Any]) -> ProxyError | None:
        err = super().check(body)
        if err is not None:
            return err
        if body.get("input") is None and self.needs_turns(body):
            return self.invalid(
                "Missing required parameter: 'input'.", "input", "missing_required_parameter"
            )
        conversation = body.get("conversation")
        if isinstance(conversation, dict) and not isinstance(conversation.get("id"), str):
            return self.invalid(
                "Invalid type for 'conversation.id': expected a string.",
                "conversation",
                "invalid_type",
            )
        return None

    # -- streams -----------------------------------------------------------------------------

    def commits(self, event: SSEEvent) -> bool:
        name = event.event
        if name is None:
            # No event line: the type is in the data (some servers send it only there).
            obj = loads(event.data)
            name = obj.get("type") if isinstance(obj, dict) else None
            if not isinstance(name, str):
                return True
        return (
            name.endswith(".delta")
            or name == "response.output_item.done"
            or name in _ENDS
            or name == "error"
        )

    def usage_of(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        usage = obj.get("usage")
        if isinstance(usage, dict):
            return usage
        response = obj.get("response")
        if isinstance(response, dict):
            usage = response.get("usage")
            if isinstance(usage, dict):
                return usage
        return None

    def counted(self, usage: dict[str, Any]) -> dict[str, Any]:
        # input_tokens includes the cached ones (input_tokens_details.cached_tokens).
        if "prompt_tokens" in usage:
            return usage
        return counted_io(usage, tokens(usage.get("input_tokens")))

    def is_end(self, event: SSEEvent) -> bool:
        return event.event in _ENDS

    def is_error(self, event: SSEEvent) -> bool:
        return event.event in ("error", "response.failed")

    # -- what the proxy writes ---------------------------------------------------------------

    def error_event(self, err: ProxyError, *, sequence: int = 0) -> bytes:
        """The Responses API's ``error`` event, with OpenAI's ``error`` object beside its
        fields: the openai SDK raises ``APIError`` on it."""
        code = err.code or err.type
        data = {
            "type": "error",
            "code": code,
            "message": err.message,
            "param": err.param,
            "sequence_number": sequence,
            "error": {"type": err.type, "code": code, "message": err.message, "param": err.param},
        }
        return _event("error", data)

    def response_object(
        self, text: AnswerText, status: str, output: list[Any], usage: Any
    ) -> dict[str, Any]:
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

    def answer(self, text: AnswerText) -> dict[str, Any]:
        writer = ResponsesWriter(text)
        item = writer._item("completed", text.text)
        reason = _INCOMPLETE.get(text.finish or "")
        out = self.response_object(
            text, "incomplete" if reason else "completed", [item], text.usage
        )
        if reason:
            out["incomplete_details"] = {"reason": reason}
        return out

    def text_of(self, answer: dict[str, Any]) -> AnswerText | None:
        if answer.get("object") != "response" or answer.get("status") not in (
            "completed",
            "incomplete",
        ):
            return None
        output = answer.get("output")
        if not isinstance(output, list) or len(output) != 1:
            return None
        item = output[0]
        if not isinstance(item, dict) or item.get("type") != "message":
            return None
        parts = item.get("content")
        if not isinstance(parts, list):
            return None
        text = []
        for part in parts:
            if not isinstance(part, dict) or part.get("type") != "output_text":
                return None
            if not isinstance(part.get("text"), str):
                return None
            text.append(part["text"])
        details = answer.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        finish = "length" if reason == "max_output_tokens" else "stop"
        usage = answer.get("usage")
        return AnswerText(
            str(answer.get("id") or response_id()),
            str(answer.get("model") or ""),
            created if isinstance(created := answer.get("created_at"), int) else 0,
            "".join(text),
            finish,
            usage if isinstance(usage, dict) else None,
        )

    def assemble(self, events: list[SSEEvent]) -> dict[str, Any] | None:
        for event in reversed(events):
            if event.event in ("response.completed", "response.incomplete"):
                obj = loads(event.data)
                response = obj.get("response") if isinstance(obj, dict) else None
                return response if isinstance(response, dict) else None
        return None


RESPONSES: Final = ResponsesDialect()
