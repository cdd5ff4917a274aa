"""Compression toward the client: which answers, in which coding, and the cache's copies.

A JSON or text answer of at least ``server.compression_min_size`` bytes (or of unknown
length) is compressed when the client accepts a coding this proxy offers
(``server.compression_encodings``, zstd, br and gzip by default). An SSE stream is
compressed only on a route with ``compress_sse = true``, and then every event is flushed as
it is written, so compression never holds an event back. A cached answer is stored once,
uncompressed; each coding of it is made at most once, on the first hit that asks for it,
and kept with the entry.
"""

from __future__ import annotations

from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext
from edgeproxy._core.exchange import Writer
from edgeproxy._core.response import StreamResponse
from edgeproxy._core.types import Headers
from edgeproxy._protocol.encoding import (
    StreamCompressor,
    choose_encoding,
    compress,
    compressible_type,
)

__all__ = ["Compression", "EncodedResponse"]

_NO_BODY_STATUS = frozenset({204, 304})
# Answers that must reach the client as the region sent them.
_KEEP = frozenset({206})


class EncodedResponse(StreamResponse):
    """A streamed response whose body goes out in ``encoding``, every write flushed.

    Everything written to it is compressed, error events and the end of a cut stream
    included, so that no code path can put plain bytes into an encoded body.
    """

    def __init__(self, encoding: str, *, status: int, headers: Headers) -> None:
        super().__init__(status=status, headers=headers)
        self.headers["Content-Encoding"] = encoding
        self.headers.add("Vary", "Accept-Encoding")
        self._stream: StreamCompressor | None = StreamCompressor(encoding)

    @property
    def writer(self) -> Writer:
        # Every piece goes through the compressor.
        return self.write

    async def write(self, data: bytes) -> None:
        if data and self._stream is not None:
            await super().write(self._stream.compress(data))

    async def write_eof(self, data: bytes = b"") -> None:
        stream, self._stream = self._stream, None
        tail = b""
        if stream is not None:
            tail = (stream.compress(data) if data else b"") + stream.finish()
        await super().write_eof(tail)


class Compression:
    """Decides, per response, whether and how to compress it."""

    def __init__(self, config: Config) -> None:
        server = config.server
        self.enabled = server.compression
        self.min_size = server.compression_min_size
        self.offered = tuple(server.compression_encodings)

    def choose(
        self,
        ctx: RequestContext,
        status: int,
        length: int | None,
        headers: Headers,
        *,
        sse: bool,
    ) -> str | None:
        """The coding for this answer (``length`` None when unknown, ``headers`` the ones it
        goes out with), or None to send it as it is.

        The size and the route come first: most answers are too small to compress, and
        looking through the headers and Accept-Encoding costs more.
        """
        if not self.enabled or ctx.method == "HEAD":
            return None
        if sse:
            if not ctx.route.compress_sse:
                return None
        elif length is not None and length < self.min_size:
            return None
        if status in _NO_BODY_STATUS or status in _KEEP:
            return None
        content_type = "text/event-stream" if sse else _header(headers, "content-type")
        if not compressible_type(content_type) or _header(headers, "content-encoding"):
            return None
        return choose_encoding(ctx.headers.get("accept-encoding"), self.offered)

    def whole(self, parts: list[bytes], encoding: str) -> bytes:
        """A body known whole (a cached answer's parts) in ``encoding``."""
        if len(parts) == 1:
            return compress(parts[0], encoding)
        stream = StreamCompressor(encoding)
        return b"".join([*map(stream.compress, parts), stream.finish()])


def _header(headers: Headers, name: str) -> str | None:
    """The value of ``name`` (lower-case) in ``headers``, None when absent."""
    return next((v for k, v in headers if k.lower() == name), None)
