"""OpenAI's chat completions and text completions: the dialects the proxy was born with.

A stream is ``data: <chunk>`` events and ``data: [DONE]``; the first chunk usually
carries only the ``role``, and the first content is a delta with ``content`` or
``tool_calls`` (or, for text completions, a choice with ``text``). Usage comes at the
top of the JSON answer, or of a last chunk without choices
(``stream_options.include_usage``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from edgeproxy._protocol import openai
from edgeproxy._protocol.dialects._base import (
    REGION_METHOD,
    AnswerText,
    Dialect,
    Piece,
    Seam,
    StreamWriter,
    loads,
)
from edgeproxy._protocol.sse import SSEEvent

__all__ = ["CHAT", "COMPLETIONS", "ChatDialect", "ChatSeam", "ChatWriter", "CompletionsDialect"]


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class ChatWriter(StreamWriter):
    """A chat (or text) completion as chunks: the role, the pieces, the finish, the usage."""

    chat: ClassVar[bool] = True

    def __init__(self, answer: AnswerText, *, include_usage: bool = False) -> None:
        super().__init__(answer, include_usage=include_usage)
        self.head = openai.AnswerHead(answer.id, answer.created, answer.model, self.chat)

    def open(self) -> bytes:
        if not self.chat:
            return b""
        choice = openai.chat_chunk_choice(0, {"role": "assistant", "content": ""})
        return openai.sse_event(openai.chunk(self.head, [choice]))

    def piece(self, text: str) -> bytes:
        self.text.append(text)
        if self.chat:
            choice = openai.chat_chunk_choice(0, {"content": text})
        else:
            choice = openai.text_choice(0, text)
        return openai.sse_event(openai.chunk(self.head, [choice]))

    def close(self, finish: str | None, usage: dict[str, Any] | None) -> bytes:
        if self.chat:
            choice = openai.chat_chunk_choice(0, {}, finish)
        else:
            choice = openai.text_choice(0, "", finish)
        out = openai.sse_event(openai.chunk(self.head, [choice]))
        if usage is not None and self.include_usage:
            out += openai.sse_event(openai.usage_chunk(self.head, usage))
        return out + openai.SSE_DONE


class TextWriter(ChatWriter):
    chat = False


class ChatSeam(Seam):
    """A chat completion continued across legs: the first leg's ``id``, ``created``,
    ``model`` (and ``system_fingerprint``) on every later chunk, no second ``role`` delta,
    the legs' usage in one last chunk (``stream_options.include_usage``) and one
    ``[DONE]``."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.include_usage = _include_usage(body)
        self.head: dict[str, Any] | None = None
        self.done = False  # the last leg's [DONE] came

    def first(self, event: SSEEvent) -> Piece:
        obj = loads(event.data) if event.data.startswith(b"{") else None
        if not isinstance(obj, dict):
            return Piece()
        if self.head is None and "id" in obj:
            self.head = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
            if obj.get("system_fingerprint") is not None:
                self.head["system_fingerprint"] = obj["system_fingerprint"]
        return self._read(obj)

    def start_leg(self) -> None:
        self.done = False

    def later(self, event: SSEEvent) -> Piece:
        data = event.data
        if data == b"[DONE]":
            self.done = True
            return Piece("hold")
        obj = loads(data) if data.startswith(b"{") else None
        if not isinstance(obj, dict):
            # An event without data passes; data that is no chunk does not.
            return Piece("drop" if data else "raw")
        if "error" in obj and not obj.get("choices"):
            return Piece("raw")  # an in-band error: the client is told
        return self._read(obj)

    def _read(self, obj: dict[str, Any]) -> Piece:
        usage = obj.get("usage")
        usage = usage if isinstance(usage, dict) else None
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return Piece("hold", obj, usage=usage)  # the usage chunk: summed at the end
        choice = choices[0]
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        content = delta.get("content")
        text = content if isinstance(content, str) else ""
        other = bool(delta.get("tool_calls"))
        finish = bool(choice.get("finish_reason"))
        kind = "text" if text else "pass" if other or finish else "drop"
        return Piece(kind, obj, text=text, other=other, finish=finish, usage=usage)

    def write(self, piece: Piece, text: str) -> bytes:
        obj = piece.obj
        if self.head is not None:
            obj.update(self.head)
        obj.pop("usage", None)
        delta = obj["choices"][0].get("delta")
        if isinstance(delta, dict):
            delta.pop("role", None)
            if piece.text:
                delta["content"] = piece.text
            else:
                delta.pop("content", None)
        return openai.sse_event(obj)

    def close(self, usage: dict[str, Any] | None, text: str) -> bytes:
        out = b""
        if self.include_usage and usage is not None and self.head is not None:
            out += openai.sse_event({**self.head, "choices": [], "usage": usage})
        return out + openai.SSE_DONE if self.done else out


