"""A broken stream's next leg, by the same path as any answer.

:class:`Continuer` finds the next leg of a stream that broke after tokens were sent: the
regions of the request's own ranked plan able to continue it (never ranked again), by each
continuation method they speak, then a lighter model in the regions (the route's ladder
has ``lighter``), then the local model. Every leg is obtained through the obtain path
(:class:`ObtainPath`, which :class:`edgeproxy._obtain.obtainer.Obtainer` is), and every leg
after the first break shares one deadline, the route's, from that break: the route's
deadline bounds the whole continued answer, not each leg. A region's refusal to continue
(a 4xx, a content filter) is the client's to read, once, never retried.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from edgeproxy._core.errors import ProxyError
from edgeproxy._obtain.continuation import (
    LOCAL,
    ContinuationStage,
    Leg,
    Splice,
    carries_token,
    continuation_body,
    spent_body,
)
from edgeproxy._obtain.failover import AttemptResponse, Failover, Failure
from edgeproxy._obtain.fallback import Degraded, FallbackStage
from edgeproxy._obtain.record import record_leg
from edgeproxy._protocol.endpoints import dialect_for
from edgeproxy._protocol.modelnames import model_from_body
from edgeproxy._protocol.refusals import REFUSAL_READ_LIMIT, error_message
from edgeproxy._protocol.sse import SSEEventTooLarge
from edgeproxy._routing.routeplan import RoutePlan
from edgeproxy._upstream.pool import UpstreamError

if TYPE_CHECKING:
    from edgeproxy._core.context import Continuation, RequestContext
    from edgeproxy._core.exchange import Exchange
    from edgeproxy._protocol.dialects import Dialect
    from edgeproxy._upstream.regions import Region

__all__ = ["Continuer", "ObtainPath"]

logger = logging.getLogger("edgeproxy")


class ObtainPath(Protocol):
    """What a continuation needs of the obtain path: its stages, a leg obtained, a plan."""

    continuation: ContinuationStage
    failover: Failover
    fallback: FallbackStage

    async def obtain(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        *,
        regions: list[Region] | None = None,
        degrade: bool = True,
    ) -> AttemptResponse | Degraded | Failure: ...

    def ranked(self, ctx: RequestContext) -> RoutePlan | Failure: ...


class _LegOutcome:
    """What one :meth:`Continuer.next_leg` call did, as its steps return it, recorded on the
    request in one place (:meth:`record`) whatever way the call ends."""

    __slots__ = ("attempts", "continuation", "leg")

    def __init__(self) -> None:
        self.attempts = 0
        self.continuation: Continuation | None = None
        self.leg: Leg | None = None

    def record(self, ctx: RequestContext) -> None:
        """The leg's outcome onto the request (:func:`record_leg`)."""
        record_leg(ctx, self.attempts, self.continuation, self.leg)


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

    def __init__(self, obtainer: ObtainPath, plan: RoutePlan) -> None:
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
        leg = await self._in_regions(request, ctx, splice, broken, candidates, outcome)
        if leg is not None or splice.refused is not None:
            return leg
        if "lighter" in ctx.route.fallback:
            leg = await self._lighter(request, ctx, splice, broken, outcome)
            if leg is not None or splice.refused is not None:
                return leg
        leg = await self._local(ctx, splice, broken)
        if leg is None:
            outcome.continuation = continuation.count(ctx, broken, "none", "failed")
        else:
            outcome.continuation = continuation.count(ctx, broken, LOCAL, "continued")
        return leg

    async def _in_regions(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        splice: Splice,
        broken: str,
        candidates: list[Region],
        outcome: _LegOutcome,
        *,
        model: str | None = None,
    ) -> Leg | None:
        """The next leg from ``candidates`` (for ``model`` instead of the client's, a lighter
        one), by each continuation method they speak, or None. A region's refusal (a 4xx)
        ends the search: it is the client's to read (``splice.refused``), never retried."""
        obtainer = self.obtainer
        continuation = obtainer.continuation
        for method, regions in continuation.groups(candidates, splice).items():
            if ctx.route.race_continuations and len(regions) > 1:
                raced = await self._race(request, ctx, splice, method, regions, outcome, model)
                if raced is None:
                    continue
                upstream, chunks = raced
            else:
                leg_ctx = _leg_context(ctx, splice, method, model)
                obtained = await obtainer.obtain(request, leg_ctx, regions=regions, degrade=False)
                assert not isinstance(obtained, Degraded)
                outcome.attempts += obtained.attempts
                if isinstance(obtained, Failure):
                    continuation.no_region_continued(ctx, method, obtained.error)
                    continue
                if obtained.status != 200:
                    if 400 <= obtained.status < 500:
                        await _refused_leg(obtained, splice)
                        outcome.continuation = continuation.count(
                            ctx, broken, obtained.region.name, "refused"
                        )
                        await obtained.aclose()
                        return None
                    await obtained.aclose()
                    continue
                upstream, chunks = obtained, obtained.aiter_bytes()
            target = upstream.region.name
            splice.start_leg(broken, target, method)
            outcome.continuation = continuation.count(ctx, broken, target, "continued")
            degraded = None if model is None else "lighter-model"
            return Leg(target, chunks, upstream.aclose, degraded=degraded, model=model)
        return None

    async def _lighter(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        splice: Splice,
        broken: str,
        outcome: _LegOutcome,
    ) -> Leg | None:
        """The ladder's lighter rung for a broken stream: every region serving the client's
        model failed to continue it, so each of its lighter models (``fallback_models``) in
        turn, in the regions serving it; None when none did."""
        body = ctx.json
        requested = model_from_body(body)
        if not isinstance(requested, str) or not isinstance(body, dict):
            return None
        chain = ctx.route.fallback_models.get(requested)
        if not chain or dialect_for(ctx.path).stateful(body):
            return None
        for model in chain:
            plan = self.obtainer.ranked(ctx.with_json({**body, "model": model}))
            if isinstance(plan, Failure):
                continue
            candidates = list(plan.without(*splice.broken).regions)
            leg = await self._in_regions(
                request, ctx, splice, broken, candidates, outcome, model=model
            )
            if leg is not None:
                self.obtainer.fallback.answered_lighter(requested, model)
                return leg
            if splice.refused is not None:
                return None
        return None

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
                async for event in answer.events():
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
        model: str | None = None,
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
        contenders = [
            _Contender(_leg_context(ctx, splice, method, model), group) for group in groups
        ]
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
        try:
            if await obtained.read_until(lambda event: carries_token(event, dialect)):
                return obtained, obtained.aiter_bytes()
        except (UpstreamError, SSEEventTooLarge):
            pass
        except BaseException:
            await obtained.aclose()
            raise
        await obtained.aclose()
        return None


