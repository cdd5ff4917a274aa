"""Fuzz the request-head checks: raw bytes through aiohttp's parser, then ``check_request_head``.

Input: one flag byte, then the raw bytes a client sends. Flag bit 0 picks
the parser (0: llhttp, the C parser aiohttp normally runs; 1: the pure-Python
fallback of ``AIOHTTP_NO_EXTENSIONS=1``), bit 1 the limits (0: no body size
limit; 1: ``max_body_size = 1000``).

Property: the parser raises only ``HttpProcessingError`` (which the listener
answers as a 4xx), and ``_parser_reason`` makes a short message of it;
``check_request_head`` returns a ``ProxyError`` or None and raises nothing.
A head it lets through is one the proxy can forward without ambiguity:
HTTP/1.0 or 1.1, an origin-form ASCII target, no refused method, framing
that only ``Transfer-Encoding: chunked`` or a single in-limit
``Content-Length`` describes, UTF-8 header values, and no expectation other
than ``100-continue``.
"""

from __future__ import annotations

import asyncio
import atexit
import sys
from typing import Any

from _harness import check, fuzz
from aiohttp import http_parser
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import HttpProcessingError

from edgeproxy._core.config import LimitsConfig
from edgeproxy._core.errors import ProxyError
from edgeproxy._server.handler import _parser_reason
from edgeproxy._server.headchecks import check_request_head

# The parser's payload streams want a loop; it never runs.
_LOOP = asyncio.new_event_loop()
atexit.register(_LOOP.close)
_LIMITS = (LimitsConfig(max_body_size=0), LimitsConfig(max_body_size=1000))
_PARSERS: tuple[Any, ...] = (
    getattr(http_parser, "HttpRequestParserC", http_parser.HttpRequestParserPy),
    http_parser.HttpRequestParserPy,
)
_ECHO_LIMIT = 120
# After these the proxy cannot tell where the next request on the connection starts.
_CLOSING = frozenset(
    {"invalid_framing", "http_version_not_supported", "expectation_failed", "request_too_large"}
)


class _Head:
    """What ``check_request_head`` reads of a request, from the parser's message."""

    __slots__ = ("version", "headers", "method", "raw_path")

    def __init__(self, message: Any) -> None:
        self.version = message.version
        self.headers = message.headers
        self.method = message.method
        self.raw_path = message.path


def _parse(parser_cls: Any, limits: LimitsConfig, raw: bytes) -> list[Any]:
    parser = parser_cls(
        BaseProtocol(_LOOP),
        _LOOP,
        2**16,
        max_line_size=limits.max_request_line,
        max_field_size=limits.max_header_size,
        max_headers=limits.max_headers,
    )
    try:
        messages, _upgraded, _tail = parser.feed_data(raw)
    except HttpProcessingError as exc:
        reason = _parser_reason(exc.message)
        check(isinstance(reason, str) and 0 < len(reason) <= _ECHO_LIMIT, "parser reason", reason)
        return []
    except ValueError:
        if parser_cls is http_parser.HttpRequestParserPy:
            # The pure-Python parser's own int() on a Content-Length of more than
            # 4300 digits; aiohttp answers any parser exception itself (500).
            return []
        raise
    return [message for message, _payload in messages]


def _check_accepted(head: _Head, limits: LimitsConfig) -> None:
    """A head the checks let through: the invariants the proxy relies on downstream."""
    version = head.version
    check(version.major == 1 and version.minor in (0, 1), "version let through", version)
    check(head.method not in ("CONNECT", "TRACE"), "method let through", head.method)
    check(head.raw_path.startswith("/"), "target not origin-form", head.raw_path)
    check(head.raw_path.isascii(), "non-ASCII target", head.raw_path)
    headers = head.headers
    te = headers.getall("Transfer-Encoding", [])
    lengths = headers.getall("Content-Length", [])
    if te:
        check(version.minor == 1, "Transfer-Encoding on HTTP/1.0", te)
        check(not lengths, "Transfer-Encoding with Content-Length", te, lengths)
        codings = [c.strip().lower() for value in te for c in value.split(",")]
        check(codings == ["chunked"], "Transfer-Encoding other than chunked", te)
    check(len(lengths) <= 1, "several Content-Length", lengths)
    if lengths:
        check(lengths[0].isascii() and lengths[0].isdigit(), "bad Content-Length", lengths)
        if limits.max_body_size:
            check(int(lengths[0]) <= limits.max_body_size, "Content-Length over limit", lengths)
    for name, value in headers.items():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            check(False, "header value not UTF-8", name, value)
    if version.minor == 1:
        expect = ",".join(headers.getall("Expect", [])).strip().lower()
        check(expect in ("", "100-continue"), "expectation let through", expect)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    flags, raw = data[0], data[1:]
    limits = _LIMITS[(flags >> 1) & 1]
    for message in _parse(_PARSERS[flags & 1], limits, raw):
        head = _Head(message)
        error = check_request_head(head, limits)  # type: ignore[arg-type]
        if error is None:
            _check_accepted(head, limits)
            continue
        check(isinstance(error, ProxyError), "not a ProxyError", error)
        check(400 <= error.status <= 599 and error.code, "bad error", error.status, error.code)
        if error.code in _CLOSING:
            check(error.headers.get("Connection") == "close", "framing error keeps alive", error)


if __name__ == "__main__":
    fuzz(test_one_input, "edgeproxy._server.listener", "aiohttp.http_parser")
    sys.exit(0)
