"""One attempt: a request sent to one region, up to its first body byte, and its accounting.

:class:`Attempt` sends, waits for the headers, and for a 2xx the first body chunk (a
non-streamed LLM answer whole, a stream up to the event that commits it), then says what
happened: an answer (:attr:`Attempt.ok`), a transport error, a status the attempt loop
retries, or the caller's own 5xx (``neutral``). It judges the region on the way: its
latency, its health (through :meth:`Health.blame
<edgeproxy._upstream.health.Health.blame>`, which needs evidence before a 5xx is the
caller's), the models it holds off (429, 503, 529), and poison bodies.
:class:`AttemptResponse` is the winner, as the relay reads it.

The attempt loop (:mod:`edgeproxy._obtain.failover`) owns every attempt; what an attempt
needs of it is :class:`AttemptLoop`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

from edgeproxy._admission.poison import Poison, caller_key
from edgeproxy._core.errors import ProxyError
from edgeproxy._core.types import Headers
from edgeproxy._protocol.dialects import Dialect, dialect_named
from edgeproxy._protocol.endpoints import endpoint_suffixes
from edgeproxy._protocol.modelnames import model_from_body
from edgeproxy._protocol.sse import MAX_EVENT, SSEEvent, SSEEventTooLarge, SSEReader
from edgeproxy._upstream.health import CAPACITY_STATUSES, Health
from edgeproxy._upstream.pool import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)
from edgeproxy._upstream.regions import Endpoint, Region, RegionSet
from edgeproxy._upstream.reported import LOAD_FORMAT_HEADER, without_load_header

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext
    from edgeproxy._core.exchange import Exchange
    from edgeproxy._obtain.forward import UpstreamStage

__all__ = [
    "HOLD_LIMIT",
    "LLM_SUFFIXES",
    "WHOLE_BODY_LIMIT",
    "Attempt",
    "AttemptLoop",
    "AttemptResponse",
    "model_of",
]

# OpenAI-style endpoints where a repeated POST only costs compute: nothing
# was returned, so nothing can be applied twice.
LLM_SUFFIXES = endpoint_suffixes("retry_safe")
# A non-streamed LLM answer up to this size is read whole inside its attempt (see
# Attempt._read_whole); a larger one streams through and a break in it is final.
WHOLE_BODY_LIMIT = 8 * 1024 * 1024
# The opening events of a stream held until one commits it to its region (_until_content).
HOLD_LIMIT = 64 * 1024
_NO_BODY = frozenset({204, 304})
_ids = itertools.count(1)


def model_of(ctx: RequestContext) -> str:
    """The model a region is asked for, for its cooldowns ("" for a request with none)."""
    model = ctx.model
    if model is None:
        named = model_from_body(ctx.json) if ctx.body_read else None
        model = named if isinstance(named, str) else ""
    return model


class AttemptLoop(Protocol):
    """What an attempt needs of the loop that owns it
    (:class:`edgeproxy._obtain.failover.Failover`)."""

    upstream: UpstreamStage
    regions: RegionSet
    health: Health
    poison: Poison
    retry_statuses: frozenset[int]

    def cool(
        self, region: Region, ctx: RequestContext, status: int, response: UpstreamResponse | None
    ) -> float: ...


class Attempt:
    """One request to one region, from sending to the first body byte, and its accounting."""

    __slots__ = (
        "failover",
        "region",
        "endpoint",
        "kind",
        "id",
        "started",
        "headers_at",
        "response",
        "iterator",
        "first",
        "eof",
        "error",
        "failed_status",
        "sse",
        "reader",
        "opening",
        "neutral",
        "rejected",
        "_released",
    )

    def __init__(
        self, failover: AttemptLoop, region: Region, kind: str, tried: set[Endpoint]
    ) -> None:
        self.failover = failover
        self.region = region
        self.endpoint: Endpoint = region.pick_endpoint(exclude=tried)
        tried.add(self.endpoint)
        self.kind = kind
        self.id = next(_ids)
        self.started = 0.0
        self.headers_at = 0.0
        self.response: UpstreamResponse | None = None
        self.iterator: AsyncIterator[bytes] | None = None
        self.first: bytes | None = None
        self.eof = False
        self.error: UpstreamError | None = None
        self.failed_status = 0
        self.sse = False
        # A stream's one reader, and the events of ``first`` it read (_until_content).
        self.reader: SSEReader | None = None
        self.opening: list[SSEEvent] | None = None
        # A 5xx the caller caused (Health.blame): nothing of it counts against the region.
        self.neutral = False
        # The 502 of a request whose body this 5xx made poison: not tried further.
        self.rejected: ProxyError | None = None
        # Nothing to release until run() counts the attempt: a task cancelled before
        # it started must not uncount anything.
        self._released = True

    @property
    def ok(self) -> bool:
        return self.response is not None and not self.failed_status and self.error is None

    async def run(self, request: Exchange | None, ctx: RequestContext) -> None:
        """Send, wait for the headers and (for a 2xx) the first body chunk."""
        region, endpoint = self.region, self.endpoint
        now = self.started = time.monotonic()
        region.attempt_started(endpoint, self.id, self.kind, now)
        self._released = False
        failover = self.failover
        try:
            response = self.response = await failover.upstream.send(request, ctx, region, endpoint)
            self.headers_at = time.monotonic()
            if region.reads_load:
                # The load the region reports (ORCA endpoint-load-metrics), kept off the
                # client's answer when the proxy asked for it and the client did not.
                region.reported.from_headers(response.headers, failover.regions.clock)
                if region.asks_load and LOAD_FORMAT_HEADER not in ctx.headers:
                    response.headers = without_load_header(response.headers)
            status = response.status
            if status in failover.retry_statuses or status in CAPACITY_STATUSES:
                self.failed_status = status
            elif 200 <= status < 300 and status not in _NO_BODY and ctx.method != "HEAD":
                self.sse = _is_sse(response.headers)
                self.iterator = response.aiter_bytes().__aiter__()
                try:
                    self.first = await anext(self.iterator)
                except StopAsyncIteration:
                    self.eof = True
                else:
                    if not self.sse and ctx.method == "POST" and ctx.path.endswith(LLM_SUFFIXES):
                        await self._read_whole()
                    elif self.sse:
                        facts = ctx.facts
                        if facts is not None and facts.dialect is not None:
                            await self._until_content(dialect_named(facts.dialect))
        except UpstreamError as exc:
            self.error = exc
        except BaseException:
            # Cancelled (a hedge lost, the client left, the deadline, shutdown) or a
            # plugin failed: this task lets go of the attempt itself.
            region.attempt_answered(self.id)
            await self.discard()
            raise
        now = time.monotonic()
        region.attempt_answered(self.id)
        if self.error is not None or self.failed_status:
            self._failed(now, ctx)
            return
        failed = self.response is not None and self.response.status >= 500
        if failed and not self._blamed(ctx):
            self.neutral = True  # the caller's own 5xx, relayed: the region is not judged
            return
        if not failed:
            # Evidence, should another caller's 5xx come, that the region serves.
            failover.health.served(region, caller_key(ctx, failover.poison.key_header))
            if region.cooldowns:
                region.cooldowns.answered(model_of(ctx))
        region.ttfb.add(now - self.started)
        if self.sse or self.eof:
            region.latency.observe(now - self.started, now)
        failover.health.record(region, failed=failed)

    async def _read_whole(self) -> None:
        """Read a non-streamed LLM answer to its end (up to ``WHOLE_BODY_LIMIT``) before it
        counts as an answer: a region that breaks mid-body has then sent the client nothing,
        and the request can go whole to the next region."""
        assert self.iterator is not None and self.first is not None
        parts = [self.first]
        size = len(self.first)
        async for chunk in self.iterator:
            parts.append(chunk)
            size += len(chunk)
            if size > WHOLE_BODY_LIMIT:
                break  # too big to hold: the rest streams as it comes, as before
        else:
            self.eof = True
        self.first = b"".join(parts)

    def _blamed(self, ctx: RequestContext) -> bool:
        """This attempt's 5xx: whether it counts against the region (several callers got
        them, :meth:`Health.blame`); if not, whether it made the request's body poison (a
        region failing for everyone is an outage, never a reason to reject a body)."""
        failover, region = self.failover, self.region
        assert self.response is not None
        status = self.response.status
        if failover.health.blame(
            region, caller_key(ctx, failover.poison.key_header), status=status
        ):
            return True
        self.rejected = failover.poison.failed(ctx, region.name, self.response.status)
        return False

    async def _until_content(self, dialect: Dialect) -> None:
        """Hold a stream's opening events (chat's role delta, ``response.created``,
        ``message_start``) until one that commits it comes, as its dialect says (its first
        content, its end, an error), up to ``HOLD_LIMIT`` bytes: a region that breaks before
        has sent the client nothing, and the request goes whole to the next region. They go
        out together, in order."""
        assert self.iterator is not None and self.first is not None
        # The region's stream is read here, once: the opening events are kept for the
        # stages that look at them (the owner's id), and the reader goes on for those
        # that read further (a continuation leg's first token).
        reader = self.reader = SSEReader(max_event=HOLD_LIMIT)
        opening: list[SSEEvent] = []
        self.opening = opening
        commits = dialect.commits
        held = [self.first]
        size = len(self.first)
        try:
            opening.extend(reader.feed(self.first))
            if any(commits(event) for event in opening):
                return
            async for chunk in self.iterator:
                held.append(chunk)
                size += len(chunk)
                events = reader.feed(chunk)
                opening.extend(events)
                if size > HOLD_LIMIT or any(commits(event) for event in events):
                    break
            else:
                self.eof = True
        except SSEEventTooLarge:
            # Held no further: what came so far goes out as it came, unread.
            self.reader = self.opening = None
        finally:
            self.first = b"".join(held)
            if self.reader is not None:
                self.reader.max_event = MAX_EVENT

    def _failed(self, now: float, ctx: RequestContext) -> None:
        region, failover = self.region, self.failover
        status = self.failed_status
        if status in CAPACITY_STATUSES:
            failover.cool(region, ctx, status, self.response)
            if status == 429:
                # Busy for this model, not broken: held off for it, nothing else judged.
                return
        elif status and not self._blamed(ctx):
            # A 5xx this caller alone gets: not the region's failure, nor a slow answer.
            self.neutral = True
            return
        region.record_error()
        failover.health.record(region, failed=True, now=now)
        elapsed = now - self.started
        # A failure counts as a slow answer, so that traffic leaves before the
        # ejection threshold is reached; a fast refusal must not look attractive.
        penalty = max(elapsed, 2 * region.latency.value) if region.latency.samples else elapsed
        penalty = max(penalty, region.geo_rtt)
        region.latency.observe(penalty, now)
        failover.health.penalized(region, penalty, failover.regions.clock())
        exc = self.error
        if isinstance(exc, UpstreamConnectError) or (
            isinstance(exc, UpstreamTimeout) and exc.phase == "connect"
        ):
            self.endpoint.mark_down(str(exc))
            failover.regions.schedule_rewarm(self.endpoint)

    def body_done(self) -> None:
        """The whole body arrived: a non-streamed answer's latency is its total time."""
        if not self.sse and not self.eof and not self.neutral:
            now = time.monotonic()
            self.region.latency.observe(now - self.started, now)

    def broke(self, exc: UpstreamError) -> None:
        """The body failed after the first byte: no retry, but it counts against the region."""
        self.region.record_error()
        self.failover.health.record(self.region, failed=True)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.region.attempt_released(self.endpoint)

    async def discard(self) -> None:
        """Cancel whatever is left upstream and stop counting this attempt (idempotent)."""
        try:
            iterator = self.iterator
            if iterator is not None and hasattr(iterator, "aclose"):
                try:
                    await iterator.aclose()
                except RuntimeError:
                    pass  # still running in a task being cancelled: aclose() below resets it
            if self.response is not None:
                await self.response.aclose()
        finally:
            self.release()


