"""Bounded fuzzing (hypothesis) of request parsing, JSON validation and the config loader.

The properties and strategies live here as plain functions, so that
``bench/fuzz_long.py`` runs the same ones for much longer. In the test suite
each runs a small number of examples.

* Raw requests: each class of input (well-formed, or with one kind of defect)
  gets a status line with one of the statuses of its class, and the proxy
  keeps serving good requests.
* JSON bodies: validation either accepts a JSON object or raises a 400
  ``ProxyError``; the token estimate never fails.
* Config: a mapping or TOML text either loads or raises ``ConfigError``
  whose lines each name a key and a reason; nothing else escapes.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeproxy import Config, EdgeProxy
from edgeproxy._core.config import ConfigError, load_config
from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.bodies import (
    check_json_content_type,
    estimate_prompt_tokens,
    parse_json_object,
)
from edgeproxy.testing import FakeRegion

# -- raw requests ------------------------------------------------------------------
#
# Each example belongs to one class of input, built to be exactly that: a
# well-formed request, or one with exactly one kind of defect in an otherwise
# plausible request (random paths, headers and bodies around it). Every class
# has the precise set of statuses the proxy may answer it with (EXPECTED).

HOST = b"Host: fuzz.test"
LLM_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
PATHS = [*LLM_PATHS, "/echo/x", "/v1/models", "/", "/healthz"]
# Methods llhttp knows, that the proxy forwards: the region answers, or the proxy's own checks.
METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "PROPFIND", "PURGE"]
# Every method llhttp parses in an HTTP request; any other token is a parse error.
LLHTTP_HTTP_METHODS = frozenset(
    "DELETE GET HEAD POST PUT CONNECT OPTIONS TRACE COPY LOCK MKCOL MOVE PROPFIND PROPPATCH "
    "SEARCH UNLOCK BIND REBIND UNBIND ACL REPORT MKACTIVITY CHECKOUT MERGE M-SEARCH NOTIFY "
    "SUBSCRIBE UNSUBSCRIBE PATCH PURGE MKCALENDAR LINK UNLINK SOURCE QUERY".split()
)
# llhttp knows these only for RTSP (and PRI for the HTTP/2 preface): a 400 in HTTP/1.x.
NOT_HTTP_METHODS = ["DESCRIBE", "ANNOUNCE", "SETUP", "PLAY", "PAUSE", "TEARDOWN", "PRI", "get"]
# Headers that are harmless with any printable value, and some with sampled values.
FREE_HEADERS = ["X-Custom", "X-Forwarded-For", "Accept", "User-Agent", "X-Request-Id", "Trailer"]
SAMPLED_HEADERS = {
    "Connection": ["close", "keep-alive", "keep-alive, X-Custom"],
    "TE": ["trailers"],
    "Cache-Control": ["no-store", "no-cache", "max-age=0"],
    "Authorization": ["Bearer sk-fuzz", "Basic Zm9vOmJhcg=="],
    "X-Edgeproxy-Cache": ["HIT", "bypass"],
    "X-Priority": ["0", "1", "high"],
}

_token = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=":"),
    min_size=1,
    max_size=20,
)
_printable = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30)
_any_path = st.one_of(
    st.sampled_from(PATHS),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~/?=&%!$'()*+,;:@", max_size=30).map(
        lambda t: "/" + t
    ),
)
_body = st.one_of(
    st.just(b""),
    st.sampled_from([b"{}", b"[1, 2]", b'{"a": "\xff"}', b"null", b'{"model": 7}']),
    st.binary(max_size=200),
)
CHAT_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@dataclass(frozen=True)
class RawRequest:
    """The bytes of one example, and the class of input it belongs to (a key of EXPECTED)."""

    kind: str
    data: bytes


RAW_CLASSES: dict[str, st.SearchStrategy[RawRequest]] = {}
EXPECTED: dict[str, frozenset[int]] = {}
"""The statuses each class of raw request may be answered with."""


MakeRaw = Callable[[st.DrawFn], bytes]


def raw_class(kind: str, *expected: int) -> Callable[[MakeRaw], MakeRaw]:
    """Register a class of raw requests: its statuses, and how to draw its bytes."""

    def register(make: MakeRaw) -> MakeRaw:
        EXPECTED[kind] = frozenset(expected)
        RAW_CLASSES[kind] = st.composite(lambda draw: RawRequest(kind, make(draw)))()
        return make

    return register


def _head(line: str, headers: list[bytes], body: bytes = b"") -> bytes:
    request_line = line.encode("utf-8", "surrogateescape")
    return b"\r\n".join([request_line, *headers]) + b"\r\n\r\n" + body


def _headers(draw: st.DrawFn, *extra: bytes, content_type: bool = True) -> list[bytes]:
    """Host, up to five plausible headers (each name at most once), and ``extra`` among them."""
    names = [*FREE_HEADERS, *SAMPLED_HEADERS] + (["Content-Type"] if content_type else [])
    out = [HOST]
    for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=5)):
        if name == "Content-Type":
            value = draw(st.sampled_from(["application/json", "text/plain", "", "a/b; c=d"]))
        elif name in SAMPLED_HEADERS:
            value = draw(st.sampled_from(SAMPLED_HEADERS[name]))
        else:
            value = draw(_printable)
        out.append(f"{name}: {value}".encode())
    for header in extra:
        out.insert(draw(st.integers(1, len(out))), header)
    return out


def _line(
    draw: st.DrawFn,
    method: str | None = None,
    target: str | None = None,
    version: str | None = None,
) -> str:
    method = method or draw(st.sampled_from(METHODS))
    target = target or draw(_any_path)
    version = version or draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0"]))
    return f"{method} {target} {version}"


def _framed(draw: st.DrawFn, headers: list[bytes], body: bytes, version: str) -> bytes:
    """``body`` with a Content-Length, or chunked (HTTP/1.1 only), or neither when empty."""
    if version == "HTTP/1.1" and body and draw(st.booleans()):
        headers.append(b"Transfer-Encoding: chunked")
        return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    if body or draw(st.booleans()):
        headers.append(b"Content-Length: %d" % len(body))
    return body


# Forwarded: the region's answer (200, 404, 405) or the proxy's own (400 for a body an
# LLM route cannot take, 405 for a method it does not serve there).
@raw_class("well_formed", 200, 400, 404, 405)
def _well_formed(draw: st.DrawFn) -> bytes:
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0"]))
    headers = _headers(draw)
    body = _framed(draw, headers, draw(_body), version)
    return _head(_line(draw, version=version), headers, body)


@raw_class("chat", 200)
def _chat(draw: st.DrawFn) -> bytes:
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0"]))
    headers = _headers(draw, b"Content-Type: application/json", content_type=False)
    body = _framed(draw, headers, CHAT_BODY, version)
    return _head(f"POST /v1/chat/completions {version}", headers, body)


@raw_class("version_unsupported", 505)
def _version_unsupported(draw: st.DrawFn) -> bytes:
    version = draw(st.sampled_from(["HTTP/2.0", "HTTP/0.9", "HTTP/1.2", "HTTP/3.0"]))
    return _head(_line(draw, version=version), _headers(draw))


@raw_class("version_invalid", 400)
def _version_invalid(draw: st.DrawFn) -> bytes:
    version = draw(st.sampled_from(["HTTP/1.1x", "HTTP/11", "http/1.1", "HTTPS/1.1"]))
    return _head(_line(draw, version=version), _headers(draw))


@raw_class("method_invalid", 400)
def _method_invalid(draw: st.DrawFn) -> bytes:
    method = draw(
        st.one_of(
            st.sampled_from(NOT_HTTP_METHODS),
            _token.filter(lambda t: t not in LLHTTP_HTTP_METHODS),
        )
    )
    return _head(_line(draw, method=method), _headers(draw))


# Never forwarded: CONNECT would tunnel, TRACE would reflect the client's credentials.
@raw_class("method_refused", 405)
def _method_refused(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from(["TRACE", "CONNECT"]))
    # CONNECT as a tunnelling client sends it (authority-form): a path after CONNECT is
    # malformed, and the parser answers 400 before the method is looked at.
    target = (
        draw(st.sampled_from(["example.com:443", "10.0.0.1:22"])) if method == "CONNECT" else None
    )
    return _head(_line(draw, method=method, target=target, version="HTTP/1.1"), _headers(draw))


@raw_class("target_invalid", 400)
def _target_invalid(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from([m for m in METHODS if m != "OPTIONS"]))
    target = draw(st.sampled_from(["http://evil.example/", "x", "*", "/\xff", "/a\x7fb"]))
    return _head(_line(draw, method=method, target=target), _headers(draw))


@raw_class("header_invalid", 400)
def _header_invalid(draw: st.DrawFn) -> bytes:
    bad = draw(
        st.sampled_from(
            [
                b" folded",
                b"\tfolded",
                b"NoColon",
                b": empty-name",
                b"X-A : b",
                b"X(A): b",
                b"X A: b",
                b"X-A: a\x01b",
                b"X-A: a\x7fb",
                b"X-A: \x00",
                b"X-A: \xff\xfe",  # not UTF-8: it could not be forwarded
                HOST,  # a second Host
            ]
        )
    )
    return _head(_line(draw), _headers(draw, bad))


@raw_class("length_invalid", 400)
def _length_invalid(draw: st.DrawFn) -> bytes:
    bad = draw(
        st.sampled_from(
            [
                b"Content-Length: -1",
                b"Content-Length: +5",
                b"Content-Length: 5, 5",
                b"Content-Length: 5 5",
                b"Content-Length: 0x10",
                b"Content-Length: 5.0",
                b"Content-Length: ",
                b"Content-Length: \xb2",
                b"Content-Length: 18446744073709551616",  # 2**64 overflows
                b"Content-Length: 5\r\nContent-Length: 5",
                b"Content-Length: 5\r\nTransfer-Encoding: chunked",
            ]
        )
    )
    return _head(_line(draw, version="HTTP/1.1"), _headers(draw, bad), b"hello")


@raw_class("coding_invalid", 400)
def _coding_invalid(draw: st.DrawFn) -> bytes:
    coding = draw(
        st.sampled_from(
            [b"gzip", b"chunked, chunked", b"chunked, gzip", b"identity", b"foo", b"chunked;x"]
            + [b"br, chunked"]
        )
    )
    headers = _headers(draw, b"Transfer-Encoding: " + coding)
    return _head(_line(draw, version="HTTP/1.1"), headers, b"0\r\n\r\n")


@raw_class("coding_in_http10", 400)
def _coding_in_http10(draw: st.DrawFn) -> bytes:
    headers = _headers(draw, b"Transfer-Encoding: chunked")
    return _head(_line(draw, version="HTTP/1.0"), headers, b"0\r\n\r\n")


@raw_class("coding_unsupported", 501)
def _coding_unsupported(draw: st.DrawFn) -> bytes:
    coding = draw(st.sampled_from([b"gzip", b"deflate", b"x-gzip", b"compress"]))
    headers = _headers(draw, b"Transfer-Encoding: " + coding + b", chunked")
    return _head(_line(draw, version="HTTP/1.1"), headers, b"0\r\n\r\n")


# Declared over [limits] max_body_size (4096 here): refused before it is read.
@raw_class("too_large", 413)
def _too_large(draw: st.DrawFn) -> bytes:
    headers = _headers(draw, b"Content-Length: %d" % draw(st.integers(4097, 2**64 - 1)))
    return _head(_line(draw, method="POST"), headers, draw(st.binary(max_size=100)))


@raw_class("chunks_invalid", 400)
def _chunks_invalid(draw: st.DrawFn) -> bytes:
    chunks = draw(
        st.sampled_from([b"zz\r\n", b"-1\r\n", b"5\r\nhelloXX0\r\n\r\n", b"ffffffffffffffffff\r\n"])
    )
    headers = _headers(draw, b"Transfer-Encoding: chunked")
    return _head(_line(draw, method="POST", version="HTTP/1.1"), headers, chunks)


# The body stops short of its framing: [limits] body_timeout answers. (A JSON content
# type: an LLM route refuses any other before it waits for a chunked body.)
@raw_class("body_incomplete", 408)
def _body_incomplete(draw: st.DrawFn) -> bytes:
    target = draw(st.sampled_from([*LLM_PATHS, "/echo/x"]))
    json = b"Content-Type: application/json"
    if draw(st.booleans()):
        body = draw(st.binary(max_size=100))
        length = b"Content-Length: %d" % (len(body) + draw(st.integers(1, 99)))
        headers = _headers(draw, json, length, content_type=False)
        return _head(_line(draw, method="POST", target=target), headers, body)
    chunks = draw(st.sampled_from([b"5\r\nhel", b"5\r\nhello\r\n", b"5\r\nhello\r\n0\r\n"]))
    headers = _headers(draw, json, b"Transfer-Encoding: chunked", content_type=False)
    return _head(_line(draw, method="POST", target=target, version="HTTP/1.1"), headers, chunks)


# The head stops short of its blank line: [limits] header_timeout answers.
@raw_class("head_incomplete", 408)
def _head_incomplete(draw: st.DrawFn) -> bytes:
    head = _head(_line(draw), _headers(draw))
    return head[: draw(st.integers(1, len(head) - 1))]


@raw_class("expect_continue", 100)
def _expect_continue(draw: st.DrawFn) -> bytes:
    headers = _headers(draw, b"Expect: 100-continue", b"Content-Length: 2")
    return _head(_line(draw, method="POST", target="/echo/x", version="HTTP/1.1"), headers, b"{}")


@raw_class("expect_unknown", 417)
def _expect_unknown(draw: st.DrawFn) -> bytes:
    expect = draw(st.sampled_from([b"foo", b"200-ok", b"100-continue-x"]))
    headers = _headers(draw, b"Expect: " + expect)
    return _head(_line(draw, target="/echo/x", version="HTTP/1.1"), headers)


# Not HTTP at all: the first byte cannot start a request (nor be a blank line before one).
@raw_class("garbage", 400)
def _garbage(draw: st.DrawFn) -> bytes:
    first = draw(st.sampled_from([*range(0, 9), 11, 12, *range(14, 32), *range(127, 256)]))
    return bytes([first]) + draw(st.binary(max_size=60))


def raw_requests() -> st.SearchStrategy[RawRequest]:
    """A raw request of any class, from well-formed to hostile."""
    return st.one_of(*RAW_CLASSES.values())


_STATUS_LINE = re.compile(rb"^HTTP/\d\.\d (\d{3}) ")


def exchange(port: int, payload: bytes, timeout: float = 10.0) -> int | None:
    """Send ``payload``; the first response's status, or None if closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            # No half-close after it: aiohttp takes EOF from the client as "gone".
            sock.sendall(payload)
        except OSError:
            pass
        data = b""
        try:
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            pass
    if not data:
        return None
    match = _STATUS_LINE.match(data)
    assert match, f"not a status line: {data[:80]!r}"
    return int(match.group(1))


