"""The attempt loop: failover before the first byte, deadlines, budgets, hedged requests.

:meth:`Failover.send` takes the router's candidates, best first, and returns
the first response worth relaying. Until a region's first body byte (or a
final status) has arrived, nothing has reached the client, so a failure can
still go to the next region:

* transport failures (connect, reset, timeout), the statuses in
  ``[routing] retry_statuses`` and the capacity statuses (429, 503, 529) are retried on
  the next candidate, up to the route's ``retries``, for idempotent methods and for POSTs
  to LLM endpoints (safe: nothing was returned); other requests are retried only when
  the region certainly never saw them (connect failures). Bodies must have been
  buffered to be sent twice; streamed uploads get one attempt;
* a capacity status holds the region off for the request's model until its
  ``Retry-After`` (seconds or an HTTP date) has passed, or for a backoff with jitter
  without one (:mod:`edgeproxy._upstream.cooldown`); a region held off is not tried. When
  no other candidate is left, the request waits for the soonest region held off, if that
  fits its deadline, and otherwise fails (the ladder may answer); the client's 429 or 503
  then says when a region takes the model again;
* a region that is the only candidate is retried itself, after a backoff with jitter: a
  deployment with one region never needs it listed twice;
* retries come out of a budget: over ``budget_window`` seconds at most
  ``retry_budget`` of the requests plus ``retry_budget_min`` per second, so
  an outage does not multiply the load on what is left;
* the route's ``deadline`` bounds everything up to the first byte; past it
  the request fails with :class:`DeadlineExceeded`, a 504 (which the fallback
  ladder may still answer);
* with the route's ``hedge`` on, a request with no first byte after
  ``hedge_delay`` (or the region's recent p95) sends a copy to the next-best
  region; the first to answer wins and the other is cancelled (HTTP/2
  ``RST_STREAM``, or the HTTP/1.1 connection closed). Hedges have their own
  budget, ``hedge_budget``.

A region's 5xx answer counts against it (its health, its errors, its latency) unless
:meth:`Health.blame <edgeproxy._upstream.health.Health.blame>` finds evidence that it is
the caller's own (the region served other callers meanwhile); then two regions rejecting
the same body from the same caller make it poison (:mod:`edgeproxy._stages.poison`): 502
``upstream_rejected_request``, no further attempt, and none at all for that caller's body
while it is known. Capacity statuses are never the caller's.

A non-streamed answer of an LLM endpoint is read to its end inside its
attempt (up to ``WHOLE_BODY_LIMIT``), within the deadline: a region that
resets mid-body has sent the client nothing, so the request is retried whole
on the next region like any failure before the first byte.

Once the winner is handed to the stream stage there is no retry: a stream
that breaks later ends with an SSE error event and a truncated body, unless
the route continues it (``continue_on_break``, see
:mod:`edgeproxy._stages.continuation`).

Every attempt has exactly one owner, which cancels it upstream and stops
counting it on every way out (a failure, the deadline, a plugin's
exception, the client leaving, the proxy shutting down):

* while the request waits for a first byte, the request's :class:`_Plan`;
  whatever it still holds when :meth:`Failover.send` returns or raises is
  cancelled before it does;
* the winner, once returned as an :class:`AttemptResponse`: the caller,
  which relays it and then calls :meth:`AttemptResponse.aclose`;
* with ``keep_late`` (the route's ``deadline_action = "race"``), the
  attempts still running at the deadline: the :class:`PendingUpstream` of
  the :class:`Failure` returned (kind :attr:`FailureKind.DEADLINE`), owned by
  whoever holds that value and closed with :meth:`Failure.aclose`;
  :meth:`PendingUpstream.take` hands its winner over as an :class:`AttemptResponse`.

:meth:`Failover.send` returns a value either way, an :class:`AttemptResponse` or a
:class:`Failure`; no exception carries live work.

An attempt's task that is cancelled lets go of its response itself
(``_Attempt.run``); one that had finished is let go by its owner.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from edgeproxy._core.errors import ProxyError
from edgeproxy._core.types import Headers
from edgeproxy._protocol.dialects import Dialect, dialect_named
from edgeproxy._protocol.endpoints import endpoint_suffixes
from edgeproxy._protocol.models import model_from_body
from edgeproxy._protocol.refusals import error_message
from edgeproxy._protocol.sse import SSEEventTooLarge, SSEReader
from edgeproxy._stages.deadlines import Deadlines
from edgeproxy._stages.poison import Poison, caller_key
from edgeproxy._upstream.cooldown import retry_after_seconds, soonest
from edgeproxy._upstream.health import CAPACITY_STATUSES
from edgeproxy._upstream.pool import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
)
from edgeproxy._upstream.regions import Endpoint, Region, RegionSet
from edgeproxy._upstream.reported import LOAD_FORMAT_HEADER, without_load_header

if TYPE_CHECKING:
    from edgeproxy._core.config import Config
    from edgeproxy._core.context import RequestContext
    from edgeproxy._core.exchange import Exchange
    from edgeproxy._stages.upstream import UpstreamStage

__all__ = [
    "AttemptResponse",
    "Budget",
    "DeadlineExceeded",
    "Failover",
    "Failure",
    "FailureKind",
    "PendingUpstream",
    "no_region",
]

logger = logging.getLogger("edgeproxy")

IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
# OpenAI-style endpoints where a repeated POST only costs compute: nothing
# was returned, so nothing can be applied twice.
LLM_SUFFIXES = endpoint_suffixes("retry_safe")
# Hedging waits for this much history before trusting a region's p95.
HEDGE_MIN_SAMPLES = 20
# A non-streamed LLM answer up to this size is read whole inside its attempt (see
# _Attempt._read_whole); a larger one streams through and a break in it is final.
WHOLE_BODY_LIMIT = 8 * 1024 * 1024
# The opening events of a stream held until one commits it to its region (_until_content).
HOLD_LIMIT = 64 * 1024
_NO_BODY = frozenset({204, 304})
# The backoff before a lone region is retried itself: doubled per attempt, with jitter.
SAME_REGION_BACKOFF = 0.25
_ids = itertools.count(1)


def model_of(ctx: RequestContext) -> str:
    """The model a region is asked for, for its cooldowns ("" for a request with none)."""
    model = ctx.model
    if model is None:
        named = model_from_body(ctx.json) if ctx.body_read else None
        model = named if isinstance(named, str) else ""
    return model


class Budget:
    """Extra work allowed over a sliding window: ``ratio`` of requests, plus ``min_per_s``.

    Counted in ten buckets across the window, so old traffic stops counting
    smoothly rather than all at once.
    """

    __slots__ = ("ratio", "reserve", "slot", "_requests", "_spent", "_epoch")

    def __init__(self, ratio: float, min_per_s: float, window: float) -> None:
        self.ratio = ratio
        self.reserve = min_per_s * window
        self.slot = window / 10
        self._requests = [0] * 10
        self._spent = [0] * 10
        self._epoch = 0

    def _advance(self, now: float) -> int:
        epoch = int(now / self.slot)
        if epoch != self._epoch:
            for e in range(max(self._epoch + 1, epoch - 9), epoch + 1):
                self._requests[e % 10] = 0
                self._spent[e % 10] = 0
            self._epoch = epoch
        return epoch % 10

    def deposit(self, now: float | None = None) -> None:
        """Count one request."""
        if now is None:
            now = time.monotonic()
        epoch = int(now / self.slot)
        # _advance() only when a bucket ends: most requests land in the current one.
        self._requests[(epoch if epoch == self._epoch else self._advance(now)) % 10] += 1

    def available(self, now: float | None = None) -> float:
        self._advance(time.monotonic() if now is None else now)
        return self.reserve + self.ratio * sum(self._requests) - sum(self._spent)

    def try_spend(self, now: float | None = None) -> bool:
        """Take one unit of extra work if the budget allows it."""
        now = time.monotonic() if now is None else now
        if self.available(now) < 1:
            return False
        self._spent[self._advance(now)] += 1
        return True


class _Attempt:
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
        "neutral",
        "rejected",
        "_released",
    )

    def __init__(self, failover: Failover, region: Region, kind: str, tried: set[Endpoint]) -> None:
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
        reader = SSEReader(max_event=HOLD_LIMIT)
        commits = dialect.commits
        held = [self.first]
        size = len(self.first)
        try:
            if any(commits(event) for event in reader.feed(self.first)):
                return
            async for chunk in self.iterator:
                held.append(chunk)
                size += len(chunk)
                if size > HOLD_LIMIT or any(commits(event) for event in reader.feed(chunk)):
                    break
            else:
                self.eof = True
        except SSEEventTooLarge:
            pass  # held no further: what came so far goes out as it came
        finally:
            self.first = b"".join(held)

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
    """The winning attempt's response, as the stream stage reads it.

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

    def __init__(self, attempt: _Attempt, attempts: int, *, hedged: bool = False) -> None:
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

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        attempt = self.attempt
        if attempt.iterator is None:
            assert attempt.response is not None
            attempt.iterator = attempt.response.aiter_bytes().__aiter__()
        elif attempt.first is not None:
            first, attempt.first = attempt.first, None
            if first:
                yield first
        if attempt.eof:
            return
        try:
            async for chunk in attempt.iterator:
                yield chunk
        except UpstreamError as exc:
            attempt.broke(exc)
            raise
        attempt.body_done()

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


