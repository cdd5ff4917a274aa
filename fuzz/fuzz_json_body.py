"""Fuzz the JSON body checks of LLM routes: content type, JSON object, prompt estimate.

Input: the ``Content-Type`` value, a newline, the ``Content-Encoding`` value,
a newline, then the body (an empty header line stands for an absent header;
header values are decoded as aiohttp decodes them, UTF-8 with surrogates for
bad bytes).

Property: ``check_json_content_type`` and ``parse_json_object`` raise only a
400 ``ProxyError`` with one of their codes; a parsed body is a ``dict``, the
one ``orjson`` reads; ``estimate_prompt_tokens`` of it is an ``int`` of at
least 1 and grows no faster than the body (at most 5 per byte: 4 of framing
per message, a quarter per character).
"""

from __future__ import annotations

import sys

import orjson
from _harness import check, fuzz

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.bodies import (
    check_json_content_type,
    estimate_prompt_tokens,
    parse_json_object,
)

_TYPE_CODES = frozenset({"invalid_content_type", "unsupported_content_encoding"})
_BODY_CODES = frozenset({"invalid_json", "invalid_body"})


def _header(raw: bytes) -> str | None:
    return raw.decode("utf-8", "surrogateescape") if raw else None


def _check_error(error: ProxyError, codes: frozenset[str]) -> None:
    check(error.status == 400, "status", error.status, error.message)
    check(error.code in codes, "code", error.code)
    check(error.type == "invalid_request_error", "type", error.type)
    # Messages echo at most 120 characters of what the client sent, each as repr()
    # writes it: up to 10 characters ("\U0010ffff").
    check(len(error.message) <= 200 + 10 * 120, "message too long", len(error.message))


def test_one_input(data: bytes) -> None:
    content_type, _, rest = data.partition(b"\n")
    content_encoding, _, body = rest.partition(b"\n")
    try:
        check_json_content_type(_header(content_type), _header(content_encoding))
    except ProxyError as exc:
        _check_error(exc, _TYPE_CODES)
    try:
        value = parse_json_object(body)
    except ProxyError as exc:
        _check_error(exc, _BODY_CODES)
        return
    check(type(value) is dict, "not a dict", type(value))
    check(value == orjson.loads(body), "not what orjson reads", value)
    estimate = estimate_prompt_tokens(value)
    check(type(estimate) is int and estimate >= 1, "estimate below 1", estimate)
    check(estimate <= 5 * len(body) + 1, "estimate out of proportion", estimate, len(body))


if __name__ == "__main__":
    fuzz(test_one_input, "edgeproxy._protocol.bodies")
    sys.exit(0)
