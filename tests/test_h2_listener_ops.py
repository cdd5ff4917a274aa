"""Operating the HTTP/2 listener (``server.http2``), end to end: ALPN over TLS beside
HTTP/1.1 on one port, a certificate reloaded under open HTTP/2 connections, ``Upgrade:
h2c``, a drain (GOAWAY, the open streams finish, new ones refused, the rest cut at the end
of the grace period), and ``serve --workers 2 --http2 --h2c`` as real processes.

The drain is watched frame by frame: the h2 library's client stops reading at a GOAWAY,
and a drain goes on after it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h2.errors
import hpack
import httpx
import pytest
import trustme
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from edgeproxy import EdgeProxy
from edgeproxy.testing import FakeRegion

from . import test_workers
from .conftest import ProxyFactory, RegionFactory, eventually, spawn_serve, write_pair
from .test_http2_listener import RawH2
from .test_workers import post_new_connection, supervise, write_config

CHAT = "/v1/chat/completions"
# The fake regions serve (and list in their /v1/models, from which a proxy learns it) the
# model the requests name.
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
STREAM = {**BODY, "stream": True}
H2C = {"http2": True, "h2c": True}
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REFUSED_STREAM = h2.errors.ErrorCodes.REFUSED_STREAM


# -- clients -----------------------------------------------------------------------------


@dataclass
class Answer:
    """One stream's answer as it arrives."""

    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    ended: bool = False  # END_STREAM came
    reset: int | None = None  # the RST_STREAM's error code

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None

    @property
    def status(self) -> int:
        return int(dict(self.headers)[":status"])


class FrameClient:
    """An HTTP/2 client that reads every frame the server sends, a GOAWAY and what
    follows it included. It opens a connection-wide window large enough for every answer
    here, so it never sends a frame it was not asked to."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.scheme = "https" if writer.get_extra_info("ssl_object") is not None else "http"
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.answers: dict[int, Answer] = {}
        self.goaway: GoAwayFrame | None = None
        self.closed = False
        self._reading = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str, context: ssl.SSLContext | None = None) -> FrameClient:
        host, port = url.split("://", 1)[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
        client = cls(reader, writer)
        window = WindowUpdateFrame(0)
        window.window_increment = 2**30
        writer.write(PREFACE + SettingsFrame(0).serialize() + window.serialize())
        await writer.drain()
        return client

    @property
    def peer_certificate(self) -> bytes:
        der: bytes = self.writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return der

    def request(self, stream_id: int, method: str, path: str, body: Any = None) -> None:
        headers = [
            (":method", method),
            (":scheme", self.scheme),
            (":authority", "localhost"),
            (":path", path),
        ]
        data = b"" if body is None else json.dumps(body).encode()
        if data:
            headers.append(("content-type", "application/json"))
        self.answers[stream_id] = Answer()
        flags = ["END_HEADERS"] if data else ["END_HEADERS", "END_STREAM"]
        frames: list[Frame] = [HeadersFrame(stream_id, self.encoder.encode(headers), flags=flags)]
        if data:
            frames.append(DataFrame(stream_id, data, flags=["END_STREAM"]))
        self.writer.write(b"".join(frame.serialize() for frame in frames))

    async def answer(self, stream_id: int) -> Answer:
        """The stream's answer once it ended, was reset, or the connection closed."""
        answer = self.answers[stream_id]
        await eventually(lambda: answer.done or self.closed, timeout=30)
        return answer

    async def close(self) -> None:
        self.writer.close()
        await asyncio.wait_for(self._reading, 30)
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await self.writer.wait_closed()

    async def _read(self) -> None:
        buffer = b""
        try:
            while chunk := await self.reader.read(65536):
                buffer += chunk
                while len(buffer) >= 9:
                    frame, length = Frame.parse_frame_header(memoryview(buffer[:9]))
                    if len(buffer) < 9 + length:
                        break
                    frame.parse_body(memoryview(buffer[9 : 9 + length]))
                    buffer = buffer[9 + length :]
                    self._frame(frame)
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            self.closed = True

    def _frame(self, frame: Frame) -> None:
        answer = self.answers.get(frame.stream_id)
        if isinstance(frame, SettingsFrame):
            if "ACK" not in frame.flags:
                self.writer.write(SettingsFrame(0, flags=["ACK"]).serialize())
        elif isinstance(frame, GoAwayFrame):
            self.goaway = frame
        elif answer is None:
            return
        elif isinstance(frame, HeadersFrame):
            answer.headers += [(str(k), str(v)) for k, v in self.decoder.decode(frame.data)]
            answer.ended = "END_STREAM" in frame.flags
        elif isinstance(frame, DataFrame):
            answer.body += frame.data
            answer.ended = "END_STREAM" in frame.flags
        elif isinstance(frame, RstStreamFrame):
            answer.reset = frame.error_code