class DeadlineExceeded(ProxyError):
    """504 ``deadline_exceeded``: no first byte by the route's deadline."""

    def __init__(self, deadline: float, *, headers: dict[str, str]) -> None:
        super().__init__(
            504,
            "upstream_timeout",
            f"no region answered within the route's deadline of {deadline:g}s",
            code="deadline_exceeded",
            headers=headers,
        )


def no_region() -> ProxyError:
    """The 503 of a request no region may serve."""
    return ProxyError(503, "no_region", "no region may serve this request", code="no_region")


class FailureKind(enum.Enum):
    """Why no region answered a request, which decides what may still answer it."""

    NO_REGION = "no_region"
    """No region may serve it (none configured for it, or none left to try)."""
    OVERLOADED = "overloaded"
    """Admission shed it, or every region it may use is at its concurrency limit."""
    DEADLINE = "deadline"
    """No first byte by the route's deadline."""
    UPSTREAM = "upstream"
    """Every attempt failed: a transport error, or a status the route retries."""
    MODEL_UNKNOWN = "model_unknown"
    """No region serves the request's model (404): only the local model may answer."""
    RESIDENCY = "residency"
    """A residency rule allows no available region: refused, never degraded."""
    BAD_REQUEST = "bad_request"
    """The request cannot be routed as sent (a model that is not a name): never degraded."""
    OWNER_UNAVAILABLE = "owner_unavailable"
    """The one region holding the request's state is unavailable: 503, never another
    region (it would answer 404), never degraded."""
    REJECTED = "rejected"
    """Two regions answered this request's body with 5xx (a poison request, see
    :mod:`edgeproxy._stages.poison`): 502, never tried further, never degraded."""


