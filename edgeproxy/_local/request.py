"""Mapping a request of any API the local model answers onto a local generation.

:func:`parse_generation_request` reads the request through its dialect: the conversation
(chat's ``messages``, the Responses API's ``instructions`` and ``input``, Messages'
``system`` and ``messages``) as text turns, or a text completion's ``prompt``. It validates
the body (400 naming the bad field, in the API's error shape once written), maps the
sampling fields llama.cpp supports and lists the others that would change the answer, for
the warning header.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Dialect
from edgeproxy._protocol.endpoints import dialect_for

__all__ = ["GenerationRequest", "parse_generation_request"]

_Check = Callable[[Any], bool]
# (field, llama.cpp's name, low, high, low end open)
_Range = tuple[str, str, float, float, bool]


@dataclass(frozen=True, slots=True)
class _Api:
    """What the local model makes of one API's request fields."""

    sampling: tuple[_Range, ...]
    """Numbers mapped onto llama.cpp sampling, with the range each must be in."""
    mapped: frozenset[str]
    """Every field that is honoured (the sampling ones, the answer's bound, stop strings...)."""
    neutral: frozenset[str]
    """Fields with no bearing on a single local answer: accepted without a warning."""
    harmless: dict[str, _Check]
    """Unsupported fields that are harmless at these values (the API's defaults)."""
    stop: str | None = None
    """The field of stop strings, and how many it may hold (0: any number)."""
    stop_max: int = 0
    seed: bool = False
    logit_bias: bool = False
    top_k: bool = False


# Chat and text completions. top_k, min_p, typical_p and repeat_penalty are llama.cpp
# extensions, as llama-cpp-python's own server accepts them.
_OPENAI: Final = _Api(
    sampling=(
        ("temperature", "temp", 0.0, 2.0, False),
        ("top_p", "top_p", 0.0, 1.0, True),
        ("frequency_penalty", "frequency_penalty", -2.0, 2.0, False),
        ("presence_penalty", "presence_penalty", -2.0, 2.0, False),
        ("min_p", "min_p", 0.0, 1.0, False),
        ("typical_p", "typical_p", 0.0, 1.0, True),
        ("repeat_penalty", "repeat_penalty", 0.0, 10.0, True),
    ),
    mapped=frozenset(
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
    ),
    neutral=frozenset(
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
    ),
    harmless={
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
    },
    stop="stop",
    stop_max=4,
    seed=True,
    logit_bias=True,
    top_k=True,
)

# The Responses API, stateless: a request that refers to stored state never gets here (see
# LocalModel.stateless). Its answer is never stored: `store: true` is listed as ignored.
_RESPONSES: Final = _Api(
    sampling=(
        ("temperature", "temp", 0.0, 2.0, False),
        ("top_p", "top_p", 0.0, 1.0, True),
    ),
    mapped=frozenset({"temperature", "top_p", "max_output_tokens"}),
    neutral=frozenset(
        {
            "model",
            "input",
            "instructions",
            "stream",
            "stream_options",
            "user",
            "safety_identifier",
            "prompt_cache_key",
            "prompt_cache_retention",
            "metadata",
            "service_tier",
            "parallel_tool_calls",
            "max_tool_calls",
            "truncation",
        }
    ),
    harmless={
        "store": lambda v: v is False,
        "background": lambda v: v is False,
        "tools": lambda v: v == [],
        "tool_choice": lambda v: v in ("none", "auto"),
        "include": lambda v: v == [],
        "top_logprobs": lambda v: v == 0,
        "text": lambda v: (
            isinstance(v, dict)
            and set(v) <= {"format", "verbosity"}
            and v.get("format", {"type": "text"}) == {"type": "text"}
        ),
        "reasoning": lambda v: v == {} or (isinstance(v, dict) and not any(v.values())),
    },
)

