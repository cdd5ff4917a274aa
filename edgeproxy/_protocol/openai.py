"""OpenAI answers built by the proxy itself: completions, streamed chunks and their SSE framing.

The cache (a stored JSON answer replayed as a stream) and the local model
build the same objects, with the same fields in the same order, as OpenAI
sends them::

    {"id", "object", "created", "model", ["system_fingerprint",] "choices", ["usage"]}

A stream is ``data: <chunk>`` events, each ending with a blank line, then
``data: [DONE]``.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = [
    "CHAT_CHUNK",
    "CHAT_COMPLETION",
    "SSE_DONE",
    "TEXT_COMPLETION",
    "AnswerHead",
    "chat_chunk_choice",
    "chat_choice",
    "chunk",
    "completion",
    "completion_id",
    "sse_event",
    "text_choice",
    "usage",
    "usage_chunk",
]

CHAT_COMPLETION: Final = "chat.completion"
CHAT_CHUNK: Final = "chat.completion.chunk"
# Text completions use the same object name for the answer and its chunks.
TEXT_COMPLETION: Final = "text_completion"

SSE_DONE: Final = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class AnswerHead:
    """The fields every object of one answer repeats, the completion and each of its chunks."""

    id: Any
    created: Any
    model: Any
    chat: bool
    system_fingerprint: Any = None

    @classmethod
    def of(cls, answer: dict[str, Any]) -> AnswerHead | None:
        """The head of a chat or text completion; None for any other object."""
        obj = answer.get("object")
        if obj not in (CHAT_COMPLETION, TEXT_COMPLETION):
            return None
        return cls(
            answer.get("id"),
            answer.get("created"),
            answer.get("model"),
            obj == CHAT_COMPLETION,
            answer.get("system_fingerprint"),
        )

    def fields(self, obj: str) -> dict[str, Any]:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        if self.system_fingerprint is not None:
            out["system_fingerprint"] = self.system_fingerprint
        return out


def completion_id(*, chat: bool) -> str:
    """A fresh answer id in OpenAI's form: ``chatcmpl-...`` or ``cmpl-...``."""
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# -- choices -------------------------------------------------------------------------------


def chat_choice(
    index: int, content: str | None, finish_reason: Any, *, role: str = "assistant"
) -> dict[str, Any]:
    """A choice of a chat completion: the whole message."""
    return {
        "index": index,
        "message": {"role": role, "content": content},
        "logprobs": None,
        "finish_reason": finish_reason,
    }


def chat_chunk_choice(
    index: int, delta: dict[str, Any], finish_reason: Any = None
) -> dict[str, Any]:
    """A choice of a chat chunk: what the message gained (``role``, ``content``, ``tool_calls``)."""
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def text_choice(index: int, text: str, finish_reason: Any = None) -> dict[str, Any]:
    """A choice of a text completion, or of one of its chunks (a piece of the text)."""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


# -- objects -------------------------------------------------------------------------------


def completion(
    head: AnswerHead, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A ``chat.completion`` or ``text_completion``."""
    out = head.fields(CHAT_COMPLETION if head.chat else TEXT_COMPLETION)
    out["choices"] = choices
    if usage is not None:
        out["usage"] = usage
    return out


def chunk(head: AnswerHead, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """One chunk of a streamed answer."""
    out = head.fields(CHAT_CHUNK if head.chat else TEXT_COMPLETION)
    out["choices"] = choices
    return out


def usage_chunk(head: AnswerHead, usage: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream asked with ``stream_options.include_usage``: no choices."""
    out = chunk(head, [])
    out["usage"] = usage
    return out


def sse_event(data: Any) -> bytes:
    """``data`` as one server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + orjson.dumps(data) + b"\n\n"