class Failure:
    """A request the regions could not answer: its kind, the error it gets if nothing else
    answers, and the attempts still running past the deadline (``deadline_action =
    "race"``), which this value owns: :meth:`aclose` cancels them, and its holder calls it
    on every way out (it is idempotent).

    It also says what was tried, for the obtain path to record on the request
    (:func:`edgeproxy._obtain.record`): the ``attempts`` sent, the ``region`` the latest
    of them went to (None when none was sent), and whether a hedge was (``hedged``).
    """

    __slots__ = ("error", "kind", "pending", "attempts", "region", "hedged")

    def __init__(
        self,
        kind: FailureKind,
        error: ProxyError,
        pending: PendingUpstream | None = None,
        *,
        attempts: int = 0,
        region: str | None = None,
        hedged: bool = False,
    ) -> None:
        self.kind = kind
        self.error = error
        self.pending = pending
        self.attempts = attempts
        self.region = region
        self.hedged = hedged

    def with_error(self, error: ProxyError) -> Failure:
        """The same failure (what was tried) answered with ``error`` instead; it holds
        no pending attempts (those stay this value's to close)."""
        return Failure(
            self.kind, error, attempts=self.attempts, region=self.region, hedged=self.hedged
        )

    @property
    def status(self) -> int:
        """The status of :attr:`error`."""
        return self.error.status

    def __repr__(self) -> str:
        return f"Failure({self.kind.name}, {self.error.status} {self.error.code})"

    async def aclose(self) -> None:
        """Cancel the attempts still running, if any; idempotent."""
        pending, self.pending = self.pending, None
        if pending is not None:
            await pending.aclose()


