"""The HTTP/2 client listener (``server.http2``): many SSE streams on one connection, TLS
with ALPN h2, HTTP/1.1 beside it, its config errors, and hostile HTTP/2 clients built on
the h2 library (rapid reset, PING/SETTINGS/CONTINUATION floods, stream exhaustion, a
stalled head): each is counted and loses its connection while a good client is served."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import signal
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import pytest
import trustme
from hyperframe.frame import ContinuationFrame, HeadersFrame, PingFrame, SettingsFrame

from edgeproxy import Config, ConfigError, EdgeProxy
from edgeproxy._cli import main

from .conftest import (
    ProxyFactory,
    RegionFactory,
    eventually,
    proxy_config,
    spawn_serve,
    wait_ready,
    write_pair,
)
from .test_cli import free_port

CHAT = "/v1/chat/completions"
# The fake regions serve (and list in their /v1/models, from which a proxy learns it) the
# model the requests name.
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
H2C = {"http2": True, "h2c": True}


def load(**server: Any) -> Config:
    data = proxy_config([{"name": "ap-1", "url": "http://127.0.0.1:9"}], server=server)
    return Config.from_mapping(data, environ={})


# -- config ----------------------------------------------------------------------


def test_http2_without_tls_or_h2c_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load(http2=True)
    message = str(info.value)
    assert "server" in message and "http2" in message and "h2c" in message


def test_h2c_without_http2_names_the_key() -> None:
    with pytest.raises(ConfigError, match="h2c"):
        load(h2c=True)


def test_certificate_without_key_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"server\.tls_key"):
        load(http2=True, tls_cert="proxy.pem")


# -- serving ---------------------------------------------------------------------


async def test_ten_sse_streams_share_one_connection(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    """A page's ten chats stream at once over one HTTP/2 connection (HTTP/1.1 would need
    ten connections, and a browser opens six)."""
    region = await make_region("ap-1", model="m", tokens=40, inter_token_delay=0.05)
    proxy = await make_proxy([region], server=H2C)
    first_events = 0
    all_started = asyncio.Event()
    connections: list[int] = []

    async def chat(client: httpx.AsyncClient, i: int) -> list[str]:
        nonlocal first_events
        body = {**BODY, "stream": True, "user": f"tab-{i}"}
        lines: list[str] = []
        async with client.stream("POST", proxy.url + CHAT, json=body) as resp:
            assert resp.status_code == 200 and resp.http_version == "HTTP/2"
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and not lines:
                    first_events += 1
                    if first_events == 10:
                        # All ten stream at once: count the client connections now.
                        connections.append(proxy.guard.open)
                        all_started.set()
                    # Every stream has its first token before any goes on: all ten run at once.
                    await asyncio.wait_for(all_started.wait(), 30)
                if line.startswith("data: "):
                    lines.append(line)
        return lines

    async with httpx.AsyncClient(http1=False, http2=True, timeout=30) as client:
        results = await asyncio.gather(*(chat(client, i) for i in range(10)))
    assert all(lines[-1] == "data: [DONE]" for lines in results)
    assert connections == [1]


async def test_http1_and_json_on_the_same_listener(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", model="m")
    proxy = await make_proxy([region], server=H2C)
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200 and resp.version.major == 1
            assert resp.headers["X-Edgeproxy-Region"] == "ap-1"
            assert (await resp.json())["object"] == "chat.completion"
    async with httpx.AsyncClient(http1=False, http2=True) as client:
        resp = await client.post(proxy.url + CHAT, json=BODY)
        assert resp.status_code == 200 and resp.http_version == "HTTP/2"
        assert resp.json()["object"] == "chat.completion"
        # The proxy's own errors, in the OpenAI shape, without HTTP/1.1-only headers.
        resp = await client.post(proxy.url + CHAT, content=b"{nope")
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


async def test_tls_offers_h2_by_alpn(
    make_region: RegionFactory, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    ca = trustme.CA()
    cert_path, key_path = write_pair(ca, tmp_path)
    region = await make_region("ap-1", model="m", tokens=4)
    proxy = await make_proxy(
        [region], server={"http2": True, "tls_cert": cert_path, "tls_key": key_path}
    )
    assert proxy.url.startswith("https://")
    context = ssl.create_default_context()
    ca.configure_trust(context)
    async with httpx.AsyncClient(http2=True, verify=context) as client:
        resp = await client.post(proxy.url + CHAT, json={**BODY, "stream": True})
        assert resp.status_code == 200 and resp.http_version == "HTTP/2"
        assert resp.text.rstrip().endswith("data: [DONE]")
    # A client without h2 gets HTTP/1.1 from the same port.
    async with httpx.AsyncClient(http2=False, verify=context) as client:
        resp = await client.post(proxy.url + CHAT, json=BODY)
        assert resp.status_code == 200 and resp.http_version == "HTTP/1.1"


async def test_reset_mid_stream_resets_the_stream(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    """An answer cut upstream: its error event, then RST_STREAM (not a clean end); the
    connection serves the next request."""
    region = await make_region(
        "ap-1", model="m", fault="reset", fault_after_tokens=2, inter_token_delay=0.01
    )
    proxy = await make_proxy([region], server=H2C)
    raw = ""
    async with httpx.AsyncClient(http1=False, http2=True) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", proxy.url + CHAT, json={**BODY, "stream": True}) as r:
                async for text in r.aiter_text():
                    raw += text
        assert "event: error" in raw and "[DONE]" not in raw
        region.behavior.fault = None
        resp = await client.post(proxy.url + CHAT, json=BODY)
        assert resp.status_code == 200


async def test_client_disconnect_cancels_upstream(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", model="m", inter_token_delay=0.2, tokens=200)
    proxy = await make_proxy([region], server=H2C)
    async with httpx.AsyncClient(http1=False, http2=True) as client:
        async with client.stream("POST", proxy.url + CHAT, json={**BODY, "stream": True}) as r:
            async for _ in r.aiter_lines():
                break
            assert region.in_flight == 1
    await eventually(lambda: region.cancelled_total == 1 and region.in_flight == 0)
    await eventually(lambda: proxy.pipeline.in_flight == 0)


# -- hostile clients ---------------------------------------------------------------


class RawH2:
    """A client speaking raw HTTP/2 frames, to break the rules on purpose."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))

    @classmethod
    async def open(cls, url: str) -> RawH2:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        client = cls(reader, writer)
        client.conn.initiate_connection()
        await client.flush()
        return client

    async def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())
        await self.writer.drain()

    async def raw(self, data: bytes) -> None:
        try:
            self.writer.write(data)
            await self.writer.drain()
        except ConnectionError:
            pass

    def request_headers(self, stream_id: int) -> list[tuple[str, str]]:
        return [
            (":method", "POST"),
            (":path", CHAT),
            (":scheme", "http"),
            (":authority", "localhost"),
            ("content-type", "application/json"),
        ]

    async def answer(self, stream_id: int) -> tuple[int, bytes]:
        """Read frames until the stream's answer ends: its status and body."""
        status, body = 0, b""
        async with asyncio.timeout(20):
            while True:
                data = await self.reader.read(65536)
                assert data, "the server closed before the answer ended"
                for event in self.conn.receive_data(data):
                    if getattr(event, "stream_id", None) != stream_id:
                        continue
                    if isinstance(event, h2.events.ResponseReceived):
                        status = int(dict(event.headers)[b":status"])
                    elif isinstance(event, h2.events.DataReceived):
                        body += event.data
                        self.conn.acknowledge_received_data(event.flow_controlled_length, stream_id)
                    elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                        await self.flush()
                        return status, body
                await self.flush()

    async def goaway(self) -> int | None:
        """Read until the server closes; the error code of the GOAWAY it sent, if any. Frames
        are parsed raw: the client's own h2 state broke with the rules it broke."""
        code = None
        data = b""
        try:
            async with asyncio.timeout(20):
                while chunk := await self.reader.read(65536):
                    data += chunk
        except (ConnectionError, TimeoutError):
            pass
        self.writer.close()
        # The server preface's SETTINGS, answers, then GOAWAY (type 7) before it closes.
        while len(data) >= 9:
            length = int.from_bytes(data[:3], "big")
            kind = data[3]
            payload = data[9 : 9 + length]
            if kind == 7 and len(payload) >= 8:
                code = int.from_bytes(payload[4:8], "big")
            data = data[9 + length :]
        return code


