"""Mapping an OpenAI chat or text completion request onto a local generation.

:func:`parse_generation_request` validates the body (400 naming the bad
field), maps the sampling fields llama.cpp supports and lists the others that
would change the answer, for the warning header.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.endpoints import CHAT_COMPLETIONS, openai_endpoint

__all__ = ["GenerationRequest", "parse_generation_request"]

# Request fields that shape the answer and are mapped onto llama.cpp sampling.
# top_k, min_p, typical_p and repeat_penalty are llama.cpp extensions, as
# llama-cpp-python's own server accepts them.
_MAPPED = frozenset(
    {
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "seed",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "top_k",
        "min_p",
        "typical_p",
        "repeat_penalty",
    }
)
# Fields with no bearing on a single local answer: accepted without a warning.
_NEUTRAL = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "stream",
        "stream_options",
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
    }
)
# Unsupported fields that are harmless at these values (the OpenAI defaults).
_HARMLESS: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v == 1,
    "best_of": lambda v: v == 1,
    "logprobs": lambda v: v is False or v == 0,
    "top_logprobs": lambda v: v == 0,
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
    "tools": lambda v: v == [],
    "functions": lambda v: v == [],
    "tool_choice": lambda v: v in ("none", "auto"),
    "function_call": lambda v: v in ("none", "auto"),
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
}
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _bad(message: str, *, code: str | None = None) -> ProxyError:
    return ProxyError(400, "invalid_request_error", message, code=code)


@dataclass(slots=True)
class GenerationRequest:
    """A validated chat or text completion request, ready for the model."""

    chat: bool
    stream: bool
    include_usage: bool
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str | list[int] = ""
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    # Text the answer already begins with (a continued stream's partial answer): the model
    # goes on from it, and it is not sent again.
    prefix: str = ""


def _number(
    body: dict[str, Any], key: str, low: float, high: float, *, low_open: bool = False
) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{key} must be a number")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _bad(f"{key} must be in {bracket}{low:g}, {high:g}], not {value!r}")
    return float(value)


def _integer(body: dict[str, Any], key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer")
    if value < low:
        raise _bad(f"{key} must be >= {low}, not {value}")
    return value


def _content(index: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(
                    f"messages[{index}].content: the local model reads text only, "
                    f"not {kind!r} parts"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"messages[{index}].content: a text part needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)
    raise _bad(f"messages[{index}].content must be a string or a list of text parts")


def parse_generation_request(path: str, body: Any) -> GenerationRequest:
    """Validate an OpenAI chat or text completion body for the local model.

    Raises :class:`ProxyError` 400 (``invalid_request_error``) naming the bad
    field. Sampling fields llama.cpp supports are mapped; other fields that
    would change the answer are collected in ``ignored`` for the warning
    header.
    """
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    chat = openai_endpoint(path) is CHAT_COMPLETIONS
    stream_options = body.get("stream_options")
    req = GenerationRequest(
        chat=chat,
        stream=body.get("stream") is True,
        include_usage=isinstance(stream_options, dict)
        and stream_options.get("include_usage") is True,
    )
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise _bad("messages must be a list of messages")
        if not messages:
            raise _bad("messages must not be empty", code="empty_messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise _bad(f"messages[{i}] must be an object")
            role = message.get("role")
            if role not in _ROLES:
                raise _bad(f"messages[{i}].role must be one of {', '.join(sorted(_ROLES))}")
            # Chat templates know "system"; "developer" is OpenAI's new name for it.
            req.messages.append(
                {
                    "role": "system" if role == "developer" else str(role),
                    "content": _content(i, message.get("content")),
                }
            )
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            req.prompt = prompt
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            req.prompt = list(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise _bad("prompt: the local model answers one prompt per request")
        else:
            raise _bad("prompt must be a string or a list of token ids")

    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    req.max_tokens = max_tokens
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop = [stop] if stop else []
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        req.stop = [s for s in stop if s]
    elif stop is not None:
        raise _bad("stop must be a string or a list of up to 4 strings")
    req.seed = _integer(body, "seed", -(2**63))
    sampling: dict[str, Any] = {}
    for key, target, low, high, low_open in (
        ("temperature", "temp", 0.0, 2.0, False),
        ("top_p", "top_p", 0.0, 1.0, True),
        ("frequency_penalty", "frequency_penalty", -2.0, 2.0, False),
        ("presence_penalty", "presence_penalty", -2.0, 2.0, False),
        ("min_p", "min_p", 0.0, 1.0, False),
        ("typical_p", "typical_p", 0.0, 1.0, True),
        ("repeat_penalty", "repeat_penalty", 0.0, 10.0, True),
    ):
        value = _number(body, key, low, high, low_open=low_open)
        if value is not None:
            sampling[target] = value
    top_k = _integer(body, "top_k", 0)
    if top_k is not None:
        sampling["top_k"] = top_k
    req.sampling = sampling
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _bad("logit_bias must map token ids to numbers")
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise _bad(f"logit_bias: {key!r} is not a token id") from None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _bad(f"logit_bias[{key}] must be a number")
            if not -100 <= value <= 100:
                raise _bad(f"logit_bias[{key}] must be in [-100, 100]")
            req.logit_bias[token] = float(value)

    for key, value in body.items():
        if key in _MAPPED or key in _NEUTRAL or value is None:
            continue
        harmless = _HARMLESS.get(key)
        if harmless is not None and harmless(value):
            continue
        req.ignored.append(key)
    req.ignored.sort()
    return req
