"""HTTP/1.1 on the HTTP/2 listener's port (``server.http2`` with ``h2c``) is answered
exactly as the default listener answers it.

The same bytes go, over raw sockets, to two proxies in front of one region: one on the
default listener, one with ``[server] http2 = true, h2c = true``. For malformed heads and
framing that could smuggle a request past another hop, both must give the same status
line, the same OpenAI-shaped JSON error, the same headers (``X-Edgeproxy-Region: none``
among them) and, where the default listener closes, the same close with nothing after
it. Good requests must be served the same way, and ``Upgrade: h2c`` switches to HTTP/2
on the h2c port only.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import h2.connection
import h2.events
import pytest

from edgeproxy import Config, EdgeProxy
from edgeproxy.testing import FakeRegion

from .conftest import proxy_config

CHAT = "/v1/chat/completions"
BODY = {"model": "fake-llm", "messages": [{"role": "user", "content": "hello"}]}
MAX_BODY = 64 * 1024
LIMITS = {
    "max_body_size": MAX_BODY,
    # A head the port keeps waiting for ends in this, not in the socket's timeout.
    "header_timeout": 1.0,
    "keepalive_timeout": 5.0,
}
# Headers whose values differ from one answer to the next: the proxy's, and the fake
# region's timings.
VARYING = frozenset({"date", "x-request-id"})
REGION_VARYING = VARYING | {"x-fake-queue-ms", "x-fake-ttft-ms"}
TIMEOUT = 10.0


# -- the two listeners ---------------------------------------------------------------------


class Listeners:
    """One fake region and two proxies in front of it, the default listener's and the h2c
    one's, serving from a thread of their own so that the tests use blocking sockets.

    Started once for the module (conftest's make_proxy and make_region start theirs for
    each test; the proxies' config is conftest's ``proxy_config``): the cases only read
    answers, and each has a connection of its own.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.region = FakeRegion(name="r1", model="fake-llm")
        self.proxies: list[EdgeProxy] = []

    def __enter__(self) -> Listeners:
        self.thread.start()
        try:
            self._run(self._start())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _start(self) -> None:
        await self.region.start()
        regions = [{"name": "r1", "url": self.region.url}]
        for server in ({}, {"http2": True, "h2c": True}):
            data = proxy_config(regions, server=server, limits=LIMITS, admin={"enabled": False})
            proxy = EdgeProxy(Config.from_mapping(data, environ={}))
            await proxy.start()
            self.proxies.append(proxy)

    async def _stop(self) -> None:
        for proxy in self.proxies:
            await proxy.stop(grace=1.0)
        await self.region.stop()

    @property
    def default_port(self) -> int:
        return _port(self.proxies[0])

    @property
    def h2_port(self) -> int:
        return _port(self.proxies[1])