async def good_client_served(url: str) -> None:
    async with httpx.AsyncClient(http1=False, http2=True, timeout=10) as client:
        resp = await client.post(url + CHAT, json=BODY)
        assert resp.status_code == 200


@pytest.fixture
async def h2_proxy(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> AsyncIterator[EdgeProxy]:
    region = await make_region("ap-1", model="m", ttft=0.05)
    yield await make_proxy(
        [region],
        server=H2C,
        limits={"h2_max_premature_resets": 50, "h2_max_control_frames": 100, "header_timeout": 1.0},
    )


async def test_rapid_reset_is_closed_and_counted(h2_proxy: EdgeProxy) -> None:
    abuser = await RawH2.open(h2_proxy.url)
    for i in range(200):
        stream_id = 1 + 2 * i
        abuser.conn.send_headers(stream_id, abuser.request_headers(stream_id))
        abuser.conn.send_data(stream_id, b'{"model": "m", "messages": []}', end_stream=True)
        abuser.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        if i % 20 == 19:
            await abuser.raw(abuser.conn.data_to_send())
    await abuser.raw(abuser.conn.data_to_send())
    await good_client_served(h2_proxy.url)
    assert await abuser.goaway() == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, (
        h2_proxy.guard.snapshot()
    )
    assert h2_proxy.guard.snapshot()["h2_rapid_resets"] == 1
    await eventually(lambda: h2_proxy.pipeline.in_flight == 0)
    await good_client_served(h2_proxy.url)


@pytest.mark.parametrize("frame", ["ping", "settings"])
async def test_control_frame_floods_are_closed_and_counted(h2_proxy: EdgeProxy, frame: str) -> None:
    abuser = await RawH2.open(h2_proxy.url)
    make = (lambda: PingFrame(0, b"12345678")) if frame == "ping" else (lambda: SettingsFrame(0))
    await abuser.raw(b"".join(make().serialize() for _ in range(1000)))
    assert await abuser.goaway() == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert h2_proxy.guard.snapshot()["h2_control_floods"] == 1
    await good_client_served(h2_proxy.url)


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PINGS = b"".join(PingFrame(0, b"12345678").serialize() for _ in range(1000))


async def test_a_split_preface_is_guarded_from_the_first_frame(h2_proxy: EdgeProxy) -> None:
    """The preface's first bytes alone, then its rest with a flood in the same write: the
    flood is checked although hypercorn switched to HTTP/2 on that write."""
    host, port = h2_proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    abuser = RawH2(reader, writer)
    await abuser.raw(PREFACE[:10])
    await asyncio.sleep(0.05)  # let the server read them on their own (either way it holds)
    await abuser.raw(PREFACE[10:] + SettingsFrame(0).serialize() + PINGS)
    assert await abuser.goaway() == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert h2_proxy.guard.snapshot()["h2_control_floods"] == 1
    await good_client_served(h2_proxy.url)


async def test_an_h2c_upgrade_is_guarded_from_the_first_frame(h2_proxy: EdgeProxy) -> None:
    """Upgrade: h2c, with the preface and a flood sent at once behind the request."""
    host, port = h2_proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    abuser = RawH2(reader, writer)
    settings = base64.urlsafe_b64encode(SettingsFrame(0).serialize_body()).rstrip(b"=")
    request = (
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: " + settings + b"\r\n\r\n"
    )
    await abuser.raw(request + PREFACE + SettingsFrame(0).serialize() + PINGS)
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 ")
    assert await abuser.goaway() == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert h2_proxy.guard.snapshot()["h2_control_floods"] == 1
    await good_client_served(h2_proxy.url)


async def test_continuation_flood_is_refused(h2_proxy: EdgeProxy) -> None:
    abuser = await RawH2.open(h2_proxy.url)
    block = abuser.conn.encoder.encode(abuser.request_headers(1))
    frames = [HeadersFrame(1, block[:8]).serialize()]
    frames += [ContinuationFrame(1, b"\x00" * 16).serialize() for _ in range(500)]
    await abuser.raw(b"".join(frames))
    await abuser.goaway()
    await eventually(lambda: h2_proxy.guard.snapshot()["h2_protocol_errors"] >= 1)
    await good_client_served(h2_proxy.url)


async def test_streams_past_the_cap_are_refused_alone(h2_proxy: EdgeProxy) -> None:
    """More open streams than SETTINGS_MAX_CONCURRENT_STREAMS (100): each one past the cap
    gets RST_STREAM REFUSED_STREAM (safe to retry); the connection goes on."""
    abuser = await RawH2.open(h2_proxy.url)
    # The client's own h2 would refuse to open them: raw HEADERS frames, no END_STREAM.
    frames = []
    for i in range(120):
        stream_id = 1 + 2 * i
        block = abuser.conn.encoder.encode(abuser.request_headers(stream_id))
        frames.append(HeadersFrame(stream_id, block, flags=["END_HEADERS"]).serialize())
    await abuser.raw(b"".join(frames))
    await eventually(lambda: h2_proxy.guard.snapshot()["h2_refused_streams"] == 20)
    assert h2_proxy.guard.snapshot()["h2_protocol_errors"] == 0
    abuser.writer.close()
    await eventually(lambda: h2_proxy.pipeline.in_flight == 0)
    await good_client_served(h2_proxy.url)


async def test_stalled_head_times_out(h2_proxy: EdgeProxy) -> None:
    abuser = await RawH2.open(h2_proxy.url)
    block = abuser.conn.encoder.encode(abuser.request_headers(1))
    # A header block that never ends: HEADERS without END_HEADERS, then nothing.
    await abuser.raw(HeadersFrame(1, block[:8]).serialize())
    await abuser.goaway()  # the server closes (header_timeout = 1 s)
    assert h2_proxy.guard.snapshot()["header_timeouts"] == 1
    await good_client_served(h2_proxy.url)


async def test_stalled_body_gets_408_and_is_counted(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    """The body bounds of [limits] hold on the HTTP/2 listener too, and /status counts
    what they refused beside the listener's other limits."""
    region = await make_region("ap-1", model="m")
    proxy = await make_proxy([region], server=H2C, limits={"body_timeout": 0.5})
    client = await RawH2.open(proxy.url)
    client.conn.send_headers(1, client.request_headers(1))
    client.conn.send_data(1, b'{"model": "m", ')  # and then nothing more
    await client.raw(client.conn.data_to_send())
    status, body = await client.answer(1)
    assert status == 408
    assert json.loads(body)["error"]["code"] == "request_timeout"
    client.writer.close()
    await client.writer.wait_closed()
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.admin_url + "/status") as resp:
            limits = (await resp.json())["limits"]
    assert limits["body_timeouts"] == 1
    assert region.requests_by_path.get(CHAT) is None
    await good_client_served(proxy.url)


def http1_chat(body: dict[str, Any], *headers: bytes) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy.test\r\n%s"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (b"".join(h + b"\r\n" for h in headers), len(data), data)
    )