class PendingUpstream:
    """Attempts still running past the deadline, kept for the fallback to race.

    Its holder owns them: :meth:`aclose` cancels every one that
    :meth:`take` did not hand over, and must be called on every path (it is
    idempotent).
    """

    __slots__ = ("_plan", "_running", "_winner")

    def __init__(self, plan: _Plan, running: dict[asyncio.Task[None], _Attempt]) -> None:
        self._plan = plan
        self._running = running
        self._winner: _Attempt | None = None

    async def ready(self) -> bool:
        """Wait until an attempt has its first byte (True) or every one failed (False).

        Failed attempts are let go as they end; a plugin's exception is raised.
        """
        while self._winner is None and self._running:
            running = self._running
            done = {task for task in running if task.done()}
            if not done:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                attempt = running.pop(task)
                task.result()  # a plugin failed: its attempt already let itself go
                if attempt.ok and self._winner is None:
                    self._winner = attempt
                else:
                    await attempt.discard()
        return self._winner is not None

    def take(self) -> AttemptResponse:
        """The attempt :meth:`ready` found, handed over: the caller owns it from now on."""
        winner, self._winner = self._winner, None
        if winner is None:
            raise RuntimeError("no attempt is ready to be taken")
        return self._plan.win(winner)

    async def aclose(self) -> None:
        """Cancel every attempt still held, upstream, and stop counting it."""
        running, self._running = self._running, {}
        winner, self._winner = self._winner, None
        if winner is not None:
            await winner.discard()
        await _cancel(running)


async def _cancel(running: dict[asyncio.Task[None], _Attempt]) -> None:
    """Cancel the attempts of ``running`` upstream and stop counting them; it is emptied."""
    attempts = list(running.items())
    running.clear()
    for task, _ in attempts:
        task.cancel()
    # A task that had already finished holds its attempt's response: let go of it here. A
    # cancelled one lets go of its own (_Attempt.run); one that never started holds nothing.
    for task, attempt in attempts:
        if task.done():
            await attempt.discard()
    if attempts:
        await asyncio.gather(*(task for task, _ in attempts), return_exceptions=True)


def _is_sse(headers: Headers) -> bool:
    for name, value in headers:
        if name.lower() == "content-type":
            return value.startswith("text/event-stream")
    return False