# Anthropic's Messages API.
_MESSAGES: Final = _Api(
    sampling=(
        ("temperature", "temp", 0.0, 1.0, False),
        ("top_p", "top_p", 0.0, 1.0, True),
    ),
    mapped=frozenset({"temperature", "top_p", "top_k", "max_tokens", "stop_sequences"}),
    neutral=frozenset({"model", "messages", "system", "stream", "metadata", "service_tier"}),
    harmless={
        "tools": lambda v: v == [],
        "tool_choice": lambda v: isinstance(v, dict) and v.get("type") in ("auto", "none"),
        "thinking": lambda v: isinstance(v, dict) and v.get("type") == "disabled",
    },
    stop="stop_sequences",
    top_k=True,
)

_APIS: Final[dict[str, _Api]] = {
    CHAT.name: _OPENAI,
    COMPLETIONS.name: _OPENAI,
    RESPONSES.name: _RESPONSES,
    MESSAGES.name: _MESSAGES,
}


def _bad(message: str, *, code: str | None = None) -> ProxyError:
    return ProxyError(400, "invalid_request_error", message, code=code)


@dataclass(slots=True)
class GenerationRequest:
    """A validated request of any API the local model answers, ready for the model."""

    chat: bool
    """A conversation, rendered with the chat template (chat, Responses, Messages); not a
    text completion's prompt."""
    stream: bool
    include_usage: bool
    dialect: Dialect = CHAT
    """The request's API: what the answer is written in."""
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


def _prompt(body: dict[str, Any]) -> str | list[int]:
    """A text completion's one prompt: a string or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("prompt: the local model answers one prompt per request")
    raise _bad("prompt must be a string or a list of token ids")


def _stops(body: dict[str, Any], key: str, most: int) -> list[str]:
    stop = body.get(key)
    if stop is None:
        return []
    if isinstance(stop, str) and key == "stop":
        return [stop] if stop else []
    if (
        isinstance(stop, list)
        and all(isinstance(s, str) for s in stop)
        and (not most or len(stop) <= most)
    ):
        return [s for s in stop if s]
    if most:
        raise _bad(f"{key} must be a string or a list of up to {most} strings")
    raise _bad(f"{key} must be a list of strings")


def parse_generation_request(path: str, body: Any) -> GenerationRequest:
    """Validate a request of the API ``path`` names for the local model: chat and text
    completions, the Responses API (stateless) and Messages.

    Raises :class:`ProxyError` 400 (``invalid_request_error``) naming the bad
    field. Sampling fields llama.cpp supports are mapped; other fields that
    would change the answer are collected in ``ignored`` for the warning
    header.
    """
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    dialect = dialect_for(path)
    api = _APIS.get(dialect.name)
    if api is None:
        raise _bad(f"the local model does not answer {path}")
    chat = dialect is not COMPLETIONS
    if api is _OPENAI:
        stream_options = body.get("stream_options")
        include_usage = (
            isinstance(stream_options, dict) and stream_options.get("include_usage") is True
        )
    else:
        include_usage = True  # their streams always end with the usage
    req = GenerationRequest(
        chat=chat, stream=body.get("stream") is True, include_usage=include_usage, dialect=dialect
    )
    if chat:
        req.messages = [{"role": role, "content": text} for role, text in dialect.text_turns(body)]
    else:
        req.prompt = _prompt(body)

    for key in dialect.max_tokens_keys:
        req.max_tokens = _integer(body, key, 1)
        if req.max_tokens is not None:
            break
    if api.stop is not None:
        req.stop = _stops(body, api.stop, api.stop_max)
    if api.seed:
        req.seed = _integer(body, "seed", -(2**63))
    sampling: dict[str, Any] = {}
    for key, target, low, high, low_open in api.sampling:
        value = _number(body, key, low, high, low_open=low_open)
        if value is not None:
            sampling[target] = value
    if api.top_k:
        top_k = _integer(body, "top_k", 0)
        if top_k is not None:
            sampling["top_k"] = top_k
    req.sampling = sampling
    bias = body.get("logit_bias") if api.logit_bias else None
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
        if key in api.mapped or key in api.neutral or value is None:
            continue
        harmless = api.harmless.get(key)
        if harmless is not None and harmless(value):
            continue
        req.ignored.append(key)
    req.ignored.sort()
    return req
