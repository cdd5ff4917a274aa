"""OpenAI's chat completions and text completions: the dialects the proxy was born with.

A stream is ``data: <chunk>`` events and ``data: [DONE]``; the first chunk usually
carries only the ``role``, and the first content is a delta with ``content`` or
``tool_calls`` (or, for text completions, a choice with ``text``). Usage comes at the
top of the JSON answer, or of a last chunk without choices
(``stream_options.include_usage``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol import openai
from edgeproxy._protocol.dialects._base import AnswerText, Dialect, StreamWriter, loads
from edgeproxy._protocol.sse import SSEEvent

__all__ = ["CHAT", "COMPLETIONS", "ChatDialect", "ChatWriter", "CompletionsDialect"]


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


class ChatDialect(Dialect):
    """``/v1/chat/completions``."""

    name = "chat.completions"
    max_tokens_keys: ClassVar[tuple[str, ...]] = ("max_completion_tokens", "max_tokens")
    continuation: ClassVar[str | None] = "continue_final_message"
    writer = ChatWriter
    minimums: ClassVar[dict[str, int]] = {"n": 1}
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
    # ``max_tokens: 0`` with ``echo`` scores a prompt without generating: OpenAI's legacy
    # completions and the servers that copy them take it.
    min_tokens: ClassVar[int] = 0
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

    def check(self, body: dict[str, Any]) -> ProxyError | None:
        err = super().check(body)
        # An empty list is no prompt at all; an empty string is one (the model starts a
        # document from nothing), which OpenAI's completions take.
        if err is None and body.get("prompt") == []:
            return self.invalid("'prompt' must not be empty.", "prompt", "empty_array")
        return err

    def answer(self, text: AnswerText) -> dict[str, Any]:
        head = openai.AnswerHead(text.id, text.created, text.model, False)
        return openai.completion(head, [openai.text_choice(0, text.text, text.finish)], text.usage)


CHAT: Final = ChatDialect()
COMPLETIONS: Final = CompletionsDialect()
