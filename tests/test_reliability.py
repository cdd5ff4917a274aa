"""Reliability under hostile clients and at shutdown: slow bodies, one address flooding the
listener, requests aiohttp would answer itself, status lines, the SIGTERM cut, error leaks.

Raw sockets for what a well-behaved client would never send; slow clients connect from
127.0.0.2 (any 127.x address is loopback on Linux) and good ones from 127.0.0.1, so the
per-address cap tells them apart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from edgeproxy import EdgeProxy
from edgeproxy._server.listener import EdgeRequestHandler
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory, eventually

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
SLOW_ADDRESS = "127.0.0.2"


def port_of(proxy: EdgeProxy) -> int:
    return int(proxy.url.rsplit(":", 1)[1])


def head(request_line: str, *headers: str, body: bytes = b"") -> bytes:
    lines = [request_line, "Host: proxy.test", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def assert_openai_error(body: bytes, code: str | None = None) -> dict[str, Any]:
    data = json.loads(body)
    assert set(data) == {"error"}
    assert set(data["error"]) == {"message", "type", "param", "code"}
    if code is not None:
        assert data["error"]["code"] == code, data
    return dict(data["error"])


class Raw:
    """One raw client connection, from ``source`` (a loopback address)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int, source: str = "127.0.0.1") -> Raw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, timeout: float = 20.0) -> tuple[bytes, int, dict[str, str], bytes]:
        """One response: status line, status, headers (lower-case), body (Content-Length)."""
        raw_head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        lines = raw_head.decode("latin-1").split("\r\n")
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
        return lines[0].encode("latin-1"), status, headers, body

    async def closed(self, timeout: float = 20.0) -> bool:
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


def slow_chat_head(length: int = 1000) -> bytes:
    """A chat request head announcing a body of ``length`` bytes, and its first bytes."""
    return head(
        f"POST {CHAT} HTTP/1.1",
        "Content-Type: application/json",
        f"Content-Length: {length}",
        body=b'{"model": "m", ',
    )


async def trickle(conns: list[Raw], stop: asyncio.Event, every: float = 0.2) -> None:
    """Send one body byte on every connection now and then, until ``stop``: never idle
    long enough for ``body_timeout``, never fast enough to finish."""
    while not stop.is_set():
        for conn in conns:
            if not conn.writer.is_closing():
                conn.writer.write(b" ")
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def good_requests(proxy: EdgeProxy, count: int) -> list[int]:
    """``count`` chat requests from 127.0.0.1, one after the other; their statuses."""
    statuses = []
    connector = aiohttp.TCPConnector(limit=1, local_addr=("127.0.0.1", 0))
    async with aiohttp.ClientSession(connector=connector) as client:
        for _ in range(count):
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                await resp.read()
                statuses.append(resp.status)
    return statuses


@pytest.fixture
async def region(make_region: RegionFactory) -> FakeRegion:
    return await make_region("r1")


# -- 1. slow bodies and one address flooding the listener -------------------------------


