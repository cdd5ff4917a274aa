"""Content codings toward the client: choosing one from Accept-Encoding, and compressing.

zstd (``zstandard``), brotli (``brotli``) and gzip. A whole body is compressed in one
call; a stream (SSE) through a :class:`StreamCompressor`, which flushes after every chunk
so that each event leaves at once, decodable by the client as it arrives.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from typing import Final, Protocol

import brotli
import zstandard

__all__ = [
    "AVAILABLE",
    "StreamCompressor",
    "choose_encoding",
    "compress",
    "compressible_type",
]

#: The codings this process can produce, in the order it prefers them.
AVAILABLE: Final[tuple[str, ...]] = ("zstd", "br", "gzip")

# Levels that favour speed: a proxy compresses every answer it sends, on its one core.
_ZSTD_LEVEL: Final = 3
_BROTLI_QUALITY: Final = 4
_GZIP_LEVEL: Final = 6

_COMPRESSIBLE: Final = ("application/json", "text/", "application/javascript", "+json")


def compressible_type(content_type: str | None) -> bool:
    """Whether a body of this Content-Type is worth compressing (JSON and text)."""
    if not content_type:
        return False
    value = content_type.split(";", 1)[0].strip().lower()
    return value.startswith(_COMPRESSIBLE[1]) or any(
        value == kind or value.endswith(kind) for kind in _COMPRESSIBLE if kind != "text/"
    )


def choose_encoding(accept: str | None, offered: Iterable[str] = AVAILABLE) -> str | None:
    """The coding to answer with for an ``Accept-Encoding`` value, None for identity.

    Among ``offered`` (in the server's order of preference), the client's highest q-value
    wins; ``*`` stands for every coding the client did not name; ``q=0`` refuses one.
    """
    if not accept:
        return None
    weights: dict[str, float] = {}
    for item in accept.split(","):
        name, _, params = item.strip().partition(";")
        name = name.strip().lower()
        if not name:
            continue
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
                if not 0.0 <= q <= 1.0:
                    q = 0.0
        weights[name] = q
    best: str | None = None
    best_q = 0.0
    wildcard = weights.get("*")
    for name in offered:
        q = weights.get(name, wildcard if wildcard is not None else 0.0)
        if name == "gzip" and "gzip" not in weights and "x-gzip" in weights:
            q = weights["x-gzip"]
        if q > best_q:
            best, best_q = name, q
    return best


def compress(body: bytes, encoding: str) -> bytes:
    """``body`` in ``encoding`` (one of :data:`AVAILABLE`)."""
    if encoding == "zstd":
        return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(body)
    if encoding == "br":
        return bytes(brotli.compress(body, quality=_BROTLI_QUALITY))
    if encoding == "gzip":
        compressor = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, 31)
        return compressor.compress(body) + compressor.flush()
    raise ValueError(f"unknown content coding {encoding!r}")


class _Coder(Protocol):
    def chunk(self, data: bytes) -> bytes: ...
    def end(self) -> bytes: ...


class _Zstd:
    def __init__(self) -> None:
        self._obj = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compressobj()

    def chunk(self, data: bytes) -> bytes:
        return bytes(self._obj.compress(data) + self._obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))

    def end(self) -> bytes:
        return bytes(self._obj.flush())


class _Brotli:
    def __init__(self) -> None:
        self._obj = brotli.Compressor(quality=_BROTLI_QUALITY)

    def chunk(self, data: bytes) -> bytes:
        return bytes(self._obj.process(data) + self._obj.flush())

    def end(self) -> bytes:
        return bytes(self._obj.finish())


class _Gzip:
    def __init__(self) -> None:
        self._obj = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, 31)

    def chunk(self, data: bytes) -> bytes:
        return self._obj.compress(data) + self._obj.flush(zlib.Z_SYNC_FLUSH)

    def end(self) -> bytes:
        return self._obj.flush()


class StreamCompressor:
    """Compresses a stream chunk by chunk, each chunk flushed whole: what the client has
    received always decodes to every event sent so far."""

    def __init__(self, encoding: str) -> None:
        coders: dict[str, Callable[[], _Coder]] = {"zstd": _Zstd, "br": _Brotli, "gzip": _Gzip}
        if encoding not in coders:
            raise ValueError(f"unknown content coding {encoding!r}")
        self.encoding = encoding
        self._coder = coders[encoding]()

    def compress(self, data: bytes) -> bytes:
        """``data`` compressed and flushed."""
        return self._coder.chunk(data)

    def finish(self) -> bytes:
        """The end of the stream."""
        return self._coder.end()