def tls_context(ca: trustme.CA, alpn: list[str] | None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    if alpn is not None:
        context.set_alpn_protocols(alpn)
    return context


async def http1_chat(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """A chat completion over HTTP/1.1 on an open connection: the answer's head (its body
    checked)."""
    body = json.dumps(BODY).encode()
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return await read_http1(reader)


async def read_http1(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 answer with a Content-Length: its head; a JSON body must parse."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    lines = (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)
    fields = {name.strip().lower(): value.strip() for name, _, value in lines}
    assert b"content-length" in fields, head
    data = await asyncio.wait_for(reader.readexactly(int(fields[b"content-length"])), 20)
    if fields.get(b"content-type", b"").startswith(b"application/json"):
        assert json.loads(data)["object"] == "chat.completion", data
    return head


async def close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        await writer.wait_closed()


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


Connect = Callable[..., Awaitable[FrameClient]]


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """Open :class:`FrameClient` connections (``url``, ``context``); all closed after."""
    opened: list[FrameClient] = []

    async def factory(url: str, context: ssl.SSLContext | None = None) -> FrameClient:
        client = await FrameClient.open(url, context)
        opened.append(client)
        return client

    yield factory
    for client in opened:
        await client.close()


# -- ALPN over TLS ------------------------------------------------------------------------


@pytest.mark.parametrize("offered", [["h2", "http/1.1"], ["http/1.1"], None])
async def test_alpn_picks_h2_or_http1_on_one_tls_port(
    tmp_path: Path,
    ca: trustme.CA,
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    connect: Connect,
    offered: list[str] | None,
) -> None:
    """A client offering h2 gets HTTP/2; one offering only http/1.1, or nothing, HTTP/1.1
    from the same port."""
    region = await make_region("ap-1", model="m")
    cert, key = write_pair(ca, tmp_path)
    proxy = await make_proxy([region], server={"http2": True, "tls_cert": cert, "tls_key": key})
    assert proxy.url.startswith("https://")
    context = tls_context(ca, offered)
    if offered and "h2" in offered:
        client = await connect(proxy.url, context)
        assert client.writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
        client.request(1, "POST", CHAT, BODY)
        answer = await client.answer(1)
        assert answer.ended and answer.status == 200
        assert json.loads(answer.body)["object"] == "chat.completion"
        return
    host, port = proxy.url.removeprefix("https://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
    try:
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == (
            "http/1.1" if offered else None
        )
        head = await http1_chat(reader, writer)
        assert head.startswith(b"HTTP/1.1 200 "), head
        # Kept alive: a second request on the same connection.
        assert (await http1_chat(reader, writer)).startswith(b"HTTP/1.1 200 ")
    finally:
        await close_writer(writer)


# -- certificate reload ---------------------------------------------------------------------


async def test_a_reloaded_certificate_serves_new_h2_connections_and_open_ones_go_on(
    tmp_path: Path,
    ca: trustme.CA,
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    connect: Connect,
) -> None:
    """What SIGHUP does (``reload_tls``), with HTTP/2: a new connection gets the new
    certificate, one opened before keeps its streams coming."""
    region = await make_region("ap-1", model="m")
    cert, key = write_pair(ca, tmp_path)
    proxy = await make_proxy([region], server={"http2": True, "tls_cert": cert, "tls_key": key})
    before = await connect(proxy.url, tls_context(ca, ["h2"]))
    before.request(1, "POST", CHAT, BODY)
    assert (await before.answer(1)).status == 200

    new_ca = trustme.CA()
    new_cert, new_key = write_pair(new_ca, tmp_path, "new")
    Path(cert).write_bytes(Path(new_cert).read_bytes())
    Path(key).write_bytes(Path(new_key).read_bytes())
    assert proxy.reload_tls() is True

    # Trusting the new CA alone: the handshake itself shows the certificate is the new one.
    after = await connect(proxy.url, tls_context(new_ca, ["h2"]))
    assert after.writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
    assert after.peer_certificate != before.peer_certificate
    after.request(1, "POST", CHAT, BODY)
    assert (await after.answer(1)).status == 200
    with pytest.raises(ssl.SSLCertVerificationError):
        await connect(proxy.url, tls_context(ca, ["h2"]))

    # The connection opened under the old certificate serves on.
    before.request(3, "POST", CHAT, BODY)
    answer = await before.answer(3)
    assert answer.ended and answer.status == 200
    assert not before.closed and before.goaway is None


# -- Upgrade: h2c ---------------------------------------------------------------------------


async def test_an_upgrade_to_h2c_answers_on_stream_1_then_serves_stream_3(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", model="m")
    proxy = await make_proxy([region], server=H2C)
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    client = RawH2(reader, writer)
    settings = client.conn.initiate_upgrade_connection()
    assert settings is not None
    writer.write(
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
        b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: " + settings + b"\r\n\r\n"
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    assert head.startswith(b"HTTP/1.1 101 "), head
    assert b"upgrade: h2c" in head.lower()
    await client.flush()  # the client's preface and SETTINGS, after the 101
    status, body = await client.answer(1)
    assert status == 200
    assert "m" in [model["id"] for model in json.loads(body)["data"]]

    stream_id = client.conn.get_next_available_stream_id()
    assert stream_id == 3
    client.conn.send_headers(stream_id, client.request_headers(stream_id))
    client.conn.send_data(stream_id, json.dumps(BODY).encode(), end_stream=True)
    await client.flush()
    status, body = await client.answer(stream_id)
    assert status == 200
    assert json.loads(body)["object"] == "chat.completion"
    await close_writer(writer)


async def test_an_upgrade_request_with_a_body_is_answered_over_http1(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    """``Upgrade: h2c`` on a request with a body: the upgrade is ignored (no 101), the
    request answered as plain HTTP/1.1."""
    region = await make_region("ap-1", model="m")
    proxy = await make_proxy([region], server=H2C)
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    settings = RawH2(reader, writer).conn.initiate_upgrade_connection()
    assert settings is not None
    body = json.dumps(BODY).encode()
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        "Upgrade: h2c\r\nHTTP2-Settings: ".encode()
        + settings
        + b"\r\n\r\n"
        + body
    )
    try:
        head = await read_http1(reader)
        assert head.startswith(b"HTTP/1.1 200 "), head
        assert b"upgrade" not in head.lower()
        # Still HTTP/1.1: the connection takes another request.
        assert (await http1_chat(reader, writer)).startswith(b"HTTP/1.1 200 ")
    finally:
        await close_writer(writer)


# -- drain ----------------------------------------------------------------------------------


async def drain_started(
    make_region: RegionFactory, make_proxy: ProxyFactory, connect: Connect, answer: str
) -> tuple[EdgeProxy, FakeRegion, FrameClient, asyncio.Task[bool]]:
    """A proxy asked to stop (grace 20 s) while its h2c client's stream 1 is in flight:
    a ``"stream"`` that sent its first event (about 2 s more to go), or a JSON answer
    still ``"waiting"`` for its region (1 s), whose head has not gone out yet. Returns
    once the client has the GOAWAY."""
    if answer == "stream":
        region = await make_region("ap-1", model="m", tokens=40, inter_token_delay=0.05)
    else:
        region = await make_region("ap-1", model="m", ttft=1.0)
    proxy = await make_proxy([region], server=H2C)
    client = await connect(proxy.url)
    client.request(1, "POST", CHAT, STREAM if answer == "stream" else BODY)
    if answer == "stream":
        await eventually(lambda: b"data: {" in client.answers[1].body)
    else:
        await eventually(lambda: region.in_flight == 1)
    stopping = asyncio.create_task(proxy.stop(20.0))
    await eventually(lambda: client.goaway is not None or client.closed)
    goaway = client.goaway
    assert goaway is not None, "closed without a GOAWAY"
    assert goaway.error_code == h2.errors.ErrorCodes.NO_ERROR
    assert goaway.last_stream_id >= 1
    assert not client.answers[1].done, "stream 1 ended before the test went on"
    return proxy, region, client, stopping


async def assert_finished_whole(
    proxy: EdgeProxy, region: FakeRegion, client: FrameClient, stopping: asyncio.Task[bool]
) -> None:
    """Stream 1 ended cleanly and whole, then the connection closed and stop() drained."""
    stream = await client.answer(1)
    assert stream.reset is None and stream.ended, (stream, client.closed)
    assert stream.status == 200
    text = stream.body.decode()
    if dict(stream.headers)["content-type"].startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]")
        assert text.count("data: {") >= 40
    else:
        assert json.loads(text)["object"] == "chat.completion"
    await eventually(lambda: client.closed)
    assert await asyncio.wait_for(stopping, 30) is True
    assert region.cancelled_total == 0


@pytest.mark.parametrize("answer", ["stream", "waiting"])
async def test_a_drain_sends_goaway_and_the_open_stream_finishes_whole(
    make_region: RegionFactory, make_proxy: ProxyFactory, connect: Connect, answer: str
) -> None:
    drain = await drain_started(make_region, make_proxy, connect, answer)
    await assert_finished_whole(*drain)


async def test_a_stream_opened_after_the_goaway_is_refused(
    make_region: RegionFactory, make_proxy: ProxyFactory, connect: Connect
) -> None:
    """Past the GOAWAY's last stream: RST_STREAM REFUSED_STREAM (never processed, safe to
    retry elsewhere), not the connection's end."""
    proxy, region, client, stopping = await drain_started(
        make_region, make_proxy, connect, "stream"
    )
    client.request(3, "POST", CHAT, STREAM)
    refused = await client.answer(3)
    assert refused.reset == REFUSED_STREAM, (refused, client.closed, proxy.guard.snapshot())
    assert proxy.guard.h2_protocol_errors == 0
    await assert_finished_whole(proxy, region, client, stopping)


@pytest.mark.parametrize("kind", ["window_update", "ping"])
async def test_frames_a_reading_client_sends_after_the_goaway_are_taken(
    make_region: RegionFactory, make_proxy: ProxyFactory, connect: Connect, kind: str
) -> None:
    """A client reading its stream goes on sending WINDOW_UPDATE and PING after the
    GOAWAY, as browsers do: the connection stays until the stream has ended."""
    proxy, region, client, stopping = await drain_started(
        make_region, make_proxy, connect, "stream"
    )
    if kind == "window_update":
        update = WindowUpdateFrame(1)
        update.window_increment = 1024
        client.writer.write(update.serialize())
    else:
        client.writer.write(PingFrame(0, b"12345678").serialize())
    await client.answer(1)
    assert proxy.guard.h2_protocol_errors == 0, client.answers[1]
    await assert_finished_whole(proxy, region, client, stopping)


async def test_a_stream_still_running_when_the_grace_period_ends_is_cut(
    make_region: RegionFactory, make_proxy: ProxyFactory, connect: Connect
) -> None:
    # Its first event, then nothing until the proxy lets go.
    region = await make_region("ap-1", model="m", fault="stall_body")
    proxy = await make_proxy([region], server=H2C)
    client = await connect(proxy.url)
    client.request(1, "POST", CHAT, STREAM)
    stream = client.answers[1]
    await eventually(lambda: b"data: {" in stream.body)

    assert await asyncio.wait_for(proxy.stop(0.5), 30) is False
    await client.answer(1)
    # Cut where the client can tell: reset, or an error event, never a clean [DONE].
    assert stream.reset is not None or b"event: error" in stream.body, (
        stream,
        client.closed,
    )
    assert b"[DONE]" not in stream.body
    await eventually(lambda: region.cancelled_total == 1 and region.in_flight == 0)
    await eventually(lambda: client.closed)


# -- serve --workers 2 --http2 --h2c ----------------------------------------------------------


async def test_two_workers_serve_h2c_and_http1_then_drain_on_sigterm(
    tmp_path: Path, make_region: RegionFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    region = await make_region("ap-1", model="m")
    config = tmp_path / "edge.toml"
    write_config(config, [("ap-1", region.url)])

    # test_workers.supervise starts ``serve --config``: the flags under test go with it.
    def serve_with_flags(path: Path, **streams: Any) -> Any:
        return spawn_serve(path, "--workers", "2", "--http2", "--h2c", **streams)

    monkeypatch.setattr(test_workers, "spawn_serve", serve_with_flags)
    async with supervise(config) as run:
        assert run.url.startswith("http://")
        versions = []
        for _ in range(20):
            # A connection each, so that the kernel spreads them over both workers.
            async with httpx.AsyncClient(http1=False, http2=True, timeout=30) as client:
                resp = await client.post(run.url + CHAT, json=BODY)
                assert resp.status_code == 200
                versions.append(resp.http_version)
        assert versions == ["HTTP/2"] * 20
        assert [await post_new_connection(run.url) for _ in range(20)] == [200] * 20
        status = await run.until(
            lambda s: sum(w["requests_total"] or 0 for w in s["workers"]) == 40,
            "the workers' counts did not add up",
        )
        assert len(status["workers"]) == 2

        # An idle HTTP/2 connection stays open across the SIGTERM: it must not hold the
        # drain (grace_period = 20 s in write_config).
        async with httpx.AsyncClient(http1=False, http2=True, timeout=30) as kept:
            resp = await kept.post(run.url + CHAT, json=BODY)
            assert resp.status_code == 200 and resp.http_version == "HTTP/2"
            run.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(run.proc.wait(), 20) == 0, "".join(run.log[-40:])
        assert any("all drained" in line for line in run.log), "".join(run.log[-40:])
