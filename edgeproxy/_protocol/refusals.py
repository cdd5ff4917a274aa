"""What a region's refusal means: "too long for this model", in each server's words.

A request longer than the model's context window is refused with a 400 (413 by some
servers) whose wording differs per server; none of them is worth retrying on the same
model, and a model with a larger window may answer it (the route's ``larger_models``).
:func:`too_long` recognises the wordings of OpenAI (``context_length_exceeded``), vLLM,
SGLang, llama.cpp's ``llama-server`` and llama-cpp-python's server, TGI and Anthropic's
Messages API. Any other refusal (a content filter, a bad parameter) is the client's to
read, passed through once and never retried.
"""

from __future__ import annotations

import re

import orjson

__all__ = ["REFUSAL_READ_LIMIT", "TOO_LONG_STATUSES", "error_message", "too_long"]

REFUSAL_READ_LIMIT = 64 * 1024
"""The most of a refusal's body read for its reason."""

TOO_LONG_STATUSES = frozenset({400, 413})

# Lower-cased: each alternative is one server's wording (see the module's docstring).
_TOO_LONG = re.compile(
    r"context_length_exceeded"  # OpenAI's code
    r"|exceed_context_size"  # llama-server's error type
    r"|maximum context length"  # OpenAI, vLLM, SGLang
    r"|model'?s context length"  # SGLang: longer than the model's context length
    r"|maximum model length"  # vLLM: the decoder prompt is longer than ...
    r"|exceeds? (?:the )?(?:available )?context (?:size|window)"  # llama.cpp, llama-cpp-python
    r"|prompt is too long"  # Anthropic
    r"|exceed context limit"  # Anthropic: input length and max_tokens exceed context limit
    r"|tokens \+ `max_new_tokens` must be <="  # TGI
    r"|must have less than \d+ tokens"  # TGI
)


def too_long(status: int, body: bytes) -> bool:
    """Whether a region's ``status`` and error ``body`` say the request is longer than the
    model's context window."""
    if status not in TOO_LONG_STATUSES or not body:
        return False
    text = body
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    else:
        # The message and code as the API puts them; a whole body could quote the prompt.
        error = data.get("error", data) if isinstance(data, dict) else None
        if isinstance(error, dict):
            parts = [error.get(k) for k in ("code", "type", "message", "detail")]
            text = " ".join(p for p in parts if isinstance(p, str)).encode()
        elif isinstance(error, str):
            text = error.encode()
    return _TOO_LONG.search(text.decode("utf-8", "replace").lower()) is not None


def error_message(body: bytes, limit: int = 300) -> str | None:
    """The ``error.message`` of a region's JSON error body (OpenAI's and Anthropic's shape,
    or FastAPI's ``detail``), cut to ``limit`` characters; None when it has none."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    message = error.get("message") if isinstance(error, dict) else data.get("detail")
    return message[:limit] if isinstance(message, str) else None