HALF_CLOSED = {
    "get": b"GET /v1/models HTTP/1.1\r\nHost: proxy.test\r\n\r\n",
    "chat": http1_chat(BODY),
    "connection-close": http1_chat(BODY, b"Connection: close"),
}


@pytest.mark.parametrize("payload", HALF_CLOSED.values(), ids=HALF_CLOSED.keys())
async def test_a_half_closed_http1_client_gets_its_whole_answer(
    make_region: RegionFactory, make_proxy: ProxyFactory, payload: bytes
) -> None:
    # The request whole, then FIN (shutdown(SHUT_WR)), as curl --http1.1 and some load
    # balancers send it. The keep-alive timeout is long: the close that ends the read must
    # be the half-close's, once the answer is out.
    region = await make_region("ap-1", model="m", ttft=0.05)
    proxy = await make_proxy([region], server=H2C, limits={"keepalive_timeout": 60.0})
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    # HTTP/1.1 here is the default listener's: after a FIN it may ask, with an interim
    # 100, whether the client still reads.
    answer = answer.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), answer
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    assert len(body) == length
    json.loads(body)
    await eventually(lambda: proxy.guard.open == 0)


async def test_a_client_that_half_closes_while_its_stream_runs_gets_all_of_it(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # The FIN comes on a read of its own, once the answer has started.
    region = await make_region("ap-1", model="m", tokens=20, inter_token_delay=0.05)
    proxy = await make_proxy([region], server=H2C, limits={"keepalive_timeout": 60.0})
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(http1_chat({**BODY, "stream": True}))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    assert head.startswith(b"HTTP/1.1 200 "), head
    writer.write_eof()
    rest = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), rest
    await eventually(lambda: proxy.guard.open == 0)


