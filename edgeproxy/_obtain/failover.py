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
the same body from the same caller make it poison (:mod:`edgeproxy._admission.poison`): 502
``upstream_rejected_request``, no further attempt, and none at all for that caller's body
while it is known. Capacity statuses are never the caller's.

A non-streamed answer of an LLM endpoint is read to its end inside its
attempt (up to ``WHOLE_BODY_LIMIT``), within the deadline: a region that
resets mid-body has sent the client nothing, so the request is retried whole
on the next region like any failure before the first byte.

Once the winner is handed to the Responder there is no retry: a stream
that breaks later ends with an SSE error event and a truncated body, unless
the route continues it (``continue_on_break``, see
:mod:`edgeproxy._obtain.continuation`).

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
(:meth:`Attempt.run <edgeproxy._obtain.attempt.Attempt.run>`); one that had finished is let
go by its owner.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from edgeproxy._admission.poison import Poison
from edgeproxy._core.errors import ProxyError
from edgeproxy._obtain.attempt import LLM_SUFFIXES, Attempt, AttemptResponse, model_of
from edgeproxy._obtain.budget import Budget
from edgeproxy._obtain.deadlines import Deadlines
from edgeproxy._obtain.failure import DeadlineExceeded, Failure, FailureKind, no_region
from edgeproxy._protocol.refusals import error_message
from edgeproxy._upstream.cooldown import retry_after_seconds, soonest
from edgeproxy._upstream.pool import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
)
from edgeproxy._upstream.regions import Endpoint, Region, RegionSet

if TYPE_CHECKING:
    from edgeproxy._core.config import Config
    from edgeproxy._core.context import RequestContext
    from edgeproxy._core.exchange import Exchange
    from edgeproxy._obtain.forward import UpstreamStage

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
# Hedging waits for this much history before trusting a region's p95.
HEDGE_MIN_SAMPLES = 20
# The backoff before a lone region is retried itself: doubled per attempt, with jitter.
SAME_REGION_BACKOFF = 0.25


class PendingUpstream:
    """Attempts still running past the deadline, kept for the fallback to race.

    Its holder owns them: :meth:`aclose` cancels every one that
    :meth:`take` did not hand over, and must be called on every path (it is
    idempotent).
    """

    __slots__ = ("_plan", "_running", "_winner")

    def __init__(self, plan: _Plan, running: dict[asyncio.Task[None], Attempt]) -> None:
        self._plan = plan
        self._running = running
        self._winner: Attempt | None = None

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


async def _cancel(running: dict[asyncio.Task[None], Attempt]) -> None:
    """Cancel the attempts of ``running`` upstream and stop counting them; it is emptied."""
    attempts = list(running.items())
    running.clear()
    for task, _ in attempts:
        task.cancel()
    # A task that had already finished holds its attempt's response: let go of it here. A
    # cancelled one lets go of its own (Attempt.run); one that never started holds nothing.
    for task, attempt in attempts:
        if task.done():
            await attempt.discard()
    if attempts:
        await asyncio.gather(*(task for task, _ in attempts), return_exceptions=True)


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
        if not route.hedge and not keep_late and candidates and remaining > 0:
            first = candidates[0]
            if not self.health.overloaded(first) and not (
                first.cooldowns and self.held_off(first, ctx) > 0
            ):
                return await self._straight(request, ctx, candidates, remaining)
        plan = _Plan(self, request, ctx, candidates, keep_late=keep_late)
        if route.hedge and plan.replayable and plan.retry_safe and len(candidates) > 1:
            return await plan.race(remaining)
        return await plan.in_turn(remaining)

    async def _straight(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        candidates: Sequence[Region],
        remaining: float,
    ) -> AttemptResponse | Failure:
        """The common request's lane: one attempt at the best candidate, under the route's
        deadline, with no plan. The plan (what was tried, what may come next) is made only
        when that attempt fails or the deadline passes, and goes on from there exactly as
        :meth:`_Plan.in_turn` would have: the same attempt, the same accounting, the same
        failure. The caller makes sure the candidate would be :meth:`_Plan.next_region`'s
        first choice (its circuit breaker closed, not held off for the model)."""
        tried: set[Endpoint] = set()
        attempt = Attempt(self, candidates[0], "first", tried)
        deadlines = self.deadlines
        watch = deadlines.watch(asyncio.get_running_loop(), remaining)
        try:
            await attempt.run(request, ctx)
        except asyncio.CancelledError:
            if watch.expired():
                # The attempt let itself go as it was cancelled: the plan only says so.
                return _Plan.after(self, request, ctx, candidates, attempt, tried).deadline_failure(
                    {}
                )
            raise
        finally:
            deadlines.release(watch)
        if attempt.ok:
            return AttemptResponse(attempt, 1)
        plan = _Plan.after(self, request, ctx, candidates, attempt, tried)
        remaining = ctx.started + ctx.route.deadline - time.monotonic()
        return await plan.in_turn(remaining, failed=attempt)

    def held_off(self, region: Region, ctx: RequestContext) -> float:
        """Seconds ``region`` is still held off for ``ctx``'s model (a capacity status); zero
        or less when it is not."""
        return region.cooldowns.until(model_of(ctx)) - self.regions.clock()

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
        self.last: Attempt | None = None
        # What the values returned say of the attempts: the region the latest went to,
        # whether a hedge was sent (the count is `tried`).
        self.latest: Region | None = None
        self.hedged = False
        # The candidates held off for the request's model (429, 503, 529), and whether the
        # request has no other candidate (a lone region is retried itself).
        self.cooling: list[Region] = []
        self.lone = len(candidates) == 1

    @classmethod
    def after(
        cls,
        failover: Failover,
        request: Exchange | None,
        ctx: RequestContext,
        candidates: Sequence[Region],
        first: Attempt,
        tried: set[Endpoint],
    ) -> _Plan:
        """The plan of a request whose ``first`` attempt :meth:`Failover._straight` made,
        at the first of ``candidates``, as if this plan had made it: it has ``tried`` its
        endpoint and goes on with the other candidates."""
        plan = cls(failover, request, ctx, candidates)
        plan.queue.pop(0)
        plan.tried = 1
        plan.latest = first.region
        plan.tried_endpoints = tried
        return plan

    def attempt(self, region: Region, kind: str) -> Attempt:
        self.tried += 1
        self.latest = region
        return Attempt(self.failover, region, kind, self.tried_endpoints)

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
        wait = self.failover.held_off(region, self.ctx)
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

    def may_retry(self, failed: Attempt) -> bool:
        if not self.replayable or self.tried > self.ctx.route.retries:
            return False
        certainly_unseen = isinstance(failed.error, UpstreamError) and failed.error.retryable
        return self.retry_safe or certainly_unseen

    async def keep_failure(self, attempt: Attempt) -> None:
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

    async def in_turn(
        self, remaining: float, *, failed: Attempt | None = None
    ) -> AttemptResponse | Failure:
        """One attempt at a time: the next candidate only after a failure. ``failed``: the
        first attempt, made by :meth:`Failover._straight`, that failed."""
        # The attempt in flight, when it runs as a task (keep_late: it may outlive the
        # deadline); whatever is left here on the way out is cancelled.
        running: dict[asyncio.Task[None], Attempt] = {}
        try:
            if failed is not None:
                await self.keep_failure(failed)
                if failed.rejected is not None:
                    return self.rejected_failure(failed.rejected)
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
        running: dict[asyncio.Task[None], Attempt] = {}
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

    def win(self, attempt: Attempt) -> AttemptResponse:
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

    def deadline_failure(self, running: dict[asyncio.Task[None], Attempt]) -> Failure:
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
