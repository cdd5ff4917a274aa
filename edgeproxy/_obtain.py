"""One way to obtain an answer: route, then failover, then the degradation ladder.

:meth:`Obtainer.obtain` is the single path from a request to what answers it; the
pipeline's ``handle``, the cache's background refresh and a broken stream's continuation
all take it. It returns a value, never an exception carrying live work:

* an :class:`~edgeproxy._stages.failover.AttemptResponse`: a region's answer, its first
  byte in. The caller relays it and closes it.
* a :class:`~edgeproxy._stages.fallback.Degraded`: the ladder's answer (the stale cache,
  the local model, a plugin's), for the caller to send.
* a :class:`~edgeproxy._stages.failover.Failure`: nothing could answer. Its ``kind`` says
  why and its ``error`` is the client's answer. A failure that ``obtain`` returns holds
  no attempt: any that ran past the deadline to race the local model are cancelled
  before it returns, on every way out.

The stages return what happened and write none of it on the request; this path records
it on the request's context (its outcome fields, see
:class:`~edgeproxy._core.context.RequestContext`), in :func:`record`, as each value comes
back: the region, attempts, hedge and time to headers of what failover returned, then the
kind of degradation of the ladder's answer. A continuation leg's (:class:`Continuer`) are
recorded on the request once its leg is found: the attempts it took, the region or the
local model that continued, and the :class:`~edgeproxy._core.context.Continuation` record.

The kinds decide what may still answer: a residency refusal or a bad model name is
never degraded, a model no region serves goes only to the local model, and everything
else walks the route's ``fallback`` list.

:meth:`Obtainer.route` makes the request's one ranked :class:`RoutePlan`; failover and
hedging walk it in order, and :class:`Continuer` finds the next leg of a stream that broke
after tokens were sent through the same path, drawing its regions from that same plan.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.bodies import estimate_prompt_tokens
from edgeproxy._protocol.endpoints import dialect_for
from edgeproxy._protocol.models import model_from_body
from edgeproxy._protocol.sse import SSEEventTooLarge, SSEReader
from edgeproxy._stages.continuation import (
    LOCAL,
    ContinuationStage,
    Leg,
    Splice,
    carries_token,
    chain,
    continuation_body,
    spent_body,
)
from edgeproxy._stages.failover import (
    AttemptResponse,
    Failover,
    Failure,
    FailureKind,
    no_region,
)
from edgeproxy._stages.fallback import Degraded, FallbackStage, UpstreamWon
from edgeproxy._stages.models import ModelError
from edgeproxy._stages.routeplan import RoutePlan
from edgeproxy._upstream.pool import UpstreamError

if TYPE_CHECKING:
    from edgeproxy._core.context import Continuation, RequestContext
    from edgeproxy._core.exchange import Exchange
    from edgeproxy._plugins import Plugins
    from edgeproxy._protocol.dialects import Dialect
    from edgeproxy._stages.cache.stage import CacheStage
    from edgeproxy._stages.routing import Router
    from edgeproxy._upstream.regions import Region

__all__ = ["Continuer", "Obtained", "Obtainer", "record"]

logger = logging.getLogger("edgeproxy")

Obtained = AttemptResponse | Degraded | Failure


def record(ctx: RequestContext, obtained: Obtained) -> None:
    """Record on ``ctx`` what ``obtained`` says happened to the request: the one writer of
    its region, attempts, hedge, time to headers and degradation (a continuation's legs
    add theirs through :class:`Continuer`)."""
    if type(obtained) is AttemptResponse:  # the common case first: one test
        ctx.attempts = obtained.attempts
        ctx.hedged = obtained.hedged
        ctx.region = obtained.region.name
        ctx.upstream_ttfb = obtained.ttfb
        return
    if isinstance(obtained, Degraded):
        ctx.degraded = obtained.kind
        return
    assert isinstance(obtained, Failure)
    ctx.attempts = obtained.attempts
    ctx.hedged = obtained.hedged
    if obtained.region is not None:
        # The region the latest attempt went to: the error answer names it.
        ctx.region = obtained.region


class Obtainer:
    """Route, failover and fallback as one path; see the module's docstring."""

    def __init__(
        self,
        plugins: Plugins,
        router: Router,
        failover: Failover,
        fallback: FallbackStage,
        cache: CacheStage,
        continuation: ContinuationStage,
    ) -> None:
        self.plugins = plugins
        self.router = router
        self.failover = failover
        self.fallback = fallback
        self.cache = cache
        self.continuation = continuation

    async def obtain(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        *,
        route: RoutePlan | Failure | None = None,
        regions: list[Region] | None = None,
        shed: ProxyError | None = None,
        degrade: bool = True,
        keep_late: bool = False,
    ) -> Obtained:
        """What answers ``ctx``: a region's response, the ladder's answer, or a failure.

        ``route``: the request's plan from :meth:`route` (or the failure routing gave),
        made here when None; ``regions``: these candidates instead, in this order (a
        continuation's); ``shed``: admission shed the request (its 503), so no region is
        tried and only the ladder may answer; ``degrade``: walk the ladder on a failure
        (off for a continuation leg; never for a request with no client);
        ``keep_late``: the route's ``deadline_action = "race"``, attempts past the
        deadline race the local model. ``request`` is None for a request with no client
        (a background refresh).
        """
        failure: Failure
        if shed is not None:
            failure = Failure(FailureKind.OVERLOADED, shed)
        else:
            if regions is None:
                if route is None:
                    route = await self.route(request, ctx)
                routed: Sequence[Region] | Failure = (
                    route if isinstance(route, Failure) else route.regions
                )
            else:
                routed = regions
            if isinstance(routed, Failure):
                failure = routed
            else:
                if request is not None and degrade and self._saturated(ctx, routed):
                    early = await self._lighter(request, ctx, _SATURATED)
                    if early is not None:
                        return early
                sent = await self.failover.send(request, ctx, routed, keep_late=keep_late)
                # Before the ladder: its hooks, and the error answer, see what was tried.
                record(ctx, sent)
                if not isinstance(sent, Failure):
                    return sent
                failure = sent
        if not degrade or request is None or not self._degradable(ctx, failure):
            await failure.aclose()
            return failure
        return await self._degrade(request, ctx, failure)

    def ranked(
        self, ctx: RequestContext, *, exclude: tuple[str, ...] = (), owner: str | None = None
    ) -> RoutePlan | Failure:
        """:meth:`route` with no ``edgeproxy_route`` hook to ask: the router's plan, or the
        failure of a request none may serve (no coroutine, on every request's path).
        ``owner``: the one region holding the request's state."""
        try:
            plan = self.router.route(ctx, exclude=exclude, owner=owner)
        except ProxyError as err:
            return _refused(err)
        if not plan.regions:
            return Failure(FailureKind.NO_REGION, no_region())
        return plan

    async def route(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        *,
        exclude: tuple[str, ...] = (),
        owner: str | None = None,
    ) -> RoutePlan | Failure:
        """The request's one ranked plan (the ``edgeproxy_route`` hook may choose other
        regions, kept in its affinity plan), or the failure of a request none may serve.
        A request with an ``owner`` goes there alone: the hook is not asked."""
        if "edgeproxy_route" not in self.plugins.active or owner is not None:
            return self.ranked(ctx, exclude=exclude, owner=owner)
        plan = self._ranked(ctx, exclude)
        if isinstance(plan, Failure):
            return plan
        chosen = await self.plugins.call_first(
            "edgeproxy_route", request=request, ctx=ctx, candidates=list(plan.regions)
        )
        if chosen is not None:
            plan = replace(plan, regions=tuple(chosen))
        if not plan.regions:
            return Failure(FailureKind.NO_REGION, no_region())
        return plan

    def _ranked(self, ctx: RequestContext, exclude: tuple[str, ...]) -> RoutePlan | Failure:
        try:
            return self.router.route(ctx, exclude=exclude)
        except ProxyError as err:
            return _refused(err)

    def _degradable(self, ctx: RequestContext, failure: Failure) -> bool:
        kind = failure.kind
        if (
            kind is FailureKind.RESIDENCY
            or kind is FailureKind.BAD_REQUEST
            or kind is FailureKind.REJECTED
            or kind is FailureKind.OWNER_UNAVAILABLE
        ):
            return False
        if kind is FailureKind.MODEL_UNKNOWN:
            return self.fallback.local_may_answer(ctx)
        return True

    async def _degrade(self, request: Exchange, ctx: RequestContext, failure: Failure) -> Obtained:
        """The ladder for ``failure``; whatever it held is cancelled on the way out.

        The route's ``fallback`` list in order: the rungs before ``lighter`` (the stale
        cache, the local model), then a lighter model in the regions, then the rest."""
        fallback = self.fallback
        rungs = ctx.route.fallback
        try:
            stale = await self.cache.serve_stale(request, ctx)
            try:
                if "lighter" in rungs:
                    at = rungs.index("lighter")
                    rung = await fallback.ladder(request, ctx, stale=stale, rungs=rungs[:at])
                    if rung.answer is None:
                        lighter = await self._lighter(request, ctx, failure.error)
                        if lighter is not None:
                            return lighter
                        later = await fallback.ladder(
                            request, ctx, stale=stale, rungs=rungs[at + 1 :]
                        )
                        rung = replace(later, missing=(*rung.missing, *later.missing))
                else:
                    rung = await fallback.ladder(request, ctx, stale=stale)
                if rung.answer is not None:
                    # The edgeproxy_fallback hook sees the degradation about to answer.
                    record(ctx, rung.answer)
                outcome = await fallback.settle(
                    request, ctx, failure.error, rung, pending=failure.pending
                )
            except ProxyError as err:
                # Vetoed, or nothing could answer: the request is not degraded.
                ctx.degraded = None
                return failure.with_error(err)
            if isinstance(outcome, UpstreamWon):
                # A region beat the local model: not degraded after all, and its answer
                # is the request's (its region, its time to headers).
                ctx.degraded = None
                record(ctx, outcome.upstream)
                return outcome.upstream
            record(ctx, outcome)
            return outcome
        finally:
            await failure.aclose()

    async def _lighter(
        self, request: Exchange, ctx: RequestContext, error: ProxyError
    ) -> AttemptResponse | None:
        """The ``lighter`` rung: the request for each of its model's lighter models in turn
        (``fallback_models``), routed and failed over like any request for it; the first
        that answers, marked, or None.

        Never for a request that refers to stored state: another model would answer another
        conversation than the client's, silently. A request too long for a lighter model's
        context window skips that model."""
        body = ctx.json
        requested = model_from_body(body)
        if not isinstance(body, dict) or not isinstance(requested, str):
            return None
        chain = ctx.route.fallback_models.get(requested)
        if not chain:
            return None
        fallback = self.fallback
        if dialect_for(ctx.path).stateful(body):
            fallback.lighter_skipped["stateful"] += 1
            return None
        needed = estimate_prompt_tokens(body) + (_max_tokens(ctx.path, body) or 0)
        for model in chain:
            window = self._context_window(ctx, model)
            if window is not None and needed > window:
                fallback.lighter_skipped["too_long"] += 1
                logger.info(
                    "request %s: %s skipped as lighter model (about %d tokens, window %d)",
                    ctx.request_id,
                    model,
                    needed,
                    window,
                )
                continue
            leg = ctx.with_json({**body, "model": model})
            # Its own deadline from now, as a continuation leg's: the requested model's may
            # be what passed.
            leg.started = time.monotonic()
            route = self.ranked(leg)
            if isinstance(route, Failure):
                fallback.lighter_skipped["no_region"] += 1
                continue
            sent = await self.failover.send(request, leg, route.regions)
            # The requested model's attempts (and hedge) and this one's: all the request's.
            attempts, hedged = ctx.attempts + sent.attempts, ctx.hedged
            if isinstance(sent, Failure) or not 200 <= sent.status < 300:
                ctx.attempts = attempts
                await sent.aclose()
                fallback.lighter_skipped["failed"] += 1
                continue
            sent.lighter = leg
            record(ctx, sent)
            ctx.attempts, ctx.hedged = attempts, hedged or sent.hedged
            ctx.degraded = "lighter-model"
            ctx.model = model
            fallback.answered_lighter(requested, model)
            logger.info(
                "request %s: %s answered for %s (%s)",
                ctx.request_id,
                model,
                requested,
                error.message,
            )
            return sent
        return None

    def _saturated(self, ctx: RequestContext, regions: Sequence[Region]) -> bool:
        """Whether the route sends ``ctx`` to its lighter model before the regions: every
        region that would serve it reports at least ``lighter_when_waiting`` requests
        waiting (a region with no fresh report is not saturated), and the request's
        priority is at most ``lighter_max_priority``."""
        route = ctx.route
        threshold = route.lighter_when_waiting
        if threshold is None or not regions or "lighter" not in route.fallback:
            return False
        ceiling = route.lighter_max_priority
        if ceiling is not None and ctx.priority > ceiling:
            return False
        now = self.router.clock()
        max_age = self.router.config.routing.load_report_max_age
        for region in regions:
            report = region.reported.fresh(now, max_age)
            waiting = None if report is None else report.num_requests_waiting
            if waiting is None or waiting < threshold:
                return False
        return True

    def _context_window(self, ctx: RequestContext, model: str) -> int | None:
        """``model``'s context window: the route's ``context_windows``, else the least any
        region serving it reports."""
        configured = ctx.route.context_windows.get(model)
        if configured is not None:
            return configured
        reported = [
            window
            for region in self.router.regions
            if (window := region.learned.context_window(model)) is not None
        ]
        return min(reported) if reported else None

    def continuer(self, plan: RoutePlan) -> Continuer:
        """The continuation of a request routed by ``plan``, for the stream stage."""
        return Continuer(self, plan)


