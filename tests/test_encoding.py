"""Content codings toward the client: negotiation and compression, whole and streamed."""

from __future__ import annotations

import gzip
import zlib

import brotli
import pytest
import zstandard

from edgeproxy._protocol.encoding import (
    AVAILABLE,
    StreamCompressor,
    choose_encoding,
    compress,
    compressible_type,
)

BODY = b'{"choices": [{"message": {"content": "' + b"hello world " * 300 + b'"}}]}'


def decompress(data: bytes, encoding: str) -> bytes:
    if encoding == "zstd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    if encoding == "br":
        return bytes(brotli.decompress(data))
    return gzip.decompress(data)


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        (None, None),
        ("", None),
        ("identity", None),
        ("gzip", "gzip"),
        ("x-gzip", "gzip"),
        ("GZIP;Q=0.5", "gzip"),
        ("gzip, deflate, br", "br"),
        ("gzip, deflate, br, zstd", "zstd"),
        ("br;q=1.0, zstd;q=0.9", "br"),
        ("*", "zstd"),
        ("*;q=0, gzip", "gzip"),
        ("zstd;q=0, *", "br"),
        ("gzip;q=0", None),
        ("gzip;q=nonsense", None),
        ("gzip;q=2", None),
        (",,;q=1, br", "br"),
    ],
)
def test_the_clients_preference_then_ours(accept: str | None, chosen: str | None) -> None:
    assert choose_encoding(accept) == chosen


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("application/problem+json", True),
        ("text/plain", True),
        ("text/event-stream", True),
        ("image/png", False),
        ("application/octet-stream", False),
        (None, False),
    ],
)
def test_only_json_and_text_are_worth_compressing(content_type: str | None, expected: bool) -> None:
    assert compressible_type(content_type) is expected


@pytest.mark.parametrize("encoding", AVAILABLE)
def test_a_whole_body_round_trips_smaller(encoding: str) -> None:
    packed = compress(BODY, encoding)
    assert len(packed) < len(BODY) // 5
    assert decompress(packed, encoding) == BODY


@pytest.mark.parametrize("encoding", AVAILABLE)
def test_each_streamed_event_decodes_as_soon_as_it_is_sent(encoding: str) -> None:
    stream = StreamCompressor(encoding)
    if encoding == "zstd":
        decoder = zstandard.ZstdDecompressor().decompressobj()
        feed = decoder.decompress
    elif encoding == "br":
        decoder = brotli.Decompressor()
        feed = decoder.process
    else:
        decoder = zlib.decompressobj(31)
        feed = decoder.decompress
    seen = b""
    for index in range(20):
        event = b'data: {"index": %d}\n\n' % index
        seen += bytes(feed(stream.compress(event)))
        assert seen.endswith(event)
    seen += bytes(feed(stream.finish()))
    assert seen.count(b"data: ") == 20


def test_an_unknown_coding_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown content coding 'deflate'"):
        compress(BODY, "deflate")
    with pytest.raises(ValueError, match="unknown content coding 'lz4'"):
        StreamCompressor("lz4")
