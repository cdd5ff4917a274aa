"""One way to obtain an answer: route, then failover, then the degradation ladder.

:meth:`Obtainer.obtain` is the single path from a request to what answers it; the
pipeline's ``handle``, the cache's background refresh and a broken stream's continuation
all take it. It returns a value, never an exception carrying live work:

* an :class:`~edgeproxy._obtain.failover.AttemptResponse`: a region's answer, its first
  byte in. The caller relays it and closes it.
* a :class:`~edgeproxy._obtain.fallback.Degraded`: the ladder's answer (the stale cache,
  the local model, a plugin's), for the caller to send.
* a :class:`~edgeproxy._obtain.failover.Failure`: nothing could answer. Its ``kind`` says
  why and its ``error`` is the client's answer. A failure that ``obtain`` returns holds
  no attempt: any that ran past the deadline to race the local model are cancelled
  before it returns, on every way out.

The stages return what happened and write none of it on the request; this path records
it on the request's outcome (:class:`~edgeproxy._core.outcome.Outcome`) through
:mod:`edgeproxy._obtain.record`, as each value comes back: the region, attempts, hedge and
time to headers of what failover returned, then the kind of degradation of the ladder's
answer. A continuation leg's (:class:`Continuer`) are recorded once its leg is found: the
attempts it took, the region or the local model that continued, and the
:class:`~edgeproxy._core.outcome.Continuation` record.

The kinds decide what may still answer: a residency refusal or a bad model name is
never degraded, a model no region serves goes only to the local model, and everything
else walks the route's ``fallback`` list.

:meth:`Obtainer.route` makes the request's one ranked :class:`RoutePlan`; failover and
hedging walk it in order, and :class:`Continuer` finds the next leg of a stream that broke
after tokens were sent through the same path, drawing its regions from that same plan.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from edgeproxy._core.errors import ProxyError
from edgeproxy._obtain.continuation import (
    ContinuationStage,
)
from edgeproxy._obtain.continuer import Continuer
from edgeproxy._obtain.failover import (
    AttemptResponse,
    Failover,
    Failure,
    FailureKind,
    no_region,
)
from edgeproxy._obtain.fallback import Degraded, FallbackStage, UpstreamWon
from edgeproxy._obtain.record import record, record_degraded, record_other_model
from edgeproxy._protocol.bodies import estimate_prompt_tokens
from edgeproxy._protocol.endpoints import dialect_for
from edgeproxy._protocol.modelnames import model_from_body
from edgeproxy._protocol.refusals import REFUSAL_READ_LIMIT, TOO_LONG_STATUSES, too_long
from edgeproxy._routing.modelcatalog import ModelError
from edgeproxy._routing.routeplan import RoutePlan
from edgeproxy._upstream.pool import UpstreamError

if TYPE_CHECKING:
    from edgeproxy._cache.stage import CacheStage
    from edgeproxy._core.context import RequestContext
    from edgeproxy._core.exchange import Exchange
    from edgeproxy._plugins import Plugins
    from edgeproxy._routing.router import Router
    from edgeproxy._upstream.regions import Region

__all__ = ["Obtained", "Obtainer"]

logger = logging.getLogger("edgeproxy")

Obtained = AttemptResponse | Degraded | Failure


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
                if request is not None and degrade:
                    early: AttemptResponse | None = None
                    if ctx.route.larger_models and self._too_long_for(ctx):
                        early = await self._larger(request, ctx, None)
                    if early is None and self._saturated(ctx, routed):
                        early = await self._lighter(request, ctx, _SATURATED)
                    if early is not None:
                        return early
                sent = await self.failover.send(request, ctx, routed, keep_late=keep_late)
                # Before the ladder: its hooks, and the error answer, see what was tried.
                record(ctx, sent)
                if not isinstance(sent, Failure):
                    if (
                        sent.status in TOO_LONG_STATUSES
                        and ctx.route.larger_models
                        and request is not None
                        and degrade
                    ):
                        larger = await self._larger(request, ctx, sent)
                        if larger is not None:
                            await sent.aclose()
                            return larger
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
        """The ladder for ``failure`` (the route's ``fallback`` list, walked by the fallback
        stage); whatever it held is cancelled on the way out."""
        fallback = self.fallback

        async def lighter() -> AttemptResponse | None:
            return await self._lighter(request, ctx, failure.error)

        try:
            stale = await self.cache.serve_stale(request, ctx)
            try:
                rung = await fallback.ladder(request, ctx, stale=stale, lighter=lighter)
                if rung.lighter is not None:
                    return rung.lighter
                if rung.answer is not None:
                    # The edgeproxy_fallback hook sees the degradation about to answer.
                    record(ctx, rung.answer)
                outcome = await fallback.settle(
                    request, ctx, failure.error, rung, pending=failure.pending
                )
            except ProxyError as err:
                # Vetoed, or nothing could answer: the request is not degraded.
                record_degraded(ctx, None)
                return failure.with_error(err)
            if isinstance(outcome, UpstreamWon):
                # A region beat the local model: not degraded after all, and its answer
                # is the request's (its region, its time to headers).
                record_degraded(ctx, None)
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
        (``fallback_models``), the first that answers, marked, or None."""
        requested = model_from_body(ctx.json)
        chain = ctx.route.fallback_models.get(requested) if isinstance(requested, str) else None
        if not chain:
            return None
        fallback = self.fallback
        sent = await self._other_model(request, ctx, chain, fallback.lighter_skipped)
        if sent is None:
            return None
        assert isinstance(requested, str) and ctx.model is not None
        record_degraded(ctx, "lighter-model")
        fallback.answered_lighter(requested, ctx.model)
        logger.info(
            "request %s: %s answered for %s (%s)",
            ctx.request_id,
            ctx.model,
            requested,
            error.message,
        )
        return sent

    def _too_long_for(self, ctx: RequestContext) -> bool:
        """Whether ``ctx`` is known to be longer than its model's context window, with a
        larger model to go to (the route's ``larger_models``)."""
        body = ctx.json
        model = model_from_body(body)
        if not isinstance(model, str) or model not in ctx.route.larger_models:
            return False
        window = self._context_window(ctx, model)
        return window is not None and _needed_tokens(ctx.path, body) > window

    async def _larger(
        self, request: Exchange, ctx: RequestContext, refused: AttemptResponse | None
    ) -> AttemptResponse | None:
        """A model with a larger context window answering ``ctx`` (the route's
        ``larger_models``), or None: for a request ``refused`` by a region as too long for
        its model (read from its 400), or known to be (``refused`` None). ``refused`` is
        left for the caller to relay or close."""
        requested = model_from_body(ctx.json)
        chain = ctx.route.larger_models.get(requested) if isinstance(requested, str) else None
        if not chain:
            return None
        if refused is not None:
            try:
                body = await refused.read_error(REFUSAL_READ_LIMIT)
            except UpstreamError:
                return None
            if not too_long(refused.status, body):
                return None
        sent = await self._other_model(request, ctx, chain, self.fallback.larger_skipped)
        if sent is None:
            return None
        self.fallback.larger[(str(requested), str(ctx.model))] += 1
        logger.info(
            "request %s: %s answered for %s (too long for its context window)",
            ctx.request_id,
            ctx.model,
            requested,
        )
        return sent

    async def _other_model(
        self, request: Exchange, ctx: RequestContext, models: Sequence[str], skipped: Counter[str]
    ) -> AttemptResponse | None:
        """``ctx`` for each of ``models`` in turn, routed and failed over like any request for
        it: the first that answers (2xx), with ``ctx``'s model set to it, or None (why each
        was passed over counted in ``skipped``).

        Never for a request that refers to stored state: another model would answer another
        conversation than the client's, silently. A request too long for a model's context
        window skips that model."""
        body = ctx.json
        if not isinstance(body, dict):
            return None
        if dialect_for(ctx.path).stateful(body):
            skipped["stateful"] += 1
            return None
        needed = _needed_tokens(ctx.path, body)
        for model in models:
            window = self._context_window(ctx, model)
            if window is not None and needed > window:
                skipped["too_long"] += 1
                logger.info(
                    "request %s: %s skipped (about %d tokens, window %d)",
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
                skipped["no_region"] += 1
                continue
            sent = await self.failover.send(request, leg, route.regions)
            # The requested model's attempts (and hedge) and this one's: all the request's.
            attempts, hedged = ctx.outcome.attempts + sent.attempts, ctx.outcome.hedged
            if isinstance(sent, Failure) or not 200 <= sent.status < 300:
                record_other_model(ctx, attempts, hedged, None)
                await sent.aclose()
                skipped["failed"] += 1
                continue
            sent.other_model = leg
            record_other_model(ctx, attempts, hedged or sent.hedged, sent)
            ctx.model = model
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
        """The continuation of a request routed by ``plan``, for the Responder."""
        return Continuer(self, plan)


def _needed_tokens(path: str, body: Any) -> int:
    """About how many tokens of context a request needs: its prompt and the most it asks
    to be generated."""
    if not isinstance(body, dict):
        return 0
    return estimate_prompt_tokens(body) + (_max_tokens(path, body) or 0)


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
