"""A region's chat completion answer in the client's API: whole, streamed, or an error
(see :mod:`edgeproxy._protocol.translate`).

A whole answer is read into an :class:`~edgeproxy._protocol.dialects.AnswerText` (its text,
its calls, why it ended, its usage) and written by the client's dialect
(:meth:`~edgeproxy._protocol.dialects.Dialect.answer`). A stream is read once, chunk by
chunk, through the one SSE reader, each chunk's content and tool-call pieces handed to the
client's dialect's :class:`~edgeproxy._protocol.dialects.StreamWriter`, which writes the
API's own events; nothing is held back but an event not yet whole.
"""

from __future__ import annotations

import time
from typing import Any

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects import AnswerText, Dialect, StreamWriter
from edgeproxy._protocol.dialects._base import ToolCall, loads
from edgeproxy._protocol.refusals import error_message
from edgeproxy._protocol.sse import SSEReader

__all__ = ["ChatStream", "answer_text", "error_of", "usage_or"]


def usage_or(usage: Any, prompt: int, completion: int) -> dict[str, Any]:
    """The region's ``usage`` in chat's fields, or an estimate when it sent none (a chat
    stream says its usage only when a server honours ``stream_options``)."""
    if isinstance(usage, dict) and "prompt_tokens" in usage:
        return usage
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def answer_text(obj: Any, head: AnswerText, prompt: int) -> AnswerText | None:
    """A chat completion's first choice as ``head`` (its id, model and time) saying it:
    its text, its calls, why it ended and its usage; None for anything but a completion."""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    if not text and isinstance(message.get("refusal"), str):
        text = message["refusal"]
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            arguments = function.get("arguments")
            calls.append(
                ToolCall(
                    str(call.get("id") or ""),
                    str(function.get("name") or ""),
                    arguments if isinstance(arguments, str) else "",
                )
            )
    head.text = text
    head.calls = tuple(calls)
    head.finish = choice.get("finish_reason") or ("tool_calls" if calls else "stop")
    head.usage = usage_or(obj.get("usage"), prompt, len(text) // 4 + 1)
    return head


def error_of(dialect: Dialect, status: int, body: bytes) -> bytes:
    """A region's chat error (OpenAI's shape, FastAPI's ``detail``, or anything) as the
    client's API's error body, its message and type kept where it had them."""
    message = error_message(body) or f"the region answered {status}"
    data = loads(body)
    error = data.get("error") if isinstance(data, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    err = ProxyError(
        status,
        kind if isinstance(kind, str) else "invalid_request_error" if status < 500 else "api_error",
        message,
        code=code if isinstance(code, str) else None,
    )
    return dialect.error_body(err)


class ChatStream:
    """One chat completion stream, read once and written as the client's API's events.

    :meth:`feed` takes the region's bytes as they come and returns the client's; once the
    region's stream ended, :meth:`close` returns the end of the client's, or None when
    the region's stream broke off before its answer ended (no finish reason, no
    ``[DONE]``): the caller takes it as broken.
    """

    __slots__ = (
        "dialect",
        "writer",
        "reader",
        "opened",
        "ended",
        "finish",
        "usage",
        "prompt",
        "pieces",
    )

    def __init__(self, dialect: Dialect, head: AnswerText, prompt: int) -> None:
        self.dialect = dialect
        # The prompt is counted only at the end of a chat stream: the writer says so there.
        head.usage = None
        self.writer: StreamWriter = dialect.writer(head)
        self.writer.text_first = False
        self.reader = SSEReader()
        self.opened = False
        self.ended = False
        self.finish: str | None = None
        self.usage: Any = None
        self.prompt = prompt  # the estimate, for a region that counts nothing
        self.pieces = 0

    def feed(self, chunk: bytes) -> bytes:
        out = b""
        for event in self.reader.feed(chunk):
            data = event.data
            if self.ended or not data:
                continue  # a keep-alive comment: the client's own heartbeats are the proxy's
            if data == b"[DONE]":
                out += self._end()
                continue
            obj = loads(data)
            if isinstance(obj, dict):
                out += self._chunk(obj)
        return out

    def _chunk(self, obj: dict[str, Any]) -> bytes:
        writer = self.writer
        out = b""
        if not self.opened:
            self.opened = True
            out = writer.open()
        usage = obj.get("usage")
        if usage:
            self.usage = usage
        choices = obj.get("choices")
        if not choices:
            if "error" in obj:
                self.ended = True
                return out + self._error(obj)
            return out
        choice = choices[0]
        delta = choice.get("delta")
        if delta:
            content = delta.get("content")
            if content:
                self.pieces += 1
                out += writer.piece(content)
            calls = delta.get("tool_calls")
            if calls:
                self.pieces += 1
                for call in calls:
                    function = call.get("function") or {}
                    out += writer.tool(
                        call.get("index", 0),
                        call.get("id"),
                        function.get("name"),
                        function.get("arguments") or "",
                    )
        finish = choice.get("finish_reason")
        if finish:
            self.finish = finish
        return out

    def _end(self) -> bytes:
        self.ended = True
        out = b"" if self.opened else self.writer.open()
        self.opened = True
        usage = usage_or(self.usage, self.prompt, self.pieces)
        return out + self.writer.close(self.finish or "stop", usage)

    def _error(self, obj: dict[str, Any]) -> bytes:
        error = obj.get("error")
        error = error if isinstance(error, dict) else {}
        message = error.get("message")
        err = ProxyError(
            502,
            str(error.get("type") or "api_error"),
            message if isinstance(message, str) else "the region's stream failed",
            code=error.get("code") if isinstance(error.get("code"), str) else None,
        )
        return self.dialect.error_event(err)

    def close(self) -> bytes | None:
        """The client's stream's end, after the region's ended; None: it broke off."""
        if self.ended:
            return b""
        if self.finish is None:
            return None
        return self._end()


def head_for(dialect: Dialect, model: str) -> AnswerText:
    """A fresh answer of the client's API: its id, the model, now."""
    return AnswerText(dialect.answer_id(), model, int(time.time()))