class Failover:
    """Sends a request to its candidates in turn, or races two of them, before the first byte."""

    def __init__(
        self,
        config: Config,
        regions: RegionSet,
        upstream: UpstreamStage,
        *,
        poison: Poison | None = None,
    ) -> None:
        routing = config.routing
        self.regions = regions
        self.health = regions.health
        self.upstream = upstream
        self.retry_statuses = frozenset(routing.retry_statuses)
        self.retry_budget = Budget(
            routing.retry_budget, routing.retry_budget_min, routing.budget_window
        )
        self.hedge_budget = Budget(
            routing.hedge_budget, routing.hedge_budget_min, routing.budget_window
        )
        self.deadlines = Deadlines()
        self.poison = Poison(config, clock=regions.clock) if poison is None else poison
        # How the attempt loop waits for a region held off, and draws its jitter: the
        # tests inject both, with the region set's clock.
        self.sleep = asyncio.sleep
        self.random = random.random

    def cool(
        self,
        region: Region,
        ctx: RequestContext,
        status: int,
        response: UpstreamResponse | None,
    ) -> float:
        """``region`` answered ``ctx`` with a capacity status: hold it off for the model
        until its Retry-After, or for a backoff without one (429 only: a 503 or 529 with no
        Retry-After is left to outlier ejection). Returns the wait."""
        value = None
        if response is not None:
            for name, header in response.headers:
                if name.lower() == "retry-after":
                    value = header
                    break
        retry_after = retry_after_seconds(value)
        if retry_after is None and status != 429:
            return 0.0
        return region.cooldowns.refused(
            model_of(ctx), status, retry_after, self.regions.clock(), jitter=self.random()
        )

    async def send(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        candidates: Sequence[Region],
        *,
        keep_late: bool = False,
    ) -> AttemptResponse | Failure:
        """The first good response among ``candidates``, or the :class:`Failure` saying why
        none came.

        A failure is :attr:`~FailureKind.UPSTREAM` (502/504, or the region's own 5xx
        status) when every attempt failed, :attr:`~FailureKind.DEADLINE` (504) when the
        route's deadline passed first, and :attr:`~FailureKind.OVERLOADED` (503) when
        every candidate's circuit breaker was open. Nothing is left running upstream
        then, except, with ``keep_late``, the attempts a deadline failure holds in its
        ``pending``. The caller owns what is returned: it closes the response, or the
        failure (:meth:`Failure.aclose`).

        ``request`` is None for a request with no client (a background cache
        refresh): its body must have been buffered.
        """
        if self.poison.known:
            # A body two regions rejected lately: not sent again (no attempt).
            refused = self.poison.rejection(ctx)
            if refused is not None:
                self.poison.strike(ctx)
                return Failure(FailureKind.REJECTED, refused)
        now = time.monotonic()
        self.retry_budget.deposit(now)
        self.hedge_budget.deposit(now)
        route = ctx.route
        remaining = ctx.started + route.deadline - now
        plan = _Plan(self, request, ctx, candidates, keep_late=keep_late)
        if route.hedge and plan.replayable and plan.retry_safe and len(candidates) > 1:
            return await plan.race(remaining)
        return await plan.in_turn(remaining)

    def hedge_delay(self, ctx: RequestContext, region: Region) -> float | None:
        """Seconds to wait for a first byte before hedging; None: not enough history."""
        if ctx.route.hedge_delay is not None:
            return ctx.route.hedge_delay
        if len(region.ttfb) < HEDGE_MIN_SAMPLES:
            return None
        return region.ttfb.p95()


