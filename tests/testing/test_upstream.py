"""The fake regional cluster, exercised over real sockets.

HTTP/2 is checked twice: through httpx (h2c with prior knowledge), as a
typical client sees it, and through a bare ``h2`` client where the frames
themselves matter (one DATA frame per SSE event, RST_STREAM codes, GOAWAY's
last stream id, REFUSED_STREAM). HTTP/1.1 goes through aiohttp.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
import pytest
from h2.errors import ErrorCodes
from hpack import Decoder, Encoder
from hyperframe.frame import (
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    RstStreamFrame,
    SettingsFrame,
)
from hyperframe.frame import Frame as HyperFrame

from edgeproxy.testing import Behavior, Counters, FakeRegion

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Say something deterministic"}]
# Generous: only ever reached when something hangs.
HANG = 10.0


# -- helpers ------------------------------------------------------------------


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    assert raw.endswith(b"\n\n"), raw[-40:]
    events = []
    for block in raw.decode().split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        events.append(block.removeprefix("data: "))
    return events


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, **extra}


@dataclass
class Frame:
    """One frame as the server sent it."""

    kind: str  # "headers", "data", "rst" or "goaway"
    stream_id: int
    end: bool = False
    data: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    error_code: int = 0
    last_stream_id: int = 0


class RawH2:
    """A frame-level HTTP/2 client, to see exactly what the server sends.

    Built on hyperframe and hpack rather than h2, whose connection state
    machine stops sending and receiving stream frames after a GOAWAY.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.frames: list[Frame] = []
        self.next_stream_id = 1
        self.eof = False
        self._buffer = b""

    @classmethod
    async def connect(cls, url: str) -> RawH2:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        client = cls(reader, writer)
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize())
        await writer.drain()
        return client

    async def request(self, method: str, path: str, body: bytes = b"", *, end: bool = True) -> int:
        """Open a stream; ``end=False`` leaves the request body unfinished."""
        stream_id = self.next_stream_id
        self.next_stream_id += 2
        block = self.encoder.encode(
            [(":method", method), (":path", path), (":scheme", "http"), (":authority", "fake")]
        )
        flags = ["END_HEADERS"] + (["END_STREAM"] if end and not body else [])
        out = HeadersFrame(stream_id, block, flags=flags).serialize()
        if body:
            out += DataFrame(stream_id, body, flags=["END_STREAM"] if end else []).serialize()
        self.writer.write(out)
        await self.writer.drain()
        return stream_id

    async def end_body(self, stream_id: int) -> None:
        self.writer.write(DataFrame(stream_id, b"", flags=["END_STREAM"]).serialize())
        await self.writer.drain()

    async def wait_for(self, predicate: Callable[[Frame], bool]) -> Frame:
        """Read until a frame matching ``predicate`` arrives; return it."""
        seen = 0
        while True:
            for frame in self.frames[seen:]:
                if predicate(frame):
                    return frame
            seen = len(self.frames)
            if self.eof:
                raise ConnectionError("connection closed by the server")
            await self._read()

    async def wait_closed_by_server(self) -> None:
        while not self.eof:
            await self._read()

    def stream_frames(self, stream_id: int) -> list[Frame]:
        return [f for f in self.frames if f.stream_id == stream_id]

    def data_frames(self, stream_id: int) -> list[bytes]:
        return [f.data for f in self.stream_frames(stream_id) if f.kind == "data" and f.data]

    async def _read(self) -> None:
        try:
            data = await asyncio.wait_for(self.reader.read(65536), HANG)
        except ConnectionError:
            # Our WINDOW_UPDATE can cross the server's close and turn the
            # close into a reset; either way the server is gone.
            data = b""
        if not data:
            self.eof = True
            return
        self._buffer += data
        while len(self._buffer) >= 9:
            frame, length = HyperFrame.parse_frame_header(memoryview(self._buffer[:9]))
            if len(self._buffer) < 9 + length:
                break
            frame.parse_body(memoryview(self._buffer[9 : 9 + length]))
            self._buffer = self._buffer[9 + length :]
            self._handle(frame)
        try:
            await self.writer.drain()
        except ConnectionError:
            pass  # the server may close right after its last frame

    def _handle(self, frame: HyperFrame) -> None:
        end = "END_STREAM" in frame.flags
        if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            self.writer.write(SettingsFrame(0, flags=["ACK"]).serialize())
        elif isinstance(frame, HeadersFrame):
            headers = {str(k): str(v) for k, v in self.decoder.decode(frame.data, raw=False)}
            self.frames.append(Frame("headers", frame.stream_id, end, headers=headers))
        elif isinstance(frame, DataFrame):
            # No WINDOW_UPDATE: the responses in these tests stay far below
            # the initial 64 KiB window, and writing while the server closes
            # could turn its FIN into a RST.
            self.frames.append(Frame("data", frame.stream_id, end, data=frame.data))
        elif isinstance(frame, RstStreamFrame):
            self.frames.append(Frame("rst", frame.stream_id, error_code=frame.error_code))
        elif isinstance(frame, GoAwayFrame):
            self.frames.append(
                Frame("goaway", 0, error_code=frame.error_code, last_stream_id=frame.last_stream_id)
            )

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


