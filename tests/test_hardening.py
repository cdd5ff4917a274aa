"""Hostile and malformed input over raw sockets: each gets its answer, the proxy keeps serving.

Every case runs while a background client keeps sending good requests, and
checks that those were all answered 200, during the bad input too when it
is a slow one. Framing errors (anything that could smuggle a request past
another hop) must also close the connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from edgeproxy import EdgeProxy
from edgeproxy.testing import FakeRegion

from .conftest import CustomRegion, ProxyFactory, RegionFactory, eventually

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
SMALL_LIMITS = {
    "max_body_size": 64 * 1024,
    "header_timeout": 1.0,
    "body_timeout": 1.0,
    "keepalive_timeout": 1.5,
}

HardenedProxy = Callable[..., Awaitable[EdgeProxy]]


@pytest.fixture
async def region(make_region: RegionFactory) -> FakeRegion:
    return await make_region("r1")


@pytest.fixture
async def hardened(region: FakeRegion, make_proxy: ProxyFactory) -> HardenedProxy:

    async def factory(**limits: Any) -> EdgeProxy:
        return await make_proxy(
            [{"name": "r1", "url": region.url, "api_key": "sk-upstream-SECRET-0123"}],
            limits={**SMALL_LIMITS, **limits},
        )

    return factory


def port_of(proxy: EdgeProxy) -> int:
    return int(proxy.url.rsplit(":", 1)[1])


class Raw:
    """One raw client connection: send bytes, read the answer, see whether it closes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Raw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
        """One response: status, headers (lower-case), body (Content-Length framed)."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        body = b""
        if "content-length" in headers:
            body = await asyncio.wait_for(
                self.reader.readexactly(int(headers["content-length"])), timeout
            )
        return status, headers, body

    async def closed(self, timeout: float = 10.0) -> bool:
        """Whether the proxy closes the connection (EOF or reset) within ``timeout``."""
        try:
            while True:
                data = await asyncio.wait_for(self.reader.read(65536), timeout)
                if not data:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionResetError, BrokenPipeError):
            pass


@asynccontextmanager
async def good_traffic(proxy: EdgeProxy) -> AsyncIterator[list[int]]:
    """Good requests in a loop on their own connection while the block runs; all must be 200."""
    statuses: list[int] = []
    stop = asyncio.Event()

    async def loop() -> None:
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as client:
            while not stop.is_set():
                async with client.post(proxy.url + CHAT, json=BODY) as resp:
                    await resp.read()
                    statuses.append(resp.status)

    task = asyncio.create_task(loop())
    try:
        await eventually(lambda: len(statuses) >= 1 or task.done())
        yield statuses
        # And still serving afterwards.
        after = len(statuses)
        await eventually(lambda: len(statuses) >= after + 2 or task.done())
    finally:
        stop.set()
        await task
    assert statuses and all(s == 200 for s in statuses), statuses


def assert_openai_error(body: bytes, code: str | None = None) -> dict[str, Any]:
    data = json.loads(body)
    assert set(data) == {"error"}
    assert set(data["error"]) == {"message", "type", "param", "code"}
    if code is not None:
        assert data["error"]["code"] == code, data
    return data["error"]


def head(request_line: str, *headers: str, body: bytes = b"") -> bytes:
    lines = [request_line, "Host: proxy.test", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# -- framing and smuggling -----------------------------------------------------------

SMUGGLING = {
    "cl-and-te": head(
        "POST /echo/x HTTP/1.1",
        "Content-Length: 5",
        "Transfer-Encoding: chunked",
        body=b"0\r\n\r\n",
    ),
    "te-and-cl": head(
        "POST /echo/x HTTP/1.1",
        "Transfer-Encoding: chunked",
        "Content-Length: 5",
        body=b"0\r\n\r\n",
    ),
    "duplicate-cl": head(
        "POST /echo/x HTTP/1.1", "Content-Length: 5", "Content-Length: 5", body=b"hello"
    ),
    "conflicting-cl": head(
        "POST /echo/x HTTP/1.1", "Content-Length: 5", "Content-Length: 6", body=b"hello!"
    ),
    "cl-list": head("POST /echo/x HTTP/1.1", "Content-Length: 5, 5", body=b"hello"),
    "cl-signed": head("POST /echo/x HTTP/1.1", "Content-Length: +5", body=b"hello"),
    "obs-fold": head("GET /echo/x HTTP/1.1", "X-Folded: a", " folded"),
    "obs-fold-tab": head("GET /echo/x HTTP/1.1", "X-Folded: a", "\tfolded"),
    "te-chunked-twice": head(
        "POST /echo/x HTTP/1.1", "Transfer-Encoding: chunked, chunked", body=b"0\r\n\r\n"
    ),
    "te-two-headers": head(
        "POST /echo/x HTTP/1.1",
        "Transfer-Encoding: chunked",
        "Transfer-Encoding: chunked",
        body=b"0\r\n\r\n",
    ),
    "te-unknown": head("POST /echo/x HTTP/1.1", "Transfer-Encoding: xchunked", body=b"0\r\n\r\n"),
    "te-space-before-colon": head(
        "POST /echo/x HTTP/1.1", "Transfer-Encoding : chunked", body=b"0\r\n\r\n"
    ),
    "te-in-http10": head("POST /echo/x HTTP/1.0", "Transfer-Encoding: chunked", body=b"0\r\n\r\n"),
    "bad-chunk-size": head(
        "POST /echo/x HTTP/1.1", "Transfer-Encoding: chunked", body=b"zz\r\nhello\r\n0\r\n\r\n"
    ),
    "bare-lf": b"GET /echo/x HTTP/1.1\nHost: proxy.test\n\n",
    "nul-in-header": head("GET /echo/x HTTP/1.1", "X-A: a\x00b"),
}


@pytest.mark.parametrize("payload", SMUGGLING.values(), ids=SMUGGLING.keys())
async def test_smuggling_framing_gets_400_and_closes(
    hardened: HardenedProxy, region: FakeRegion, payload: bytes
) -> None:
    proxy = await hardened()
    async with good_traffic(proxy):
        raw = await Raw.open(port_of(proxy))
        # A second request right behind it would be the smuggled one: it must never run.
        await raw.send(payload + head("GET /echo/smuggled HTTP/1.1"))
        status, _, body = await raw.response()
        assert status == 400
        assert_openai_error(body)
        assert await raw.closed()
        await raw.close()
    assert "/echo/smuggled" not in region.requests_by_path


async def test_transfer_codings_other_than_chunked_get_501_and_close(
    hardened: HardenedProxy,
) -> None:
    proxy = await hardened()
    async with good_traffic(proxy):
        raw = await Raw.open(port_of(proxy))
        await raw.send(
            head("POST /echo/x HTTP/1.1", "Transfer-Encoding: gzip, chunked", body=b"0\r\n\r\n")
        )
        status, headers, body = await raw.response()
        assert status == 501
        assert headers["connection"] == "close"
        assert_openai_error(body, "not_implemented")
        assert await raw.closed()
        await raw.close()


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (b"GET /echo/x\r\n\r\n", 505, "http_version_not_supported"),
        (head("GET http://evil.example/ HTTP/1.1"), 400, "invalid_target"),
        (head("CONNECT evil.example:443 HTTP/1.1"), 405, "method_not_allowed"),
        (head("TRACE /echo/x HTTP/1.1"), 405, "method_not_allowed"),
        (head("GET /echo/\xff HTTP/1.1"), 400, None),
        (head("GET /echo/x HTTP/1.1", "X-Bytes: \xff\xfe"), 400, "invalid_header"),
        (head("GET /echo/x HTTP/1.1", "X-Nul: a\x00"), 400, None),
        (head("get /echo/x HTTP/1.1"), 400, None),
        (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40, 400, None),
    ],
    ids=[
        "http-0.9",
        "absolute-form",
        "connect",
        "trace",
        "raw-non-ascii-target",
        "non-utf8-header",
        "nul-header",
        "lower-case-method",
        "tls-on-http-port",
    ],
)
async def test_bad_request_heads(
    hardened: HardenedProxy,
    make_region: RegionFactory,
    payload: bytes,
    status: int,
    code: str | None,
) -> None:
    proxy = await hardened()
    async with good_traffic(proxy):
        raw = await Raw.open(port_of(proxy))
        await raw.send(payload)
        got, headers, body = await raw.response()
        assert got == status
        assert headers["content-type"].startswith("application/json")
        assert_openai_error(body, code)
        await raw.close()


# -- sizes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (head("GET /echo/" + "a" * 9000 + " HTTP/1.1"), 414, "request_line_too_long"),
        (head("GET /echo/x HTTP/1.1", "X-Big: " + "a" * 9000), 431, "headers_too_large"),
        (
            head("GET /echo/x HTTP/1.1", *(f"X-H{i}: v" for i in range(150))),
            431,
            "headers_too_large",
        ),
    ],
    ids=["request-line", "header-field", "header-count"],
)
async def test_oversized_heads(
    hardened: HardenedProxy, payload: bytes, status: int, code: str
) -> None:
    proxy = await hardened()
    async with good_traffic(proxy):
        raw = await Raw.open(port_of(proxy))
        await raw.send(payload)
        got, _, body = await raw.response()
        assert got == status
        assert_openai_error(body, code)
        assert await raw.closed()
        await raw.close()


async def test_configured_head_limits(hardened: HardenedProxy) -> None:
    proxy = await hardened(max_request_line=512, max_header_size=512, max_headers=20)
    async with good_traffic(proxy):
        for payload, status in [
            (head("GET /echo/" + "a" * 600 + " HTTP/1.1"), 414),
            (head("GET /echo/x HTTP/1.1", "X-Big: " + "a" * 600), 431),
            (head("GET /echo/x HTTP/1.1", *(f"X-H{i}: v" for i in range(25))), 431),
            (head("GET /echo/" + "a" * 400 + " HTTP/1.1", "X-Ok: " + "a" * 400), 200),
        ]:
            raw = await Raw.open(port_of(proxy))
            await raw.send(payload)
            assert (await raw.response())[0] == status
            await raw.close()


async def test_declared_body_over_the_limit_is_413_before_reading(
    hardened: HardenedProxy, make_region: RegionFactory
) -> None:
    proxy = await hardened()
    async with good_traffic(proxy):
        raw = await Raw.open(port_of(proxy))
        # Only the head is sent: the answer must not wait for a 10 GB body.
        await raw.send(head("POST /echo/x HTTP/1.1", "Content-Length: 10000000000"))
        status, headers, body = await raw.response()
        assert status == 413
        assert headers["connection"] == "close"
        assert_openai_error(body, "request_too_large")
        await raw.close()
    # Counted in /status as a body that grows past the limit is.
    assert proxy.guard.bodies_too_large == 1


async def test_chunked_body_over_the_limit_is_cut_off(
    hardened: HardenedProxy, region: FakeRegion
) -> None:
    proxy = await hardened()
    async with good_traffic(proxy):
        raw = await Raw.open(port_of(proxy))
        await raw.send(head("POST /echo/x HTTP/1.1", "Transfer-Encoding: chunked"))
        chunk = b"x" * 16384
        for _ in range(4):  # 64 KiB: exactly the limit
            await raw.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        # One byte more, in a write of its own, then nothing: the proxy has read every byte
        # sent when it answers, so its close after the answer cannot reset the connection.
        await raw.send(b"1\r\nx\r\n")
        status, headers, body = await raw.response()
        assert status == 413
        assert headers["connection"] == "close"
        assert_openai_error(body, "request_too_large")
        assert await raw.closed()
        await raw.close()
    assert proxy.guard.bodies_too_large == 1
    # The upload never reached the region whole: its stream there was reset.
    await eventually(lambda: region.counters().cancelled_total == 1)


# -- JSON bodies of LLM routes ---------------------------------------------------------


def chat(body: bytes, *headers: str) -> bytes:
    return head(f"POST {CHAT} HTTP/1.1", *headers, f"Content-Length: {len(body)}", body=body)


JSON_CASES = {
    "invalid-json": (chat(b'{"model": ', "Content-Type: application/json"), "invalid_json"),
    "trailing-garbage": (chat(b'{"a": 1} x', "Content-Type: application/json"), "invalid_json"),
    "invalid-utf8": (chat(b'{"a": "\xff\xfe"}', "Content-Type: application/json"), "invalid_json"),
    "lone-surrogate": (
        chat(b'{"a": "\\ud800"}', "Content-Type: application/json"),
        "invalid_json",
    ),
    "array": (chat(b"[1, 2]", "Content-Type: application/json"), "invalid_body"),
    "string": (chat(b'"hello"', "Content-Type: application/json"), "invalid_body"),
    "null": (chat(b"null", "Content-Type: application/json"), "invalid_body"),
    "empty": (chat(b"", "Content-Type: application/json"), "invalid_body"),
    "text-plain": (chat(b"{}", "Content-Type: text/plain"), "invalid_content_type"),
    "form": (
        chat(b"a=1", "Content-Type: application/x-www-form-urlencoded"),
        "invalid_content_type",
    ),
    "no-content-type": (chat(b"{}"), "invalid_content_type"),
    "latin1-charset": (
        chat(b"{}", "Content-Type: application/json; charset=latin-1"),
        "invalid_content_type",
    ),
    "gzip-encoded": (
        chat(b"\x1f\x8b\x08\x00", "Content-Type: application/json", "Content-Encoding: gzip"),
        "unsupported_content_encoding",
    ),
}


@pytest.mark.parametrize(("payload", "code"), JSON_CASES.values(), ids=JSON_CASES.keys())
async def test_llm_bodies_are_validated_before_any_upstream_work(
    hardened: HardenedProxy, make_region: RegionFactory, payload: bytes, code: str
) -> None:
    proxy = await hardened()
    async with good_traffic(proxy):
        raw = await Raw.open(port_of(proxy))
        await raw.send(payload)
        status, headers, body = await raw.response()
        assert status == 400
        assert headers["content-type"].startswith("application/json")
        error = assert_openai_error(body, code)
        assert error["type"] == "invalid_request_error"
        # Not framing: the connection stays usable.
        await raw.send(chat(json.dumps(BODY).encode(), "Content-Type: application/json"))
        assert (await raw.response())[0] == 200
        await raw.close()
    assert proxy.status()["admission"]["invalid_total"] >= 1


async def test_chunked_llm_body_is_read_and_validated(hardened: HardenedProxy) -> None:
    proxy = await hardened()
    good = json.dumps(BODY).encode()
    async with good_traffic(proxy):
        raw = await Raw.open(port_of(proxy))
        for body, status in [(good, 200), (b'{"model": ', 400), (b"x" * 70_000, 413)]:
            payload = head(
                f"POST {CHAT} HTTP/1.1",
                "Content-Type: application/json",
                "Transfer-Encoding: chunked",
                body=b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
            )
            if status == 413:
                await raw.close()
                raw = await Raw.open(port_of(proxy))
            await raw.send(payload)
            got, _, answer = await raw.response()
            assert got == status, answer
        await raw.close()


async def test_json_content_type_variants_are_accepted(hardened: HardenedProxy) -> None:
    proxy = await hardened()
    body = json.dumps(BODY).encode()
    raw = await Raw.open(port_of(proxy))
    for ctype in [
        "application/json",
        "application/json; charset=utf-8",
        'Application/JSON; charset="UTF-8"',
        "application/vnd.api+json",
    ]:
        await raw.send(chat(body, f"Content-Type: {ctype}"))
        assert (await raw.response())[0] == 200, ctype
    await raw.close()


# -- slow clients -------------------------------------------------------------------


async def test_slowloris_head_gets_408_and_closes(hardened: HardenedProxy) -> None:
    proxy = await hardened()
    async with good_traffic(proxy) as statuses:
        raw = await Raw.open(port_of(proxy))
        await raw.send(b"GET /echo/x HTTP/1.1\r\nHost: proxy.test\r\n")
        before = len(statuses)
        # The proxy keeps serving others while this head trickles in.
        for i in range(3):
            await raw.send(f"X-Slow-{i}: a\r\n".encode())
            await asyncio.sleep(0.2)
        await eventually(lambda: len(statuses) >= before + 3)
        status, headers, body = await raw.response()
        assert status == 408
        assert_openai_error(body, "request_timeout")
        assert await raw.closed()
        await raw.close()
    assert proxy.guard.header_timeouts == 1


async def test_silent_connection_is_closed_after_the_header_timeout(
    hardened: HardenedProxy,
) -> None:
    proxy = await hardened()
    async with good_traffic(proxy):
        raw = await Raw.open(port_of(proxy))
        status, _, _ = await raw.response()
        assert status == 408
        assert await raw.closed()
        await raw.close()


async def test_slow_body_gets_408_and_closes(hardened: HardenedProxy) -> None:
    proxy = await hardened()
    async with good_traffic(proxy) as statuses:
        raw = await Raw.open(port_of(proxy))
        await raw.send(
            head(
                f"POST {CHAT} HTTP/1.1",
                "Content-Type: application/json",
                "Content-Length: 100",
                body=b'{"model": "m", ',
            )
        )
        before = len(statuses)
        await eventually(lambda: len(statuses) >= before + 3)
        status, _, body = await raw.response()
        assert status == 408
        assert_openai_error(body, "request_timeout")
        assert await raw.closed()
        await raw.close()
    assert proxy.guard.body_timeouts == 1


async def test_slow_but_steady_body_is_fine(hardened: HardenedProxy) -> None:
    proxy = await hardened(body_timeout=1.0)
    raw = await Raw.open(port_of(proxy))
    body = json.dumps(BODY).encode()
    await raw.send(
        head(
            f"POST {CHAT} HTTP/1.1",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
        )
    )
    # Each piece well inside the idle timeout, the whole longer than it.
    for i in range(0, len(body), 16):
        await raw.send(body[i : i + 16])
        await asyncio.sleep(0.25)
    status, _, _ = await raw.response()
    assert status == 200
    await raw.close()


async def test_idle_keepalive_connection_is_closed(hardened: HardenedProxy) -> None:
    proxy = await hardened(header_timeout=10.0)
    raw = await Raw.open(port_of(proxy))
    await raw.send(head("GET /echo/x HTTP/1.1"))
    assert (await raw.response())[0] == 200
    # Nothing more sent: closed after keepalive_timeout, without an answer.
    assert await raw.closed()
    await raw.close()


async def half_closed_answer(port: int, payload: bytes) -> bytes:
    """Everything the proxy sends on a connection whose client sent ``payload`` and then
    half-closed (shutdown(SHUT_WR)), up to the proxy's own close."""
    raw = await Raw.open(port)
    await raw.send(payload)
    raw.writer.write_eof()
    try:
        return await asyncio.wait_for(raw.reader.read(), 10.0)
    finally:
        await raw.close()


