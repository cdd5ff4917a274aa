"""OpenAI request bodies: which must be JSON objects, their validation, the prompt estimate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import orjson

from edgeproxy._core.config import LimitsConfig, RouteConfig
from edgeproxy._core.errors import ProxyError
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.strictjson import MAX_DEPTH, NestedTooDeeply, duplicate_key, too_deep
from edgeproxy._protocol.dialects import OPENAI
from edgeproxy._protocol.endpoints import dialect_for, endpoint_has

__all__ = [
    "BodyDeadline",
    "BodyTimeout",
    "BodyTooLarge",
    "body_bound_due",
    "body_bound_passed",
    "body_wait",
    "body_error",
    "check_json_content_type",
    "estimate_prompt_tokens",
    "is_llm_request",
    "parse_json_object",
    "read_json_body",
    "requires_json",
    "SlowBody",
]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Error messages echo at most this much of what the client sent.
_ECHO_LIMIT = 120


class BodyTooLarge(ProxyError):
    """The request body passed ``limits.max_body_size`` (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            "invalid_request_error",
            f"Request body too large: the limit is {limit} bytes.",
            code="request_too_large",
            headers={"Connection": "close"},
        )


class BodyTimeout(ProxyError):
    """The client stopped sending its body for ``limits.body_timeout`` (408)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(
            408,
            "invalid_request_error",
            f"The request body stalled for {seconds:g} seconds.",
            code="request_timeout",
            headers={"Connection": "close"},
        )


class BodyDeadline(ProxyError):
    """The whole body did not arrive within ``limits.body_deadline`` (408)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(
            408,
            "invalid_request_error",
            f"The request body did not arrive within {seconds:g} seconds.",
            code="request_timeout",
            headers={"Connection": "close"},
        )


class SlowBody(ProxyError):
    """The body arrived slower than ``limits.min_body_rate`` (408)."""

    def __init__(self, rate: int) -> None:
        super().__init__(
            408,
            "invalid_request_error",
            f"The request body arrived slower than {rate} bytes per second.",
            code="request_timeout",
            headers={"Connection": "close"},
        )


def body_bound_due(
    limits: LimitsConfig, *, stalled: float, active: float, received: int, rate_grace: float
) -> float:
    """Seconds until a body in progress could pass one of its bounds, with no more bytes.

    ``stalled``: seconds since its last bytes came; ``active``: seconds it has been
    arriving, less those the proxy did not read; ``received``: its bytes so far;
    ``rate_grace``: ``limits.body_rate_grace``, or less while draining. Every front end
    bounds bodies with this and :func:`body_bound_passed`.
    """
    delay = limits.body_timeout - stalled
    if limits.body_deadline:
        delay = min(delay, limits.body_deadline - active)
    if limits.min_body_rate:
        # With no more bytes, the average falls under the rate at `received / rate`.
        due = max(rate_grace, received / limits.min_body_rate)
        delay = min(delay, due - active)
    return max(delay, 0.0)


def body_bound_passed(
    limits: LimitsConfig, *, stalled: float, active: float, received: int, rate_grace: float
) -> ProxyError | None:
    """The bound a body in progress has passed (408), if any; the arguments are
    :func:`body_bound_due`'s."""
    if stalled >= limits.body_timeout:
        return BodyTimeout(limits.body_timeout)
    if limits.body_deadline and active >= limits.body_deadline:
        return BodyDeadline(limits.body_deadline)
    rate = limits.min_body_rate
    if rate and active >= rate_grace and received < rate * active:
        return SlowBody(rate)
    return None


_T = TypeVar("_T")


async def body_wait(
    waiting: Awaitable[_T],
    limits: LimitsConfig,
    *,
    active: float,
    received: int,
    rate_grace: float,
) -> tuple[_T, float]:
    """``waiting`` (the next bytes of a body in progress), within the body's bounds: its
    result and the seconds it took, to add to ``active``. Past a bound, raises that
    bound's error (:func:`body_bound_passed`, or :class:`BodyTimeout` at the due time
    exactly, where the rate check's equality may still hold). For front ends that wait
    for body bytes themselves (the ASGI application, the HTTP/2 listener)."""
    wait = body_bound_due(
        limits, stalled=0.0, active=active, received=received, rate_grace=rate_grace
    )
    started = time.monotonic()
    try:
        async with asyncio.timeout(wait):
            result = await waiting
    except TimeoutError:
        stalled = time.monotonic() - started
        error = body_bound_passed(
            limits,
            stalled=stalled,
            active=active + stalled,
            received=received,
            rate_grace=rate_grace,
        )
        raise (error or BodyTimeout(limits.body_timeout)) from None
    return result, time.monotonic() - started


# -- JSON bodies of LLM routes ------------------------------------------------------


def is_llm_request(method: str, path: str) -> bool:
    """Whether this is a POST to an endpoint whose answers carry token usage (chat, embeddings...).

    Such requests have their prompt tokens estimated for the token limits.
    """
    return method == "POST" and endpoint_has(path, "usage")


def requires_json(method: str, path: str, route: RouteConfig) -> bool:
    """Whether the body must be a JSON object: the route's ``require_json``, else the
    endpoint table's say for POSTs (chat, completions, embeddings, responses, moderations)."""
    if method not in _BODY_METHODS:
        return False
    if route.require_json is not None:
        return route.require_json
    return method == "POST" and endpoint_has(path, "json_body")


def _bad_body(message: str, code: str) -> ProxyError:
    return ProxyError(400, "invalid_request_error", message, code=code)


