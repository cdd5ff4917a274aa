"""Recording the answer the pipeline relays for a cacheable request, and storing it once
complete."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from edgeproxy._cache.entry import Entry
from edgeproxy._cache.flight import Coalescer, Flight
from edgeproxy._cache.plan import CachePlan
from edgeproxy._core.context import RequestContext, UpstreamReply
from edgeproxy._protocol.sse import SSEEvent

if TYPE_CHECKING:
    from edgeproxy._core.config import CacheConfig
    from edgeproxy._plugins import Plugins

__all__ = ["CacheRecorder", "RecordingStage"]


class _NotCached(Protocol):
    @property
    def not_cached(self) -> Counter[str]: ...


class RecordingStage(Protocol):
    """What a recorder uses of :class:`~edgeproxy._cache.stage.CacheStage`: a
    Protocol, as the stage's module imports this one to hand recorders out."""

    @property
    def config(self) -> CacheConfig: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def plugins(self) -> Plugins: ...

    @property
    def stats(self) -> _NotCached: ...

    @property
    def coalescer(self) -> Coalescer: ...

    def storable(
        self, plan: CachePlan, status: int, headers: list[tuple[str, str]]
    ) -> tuple[tuple[float, float, float] | None, str]: ...

    def store(self, key: str, entry: Entry, flight: Flight | None) -> None: ...