class _LegOutcome:
    """What one :meth:`Continuer.next_leg` call did, as its steps return it, recorded on the
    request in one place (:meth:`record`) whatever way the call ends."""

    __slots__ = ("attempts", "continuation", "leg")

    def __init__(self) -> None:
        self.attempts = 0
        self.continuation: Continuation | None = None
        self.leg: Leg | None = None

    def record(self, ctx: RequestContext) -> None:
        """The leg's outcome onto the request: the attempts it took, its continuation
        record, and the region (or the local model's degradation) that now answers."""
        ctx.attempts += self.attempts
        if self.continuation is not None:
            # For the metrics and the access log, as they read a finished request.
            ctx.continuations = (*ctx.continuations, self.continuation)
        leg = self.leg
        if leg is not None:
            if leg.degraded is not None:
                # A request degraded already keeps its first reason.
                ctx.degraded = ctx.degraded or leg.degraded
            else:
                ctx.region = leg.name


class _Contender:
    """One side of a continuation race: its leg's request and regions, and the attempts
    its leg took (at least one sent when it is cancelled before it knew)."""

    __slots__ = ("ctx", "regions", "attempts")

    def __init__(self, ctx: RequestContext, regions: list[Region]) -> None:
        self.ctx = ctx
        self.regions = regions
        self.attempts = 1