def ends(stream_id: int) -> Callable[[Frame], bool]:
    """Matches the frame that ends ``stream_id``: END_STREAM or RST_STREAM."""
    return lambda f: f.stream_id == stream_id and (f.end or f.kind == "rst")


# -- fixtures -----------------------------------------------------------------


@pytest.fixture
async def region() -> AsyncIterator[FakeRegion]:
    async with FakeRegion(name="eu-test", seed=7) as fake:
        yield fake


@pytest.fixture
async def h2c(region: FakeRegion) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        http1=False, http2=True, base_url=region.url, timeout=HANG
    ) as client:
        yield client


@pytest.fixture
async def h1() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
        yield session


@pytest.fixture
def cert(tmp_path: Path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
        + ["-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"]
        + ["-keyout", str(keyfile), "-out", str(certfile)],
        check=True,
        capture_output=True,
    )
    return str(certfile), str(keyfile)


# -- completions ----------------------------------------------------------------


async def test_chat_json_over_h2c_and_http1(
    region: FakeRegion, h2c: httpx.AsyncClient, h1: aiohttp.ClientSession
) -> None:
    r2 = await h2c.post(CHAT, json=chat_body())
    assert r2.http_version == "HTTP/2"
    assert r2.status_code == 200
    assert r2.headers["x-fake-region"] == "eu-test"
    body = r2.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert isinstance(body["created"], int)
    assert body["model"] == "m"
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    text = choice["message"]["content"]
    assert len(text.split()) == 8
    usage = body["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8

    async with h1.post(region.url + CHAT, json=chat_body()) as r1:
        assert r1.version == aiohttp.HttpVersion11
        assert r1.headers["x-fake-region"] == "eu-test"
        again = await r1.json()
    # Same prompt, same answer, whatever the protocol; a fresh id each time.
    assert again["choices"][0]["message"]["content"] == text
    assert again["id"] != body["id"]

    other = await h2c.post(CHAT, json={"messages": [{"role": "user", "content": "else"}]})
    assert other.json()["choices"][0]["message"]["content"] != text
    assert other.json()["model"] == "fake-llm"

    counters = region.counters()
    assert counters.requests_total == 3
    assert counters.requests_by_path == {CHAT: 3}
    assert counters.requests_by_http_version == {"2": 2, "1.1": 1}


async def test_max_tokens_overrides_and_answer_is_prefix_stable(
    region: FakeRegion, h2c: httpx.AsyncClient
) -> None:
    region.behavior.tokens = 12
    full = (await h2c.post(CHAT, json=chat_body())).json()["choices"][0]["message"]["content"]
    short = await h2c.post(CHAT, json=chat_body(max_tokens=3))
    content = short.json()["choices"][0]["message"]["content"]
    assert len(content.split()) == 3
    assert full.startswith(content)
    assert len(full.split()) == 12
    bad = await h2c.post(CHAT, json=chat_body(max_tokens="many"))
    assert bad.status_code == 400


async def test_sse_stream_h2c_one_event_per_frame(region: FakeRegion) -> None:
    region.configure(tokens=5, inter_token_delay=0.001)
    client = await RawH2.connect(region.url)
    try:
        body = json.dumps(chat_body(stream=True, stream_options={"include_usage": True})).encode()
        sid = await client.request("POST", CHAT, body)
        await client.wait_for(ends(sid))
        [response] = [f for f in client.stream_frames(sid) if f.kind == "headers"]
        headers = response.headers
        assert headers[":status"] == "200"
        assert headers["content-type"] == "text/event-stream"
        assert headers["x-fake-region"] == "eu-test"
        frames = client.data_frames(sid)
    finally:
        await client.close()

    # Flushed per event: each DATA frame holds exactly one SSE event.
    events = [sse_events(frame) for frame in frames]
    assert all(len(e) == 1 for e in events)
    payloads = [e[0] for e in events]
    assert len(payloads) == 5 + 3  # tokens, finish, usage, [DONE]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:5])
    assert [c["choices"][0]["finish_reason"] for c in chunks[:6]] == [None] * 5 + ["stop"]
    assert chunks[6]["choices"] == []
    assert chunks[6]["usage"]["completion_tokens"] == 5
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:5])
    assert len(text.split()) == 5


