"""The degradation ladder: what a request gets when no region can answer it.

The full ladder, per route::

    1. healthy regions          (routing and failover)
    2. fresh cache              (the cache stage, before any region)
    3. stale cache              X-Edgeproxy-Degraded: stale-cache
    4. local model              X-Edgeproxy-Degraded: local-model
    5. 503 with Retry-After     a JSON error

Rungs 1 and 2 run before this stage. :class:`FallbackStage` runs when every
attempt failed before the first byte, when the route's deadline passed with
no first byte, when no region may serve the request, or when admission
sheds a request whose policy says degrade. It walks the route's
``fallback`` list (rungs 3 and 4, in the configured order), lets the
``edgeproxy_fallback`` hook veto or replace the chosen answer, and sends
it. With the route's ``deadline_action = "race"`` and an upstream attempt
still running past the deadline (handed over as the error's
``pending_upstream``), the local answer races it: whichever produces a first
token or first byte first is sent and the other is cancelled. Recovery needs
nothing here: each new request tries the regions first,
so traffic goes back upstream as soon as a region answers; a local answer
that already started finishes on the local model.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from edgeproxy._core.config import Config
from edgeproxy._core.errors import ProxyError
from edgeproxy._local.model import LocalAnswer, LocalModel
from edgeproxy._plugins import Plugins

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext

__all__ = ["PENDING_UPSTREAM", "FallbackStage"]

logger = logging.getLogger("edgeproxy.fallback")

Finish = Callable[["RequestContext", web.StreamResponse], web.StreamResponse]
Fail = Callable[["RequestContext", ProxyError], web.StreamResponse]
Relay = Callable[[Any], Awaitable[web.StreamResponse]]

# The attribute of a deadline ProxyError that carries the upstream attempt still
# running (an asyncio.Future of the first-byte response) when the route races it.
PENDING_UPSTREAM = "pending_upstream"


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

    def open(self) -> None:
        """Start loading the local model in the background; returns at once."""
        self.local.start()

    async def close(self) -> None:
        await self.local.close()

    async def respond(
        self,
        request: web.Request,
        ctx: RequestContext,
        err: ProxyError,
        *,
        stale: web.StreamResponse | None,
        finish: Finish,
        fail: Fail,
        relay: Relay | None = None,
    ) -> web.StreamResponse:
        """The degraded answer for a request the regions could not answer, or the error.

        ``stale`` is the cache's stale-if-error answer, if it has one;
        ``finish`` adds the proxy's headers to an answer and ``fail`` turns a
        :class:`ProxyError` into the error response. ``relay`` streams an
        upstream response that won a deadline race to the client.
        """
        pending: asyncio.Future[Any] | None = getattr(err, PENDING_UPSTREAM, None)
        race = _Race(pending) if pending is not None and relay is not None else None
        try:
            return await self._respond(request, ctx, err, stale, finish, fail, relay, race)
        finally:
            if pending is not None and (race is None or not race.relayed):
                await _drop(pending)

    async def _respond(
        self,
        request: web.Request,
        ctx: RequestContext,
        err: ProxyError,
        stale: web.StreamResponse | None,
        finish: Finish,
        fail: Fail,
        relay: Relay | None,
        race: _Race | None,
    ) -> web.StreamResponse:
        answer: web.StreamResponse | None = None
        missing: list[str] = []
        try:
            for rung in ctx.route.fallback:
                if rung == "stale" and stale is not None:
                    answer = stale
                    ctx.degraded = ctx.degraded or "stale-cache"
                    break
                if rung == "local" and self._local_applies(ctx):
                    if not self.local.ready:
                        missing.append(f"the local model is {self.local.state}")
                        continue
                    answer = await self.local.answer(ctx)
                    ctx.degraded = "local-model"
                    break
            answer = await self._hook(request, ctx, err, answer)
        except ProxyError as exc:
            # Bad input for the local model (400), or its queue is saturated (503).
            return fail(ctx, exc)
        except BaseException:
            _discard(answer)
            raise
        if answer is False:
            self.vetoed_total += 1
            return fail(ctx, err)
        if answer is None:
            if missing:
                self.unavailable_total += 1
                return fail(ctx, self._unavailable(ctx, err, missing))
            return fail(ctx, err)
        assert isinstance(answer, web.StreamResponse)
        if isinstance(answer, LocalAnswer):
            try:
                if (
                    race is not None
                    and relay is not None
                    and ctx.route.deadline_action == "race"
                    and not await self._local_wins(answer, race.pending)
                ):
                    ctx.degraded = None
                    race.relayed = True  # the relay owns the upstream response now
                    return await relay(race.pending.result())
                self.served[ctx.degraded or "plugin"] += 1
                finish(ctx, answer)
                return await answer.send(request, ctx)
            except ProxyError as exc:
                return fail(ctx, exc)
            finally:
                answer.abandon()  # a no-op once sent
        self.served[ctx.degraded or "plugin"] += 1
        return finish(ctx, answer)

    async def _local_wins(self, answer: LocalAnswer, pending: asyncio.Future[Any]) -> bool:
        """Race the local model's first token against the upstream attempt's first byte."""
        first = asyncio.ensure_future(answer.first_token())
        try:
            await asyncio.wait({first, pending}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not first.done():
                first.cancel()
        upstream_won = pending.done() and not pending.cancelled() and pending.exception() is None
        if upstream_won and not first.done():
            self.races["upstream"] += 1
            answer.abandon()
            return False
        self.races["local"] += 1
        return True

    def _local_applies(self, ctx: RequestContext) -> bool:
        return self.local.enabled and self.local.serves(ctx.method, ctx.path)

    async def _hook(
        self,
        request: web.Request,
        ctx: RequestContext,
        err: ProxyError,
        answer: web.StreamResponse | None,
    ) -> Any:
        """Let plugins veto (``False``) or replace the answer; returns what is to be used."""
        if not self.plugins.has("edgeproxy_fallback"):
            return answer
        verdict = await self.plugins.call_first(
            "edgeproxy_fallback", request=request, ctx=ctx, reason=err.type, answer=answer
        )
        if verdict is False:
            _discard(answer)
            ctx.degraded = None
            return False
        if isinstance(verdict, web.StreamResponse) and verdict is not answer:
            _discard(answer)
            ctx.degraded = "plugin"
            return verdict
        return answer

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

    def snapshot(self) -> dict[str, Any]:
        """The fallback part of /status."""
        return {
            "served": dict(self.served),
            "vetoed_total": self.vetoed_total,
            "unavailable_total": self.unavailable_total,
            "races": dict(self.races),
            "local_model": self.local.snapshot(),
        }


@dataclass(slots=True)
class _Race:
    """An upstream attempt still running past the deadline, and whether it was relayed."""

    pending: asyncio.Future[Any]
    relayed: bool = False


async def _drop(pending: asyncio.Future[Any]) -> None:
    """Cancel an upstream attempt that was not raced, or close the answer that lost."""
    if not pending.done():
        pending.cancel()
        return
    if pending.cancelled() or pending.exception() is not None:
        return
    aclose = getattr(pending.result(), "aclose", None)
    if aclose is not None:
        await aclose()


def _discard(answer: object) -> None:
    if isinstance(answer, LocalAnswer):
        answer.abandon()
