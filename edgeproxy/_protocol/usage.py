"""Token usage of LLM answers, picked out as the body streams past.

Three shapes of ``usage`` reach it, and every reader (the metrics, the token limits, the
access log, tokens per second) gets one: chat's (``prompt_tokens``, ``completion_tokens``,
``total_tokens``), with the API's own fields kept beside them.

* chat completions and completions: ``usage`` at the top of the JSON answer, or of the
  last streamed chunk (``stream_options.include_usage``);
* the Responses API: ``usage`` at the top of the JSON answer, or in the ``response`` of the
  ``response.completed`` (``.incomplete``, ``.failed``) event: ``input_tokens`` (cached
  ones included) and ``output_tokens``;
* Anthropic Messages: ``usage`` at the top of the JSON answer; streamed, split over
  ``message_start`` (in its ``message``: the input tokens, cache reads and writes) and
  ``message_delta`` (the output tokens so far), the later value of a field winning. The
  prompt is ``input_tokens`` plus ``cache_read_input_tokens`` and
  ``cache_creation_input_tokens``, which Anthropic counts apart.
"""

from __future__ import annotations

from typing import Any

import orjson

from edgeproxy._protocol.endpoints import endpoint_has

__all__ = ["UsageTracker"]

# A JSON answer longer than this is not kept for usage parsing.
_JSON_LIMIT = 1024 * 1024


class UsageTracker:
    """Finds the ``usage`` object in a JSON answer or an SSE stream, without delaying it.

    For SSE only lines that mention ``"usage"`` are parsed (OpenAI sends it
    in the last chunk when ``stream_options.include_usage`` is set); for
    JSON the body is kept up to 1 MiB and parsed at the end.
    """

    __slots__ = ("_sse", "_buf", "_usage", "_overflow")

    def __init__(self, *, sse: bool) -> None:
        self._sse = sse
        self._buf = b""
        self._usage: dict[str, Any] | None = None
        self._overflow = False

    @classmethod
    def for_response(cls, path: str, content_type: str, status: int) -> UsageTracker | None:
        if status != 200 or not endpoint_has(path, "usage"):
            return None
        if content_type.startswith("text/event-stream"):
            return cls(sse=True)
        if "json" in content_type:
            return cls(sse=False)
        return None

    def feed(self, chunk: bytes) -> None:
        if not self._sse:
            if not self._overflow:
                if len(self._buf) + len(chunk) > _JSON_LIMIT:
                    self._overflow = True
                    self._buf = b""
                else:
                    self._buf += chunk
            return
        data = self._buf + chunk if self._buf else chunk
        # find(), not `in`: for bytes it is about half the cost, once per streamed chunk.
        if data.find(b'"usage"') < 0:
            # Keep only a possibly unfinished last line.
            cut = data.rfind(b"\n")
            self._buf = data[cut + 1 :] if cut >= 0 else data
            if len(self._buf) > _JSON_LIMIT:
                self._buf = b""
            return
        lines = data.split(b"\n")
        self._buf = lines.pop()
        for line in lines:
            if line.startswith(b"data:") and b'"usage"' in line:
                self._take(line[5:].strip())

    def _take(self, raw: bytes) -> None:
        try:
            event = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        usage = event.get("usage")
        if not isinstance(usage, dict):
            # Responses' final event, Messages' first: the usage inside the object.
            inner = event.get("response") or event.get("message")
            usage = inner.get("usage") if isinstance(inner, dict) else None
            if not isinstance(usage, dict):
                return
        if self._usage is None or "prompt_tokens" in usage:
            self._usage = dict(usage)
        else:
            # Messages: message_delta's counts update message_start's, field by field.
            self._usage.update(usage)

    def result(self) -> dict[str, Any] | None:
        if not self._sse and not self._overflow and self._buf:
            self._take(self._buf)
            self._buf = b""
        usage = self._usage
        if usage is not None and "prompt_tokens" not in usage and "input_tokens" in usage:
            return chat_usage(usage)
        return usage


def chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A Responses or Messages ``usage`` with chat's fields added (its own kept)."""
    prompt = _tokens(usage.get("input_tokens"))
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
        # Anthropic counts cached input apart from input_tokens; OpenAI includes it.
        prompt += _tokens(usage.get("cache_read_input_tokens"))
        prompt += _tokens(usage.get("cache_creation_input_tokens"))
    completion = _tokens(usage.get("output_tokens"))
    return {
        **usage,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _tokens(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
