"""The request head of an HTTP/2 stream, framed by edgeproxy instead of h2's frame objects."""

from __future__ import annotations

import hyperframe.frame

from edgeproxy._http2.frames import header_frames
from tests.test_h2pool import hypercorn_server, limits, open_pool


def _frames(data: bytes) -> list[hyperframe.frame.Frame]:
    frames = []
    while data:
        frame, length = hyperframe.frame.Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9 : 9 + length]))
        frames.append(frame)
        data = data[9 + length :]
    return frames


def test_one_frame_when_the_block_fits() -> None:
    frames = _frames(header_frames(7, b"abc", True, 16384))
    assert [type(f).__name__ for f in frames] == ["HeadersFrame"]
    assert frames[0].stream_id == 7
    assert frames[0].data == b"abc"
    assert frames[0].flags == {"END_HEADERS", "END_STREAM"}


def test_continuation_frames_past_the_frame_size() -> None:
    block = bytes(range(256)) * 10  # 2,560 bytes in frames of 1,000
    frames = _frames(header_frames(3, block, False, 1000))
    assert [type(f).__name__ for f in frames] == [
        "HeadersFrame",
        "ContinuationFrame",
        "ContinuationFrame",
    ]
    assert b"".join(f.data for f in frames) == block
    assert [set(f.flags) for f in frames] == [set(), set(), {"END_HEADERS"}]
    assert {f.stream_id for f in frames} == {3}


def test_exact_multiple_of_the_frame_size() -> None:
    frames = _frames(header_frames(5, b"x" * 2000, True, 1000))
    assert [set(f.flags) for f in frames] == [{"END_STREAM"}, {"END_HEADERS"}]


async def test_a_head_larger_than_a_frame_reaches_the_server() -> None:
    big = "v" * 40_000  # several CONTINUATION frames at the default 16 KiB frame size
    async with hypercorn_server() as (origin, state), open_pool(origin, limits()) as pool:
        for _ in range(2):  # the second time, HPACK's table holds the field
            resp = await pool.request("POST", "/echo", [("x-big", big)], b"body")
            data = b"".join([c async for c in resp.aiter_bytes()])
            await resp.aclose()
            assert (resp.status, data) == (200, b"body")
            assert (b"x-big", big.encode()) in state.last_headers
        resp = await pool.request("GET", "/hello", [("x-small", "1")])
        assert [c async for c in resp.aiter_bytes()] == [b"hello"]
        await resp.aclose()
        assert pool.stats().requests_total == 3