class Continuer:
    """The next legs of one request's stream: regions able to continue it, drawn from the
    request's own ranked plan (never ranked again), then the local model."""

    __slots__ = ("obtainer", "plan")

    def __init__(self, obtainer: Obtainer, plan: RoutePlan) -> None:
        self.obtainer = obtainer
        self.plan = plan

    def splice(self, ctx: RequestContext, status: int, content_type: str) -> Splice | None:
        """A splice for this answer if its route continues it and it can be continued."""
        return self.obtainer.continuation.splice(ctx, status, content_type)

    async def next_leg(
        self, request: Exchange | None, ctx: RequestContext, splice: Splice, broken: str
    ) -> Leg | None:
        """The next leg of the answer ``broken`` (a region's name, or ``local``) broke, or
        None when it cannot be continued (the caller ends the stream with an error).

        What it did is recorded on ``ctx`` here, once, however it ends."""
        outcome = _LegOutcome()
        try:
            outcome.leg = await self._find(request, ctx, splice, broken, outcome)
            return outcome.leg
        finally:
            outcome.record(ctx)

    async def _find(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        splice: Splice,
        broken: str,
        outcome: _LegOutcome,
    ) -> Leg | None:
        obtainer = self.obtainer
        continuation = obtainer.continuation
        refused = continuation.refusal(ctx, splice, broken)
        if refused is not None:
            outcome.continuation = refused
            return None
        if not obtainer.failover.retry_budget.try_spend():
            outcome.continuation = continuation.count(ctx, broken, "none", "budget")
            return None
        candidates = list(self.plan.without(*splice.broken).regions)
        for method, regions in continuation.groups(candidates, splice).items():
            if ctx.route.race_continuations and len(regions) > 1:
                raced = await self._race(request, ctx, splice, method, regions, outcome)
                if raced is None:
                    continue
                upstream, chunks = raced
            else:
                leg_ctx = _leg_context(ctx, splice, method)
                obtained = await obtainer.obtain(request, leg_ctx, regions=regions, degrade=False)
                assert not isinstance(obtained, Degraded)
                outcome.attempts += obtained.attempts
                if isinstance(obtained, Failure):
                    continuation.no_region_continued(ctx, method, obtained.error)
                    continue
                if obtained.status != 200:
                    await obtained.aclose()
                    continue
                upstream, chunks = obtained, obtained.aiter_bytes()
            target = upstream.region.name
            splice.start_leg(broken, target, method)
            outcome.continuation = continuation.count(ctx, broken, target, "continued")
            return Leg(target, chunks, upstream.aclose)
        leg = await self._local(ctx, splice, broken)
        if leg is None:
            outcome.continuation = continuation.count(ctx, broken, "none", "failed")
        else:
            outcome.continuation = continuation.count(ctx, broken, LOCAL, "continued")
        return leg

    async def _local(self, ctx: RequestContext, splice: Splice, broken: str) -> Leg | None:
        """The local model as the last rung: the conversation, the partial answer as prefix."""
        fallback = self.obtainer.fallback
        local = fallback.local
        if broken == LOCAL or not fallback.local_may_answer(ctx) or not local.ready:
            return None
        leg_ctx = ctx.with_json(spent_body(splice))
        try:
            answer = await local.answer(leg_ctx, prefix=splice.text)
        except ProxyError as err:
            logger.info(
                "request %s: the local model cannot continue: %s", ctx.request_id, err.message
            )
            return None
        splice.start_leg(broken, LOCAL, "prefill")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for event in answer.events(leg_ctx):
                    yield event
            except (ProxyError, RuntimeError, ValueError, OSError) as exc:
                raise UpstreamError(f"the local model failed: {exc}") from exc

        async def close() -> None:
            answer.abandon()

        return Leg(LOCAL, chunks(), close, degraded="local-model")

    async def _race(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        splice: Splice,
        method: str,
        regions: list[Region],
        outcome: _LegOutcome,
    ) -> tuple[AttemptResponse, AsyncIterator[bytes]] | None:
        """Ask the best two regions for the rest at once; the first whose new leg carries
        a token wins and the other is cancelled (closing its stream). A leg that breaks
        before its first token, which would stall the client for a second time-to-first-
        token, so costs nothing but the other leg's prefill. None when neither answered."""
        # A second leg spends a second unit of the retry budget; without one, no race.
        if self.obtainer.failover.retry_budget.try_spend():
            groups = [regions[:1], regions[1:]]
        else:
            groups = [regions]
        contenders = [_Contender(_leg_context(ctx, splice, method), group) for group in groups]
        tasks = [
            asyncio.ensure_future(self._until_token(request, contender, splice.dialect))
            for contender in contenders
        ]
        won: tuple[AttemptResponse, AsyncIterator[bytes]] | None = None
        try:
            pending = set(tasks)
            while pending and won is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                won = next((t.result() for t in tasks if t in done and t.result()), None)
            return won
        finally:
            for task in tasks:
                task.cancel()
            # A loser still reading closes its own stream as its cancellation unwinds; one
            # that finished with a token too is closed here.
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, tuple) and result is not won:
                    await result[0].aclose()
            # The longest contender's attempts, and one for each other contender.
            outcome.attempts += max(c.attempts for c in contenders) + len(contenders) - 1

    async def _until_token(
        self, request: Exchange | None, contender: _Contender, dialect: Dialect
    ) -> tuple[AttemptResponse, AsyncIterator[bytes]] | None:
        """One contender of a race: its leg, read up to its first token (as ``dialect``
        says), the bytes read so far put back in front of the rest. None if it failed
        before a token."""
        obtained = await self.obtainer.obtain(
            request, contender.ctx, regions=contender.regions, degrade=False
        )
        assert not isinstance(obtained, Degraded)
        contender.attempts = obtained.attempts
        if isinstance(obtained, Failure):
            return None
        if obtained.status != 200:
            await obtained.aclose()
            return None
        chunks = obtained.aiter_bytes()
        reader = SSEReader()
        seen: list[bytes] = []
        try:
            async for chunk in chunks:
                seen.append(chunk)
                if any(carries_token(event, dialect) for event in reader.feed(chunk)):
                    return obtained, chain(seen, chunks)
        except (UpstreamError, SSEEventTooLarge):
            pass
        except BaseException:
            await obtained.aclose()
            raise
        await obtained.aclose()
        return None


