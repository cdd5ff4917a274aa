"""The upstream HTTP/2 client's response frames taken without jh2's frame objects
(``Connection._fast_headers``, ``_fast_data``), and its request header blocks written with
the static HPACK table alone (:mod:`edgeproxy._http2.staticpack`).

A client :class:`~edgeproxy._upstream.h2conn.Connection` is fed raw frames written here by
hand (their header blocks encoded by one hpack encoder, whose dynamic table the client's
decoder must follow), and what it writes back is read as frames. Every rule that makes a
malformed response its stream's error is checked on the fast path, with jh2's
``receive_data`` made to fail so that the frame cannot have gone to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, cast

import hpack
import hyperframe.frame as hf
import pytest

from edgeproxy._http2 import fields as http2_fields
from edgeproxy._http2 import staticpack
from edgeproxy._http2.engine import HALF_CLOSED_LOCAL, STREAM_OPEN
from edgeproxy._upstream import h2conn, h2head
from edgeproxy._upstream.h2pool import H2Pool
from edgeproxy._upstream.pool import PoolLimits, UpstreamProtocolError

from ._h2stubs import StubPool, Wire

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PROTOCOL_ERROR = 0x1
STREAM_CLOSED = 0x5
COMPRESSION_OR_PROTOCOL = {0x1, 0x9}
ENHANCE_YOUR_CALM = 0xB
REQUEST = [(":method", "GET"), (":scheme", "http"), (":authority", "a"), (":path", "/")]


def frames_of(data: bytes) -> Iterator[Any]:
    pos = 0
    while pos < len(data):
        frame, length = hf.Frame.parse_frame_header(memoryview(data[pos : pos + 9]))
        frame.parse_body(memoryview(data[pos + 9 : pos + 9 + length]))
        pos += 9 + length
        yield frame


class Peer:
    """The server's end, by hand: its SETTINGS, and header blocks from one hpack encoder."""

    def __init__(self, conn: h2conn.Connection, wire: Wire) -> None:
        self.conn = conn
        self.wire = wire
        self.encoder = hpack.Encoder()

    def send(self, *frames: Any) -> None:
        self.conn.data_received(
            b"".join(f if isinstance(f, bytes) else f.serialize() for f in frames)
        )

    def headers(self, stream_id: int, fields: list[tuple[bytes, bytes]], *flags: str) -> Any:
        frame = hf.HeadersFrame(stream_id, flags=["END_HEADERS", *flags])
        frame.data = self.encoder.encode(fields)
        return frame

    def written(self) -> list[Any]:
        self.conn.flush()
        return list(frames_of(self.wire.take()))

    def open(self, fields: list[tuple[str, str]] | None = None, end: bool = True) -> int:
        stream = self.conn.open_stream(fields or REQUEST, end)
        assert stream is not None
        return stream.id


@pytest.fixture
async def peer() -> Peer:
    loop = asyncio.get_running_loop()
    conn = h2conn.Connection(cast(Any, StubPool()), loop)
    wire = Wire()
    conn.connection_made(cast(Any, wire))
    assert wire.take().startswith(PREFACE)
    server = Peer(conn, wire)
    server.send(hf.SettingsFrame(0), hf.SettingsFrame(0, flags=["ACK"]))
    assert conn.ready.done()
    wire.take()
    return server