def _port(proxy: EdgeProxy) -> int:
    return int(proxy.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def listeners() -> Iterator[Listeners]:
    with Listeners() as running:
        yield running


# -- a raw HTTP/1.1 client -----------------------------------------------------------------


@dataclass
class Answer:
    """One HTTP/1.1 answer as it came: the status line, the headers (names in lower case, in
    order), the body, and for one that closes the connection whatever came after it."""

    status_line: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    after: bytes | None = None

    @property
    def status(self) -> int:
        parts = self.status_line.split(" ", 2)
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    @property
    def closes(self) -> bool:
        return (self.header("connection") or "").lower() == "close"

    def comparable(
        self, varying: frozenset[str] = VARYING
    ) -> tuple[str, list[tuple[str, str]], bytes, bytes | None]:
        """What must be the same on both listeners: everything but the values that vary."""
        headers = sorted((k, "..." if k in varying else v) for k, v in self.headers)
        return self.status_line, headers, self.body, self.after


class Client:
    """A blocking connection to one port, reading answers whole."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.buffer = b""
        self.eof = False

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            pass  # it answered and closed before taking it all: the answer is what counts

    def recv_more(self) -> bool:
        """Read what comes next into the buffer; False once the connection has closed."""
        if self.eof:
            return False
        try:
            data = self.sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            # A connection that hangs reads as closed: the comparison then shows it.
            data = b""
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    def _take(self, size: int) -> bytes:
        taken, self.buffer = self.buffer[:size], self.buffer[size:]
        return taken

    def answer(self) -> Answer:
        """The next answer: its head, then its body up to its Content-Length, else until
        the connection closes; for an answer that closes the connection, whatever else
        came before the close (an interim 1xx is an answer of its own, without a body)."""
        while b"\r\n\r\n" not in self.buffer:
            if not self.recv_more():
                # Closed before a whole head: what came, as the status line, if anything.
                return Answer(self._take(len(self.buffer)).decode("latin-1"), after=b"")
        head = self._take(self.buffer.index(b"\r\n\r\n") + 4).decode("latin-1")
        status_line, *lines = head[:-4].split("\r\n")
        headers = [
            (name.strip().lower(), value.strip())
            for name, _, value in (line.partition(":") for line in lines)
        ]
        answer = Answer(status_line, headers)
        if answer.status < 200:
            return answer
        length = answer.header("content-length")
        if length is not None:
            while len(self.buffer) < int(length) and self.recv_more():
                pass
            answer.body = self._take(int(length))
        else:
            while self.recv_more():
                pass
            answer.body = self._take(len(self.buffer))
        if answer.closes:
            while self.recv_more():
                pass
            answer.after = self._take(len(self.buffer))
        return answer


def exchange(port: int, payload: bytes) -> Answer:
    """``payload`` sent on a new connection to ``port``: the first answer."""
    with Client(port) as client:
        client.send(payload)
        return client.answer()


def head(request_line: str, *headers: str, body: bytes = b"") -> bytes:
    lines = [request_line, "Host: proxy.test", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chat(body: bytes, *headers: str) -> bytes:
    return head(
        f"POST {CHAT} HTTP/1.1",
        "Content-Type: application/json",
        *headers,
        f"Content-Length: {len(body)}",
        body=body,
    )


def chunked(body: bytes) -> bytes:
    return head(
        f"POST {CHAT} HTTP/1.1",
        "Content-Type: application/json",
        "Transfer-Encoding: chunked",
        body=b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
    )


# -- refusals ------------------------------------------------------------------------------

# A request right behind a framing error would be a smuggled one: it must never be answered.
SMUGGLED = head("GET /v1/models HTTP/1.1")
GOOD = json.dumps(BODY).encode()

# Bytes, then the status the default listener answers them with.
REFUSALS: dict[str, tuple[bytes, int]] = {
    # Framing that two hops could read two ways.
    "cl-and-te": (
        head(f"POST {CHAT} HTTP/1.1", "Content-Length: 5", "Transfer-Encoding: chunked")
        + b"0\r\n\r\n"
        + SMUGGLED,
        400,
    ),
    "te-and-cl": (
        head(f"POST {CHAT} HTTP/1.1", "Transfer-Encoding: chunked", "Content-Length: 5")
        + b"0\r\n\r\n"
        + SMUGGLED,
        400,
    ),
    "duplicate-cl": (
        head(f"POST {CHAT} HTTP/1.1", "Content-Length: 2", "Content-Length: 2") + b"{}" + SMUGGLED,
        400,
    ),
    "conflicting-cl": (
        head(f"POST {CHAT} HTTP/1.1", "Content-Length: 2", "Content-Length: 3") + b"{} " + SMUGGLED,
        400,
    ),
    "cl-list": (head(f"POST {CHAT} HTTP/1.1", "Content-Length: 2, 2") + b"{}" + SMUGGLED, 400),
    "cl-signed": (head(f"POST {CHAT} HTTP/1.1", "Content-Length: +2") + b"{}" + SMUGGLED, 400),
    "cl-not-a-number": (head(f"POST {CHAT} HTTP/1.1", "Content-Length: two") + SMUGGLED, 400),
    "te-unknown": (
        head(f"POST {CHAT} HTTP/1.1", "Transfer-Encoding: xchunked") + b"0\r\n\r\n" + SMUGGLED,
        400,
    ),
    "te-gzip-chunked": (
        head(f"POST {CHAT} HTTP/1.1", "Transfer-Encoding: gzip, chunked") + b"0\r\n\r\n" + SMUGGLED,
        501,
    ),
    "te-chunked-gzip": (
        head(f"POST {CHAT} HTTP/1.1", "Transfer-Encoding: chunked, gzip") + b"0\r\n\r\n" + SMUGGLED,
        400,
    ),
    "te-chunked-twice": (
        head(f"POST {CHAT} HTTP/1.1", "Transfer-Encoding: chunked, chunked")
        + b"0\r\n\r\n"
        + SMUGGLED,
        400,
    ),
    "te-two-fields": (
        head(f"POST {CHAT} HTTP/1.1", "Transfer-Encoding: chunked", "Transfer-Encoding: chunked")
        + b"0\r\n\r\n"
        + SMUGGLED,
        400,
    ),
    "te-in-http10": (
        head(f"POST {CHAT} HTTP/1.0", "Transfer-Encoding: chunked") + b"0\r\n\r\n" + SMUGGLED,
        400,
    ),
    "te-space-before-colon": (
        head(f"POST {CHAT} HTTP/1.1", "Transfer-Encoding : chunked") + b"0\r\n\r\n" + SMUGGLED,
        400,
    ),
    "chunk-size-not-hex": (
        head(f"POST {CHAT} HTTP/1.1", "Transfer-Encoding: chunked")
        + b"zz\r\nhello\r\n0\r\n\r\n"
        + SMUGGLED,
        400,
    ),
    "chunk-size-negative": (
        head(f"POST {CHAT} HTTP/1.1", "Transfer-Encoding: chunked")
        + b"-2\r\n{}\r\n0\r\n\r\n"
        + SMUGGLED,
        400,
    ),
    "chunk-size-overflow": (
        head(f"POST {CHAT} HTTP/1.1", "Transfer-Encoding: chunked")
        + b"10000000000000002\r\n{}\r\n0\r\n\r\n"
        + SMUGGLED,
        400,
    ),
    "chunk-without-crlf": (
        head(f"POST {CHAT} HTTP/1.1", "Transfer-Encoding: chunked")
        + b"2\r\n{}XX0\r\n\r\n"
        + SMUGGLED,
        400,
    ),
    # Line ends and field syntax.
    "obs-fold": (head("GET /v1/models HTTP/1.1", "X-Folded: a", " folded") + SMUGGLED, 400),
    "obs-fold-tab": (head("GET /v1/models HTTP/1.1", "X-Folded: a", "\tfolded") + SMUGGLED, 400),
    # Alone: a head without CRLF CRLF in it, and nothing behind to complete one.
    "bare-lf-head": (b"GET /v1/models HTTP/1.1\nHost: proxy.test\n\n", 400),
    "bare-lf-head-then-request": (
        b"GET /v1/models HTTP/1.1\nHost: proxy.test\n\n" + SMUGGLED,
        400,
    ),
    "bare-cr-line-ends": (b"GET /v1/models HTTP/1.1\rHost: proxy.test\r\r", 400),
    "bare-lf-in-fields": (
        b"GET /v1/models HTTP/1.1\r\nHost: proxy.test\nX-A: b\r\n\r\n" + SMUGGLED,
        400,
    ),
    "bare-cr-in-value": (head("GET /v1/models HTTP/1.1", "X-A: a\rb") + SMUGGLED, 400),
    "space-before-colon": (head("GET /v1/models HTTP/1.1", "X-A : b") + SMUGGLED, 400),
    "space-in-name": (head("GET /v1/models HTTP/1.1", "X A: b") + SMUGGLED, 400),
    "invalid-name-byte": (head("GET /v1/models HTTP/1.1", "X@A: b") + SMUGGLED, 400),
    "field-without-colon": (head("GET /v1/models HTTP/1.1", "NoColonHere") + SMUGGLED, 400),
    "empty-name": (head("GET /v1/models HTTP/1.1", ": b") + SMUGGLED, 400),
    "no-host": (b"GET /v1/models HTTP/1.1\r\n\r\n" + SMUGGLED, 400),
    "two-hosts": (head("GET /v1/models HTTP/1.1", "Host: other.test") + SMUGGLED, 400),
    "nul-in-value": (head("GET /v1/models HTTP/1.1", "X-A: a\x00b") + SMUGGLED, 400),
    "non-utf8-value": (head("GET /v1/models HTTP/1.1", "X-Bytes: \xff\xfe"), 400),
    # Request lines.
    "lower-case-method": (head("get /v1/models HTTP/1.1") + SMUGGLED, 400),
    "trailing-token": (head("GET /v1/models HTTP/1.1 x") + SMUGGLED, 400),
    "lower-case-version": (head("GET /v1/models http/1.1") + SMUGGLED, 400),
    "version-without-dot": (head("GET /v1/models HTTP/11") + SMUGGLED, 400),
    "unknown-method": (head("FOO /v1/models HTTP/1.1") + SMUGGLED, 400),
    "leading-space": (b" " + head("GET /v1/models HTTP/1.1") + SMUGGLED, 400),
    "space-in-target": (head("GET /v1/ models HTTP/1.1") + SMUGGLED, 400),
    "no-target": (head("GET HTTP/1.1") + SMUGGLED, 400),
    "tab-separator": (head("GET\t/v1/models HTTP/1.1") + SMUGGLED, 400),
    "raw-non-ascii-target": (head("GET /v1/\xff HTTP/1.1"), 400),
    "absolute-form": (head("GET http://evil.example/v1/models HTTP/1.1"), 400),
    "authority-form": (head("GET evil.example:443 HTTP/1.1"), 400),
    "asterisk-form": (head("OPTIONS * HTTP/1.1"), 501),
    "connect": (head("CONNECT evil.example:443 HTTP/1.1"), 405),
    "trace": (head("TRACE /v1/models HTTP/1.1"), 405),
    "tls-client-hello": (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40, 400),
    # Versions: only 1.0 and 1.1.
    "http-1.2": (head("GET /v1/models HTTP/1.2"), 505),
    "http-2.0": (head("GET /v1/models HTTP/2.0"), 505),
    "http-3.0": (head("GET /v1/models HTTP/3.0"), 505),
    "http-0.9": (head("GET /v1/models HTTP/0.9"), 505),
    "no-version": (b"GET /v1/models\r\n\r\n", 505),
    # Sizes.
    "request-line-too-long": (head("GET /v1/" + "a" * 9000 + " HTTP/1.1"), 414),
    "header-too-large": (head("GET /v1/models HTTP/1.1", "X-Big: " + "a" * 9000), 431),
    "too-many-headers": (
        head("GET /v1/models HTTP/1.1", *(f"X-H{i}: v" for i in range(150))),
        431,
    ),
    "declared-body-too-large": (head(f"POST {CHAT} HTTP/1.1", "Content-Length: 10000000000"), 413),
    "chunked-body-too-large": (chunked(b"x" * (MAX_BODY + 1)), 413),
    # A head that never ends: the header timeout's 408.
    "incomplete-head": (b"GET /v1/models HTTP/1.1\r\nHost: proxy.test\r\n", 408),
    # Expectations.
    "expect-unknown": (chat(GOOD, "Expect: 200-ok"), 417),
}


def assert_refusal(answer: Answer, status: int) -> None:
    """A refusal of the proxy's own: its status, JSON in OpenAI's shape, no region."""
    assert answer.status_line.startswith(f"HTTP/1.1 {status} "), answer
    assert answer.header("content-type") == "application/json", answer
    assert answer.header("x-edgeproxy-region") == "none", answer
    error = json.loads(answer.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["message"], error
    if status == 505:
        assert error["code"] == "http_version_not_supported", error


@pytest.mark.parametrize(("payload", "status"), REFUSALS.values(), ids=REFUSALS.keys())
def test_the_default_listener_refuses(listeners: Listeners, payload: bytes, status: int) -> None:
    answer = exchange(listeners.default_port, payload)
    assert_refusal(answer, status)
    if payload.endswith(SMUGGLED):
        # Framing the proxy cannot trust: it closes, and the request behind never runs.
        assert answer.closes and answer.after == b"", answer


@pytest.mark.parametrize(("payload", "status"), REFUSALS.values(), ids=REFUSALS.keys())
def test_the_h2_port_refuses_the_same(listeners: Listeners, payload: bytes, status: int) -> None:
    expected = exchange(listeners.default_port, payload)
    answer = exchange(listeners.h2_port, payload)
    assert answer.comparable() == expected.comparable()
    assert_refusal(answer, status)


# -- good requests -------------------------------------------------------------------------


def served(port: int, *payloads: bytes) -> list[Answer]:
    """Each payload in turn on one connection, each answer read before the next is sent."""
    with Client(port) as client:
        answers = []
        for payload in payloads:
            client.send(payload)
            answers.append(client.answer())
        return answers


def same_service(answer: Answer, expected: Answer) -> None:
    """The same answer to a good request: status line, headers and body, but for what a
    region makes anew for each request (ids, timestamps)."""
    got, want = answer.comparable(REGION_VARYING), expected.comparable(REGION_VARYING)
    assert got[:2] == want[:2] and got[3] == want[3]
    assert _stable(json.loads(answer.body)) == _stable(json.loads(expected.body))


def _stable(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


# An upgrade to h2c with valid settings (SETTINGS_MAX_CONCURRENT_STREAMS = 100).
UPGRADE_H2C = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABk")

GOOD_REQUESTS: dict[str, list[bytes]] = {
    "chat": [chat(GOOD)],
    "keep-alive": [chat(GOOD), chat(GOOD)],
    "chunked-body": [chunked(GOOD), chat(GOOD)],
    "models-then-chat": [head("GET /v1/models HTTP/1.1"), chat(GOOD)],
    "http-1.0": [head(f"POST {CHAT} HTTP/1.0", f"Content-Length: {len(GOOD)}", body=GOOD)],
    "connection-close": [chat(GOOD, "Connection: close")],
    "invalid-json-keeps-the-connection": [chat(b'{"model": '), chat(GOOD)],
    # Upgrade requests the h2c port does not take up: plain HTTP/1.1 on both. (One whose
    # HTTP2-Settings is bad gets 400 there: test_h2_frame_limits.)
    "upgrade-websocket": [
        head("GET /v1/models HTTP/1.1", "Connection: Upgrade", "Upgrade: websocket")
    ],
    "upgrade-h2c-without-settings": [
        head("GET /v1/models HTTP/1.1", "Connection: Upgrade", "Upgrade: h2c")
    ],
    "upgrade-h2c-with-body": [chat(GOOD, *UPGRADE_H2C)],
    "upgrade-h2c-in-http10": [head("GET /v1/models HTTP/1.0", *UPGRADE_H2C)],
}


@pytest.mark.parametrize("payloads", GOOD_REQUESTS.values(), ids=GOOD_REQUESTS.keys())
def test_good_requests_are_served_the_same(listeners: Listeners, payloads: list[bytes]) -> None:
    expected = served(listeners.default_port, *payloads)
    answers = served(listeners.h2_port, *payloads)
    assert len(answers) == len(expected) == len(payloads)
    for answer, want in zip(answers, expected, strict=True):
        assert want.status in (200, 400), want
        if want.status == 200:
            assert {"choices", "data"} & set(json.loads(want.body)), want
        same_service(answer, want)


def test_pipelined_and_byte_by_byte_requests_are_served_the_same(listeners: Listeners) -> None:
    requests = [head("GET /v1/models HTTP/1.1"), chat(GOOD), chat(GOOD)]
    answers: list[list[Answer]] = []
    for port in (listeners.default_port, listeners.h2_port):
        with Client(port) as client:
            # All three in one write, then one more a byte at a time.
            client.send(b"".join(requests))
            got = [client.answer() for _ in requests]
            client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for byte in chat(GOOD):
                client.send(bytes([byte]))
            got.append(client.answer())
        assert [a.status for a in got] == [200] * 4, got
        answers.append(got)
    for answer, want in zip(answers[1], answers[0], strict=True):
        same_service(answer, want)


def test_expect_100_continue_is_served_the_same(listeners: Listeners) -> None:
    request = head(
        f"POST {CHAT} HTTP/1.1",
        "Content-Type: application/json",
        f"Content-Length: {len(GOOD)}",
        "Expect: 100-continue",
    )
    answers = []
    for port in (listeners.default_port, listeners.h2_port):
        with Client(port) as client:
            client.send(request)
            interim = client.answer()
            assert interim.status_line == "HTTP/1.1 100 Continue", interim
            client.send(GOOD)
            answers.append(client.answer())
    assert answers[0].status == 200
    same_service(answers[1], answers[0])


# -- Upgrade: h2c --------------------------------------------------------------------------


def upgrade_request(settings: bytes) -> bytes:
    return head(
        "GET /v1/models HTTP/1.1",
        "Connection: Upgrade, HTTP2-Settings",
        "Upgrade: h2c",
        f"HTTP2-Settings: {settings.decode('ascii')}",
    )


def test_upgrade_h2c_switches_to_http2_on_the_h2c_port(listeners: Listeners) -> None:
    conn = h2.connection.H2Connection()
    settings = conn.initiate_upgrade_connection()
    assert settings is not None
    with Client(listeners.h2_port) as client:
        client.send(upgrade_request(settings))
        switch = client.answer()
        assert switch.status_line == "HTTP/1.1 101 Switching Protocols", switch
        assert switch.header("upgrade") == "h2c"
        client.send(conn.data_to_send())
        # The answer to the upgraded request comes on stream 1.
        status, body, ended = None, b"", False
        data, client.buffer = client.buffer, b""
        while not ended:
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    assert event.stream_id == 1
                    status = dict(event.headers)[b":status"]
                elif isinstance(event, h2.events.DataReceived):
                    assert event.stream_id == 1
                    body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.StreamEnded):
                    ended = event.stream_id == 1
            client.send(conn.data_to_send())
            if not ended:
                assert client.recv_more(), "the connection closed before stream 1 ended"
                data, client.buffer = client.buffer, b""
        assert status == b"200"
        assert json.loads(body)["data"]
    # The default listener has no HTTP/2: the same request is served as HTTP/1.1.
    plain = exchange(listeners.default_port, upgrade_request(settings))
    assert plain.status_line == "HTTP/1.1 200 OK", plain
    assert plain.header("upgrade") is None
    assert json.loads(plain.body) == json.loads(body)
