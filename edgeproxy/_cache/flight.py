"""Request coalescing: identical cacheable requests share one upstream request.

The first request for a key leads: it goes upstream, and what it relays is
recorded into its :class:`Flight`. Requests for the same key that arrive
meanwhile follow: a streaming follower of a streamed answer gets the chunks
as the leader receives them; any other follower gets the answer once it is
complete, converted to the form it asked for. A leader that fails (an error
status, a broken stream, no answer at all) does not fail its followers: they
wake up, and the first one leads a retry.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Final

from edgeproxy._cache.entry import Entry
from edgeproxy._core.answer import AnswerBroken
from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects import Dialect
from edgeproxy._protocol.sse import SSEEvent

__all__ = ["Coalescer", "Flight"]

PENDING: Final = "pending"
"""No response headers yet."""
STREAMING: Final = "streaming"
"""200 headers arrived; the body is flowing into ``chunks``."""
DONE: Final = "done"
"""The answer is complete and in ``entry``."""
FAILED: Final = "failed"
"""The leader gave up or got something that must not be shared."""


class Flight:
    """One upstream request that identical cacheable requests share."""

    __slots__ = (
        "key",
        "attempt",
        "state",
        "status",
        "headers",
        "sse",
        "region",
        "chunks",
        "events",
        "entry",
        "followers",
        "shareable",
        "error",
        "_changed",
    )

    def __init__(self, key: str, attempt: int = 1) -> None:
        self.key = key
        self.attempt = attempt
        self.state = PENDING
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.sse = False
        self.region: str | None = None
        self.chunks: list[bytes] = []
        # The stream's events as the leader's one parse read them: what followers get.
        self.events: list[SSEEvent] = []
        self.entry: Entry | None = None
        self.followers = 0
        # False once the recorded chunks were dropped (an answer too large to
        # keep with nobody following): late arrivals cannot replay it.
        self.shareable = True
        # Set when the leader failed because the regions did (not its client):
        # followers may then take a stale-if-error answer instead of retrying.
        self.error = False
        self._changed = asyncio.Event()

    def changed(self) -> asyncio.Event:
        """An event set at the next change; fetch it *before* checking the state."""
        return self._changed

    def notify(self) -> None:
        # Only followers wait on the event (``followers`` counts them before they do).
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # -- the leader's side -----------------------------------------------

    def started(self, status: int, headers: list[tuple[str, str]], sse: bool) -> None:
        self.status = status
        self.headers = headers
        self.sse = sse
        self.state = STREAMING
        if self.followers:
            self.notify()

    def add(self, chunk: bytes, events: list[SSEEvent] | None = None) -> None:
        self.chunks.append(chunk)
        if events:
            self.events.extend(events)
        if self.followers:
            self.notify()

    def drop_chunks(self) -> None:
        self.chunks.clear()
        self.events.clear()
        self.shareable = False

    def done(self, entry: Entry | None) -> None:
        """The answer is complete; ``entry`` is None when it cannot be replayed (too large)."""
        self.entry = entry
        self.state = DONE
        if self.followers:
            self.notify()

    def fail(self) -> None:
        if self.state in (PENDING, STREAMING):
            self.state = FAILED
            if self.followers:
                self.notify()


class Coalescer:
    """The flights in progress, by cache key."""

    def __init__(self) -> None:
        self.flights: dict[str, Flight] = {}

    def join(self, key: str, attempt: int = 1) -> tuple[Flight, bool]:
        """The flight for ``key`` and whether the caller leads it (a new flight)."""
        flight = self.flights.get(key)
        if flight is None or flight.state == FAILED or not flight.shareable:
            flight = Flight(key, attempt)
            self.flights[key] = flight
            return flight, True
        flight.followers += 1
        return flight, False

    def end(self, flight: Flight) -> None:
        if self.flights.get(flight.key) is flight:
            del self.flights[flight.key]

    def __len__(self) -> int:
        return len(self.flights)


async def wait_started(flight: Flight) -> None:
    """Until the leader has response headers, or gave up."""
    while flight.state == PENDING:
        await flight.changed().wait()


async def wait_finished(flight: Flight) -> None:
    """Until the answer is complete, or the leader gave up."""
    while flight.state in (PENDING, STREAMING):
        await flight.changed().wait()


async def live_events(
    flight: Flight, *, include_usage: bool, dialect: Dialect
) -> AsyncIterator[bytes]:
    """The leader's SSE events for a follower, as they arrive.

    Each goes whole, as the leader's one parse read it, and the usage-only event (OpenAI's
    include_usage chunk) is left out without ``include_usage``. A broken leader ends it
    with :class:`AnswerBroken`, numbered after the events sent: the follower's stream ends
    as the leader's did.
    """
    sent = 0
    events_sent = 0
    while True:
        changed = flight.changed()
        events = flight.events
        if sent < len(events):
            out = []
            for event in events[sent:]:
                if include_usage or not dialect.usage_only(event):
                    out.append(event.raw)
                    events_sent += not event.comment
            sent = len(events)
            if out:
                yield b"".join(out)
        if flight.state == DONE:
            return
        if flight.state == FAILED:
            raise _broken(events_sent)
        await changed.wait()


def _broken(sequence: int) -> AnswerBroken:
    err = ProxyError(
        502, "upstream_error", "the upstream stream broke", code="upstream_stream_broken"
    )
    return AnswerBroken(err, sequence, "the coalesced stream broke upstream")
