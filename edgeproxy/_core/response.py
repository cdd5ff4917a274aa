"""Answers the proxy sends through an :class:`~edgeproxy._core.exchange.Exchange`.

:class:`StreamResponse` is started, written piece by piece and ended; :class:`Response`
carries its whole body and is sent at the end of the request, so that the pipeline and
plugins can still add headers to it or replace it. The names and the methods follow
aiohttp's, which most readers know; the front end that sends them may be any.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from multidict import CIMultiDict
from mypy_extensions import mypyc_attr

from edgeproxy._core.exchange import Exchange, Writer

__all__ = ["ReadyStream", "Response", "StreamResponse"]

HeadersIn = Mapping[str, str] | Iterable[tuple[str, str]]


async def _unprepared(data: bytes) -> None:
    raise RuntimeError("write() before prepare()")


# The compiled build compiles these classes; the front ends, the local model and the
# compression wrapper subclass them in Python.
@mypyc_attr(allow_interpreted_subclasses=True)
class StreamResponse:
    """A response written piece by piece: :meth:`prepare` sends the head, :meth:`write`
    each piece, :meth:`write_eof` the end."""

    __slots__ = (
        "_close",
        "_eof",
        "_exchange",
        "_writer",
        "content_length",
        "headers",
        "status",
    )

    def __init__(
        self,
        *,
        status: int = 200,
        headers: HeadersIn | None = None,
        content_type: str | None = None,
    ) -> None:
        self.status = status
        self.headers: CIMultiDict[str] = (
            CIMultiDict(headers) if headers is not None else CIMultiDict()
        )
        if content_type is not None:
            self.headers["Content-Type"] = content_type
        # The body's size, when known before it is written; else the front end frames it.
        self.content_length: int | None = None
        self._exchange: Exchange | None = None
        self._writer: Writer = _unprepared
        self._close = False
        self._eof = False

    @classmethod
    def sent_by(cls, exchange: Exchange, status: int) -> StreamResponse:
        """An answer its front end sent in its own way (a WebSocket session, once it is
        over): prepared and ended, for the front end to leave alone."""
        done = cls(status=status)
        done._exchange = exchange
        done._eof = True
        return done

    @property
    def prepared(self) -> bool:
        """Whether the head was sent."""
        return self._exchange is not None

    @property
    def exchange(self) -> Exchange | None:
        """The exchange the head went out on, once prepared."""
        return self._exchange

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "")

    @content_type.setter
    def content_type(self, value: str) -> None:
        self.headers["Content-Type"] = value

    @property
    def keep_alive(self) -> bool:
        return not self._close

    def force_close(self) -> None:
        """Close the connection after this answer (a draining proxy, a broken stream)."""
        self._close = True

    async def prepare(self, exchange: Exchange) -> None:
        """Send the status and headers on ``exchange``; a second call does nothing."""
        if self._exchange is not None:
            return
        self._exchange = exchange
        self._writer = await exchange.start(
            self.status, self.headers, self.content_length, self._close
        )

    async def write(self, data: bytes) -> None:
        """Send a piece of the body. Raises :class:`ConnectionResetError` if the client left."""
        await self._writer(data)

    @property
    def writer(self) -> Writer:
        """What :meth:`write` does, without going through it: for loops writing many
        pieces (a relayed stream), once prepared."""
        return self._writer

    async def write_eof(self, data: bytes = b"") -> None:
        """End the body cleanly, after ``data`` if given; a second call does nothing."""
        if self._eof:
            return
        exchange = self._exchange
        if exchange is None:
            raise RuntimeError("write_eof() before prepare()")
        self._eof = True
        await exchange.end(data)

    def abort(self) -> None:
        """End the answer so the client cannot take it as complete (see
        :meth:`~edgeproxy.Exchange.abort`)."""
        self._close = True
        if self._exchange is not None:
            self._exchange.abort()


@mypyc_attr(allow_interpreted_subclasses=True)
class Response(StreamResponse):
    """A response whose whole body is known: sent in one go at the end of the request."""

    __slots__ = ("body",)

    def __init__(
        self,
        *,
        status: int = 200,
        body: bytes = b"",
        headers: HeadersIn | None = None,
        content_type: str | None = None,
    ) -> None:
        # StreamResponse.__init__ spelled out: built for every cache hit and error.
        self.status = status
        self.headers = CIMultiDict(headers) if headers is not None else CIMultiDict()
        if content_type is not None:
            self.headers["Content-Type"] = content_type
        self._exchange = None
        self._writer = _unprepared
        self._close = False
        self._eof = False
        self.body = body
        self.content_length = len(body)

    @classmethod
    def json(cls, data: Any, *, status: int = 200, headers: HeadersIn | None = None) -> Response:
        """``data`` as a JSON body (``application/json``)."""
        return cls(
            status=status,
            body=orjson.dumps(data),
            headers=headers,
            content_type="application/json",
        )

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    async def prepare(self, exchange: Exchange) -> None:
        self.content_length = len(self.body)
        await super().prepare(exchange)

    async def write_eof(self, data: bytes = b"") -> None:
        await super().write_eof(self.body + data if data else self.body)


class ReadyStream(StreamResponse):
    """A stream whose whole body is known (a cached SSE answer): framed as a stream, with no
    length, and written piece by piece once the front end sends it.

    It leaves the handler unprepared, like a :class:`Response`, so the pipeline and
    fallback plugins can still add headers to it or replace it.
    """

    __slots__ = ("parts",)

    def __init__(
        self, *, status: int, parts: list[bytes], headers: HeadersIn | None = None
    ) -> None:
        super().__init__(status=status, headers=headers)
        self.parts = parts

    async def write_eof(self, data: bytes = b"") -> None:
        # One piece an event, as recorded: the client may merge reads, never split events.
        parts, self.parts = self.parts, []
        for part in parts:
            await self.write(part)
        await super().write_eof(data)
