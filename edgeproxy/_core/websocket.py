"""A WebSocket as the proxy relays it: one side of a session, whichever end it faces.

The client's side comes from a front end (the aiohttp listener's HTTP/1.1 Upgrade, the
HTTP/2 listener's extended CONNECT, an ASGI ``websocket`` scope), the region's side from
the upstream layer. The session between them (:mod:`edgeproxy._realtime`) sees only this
shape: messages in and out, a close, a ping. Each side answers pings and reassembles
fragments itself, and bounds what it holds: a message past its size limit ends the
session (1009), and a send waits while the peer does not read, so a peer that stops
reading pushes back on the other side instead of filling the proxy's memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Final, NamedTuple

__all__ = [
    "GOING_AWAY",
    "INTERNAL_ERROR",
    "MESSAGE_TOO_BIG",
    "NORMAL",
    "POLICY",
    "SERVICE_RESTART",
    "TRY_AGAIN_LATER",
    "Accept",
    "Closed",
    "WebSocket",
    "is_websocket_upgrade",
]

# Close codes the proxy itself sends (RFC 6455 §7.4.1, and the IANA registry's 1012-1014).
NORMAL: Final = 1000
GOING_AWAY: Final = 1001
"""The proxy shuts down, or the session was idle past its timeout."""
POLICY: Final = 1008
"""The session broke a rule: a limit, a message the proxy will not relay."""
MESSAGE_TOO_BIG: Final = 1009
INTERNAL_ERROR: Final = 1011
"""The region failed mid-session (it closed abnormally, or stopped answering)."""
SERVICE_RESTART: Final = 1012
"""A reload: the client may reconnect at once, to the new configuration."""
TRY_AGAIN_LATER: Final = 1013


class Closed(NamedTuple):
    """The other end closed the session (or its connection went): its close code and reason.
    1006 stands for a connection that went without a close frame."""

    code: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Accept:
    """How a front end completes a client's handshake."""

    subprotocol: str | None = None
    """The subprotocol chosen among those the client offered (the region's choice)."""
    headers: tuple[tuple[str, str], ...] = ()
    """Extra response headers (``x-edgeproxy-region``, the request id)."""
    max_message: int = 4 * 1024 * 1024
    """The largest message taken from the client; past it the session closes with 1009."""
    compress: bool = True
    """permessage-deflate, when the client offers it."""
    buffer: int = 1024 * 1024
    """Bytes a send may leave queued toward a client that does not read before the next
    send waits for it."""


class WebSocket(ABC):
    """One side of a WebSocket session: messages are ``str`` (text) or ``bytes`` (binary)."""

    subprotocol: str | None = None

    @abstractmethod
    async def receive(self) -> str | bytes | Closed:
        """The next whole message, or :class:`Closed` once the session ended on this side
        (after which it returns :class:`Closed` again)."""

    @abstractmethod
    async def send(self, message: str | bytes) -> None:
        """Send one message; waits while the peer does not read. Raises
        :class:`ConnectionResetError` once this side is closed."""

    @abstractmethod
    async def close(self, code: int = NORMAL, reason: str = "") -> None:
        """Send a close frame (once; later calls do nothing) and let the connection go."""

    async def ping(self) -> None:  # noqa: B027 - optional: a front end that cannot ping
        """Send a ping; its pong counts as activity. A side that cannot ping (an ASGI
        server pings on its own) does nothing."""

    def buffered(self) -> int:
        """Bytes accepted by :meth:`send` that the peer has not taken yet, where known."""
        return 0


def is_websocket_upgrade(connection: str | None, upgrade: str | None) -> bool:
    """Whether an HTTP/1.1 request's ``Connection`` and ``Upgrade`` fields ask for a
    WebSocket (RFC 6455 §4.1; both are case-insensitive token lists)."""
    if not upgrade or not connection:
        return False
    if "websocket" not in upgrade.lower():
        return False
    return any(token.strip().lower() == "upgrade" for token in connection.split(","))