class _Plan:
    """The attempts of one request: what was tried, what may come next.

    It owns every attempt it starts until one wins (returned to the caller)
    or the deadline hands the ones still running over (``keep_late``);
    :meth:`in_turn` and :meth:`race` cancel whatever else they hold on the way out.
    """

    def __init__(
        self,
        failover: Failover,
        request: Exchange | None,
        ctx: RequestContext,
        candidates: Sequence[Region],
        *,
        keep_late: bool = False,
    ) -> None:
        self.failover = failover
        self.request = request
        self.ctx = ctx
        self.queue = list(candidates)
        self.replayable = ctx.body_read
        self.retry_safe = ctx.method in IDEMPOTENT or ctx.path.endswith(LLM_SUFFIXES)
        self.tried = 0
        self.tried_endpoints: set[Endpoint] = set()
        # deadline_action = "race": attempts outlive the deadline, for the fallback to race.
        self.keep_late = keep_late
        self.overloaded = 0
        self.last: _Attempt | None = None
        # What the values returned say of the attempts: the region the latest went to,
        # whether a hedge was sent (the count is `tried`).
        self.latest: Region | None = None
        self.hedged = False
        # The candidates held off for the request's model (429, 503, 529), and whether the
        # request has no other candidate (a lone region is retried itself).
        self.cooling: list[Region] = []
        self.lone = len(candidates) == 1

    def attempt(self, region: Region, kind: str) -> _Attempt:
        self.tried += 1
        self.latest = region
        return _Attempt(self.failover, region, kind, self.tried_endpoints)

    def next_region(self) -> Region | None:
        """The next candidate whose circuit breaker lets a request through and that is not
        held off for the request's model."""
        health = self.failover.health
        while self.queue:
            region = self.queue.pop(0)
            if health.overloaded(region):
                region.record_overflow()
                self.overloaded += 1
                continue
            if region.cooldowns and self._held_off(region) > 0:
                continue
            return region
        return None

    def _held_off(self, region: Region) -> float:
        """Seconds ``region`` is still held off for the request's model (noted if any)."""
        wait = region.cooldowns.until(model_of(self.ctx)) - self.failover.regions.clock()
        if wait > 0 and region not in self.cooling:
            self.cooling.append(region)
        return wait

    def waiting(self) -> tuple[Region, float] | None:
        """With no candidate left: the region to try again and the seconds to wait first,
        the soonest of those held off, or a lone region after its backoff; None when
        there is none."""
        waits = [(r, self._held_off(r)) for r in self.cooling]
        last = self.last
        if self.lone and last is not None and last.region not in self.cooling:
            backoff = SAME_REGION_BACKOFF * 2 ** max(0, self.tried - 1)
            waits.append((last.region, backoff * (0.5 + 0.5 * self.failover.random())))
        if not waits:
            return None
        return min(waits, key=lambda pair: pair[1])

    def may_retry(self, failed: _Attempt) -> bool:
        if not self.replayable or self.tried > self.ctx.route.retries:
            return False
        certainly_unseen = isinstance(failed.error, UpstreamError) and failed.error.retryable
        return self.retry_safe or certainly_unseen

    async def keep_failure(self, attempt: _Attempt) -> None:
        """Remember the latest failure for the error; let go of the one before.

        A region with another endpoint this request has not tried goes back to
        the front of the queue: a dead endpoint is not a dead region.
        """
        previous, self.last = self.last, attempt
        if previous is not None:
            await previous.discard()
        region = attempt.region
        if region.cooldowns:
            self._held_off(region)  # noted, if it now holds off: the wait and Retry-After
        if region not in self.queue and any(
            e not in self.tried_endpoints and e.state != "down" for e in region.endpoints
        ):
            self.queue.insert(0, region)

    async def drop_failure(self) -> None:
        """Let go of the failure kept for the error message."""
        last, self.last = self.last, None
        if last is not None:
            await last.discard()

    async def in_turn(self, remaining: float) -> AttemptResponse | Failure:
        """One attempt at a time: the next candidate only after a failure."""
        # The attempt in flight, when it runs as a task (keep_late: it may outlive the
        # deadline); whatever is left here on the way out is cancelled.
        running: dict[asyncio.Task[None], _Attempt] = {}
        try:
            while True:
                if self.tried and (self.last is None or not self.may_retry(self.last)):
                    break
                if remaining <= 0:
                    return self.deadline_failure(running)
                region = self.next_region()
                if region is None:
                    again = self.waiting()
                    if again is None or again[1] >= remaining:
                        break
                    region, wait = again
                    if self.tried and not self.failover.retry_budget.try_spend():
                        break
                    if wait > 0:
                        await self.failover.sleep(wait)
                        remaining = self.ctx.started + self.ctx.route.deadline - time.monotonic()
                elif self.tried and not self.failover.retry_budget.try_spend():
                    break
                attempt = self.attempt(region, "retry" if self.tried else "first")
                if self.keep_late:
                    task = asyncio.get_running_loop().create_task(
                        attempt.run(self.request, self.ctx)
                    )
                    running[task] = attempt
                    done, _ = await asyncio.wait(running, timeout=remaining)
                    if not done:
                        return self.deadline_failure(running)
                    del running[task]
                    task.result()  # a plugin's failure ends the request
                else:
                    deadlines = self.failover.deadlines
                    watch = deadlines.watch(asyncio.get_running_loop(), remaining)
                    try:
                        await attempt.run(self.request, self.ctx)
                    except asyncio.CancelledError:
                        if watch.expired():
                            return self.deadline_failure(running)
                        raise
                    finally:
                        deadlines.release(watch)
                if attempt.ok:
                    return self.win(attempt)
                await self.keep_failure(attempt)
                if attempt.rejected is not None:
                    return self.rejected_failure(attempt.rejected)
                remaining = self.ctx.started + self.ctx.route.deadline - time.monotonic()
            return await self.failure()
        finally:
            # Both are no-ops for a request that got its answer at the first attempt.
            if running:
                await _cancel(running)
            if self.last is not None:
                await self.drop_failure()

    async def race(self, remaining: float) -> AttemptResponse | Failure:
        """The first attempt, a hedge if it is slow, retries after failures; first answer wins."""
        ctx, failover = self.ctx, self.failover
        deadline = time.monotonic() + remaining
        # The attempts in flight; whatever is left here on the way out is cancelled.
        running: dict[asyncio.Task[None], _Attempt] = {}
        loop = asyncio.get_running_loop()

        def start(region: Region, kind: str) -> None:
            attempt = self.attempt(region, kind)
            running[loop.create_task(attempt.run(self.request, ctx))] = attempt

        try:
            region = self.next_region()
            if region is None:
                return await self.failure()
            start(region, "first")
            delay = failover.hedge_delay(ctx, region)
            hedge_at = math.inf if delay is None else time.monotonic() + delay
            while running:
                now = time.monotonic()
                if now >= deadline:
                    return self.deadline_failure(running)
                done, _ = await asyncio.wait(
                    running,
                    timeout=min(deadline, hedge_at) - now,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done:
                    if time.monotonic() >= hedge_at:
                        hedge_at = math.inf
                        region = self.next_region() if self.queue else None
                        if region is not None and failover.hedge_budget.try_spend():
                            self.hedged = True
                            start(region, "hedge")
                    continue
                for task in done:
                    attempt = running.pop(task)
                    task.result()  # a plugin's failure ends the request
                    if attempt.ok:
                        return self.win(attempt)
                    await self.keep_failure(attempt)
                    if attempt.rejected is not None:
                        return self.rejected_failure(attempt.rejected)
                if not running and self.last is not None and self.may_retry(self.last):
                    region = self.next_region()
                    if region is not None and failover.retry_budget.try_spend():
                        start(region, "retry")
            return await self.failure()
        finally:
            # The losers, and everything else still held: cancelled upstream, uncounted.
            await _cancel(running)
            await self.drop_failure()

    def win(self, attempt: _Attempt) -> AttemptResponse:
        """``attempt`` answered: the response the caller owns from now on."""
        return AttemptResponse(attempt, self.tried, hedged=self.hedged)

    def _failure(
        self, kind: FailureKind, error: ProxyError, pending: PendingUpstream | None = None
    ) -> Failure:
        latest = self.latest
        return Failure(
            kind,
            error,
            pending,
            attempts=self.tried,
            region=None if latest is None else latest.name,
            hedged=self.hedged,
        )

    def _headers(self) -> dict[str, str]:
        if self.tried > 1:
            return {"X-Edgeproxy-Attempts": str(self.tried)}
        return {}

    def deadline_failure(self, running: dict[asyncio.Task[None], _Attempt]) -> Failure:
        """The failure (a 504) of a request with no first byte by the route's deadline.

        With ``keep_late``, the attempts still ``running`` move into the
        failure's ``pending``, for the fallback to race against its local
        answer: ``running`` is emptied, so the caller's cleanup leaves them
        alone. Otherwise they stay in ``running`` and are cancelled with it.
        """
        pending = None
        if self.keep_late and running:
            pending = PendingUpstream(self, dict(running))
            running.clear()
        error = DeadlineExceeded(self.ctx.route.deadline, headers=self._headers())
        return self._failure(FailureKind.DEADLINE, error, pending)

    def rejected_failure(self, error: ProxyError) -> Failure:
        """The failure of a request whose body turned out poison: its caller's strike."""
        self.failover.poison.strike(self.ctx)
        error.headers.update(self._headers())
        return self._failure(FailureKind.REJECTED, error)

    async def failure(self) -> Failure:
        """The failure of a request whose attempts all failed (or that got none)."""
        error = await self._failure_error()
        if self.last is not None:
            return self._failure(FailureKind.UPSTREAM, error)
        kind = FailureKind.OVERLOADED if self.overloaded or self.cooling else FailureKind.NO_REGION
        return self._failure(kind, error)

    def _retry_after(self) -> str | None:
        """Whole seconds until the soonest region held off takes the model again: the
        Retry-After the client can trust. None when none is held off."""
        waits = [w for r in self.cooling if (w := self._held_off(r)) > 0]
        return str(soonest(waits)) if waits else None

    async def _failure_error(self) -> ProxyError:
        attempt = self.last
        headers = self._headers()
        retry_after = self._retry_after()
        if attempt is None:
            if retry_after is not None:
                return _held_off_error(self.cooling, model_of(self.ctx), retry_after, headers)
            if self.overloaded:
                return ProxyError(
                    503,
                    "overloaded",
                    "every region that may serve this request is at its concurrency limit",
                    code="region_overloaded",
                    headers={**headers, "Retry-After": "1"},
                )
            return no_region()
        name = attempt.region.name
        exc = attempt.error
        if isinstance(exc, UpstreamTimeout):
            return ProxyError(
                504,
                "upstream_timeout",
                f"region {name} timed out ({exc.phase})",
                code="upstream_timeout",
                headers=headers,
            )
        if exc is not None:
            # The client learns which region and what kind of failure; the detail (the
            # region's address, a parser's text) is for the log only.
            logger.warning("request %s: region %s failed: %s", self.ctx.request_id, name, exc)
            return ProxyError(
                502,
                "upstream_error",
                f"region {name} failed: {_failure_reason(exc)}",
                code="bad_gateway",
                headers=headers,
            )
        assert attempt.response is not None
        for key, value in attempt.response.headers:
            if key.lower() == "retry-after":
                headers["Retry-After"] = value
        if retry_after is not None:
            headers["Retry-After"] = retry_after
        detail = await _error_detail(attempt.response)
        return ProxyError(
            attempt.failed_status,
            "upstream_error",
            f"region {name} answered {attempt.failed_status}" + (f": {detail}" if detail else ""),
            code="upstream_unavailable",
            headers=headers,
        )


def _held_off_error(
    cooling: list[Region], model: str, retry_after: str, headers: dict[str, str]
) -> ProxyError:
    """The 429 (every region rate-limited the model) or 503 of a request no region may be
    asked for yet, with the Retry-After at which the soonest takes it again."""
    limited = all(r.cooldowns.status(model) == 429 for r in cooling)
    names = ", ".join(r.name for r in cooling)
    return ProxyError(
        429 if limited else 503,
        "rate_limit_exceeded" if limited else "overloaded",
        f"every region serving this model asked to hold off ({names}): retry after {retry_after}s",
        code="upstream_rate_limited" if limited else "region_overloaded",
        headers={**headers, "Retry-After": retry_after},
    )


def _failure_reason(exc: UpstreamError) -> str:
    """A short reason for a failed attempt, safe to show a client."""
    if isinstance(exc, UpstreamConnectError):
        return "cannot connect"
    if isinstance(exc, UpstreamProtocolError):
        return "malformed response or broken connection"
    return "upstream error"


async def _error_detail(response: UpstreamResponse, limit: int = 8192) -> str | None:
    """The ``error.message`` of a region's small JSON error body, if it has one."""
    body = b""
    try:
        async with asyncio.timeout(1.0):
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    return None
    except (TimeoutError, UpstreamError):
        return None
    return error_message(body)
