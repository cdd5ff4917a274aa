"""WebSockets to the regions, and aiohttp's WebSockets as the proxy's
:class:`~edgeproxy._core.websocket.WebSocket`.

A session's region side is an HTTP/1.1 Upgrade through aiohttp's client (what every
Realtime server takes: OpenAI, vLLM, LocalAI), opened once per session, never pooled.
The aiohttp listener's side of a session is aiohttp's server WebSocket, which speaks the
same API: :class:`AiohttpSocket` adapts either.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple

import aiohttp
from aiohttp import WSMsgType

from edgeproxy._core.websocket import MESSAGE_TOO_BIG, NORMAL, Closed, WebSocket

__all__ = ["AiohttpSocket", "RegionSockets", "Refused", "WEBSOCKET_REQUEST_HEADERS"]

# The handshake's own fields: the client's are for the proxy; aiohttp writes the region's.
WEBSOCKET_REQUEST_HEADERS: Final = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "sec-websocket-accept",
        "upgrade",
        "connection",
        "host",
        "content-length",
        "transfer-encoding",
    }
)
# Seconds a close waits for the peer's own close frame: a peer that does not read must not
# hold the session's end.
_CLOSE_WAIT: Final = 2.0
_GONE: Final = Closed(1006, "connection lost")


class AiohttpSocket(WebSocket):
    """aiohttp's WebSocket, client's or server's, as the proxy's :class:`WebSocket`."""

    __slots__ = ("_beats", "_closed", "_ws")

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse | aiohttp.web.WebSocketResponse,
        *,
        beats: bool = False,
    ) -> None:
        self._ws = ws
        # The client's side names it .protocol, the server's .ws_protocol.
        chosen = ws.protocol if isinstance(ws, aiohttp.ClientWebSocketResponse) else ws.ws_protocol
        self.subprotocol = chosen
        self._closed: Closed | None = None
        # aiohttp pings on its own (heartbeat=) and ends a session whose peer answers none.
        self._beats = beats

    async def receive(self) -> str | bytes | Closed:
        if self._closed is not None:
            return self._closed
        ws = self._ws
        while True:
            try:
                msg = await ws.receive()
            except (ConnectionError, RuntimeError):
                # aiohttp raises once its connection is gone mid-read.
                self._closed = _GONE
                return _GONE
            kind = msg.type
            if kind is WSMsgType.TEXT or kind is WSMsgType.BINARY:
                data = msg.data
                assert isinstance(data, str | bytes)
                return data
            if kind is WSMsgType.PING or kind is WSMsgType.PONG:
                continue  # answered by aiohttp (autoping)
            if kind is WSMsgType.CLOSE:
                code = int(msg.data) if isinstance(msg.data, int) else 1005
                self._closed = Closed(code, str(msg.extra or ""))
            elif kind is WSMsgType.ERROR:
                error = msg.data
                if getattr(error, "code", None) == MESSAGE_TOO_BIG:
                    self._closed = Closed(MESSAGE_TOO_BIG, "message too big")
                else:
                    self._closed = Closed(1006, str(error) or "connection error")
            else:  # CLOSING, CLOSED
                close_code = ws.close_code
                self._closed = Closed(close_code, "") if close_code else _GONE
            return self._closed

    async def send(self, message: str | bytes) -> None:
        ws = self._ws
        if ws.closed:
            raise ConnectionResetError("the WebSocket is closed")
        try:
            if isinstance(message, str):
                await ws.send_str(message)
            else:
                await ws.send_bytes(message)
        except (ConnectionError, RuntimeError) as exc:
            raise ConnectionResetError(str(exc)) from None

    async def close(self, code: int = NORMAL, reason: str = "") -> None:
        ws = self._ws
        if ws.closed:
            return
        try:
            # aiohttp gives up on a peer's close frame after _CLOSE_WAIT and lets the
            # connection go; this bounds a close frame stuck behind a peer that does not
            # read (cancelled, aiohttp closes the transport).
            async with asyncio.timeout(_CLOSE_WAIT + 1.0):
                await ws.close(code=code, message=reason.encode()[:123])
        except (TimeoutError, ConnectionError, RuntimeError):
            pass
        if self._closed is None:
            self._closed = Closed(code, reason)

    async def ping(self) -> None:
        ws = self._ws
        if not self._beats and not ws.closed:
            try:
                await ws.ping()
            except (ConnectionError, RuntimeError):
                pass

    def buffered(self) -> int:
        writer = getattr(self._ws, "_writer", None)
        transport = getattr(writer, "transport", None)
        if transport is None:
            return 0
        size: int = transport.get_write_buffer_size()
        return size


class Refused(NamedTuple):
    """A region that did not complete a session's handshake: its status (None when it was
    not reached or did not answer in time), why, and its Retry-After in seconds."""

    status: int | None
    reason: str
    retry_after: float | None = None


class RegionSockets:
    """The sessions' handshakes with the regions: one aiohttp client, opened on first use
    and closed with the proxy."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        max_message: int,
        compress: bool,
        ping_interval: float | None = None,
        tls: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        self.ping_interval = ping_interval
        self.connect_timeout = connect_timeout
        self.max_message = max_message
        self.compress = compress
        # Made on first use: loading the trust store is of no use to a proxy without TLS
        # regions, or without sessions.
        self._tls = tls
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None or session.closed:
            # No pooling: a session's connection is its own for as long as it lasts.
            connector = aiohttp.TCPConnector(
                force_close=True, limit=0, ssl=self._tls() if self._tls is not None else True
            )
            session = self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
            )
        return session

    async def connect(
        self, url: str, headers: Sequence[tuple[str, str]], protocols: Sequence[str]
    ) -> AiohttpSocket | Refused:
        """Open a session at ``url`` (``http(s)://`` or ``ws(s)://``)."""
        if url.startswith("http"):
            url = "ws" + url[4:]
        try:
            async with asyncio.timeout(self.connect_timeout):
                ws = await self._client().ws_connect(
                    url,
                    headers=list(headers),
                    protocols=tuple(protocols),
                    autoping=True,
                    heartbeat=self.ping_interval,
                    compress=15 if self.compress else 0,
                    max_msg_size=self.max_message,
                    timeout=aiohttp.ClientWSTimeout(ws_close=_CLOSE_WAIT),
                )
        except TimeoutError:
            return Refused(None, f"no handshake in {self.connect_timeout:g}s")
        except aiohttp.WSServerHandshakeError as exc:
            return Refused(
                exc.status or None,
                f"handshake refused: {exc.status} {exc.message}",
                _retry_after(exc.headers),
            )
        except (aiohttp.ClientError, OSError) as exc:
            return Refused(None, f"cannot connect: {exc}")
        return AiohttpSocket(ws, beats=self.ping_interval is not None)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _retry_after(headers: object) -> float | None:
    value = headers.get("retry-after") if hasattr(headers, "get") else None
    if not isinstance(value, str):
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