async def test_sse_stream_httpx_and_aiohttp(
    region: FakeRegion, h2c: httpx.AsyncClient, h1: aiohttp.ClientSession
) -> None:
    region.configure(tokens=4, ttft=0.01, inter_token_delay=0.03)
    async with h2c.stream("POST", CHAT, json=chat_body(stream=True)) as response:
        assert response.headers["content-type"] == "text/event-stream"
        raw_chunks = [chunk async for chunk in response.aiter_raw()]
    payloads = sse_events(b"".join(raw_chunks))
    assert len(payloads) == 4 + 2 and payloads[-1] == "[DONE]"
    assert len(raw_chunks) > 1  # tokens 30 ms apart do not arrive as one read

    reads = 0
    body = b""
    async with h1.post(region.url + CHAT, json=chat_body(stream=True)) as h1_response:
        assert h1_response.headers["content-type"] == "text/event-stream"
        async for data in h1_response.content.iter_any():
            reads += 1
            body += data
    assert reads > 1

    def text(events: list[str]) -> str:
        chunks = [json.loads(e) for e in events[:-1]]
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)

    assert text(sse_events(body)) == text(payloads)


async def test_completions_and_embeddings(region: FakeRegion, h2c: httpx.AsyncClient) -> None:
    completion = (await h2c.post("/v1/completions", json={"prompt": "hello there"})).json()
    assert completion["object"] == "text_completion"
    assert len(completion["choices"][0]["text"].split()) == 8
    async with h2c.stream(
        "POST", "/v1/completions", json={"prompt": "hello there", "stream": True}
    ) as response:
        payloads = sse_events(await response.aread())
    text = "".join(json.loads(p)["choices"][0]["text"] for p in payloads[:-1])
    assert text == completion["choices"][0]["text"]

    emb = (await h2c.post("/v1/embeddings", json={"input": ["a b", "c"]})).json()
    assert emb["object"] == "list"
    assert [d["index"] for d in emb["data"]] == [0, 1]
    assert len(emb["data"][0]["embedding"]) == 8
    same = (await h2c.post("/v1/embeddings", json={"input": "a b"})).json()
    assert same["data"][0]["embedding"] == emb["data"][0]["embedding"]


