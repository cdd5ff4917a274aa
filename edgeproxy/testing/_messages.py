"""The Anthropic Messages API of the fake region: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

The answer comes from the same deterministic generator as chat completions,
fed with the conversation as chat ``messages``: ``system`` (if any) as a
``system`` message, then each message with its text blocks joined into one
string, so it equals :func:`~edgeproxy.testing.answer_text` of those messages
and ``Behavior.tokens`` tokens. ``max_tokens`` (required, as Anthropic
requires it) cuts it shorter, with ``stop_reason: "max_tokens"``; a stop
sequence found in it ends it there (``stop_reason: "stop_sequence"``).

A last message from the ``assistant`` is a prefill, which the answer
continues, as with chat continuations: the answer to the conversation
without that message, after the prefill's text (``Behavior.continuation_overlap``
applies), so a partial answer followed by its continuation equals the
unbroken answer. ``max_tokens`` counts the new tokens only. A prefill that ends with
whitespace is refused (400), as Anthropic refuses it.

Usage counts input tokens with the KV model's tokeniser
(:mod:`edgeproxy.testing._kv`), which ``count_tokens`` also answers with: the
prefix the region's KV cache held is in ``cache_read_input_tokens``; when the
request carries a ``cache_control`` breakpoint, the prompt's whole KV blocks this
request added to the cache are in ``cache_creation_input_tokens``; the rest in
``input_tokens``. ``output_tokens`` is one per text delta.

Errors have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from edgeproxy._protocol.dialects.messages import anthropic_error_type as error_type
from edgeproxy._protocol.dialects.messages import message_id
from edgeproxy.testing import _content as content
from edgeproxy.testing._behavior import Behavior
from edgeproxy.testing._exchange import (
    BadRequest,
    Exchange,
    Generation,
    Reply,
    joined_text,
    json_reply,
    set_json,
)
from edgeproxy.testing._kv import read_prompt

MAX_TOKENS: Final = 100_000
_SSE_HEADERS: Final = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_reply(status: int, message: str) -> Reply:
    return json_reply(status, error_body(status, message))


@dataclass(slots=True)
class SeenHeaders:
    """The last Anthropic headers a region received, to check that a proxy forwards them."""

    anthropic_version: str | None = None
    anthropic_beta: str | None = None

    def record(self, ex: Exchange) -> None:
        version = ex.header(b"anthropic-version")
        if version is not None:
            self.anthropic_version = version.decode("latin-1")
        beta = ex.header(b"anthropic-beta")
        if beta is not None:
            self.anthropic_beta = beta.decode("latin-1")


def _text(value: object, where: str) -> str | list[Any]:
    """A message's content as the conversation holds it (see ``joined_text``)."""
    return joined_text(
        value,
        _TEXT_BLOCKS,
        not_list=f"{where}: Input should be a valid string or list",
        not_object=f"{where}: content blocks must be objects",
    )


_TEXT_BLOCKS: Final = frozenset({"text"})


def _conversation(request: dict[str, Any]) -> list[Any]:
    """The chat ``messages`` a Messages request is answered as (see the module's docstring)."""
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: Field required (a non-empty array)")
    convo: list[Any] = []
    system = request.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            convo.append({"role": "system", "content": text})
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise BadRequest(f"messages.{index}.role: Input should be 'user' or 'assistant'")
        text = _text(message.get("content"), f"messages.{index}.content")
        convo.append({"role": message["role"], "content": text})
    return convo


def _prompt_tokens(convo: list[Any]) -> int:
    return read_prompt({"messages": convo}, chat=True, block_size=1, hashed=False).tokens


def _has_breakpoint(request: dict[str, Any]) -> bool:
    """Whether a block of ``tools``, ``system`` or the messages carries ``cache_control``."""
    blocks: list[Any] = []
    for key in ("tools", "system"):
        value = request.get(key)
        if isinstance(value, list):
            blocks += value
    for message in request.get("messages") or ():
        body = message.get("content") if isinstance(message, dict) else None
        if isinstance(body, list):
            blocks += body
    return any(isinstance(b, dict) and b.get("cache_control") is not None for b in blocks)


class CacheReport:
    """A Messages answer's ``Reply.with_cache``: Anthropic reports the prompt tokens read
    from the cache and those this request wrote to it, both apart from ``input_tokens``,
    so the region gives both (:meth:`record`); called with the read ones alone, it wrote
    none."""

    __slots__ = ("_rebuild",)

    def __init__(self, rebuild: Callable[[int, int], None]) -> None:
        self._rebuild = rebuild

    def __call__(self, cached: int) -> None:
        self._rebuild(cached, 0)

    def record(self, cached: int, written: int) -> None:
        self._rebuild(cached, written)


def count_tokens(request: dict[str, Any]) -> Reply:
    """``POST /v1/messages/count_tokens``."""
    return json_reply(200, {"input_tokens": _prompt_tokens(_conversation(request))})