class ChatDialect(Dialect):
    """``/v1/chat/completions``."""

    name = "chat.completions"
    max_tokens_keys: ClassVar[tuple[str, ...]] = ("max_completion_tokens", "max_tokens")
    continuation: ClassVar[str | None] = REGION_METHOD
    seam = ChatSeam
    writer = ChatWriter
    types: ClassVar[dict[str, tuple[type, ...]]] = {
        **Dialect.types,
        "max_completion_tokens": (int,),
        "stream_options": (dict,),
        "response_format": (dict,),
        "tool_choice": (str, dict),
        "logit_bias": (dict,),
        "logprobs": (bool,),
        "presence_penalty": (int, float),
        "frequency_penalty": (int, float),
    }

    def include_usage(self, body: dict[str, Any]) -> bool:
        return _include_usage(body)

    def continuable(self, body: dict[str, Any]) -> bool:
        # One choice, whose text a final assistant message can carry.
        return isinstance(body.get("messages"), list) and body.get("n", 1) == 1

    def continuation_body(self, body: dict[str, Any], text: str, method: str) -> dict[str, Any]:
        """The conversation plus the partial answer as a final assistant message; with
        vLLM's and SGLang's switches for ``continue_final_message``."""
        out = dict(body)
        if method == "reissue":
            return out
        out["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
        if method == "continue_final_message":
            out["continue_final_message"] = True
            out["add_generation_prompt"] = False
        return out

    def commits(self, event: SSEEvent) -> bool:
        data = event.data
        if event.event is not None or data == b"[DONE]" or not data.startswith(b"{"):
            return True
        if (
            data.find(b'"content"') < 0
            and data.find(b'"tool_calls"') < 0
            and data.find(b'"text"') < 0
            and data.find(b'"finish_reason"') < 0
            and data.find(b'"error"') < 0
        ):
            return False
        obj = loads(data)
        if not isinstance(obj, dict):
            return True
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            return "error" in obj
        for choice in choices:
            if not isinstance(choice, dict):
                return True
            if choice.get("finish_reason") or choice.get("text"):
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict) and (
                delta.get("content") or delta.get("tool_calls") or delta.get("refusal")
            ):
                return True
        return False

    def answer(self, text: AnswerText) -> dict[str, Any]:
        head = openai.AnswerHead(text.id, text.created, text.model, True)
        return openai.completion(head, [openai.chat_choice(0, text.text, text.finish)], text.usage)


class CompletionsDialect(ChatDialect):
    """``/v1/completions``: a ``prompt`` instead of messages."""

    name = "completions"
    max_tokens_keys: ClassVar[tuple[str, ...]] = ("max_tokens",)
    prompt_keys: ClassVar[tuple[str, ...]] = ("prompt",)
    turns: ClassVar[str | None] = None
    continuation: ClassVar[str | None] = None
    writer = TextWriter
    types: ClassVar[dict[str, tuple[type, ...]]] = {
        **Dialect.types,
        "prompt": (str, list),
        "stream_options": (dict,),
        "echo": (bool,),
        "logprobs": (int,),
        "best_of": (int,),
        "suffix": (str,),
    }

    def conversation(self, body: dict[str, Any]) -> list[Any]:
        return []  # a prompt, not turns: keyed as text (see edgeproxy._protocol.prefix)

    def check(self, body: dict[str, Any]) -> Any:
        err = super().check(body)
        if err is None and body.get("prompt") in ("", []):
            return self.invalid("'prompt' must not be empty.", "prompt", "empty_array")
        return err

    def answer(self, text: AnswerText) -> dict[str, Any]:
        head = openai.AnswerHead(text.id, text.created, text.model, False)
        return openai.completion(head, [openai.text_choice(0, text.text, text.finish)], text.usage)


CHAT: Final = ChatDialect()
COMPLETIONS: Final = CompletionsDialect()