# The most of a refusal's body read for its reason (a context window's 400).


def _leg_context(
    ctx: RequestContext, splice: Splice, method: str, model: str | None = None
) -> RequestContext:
    """The request a continuation leg sends: its own body (for ``model`` instead of the
    client's, a lighter one), and the deadline of the whole continued answer, which runs
    from its first break."""
    if method == "reissue":
        if model is None:
            leg = copy.copy(ctx)
            leg.outcome = copy.copy(ctx.outcome)
        else:
            leg = ctx.with_json({**ctx.json, "model": model})
    else:
        body = continuation_body(splice, method)
        leg = ctx.with_json(body if model is None else {**body, "model": model})
    leg.started = time.monotonic() if splice.since is None else splice.since
    return leg


async def _refused_leg(refused: AttemptResponse, splice: Splice) -> None:
    """A region refused to continue the answer (a 4xx, a content filter): its reason, the
    client's to read as the stream's error."""
    try:
        body = await refused.read_error(REFUSAL_READ_LIMIT)
    except UpstreamError:
        body = b""
    reason = error_message(body)
    splice.refused = ProxyError(
        refused.status,
        "invalid_request_error",
        f"region {refused.region.name} refused to continue the answer"
        + (f": {reason}" if reason else f" ({refused.status})"),
        code="continuation_refused",
    )