async def test_bad_requests_use_openai_error_shape(
    region: FakeRegion, h2c: httpx.AsyncClient, h1: aiohttp.ClientSession
) -> None:
    r = await h2c.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in r.json()["error"]["message"]
    async with h1.post(region.url + CHAT, data=b"[1, 2]") as response:
        assert response.status == 400
        assert (await response.json())["error"]["type"] == "invalid_request_error"
    assert (await h2c.post(CHAT, json={"model": "m"})).status_code == 400
    assert (await h2c.get(CHAT)).status_code == 405
    missing = await h2c.get("/v2/nothing")
    assert missing.status_code == 404
    assert missing.headers["x-fake-region"] == "eu-test"


async def test_models_health_and_status(region: FakeRegion, h2c: httpx.AsyncClient) -> None:
    models = (await h2c.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["fake-llm"]
    health = await h2c.get("/healthz")
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}
    teapot = await h2c.get("/status/418")
    assert teapot.status_code == 418
    assert teapot.json() == {"status": 418}
    assert teapot.headers["x-fake-region"] == "eu-test"
    empty = await h2c.get("/status/204")
    assert empty.status_code == 204 and empty.content == b""
    assert (await h2c.get("/status/abc")).status_code == 400


# -- echo ---------------------------------------------------------------------


async def test_echo_reports_the_request(
    region: FakeRegion, h2c: httpx.AsyncClient, h1: aiohttp.ClientSession
) -> None:
    payload = os.urandom(200_000)

    async def upload() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 50_000):
            yield payload[i : i + 50_000]

    r = await h2c.put("/echo/a%20b/c?x=1&y=2", content=upload(), headers={"x-test": "yes"})
    echo = r.json()
    assert echo["method"] == "PUT"
    assert echo["path"] == "/echo/a b/c"
    assert echo["raw_path"] == "/echo/a%20b/c"
    assert echo["query_string"] == "x=1&y=2"
    assert echo["http_version"] == "2"
    assert ["x-test", "yes"] in echo["headers"]
    assert echo["body_length"] == len(payload)
    assert echo["body_sha256"] == hashlib.sha256(payload).hexdigest()
    assert r.headers["x-echo-body-sha256"] == echo["body_sha256"]

    async with h1.delete(region.url + "/echo/z") as response:
        echo = await response.json()
    assert echo["method"] == "DELETE" and echo["http_version"] == "1.1"
    assert echo["body_length"] == 0

    sized = await h2c.get("/echo/blob?size=300000")
    assert len(sized.content) == 300_000
    assert sized.headers["content-length"] == "300000"


async def test_echo_streams_chunks(region: FakeRegion, h1: aiohttp.ClientSession) -> None:
    reads = []
    async with h1.get(region.url + "/echo/s?chunks=3&delay=0.05") as response:
        async for data in response.content.iter_any():
            reads.append(data)
    assert b"".join(reads) == b"chunk 0\nchunk 1\nchunk 2\n"
    assert len(reads) > 1
    async with h1.get(region.url + "/echo/s?chunks=x") as response:
        assert response.status == 400


# -- faults -------------------------------------------------------------------


async def test_fault_5xx(
    region: FakeRegion, h2c: httpx.AsyncClient, h1: aiohttp.ClientSession
) -> None:
    region.behavior.fault = "5xx"
    r = await h2c.post(CHAT, json=chat_body(stream=True))
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "server_error"
    assert r.headers["x-fake-region"] == "eu-test"
    region.behavior.fault_status = 429
    async with h1.get(region.url + "/healthz") as response:
        assert response.status == 429

    # Restricted to the API, the health check keeps passing.
    region.behavior.fault_paths = ("/v1/",)
    assert (await h2c.get("/healthz")).status_code == 200
    assert (await h2c.post(CHAT, json=chat_body())).status_code == 429
    assert region.counters().faults_total == 3


