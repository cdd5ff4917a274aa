"""Bounded fuzzing (hypothesis) of request parsing, JSON validation and the config loader.

The properties and strategies live here as plain functions, so that
``bench/fuzz_long.py`` runs the same ones for much longer. In the test suite
each runs a small number of examples.

* Raw requests: whatever bytes arrive, the proxy answers with a well-formed
  status line (or closes), never a 500, and keeps serving good requests.
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

METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "CONNECT", "TRACE", "get"]
PATHS = ["/v1/chat/completions", "/v1/completions", "/echo/x", "/v1/models", "/"]
HEADER_NAMES = [
    "Content-Length",
    "Transfer-Encoding",
    "Content-Type",
    "Connection",
    "Host",
    "X-Forwarded-For",
    "X-Priority",
    "Authorization",
    "Expect",
    "Upgrade",
    "TE",
    "Trailer",
    "X-Edgeproxy-Cache",
    "Content-Encoding",
    "X-Custom",
]
HEADER_VALUES = [
    "0",
    "5",
    "-1",
    "+5",
    "5, 5",
    "chunked",
    "gzip, chunked",
    "chunked, chunked",
    "identity",
    "application/json",
    "text/plain",
    "close",
    "keep-alive, X-Custom",
    "100-continue",
    "h2c",
    "websocket",
    "203.0.113.9, 10.0.0.1",
    "99999999999999999999",
]

_token = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=":"),
    min_size=1,
    max_size=20,
)
_printable_value = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40
).map(str.encode)
_raw_value = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_known_header = st.tuples(st.sampled_from(HEADER_NAMES), st.sampled_from(HEADER_VALUES)).map(
    lambda nv: f"{nv[0]}: {nv[1]}".encode()
)
# Mostly plausible headers, so that requests get past the parser often enough
# to exercise the proxy's own checks and the forwarding path.
_header = st.one_of(
    _known_header,
    _known_header,
    st.tuples(_token, _printable_value).map(lambda nv: nv[0].encode() + b": " + nv[1]),
    st.tuples(_token, _raw_value).map(lambda nv: nv[0].encode() + b": " + nv[1]),
    # Obsolete folding, bare names, junk.
    st.sampled_from([b" folded", b"\tfolded", b"NoColon", b": empty-name", b"X-A : b"]),
)
_body = st.one_of(
    st.just(b""),
    st.sampled_from(
        [
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
            b"[1, 2]",
            b'{"a": "\xff"}',
            b"0\r\n\r\n",
            b"5\r\nhello\r\n0\r\n\r\n",
            b"zz\r\n",
        ]
    ),
    st.binary(max_size=200),
)


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    """A request head (and maybe body), from plausible to hostile."""
    # llhttp knows a fixed list of methods: mostly those, so requests get further.
    method = draw(st.sampled_from(METHODS)) if draw(st.integers(0, 9)) else draw(_token)
    kind = draw(st.integers(0, 9))
    if kind < 6:
        target = draw(st.sampled_from(PATHS))
    elif kind < 8:
        target = "/" + draw(
            st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30)
        )
    elif kind < 9:
        target = draw(
            st.sampled_from(["*", "http://evil.example/", "//x", "/a?b=c#d", "/%ff", "/\xff"])
        )
    else:
        target = "/" + draw(st.text(max_size=30))
    version = draw(st.sampled_from(["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/2.0", "HTTP/0.9"]))
    headers = draw(st.lists(_header, max_size=6))
    body = draw(_body)
    if draw(st.integers(0, 3)):
        headers.append(b"Content-Length: %d" % len(body))
    if draw(st.integers(0, 9)):
        headers.insert(0, b"Host: fuzz.test")
    line = f"{method} {target} {version}".encode("utf-8", "surrogateescape")
    return b"\r\n".join([line, *headers]) + b"\r\n\r\n" + body


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


def check_raw_request(port: int, payload: bytes) -> int | None:
    """The property: a proper answer that is never a 500 (an unhandled error)."""
    status = exchange(port, payload)
    assert status is None or 100 <= status < 600
    assert status != 500, payload
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
                "regions": [{"name": "r1", "url": self.region.url}],
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
def test_fuzz_raw_requests(proxy_thread: ProxyThread, payload: bytes) -> None:
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
