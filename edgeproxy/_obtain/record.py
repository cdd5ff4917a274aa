"""The obtain path's record of what happened to a request, on its outcome.

The stages return what happened and write none of it; the obtain path writes it here, as
each value comes back: the region, attempts, hedge and time to headers of what failover
returned, the kind of degradation of the ladder's answer (before the ``edgeproxy_fallback``
hook runs, so that it sees it), another model's attempts, and a continuation leg's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgeproxy._obtain.attempt import AttemptResponse
from edgeproxy._obtain.continuation import LOCAL, Leg
from edgeproxy._obtain.failure import Failure

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext
    from edgeproxy._core.outcome import Continuation
    from edgeproxy._obtain.fallback import Degraded

__all__ = ["record", "record_degraded", "record_leg", "record_other_model"]


def record(ctx: RequestContext, obtained: AttemptResponse | Degraded | Failure) -> None:
    """What ``obtained`` says happened to the request."""
    out = ctx.outcome
    if isinstance(obtained, AttemptResponse):
        out.attempts = obtained.attempts
        out.hedged = obtained.hedged
        out.region = obtained.region.name
        out.upstream_ttfb = obtained.ttfb
        return
    if isinstance(obtained, Failure):
        out.attempts = obtained.attempts
        out.hedged = obtained.hedged
        if obtained.region is not None:
            # The region the latest attempt went to: the error answer names it.
            out.region = obtained.region
        return
    out.degraded = obtained.kind


def record_degraded(ctx: RequestContext, kind: str | None) -> None:
    """The request is degraded as ``kind`` (``lighter-model``), or not after all (None: the
    ladder was vetoed, or a region beat the local model)."""
    ctx.outcome.degraded = kind


def record_other_model(
    ctx: RequestContext, attempts: int, hedged: bool, sent: AttemptResponse | None
) -> None:
    """Another model was asked for the request (a lighter or a larger one): its
    ``attempts`` and hedge are the request's too, and ``sent``, its answer, if it answered."""
    if sent is not None:
        record(ctx, sent)
    out = ctx.outcome
    out.attempts = attempts
    out.hedged = hedged


def record_leg(
    ctx: RequestContext, attempts: int, continuation: Continuation | None, leg: Leg | None
) -> None:
    """A continuation leg's outcome: the attempts it took, its continuation record, and the
    region (or the local model's degradation) that now answers."""
    out = ctx.outcome
    out.attempts += attempts
    if continuation is not None:
        # For the metrics and the access log, as they read a finished request.
        out.continuations = (*out.continuations, continuation)
    if leg is not None:
        if leg.degraded is not None:
            # A request degraded already keeps its first reason.
            out.degraded = out.degraded or leg.degraded
        if leg.name != LOCAL:
            out.region = leg.name
        if leg.model is not None:
            ctx.model = leg.model
