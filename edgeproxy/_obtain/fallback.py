"""The degradation ladder: what a request gets when no region can answer it.

The full ladder, per route::

    1. healthy regions          (routing and failover)
    2. fresh cache              (the cache stage, before any region)
    3. a lighter model          X-Edgeproxy-Degraded: lighter-model (the obtain path)
    4. stale cache              X-Edgeproxy-Degraded: stale-cache
    5. local model              X-Edgeproxy-Degraded: local-model
    6. 503 with Retry-After     a JSON error

Rungs 3 to 5 run in the order of the route's ``fallback`` list. The lighter model is
another request to the regions (routed, failed over), so the obtain path runs it
(:mod:`edgeproxy._obtain`); this stage runs the others and counts the lighter answers.

Rungs 1 and 2 run before this stage. :class:`FallbackStage` runs when every
attempt failed before the first byte, when the route's deadline passed with
no first byte, when no region may serve the request, or when admission
sheds a request whose policy says degrade. It walks the route's
``fallback`` list (rungs 3 and 4, in the configured order) and lets the
``edgeproxy_fallback`` hook veto or replace the chosen answer.

It answers or raises, and sends nothing itself, nor writes the request's outcome: in two
steps, :meth:`FallbackStage.ladder` finds the rung that may answer (a :class:`Rung`, its
answer a :class:`Degraded` of a kind), which the obtain path records on the request for the
hook to see, and :meth:`FallbackStage.settle` lets the hook have its say and returns a
:class:`Degraded` answer (of its kind) for the pipeline to send, or an :class:`UpstreamWon`
for it to relay, and raises the :class:`~edgeproxy._core.errors.ProxyError` the client is
to get otherwise.

With the route's ``deadline_action = "race"``, the attempts still running
past the deadline (the ``pending`` of the deadline's
:class:`~edgeproxy._obtain.failover.Failure`) race a local answer:
whichever produces a first byte or first token first is used. The stage
only borrows them: the pipeline owns them and cancels what is left once the
race is over. Recovery needs nothing here: each new request tries the
regions first, so traffic goes back upstream as soon as a region answers; a
local answer that already started finishes on the local model.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgeproxy._core.config import Config
from edgeproxy._core.errors import ProxyError
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.response import StreamResponse
from edgeproxy._local.model import LocalAnswer, LocalModel
from edgeproxy._plugins import Plugins, hook_answer
from edgeproxy._protocol.dialects import tokens
from edgeproxy._protocol.modelnames import model_from_body

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext
    from edgeproxy._obtain.attempt import AttemptResponse
    from edgeproxy._obtain.failure import Pending

__all__ = ["Degraded", "FallbackStage", "Rung", "UpstreamWon"]

logger = logging.getLogger("edgeproxy.fallback")


@dataclass(frozen=True, slots=True)
class Degraded:
    """Answer with ``response``: a stale cache entry, the local model's answer, a plugin's.

    A :class:`~edgeproxy._local.model.LocalAnswer` is not generated yet and
    holds a generation slot: the caller sends it
    (:meth:`~edgeproxy._local.model.LocalAnswer.send`) or gives the slot back
    (:meth:`~edgeproxy._local.model.LocalAnswer.abandon`).
    """

    response: StreamResponse
    kind: str
    """What answers: ``stale-cache``, ``local-model`` or ``plugin`` (the request's
    ``degraded``, its ``X-Edgeproxy-Degraded``; a lighter model's answer is a region's,
    relayed, and marked ``lighter-model`` by the obtain path)."""


@dataclass(frozen=True, slots=True)
class Rung:
    """The rung of the ladder that may answer, before the ``edgeproxy_fallback`` hook has
    its say: its answer (None when none could), and why rungs that applied could not
    (``missing``: the local model not loaded). ``lighter``: the lighter rung answered, a
    region's answer for a lighter model, relayed as is (the hook is not asked)."""

    answer: Degraded | None
    missing: tuple[str, ...] = ()
    lighter: AttemptResponse | None = None


@dataclass(frozen=True, slots=True)
class UpstreamWon:
    """An attempt racing past the deadline answered before the local model: relay it.

    Taken out of the pending attempts: the caller owns it and closes it.
    """

    upstream: AttemptResponse


