"""The seam between a front end and the pipeline: one request and the way its answer goes back.

A front end (the aiohttp listener, the ASGI application, the HTTP/2 listener)
receives a request in its own types and hands the pipeline an :class:`Exchange`.
The pipeline, every stage and every hook see only this: what the client sent
(method, target, headers, address, TLS, a body stream, whether it is still
there) and a response to start, write to, and end or abort. Nothing below the
server layer knows which server received the request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar

from multidict import CIMultiDict, CIMultiDictProxy

from edgeproxy._core.websocket import Accept, WebSocket

__all__ = ["Exchange", "TlsInfo", "Writer"]

Writer = Callable[[bytes], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class TlsInfo:
    """The TLS session a request came on: protocol version, negotiated ALPN protocol and the
    server name the client asked for (each None when unknown)."""

    version: str | None = None
    alpn: str | None = None
    server_name: str | None = None


class Exchange(ABC):
    """One client request as a front end received it, and the way its answer goes back.

    Attributes are read once, when the front end builds it:

    - ``method``, ``target`` (the raw path and query, as sent, a mount prefix removed),
      ``headers`` (read-only, case-insensitive);
    - ``client`` (the peer address; the trusted client IP is worked out from it and
      the forwarding headers elsewhere), ``scheme``, ``version`` (``"1.1"``, ``"2"``),
      ``host``, ``tls`` (a :class:`TlsInfo`, or None over plain TCP);
    - ``content_length`` (None when unknown) and ``body_exists``;
    - ``native``: the front end's own request object (an aiohttp ``web.Request``,
      an ASGI scope), for embedders that need it; the pipeline never looks at it.

    The response side is used through :class:`~edgeproxy.StreamResponse`, which calls
    :meth:`start`, :meth:`write`, :meth:`end` and :meth:`abort`.
    """

    __slots__ = (
        "body_exists",
        "client",
        "content_length",
        "headers",
        "host",
        "method",
        "native",
        "scheme",
        "target",
        "tls",
        "version",
    )

    method: str
    target: str
    headers: CIMultiDictProxy[str]
    client: str | None
    scheme: str
    version: str
    host: str
    tls: TlsInfo | None
    content_length: int | None
    body_exists: bool
    native: object

    websocket: ClassVar[bool] = False
    """The request is a WebSocket handshake (an HTTP/1.1 Upgrade, an HTTP/2 extended
    CONNECT, an ASGI ``websocket`` scope), which its front end can :meth:`accept`. Its
    ``method`` reads ``GET`` whatever the front end, so that routes match it alike."""

    async def accept(self, accept: Accept) -> WebSocket:
        """Complete the client's WebSocket handshake; the session then goes on in the
        :class:`~edgeproxy._core.websocket.WebSocket` returned. Refusing it instead is
        answering the request as any other (a JSON error before the upgrade)."""
        raise NotImplementedError(f"{type(self).__name__} takes no WebSocket")

    @property
    def path(self) -> str:
        """The target without its query string."""
        return self.target.split("?", 1)[0]

    # -- the request body ------------------------------------------------

    async def read(self) -> bytes:
        """The whole body (the front end bounds it): by default, :meth:`read_chunk` until
        its end."""
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    @abstractmethod
    async def read_chunk(self) -> bytes:
        """The next piece of the body as it arrives; ``b""`` at its end."""

    def iter_body(self) -> AsyncIterator[bytes]:
        """The body piece by piece, as it arrives."""
        return _Chunks(self)

    @abstractmethod
    def client_gone(self) -> bool:
        """Whether the client went away (its connection or stream closed)."""

    def queued(self, waiting: bool) -> None:
        """Admission says the request waits in its queue for a slot (``waiting``), then that
        it no longer does.

        A front end that answers clients that half-close (``limits.half_close =
        "answer"``) takes the client's FIN, whether it came before the request started
        waiting or while it waits, for the client gone: it cancels the request, which gives
        up its place. The default does nothing."""
        return

    # -- the response ----------------------------------------------------

    @abstractmethod
    async def start(
        self, status: int, headers: CIMultiDict[str], length: int | None, close: bool
    ) -> Writer:
        """Send the status and headers; ``length`` is the body's size when known (else the
        front end frames it), ``close`` asks to close the connection after this answer.

        Returns what writes the body from now on: :meth:`write` itself, or a quicker
        writer of the front end's own with the same contract (a streamed answer calls it
        once per event)."""

    @abstractmethod
    async def write(self, data: bytes) -> None:
        """Send a piece of the body. Raises :class:`ConnectionResetError` if the client left."""

    @abstractmethod
    async def end(self, data: bytes = b"") -> None:
        """Send the last piece, if any, and end the body cleanly."""

    @abstractmethod
    def abort(self) -> None:
        """End the answer so that the client cannot take it as complete: the connection
        (HTTP/1.1) or the stream (HTTP/2) is closed without a clean end."""

    async def cut(self, data: bytes) -> None:
        """Queue ``data`` without waiting for the client to read it, then :meth:`abort`: for
        answers cut at shutdown, which must not wait on a slow client."""
        self.abort()


class _Chunks:
    """:meth:`Exchange.iter_body`'s iterator, a class rather than an async generator so
    that the compiled build (mypyc, which has no async generators) compiles it too."""

    __slots__ = ("_exchange",)

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._exchange.read_chunk()
        if not chunk:
            raise StopAsyncIteration
        return chunk