class AttemptResponse:
    """The winning attempt's response, as the Responder reads it.

    Replays the first chunk read while racing, records the region's latency
    when a non-streamed body ends, and on :meth:`aclose` releases the
    region's in-flight slot (and cancels the upstream if the body did not end).

    It also says how it was obtained, for the obtain path to record on the request
    (:func:`edgeproxy._obtain.record`): the region that answered, the ``attempts`` it
    took (this one included), whether a hedge was sent (``hedged``), and ``ttfb``, the
    seconds from sending this attempt to its response's headers.
    """

    __slots__ = (
        "attempt",
        "region",
        "status",
        "headers",
        "http_version",
        "attempts",
        "hedged",
        "ttfb",
        "other_model",
    )

    def __init__(self, attempt: Attempt, attempts: int, *, hedged: bool = False) -> None:
        response = attempt.response
        assert response is not None
        self.attempt = attempt
        self.region = attempt.region
        self.attempts = attempts
        self.hedged = hedged
        self.ttfb = attempt.headers_at - attempt.started
        self.status = response.status
        self.headers: Headers = list(response.headers)
        self.http_version = response.http_version
        self.other_model: RequestContext | None = None
        """Another model's request, when it answered instead of the requested model: a
        lighter one (the ladder's ``lighter`` rung) or a larger one (a context window
        too small, the route's ``larger_models``)."""

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as one iterator: :meth:`body`, with its accounting done here."""
        return _Body(self)

    def body(self) -> tuple[bytes | None, AsyncIterator[bytes] | None]:
        """The body as a reader takes it with no iterator of this response's between: the
        first chunk read while racing (None: none) and the rest (None: it ended). The
        reader then says :meth:`broke` or :meth:`body_done`, as :meth:`aiter_bytes`
        does itself."""
        attempt = self.attempt
        if attempt.iterator is None:
            assert attempt.response is not None
            attempt.iterator = attempt.response.aiter_bytes().__aiter__()
            return None, attempt.iterator
        first, attempt.first = attempt.first, None
        return first or None, None if attempt.eof else attempt.iterator

    def broke(self, exc: UpstreamError) -> None:
        """The body read through :meth:`body` broke: counted against the region."""
        self.attempt.broke(exc)

    def body_done(self) -> None:
        """The body read through :meth:`body` ended."""
        if not self.attempt.eof:
            self.attempt.body_done()

    async def read_more(self, limit: int) -> bytes:
        """The body's beginning, read on until it holds ``limit`` bytes or ended, and kept
        to be relayed as it came: what a stage must see of a non-streamed answer before it
        goes out. Raises the :class:`UpstreamError` of a body that broke meanwhile (counted
        against the region)."""
        attempt = self.attempt
        first = attempt.first
        if first is None or attempt.iterator is None or attempt.eof:
            return first or b""
        parts = [first]
        size = len(first)
        try:
            while size < limit:
                try:
                    chunk = await anext(attempt.iterator)
                except StopAsyncIteration:
                    attempt.eof = True
                    break
                parts.append(chunk)
                size += len(chunk)
        except UpstreamError as exc:
            attempt.broke(exc)
            raise
        finally:
            attempt.first = b"".join(parts)
        return attempt.first

    async def read_until(self, found: Callable[[SSEEvent], bool]) -> bool:
        """A stream read on, through its one reader, until an event ``found`` says so (true)
        or its end (false); what is read is kept to be relayed as it came. Raises the
        :class:`UpstreamError` of a body that broke meanwhile (counted against the region),
        or :class:`SSEEventTooLarge`."""
        attempt = self.attempt
        if attempt.opening is not None and any(found(event) for event in attempt.opening):
            return True
        reader = attempt.reader
        if reader is None:
            reader = attempt.reader = SSEReader()
            if attempt.first:
                if any(found(event) for event in reader.feed(attempt.first)):
                    return True
        iterator = attempt.iterator
        if iterator is None or attempt.eof:
            return False
        parts = [attempt.first or b""]
        try:
            async for chunk in iterator:
                parts.append(chunk)
                if any(found(event) for event in reader.feed(chunk)):
                    return True
            attempt.eof = True
            return False
        except UpstreamError as exc:
            attempt.broke(exc)
            raise
        finally:
            attempt.first = b"".join(parts)

    async def read_error(self, limit: int) -> bytes:
        """A refusal's body (a 4xx), read whole up to ``limit`` bytes and kept to be relayed
        as it came, for the obtain path to read its reason; what is past ``limit`` streams
        after it. Raises the :class:`UpstreamError` of a body that broke meanwhile."""
        attempt = self.attempt
        if attempt.iterator is None:
            assert attempt.response is not None
            attempt.iterator = attempt.response.aiter_bytes().__aiter__()
            attempt.first = b""
        return await self.read_more(limit)

    async def aclose(self) -> None:
        await self.attempt.discard()


def _is_sse(headers: Headers) -> bool:
    for name, value in headers:
        if name.lower() == "content-type":
            return value.startswith("text/event-stream")
    return False


class _Body:
    """:meth:`AttemptResponse.aiter_bytes`: a class rather than an async generator, so that
    the compiled build (mypyc has no async generators) compiles it. :meth:`~AttemptResponse.
    body` is taken at the first chunk asked for, as the generator took it."""

    __slots__ = ("_response", "_first", "_rest", "_started")

    def __init__(self, response: AttemptResponse) -> None:
        self._response = response
        self._first: bytes | None = None
        self._rest: AsyncIterator[bytes] | None = None
        self._started = False

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        if not self._started:
            self._started = True
            first, self._rest = self._response.body()
            if first is not None:
                return first
        rest = self._rest
        if rest is None:
            raise StopAsyncIteration
        try:
            return await rest.__anext__()
        except StopAsyncIteration:
            self._rest = None
            self._response.body_done()
            raise
        except UpstreamError as exc:
            self._rest = None
            self._response.broke(exc)
            raise
