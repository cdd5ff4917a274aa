"""The HTTP/2 listener's front door (:mod:`edgeproxy._server.h2server`): each new
connection is a :class:`Front` until its protocol is told apart, and one past a connection
cap is refused before a byte of it is read."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Final, Protocol, cast

import jh2.config
import jh2.connection
import jh2.errors
import jh2.settings

from edgeproxy._server.guard import ConnectionGuard, raw_error
from edgeproxy._server.h2connection import ConnectionSite, H2Connection
from edgeproxy._server.h2request import BadUpgrade, upgrade_request
from edgeproxy._server.handler import EdgeRequestHandler

__all__ = ["PREFACE", "Front", "FrontSite"]

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_CALM: Final = jh2.errors.ErrorCodes.ENHANCE_YOUR_CALM


class FrontSite(ConnectionSite, Protocol):
    """What a new connection needs of its listener
    (:class:`~edgeproxy._server.h2server.H2Site`): a Protocol, as the listener's module
    imports this one to make each connection's protocol."""

    @property
    def upgrade_head_max(self) -> int: ...

    @property
    def handler_factory(self) -> Callable[[], EdgeRequestHandler]: ...


class Front(asyncio.Protocol):
    """A new connection on the listener until it is told apart: HTTP/2 (ALPN, the preface,
    an upgrade) becomes an :class:`H2Connection`, anything else the HTTP/1.1 handler."""

    __slots__ = ("_accepted", "_buffer", "_counted", "_ip", "_site", "_timer", "_transport")

    def __init__(self, site: FrontSite) -> None:
        self._site = site
        self._buffer = b""
        self._counted = False
        self._ip = ""
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._accepted = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        site = self._site
        self._accepted = asyncio.get_running_loop().time()
        guard = site.guard
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        ip = self._ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refused = guard.admit(ip)
        if refused is not None:
            _refuse(self._transport, guard, refused)
            return
        self._counted = True
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            if ssl_object.selected_alpn_protocol() == "h2":
                self._h2(b"", None)
            else:
                self._http1(b"")
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(guard.limits.header_timeout, self._too_slow)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data
        if PREFACE.startswith(buffer[:24]):
            if len(buffer) >= len(PREFACE):
                self._h2(buffer, None)
            else:
                self._buffer = buffer
            return
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if (
                len(buffer) < self._site.upgrade_head_max
                and b"\n" in buffer
                # A bare LF is no upgrade's: the handler answers it at once.
                and buffer.count(b"\n") == buffer.count(b"\r\n")
            ):
                # An HTTP/1.1 head on its way: whole, it may ask to upgrade.
                self._buffer = buffer
                return
            self._http1(buffer)
            return
        try:
            upgrade = upgrade_request(buffer[:end])
        except BadUpgrade as exc:
            self._bad_upgrade(str(exc))
            return
        if upgrade is None:
            self._http1(buffer)
        else:
            self._h2(buffer[end + 4 :], upgrade)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_timer()
        if self._counted:
            self._counted = False
            self._site.guard.release(self._ip)

    def _too_slow(self) -> None:
        # The handler answers a head that did not come in time (408), as on HTTP/1.1.
        self._timer = None
        if self._transport is not None and self._counted:
            self._http1(self._buffer)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _bad_upgrade(self, reason: str) -> None:
        """A 400 in HTTP/1.1, and the connection closes: what followed the head was meant
        for HTTP/2."""
        self._stop_timer()
        transport = self._transport
        assert transport is not None
        server = self._site.guard.server_header
        transport.write(raw_error(400, f"Bad h2c upgrade: {reason}.", "bad_upgrade", server))
        transport.close()

    def _http1(self, data: bytes) -> None:
        """The default listener's handler takes the connection and what was read of it."""
        self._stop_timer()
        transport = self._transport
        assert transport is not None
        # The handler counts the connection itself.
        self._counted = False
        self._site.guard.release(self._ip)
        handler = self._site.handler_factory()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if data and not transport.is_closing():
            handler.data_received(data)
        handler.head_since(self._accepted)

    def _h2(self, data: bytes, upgrade: tuple[bytes, list[tuple[bytes, bytes]]] | None) -> None:
        self._stop_timer()
        transport = self._transport
        assert transport is not None
        self._counted = False  # the connection's to give back now
        site = self._site
        ip = self._ip
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                site.guard.release(ip)

        conn = H2Connection(site, transport, ip, release)
        transport.set_protocol(conn)
        site.connections.add(conn)
        conn.begin(data, upgrade)


def _refuse(transport: asyncio.Transport, guard: ConnectionGuard, message: str) -> None:
    """Answer a connection over a cap and close it, reading nothing of it: a client that
    negotiated h2 by ALPN gets HTTP/2's refusal, any other the aiohttp listener's 503. In
    cleartext an h2c client with prior knowledge gets the 503 too: telling it apart would
    mean waiting for its first bytes."""
    tls = transport.get_extra_info("ssl_object")
    if tls is not None and tls.selected_alpn_protocol() == "h2":
        transport.write(_h2_refusal(message))
    else:
        transport.write(guard.refusal(message))
    transport.close()


@functools.cache
def _h2_refusal(message: str) -> bytes:
    """The server's preface allowing no stream, then GOAWAY: last stream 0 (none was
    processed, so the client may retry each request elsewhere), ENHANCE_YOUR_CALM (back
    off rather than reconnect at once), the reason as its debug data."""
    conn = jh2.connection.H2Connection(jh2.config.H2Configuration(client_side=False))
    conn.local_settings = jh2.settings.Settings(
        client=False, initial_values={jh2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0}
    )
    conn.initiate_connection()
    conn.close_connection(error_code=_CALM, additional_data=message.encode(), last_stream_id=0)
    return cast(bytes, conn.data_to_send())