@pytest.fixture
def no_engine(peer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any frame handed to jh2 fails the test: the fast paths must take them all."""

    def refuse(data: bytes) -> list[Any]:
        raise AssertionError(f"jh2 was handed {data!r}")

    monkeypatch.setattr(peer.conn.h2, "receive_data", refuse)


def resets(frames: list[Any]) -> dict[int, int]:
    return {f.stream_id: f.error_code for f in frames if isinstance(f, hf.RstStreamFrame)}


def goaway(frames: list[Any]) -> int | None:
    """The error code of the first GOAWAY (the one that names the error)."""
    codes = [f.error_code for f in frames if isinstance(f, hf.GoAwayFrame)]
    return codes[0] if codes else None


# -- well-formed responses: every frame on the fast paths -----------------------------


@pytest.mark.usefixtures("no_engine")
async def test_a_whole_response_passes_without_the_engine(peer: Peer) -> None:
    stream_id = peer.open()
    stream = peer.conn.streams[stream_id]
    body = hf.DataFrame(stream_id, data=b"hello", flags=["END_STREAM"])
    fields = [(b":status", b"200"), (b"content-type", b"text/plain"), (b"content-length", b"5")]
    peer.send(peer.headers(stream_id, fields), body)
    assert stream.status == 200
    assert stream.headers == [("content-type", "text/plain"), ("content-length", "5")]
    assert stream.remote_ended and stream.error is None
    assert await stream.read(1.0) == b"hello"
    h2stream = peer.conn.h2.streams[stream_id]
    assert h2stream.state_machine.headers_received and h2stream.closed
    assert peer.conn.h2.open_outbound_streams == 0


@pytest.mark.usefixtures("no_engine")
async def test_headers_that_end_the_stream_close_it_in_h2_too(peer: Peer) -> None:
    stream_id = peer.open()
    peer.send(peer.headers(stream_id, [(b":status", b"204")], "END_STREAM"))
    stream = peer.conn.streams.get(stream_id)
    assert stream is None  # the request had ended, the response too: released
    assert peer.conn.h2.streams[stream_id].closed
    assert not resets(peer.written())


@pytest.mark.usefixtures("no_engine")
async def test_padding_and_priority_are_taken_off(peer: Peer) -> None:
    stream_id = peer.open()
    frame = peer.headers(stream_id, [(b":status", b"200"), (b"x-a", b"1")], "PADDED", "PRIORITY")
    frame.pad_length = 7
    frame.depends_on = 0
    frame.stream_weight = 15
    peer.send(frame, hf.DataFrame(stream_id, data=b"", flags=["END_STREAM"]))
    stream = peer.conn.streams.get(stream_id)
    assert stream is None or stream.error is None
    assert not resets(peer.written())


@pytest.mark.usefixtures("no_engine")
async def test_informational_responses_and_trailers_pass(peer: Peer) -> None:
    stream_id = peer.open()
    stream = peer.conn.streams[stream_id]
    peer.send(peer.headers(stream_id, [(b":status", b"103"), (b"link", b"</a>")]))
    assert stream.status == 0
    peer.send(
        peer.headers(stream_id, [(b":status", b"200")]),
        hf.DataFrame(stream_id, data=b"abc"),
        peer.headers(stream_id, [(b"x-checksum", b"1")], "END_STREAM"),
    )
    assert stream.status == 200 and stream.remote_ended and stream.error is None
    assert peer.conn.h2.streams[stream_id].state_machine.trailers_received
    assert await stream.read(1.0) == b"abc"
    assert await stream.read(1.0) is None


async def test_the_decoder_follows_the_dynamic_table_across_both_paths(peer: Peer) -> None:
    # Blocks that index fields (the encoder's default): decoded on the fast path, by jh2
    # (the response of a stream we reset) and gathered from CONTINUATION frames. Each
    # later block refers to entries the earlier ones added, whichever path decoded them.
    ids = [peer.open() for _ in range(4)]
    peer.conn.streams[ids[1]].close()
    peer.written()
    for n, stream_id in enumerate(ids):
        fields = [(b":status", b"200"), (b"x-region", b"eu-west"), (b"x-n", str(n).encode())]
        if n == 2:
            block = peer.encoder.encode(fields)
            first = hf.HeadersFrame(stream_id, data=block[:3])
            rest = hf.ContinuationFrame(stream_id, data=block[3:], flags=["END_HEADERS"])
            peer.send(first, rest)
        else:
            peer.send(peer.headers(stream_id, fields))
    for n, stream_id in enumerate(ids):
        if n != 1:
            headers = peer.conn.streams[stream_id].headers
            assert headers == [("x-region", "eu-west"), ("x-n", str(n))]
    assert not peer.conn.closing
    assert resets(peer.written()) == {ids[1]: STREAM_CLOSED}


# -- header blocks in CONTINUATION frames ------------------------------------------------


def split_block(
    peer: Peer, stream_id: int, fields: list[tuple[bytes, bytes]], *flags: str
) -> list[Any]:
    """A HEADERS frame (with ``flags``) and CONTINUATION frames of 5 bytes each."""
    block = peer.encoder.encode(fields)
    first = hf.HeadersFrame(stream_id, data=block[:5], flags=list(flags))
    rest = [hf.ContinuationFrame(stream_id, data=block[i : i + 5]) for i in range(5, len(block), 5)]
    rest[-1].flags.add("END_HEADERS")
    return [first, *rest]


@pytest.mark.usefixtures("no_engine")
@pytest.mark.parametrize("split", [1, 7, 4096])
async def test_a_block_in_continuation_frames_passes_without_the_engine(
    peer: Peer, split: int
) -> None:
    stream_id = peer.open()
    stream = peer.conn.streams[stream_id]
    fields = [(b":status", b"200"), (b"content-type", b"text/plain"), (b"x-long", b"v" * 40)]
    frames = split_block(peer, stream_id, fields, "PADDED", "PRIORITY")
    frames[0].pad_length = 2
    frames[0].depends_on = 0
    raw = b"".join(f.serialize() for f in frames)
    raw += hf.DataFrame(stream_id, data=b"ok", flags=["END_STREAM"]).serialize()
    for start in range(0, len(raw), split):
        peer.conn.data_received(raw[start : start + split])
    assert stream.status == 200 and stream.remote_ended and stream.error is None
    assert stream.headers[-1] == ("x-long", "v" * 40)
    assert await stream.read(1.0) == b"ok"
    # The next block refers to what this one added to the table.
    other = peer.open()
    peer.send(peer.headers(other, fields, "END_STREAM"))
    assert other not in peer.conn.streams and not peer.conn.closing


@pytest.mark.usefixtures("no_engine")
async def test_a_block_in_continuation_frames_may_end_the_stream(peer: Peer) -> None:
    stream_id = peer.open()
    stream = peer.conn.streams[stream_id]
    peer.send(
        *split_block(peer, stream_id, [(b":status", b"204"), (b"x-a", b"1" * 9)], "END_STREAM")
    )
    assert stream.status == 204 and stream.remote_ended and stream.released


INTERLOPERS = {
    "ping": lambda stream_id: hf.PingFrame(0, opaque_data=b"12345678"),
    "data": lambda stream_id: hf.DataFrame(stream_id, data=b"x"),
    "headers": lambda stream_id: hf.HeadersFrame(
        stream_id + 2, data=b"\x88", flags=["END_HEADERS"]
    ),
    "continuation-elsewhere": lambda stream_id: hf.ContinuationFrame(
        stream_id + 2, data=b"\x88", flags=["END_HEADERS"]
    ),
}


@pytest.mark.parametrize("name", sorted(INTERLOPERS))
async def test_any_other_frame_inside_a_block_is_a_connection_error(peer: Peer, name: str) -> None:
    stream_id = peer.open()
    peer.open()
    stream = peer.conn.streams[stream_id]
    frames = split_block(peer, stream_id, [(b":status", b"200"), (b"x-a", b"1" * 9)])
    peer.send(frames[0], INTERLOPERS[name](stream_id), *frames[1:])
    assert peer.conn.closing
    assert stream.error is not None and "protocol error" in str(stream.error)
    assert goaway(list(frames_of(bytes(peer.wire.out)))) == PROTOCOL_ERROR


async def test_a_block_of_too_many_or_too_large_frames_is_a_connection_error(
    peer: Peer,
) -> None:
    stream_id = peer.open()
    fields = [(b":status", b"200"), (b"x-a", b"1" * 400)]
    block = peer.encoder.encode(fields)
    frames = [hf.HeadersFrame(stream_id, data=block[:1])]
    frames += [hf.ContinuationFrame(stream_id, data=block[i : i + 1]) for i in range(1, 70)]
    peer.send(*frames)
    assert peer.conn.closing
    assert goaway(list(frames_of(bytes(peer.wire.out)))) == PROTOCOL_ERROR


async def test_a_continuation_past_the_frame_size_is_a_frame_size_error(peer: Peer) -> None:
    stream_id = peer.open()
    frames = split_block(peer, stream_id, [(b":status", b"200"), (b"x-a", b"1" * 9)])
    frames[-1].data += b"\x00" * 16384  # the frame's length is declared, and too long
    peer.send(*frames)
    assert peer.conn.closing
    assert goaway(list(frames_of(bytes(peer.wire.out)))) == 0x6


async def test_a_block_of_a_stream_let_go_meanwhile_goes_to_the_engine(peer: Peer) -> None:
    stream_id = peer.open()
    other = peer.open()
    fields = [(b":status", b"200"), (b"x-shared", b"entry" * 3)]
    frames = split_block(peer, stream_id, fields)
    peer.send(frames[0])
    peer.conn.streams[stream_id].close()  # a timeout, say, before the block ended
    peer.send(*frames[1:])
    assert not peer.conn.closing
    peer.send(peer.headers(other, fields))
    assert peer.conn.streams[other].headers == [("x-shared", "entry" * 3)]
    assert resets(peer.written()) == {stream_id: STREAM_CLOSED}


# -- malformed responses: a stream error each -----------------------------------------

MALFORMED: dict[str, tuple[list[list[tuple[bytes, bytes]]], str]] = {
    # Blocks sent in turn (the last ends the stream, but in NOT_ENDED), and what the
    # error names.
    "informational-end-stream": ([[(b":status", b"100")]], "informational"),
    "status-101": ([[(b":status", b"101")]], "101"),
    "no-status": ([[(b"x-a", b"1")]], "no :status"),
    "status-not-digits": ([[(b":status", b"2x0")]], "invalid :status"),
    "unknown-pseudo": ([[(b":status", b"200"), (b":path", b"/")]], "pseudo-header"),
    "pseudo-after-regular": ([[(b"x-a", b"1"), (b":status", b"200")]], "after a regular"),
    "two-statuses": ([[(b":status", b"200"), (b":status", b"200")]], "more than one"),
    "uppercase-name": ([[(b":status", b"200"), (b"X-Upper", b"1")]], "invalid field name"),
    "bad-value": ([[(b":status", b"200"), (b"x-a", b"a\nb")]], "invalid value"),
    "connection-specific": ([[(b":status", b"200"), (b"connection", b"close")]], "connection"),
    "te-not-trailers": ([[(b":status", b"200"), (b"te", b"gzip")]], "connection-specific"),
    "content-length-invalid": ([[(b":status", b"200"), (b"content-length", b"x")]], "content"),
    "content-length-conflict": (
        [[(b":status", b"200"), (b"content-length", b"1"), (b"content-length", b"2")]],
        "conflicting",
    ),
    "content-length-on-end-stream": (
        [[(b":status", b"200"), (b"content-length", b"3")]],
        "0 bytes of DATA for a content-length of 3",
    ),
    "interim-after-final": ([[(b":status", b"200")], [(b":status", b"100")]], "after the final"),
    "pseudo-in-trailers": ([[(b":status", b"200")], [(b":status", b"200")]], "in trailers"),
    "bad-trailer-name": ([[(b":status", b"200")], [(b"Bad", b"1")]], "invalid field name"),
    "trailers-without-end-stream": ([[(b":status", b"200")], [(b"x-t", b"1")]], "did not end"),
}
# Not ended: a 1xx with END_STREAM is malformed for that alone (101 is a 1xx to jh2 too).
NOT_ENDED = frozenset({"interim-after-final", "trailers-without-end-stream", "status-101"})


@pytest.mark.usefixtures("no_engine")
@pytest.mark.parametrize("name", sorted(MALFORMED))
async def test_a_malformed_response_is_its_streams_error(peer: Peer, name: str) -> None:
    blocks, reason = MALFORMED[name]
    neighbour = peer.open()
    # The request is not ended, so that the stream is still there to reset.
    stream_id = peer.open(end=False)
    stream = peer.conn.streams[stream_id]
    for n, block in enumerate(blocks):
        last = n == len(blocks) - 1 and name not in NOT_ENDED
        peer.send(peer.headers(stream_id, block, *(["END_STREAM"] if last else [])))
    assert stream.error is not None
    assert "malformed" in str(stream.error) and reason in str(stream.error)
    with pytest.raises(UpstreamProtocolError, match="malformed"):
        await stream.wait_headers(1.0)
        await stream.read(1.0)  # trailers: the head had come
    written = peer.written()
    assert resets(written) == {stream_id: PROTOCOL_ERROR}
    # The connection and the stream beside it carry on.
    assert not peer.conn.closing and goaway(written) is None
    peer.send(peer.headers(neighbour, [(b":status", b"200")], "END_STREAM"))
    assert neighbour not in peer.conn.streams
    assert not peer.conn.streams


@pytest.mark.usefixtures("no_engine")
async def test_a_malformed_response_that_ended_a_finished_exchange_has_nothing_to_reset(
    peer: Peer,
) -> None:
    stream_id = peer.open()
    stream = peer.conn.streams[stream_id]
    peer.send(peer.headers(stream_id, [(b":status", b"200"), (b"Bad", b"1")], "END_STREAM"))
    assert stream.error is not None and "invalid field name" in str(stream.error)
    assert not resets(peer.written())
    assert peer.conn.h2.streams[stream_id].closed


@pytest.mark.usefixtures("no_engine")
async def test_data_past_the_content_length_of_fast_headers_is_a_stream_error(
    peer: Peer,
) -> None:
    stream_id = peer.open()
    stream = peer.conn.streams[stream_id]
    peer.send(
        peer.headers(stream_id, [(b":status", b"200"), (b"content-length", b"2")]),
        hf.DataFrame(stream_id, data=b"abc", flags=["END_STREAM"]),
    )
    assert stream.error is not None and "more DATA than its content-length" in str(stream.error)
    assert resets(peer.written()) == {stream_id: PROTOCOL_ERROR}


async def test_head_and_304_responses_expect_no_content(peer: Peer) -> None:
    stream_id = peer.open([(":method", "HEAD"), *REQUEST[1:]])
    stream = peer.conn.streams[stream_id]
    peer.send(peer.headers(stream_id, [(b":status", b"200"), (b"content-length", b"10")]))
    assert stream.expected_length == 0
    peer.send(hf.DataFrame(stream_id, data=b"", flags=["END_STREAM"]))
    assert stream.error is None and stream.remote_ended


# -- what only the engine may decide: left to it ---------------------------------------


async def test_padding_longer_than_the_frame_is_a_connection_error(peer: Peer) -> None:
    stream_id = peer.open()
    frame = peer.headers(stream_id, [(b":status", b"200")], "PADDED")
    raw = bytearray(frame.serialize())
    raw[9] = 250  # the padding's length, past the frame's end
    peer.send(bytes(raw))
    assert peer.conn.closing
    assert goaway(list(frames_of(bytes(peer.wire.out)))) == PROTOCOL_ERROR


async def test_a_stream_that_depends_on_itself_is_a_connection_error(peer: Peer) -> None:
    stream_id = peer.open()
    frame = peer.headers(stream_id, [(b":status", b"200")], "PRIORITY")
    frame.depends_on = stream_id
    peer.send(frame)
    assert peer.conn.closing
    assert goaway(list(frames_of(bytes(peer.wire.out)))) == PROTOCOL_ERROR


async def test_a_header_block_hpack_cannot_decode_ends_the_connection(peer: Peer) -> None:
    stream_id = peer.open()
    stream = peer.conn.streams[stream_id]
    frame = hf.HeadersFrame(stream_id, flags=["END_HEADERS"])
    frame.data = b"\xff\x80\x80\x80\x80"  # an index far past both tables
    peer.send(frame)
    assert peer.conn.closing
    assert stream.error is not None and "protocol error" in str(stream.error)
    assert goaway(list(frames_of(bytes(peer.wire.out)))) in COMPRESSION_OR_PROTOCOL


async def test_an_oversized_header_list_ends_the_connection_calmly(peer: Peer) -> None:
    stream_id = peer.open()
    big = [(b":status", b"200")] + [(f"x-{n}".encode(), b"v" * 1000) for n in range(80)]
    frame = hf.HeadersFrame(stream_id, flags=["END_HEADERS"])
    frame.data = peer.encoder.encode(big)
    # Past our SETTINGS_MAX_HEADER_LIST_SIZE, in frames too large: sent as one anyway.
    peer.conn.h2.max_inbound_frame_size = len(frame.data)
    peer.send(frame)
    assert peer.conn.closing
    assert goaway(list(frames_of(bytes(peer.wire.out)))) == ENHANCE_YOUR_CALM


async def test_headers_on_a_stream_we_reset_go_to_the_engine(peer: Peer) -> None:
    stream_id = peer.open()
    other = peer.open()
    peer.conn.streams[stream_id].close()
    peer.written()
    # Decoded by jh2 all the same: the table it adds to is the next block's.
    fields = [(b":status", b"200"), (b"x-shared", b"table entry")]
    peer.send(peer.headers(stream_id, fields))
    peer.send(peer.headers(other, fields, "END_STREAM"))
    assert not peer.conn.closing
    assert other not in peer.conn.streams
    assert resets(peer.written()) == {stream_id: STREAM_CLOSED}


# -- request header blocks: the static table alone -------------------------------------


def test_a_request_block_decodes_to_its_fields() -> None:
    fields = [
        (":method", "POST"),
        (":scheme", "https"),
        (":authority", "api.example"),
        (":path", "/v1/chat/completions"),
        ("content-type", "application/json"),
        ("user-agent", "x" * 300),  # a length past the 7-bit prefix
        ("x-custom-header", "é"),
        ("accept-encoding", "gzip, deflate"),
        ("authorization", "Bearer secret"),
    ]
    sensitive = hpack.NeverIndexedHeaderTuple("authorization", "Bearer secret")
    block = staticpack.encode_block([*fields[:-1], cast(tuple[str, str], sensitive)])
    decoder = hpack.Decoder()
    decoded = decoder.decode(block)
    assert decoded == fields
    assert isinstance(decoded[-1], hpack.NeverIndexedHeaderTuple)
    assert not isinstance(decoded[0], hpack.NeverIndexedHeaderTuple)
    # Nothing was added to the decoder's dynamic table.
    assert len(decoder.header_table.dynamic_entries) == 0
    # Whole static entries are one byte each: :method POST, :scheme https, accept-encoding.
    assert block[:2] == b"\x83\x87"
    assert staticpack.encode_field(b"accept-encoding", b"gzip, deflate") == b"\x90"
    # The same fields again give the same bytes (from the kept encodings).
    again = staticpack.encode_block(fields[:-1])
    assert block.startswith(again) and again == staticpack.encode_block(fields[:-1])


def test_sensitive_fields_are_never_kept() -> None:
    secret = cast(tuple[str, str], hpack.NeverIndexedHeaderTuple("authorization", "Bearer k1"))
    staticpack.encode_block([secret])
    assert ("authorization", "Bearer k1") not in staticpack._ENCODED


def test_names_past_the_4_bit_prefix_are_encoded_right() -> None:
    for index, (name, _) in enumerate(staticpack._STATIC, 1):
        block = staticpack.encode_field(name, b"some value")
        assert hpack.Decoder().decode(block, raw=True) == [(name, b"some value")], index


async def test_a_smaller_header_table_is_acknowledged_in_the_next_block(peer: Peer) -> None:
    settings = hf.SettingsFrame(0)
    settings.settings = {hf.SettingsFrame.HEADER_TABLE_SIZE: 0}
    peer.send(settings)
    peer.written()
    decoder = hpack.Decoder()
    decoder.max_allowed_table_size = 0
    blocks = []
    for _ in range(2):
        peer.open()
        headers = [f for f in peer.written() if isinstance(f, hf.HeadersFrame)]
        blocks.append(headers[0].data)
    assert blocks[0][:1] == staticpack.TABLE_SIZE_ZERO
    assert blocks[1][:1] != staticpack.TABLE_SIZE_ZERO  # once is enough
    for block in blocks:
        assert decoder.decode(block) == REQUEST


# -- the request's own frames, and windows handed back ----------------------------------


async def test_a_request_moves_h2s_stream_as_send_headers_and_send_data_would(
    peer: Peer,
) -> None:
    whole = peer.open()
    machine = peer.conn.h2.streams[whole].state_machine
    assert machine.state is HALF_CLOSED_LOCAL
    assert machine.client and machine.headers_sent
    streamed = peer.open(end=False)
    h2stream = peer.conn.h2.streams[streamed]
    assert h2stream.state_machine.state is STREAM_OPEN
    window = peer.conn.h2.outbound_flow_control_window
    peer.conn.send_data(streamed, memoryview(b"abc"), False)
    peer.conn.send_data(streamed, memoryview(b"de"), True)
    assert h2stream.state_machine.state is HALF_CLOSED_LOCAL
    assert peer.conn.h2.outbound_flow_control_window == window - 5
    assert h2stream.outbound_flow_control_window == 65535 - 5
    frames = peer.written()
    data = [f for f in frames if isinstance(f, hf.DataFrame)]
    assert [(f.stream_id, f.data, "END_STREAM" in f.flags) for f in data] == [
        (streamed, b"abc", False),
        (streamed, b"de", True),
    ]
    heads = [f for f in frames if isinstance(f, hf.HeadersFrame)]
    assert [("END_STREAM" in f.flags) for f in heads] == [True, False]
    # Past the end, h2 itself refuses, as it would have.
    with pytest.raises(Exception, match="(?i)closed|invalid input"):
        peer.conn.send_data(streamed, memoryview(b"f"), True)


async def test_bytes_of_ended_streams_open_the_connection_window_as_h2_would(
    peer: Peer,
) -> None:
    # Responses read after they ended: their streams are closed, so only the
    # connection's window takes the bytes back, and updates once half of it is used.
    chunk = b"x" * 16384
    per_response = h2conn._STREAM_WINDOW
    window = peer.conn.h2._inbound_flow_control_window_manager
    for n in range(8):
        stream_id = peer.open()
        stream = peer.conn.streams[stream_id]
        frames: list[Any] = [peer.headers(stream_id, [(b":status", b"200")])]
        frames += [hf.DataFrame(stream_id, data=chunk) for _ in range(per_response // 16384 - 1)]
        frames.append(hf.DataFrame(stream_id, data=chunk, flags=["END_STREAM"]))
        peer.send(*frames)
        assert peer.conn.h2.streams[stream_id].closed
        assert len(await stream.read(1.0) or b"") == per_response
        updates = [f for f in peer.written() if isinstance(f, hf.WindowUpdateFrame)]
        if n < 7:
            assert not updates
            assert window._bytes_processed == (n + 1) * per_response
        else:
            assert [(f.stream_id, f.window_increment) for f in updates] == [(0, 8 * per_response)]
            assert window._bytes_processed == 0


# -- a final response's head, the short way ---------------------------------------------

HEAD_BLOCKS = [
    [(b":status", b"200")],
    [(b":status", b"200"), (b"server", b"nginx"), (b"content-length", b"12")],
    [(b":status", b"204"), (b"content-length", b"0"), (b"content-length", b"0")],
    [(b":status", b"599"), (b"x-empty", b""), (b"te", b"trailers"), (b"x-utf8", "é".encode())],
    [(b":status", b"200"), (b"content-length", b"1"), (b"content-length", b"2")],
    [(b":status", b"200"), (b"content-length", b"-1")],
    [(b":status", b"200"), (b"content-length", b"")],
    [(b":status", b"103")],
    [(b":status", b"101")],
    [(b":status", b"2000")],
    [(b":status", b"099")],
    [(b":status", b"20x")],
    [(b"server", b"x"), (b":status", b"200")],
    [(b":status", b"200"), (b":status", b"200")],
    [(b":status", b"200"), (b":path", b"/")],
    [(b":status", b"200"), (b"Server", b"x")],
    [(b":status", b"200"), (b"x-a", b" padded")],
    [(b":status", b"200"), (b"connection", b"close")],
    [(b":status", b"200"), (b"te", b"gzip")],
    [(b"x-a", b"1")],
    [],
]


@pytest.mark.parametrize("block", HEAD_BLOCKS, ids=range(len(HEAD_BLOCKS)))
def test_the_short_way_gives_what_parse_fields_gives_or_leaves_it_to_it(
    block: list[tuple[bytes, bytes]],
) -> None:
    decoded = [(name, value, False) for name, value in block]
    try:
        expected: Any = http2_fields.parse_fields(block, trailers=False)
    except http2_fields.Malformed:
        expected = None
    for _ in range(2):  # the second time from the kept fields
        head = h2head.final_head(decoded)
        if head is not None:
            assert head == expected
        elif expected is not None:
            # Left to parse_fields: of the well-formed blocks, only 1xx ones.
            assert expected[0] < 200


def test_only_fields_not_marked_never_indexed_are_kept() -> None:
    h2head._CHECKED.clear()
    decoded = [
        (b":status", b"200"),
        (b"set-cookie", b"session=1"),
        (b"x-kept", b"1"),
        (b"content-length", b"3"),
    ]
    marked = [(n, v, n == b"set-cookie") for n, v in decoded]
    head = h2head.final_head(marked)
    assert head == (200, [("set-cookie", "session=1"), ("x-kept", "1"), ("content-length", "3")], 3)
    assert set(h2head._CHECKED) == {(b"x-kept", b"1", False)}


def test_a_requests_fields_are_sorted_by_name_as_http2_asks() -> None:
    pool = H2Pool("http://region.example:8080", PoolLimits())
    headers = [
        ("Host", "other.example"),
        ("Connection", "keep-alive"),
        ("TE", "Trailers"),
        ("Transfer-Encoding", "chunked"),
        (":path", "/smuggled"),
        ("Authorization", "Bearer k"),
        ("X-Request-Id", "r1"),
        ("Content-Type", "application/json"),
    ]
    for _ in range(2):  # the second time from the kept names
        block = pool._header_block("POST", "/v1/x", headers, b"{}", None)
        assert block == [
            (":method", "POST"),
            (":scheme", "http"),
            (":authority", "other.example"),
            (":path", "/v1/x"),
            ("te", "trailers"),
            ("authorization", "Bearer k"),
            ("x-request-id", "r1"),
            ("content-type", "application/json"),
            ("content-length", "2"),
        ]
        marked = [type(f) is staticpack.NeverIndexed for f in block]
        assert marked == [False] * 5 + [True, True, False, False]
    given = [("Content-Length", "2")]
    assert pool._header_block("POST", "/", given, b"{}", "a")[-1] == ("content-length", "2")


async def test_a_new_request_stream_is_the_one_jh2_would_begin(peer: Peer) -> None:
    from edgeproxy._upstream import h2send

    engine = peer.conn.h2
    ours = h2send.new_request_stream(engine, 1)
    assert engine.highest_outbound_stream_id == 1 and engine.streams[1] is ours
    theirs = engine._begin_new_stream(3, h2conn.h2.connection.AllowedStreamIDs.ODD)
    for name in ("max_inbound_frame_size", "max_outbound_frame_size", "config"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert type(ours) is type(theirs)
    assert ours.outbound_flow_control_window == theirs.outbound_flow_control_window
    assert vars(ours._inbound_window_manager) == vars(theirs._inbound_window_manager)
    assert ours.state_machine.state is theirs.state_machine.state
    # An id jh2 would refuse goes to jh2, which refuses it.
    with pytest.raises(h2conn.h2.exceptions.StreamIDTooLowError):
        h2send.new_request_stream(engine, 1)
