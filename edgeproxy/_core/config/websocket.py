"""WebSocket sessions, the Realtime API's among them: ``[websocket]``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from edgeproxy._core.config.base import Section
from edgeproxy._core.config.kinds import Count, CountOrZero, FinitePositive

__all__ = ["WebSocketConfig"]


class WebSocketConfig(Section):
    """WebSocket sessions relayed to the regions (``/v1/realtime`` and the routes that
    allow others, see ``[[routes]] websocket``).

    A session is routed at its handshake, like a request, then stays on its region. These
    limits hold for every session of this proxy process.
    """

    connect_timeout: FinitePositive = Field(
        10.0,
        description="Seconds a region has to complete its handshake; past it, or refused, "
        "the next region is tried.",
    )
    max_message_size: Count = Field(
        4 * 1024 * 1024,
        description="Largest message relayed either way, in bytes; past it the session "
        "closes with 1009. A Realtime client appends audio in chunks of a few KiB; each "
        "session may hold one message this size each way, so it bounds their memory.",
    )
    buffer: Count = Field(
        1024 * 1024,
        description="Bytes of messages one session holds toward a peer that does not read "
        "(each way); past it the proxy stops reading the other side until the peer reads.",
    )
    idle_timeout: FinitePositive = Field(
        300.0,
        description="Seconds a session may pass with no message either way; then it closes "
        "with 1001 and, for the Realtime API, an error event saying why.",
    )
    ping_interval: FinitePositive = Field(
        20.0,
        description="Seconds between the proxy's pings to each side of a session. A region, "
        "or a client of the HTTP/1.1 listener, whose pong does not come within half of it "
        "is gone; over HTTP/2 a client that stops taking data is ended by "
        "server.h2_send_stall_timeout.",
    )
    max_sessions: Count = Field(
        10_000, description="Most sessions open in this process; past it, 503 at the handshake."
    )
    max_sessions_per_ip: CountOrZero = Field(
        32,
        description="Most sessions open from one client IP (0: no cap); past it, 429 at "
        "the handshake.",
    )
    max_sessions_per_tenant: CountOrZero = Field(
        1000,
        description="Most sessions open for one tenant (as the entry hooks set it; 0: no "
        "cap); past it, 429 at the handshake.",
    )
    compression: Literal["client", "both", "off"] = Field(
        "client",
        description="permessage-deflate: 'client', toward a client that offers it (the edge "
        "link, where bytes cost time); 'both', offered to the regions as well; 'off'. Each "
        "compressed link holds a deflate state of some 150 KiB per session.",
    )