class CacheRecorder:
    """Sees the leader's answer as the Responder relays it, and stores it once complete.

    The Responder calls :meth:`start` with the response headers, :meth:`feed`
    with each chunk sent to the client and its events as the Responder's one
    parse read them (appending to a list, nothing that could delay the client)
    and :meth:`finish` once the upstream body ended cleanly. The pipeline calls
    :meth:`release` when the request is over, whatever happened: an answer that
    never finished is not stored, and the followers waiting on it wake up.
    """

    __slots__ = (
        "stage",
        "ctx",
        "plan",
        "flight",
        "chunks",
        "size",
        "kind",
        "status",
        "headers",
        "region",
        "windows",
        "expected",
        "reading",
        "ended",
        "started",
        "active",
        "too_large",
        "finished",
    )

    def __init__(
        self, stage: RecordingStage, ctx: RequestContext, plan: CachePlan, flight: Flight | None
    ) -> None:
        self.stage = stage
        self.ctx = ctx
        self.plan = plan
        self.flight = flight
        self.chunks: list[bytes] = flight.chunks if flight is not None else []
        self.size = 0
        self.kind = "raw"
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.region: str | None = None
        self.windows: tuple[float, float, float] = (0.0, 0.0, 0.0)
        # The body is complete at `expected` bytes (a JSON answer with a Content-Length) or
        # once the stream's last event came, as its dialect ends one (chat's [DONE],
        # Messages' message_stop...): the client may hang up before the upstream's end of
        # body is read, and a complete answer must not be lost to that. `reading`: the
        # stream's events are followed; false once they cannot be (never complete then).
        self.expected: int | None = None
        self.reading = False
        self.ended = False
        self.started = False
        self.active = False
        self.too_large = False
        self.finished = False

    def start(self, reply: UpstreamReply, region: str | None = None) -> None:
        """Response headers arrived (after the plugins' edits): is this answer storable?"""
        self.started = True
        self.status = reply.status
        self.region = region
        content_type = ""
        length = ""
        for name, value in reply.headers:
            lname = name.lower()
            if lname == "content-type":
                content_type = value.lower()
            elif lname == "content-length":
                length = value
        # A chunk plugin changes the length: then only the end of the body says it is whole.
        if length.isdigit() and "edgeproxy_stream_chunk" not in self.stage.plugins.active:
            self.expected = int(length)
        if content_type.startswith("text/event-stream"):
            self.kind = "sse"
            self.reading = True
        elif "json" in content_type:
            self.kind = "json"
        windows, reason = self.stage.storable(self.plan, reply.status, reply.headers)
        if windows is None:
            self.stage.stats.not_cached[reason] += 1
            if self.flight is not None:
                self.flight.fail()
            return
        self.active = True
        self.windows = windows
        self.headers = list(reply.headers)
        # Lets the client (and an operator purging) name the entry.
        reply.headers.append(("X-Edgeproxy-Cache-Key", self.plan.key))
        if self.flight is not None:
            self.flight.region = region
            self.flight.started(reply.status, self.headers, self.kind == "sse")

    @property
    def reads(self) -> bool:
        """Whether it needs every event of the body (a stream it may store or share)."""
        return self.active and self.kind == "sse"

    def feed(self, chunk: bytes, events: list[SSEEvent] | None = None) -> None:
        """A chunk sent to the client, with its events (for a stream, as :attr:`reads`
        asks)."""
        if not self.active or self.finished:
            return
        self.size += len(chunk)
        flight = self.flight
        if (
            self.reading
            and events
            and (not self.too_large or (flight is not None and flight.shareable))
        ):
            self._read(events)
        if not self.too_large and self.size > self.stage.config.max_entry_bytes:
            self.too_large = True
            if flight is None or not flight.followers:
                # Nobody needs the recording any more: stop holding the bytes.
                if flight is not None:
                    flight.drop_chunks()
                else:
                    self.chunks.clear()
        if flight is not None:
            if flight.shareable:
                flight.add(chunk, events)
        elif not self.too_large:
            self.chunks.append(chunk)
        if self.too_large:
            return  # not stored: it ends with the upstream body
        if self.expected is not None:
            if self.size >= self.expected:
                self.finish()
        elif self.ended:
            self.finish()

    def _read(self, events: list[SSEEvent]) -> None:
        """Follow the stream's events: it ends with its dialect's last event, and an
        error anywhere in it means it never completes."""
        dialect = self.plan.dialect
        for event in events:
            if event.comment:
                continue
            if dialect.is_error(event):
                self.reading = False
                self.ended = False
                return
            if dialect.is_end(event):
                self.ended = True

    def unreadable(self) -> None:
        """The stream's events could not be read (one past the reader's bound): it never
        completes, and its followers' streams end as broken."""
        self.reading = False
        self.ended = False
        if self.flight is not None:
            self.flight.fail()

    def finish(self) -> None:
        """The upstream body ended cleanly: store the answer if it is complete."""
        if self.finished:
            return
        self.finished = True
        if not self.active:
            return
        flight = self.flight
        # A stream that did not end as its API ends one was cut: never stored, never replayed.
        complete = self.kind != "sse" or self.ended
        reason = "too_large" if self.too_large else "" if complete else "incomplete"
        # Too large to store, but kept in full while followers needed it.
        kept = not self.too_large or (flight is not None and flight.shareable)
        entry: Entry | None = None
        if complete and kept:
            ttl, swr, sie = self.windows
            entry = Entry.build(
                status=self.status,
                headers=self.headers,
                body=b"".join(self.chunks),
                kind=self.kind,
                ttl=ttl,
                swr=swr,
                sie=sie,
                delta=time.monotonic() - self.ctx.started,
                region=self.region,
                clock=self.stage.clock,
            )
        if flight is not None:
            # Followers get the answer even when it is too large to store.
            flight.done(entry)
        if reason or entry is None:
            if reason:
                self.stage.stats.not_cached[reason] += 1
            if flight is not None:
                self.stage.coalescer.end(flight)
            return
        self.stage.store(self.plan.key, entry, flight)

    def release(self) -> None:
        """The request is over. An answer that did not finish is dropped; followers wake."""
        if self.finished:
            return
        self.finished = True
        if self.active:
            self.stage.stats.not_cached["incomplete"] += 1
        flight = self.flight
        if flight is not None:
            # The regions failed (the fallback answered): followers may take stale-if-error.
            flight_error = not self.started and (
                self.ctx.outcome.status >= 500 or self.ctx.outcome.degraded is not None
            )
            flight.error = flight_error
            flight.fail()
            self.stage.coalescer.end(flight)