async def test_fault_reset_h2_sends_rst_stream_after_n_tokens(region: FakeRegion) -> None:
    region.configure(fault="reset", fault_after_tokens=3)
    client = await RawH2.connect(region.url)
    try:
        sid = await client.request("POST", CHAT, json.dumps(chat_body(stream=True)).encode())
        end = await client.wait_for(ends(sid))
        assert end.kind == "rst"
        assert end.error_code == ErrorCodes.INTERNAL_ERROR
        assert len(client.data_frames(sid)) == 3
        # Only the stream is reset: the connection goes on serving.
        region.behavior.fault = None
        sid = await client.request("GET", "/healthz")
        assert (await client.wait_for(ends(sid))).kind == "data"
    finally:
        await client.close()


async def test_fault_reset_seen_by_clients(
    region: FakeRegion, h2c: httpx.AsyncClient, h1: aiohttp.ClientSession
) -> None:
    region.configure(fault="reset", fault_after_tokens=2)
    received = []
    with pytest.raises(httpx.RemoteProtocolError):
        async with h2c.stream("POST", CHAT, json=chat_body(stream=True)) as response:
            assert response.status_code == 200
            async for chunk in response.aiter_raw():
                received.append(chunk)
    assert len(sse_events(b"".join(received))) == 2  # everything before the reset arrives

    with pytest.raises(aiohttp.ClientPayloadError):
        async with h1.post(region.url + CHAT, json=chat_body(stream=True)) as response:
            assert response.status == 200
            await response.read()
    # A plain JSON answer breaks off half way.
    with pytest.raises(aiohttp.ClientPayloadError):
        async with h1.post(region.url + CHAT, json=chat_body()) as response:
            await response.read()

    # With no token allowed, the reset comes before any response headers.
    region.behavior.fault_after_tokens = 0
    with pytest.raises(httpx.RemoteProtocolError):
        await h2c.post(CHAT, json=chat_body())
    with pytest.raises(aiohttp.ServerDisconnectedError):
        async with h1.post(region.url + CHAT, json=chat_body()) as response:
            await response.read()
    assert region.counters().faults_total == 5


async def test_fault_stall_times_out_and_counts_cancel(
    region: FakeRegion, h1: aiohttp.ClientSession
) -> None:
    region.behavior.fault = "stall"
    async with httpx.AsyncClient(http1=False, http2=True, base_url=region.url) as h2client:
        with pytest.raises(httpx.ReadTimeout):
            await h2client.post(CHAT, json=chat_body(), timeout=httpx.Timeout(HANG, read=0.3))
    # httpx does not reset an abandoned HTTP/2 stream; closing the client
    # closes the connection, which the region sees as the cancel.
    counters = await region.wait_until(lambda c: c.cancelled_total == 1)
    assert counters.in_flight == 0

    with pytest.raises(asyncio.TimeoutError):
        async with h1.post(
            region.url + CHAT, json=chat_body(), timeout=aiohttp.ClientTimeout(total=0.3)
        ) as response:
            await response.read()
    counters = await region.wait_until(lambda c: c.cancelled_total == 2)
    assert counters.in_flight == 0


async def test_fault_stall_body_sends_headers_and_first_event(
    region: FakeRegion, h2c: httpx.AsyncClient
) -> None:
    region.behavior.fault = "stall_body"
    received = b""
    with pytest.raises(httpx.ReadTimeout):
        async with h2c.stream(
            "POST", CHAT, json=chat_body(stream=True), timeout=httpx.Timeout(HANG, read=0.3)
        ) as response:
            assert response.status_code == 200
            async for chunk in response.aiter_raw():
                received += chunk
    first = json.loads(sse_events(received)[0])
    assert first["choices"][0]["delta"]["role"] == "assistant"


async def test_fault_slow_headers_then_answers(region: FakeRegion, h2c: httpx.AsyncClient) -> None:
    region.configure(fault="slow_headers", slow_headers_delay=0.05)
    r = await h2c.post(CHAT, json=chat_body())
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "stop"