# Why a request went to its lighter model before the regions (for the log).
_SATURATED = ProxyError(
    503, "service_unavailable", "every region serving the model reports a deep queue"
)


def _max_tokens(path: str, body: dict[str, Any]) -> int | None:
    """The most tokens the request asks to be generated, as its API names the bound."""
    value = dialect_for(path).max_tokens(body)
    return value if isinstance(value, int) and value > 0 else None


def _refused(err: ProxyError) -> Failure:
    """The failure of a request the router refused: a model no region serves (or a bad
    model name), a residency rule with no region left, or no region at all."""
    if isinstance(err, ModelError):
        kind = FailureKind.MODEL_UNKNOWN if err.status == 404 else FailureKind.BAD_REQUEST
    elif err.code == "residency":
        kind = FailureKind.RESIDENCY
    elif err.code == "owner_unavailable":
        kind = FailureKind.OWNER_UNAVAILABLE
    else:
        kind = FailureKind.NO_REGION
    return Failure(kind, err)


def _leg_context(ctx: RequestContext, splice: Splice, method: str) -> RequestContext:
    """The request a continuation leg sends: its own body, its deadline from now."""
    leg = (
        copy.copy(ctx) if method == "reissue" else ctx.with_json(continuation_body(splice, method))
    )
    leg.started = time.monotonic()
    return leg