def _stop_sequences(request: dict[str, Any]) -> list[str]:
    value = request.get("stop_sequences")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise BadRequest("stop_sequences: Input should be a list of non-empty strings")
    return value


def _cut_at_stop(words: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    """``words`` up to the first stop sequence (left out, as Anthropic does) and that sequence."""
    text = "".join(words)
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return words, None
    at, stop = min(found)
    kept: list[str] = []
    length = 0
    for word in words:
        if length + len(word) >= at:
            if at > length:
                kept.append(word[: at - length])
            break
        kept.append(word)
        length += len(word)
    return kept, stop


def create(request: dict[str, Any], behavior: Behavior, region_model: str) -> Reply:
    """``POST /v1/messages``."""
    limit = request.get("max_tokens")
    if limit is None:
        raise BadRequest("max_tokens: Field required")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise BadRequest("max_tokens: Input should be an integer of at least 1")
    limit = min(limit, MAX_TOKENS)
    stream = request.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: Input should be a valid boolean")
    convo = _conversation(request)
    stops = _stop_sequences(request)
    model = request.get("model")
    model = model if isinstance(model, str) and model else region_model

    last = convo[-1]
    if last["role"] == "assistant" and isinstance(last["content"], str):
        if last["content"] != last["content"].rstrip():
            # As Anthropic refuses it.
            raise BadRequest(
                "messages: final assistant content cannot end with trailing whitespace"
            )
        # The unbroken answer is to the conversation without the prefill.
        answer = list(content.tokens(content.digest(convo[:-1]), behavior.tokens))
        rest = content.continuation(answer, last["content"], behavior.continuation_overlap)
    else:
        rest = list(content.tokens(content.digest(convo), behavior.tokens))
    words = rest[:limit]
    stop_reason = "max_tokens" if len(rest) > limit else "end_turn"
    words, stop = _cut_at_stop(words, stops)
    if stop is not None:
        stop_reason = "stop_sequence"
    id_ = message_id()
    chat_request = {"messages": convo, "max_tokens": len(words)}
    prompt_tokens = _prompt_tokens(convo)
    marked = _has_breakpoint(request)
    cached = written = 0

    def usage(output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": prompt_tokens - cached - written,
            "cache_creation_input_tokens": written,
            "cache_read_input_tokens": cached,
            "output_tokens": output_tokens,
            "service_tier": "standard",
        }

    def message(text_blocks: list[dict[str, str]], *, done: bool) -> dict[str, Any]:
        return {
            "id": id_,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": text_blocks,
            "stop_reason": stop_reason if done else None,
            "stop_sequence": stop if done else None,
            "usage": usage(len(words) if done else 1),
        }

    def events() -> list[bytes]:
        opening = [
            content.sse_named_event(
                "message_start", {"type": "message_start", "message": message([], done=False)}
            ),
            content.sse_named_event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            ),
            content.sse_named_event("ping", {"type": "ping"}),
        ]
        parts = [b"".join(opening)]
        for word in words:
            delta = {"type": "text_delta", "text": word}
            parts.append(
                content.sse_named_event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": delta},
                )
            )
        closing = [
            content.sse_named_event(
                "content_block_stop", {"type": "content_block_stop", "index": 0}
            ),
            content.sse_named_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop},
                    "usage": {"output_tokens": len(words)},
                },
            ),
            content.sse_named_event("message_stop", {"type": "message_stop"}),
        ]
        parts.append(b"".join(closing))
        return parts

    def json_message() -> dict[str, Any]:
        return message([{"type": "text", "text": "".join(words)}], done=True)

    if stream:
        reply = Reply(
            200,
            [*_SSE_HEADERS],
            events(),
            gap=behavior.inter_token_delay,
            gap_units=len(words),
            lead_parts=1,
        )

        def stream_error(index: int) -> bytes:
            status = behavior.fault_status
            return content.sse_named_event(
                "error",
                error_body(status, f"injected {error_type(status)} after {index - 1} tokens"),
            )

        reply.stream_error = stream_error
    else:
        reply = json_reply(200, json_message())

    def with_cache(read: int, wrote: int) -> None:
        nonlocal cached, written
        # Anthropic counts at least one input token as read afresh.
        cached = min(read, max(0, prompt_tokens - 1))
        # Only a request that asks for a cache entry is charged for writing one, and its
        # last token, like the one read afresh, is never in it.
        written = min(wrote, max(0, prompt_tokens - cached - 1)) if marked else 0
        if stream:
            reply.parts = events()
        else:
            set_json(reply, json_message())

    reply.first_delay = behavior.ttft
    reply.generation = Generation(chat_request, True, len(words))
    reply.with_cache = CacheReport(with_cache)
    reply.headers.append((b"request-id", b"req_" + secrets.token_hex(12).encode()))
    return reply