class FallbackStage:
    """Runs the degradation ladder for requests the regions could not answer.

    Owns the :class:`~edgeproxy._local.model.LocalModel`, which opens and
    closes with the proxy (:meth:`open`, :meth:`close`).
    """

    def __init__(self, config: Config, plugins: Plugins) -> None:
        self.config = config
        self.plugins = plugins
        self.local = LocalModel(config.local_model, base_dir=config.base_dir)
        # Answers by kind ("stale-cache", "local-model", "plugin"), and the other outcomes.
        self.served: Counter[str] = Counter()
        self.vetoed_total = 0
        self.unavailable_total = 0
        # Deadline races (deadline_action = "race"): who produced a byte first.
        self.races: Counter[str] = Counter()
        # Lighter answers by (requested model, model that answered), and their tokens by
        # the model that answered; lighter models skipped, by why.
        self.lighter: Counter[tuple[str, str]] = Counter()
        self.lighter_tokens: Counter[str] = Counter()
        self.lighter_skipped: Counter[str] = Counter()
        # Requests too long for their model answered by a larger one (larger_models), by
        # (requested model, model that answered); larger models skipped, by why.
        self.larger: Counter[tuple[str, str]] = Counter()
        self.larger_skipped: Counter[str] = Counter()

    def open(self) -> None:
        """Start loading the local model in the background; returns at once."""
        self.local.start()

    async def close(self) -> None:
        await self.local.close()

    async def ladder(
        self,
        request: Exchange,
        ctx: RequestContext,
        *,
        stale: StreamResponse | None,
        lighter: Callable[[], Awaitable[AttemptResponse | None]] | None = None,
    ) -> Rung:
        """The route's ``fallback`` list, in its order, in one place: the rung that may answer
        a request the regions could not. ``stale`` is the cache's stale-if-error answer, if
        it has one; ``lighter`` sends the request for its lighter models (the obtain path's
        failover), None when the lighter rung does not apply.

        A local answer holds a generation slot: :meth:`settle` takes it over (the caller
        gives it to :meth:`settle` at once). Raises the local model's own refusal (400 bad
        input, 503 saturated).
        """
        missing: list[str] = []
        for rung in ctx.route.fallback:
            if rung == "stale" and stale is not None:
                return Rung(Degraded(stale, "stale-cache"), tuple(missing))
            if rung == "lighter" and lighter is not None:
                answered = await lighter()
                if answered is not None:
                    return Rung(None, tuple(missing), lighter=answered)
            if rung == "local" and self._local_applies(ctx):
                if not self.local.ready:
                    missing.append(f"the local model is {self.local.state}")
                    continue
                answer = await self.local.answer(ctx)
                return Rung(Degraded(answer, "local-model"), tuple(missing))
        return Rung(None, tuple(missing))

    async def settle(
        self,
        request: Exchange,
        ctx: RequestContext,
        err: ProxyError,
        rung: Rung,
        *,
        pending: Pending | None = None,
    ) -> Degraded | UpstreamWon:
        """The degraded answer for a request the regions could not answer (``err``), once
        the ``edgeproxy_fallback`` hook had its say about ``rung``'s.

        ``pending`` holds the attempts still running past the deadline
        (``deadline_action = "race"``): a local answer races them, and an
        attempt with its first byte first is taken out of ``pending`` and
        returned instead. What is left in ``pending`` is the caller's to close.

        Raises ``err`` when no rung answers or the hook vetoes, a 503 saying
        why when a rung could not answer (the local model not loaded).
        """
        chosen = rung.answer
        try:
            verdict = await self._hook(request, ctx, err, chosen)
        except BaseException:
            _discard(chosen)
            raise
        if verdict is None:
            if rung.missing:
                self.unavailable_total += 1
                raise self._unavailable(ctx, err, list(rung.missing))
            raise err
        if verdict is False:
            self.vetoed_total += 1
            raise err
        assert isinstance(verdict, Degraded)
        answer = verdict.response
        if isinstance(answer, LocalAnswer) and pending is not None:
            try:
                upstream_first = await self._upstream_first(answer, pending)
            except BaseException:
                answer.abandon()
                raise
            if upstream_first:
                answer.abandon()
                return UpstreamWon(pending.take())
        self.served[verdict.kind] += 1
        return verdict

    async def _upstream_first(self, answer: LocalAnswer, pending: Pending) -> bool:
        """Race the local model's first token against the pending attempts' first byte.

        True when an attempt had its first byte first (a tie goes to the local model).
        """
        upstream = asyncio.ensure_future(pending.ready())
        first = asyncio.ensure_future(answer.first_token())
        try:
            await asyncio.wait({upstream, first}, return_when=asyncio.FIRST_COMPLETED)
            won = (
                upstream.done()
                and upstream.exception() is None
                and upstream.result()
                and not first.done()
            )
        finally:
            upstream.cancel()
            first.cancel()
            # Both are over before anything is taken from `pending`, or it is closed.
            await asyncio.gather(upstream, first, return_exceptions=True)
        self.races["upstream" if won else "local"] += 1
        return won

    def _local_applies(self, ctx: RequestContext) -> bool:
        local = self.local
        return (
            local.enabled
            and local.serves(ctx.method, ctx.path)
            and (local.every_model or local.serves_model(model_from_body(ctx.json)))
            # Never a request that refers to stored state: the model has none of it.
            and local.stateless(ctx.path, ctx.json)
        )

    def local_may_answer(self, ctx: RequestContext) -> bool:
        """Whether the route's ladder has the local model and it may answer this request
        (its kind and its model), loaded or not."""
        return "local" in ctx.route.fallback and self._local_applies(ctx)

    async def _hook(
        self,
        request: Exchange,
        ctx: RequestContext,
        err: ProxyError,
        chosen: Degraded | None,
    ) -> Degraded | bool | None:
        """Let plugins veto (``False``) or replace the answer; returns what is to be used
        (None: nothing)."""
        if not self.plugins.has("edgeproxy_fallback"):
            return chosen
        answer = None if chosen is None else chosen.response
        verdict = await self.plugins.call_first(
            "edgeproxy_fallback", request=request, ctx=ctx, reason=err.type, answer=answer
        )
        if verdict is False:
            _discard(chosen)
            return False
        if verdict is not None and verdict is not True and verdict is not answer:
            verdict = hook_answer("edgeproxy_fallback", verdict)
            _discard(chosen)
            return Degraded(verdict, "plugin")
        return chosen

    def _unavailable(self, ctx: RequestContext, err: ProxyError, missing: list[str]) -> ProxyError:
        """The last rung: 503 with Retry-After, saying what failed and why no fallback answered."""
        retry_after = ctx.route.fallback_retry_after
        headers = {k: v for k, v in err.headers.items() if k.lower() != "retry-after"}
        headers["Retry-After"] = str(retry_after)
        return ProxyError(
            503,
            "service_unavailable",
            f"{err.message}; no fallback could answer: {', '.join(missing)}",
            code="fallback_unavailable",
            headers=headers,
        )

    def answered_lighter(self, requested: str, model: str) -> None:
        """A lighter model answered for ``requested``."""
        self.served["lighter-model"] += 1
        self.lighter[(requested, model)] += 1

    def count_lighter_usage(self, model: str, usage: dict[str, Any] | None) -> None:
        """A lighter answer's tokens, counted for the model that answered: chat's fields,
        which every API's usage carries once the relay has read it (Messages and Responses
        keep their own ``input_tokens`` and ``output_tokens`` beside them, not counted
        again)."""
        if usage:
            counted = tokens(usage.get("prompt_tokens")) + tokens(usage.get("completion_tokens"))
            self.lighter_tokens[model] += counted

    def snapshot(self) -> dict[str, Any]:
        """The fallback part of /status."""
        return {
            # By model: a list of records with a name (labelled, never a metric name).
            "lighter": [
                {"name": f"{requested}>{model}", "answers_total": count}
                for (requested, model), count in sorted(self.lighter.items())
            ],
            "lighter_usage": [
                {"name": model, "tokens_total": count}
                for model, count in sorted(self.lighter_tokens.items())
            ],
            "lighter_skipped": dict(self.lighter_skipped),
            "larger": [
                {"name": f"{requested}>{model}", "answers_total": count}
                for (requested, model), count in sorted(self.larger.items())
            ],
            "larger_skipped": dict(self.larger_skipped),
            "served": dict(self.served),
            "vetoed_total": self.vetoed_total,
            "unavailable_total": self.unavailable_total,
            "races": dict(self.races),
            "local_model": self.local.snapshot(),
        }


def _discard(chosen: Degraded | None) -> None:
    if chosen is not None and isinstance(chosen.response, LocalAnswer):
        chosen.response.abandon()