async def test_fault_goaway_h2_replaces_connection(
    region: FakeRegion, h2c: httpx.AsyncClient
) -> None:
    region.configure(fault="goaway", goaway_after=2)
    for _ in range(5):
        assert (await h2c.post(CHAT, json=chat_body())).status_code == 200
    counters = region.counters()
    # Requests 1-2 on the first connection, 3-4 on the second, 5 on a third.
    # (A request httpx sends before the GOAWAY reaches it is refused, and
    # httpx retries it on a new connection; refused streams are not counted.)
    assert counters.requests_total == 5
    assert counters.connections_total == 3
    assert counters.faults_total == 2


async def test_fault_goaway_h2_frames(region: FakeRegion) -> None:
    region.configure(fault="goaway", goaway_after=1)
    client = await RawH2.connect(region.url)
    try:
        # Two requests whose bodies are still open keep both streams in flight.
        first = await client.request("POST", "/echo/1", b"x", end=False)
        second = await client.request("POST", "/echo/2", b"y", end=False)
        await region.wait_until(lambda c: c.in_flight == 2)
        await client.end_body(first)
        goaway = await client.wait_for(lambda f: f.kind == "goaway")
        assert goaway.error_code == ErrorCodes.NO_ERROR
        assert goaway.last_stream_id == second
        assert client.stream_frames(first)[-1].end

        # A stream the client opened before the GOAWAY reached it is refused.
        late = await client.request("GET", "/healthz")
        refused = await client.wait_for(ends(late))
        assert refused.kind == "rst"
        assert refused.error_code == ErrorCodes.REFUSED_STREAM
        counters = region.counters()
        assert counters.refused_total == 1
        assert counters.requests_total == 2

        # The stream accepted before GOAWAY is still answered; then the server closes.
        await client.end_body(second)
        assert (await client.wait_for(ends(second))).kind == "data"
        await client.wait_closed_by_server()
    finally:
        await client.close()


async def test_fault_goaway_http1_closes_connection(
    region: FakeRegion, h1: aiohttp.ClientSession
) -> None:
    region.configure(fault="goaway", goaway_after=1)
    for _ in range(2):
        async with h1.post(region.url + CHAT, json=chat_body()) as response:
            assert response.headers["connection"] == "close"
            await response.read()
    assert region.connections_total == 2


async def test_fault_rate_is_seeded(h2c: httpx.AsyncClient) -> None:
    async def outcomes() -> list[int]:
        async with FakeRegion(seed=42, behavior=Behavior(fault="5xx", fault_rate=0.5)) as fake:
            async with httpx.AsyncClient(http1=False, http2=True, base_url=fake.url) as client:
                return [(await client.get("/healthz")).status_code for _ in range(16)]

    first, second = await outcomes(), await outcomes()
    assert first == second
    assert set(first) == {200, 503}


# -- behaviour, counters, control ----------------------------------------------------


async def test_behavior_changes_at_run_time(region: FakeRegion, h2c: httpx.AsyncClient) -> None:
    assert (await h2c.get("/healthz")).status_code == 200
    region.behavior.fault = "5xx"
    assert (await h2c.get("/healthz")).status_code == 503
    region.behavior = Behavior(tokens=2)
    text = (await h2c.post(CHAT, json=chat_body())).json()["choices"][0]["message"]["content"]
    assert len(text.split()) == 2
    with pytest.raises(ValueError):
        region.behavior.fault = "explode"  # type: ignore[assignment]
    with pytest.raises(ValueError):
        region.behavior.ttft = -1
    with pytest.raises(AttributeError):
        region.configure(fault="5xx", ttfb=1.0)
    assert region.behavior.fault is None  # configure is all or nothing


async def test_counters_multiplexing_and_cancels(region: FakeRegion) -> None:
    region.behavior.fault = "stall"
    async with httpx.AsyncClient(http1=False, http2=True, base_url=region.url) as client:
        tasks = [asyncio.create_task(client.post(CHAT, json=chat_body())) for _ in range(10)]
        counters = await region.wait_until(lambda c: c.in_flight == 10)
        assert counters.connections_total == 1
        assert counters.peak_streams_per_connection == 10
        assert counters.peak_in_flight == 10
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    counters = await region.wait_until(lambda c: c.cancelled_total == 10)
    assert counters.in_flight == 0
    assert counters.requests_total == 10

    region.reset_counters()
    assert region.counters() == Counters()