def check_json_content_type(content_type: str | None, content_encoding: str | None) -> None:
    """Raise a 400 unless the body is declared as uncompressed UTF-8 JSON."""
    if content_type == "application/json" and not content_encoding:
        return  # what nearly every client sends
    media, _, params = (content_type or "").partition(";")
    media = media.strip().lower()
    is_json = media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )
    if not is_json:
        shown = (content_type or "none")[:_ECHO_LIMIT]
        raise _bad_body(
            f"Invalid Content-Type {shown!r}: this endpoint takes 'application/json'.",
            "invalid_content_type",
        )
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
            if charset not in ("utf-8", "utf8"):
                raise _bad_body(
                    f"Invalid charset {charset[:_ECHO_LIMIT]!r}: JSON bodies must be UTF-8.",
                    "invalid_content_type",
                )
    if content_encoding and content_encoding.strip().lower() not in ("", "identity"):
        raise _bad_body(
            "Compressed request bodies (Content-Encoding) are not accepted on this endpoint.",
            "unsupported_content_encoding",
        )


def parse_json_object(body: bytes | None) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying why it is not one."""
    if not body:
        raise _bad_body(
            "The request body is empty: this endpoint takes a JSON object.", "invalid_body"
        )
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if too_deep(exc):
            raise _too_deep() from None
        # orjson reports invalid UTF-8 and lone surrogates as decode errors too.
        raise _bad_body(
            f"The request body is not valid JSON: {str(exc)[:_ECHO_LIMIT]}", "invalid_json"
        ) from None
    if not isinstance(value, dict):
        raise _bad_body(
            f"The request body must be a JSON object, not {_json_kind(value)}.", "invalid_body"
        )
    try:
        duplicated = duplicate_key(body, value)
    except NestedTooDeeply:
        raise _too_deep() from None
    if duplicated is not None:
        # Parsers disagree on which occurrence counts (RFC 8259 §4): the region could
        # answer another question than the one the proxy keyed, limited and routed.
        raise ProxyError(
            400,
            "invalid_request_error",
            f"The request body names the key {duplicated[:_ECHO_LIMIT]!r} twice in one "
            "object: send each key once.",
            code="invalid_body",
            param=duplicated[:_ECHO_LIMIT],
        )
    return value


def _too_deep() -> ProxyError:
    # Valid JSON, but past the depth every step of the proxy reads the same way.
    return _bad_body(
        f"The request body nests arrays and objects more than {MAX_DEPTH} levels deep: "
        f"the limit is {MAX_DEPTH}.",
        "json_too_deep",
    )


def body_error(path: str, body: dict[str, Any]) -> ProxyError | None:
    """The 400 every server of the API ``path`` names would answer ``body`` with (a field of
    the wrong type, a missing model or conversation, an empty one, a chat message that is
    no object with a role, a parameter out of its range: its dialect's
    :meth:`~edgeproxy._protocol.dialects.Dialect.check`), in OpenAI's error shape with
    ``param`` naming the field (Anthropic's, on its paths, when the error is written); None
    for a body some server may take, or a path of no API the proxy knows."""
    dialect = dialect_for(path)
    if dialect is OPENAI:
        return None
    return dialect.check(body)


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"


async def read_json_body(request: Exchange, ctx: Any, max_size: int) -> dict[str, Any]:
    """Validate an LLM route's body as a JSON object, reading it first if the pipeline did not.

    ``ctx`` is the request's :class:`~edgeproxy.RequestContext`; a body the
    pipeline left to stream (chunked, or large) is read here, up to
    ``max_size`` bytes (0: no limit), and kept on ``ctx``.
    """
    check_json_content_type(ctx.headers.get("content-type"), ctx.headers.get("content-encoding"))
    if not ctx.body_read:
        ctx.body = await _read_bounded(request, max_size)
        ctx.body_read = True
    value = parse_json_object(ctx.body)
    # Parsed once: plugins and later stages read ctx.json without parsing again.
    ctx._json = value
    return value


async def _read_bounded(request: Exchange, max_size: int) -> bytes:
    length = request.content_length
    if max_size and length is not None and length > max_size:
        raise BodyTooLarge(max_size)
    parts: list[bytes] = []
    total = 0
    while chunk := await request.read_chunk():
        total += len(chunk)
        if max_size and total > max_size:
            raise BodyTooLarge(max_size)
        parts.append(chunk)
    return b"".join(parts)


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A cheap upper-ish estimate of a request's prompt tokens: about 4 characters each.

    Counts the text of ``messages`` (strings and text parts), ``prompt``,
    ``input`` and ``instructions``, plus a few tokens of framing per message.
    The rate limiter settles the difference with the upstream's usage.
    """
    chars = 0
    framing = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages[:10_000]:
            framing += 4
            if isinstance(message, dict):
                chars += _text_chars(message.get("content"), 0)
                name = message.get("name")
                if isinstance(name, str):
                    chars += len(name)
    # Completions' prompt, the Responses API's input and instructions, Messages' system.
    for key in ("prompt", "input", "instructions", "system"):
        chars += _text_chars(body.get(key), 0)
    return max(1, framing + (chars + 3) // 4)


def _text_chars(value: Any, depth: int) -> int:
    if isinstance(value, str):
        return len(value)
    if depth > 4:
        return 0
    if isinstance(value, list):
        return sum(_text_chars(item, depth + 1) for item in value[:10_000])
    if isinstance(value, dict):
        # Content parts: {"type": "text", "text": ...}; images count as nothing here.
        return _text_chars(value.get("text"), depth + 1) + _text_chars(
            value.get("content"), depth + 1
        )
    if isinstance(value, int) and not isinstance(value, bool):
        return 1  # a token id of a pre-tokenized prompt
    return 0
