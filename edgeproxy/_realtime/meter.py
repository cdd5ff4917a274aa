"""What a Realtime session's events mean to the proxy: usage, token limits, the time to a
response's first delta, and whether a response is under way (a drain waits for it).

A generic WebSocket session has no meter: its messages are only counted.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from edgeproxy._admission.ratelimit import Charge, RateLimiter, RateTicket
from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.realtime import (
    client_event,
    client_event_type,
    error_event,
    region_event_type,
    region_usage,
    session_id,
    session_model,
    sum_usage,
)

__all__ = ["Meter"]


class Meter:
    """One Realtime session's reading of its events (see the module's docstring).

    ``charges``: the session's token-unit rate charges (empty: no token limit applies);
    ``observe_first_delta``: called with the seconds from a ``response.create`` to its
    first delta; ``on_model``: the model the session turned out to use."""

    __slots__ = (
        "_charges",
        "_clock",
        "_created_at",
        "_first_delta",
        "_rate",
        "_tickets",
        "created",
        "model",
        "open_responses",
        "responses",
        "usage",
    )

    def __init__(
        self,
        *,
        rate: RateLimiter | None,
        charges: list[Charge],
        first_delta: Callable[[float], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rate = rate
        self._charges = charges
        self._first_delta = first_delta
        self._clock = clock
        # When the oldest response.create still waiting for its first delta was sent.
        self._created_at: float | None = None
        self._tickets: list[RateTicket] = []
        self.open_responses = 0
        self.responses = 0
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None
        # Told the id of the session its region made (its owner is that region).
        self.created: Callable[[str], object] | None = None

    @property
    def busy(self) -> bool:
        """A response was asked for or is under way and has not ended."""
        return self.open_responses > 0 or self._created_at is not None

    def from_client(self, message: str | bytes) -> Awaitable[str | None] | None:
        """Read a client's event. None: relay it. Otherwise an awaitable of None (relay it)
        or of an error event to answer the client with instead (a token limit)."""
        if isinstance(message, bytes):
            return None  # no event of the API is binary: the region answers it
        kind = client_event_type(message)
        if kind == "response.create":
            return self._create()
        if kind == "session.update" and self.model is None:
            body = client_event(message).body
            if body is not None:
                self.model = session_model(body)
        return None

    async def _create(self) -> str | None:
        if self._charges and self._rate is not None:
            try:
                ticket = await self._rate.take(self._charges, 1)
            except ProxyError as err:
                return error_event(err.message, code="rate_limit_exceeded", type="rate_limit_error")
            self._tickets.append(ticket)
        if self._created_at is None:
            self._created_at = self._clock()
        return None

    def from_region(self, message: str | bytes) -> None:
        """Read a region's event."""
        if isinstance(message, bytes):
            return
        kind, body = region_event_type(message)
        if kind is None:
            return
        if kind.endswith(".delta"):
            created = self._created_at
            if created is not None:
                self._created_at = None
                self._first_delta(self._clock() - created)
            return
        if kind == "response.created":
            self.open_responses += 1
        elif kind == "response.done":
            self.open_responses = max(0, self.open_responses - 1)
            self._created_at = None
            self.responses += 1
            usage = region_usage(body) if body is not None else None
            ticket = self._tickets.pop(0) if self._tickets else None
            if usage is not None:
                self.usage = sum_usage(self.usage, usage)
                if ticket is not None and self._rate is not None:
                    self._rate.settle(ticket, usage)
        elif kind.startswith("session.") and body is not None:
            model = session_model(body)
            if model is not None:
                self.model = model
            if kind == "session.created" and self.created is not None:
                made = session_id(body)
                if made is not None:
                    self.created(made)

    def abandon(self) -> None:
        """The session ended: a response asked for and never done keeps the estimate it
        was charged, nothing more."""
        self._tickets.clear()