async def test_control_over_http(region: FakeRegion, h1: aiohttp.ClientSession) -> None:
    async with h1.get(region.url + "/healthz") as response:
        assert response.status == 200
    async with h1.post(region.url + "/_control", json={"fault": "5xx", "ttft": 0.01}) as response:
        state = await response.json()
        assert response.headers["x-fake-region"] == "eu-test"
    assert state["behavior"]["fault"] == "5xx"
    assert region.behavior.fault == "5xx" and region.behavior.ttft == 0.01
    async with h1.get(region.url + "/healthz") as response:
        assert response.status == 503
    async with h1.get(region.url + "/_control") as response:
        state = await response.json()
    assert state["name"] == "eu-test"
    assert state["counters"]["requests_total"] == 2  # control requests are not counted
    assert state["counters"]["requests_by_path"] == {"/healthz": 2}
    async with h1.post(region.url + "/_control", json={"fault": "boom"}) as response:
        assert response.status == 400
        assert "fault" in (await response.json())["error"]["message"]
    async with h1.post(region.url + "/_control", json={"nope": 1}) as response:
        assert response.status == 400
    async with h1.post(region.url + "/_control/reset-counters") as response:
        assert (await response.json())["counters"]["requests_total"] == 0
    assert region.requests_total == 0


# -- lifecycle ------------------------------------------------------------------


async def test_kill_and_restart_on_the_same_port(region: FakeRegion) -> None:
    url, port = region.url, region.port
    region.behavior.inter_token_delay = 0.05
    async with httpx.AsyncClient(http1=False, http2=True, base_url=url, timeout=HANG) as client:
        assert (await client.get("/healthz")).status_code == 200
        with pytest.raises(httpx.TransportError):
            async with client.stream("POST", CHAT, json=chat_body(stream=True)) as response:
                chunks = response.aiter_raw()
                await anext(chunks)
                await region.kill()  # mid-stream
                async for _ in chunks:
                    pass
        assert not region.running
        with pytest.raises(httpx.ConnectError):
            await client.get("/healthz")

        await region.restart()
        assert region.port == port and region.url == url
        assert (await client.get("/healthz")).status_code == 200
    # Counters span the restart.
    assert region.requests_by_path == {"/healthz": 2, CHAT: 1}


async def test_stop_with_stalled_requests_is_prompt() -> None:
    fake = FakeRegion(behavior=Behavior(fault="stall"), shutdown_grace=HANG)
    await fake.start()
    async with (
        httpx.AsyncClient(http1=False, http2=True, base_url=fake.url) as h2client,
        aiohttp.ClientSession() as session,
    ):

        async def h1_request() -> None:
            async with session.get(fake.url + "/healthz") as response:
                await response.read()

        tasks = [
            asyncio.create_task(h2client.get("/healthz", timeout=HANG)),
            asyncio.create_task(h1_request()),
        ]
        await fake.wait_until(lambda c: c.in_flight == 2)
        # Well inside the grace period: stalled requests never finish, so they
        # are aborted at once rather than waited for.
        await asyncio.wait_for(fake.stop(), HANG / 2)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), HANG)
    assert all(isinstance(r, Exception) for r in results), results
    assert not fake.running
    assert fake.cancelled_total == 0  # the server left, not the clients


async def test_stop_lets_requests_finish_within_grace(region: FakeRegion) -> None:
    region.configure(tokens=3, inter_token_delay=0.1)
    async with httpx.AsyncClient(http1=False, http2=True, base_url=region.url) as client:
        task = asyncio.create_task(client.post(CHAT, json=chat_body(stream=True), timeout=HANG))
        await region.wait_until(lambda c: c.in_flight == 1)
        await region.stop(grace=HANG)
        response = await task
    assert sse_events(response.content)[-1] == "[DONE]"