@pytest.mark.parametrize("when", ["waiting", "streaming"])
async def test_with_half_close_abort_an_http1_fin_cancels_the_request(
    make_region: RegionFactory, make_proxy: ProxyFactory, when: str
) -> None:
    # The client's FIN means it is gone: nothing more is sent, the upstream work is
    # cancelled and the connection closes (the keep-alive timeout is long).
    streaming = when == "streaming"
    region = await make_region(
        "ap-1", ttft=0 if streaming else 30, tokens=200, inter_token_delay=0.05
    )
    proxy = await make_proxy(
        [region], server=H2C, limits={"half_close": "abort", "keepalive_timeout": 60.0}
    )
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(http1_chat({**BODY, "stream": True} if streaming else BODY))
    if streaming:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        assert head.startswith(b"HTTP/1.1 200 "), head
    else:
        await eventually(lambda: region.in_flight == 1)
    writer.write_eof()
    rest = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    assert b"[DONE]" not in rest and (streaming or rest == b""), rest
    await eventually(lambda: region.cancelled_total == 1 and region.in_flight == 0)
    await eventually(lambda: proxy.guard.open == 0)


def assert_refused_503(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable", answer
    headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
    assert headers["retry-after"] == "1"
    assert headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "too_many_connections"


async def test_connection_caps_hold(make_region: RegionFactory, make_proxy: ProxyFactory) -> None:
    region = await make_region("ap-1", model="m")
    proxy = await make_proxy(
        [region], server=H2C, limits={"max_connections": 2, "max_connections_per_ip": 0}
    )
    held = [await RawH2.open(proxy.url) for _ in range(2)]
    await eventually(lambda: proxy.guard.open == 2)
    # Over the cap: the aiohttp listener's 503, written before reading anything (nothing
    # in cleartext says whether the client speaks HTTP/1.1 or h2c until it sends).
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    answer = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    assert_refused_503(answer)
    assert proxy.guard.snapshot()["connections_refused"] == 1
    for client in held:
        client.writer.close()
    await eventually(lambda: proxy.guard.open == 0)
    await good_client_served(proxy.url)


@pytest.mark.parametrize("tls", [False, True], ids=["cleartext", "tls-h2"])
async def test_a_connection_the_client_closes_idle_is_released_at_once(
    make_region: RegionFactory, make_proxy: ProxyFactory, tmp_path: Path, tls: bool
) -> None:
    # Not at the keep-alive timeout: until released it counts under the caps.
    ca = trustme.CA()
    cert_path, key_path = write_pair(ca, tmp_path)
    region = await make_region("ap-1", model="m")
    server: dict[str, Any] = (
        {"http2": True, "tls_cert": cert_path, "tls_key": key_path} if tls else H2C
    )
    proxy = await make_proxy([region], server=server, limits={"keepalive_timeout": 60.0})
    host, port = proxy.url.split("://")[1].split(":")
    context = None
    if tls:
        context = ssl.create_default_context()
        ca.configure_trust(context)
        context.set_alpn_protocols(["h2"])
    _, writer = await asyncio.open_connection(host, int(port), ssl=context)
    await eventually(lambda: proxy.guard.open == 1)
    writer.close()
    await eventually(lambda: proxy.guard.open == 0)


async def test_a_refused_tls_connection_is_answered_in_its_protocol(
    make_region: RegionFactory, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    ca = trustme.CA()
    cert_path, key_path = write_pair(ca, tmp_path)
    region = await make_region("ap-1", model="m")
    proxy = await make_proxy(
        [region],
        server={"http2": True, "tls_cert": cert_path, "tls_key": key_path},
        limits={"max_connections": 1, "max_connections_per_ip": 0},
    )
    host, port = proxy.url.removeprefix("https://").split(":")

    async def connect(alpn: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        context = ssl.create_default_context()
        ca.configure_trust(context)
        context.set_alpn_protocols([alpn])
        return await asyncio.open_connection(host, int(port), ssl=context)

    held = await connect("h2")
    await eventually(lambda: proxy.guard.open == 1)
    # A client that negotiated h2: the server's SETTINGS, allowing no stream, then GOAWAY
    # with no stream processed (each request may be retried) and the reason.
    reader, writer = await connect("h2")
    frames = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    events = client.receive_data(frames)
    assert isinstance(events[0], h2.events.RemoteSettingsChanged)
    assert client.remote_settings.max_concurrent_streams == 0
    goaway = events[-1]
    assert isinstance(goaway, h2.events.ConnectionTerminated)
    assert goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert goaway.last_stream_id == 0
    assert goaway.additional_data == b"Too many connections to this proxy; retry shortly."
    # One that negotiated HTTP/1.1: the 503.
    reader, writer = await connect("http/1.1")
    answer = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    assert_refused_503(answer)
    assert proxy.guard.snapshot()["connections_refused"] == 2
    held[1].close()
    await eventually(lambda: proxy.guard.open == 0)


# -- edgeproxy serve --------------------------------------------------------------


def test_serve_http2_flag_without_tls_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "edge.toml"
    path.write_text('[[regions]]\nname = "ap-1"\nurl = "http://127.0.0.1:9"\n')
    assert main(["serve", "--config", str(path), "--http2"]) == 2
    err = capsys.readouterr().err
    assert "http2" in err and "h2c" in err and "tls_cert" in err


async def test_serve_streams_ten_over_one_connection(
    tmp_path: Path, make_region: RegionFactory
) -> None:
    """``edgeproxy serve --http2 --h2c`` as a real process: ten SSE streams at once from one
    client on one HTTP/2 connection (counted by the admin /status), then a clean drain."""
    region = await make_region("ap-1", model="m", tokens=30, inter_token_delay=0.05)
    port, admin_port = free_port(), free_port()
    config = tmp_path / "edge.toml"
    config.write_text(
        f"[server]\nport = {port}\n[admin]\nport = {admin_port}\n"
        f'[[regions]]\nname = "ap-1"\nurl = "{region.url}"\n'
    )
    proc = await spawn_serve(
        config,
        "--http2",
        "--h2c",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        async with httpx.AsyncClient(http1=False, http2=True, timeout=30) as client:
            await wait_ready(admin)  # the admin listener speaks HTTP/1.1
            started = 0
            all_started = asyncio.Event()
            seen: list[int] = []

            async def chat() -> str:
                nonlocal started
                body = {**BODY, "stream": True}
                text = ""
                url = f"http://127.0.0.1:{port}{CHAT}"
                async with client.stream("POST", url, json=body) as resp:
                    assert resp.http_version == "HTTP/2"
                    async for chunk in resp.aiter_text():
                        if not text:
                            started += 1
                            if started == 10:
                                async with httpx.AsyncClient() as plain:
                                    status = (await plain.get(admin + "/status")).json()
                                seen.append(status["limits"]["connections_open"])
                                all_started.set()
                            await asyncio.wait_for(all_started.wait(), 30)
                        text += chunk
                return text

            texts = await asyncio.gather(*(chat() for _ in range(10)))
        assert all(t.rstrip().endswith("data: [DONE]") for t in texts)
        assert seen == [1]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_start_up_no_longer_warns_about_untrusted_clients(
    make_region: RegionFactory, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    region = await make_region("ap-1", model="m")
    with caplog.at_level(logging.WARNING, logger="edgeproxy"):
        await make_proxy([region], server=H2C)
    assert not [r for r in caplog.records if "untrusted" in r.getMessage()]