def check_raw_request(port: int, payload: RawRequest) -> int | None:
    """The property: a status line with one of the statuses of the request's class."""
    status = exchange(port, payload.data)
    assert status in EXPECTED[payload.kind], (payload.kind, status, payload.data)
    return status


class ProxyThread:
    """A fake region and the proxy, each serving from its own thread, for synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.region = FakeRegion(name="r1")
        self.proxy: EdgeProxy | None = None

    def __enter__(self) -> ProxyThread:
        self.thread.start()
        self._run(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _start(self) -> None:
        await self.region.start()
        config = Config.from_mapping(
            {
                "server": {"host": "127.0.0.1", "port": 0},
                "admin": {"enabled": False},
                # The fake region answers any model: fuzzed bodies reach it, not a 404.
                "regions": [{"name": "r1", "url": self.region.url, "learn_models": False}],
                # Short timeouts: incomplete requests end in a quick 408.
                "limits": {"header_timeout": 0.3, "body_timeout": 0.3, "max_body_size": 4096},
            },
            environ={},
        )
        self.proxy = EdgeProxy(config)
        await self.proxy.start()

    async def _stop(self) -> None:
        assert self.proxy is not None
        await self.proxy.stop(grace=1.0)
        await self.region.stop()

    @property
    def port(self) -> int:
        assert self.proxy is not None
        return int(self.proxy.url.rsplit(":", 1)[1])

    def serves(self) -> bool:
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        return exchange(self.port, request) == 200


@pytest.fixture(scope="module")
def proxy_thread() -> Iterator[ProxyThread]:
    with ProxyThread() as running:
        yield running


FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


@FUZZ
@given(payload=raw_requests())
def test_fuzz_raw_requests(proxy_thread: ProxyThread, payload: RawRequest) -> None:
    check_raw_request(proxy_thread.port, payload)


def test_still_serving_after_fuzzing(proxy_thread: ProxyThread) -> None:
    assert proxy_thread.serves()


# -- JSON validation ------------------------------------------------------------------

# orjson handles 64-bit integers; a bigger one in a body is "invalid JSON" (a 400).
_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
json_values = st.recursive(
    st.none() | st.booleans() | _ints | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
chat_like = st.fixed_dictionaries(
    {"model": st.text(max_size=10)},
    optional={
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant"])},
                optional={
                    "content": st.one_of(
                        st.text(),
                        st.lists(
                            st.fixed_dictionaries({"type": st.just("text"), "text": st.text()})
                        ),
                        json_values,
                    ),
                    "name": st.text(max_size=8),
                },
            ),
            max_size=5,
        ),
        "prompt": st.one_of(st.text(), st.lists(st.text()), st.lists(_ints)),
        "input": json_values,
        "max_tokens": _ints,
    },
)
json_bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(orjson.dumps),
    chat_like.map(orjson.dumps),
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
content_types = st.one_of(
    st.none(),
    st.sampled_from(
        [
            "application/json",
            "application/json; charset=utf-8",
            "application/json;charset=latin-1",
            "application/problem+json",
            "text/json",
            "application/jsonx",
            "",
            ";",
            "application/json; charset",
        ]
    ),
    st.text(max_size=40),
)


def check_json_body(body: bytes, content_type: str | None, encoding: str | None) -> None:
    """The property: a 400 ProxyError or a JSON object, and a positive token estimate."""
    try:
        check_json_content_type(content_type, encoding)
        value = parse_json_object(body)
    except ProxyError as exc:
        assert exc.status == 400
        assert exc.code in {
            "invalid_content_type",
            "unsupported_content_encoding",
            "invalid_json",
            "invalid_body",
        }
        return
    assert isinstance(value, dict)
    assert estimate_prompt_tokens(value) >= 1


@FUZZ
@given(
    body=json_bodies,
    content_type=content_types,
    encoding=st.one_of(st.none(), st.sampled_from(["", "identity", "gzip", "br"])),
)
def test_fuzz_json_validation(body: bytes, content_type: str | None, encoding: str | None) -> None:
    check_json_body(body, content_type, encoding)


@FUZZ
@given(body=chat_like)
def test_fuzz_valid_chat_bodies_pass(body: dict[str, Any]) -> None:
    assert parse_json_object(orjson.dumps(body)) == orjson.loads(orjson.dumps(body))
    assert estimate_prompt_tokens(body) >= 1


# -- the config loader ---------------------------------------------------------------

SECTIONS: dict[str, list[str]] = {
    "server": ["host", "port", "grace_period", "backlog", "preserve_host", "prot"],
    "admission": [
        "max_in_flight",
        "max_queue",
        "max_queue_time",
        "priority_header",
        "key_requests_per_second",
        "key_burst",
        "ip_tokens_per_minute",
        "trusted_proxies",
        "redis_url",
        "redis_timeout",
        "unknown_key",
    ],
    "limits": [
        "max_request_line",
        "max_header_size",
        "max_headers",
        "max_body_size",
        "header_timeout",
        "body_timeout",
        "keepalive_timeout",
        "max_connections",
    ],
    "upstream": ["max_connections", "read_timeout", "http2"],
}
ROUTE_KEYS = ["name", "path", "methods", "max_in_flight", "max_queue_time", "on_overload"]
ROUTE_KEYS += ["require_json", "deadline"]

config_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(["10.0.0.0/8", "::1", "redis://127.0.0.1:6379", "X-Priority", "bad header"]),
    st.lists(st.one_of(st.text(max_size=12), st.integers()), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@st.composite
def config_mappings(draw: st.DrawFn) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if draw(st.booleans()):
        data["regions"] = [{"name": "r1", "url": draw(st.sampled_from(["http://x", "ftp://x"]))}]
    for section, keys in SECTIONS.items():
        if draw(st.booleans()):
            picked = draw(st.lists(st.sampled_from(keys), max_size=4, unique=True))
            data[section] = {key: draw(config_values) for key in picked}
    if draw(st.booleans()):
        routes = []
        for _ in range(draw(st.integers(0, 3))):
            picked = draw(st.lists(st.sampled_from(ROUTE_KEYS), max_size=5, unique=True))
            routes.append({key: draw(config_values) for key in picked})
        data["routes"] = routes
    if draw(st.booleans()):
        # Non-empty: an empty top-level key is reported as a bare "unknown key"
        # (found by this fuzzer; _format_errors has no name to give it).
        data[draw(st.text(min_size=1, max_size=8))] = draw(config_values)
    return data


environments = st.dictionaries(
    st.sampled_from(
        [
            "EDGEPROXY_ADMISSION__MAX_IN_FLIGHT",
            "EDGEPROXY_LIMITS__MAX_BODY_SIZE",
            "EDGEPROXY_ADMISSION__TRUSTED_PROXIES",
            "EDGEPROXY_LIMITS__HEADER_TIMEOUT",
            "EDGEPROXY_ADMISSION",
            "EDGEPROXY_",
            "EDGEPROXY_X__Y__Z",
        ]
    ),
    st.text(max_size=12),
    max_size=3,
)

# "key: reason" (keys may carry list indices, routes[0].max_in_flight), or a
# sentence naming the key for whole-model checks ("regions: at least one ...").
_ERROR_LINE = re.compile(r"^.+: \S", re.DOTALL)


def check_config(data: dict[str, Any], environ: dict[str, str]) -> None:
    """The property: a Config, or a ConfigError listing ``key: reason`` lines."""
    try:
        Config.from_mapping(data, environ=environ)
    except ConfigError as exc:
        assert exc.errors
        for line in exc.errors:
            assert _ERROR_LINE.match(line), line


@FUZZ
@given(data=config_mappings(), environ=environments)
def test_fuzz_config_mappings(data: dict[str, Any], environ: dict[str, str]) -> None:
    check_config(data, environ)


toml_texts = st.one_of(
    st.text(max_size=200),
    st.lists(
        st.one_of(
            st.sampled_from(
                [
                    "[admission]",
                    "[limits]",
                    "[[routes]]",
                    "[[regions]]",
                    'name = "r1"',
                    'url = "http://x"',
                    'path = "/v1"',
                    "max_in_flight = 3",
                    "max_in_flight = -1",
                    "max_queue_time = inf",
                    'on_overload = "degrade"',
                    'trusted_proxies = ["10.0.0.0/8", "nope"]',
                    "max_body_size = 1e99",
                    "header_timeout = 0",
                    "require_json = 1",
                ]
            ),
            st.text(max_size=30),
        ),
        max_size=12,
    ).map("\n".join),
)


def check_config_file(tmp: Path, text: str) -> None:
    path = tmp / "fuzz.toml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_config(path, environ={})
    except ConfigError as exc:
        assert exc.errors and all(isinstance(e, str) and e for e in exc.errors)
    except UnicodeEncodeError:
        pass  # the text itself could not be written as a file


@FUZZ
@given(text=toml_texts)
def test_fuzz_config_files(tmp_path: Path, text: str) -> None:
    check_config_file(tmp_path, text)


def test_toml_parser_is_the_only_gate_for_syntax(tmp_path: Path) -> None:
    # A sanity anchor for the property above: syntax errors are ConfigErrors too.
    path = tmp_path / "bad.toml"
    path.write_text("[admission\nmax_in_flight = ")
    with pytest.raises(ConfigError, match="TOML syntax error"):
        load_config(path, environ={})
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads("[admission")


PROPERTIES: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "raw requests": (check_raw_request, {"payload": raw_requests()}),
    "json bodies": (
        check_json_body,
        {
            "body": json_bodies,
            "content_type": content_types,
            "encoding": st.one_of(st.none(), st.sampled_from(["", "identity", "gzip"])),
        },
    ),
    "config mappings": (check_config, {"data": config_mappings(), "environ": environments}),
    "config files": (check_config_file, {"text": toml_texts}),
}
"""What ``bench/fuzz_long.py`` runs: each property with its strategies."""
