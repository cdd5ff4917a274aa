"""The HTTP/2 listener's own framing against hostile clients (``H2Attacker``): a frame
declared longer than SETTINGS_MAX_FRAME_SIZE ends the connection as its header arrives,
what a connection may hold of a frame not yet whole is one frame, a frame left incomplete
is bounded in time with streams open, and bytes trickling in cost the same per byte.

Then the protocol details: HEAD gets no DATA,
the header-list size advertised is the one enforced (a stream's 431 where it can be),
SETTINGS entries count against the control budget, a bad ``HTTP2-Settings`` gets 400
before any 101, and a stream that depends on itself is that stream's error."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from typing import Any

import pytest

from edgeproxy import EdgeProxy
from edgeproxy._http2 import frames as http2_frames
from edgeproxy._server.h2server import H2Connection
from edgeproxy.testing import H2Attacker
from edgeproxy.testing._h2attack import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PING,
    frame,
    priority_frame,
    request_fields,
    settings_frame,
)

from .conftest import ProxyFactory, RegionFactory, eventually

H2C = {"http2": True, "h2c": True}
CHAT = "/v1/chat/completions"
GOOD = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
PROTOCOL_ERROR, FRAME_SIZE_ERROR, CALM = 0x1, 0x6, 0xB
MAX_FRAME = 16384
MAX_HEADER_LIST_SIZE = 0x6
PRIORITY_FLAG = 0x20


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
    split = http2_frames.split_frames

    def counting(buf: Any, *args: Any, **kwargs: Any) -> int:
        nonlocal framed
        framed += len(buf)
        return split(buf, *args, **kwargs)

    monkeypatch.setattr(http2_frames, "split_frames", counting)
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


# -- item 6: HEAD ---------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/nope"])
async def test_the_proxys_own_answer_to_head_has_no_data_frames(
    make_region: RegionFactory, make_proxy: ProxyFactory, path: str
) -> None:
    """With the models listed, the proxy answers ``/v1/models`` itself (a list, or a 404)."""
    region = await make_region("ap-1", model="m")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url, "models": ["m"]}], server=H2C)
    client = await H2Attacker.open(proxy.url)
    fields = [(":method", "HEAD"), (":path", path), *models_fields()[2:]]
    head, frames = client.request(fields)
    client.send(frames)
    answer = await client.answer(head)
    assert answer.status in (200, 404) and answer.ended and answer.reset is None, answer
    assert answer.data_frames == 0 and not answer.body, answer
    await served(client)  # the connection goes on
    assert client.goaway is None
    await client.close()


# -- item 6: the header list --------------------------------------------------------------


async def test_the_header_list_size_advertised_is_the_one_enforced(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    """The default limits (100 fields of 8190 bytes) advertise 819,000 bytes: a 68 KB block
    of ten fields, as HTTP/1.1 takes it, is served (by the proxy itself: the models are
    listed, and no region sees the block)."""
    region = await make_region("ap-1", model="m")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url, "models": ["m"]}], server=H2C)
    client = await H2Attacker.open(proxy.url)
    await served(client)
    limits = proxy.guard.limits
    assert client.settings[MAX_HEADER_LIST_SIZE] == limits.max_headers * limits.max_header_size
    fields = [*models_fields(), *((f"x-big-{i}", "v" * 6800) for i in range(10))]
    stream_id, frames = client.request(fields)
    client.send(frames)
    answer = await client.answer(stream_id)
    assert answer.status == 200 and answer.ended, answer
    assert client.goaway is None
    await client.close()


@pytest.fixture
async def small_heads(make_region: RegionFactory, make_proxy: ProxyFactory) -> EdgeProxy:
    region = await make_region("ap-1", model="m")
    # 8 fields of at most 1,024 bytes: SETTINGS_MAX_HEADER_LIST_SIZE 8,192.
    return await make_proxy(
        [region], server=H2C, limits={"max_headers": 8, "max_header_size": 1024}
    )


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([("x-long", "v" * 2000)], id="a field past max_header_size"),
        pytest.param([(f"x-{i}", "v") for i in range(10)], id="more fields than max_headers"),
        pytest.param([(f"x-{i}", "v" * 1020) for i in range(8)], id="a list past the size"),
    ],
)
async def test_a_header_block_over_the_limits_gets_431_on_its_stream_alone(
    small_heads: EdgeProxy, extra: list[tuple[str, str]]
) -> None:
    client = await H2Attacker.open(small_heads.url)
    stream_id, frames = client.request([*models_fields(), *extra])
    client.send(frames)
    answer = await client.answer(stream_id)
    assert answer.status == 431 and answer.ended, answer
    await served(client)
    assert client.goaway is None
    assert small_heads.guard.h2_protocol_errors == 0
    await client.close()


async def test_a_header_block_far_past_the_size_ends_the_connection(
    small_heads: EdgeProxy,
) -> None:
    """Over twice the advertised size, the decoder stops: an HPACK bomb costs no more."""
    client = await H2Attacker.open(small_heads.url)
    stream_id = client.stream()
    block = client.encoder.encode([*models_fields(), *((f"x-{i}", "v" * 1000) for i in range(20))])
    client.send(
        frame(HEADERS, END_STREAM, stream_id, block[: MAX_FRAME // 2])
        + frame(CONTINUATION, END_HEADERS, stream_id, block[MAX_FRAME // 2 :])
    )
    goaway = await client.wait_goaway(timeout=10)
    assert goaway is not None and goaway[0] != 0, goaway
    await client.close()


# -- item 6: SETTINGS entries ---------------------------------------------------------------


async def test_settings_frames_count_their_entries_against_the_control_budget(
    proxy: EdgeProxy,
) -> None:
    """A SETTINGS frame of 2,730 entries costs as much as 2,730 frames of one."""
    client = await H2Attacker.open(proxy.url)
    await served(client)
    big = settings_frame([(0x3, 100)] * (MAX_FRAME // 6))
    for _ in range(3):
        client.send(big)
        await client.drain()
    goaway = await client.wait_goaway(timeout=10)
    assert goaway is not None and goaway[0] == CALM, goaway
    assert proxy.guard.h2_control_floods == 1
    await client.close()


# -- item 6: the h2c upgrade -------------------------------------------------------------


def _settings(*entries: tuple[int, int]) -> bytes:
    raw = b"".join(struct.pack(">HL", code, value) for code, value in entries)
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(_settings((0x4, 2**31)), id="window past 2^31-1"),
        pytest.param(_settings((0x2, 2)), id="enable_push 2"),
        pytest.param(_settings((0x5, 100)), id="max_frame_size under 16384"),
        pytest.param(b"AAMAAABk*", id="not base64url"),
        pytest.param(base64.urlsafe_b64encode(b"\x00\x03\x00"), id="not whole entries"),
    ],
)
async def test_an_upgrade_with_bad_http2_settings_gets_400_and_no_101(
    proxy: EdgeProxy, settings: bytes
) -> None:
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
        b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: " + settings + b"\r\n\r\n"
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    assert head.startswith(b"HTTP/1.1 400 "), head
    rest = await asyncio.wait_for(reader.read(), 20)  # then the connection closes
    assert b"101" not in rest.split(b"\r\n", 1)[0]
    writer.close()


# -- item 6: a stream that depends on itself ------------------------------------------------


async def test_a_priority_frame_making_an_open_stream_depend_on_itself_resets_it(
    proxy: EdgeProxy,
) -> None:
    client = await H2Attacker.open(proxy.url)
    stream_id = await open_stream(client)
    client.send(priority_frame(stream_id, stream_id))
    answer = await client.answer(stream_id)
    assert answer.reset == PROTOCOL_ERROR, answer
    await served(client)
    assert client.goaway is None
    await client.close()


async def test_a_priority_frame_making_an_idle_stream_depend_on_itself_resets_it(
    proxy: EdgeProxy,
) -> None:
    client = await H2Attacker.open(proxy.url)
    idle = client.stream()
    client.send(priority_frame(idle, idle))
    answer = await client.answer(idle)
    assert answer.reset == PROTOCOL_ERROR, answer
    await served(client)
    assert client.goaway is None
    await client.close()


async def test_headers_making_their_stream_depend_on_itself_reset_it(proxy: EdgeProxy) -> None:
    client = await H2Attacker.open(proxy.url)
    stream_id = client.stream()
    block = client.encoder.encode(models_fields())
    payload = struct.pack(">LB", stream_id, 15) + block
    client.send(frame(HEADERS, END_HEADERS | END_STREAM | PRIORITY_FLAG, stream_id, payload))
    answer = await client.answer(stream_id)
    assert answer.reset == PROTOCOL_ERROR, answer
    await served(client)
    assert client.goaway is None
    await client.close()