async def test_trickled_body_gets_408_at_the_deadline(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    # A byte every 0.2 s never stalls for body_timeout; the deadline still ends it.
    proxy = await make_proxy(
        [region],
        limits={"body_timeout": 30.0, "min_body_rate": 0, "body_deadline": 0.5},
    )
    raw = await Raw.open(port_of(proxy))
    await raw.send(slow_chat_head())
    stop = asyncio.Event()
    dripping = asyncio.create_task(trickle([raw], stop))
    try:
        _, status, headers, body = await raw.response()
    finally:
        stop.set()
        await dripping
    assert status == 408
    assert headers["x-edgeproxy-region"] == "none"
    error = assert_openai_error(body, "request_timeout")
    assert "within 0.5 seconds" in error["message"]
    assert await raw.closed()
    await raw.close()
    assert proxy.guard.body_deadlines == 1
    assert CHAT not in region.requests_by_path


async def test_body_under_the_minimum_rate_gets_408(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        [region],
        limits={
            "body_timeout": 30.0,
            "body_deadline": 0,
            "min_body_rate": 1000,
            "body_rate_grace": 0.3,
        },
    )
    raw = await Raw.open(port_of(proxy))
    await raw.send(slow_chat_head())
    stop = asyncio.Event()
    dripping = asyncio.create_task(trickle([raw], stop))
    try:
        _, status, _, body = await raw.response()
    finally:
        stop.set()
        await dripping
    assert status == 408
    error = assert_openai_error(body, "request_timeout")
    assert "slower than 1000 bytes per second" in error["message"]
    assert await raw.closed()
    await raw.close()
    assert proxy.status()["limits"]["slow_bodies"] == 1


async def test_a_fast_body_passes_the_rate_check(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    # The grace is 0: the rate applies from the first check, and a body sent at once meets it.
    proxy = await make_proxy(
        [region], limits={"min_body_rate": 1000, "body_rate_grace": 0.0, "body_deadline": 5.0}
    )
    statuses = await good_requests(proxy, 3)
    assert statuses == [200, 200, 200]
    assert proxy.guard.slow_bodies == 0 and proxy.guard.body_deadlines == 0


async def test_one_address_cannot_take_the_listener(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        [region],
        limits={"max_connections": 20, "max_connections_per_ip": 10, "header_timeout": 30.0},
    )
    port = port_of(proxy)
    slow = [await Raw.open(port, SLOW_ADDRESS) for _ in range(10)]
    for conn in slow:
        await conn.send(slow_chat_head())
    await eventually(lambda: proxy.guard.per_ip.get(SLOW_ADDRESS) == 10)
    # The eleventh from that address is refused; the listener still has room for others.
    extra = await Raw.open(port, SLOW_ADDRESS)
    _, status, headers, body = await extra.response()
    assert status == 503
    assert headers["retry-after"] == "1"
    assert headers["x-edgeproxy-region"] == "none"
    assert_openai_error(body, "too_many_connections")
    assert await extra.closed()
    await extra.close()
    assert await good_requests(proxy, 5) == [200] * 5
    limits = proxy.status()["limits"]
    assert limits["connections_refused_per_ip"] == 1
    assert limits["connections_refused"] == 0
    assert limits["max_connections_per_ip"] == 10
    for conn in slow:
        await conn.close()
    # Their slots are given back.
    await eventually(lambda: SLOW_ADDRESS not in proxy.guard.per_ip)


async def test_slow_client_flood_does_not_starve_good_requests(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    """200 slow clients against a 200-connection cap, with the default per-address cap."""
    clients = 200
    proxy = await make_proxy([region], limits={"max_connections": clients})
    port = port_of(proxy)
    slow = await asyncio.gather(*(Raw.open(port, SLOW_ADDRESS) for _ in range(clients)))
    for conn in slow:
        conn.writer.write(slow_chat_head())
    stop = asyncio.Event()
    dripping = asyncio.create_task(trickle(list(slow), stop, every=0.5))

    def settled() -> bool:
        # Every slow connection was either taken in or refused.
        limits = proxy.status()["limits"]
        refused = limits["connections_refused"] + limits.get("connections_refused_per_ip", 0)
        return bool(limits["connections_open"] + refused >= clients)

    try:
        await eventually(settled, timeout=60.0)
        statuses = await good_requests(proxy, 20)
    finally:
        stop.set()
        await dripping
        for conn in slow:
            conn.writer.close()
    assert statuses == [200] * 20
    assert proxy.guard.per_ip.get(SLOW_ADDRESS, 0) <= clients // 2


async def test_slow_bodies_do_not_hold_the_drain_open(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    # Outside a drain they would have 60 s before the rate applies; draining, one.
    proxy = await make_proxy(
        [region], limits={"body_rate_grace": 60.0, "body_deadline": 0, "body_timeout": 30.0}
    )
    port = port_of(proxy)
    slow = [await Raw.open(port, SLOW_ADDRESS) for _ in range(3)]
    for conn in slow:
        await conn.send(slow_chat_head())
    await eventually(lambda: proxy.pipeline.in_flight == 3)
    stop = asyncio.Event()
    dripping = asyncio.create_task(trickle(slow, stop))
    try:
        drained = await proxy.stop(grace=60.0)
    finally:
        stop.set()
        await dripping
    assert drained
    for conn in slow:
        _, status, _, body = await conn.response()
        assert status == 408
        assert_openai_error(body, "request_timeout")
        await conn.close()
    assert proxy.guard.slow_bodies == 3


# -- 2. what aiohttp would answer itself -------------------------------------------------


async def test_encoded_newline_in_the_path_is_forwarded(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy([region])
    raw = await Raw.open(port_of(proxy))
    await raw.send(head("GET /echo/a%0Ab HTTP/1.1"))
    _, status, headers, body = await raw.response()
    assert status == 200, body
    assert headers["x-edgeproxy-region"] == "r1"
    assert json.loads(body)["raw_path"] == "/echo/a%0Ab"
    await raw.close()


@pytest.mark.parametrize(
    ("payload", "status", "code", "closes"),
    [
        (head("OPTIONS * HTTP/1.1"), 501, "not_implemented", False),
        (head("OPTIONS * HTTP/1.1", "Expect: 200-ok"), 501, "not_implemented", False),
        (head("GET /echo/x HTTP/1.1", "Expect: 200-ok"), 417, "expectation_failed", True),
        (
            head("POST /echo/x HTTP/1.1", "Expect: something-else", "Content-Length: 2"),
            417,
            "expectation_failed",
            True,
        ),
    ],
    ids=[
        "options-asterisk",
        "options-asterisk-with-expect",
        "unknown-expectation",
        "unknown-expectation-with-body",
    ],
)
async def test_own_answers_are_json_with_the_region_header(
    region: FakeRegion,
    make_proxy: ProxyFactory,
    payload: bytes,
    status: int,
    code: str,
    closes: bool,
) -> None:
    proxy = await make_proxy([region])
    raw = await Raw.open(port_of(proxy))
    await raw.send(payload)
    line, got, headers, body = await raw.response()
    assert got == status
    assert line.startswith(b"HTTP/1.1 ")
    assert headers["content-type"].startswith("application/json")
    assert headers["x-edgeproxy-region"] == "none"
    assert headers["x-request-id"]
    assert_openai_error(body, code)
    if closes:
        assert headers["connection"] == "close"
        assert await raw.closed()
    else:
        await raw.send(head("GET /echo/x HTTP/1.1"))
        assert (await raw.response())[1] == 200
    await raw.close()


async def test_100_continue_is_only_sent_for_a_head_the_proxy_accepts(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy([region], limits={"max_body_size": 1024})
    raw = await Raw.open(port_of(proxy))
    # Too large: refused at once, without inviting the body first.
    await raw.send(head("POST /echo/x HTTP/1.1", "Expect: 100-continue", "Content-Length: 4096"))
    line, status, _, body = await raw.response()
    assert line.startswith(b"HTTP/1.1 413"), line
    assert_openai_error(body, "request_too_large")
    await raw.close()
    # Accepted: 100 Continue, then the answer once the body came.
    raw = await Raw.open(port_of(proxy))
    await raw.send(head("POST /echo/x HTTP/1.1", "Expect: 100-continue", "Content-Length: 2"))
    assert await raw.reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    await raw.send(b"{}")
    assert (await raw.response())[1] == 200
    await raw.close()


async def test_a_refused_request_leaves_no_head_timer_behind(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    """A request refused by the head checks ends its head's timer like any other: the
    keep-alive connection must not get a stray 408 later."""
    proxy = await make_proxy([region], limits={"header_timeout": 0.3, "keepalive_timeout": 30})
    raw = await Raw.open(port_of(proxy))
    await raw.send(head("TRACE /echo/x HTTP/1.1"))
    assert (await raw.response())[1] == 405
    # Longer than header_timeout: the old head's timer, had it stayed armed, fired by now.
    await asyncio.sleep(0.6)
    await raw.send(head("GET /echo/x HTTP/1.1"))
    assert (await raw.response())[1] == 200
    await raw.close()
    assert proxy.guard.header_timeouts == 0


async def test_each_head_of_a_busy_connection_gets_its_full_header_timeout(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    """The head timer stays armed across requests; when it fires for an earlier head it
    gives the head now arriving the rest of its own time, and refuses a late one."""
    proxy = await make_proxy([region], limits={"header_timeout": 0.4, "keepalive_timeout": 30})
    raw = await Raw.open(port_of(proxy))
    await raw.send(head("GET /echo/x HTTP/1.1"))
    assert (await raw.response())[1] == 200
    await asyncio.sleep(0.25)
    # The first head's timer fires while this one arrives, before its own time is up.
    await raw.send(b"GET /echo/x HTTP/1.1\r\nHost: x\r\n")
    await asyncio.sleep(0.25)
    await raw.send(b"\r\n")
    assert (await raw.response())[1] == 200
    assert proxy.guard.header_timeouts == 0
    # After the handler let go of the request: bytes of a next head that arrive while
    # it still runs are not timed (a pipelined request; the keep-alive timeout bounds it).
    await asyncio.sleep(0.05)
    await raw.send(b"GET /echo/x HTTP/1.1\r\n")
    assert (await raw.response())[1] == 408
    assert proxy.guard.header_timeouts == 1
    await raw.close()


# -- 3. status lines -------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_line",
    ["GET /echo/x", "GET /echo/x HTTP/0.9", "GET /echo/x HTTP/1.2", "GET /echo/x HTTP/2.0"],
    ids=["http-0.9-implicit", "http-0.9", "http-1.2", "http-2.0"],
)
async def test_unsupported_versions_get_505_with_an_http11_status_line(
    region: FakeRegion, make_proxy: ProxyFactory, request_line: str
) -> None:
    proxy = await make_proxy([region])
    raw = await Raw.open(port_of(proxy))
    await raw.send(head(request_line) if " HTTP/" in request_line else b"GET /echo/x\r\n\r\n")
    line, status, headers, body = await raw.response()
    assert line == b"HTTP/1.1 505 HTTP Version Not Supported"
    assert status == 505
    assert headers["x-edgeproxy-region"] == "none"
    assert headers["connection"] == "close"
    assert_openai_error(body, "http_version_not_supported")
    assert await raw.closed()
    await raw.close()


async def test_parser_errors_answer_http11_without_echoing_the_request(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy([region])
    raw = await Raw.open(port_of(proxy))
    await raw.send(b"GET /echo/x HTTP/1.1\r\nHost: x\r\nBad Header Line secret-token\r\n\r\n")
    line, status, headers, body = await raw.response()
    assert line.startswith(b"HTTP/1.1 400")
    assert headers["x-edgeproxy-region"] == "none"
    error = assert_openai_error(body, "bad_request")
    assert "secret-token" not in error["message"]
    assert await raw.closed()
    await raw.close()


# -- 4. SIGTERM -------------------------------------------------------------------------


def sse_error_events(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for block in raw.split(b"\n\n"):
        lines = block.strip(b"\n").split(b"\n")
        if lines and lines[0] == b"event: error":
            data = b"".join(line[6:] for line in lines[1:] if line.startswith(b"data: "))
            events.append(json.loads(data)["error"])
    return events


async def read_stream(resp: aiohttp.ClientResponse, first: asyncio.Event) -> bytes:
    """The whole SSE body, however it ends; ``first`` is set when the first bytes came."""
    raw = b""
    try:
        async for chunk in resp.content.iter_any():
            raw += chunk
            first.set()
    except aiohttp.ClientPayloadError:
        pass
    return raw


async def test_stream_cut_at_the_end_of_the_grace_gets_an_error_event(
    make_region: RegionFactory, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    region = await make_region("r1", fault="stall_body", fault_paths=("/v1/",))
    proxy = await make_proxy([region])
    # aiohttp's own shutdown waits for handlers still running (twice its timeout): at the
    # end of the grace period there must be none left for it to wait on.
    busy_at_shutdown: list[bool] = []
    original = EdgeRequestHandler.shutdown

    async def shutdown(self: EdgeRequestHandler, timeout: float | None = 15.0) -> None:
        busy_at_shutdown.append(self._request_in_progress)
        await original(self, timeout)

    monkeypatch.setattr(EdgeRequestHandler, "shutdown", shutdown)
    first = asyncio.Event()
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            reading = asyncio.create_task(read_stream(resp, first))
            await first.wait()
            drained = await proxy.stop(grace=0.2)
            raw = await reading
    assert not drained
    errors = sse_error_events(raw)
    assert len(errors) == 1, raw
    assert errors[0]["code"] == "shutting_down"
    assert b"[DONE]" not in raw
    # The cut connection is gone before aiohttp's shutdown, or at least idle.
    assert not any(busy_at_shutdown)
    assert proxy.guard.shutdown_cuts == 1


async def test_request_not_answered_at_the_end_of_the_grace_gets_503(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1", fault="stall", fault_paths=("/v1/",))
    proxy = await make_proxy([region])
    raw = await Raw.open(port_of(proxy))
    body = json.dumps(BODY).encode()
    await raw.send(
        head(
            f"POST {CHAT} HTTP/1.1",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            body=body,
        )
    )
    await eventually(lambda: region.requests_by_path.get(CHAT, 0) == 1)
    assert not await proxy.stop(grace=0.1)
    _, status, headers, answer = await raw.response()
    assert status == 503
    assert headers["x-edgeproxy-region"] == "none"
    assert_openai_error(answer, "shutting_down")
    assert await raw.closed()
    await raw.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"edgeproxy serve exited with {proc.returncode}") from None
            await asyncio.sleep(0.05)
        else:
            writer.close()
            await writer.wait_closed()
            return
    raise RuntimeError(f"nothing listens on port {port}")


@pytest.fixture
async def serve(
    tmp_path: Path,
) -> AsyncIterator[Callable[[str], Awaitable[subprocess.Popen[bytes]]]]:
    """``edgeproxy serve`` in a subprocess, for a config's TOML text; killed if still running."""
    procs: list[subprocess.Popen[bytes]] = []

    async def start(toml: str) -> subprocess.Popen[bytes]:
        config = tmp_path / "edge.toml"
        config.write_text(toml)
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgeproxy", "serve", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


async def test_serve_exits_on_sigterm_after_cutting_streams(
    make_region: RegionFactory,
    serve: Callable[[str], Awaitable[subprocess.Popen[bytes]]],
) -> None:
    region = await make_region("r1", fault="stall_body", fault_paths=("/v1/",))
    port = free_port()
    proc = await serve(
        f"""
[server]
host = "127.0.0.1"
port = {port}
grace_period = 0.3
[admin]
enabled = false
[[regions]]
name = "r1"
url = "{region.url}"
"""
    )
    await wait_for_port(port, proc)
    first = asyncio.Event()
    async with aiohttp.ClientSession() as client:
        async with client.post(
            f"http://127.0.0.1:{port}{CHAT}", json={**BODY, "stream": True}
        ) as resp:
            assert resp.status == 200
            reading = asyncio.create_task(read_stream(resp, first))
            await first.wait()
            proc.send_signal(signal.SIGTERM)
            raw = await asyncio.wait_for(reading, 30)
    errors = sse_error_events(raw)
    assert [e["code"] for e in errors] == ["shutting_down"], raw
    # A generous ceiling, not a measurement: the exit comes right after the grace period.
    returncode = await asyncio.to_thread(proc.wait, 30)
    assert returncode == 0


# -- 5. what errors tell the client --------------------------------------------------------


async def test_502_names_the_region_but_not_its_address(
    make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    dead_port = free_port()
    proxy = await make_proxy(
        [{"name": "dead", "url": f"http://127.0.0.1:{dead_port}", "http2": False}]
    )
    with caplog.at_level(logging.WARNING, logger="edgeproxy"):
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.status == 502
                text = await resp.text()
    error = assert_openai_error(text.encode(), "bad_gateway")
    assert error["message"] == "region dead failed: cannot connect"
    assert str(dead_port) not in text
    # The detail is in the log.
    assert any(str(dead_port) in r.getMessage() for r in caplog.records)


@pytest.fixture
async def garbage_upstream() -> AsyncIterator[str]:
    """An HTTP/1.1 "region" answering every request with a head no parser accepts."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: nope-secret-parser-text\r\n\r\n")
            await writer.drain()
            await reader.read()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.close()
    await server.wait_closed()


async def test_502_does_not_quote_the_parser(
    make_proxy: ProxyFactory, garbage_upstream: str
) -> None:
    proxy = await make_proxy([{"name": "broken", "url": garbage_upstream, "http2": False}])
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 502
            text = await resp.text()
    error = assert_openai_error(text.encode(), "bad_gateway")
    assert error["message"].startswith("region broken failed: ")
    assert "secret" not in text and "127.0.0.1" not in text


async def test_stream_broken_by_the_region_has_a_coded_error_event(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1", fault="reset", fault_after_tokens=2, inter_token_delay=0.01)
    proxy = await make_proxy([region])
    first = asyncio.Event()
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            raw = await read_stream(resp, first)
    errors = sse_error_events(raw)
    assert len(errors) == 1, raw
    assert errors[0]["code"] == "upstream_stream_broken"
    assert errors[0]["message"] == "region r1 broke the stream"
    assert errors[0]["type"] == "upstream_error"
    assert b"127.0.0.1" not in raw