HALF_CLOSED = {
    "get": head("GET /echo/x HTTP/1.1"),
    "chat": chat(json.dumps(BODY).encode(), "Content-Type: application/json"),
    "stream": chat(json.dumps({**BODY, "stream": True}).encode(), "Content-Type: application/json"),
    "pipelined": head("GET /echo/a HTTP/1.1") + head("GET /echo/b HTTP/1.1"),
}


@pytest.mark.parametrize("payload", HALF_CLOSED.values(), ids=HALF_CLOSED.keys())
async def test_a_half_closed_client_gets_its_whole_answer(
    hardened: HardenedProxy, payload: bytes
) -> None:
    # As curl with --http1.1 and some load balancers do: the request, whole, then FIN. The
    # keep-alive timeout is long: the close that ends the read must be the half-close's.
    proxy = await hardened(keepalive_timeout=60.0)
    answer = await half_closed_answer(port_of(proxy), payload)
    requests = payload.count(b" HTTP/1.1\r\n")
    assert answer.count(b"HTTP/1.1 200 ") == requests, answer
    if b'"stream": true' in payload:
        assert answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), answer
    else:
        # Every answer whole, its body as long as it said.
        for part in answer.split(b"HTTP/1.1 200 ")[1:]:
            head_part, _, body = part.partition(b"\r\n\r\n")
            length = int(head_part.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            assert len(body) == length, answer
    await eventually(lambda: proxy.guard.open == 0)


async def test_a_client_that_half_closes_while_its_stream_runs_gets_all_of_it(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # The FIN comes on a read of its own, once the answer has started.
    region = await make_region("r1", tokens=20, inter_token_delay=0.05)
    proxy = await make_proxy([region], limits={"keepalive_timeout": 60.0})
    raw = await Raw.open(port_of(proxy))
    await raw.send(
        chat(json.dumps({**BODY, "stream": True}).encode(), "Content-Type: application/json")
    )
    head_part = await asyncio.wait_for(raw.reader.readuntil(b"\r\n\r\n"), 10.0)
    assert head_part.startswith(b"HTTP/1.1 200 "), head_part
    raw.writer.write_eof()
    rest = await asyncio.wait_for(raw.reader.read(), 10.0)
    await raw.close()
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), rest
    await eventually(lambda: proxy.guard.open == 0)


async def test_a_client_that_half_closes_mid_body_is_not_answered(
    hardened: HardenedProxy,
) -> None:
    # Its body can never be whole: nothing to answer, and nothing held open for it (the
    # body timeout is long: the close must be the half-close's).
    proxy = await hardened(body_timeout=60.0, min_body_rate=0)
    payload = head("POST /echo/x HTTP/1.1", "Content-Length: 100", body=b"x" * 10)
    assert await half_closed_answer(port_of(proxy), payload) == b""
    await eventually(lambda: proxy.guard.open == 0)


async def test_a_half_closed_client_is_probed_with_an_interim_answer_it_skips(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # While its answer has not started, a client that sent FIN gets "100 Continue", which
    # every HTTP/1.1 client reads and skips; then its answer.
    region = await make_region("r1", ttft=0.3)
    proxy = await make_proxy([region], limits={"keepalive_timeout": 60.0})
    raw = await Raw.open(port_of(proxy))
    await raw.send(chat(json.dumps(BODY).encode(), "Content-Type: application/json"))
    await eventually(lambda: region.in_flight == 1)
    raw.writer.write_eof()
    answer = await asyncio.wait_for(raw.reader.read(), 10.0)
    await raw.close()
    assert answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 "), answer
    assert region.cancelled_total == 0


async def test_a_client_that_closed_entirely_is_found_gone_and_its_request_cancelled(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # A FIN is also how a client that closed its socket looks. The probe tells them apart:
    # a closed socket answers it with a reset, and the request and its upstream work are
    # cancelled, as before the half-close was answered (half_close = "answer", the default).
    region = await make_region("r1", ttft=30)
    proxy = await make_proxy([region], limits={"keepalive_timeout": 60.0})
    raw = await Raw.open(port_of(proxy))
    await raw.send(chat(json.dumps(BODY).encode(), "Content-Type: application/json"))
    await eventually(lambda: region.in_flight == 1)
    await raw.close()
    await eventually(lambda: region.cancelled_total == 1 and region.in_flight == 0)
    await eventually(lambda: proxy.guard.open == 0)


@pytest.mark.parametrize("when", ["waiting", "streaming"])
async def test_with_half_close_abort_a_fin_cancels_the_request(
    make_region: RegionFactory, make_proxy: ProxyFactory, when: str
) -> None:
    # nginx's and Envoy's rule: the client's FIN means it is gone. Nothing more is sent, the
    # upstream work is cancelled and the connection closes (the keep-alive timeout is long).
    streaming = when == "streaming"
    region = await make_region(
        "r1", ttft=0 if streaming else 30, tokens=200, inter_token_delay=0.05
    )
    proxy = await make_proxy([region], limits={"half_close": "abort", "keepalive_timeout": 60.0})
    raw = await Raw.open(port_of(proxy))
    body = {**BODY, "stream": True} if streaming else BODY
    await raw.send(chat(json.dumps(body).encode(), "Content-Type: application/json"))
    if streaming:
        head_part = await asyncio.wait_for(raw.reader.readuntil(b"\r\n\r\n"), 10.0)
        assert head_part.startswith(b"HTTP/1.1 200 "), head_part
    else:
        await eventually(lambda: region.in_flight == 1)
    raw.writer.write_eof()
    rest = await asyncio.wait_for(raw.reader.read(), 10.0)
    await raw.close()
    assert b"[DONE]" not in rest and (streaming or rest == b""), rest
    await eventually(lambda: region.cancelled_total == 1 and region.in_flight == 0)
    await eventually(lambda: proxy.guard.open == 0)


async def test_connection_cap(hardened: HardenedProxy) -> None:
    proxy = await hardened(max_connections=4, header_timeout=30.0)
    async with good_traffic(proxy):  # one connection of the four
        idle = [await Raw.open(port_of(proxy)) for _ in range(3)]
        await eventually(lambda: proxy.guard.open == 4)
        extra = await Raw.open(port_of(proxy))
        status, headers, body = await extra.response()
        assert status == 503
        assert headers["retry-after"] == "1"
        assert_openai_error(body, "too_many_connections")
        assert await extra.closed()
        await extra.close()
        # A slot frees up: new connections are served again.
        await idle.pop().close()
        await eventually(lambda: proxy.guard.open == 3)
        raw = await Raw.open(port_of(proxy))
        await raw.send(head("GET /echo/x HTTP/1.1"))
        assert (await raw.response())[0] == 200
        await raw.close()
        for conn in idle:
            await conn.close()
    assert proxy.status()["limits"]["connections_refused"] == 1


# -- header safety --------------------------------------------------------------------


async def test_hop_by_hop_internal_and_credential_headers_are_not_forwarded(
    hardened: HardenedProxy,
) -> None:
    proxy = await hardened()
    headers = {
        "Connection": "X-Secret-Hop, Keep-Alive",
        "X-Secret-Hop": "must-not-pass",
        "Keep-Alive": "timeout=5",
        "X-Edgeproxy-Region": "forged",
        "X-Edgeproxy-Cache": "HIT",
        "X-Request-Timeout-Ms": "99999999",
        "Authorization": "Bearer sk-client-key",
        "api-key": "sk-client-azure",
        "x-api-key": "sk-client-x",
        "X-Kept": "yes",
    }
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/echo/x", headers=headers) as resp:
            assert resp.status == 200
            echoed = await resp.json()
    sent = {}
    for name, value in echoed["headers"]:
        sent.setdefault(name.lower(), []).append(value)
    assert sent["x-kept"] == ["yes"]
    for name in (
        "x-secret-hop",
        "keep-alive",
        "connection",
        "x-edgeproxy-region",
        "x-edgeproxy-cache",
        "api-key",
        "x-api-key",
    ):
        assert name not in sent, name
    # The region's own credential replaces the client's.
    assert sent["authorization"] == ["Bearer sk-upstream-SECRET-0123"]
    # The deadline header is the proxy's, not the client's.
    assert int(sent["x-request-timeout-ms"][0]) <= 30_000


async def test_upstream_credentials_never_reach_the_client(
    make_proxy: ProxyFactory, custom_region: CustomRegion
) -> None:
    from aiohttp import web

    async def leaky(request: web.Request) -> web.Response:
        # A careless upstream echoing credentials back in headers.
        return web.json_response(
            {"ok": True},
            headers={
                "Authorization": request.headers.get("Authorization", ""),
                "X-Api-Key": "sk-upstream-SECRET-0123",
                "Api-Key": "sk-upstream-SECRET-0123",
                "Proxy-Authorization": "Basic c2VjcmV0",
            },
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", leaky)
    url = await custom_region(app)
    proxy = await make_proxy(
        [
            {"name": "leaky", "url": url, "http2": False, "api_key": "sk-upstream-SECRET-0123"},
        ],
        limits=SMALL_LIMITS,
    )
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/x") as resp:
            assert resp.status == 200
            raw_headers = "\n".join(f"{k}: {v}" for k, v in resp.headers.items())
        async with client.get(proxy.admin_url + "/status") as resp:
            status_json = await resp.text()
    assert "SECRET" not in raw_headers
    assert "c2VjcmV0" not in raw_headers
    assert "SECRET" not in status_json


async def test_dead_region_error_does_not_leak_credentials(make_proxy: ProxyFactory) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    proxy = await make_proxy(
        [
            {
                "name": "dead",
                "url": f"http://127.0.0.1:{dead_port}",
                "api_key": "sk-upstream-SECRET-9",
            }
        ],
        limits=SMALL_LIMITS,
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status >= 500
            text = await resp.text()
            all_headers = str(dict(resp.headers))
    assert "SECRET" not in text and "SECRET" not in all_headers


# -- the pure-Python parser -------------------------------------------------------------


PURE_PYTHON_CASES = {
    # Accepted by aiohttp's pure-Python parser, refused by the proxy.
    "te-chunked-twice": (SMUGGLING["te-chunked-twice"], 400, True),
    "te-in-http10": (SMUGGLING["te-in-http10"], 400, True),
    "te-gzip-chunked": (
        head("POST /echo/x HTTP/1.1", "Transfer-Encoding: gzip, chunked", body=b"0\r\n\r\n"),
        501,
        True,
    ),
    "raw-non-ascii-target": (head("GET /echo/\xff HTTP/1.1"), 400, False),
    "cl-and-te": (SMUGGLING["cl-and-te"], 400, True),
    "duplicate-cl": (SMUGGLING["duplicate-cl"], 400, True),
    "obs-fold": (SMUGGLING["obs-fold"], 400, True),
    "huge-cl": (head("POST /echo/x HTTP/1.1", "Content-Length: 99999999999999999999"), 413, False),
}


@pytest.fixture(scope="module")
def pure_python_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """``edgeproxy serve`` in a subprocess with aiohttp's C extensions turned off."""
    folder = tmp_path_factory.mktemp("pyparser")
    port, region_port = free_port(), free_port()
    region = subprocess.Popen(
        [sys.executable, "-m", "edgeproxy.testing", "--name", "r1", "--port", str(region_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    config = folder / "edge.toml"
    config.write_text(
        f"""
[server]
host = "127.0.0.1"
port = {port}
[admin]
enabled = false
[[regions]]
name = "r1"
url = "http://127.0.0.1:{region_port}"
[limits]
max_body_size = 65536
"""
    )
    env = {**os.environ, "AIOHTTP_NO_EXTENSIONS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgeproxy", "serve", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(region_port, region)
        wait_for_port(port, proc)
        yield port
    finally:
        for child in (proc, region):
            child.terminate()
            child.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode}") from None
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


@pytest.mark.parametrize(
    ("payload", "status", "closes"), PURE_PYTHON_CASES.values(), ids=PURE_PYTHON_CASES.keys()
)
def test_pure_python_parser_gaps_are_closed(
    pure_python_proxy: int, payload: bytes, status: int, closes: bool
) -> None:
    with socket.create_connection(("127.0.0.1", pure_python_proxy), timeout=10) as sock:
        sock.sendall(payload)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        assert data.split(b" ", 2)[1] == str(status).encode(), data[:200]
        if closes:
            sock.settimeout(10)
            try:
                while sock.recv(65536):
                    pass
            except ConnectionResetError:
                pass
        # And the proxy still serves a good request on a fresh connection.
    with socket.create_connection(("127.0.0.1", pure_python_proxy), timeout=10) as sock:
        sock.sendall(head("GET /echo/x HTTP/1.1"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
