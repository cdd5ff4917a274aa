"""A region's chat completion answer as a response in the client's API.

The attempt that sends a translated request (:mod:`edgeproxy._protocol.translate`) hands
back one of these instead of the region's own response: its status, headers and bytes
are already the client's API's, so that failover (the commit at the first content, the
whole body read before it counts), the relay, the cache, the usage readers and a broken
stream's continuation see nothing new. A stream is translated as it is read; anything
else (a JSON answer, a refusal) is read whole first, within the attempt, and held.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final

from edgeproxy._core.errors import ProxyError
from edgeproxy._core.types import Headers
from edgeproxy._protocol.dialects import Dialect
from edgeproxy._protocol.translate import Translation
from edgeproxy._protocol.translate.answers import ChatStream
from edgeproxy._upstream.pool import UpstreamProtocolError, UpstreamResponse

__all__ = ["HeldResponse", "TranslatedStream", "held", "refusal", "translated"]

# The most of a region's JSON answer read to translate it (a stream is never held).
WHOLE_LIMIT: Final = 8 * 1024 * 1024
# The region's headers that describe its body, not the client's.
_BODY_HEADERS: Final = frozenset({"content-length", "content-type", "content-encoding"})


def _headers(region: Headers, content_type: str, length: int | None = None) -> Headers:
    out = [(k, v) for k, v in region if k.lower() not in _BODY_HEADERS]
    out.append(("content-type", content_type))
    if length is not None:
        out.append(("content-length", str(length)))
    return out


class HeldResponse:
    """An answer read whole and held: a translated JSON answer or refusal, a region's own
    404 kept while its chat completions were tried, or the proxy's refusal to translate."""

    __slots__ = ("status", "headers", "http_version", "body")

    def __init__(self, status: int, headers: Headers, body: bytes, http_version: str) -> None:
        self.status = status
        self.headers = headers
        self.http_version = http_version
        self.body = body

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        if self.body:
            yield self.body

    async def aclose(self) -> None:
        self.body = b""


class TranslatedStream:
    """A region's chat completion stream as the client's API's stream, translated as it
    is read. A stream that ends before its answer did raises
    :class:`~edgeproxy._upstream.pool.UpstreamProtocolError`, as a broken stream does."""

    __slots__ = ("response", "status", "headers", "http_version", "_stream")

    def __init__(self, response: UpstreamResponse, stream: ChatStream) -> None:
        self.response = response
        self.status = response.status
        self.headers = _headers(response.headers, "text/event-stream")
        self.http_version = response.http_version
        self._stream = stream

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        stream = self._stream
        async for chunk in self.response.aiter_bytes():
            out = stream.feed(chunk)
            if out:
                yield out
        tail = stream.close()
        if tail is None:
            raise UpstreamProtocolError("the region's chat stream ended before its answer did")
        if tail:
            yield tail

    async def aclose(self) -> None:
        await self.response.aclose()


async def read_body(response: UpstreamResponse, limit: int) -> bytes:
    """``response``'s body, at most ``limit`` bytes (more is a broken answer); closes it."""
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in response.aiter_bytes():
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                raise UpstreamProtocolError(f"the region's answer passed {limit} bytes")
    finally:
        await response.aclose()
    return b"".join(parts)


def _is_sse(headers: Headers) -> bool:
    for name, value in headers:
        if name.lower() == "content-type":
            return value.startswith("text/event-stream")
    return False


async def translated(response: UpstreamResponse, translation: Translation) -> UpstreamResponse:
    """The region's ``response`` to ``translation``'s request, in the client's API."""
    status = response.status
    if status == 200 and translation.streams and _is_sse(response.headers):
        return TranslatedStream(response, translation.stream())
    body = await read_body(response, WHOLE_LIMIT)
    if 200 <= status < 300:
        status, out = translation.whole(body)
        content_type = translation.content_type if status == 200 else "application/json"
    else:
        out = translation.error(status, body)
        content_type = "application/json"
    headers = _headers(response.headers, content_type, len(out))
    return HeldResponse(status, headers, out, response.http_version)


def held(response: UpstreamResponse, body: bytes) -> HeldResponse:
    """``response`` (read already) with ``body``, as it came."""
    headers = [(k, v) for k, v in response.headers if k.lower() != "content-length"]
    headers.append(("content-length", str(len(body))))
    return HeldResponse(response.status, headers, body, response.http_version)


def refusal(err: ProxyError, dialect: Dialect) -> HeldResponse:
    """The proxy's own refusal to send a request to a region (it cannot be translated), in
    the client's API."""
    body = dialect.error_body(err)
    headers: Headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    return HeldResponse(err.status, headers, body, "1.1")
