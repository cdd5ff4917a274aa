"""Token usage of LLM answers, picked out as the body streams past.

Where each API puts its ``usage`` is its dialect's to say (``usage_of``), and so is how
the counts of a stream's events combine (``merge_usage``) and what they amount to in
chat's fields (``counted``: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``),
which every reader counts (the metrics, the token limits, the access log, tokens per
second); the API's own fields are kept beside them.

* chat completions and completions: ``usage`` at the top of the JSON answer, or of the
  last streamed chunk (``stream_options.include_usage``);
* the Responses API: in the JSON answer, or in the ``response`` of ``response.completed``;
* Anthropic Messages: in the JSON answer; streamed, split over ``message_start`` and
  ``message_delta``.

A chat or completions stream that carries no usage (llama-cpp-python's server never
sends it) is counted by estimate: a token per content event, and the prompt as
:func:`~edgeproxy._protocol.bodies.estimate_prompt_tokens` estimates it, marked
``"estimated": true``.
"""

from __future__ import annotations

from typing import Any

import orjson

from edgeproxy._protocol.bodies import estimate_prompt_tokens
from edgeproxy._protocol.dialects import CHAT, COMPLETIONS, Dialect
from edgeproxy._protocol.endpoints import openai_endpoint
from edgeproxy._protocol.sse import SSEEvent

__all__ = ["UsageTracker"]

# A JSON answer longer than this is not kept for usage parsing.
_JSON_LIMIT = 1024 * 1024


class UsageTracker:
    """Finds the ``usage`` in a JSON answer or an SSE stream, without delaying it.

    A stream's events come read already (the Responder's one parse of the body, which
    reads a chunk for the usage only where it may be); only events that
    mention ``"usage"`` are parsed as JSON. A JSON answer is kept up to 1 MiB and parsed at
    the end.
    """

    __slots__ = (
        "_sse",
        "_dialect",
        "_buf",
        "_usage",
        "_overflow",
        "_body",
        "_deltas",
        "_mark",
        "_kept",
        "keeps",
    )

    def __init__(
        self, *, sse: bool, dialect: Dialect = CHAT, body: Any = None, keep: bool = False
    ) -> None:
        self._sse = sse
        # Keep the answer the usage came in (a stored Responses response whose chain the
        # edge holds): it is parsed for the usage anyway.
        self.keeps = keep
        self._kept: dict[str, Any] | None = None
        self._dialect = dialect
        self._buf = b""
        self._usage: dict[str, Any] | None = None
        self._overflow = False
        # For a stream with no usage of its own: the request, and its content events.
        self._body = body
        self._deltas = 0
        # What marks a content delta, counted for the estimate: only chat's and
        # completions' streams are estimated (the other APIs' always count themselves).
        self._mark = (
            b'"content":"' if dialect is CHAT else b'"text":"' if dialect is COMPLETIONS else None
        )

    @classmethod
    def for_response(
        cls, path: str, content_type: str, status: int, body: Any = None, keep: bool = False
    ) -> UsageTracker | None:
        """The tracker of an answer of ``status`` and ``content_type`` to ``path``; ``body``:
        the request's JSON, for the estimate of a stream that counts nothing; ``keep``:
        keep the answer the usage came in (:meth:`kept`)."""
        if status != 200:
            return None
        endpoint = openai_endpoint(path)
        if endpoint is None or not endpoint.usage:
            return None
        if content_type.startswith("text/event-stream"):
            return cls(sse=True, dialect=endpoint.dialect, body=body, keep=keep)
        if "json" in content_type:
            return cls(sse=False, dialect=endpoint.dialect, keep=keep)
        return None

    def feed(self, chunk: bytes, events: list[SSEEvent] | None = None) -> None:
        """A chunk of the answer; for a stream, the events it completed (None when it was
        left unread: whole events that do not mention the usage)."""
        if not self._sse:
            if not self._overflow:
                if len(self._buf) + len(chunk) > _JSON_LIMIT:
                    self._overflow = True
                    self._buf = b""
                else:
                    self._buf += chunk
            return
        mark = self._mark
        if mark is not None and self._usage is None:
            # A count in C, for the estimate should the stream carry no usage.
            self._deltas += chunk.count(mark)
        if events:
            for event in events:
                # find(), not `in`: for bytes it is about half the cost, once per event.
                if event.data.find(b'"usage"') >= 0:
                    self._take(event.data)

    def _take(self, raw: bytes) -> None:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        usage = self._dialect.usage_of(obj)
        if usage is not None:
            self._usage = self._dialect.merge_usage(self._usage, usage)
            if self.keeps:
                self._kept = obj

    def kept(self) -> dict[str, Any] | None:
        """The answer the usage came in, once :meth:`result` was asked: the JSON answer, or
        what the dialect's final event carries it in (a Responses stream's ``response``)."""
        obj = self._kept
        if obj is None or not self._sse:
            return obj
        inside = self._dialect.usage_inside
        inner = obj.get(inside) if inside else None
        return inner if isinstance(inner, dict) else None

    def result(self) -> dict[str, Any] | None:
        if not self._sse and not self._overflow and self._buf:
            self._take(self._buf)
            self._buf = b""
        usage = self._usage
        if usage is not None:
            return self._dialect.counted(usage)
        if not self._sse or not self._deltas or not isinstance(self._body, dict):
            return None
        if self._mark is None:
            return None  # the other APIs' servers always count their streams
        prompt = estimate_prompt_tokens(self._body)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self._deltas,
            "total_tokens": prompt + self._deltas,
            "estimated": True,
        }