def test_sync_lifecycle() -> None:
    fake = FakeRegion(name="sync")
    fake.start_sync()
    try:
        assert fake.running
        with urllib.request.urlopen(fake.url + "/healthz", timeout=HANG) as response:
            assert response.headers["x-fake-region"] == "sync"
            assert json.load(response) == {"status": "ok"}
    finally:
        fake.stop_sync()
    assert not fake.running
    assert "fake-region-sync" not in {t.name for t in threading.enumerate()}


async def test_keeps_serving_while_the_callers_loop_is_blocked(region: FakeRegion) -> None:
    def blocking_get() -> int:
        with urllib.request.urlopen(region.url + "/healthz", timeout=HANG) as response:
            return int(response.status)

    # urllib in this very thread blocks our event loop; the region must not care.
    assert blocking_get() == 200


async def test_port_in_use_fails_start(region: FakeRegion) -> None:
    with pytest.raises(OSError):
        await FakeRegion(port=region.port).start()


async def test_http1_only_refuses_h2c(h1: aiohttp.ClientSession) -> None:
    async with FakeRegion(http1_only=True) as fake:
        async with httpx.AsyncClient(http1=False, http2=True, base_url=fake.url) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get("/healthz", timeout=HANG)
        async with h1.get(fake.url + "/healthz") as response:
            assert response.status == 200
        assert fake.counters().refused_total == 1


async def test_tls_with_alpn(cert: tuple[str, str], h1: aiohttp.ClientSession) -> None:
    certfile, keyfile = cert

    def context() -> ssl.SSLContext:
        # One per client: httpx sets ALPN protocols on the context it is given.
        return ssl.create_default_context(cafile=certfile)

    async with FakeRegion(certfile=certfile, keyfile=keyfile) as fake:
        assert fake.url.startswith("https://")
        async with httpx.AsyncClient(http2=True, verify=context(), base_url=fake.url) as client:
            r = await client.post(CHAT, json=chat_body(), timeout=HANG)
        assert r.http_version == "HTTP/2"
        assert r.json()["object"] == "chat.completion"
        async with h1.get(fake.url + "/healthz", ssl=context()) as response:
            assert response.version == aiohttp.HttpVersion11
    async with FakeRegion(certfile=certfile, keyfile=keyfile, http1_only=True) as fake:
        async with httpx.AsyncClient(http2=True, verify=context(), base_url=fake.url) as client:
            r = await client.get("/healthz", timeout=HANG)
        assert r.http_version == "HTTP/1.1"


def test_bad_certificate_fails_in_the_caller(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(OSError):
        FakeRegion(certfile=missing, keyfile=missing).start_sync()
    with pytest.raises(ValueError):
        FakeRegion(certfile=missing)


def test_command_line_region() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgeproxy.testing", "--name", "cli", "--port", str(port)]
        + ["--tokens", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == f"listening on http://127.0.0.1:{port}\n", line
        url = line.split()[-1]

        def call(method: str, path: str, body: object = None) -> Any:
            data = None if body is None else json.dumps(body).encode()
            request = urllib.request.Request(url + path, data=data, method=method)
            try:
                with urllib.request.urlopen(request, timeout=HANG) as response:
                    return response.status, json.load(response)
            except urllib.error.HTTPError as exc:
                with exc:
                    return exc.code, json.load(exc)

        status, answer = call("POST", CHAT, chat_body())
        assert status == 200
        assert len(answer["choices"][0]["message"]["content"].split()) == 3
        status, state = call("POST", "/_control", {"fault": "5xx", "fault_status": 502})
        assert state["behavior"]["fault_status"] == 502
        assert call("POST", CHAT, chat_body())[0] == 502
        status, state = call("GET", "/_control")
        assert state["counters"]["requests_total"] == 2
        assert call("POST", "/_control/reset-counters")[1]["counters"]["requests_total"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
