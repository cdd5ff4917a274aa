"""The HTTP/2 listener's own framing against hostile clients (``H2Attacker``): a frame
declared longer than SETTINGS_MAX_FRAME_SIZE ends the connection as its header arrives,
what a connection may hold of a frame not yet whole is one frame, a frame left incomplete
is bounded in time with streams open, and bytes trickling in cost the same per byte."""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

import pytest

from edgeproxy import EdgeProxy
from edgeproxy._server import h2frames
from edgeproxy._server.h2server import H2Connection
from edgeproxy.testing import H2Attacker
from edgeproxy.testing._h2attack import (
    DATA,
    END_STREAM,
    HEADERS,
    PING,
    frame,
    request_fields,
)

from .conftest import ProxyFactory, RegionFactory, eventually

H2C = {"http2": True, "h2c": True}
CHAT = "/v1/chat/completions"
GOOD = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
FRAME_SIZE_ERROR = 0x6
MAX_FRAME = 16384


def frame_header(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    return struct.pack(">BHBBL", length >> 16, length & 0xFFFF, kind, flags, stream_id)


def h2_connections(proxy: EdgeProxy) -> list[H2Connection]:
    return [c for c in proxy.guard.connections if isinstance(c, H2Connection)]


def models_fields(method: str = "GET") -> list[tuple[str, str]]:
    return [
        (":method", method),
        (":path", "/v1/models"),
        (":scheme", "http"),
        (":authority", "localhost"),
    ]


@pytest.fixture
async def proxy(make_region: RegionFactory, make_proxy: ProxyFactory) -> EdgeProxy:
    region = await make_region("ap-1", model="m")
    return await make_proxy([region], server=H2C, limits={"h2_max_control_frames": 100})


async def open_stream(client: H2Attacker) -> int:
    """A request whose body is still to come: a stream open on the connection. Once the
    client has answered the server's SETTINGS, so that no frame of its own (the ACK) cuts
    into the frames a test writes by hand."""
    await eventually(lambda: bool(client.settings))
    stream_id = client.stream()
    client.send(client.headers_frame(stream_id, request_fields()))
    await client.drain()
    return stream_id


async def served(client: H2Attacker) -> None:
    stream_id, frames = client.request(models_fields())
    client.send(frames)
    answer = await client.answer(stream_id)
    assert answer.status == 200 and answer.ended, answer


# -- item 1: the frame reader ----------------------------------------------------------------


@pytest.mark.parametrize("kind", [DATA, HEADERS, PING, 0x77])
async def test_a_frame_declared_past_the_max_frame_size_ends_the_connection_at_its_header(
    proxy: EdgeProxy, kind: int
) -> None:
    """Nothing of the frame's payload is sent: the header alone is enough to refuse it."""
    client = await H2Attacker.open(proxy.url)
    stream_id = await open_stream(client)
    client.send(frame_header(2**24 - 1, kind, 0, stream_id if kind != PING else 0))
    goaway = await client.wait_goaway(timeout=10)
    assert goaway is not None and goaway[0] == FRAME_SIZE_ERROR, goaway
    assert proxy.guard.h2_protocol_errors == 1
    await client.close()


async def test_twenty_connections_with_oversized_frames_hold_nothing(proxy: EdgeProxy) -> None:
    """Each of 20 connections, a stream open, declares a 16 MiB frame: each gets GOAWAY at
    the header, with nothing of the frame held (before, each held what it sent of it, and
    its GOAWAY came once 16 MiB had: ``bench/h2_frame_flood.py``)."""
    clients = [await H2Attacker.open(proxy.url) for _ in range(20)]
    for client in clients:
        stream_id = await open_stream(client)
        client.send(frame_header(2**24 - 1, DATA, 0, stream_id))
        await client.drain()
    for client in clients:
        goaway = await client.wait_goaway(timeout=10)
        assert goaway is not None and goaway[0] == FRAME_SIZE_ERROR, goaway
    assert sum(conn.input_held for conn in h2_connections(proxy)) == 0
    assert proxy.guard.h2_protocol_errors == 20
    for client in clients:
        await client.close()
    await eventually(lambda: proxy.guard.open == 0)


async def test_what_twenty_connections_may_hold_of_unfinished_frames_is_a_frame_each(
    proxy: EdgeProxy,
) -> None:
    """The most a connection can make the listener hold is one frame not yet whole."""
    clients = [await H2Attacker.open(proxy.url) for _ in range(20)]
    for client in clients:
        stream_id = await open_stream(client)
        client.send(frame_header(MAX_FRAME, DATA, 0, stream_id) + b"x" * (MAX_FRAME - 1))
        await client.drain()
    await eventually(lambda: sum(c.input_held for c in h2_connections(proxy)) >= 20 * MAX_FRAME)
    held = sum(conn.input_held for conn in h2_connections(proxy))
    assert held <= 20 * (MAX_FRAME + 9), held
    assert all(client.goaway is None for client in clients)
    for client in clients:
        await client.close()
    await eventually(lambda: proxy.guard.open == 0)


async def test_a_frame_left_unfinished_with_a_stream_open_is_bounded_in_time(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", model="m")
    proxy = await make_proxy([region], server=H2C, limits={"header_timeout": 0.5})
    client = await H2Attacker.open(proxy.url)
    await open_stream(client)
    client.send(frame_header(8, PING, 0, 0) + b"1234")  # half a PING, never the rest
    await client.drain()
    await asyncio.wait_for(client.closed.wait(), 20)
    assert proxy.guard.header_timeouts == 1
    await client.close()


async def test_bytes_trickling_in_cost_the_same_per_byte(
    proxy: EdgeProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request of three full DATA frames fed to the listener a byte at a time: every byte
    is framed once, not once per read as when the unfinished frame was copied each time."""
    framed = 0
    split = h2frames.split_frames

    def counting(buf: Any, *args: Any, **kwargs: Any) -> int:
        nonlocal framed
        framed += len(buf)
        return split(buf, *args, **kwargs)

    monkeypatch.setattr(h2frames, "split_frames", counting)
    client = await H2Attacker.open(proxy.url)
    await served(client)
    (conn,) = h2_connections(proxy)
    stream_id = client.stream()
    body = b"x" * (3 * MAX_FRAME)
    fields = [*request_fields(), ("content-length", str(len(body)))]
    wire = client.headers_frame(stream_id, fields)
    for start in range(0, len(body), MAX_FRAME):
        last = END_STREAM if start + MAX_FRAME >= len(body) else 0
        wire += frame(DATA, last, stream_id, body[start : start + MAX_FRAME])
    framed = 0
    for index in range(len(wire)):
        conn.data_received(wire[index : index + 1])
    total = len(wire)
    assert framed <= 2 * total, (framed, total)
    answer = await client.answer(stream_id)
    assert answer.status == 400 and answer.ended, answer  # not JSON: the proxy's own answer
    await client.close()
