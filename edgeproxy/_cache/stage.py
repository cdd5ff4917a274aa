"""The hot-answer cache stage: what is cacheable, and serving or storing answers.

Cacheable: POSTs to the endpoints the table marks ``cacheable`` whose JSON body its
API's dialect says is (:meth:`~edgeproxy._protocol.dialects.Dialect.cacheable`):
deterministic (``temperature`` 0, or a ``seed`` where the API has one; embeddings
always) and stateless (a Responses request with ``store: false``, no
``previous_response_id``, no ``conversation``); any stateless JSON POST on a route
configured ``cache = "always"``; and GETs whose upstream answer is marked cacheable
(``max-age``/``s-maxage``, not private). Never: a request with
``Cache-Control: no-store``, a body that is not a JSON object, a route configured
``cache = "off"``, an answer other than a complete 200 (a stream must end as its API
ends one: chat's ``[DONE]``, Messages' ``message_stop``, the Responses API's
``response.completed``, with no error before), or one bigger than
``[cache] max_entry_bytes``. Answers are replayed in their API's own format, streamed or
not, whichever form was stored. What a key covers, and so who may share an entry, is in
:mod:`edgeproxy._cache.keys`.

:class:`CacheStage` is the pipeline's view of it all: :meth:`~CacheStage.lookup`
answers from the cache (HIT, STALE) or from an identical request in flight
(COALESCED), or hands the request a :class:`CacheRecorder` that stores what
the Responder relays; :meth:`~CacheStage.serve_stale` is the
stale-if-error rung of the fallback ladder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

from multidict import CIMultiDict

from edgeproxy._cache.backends import CacheBackend, make_backend
from edgeproxy._cache.entry import Entry, ready_form, replay_parts, response_headers
from edgeproxy._cache.flight import (
    DONE,
    FAILED,
    Coalescer,
    Flight,
    live_events,
    wait_finished,
    wait_started,
)
from edgeproxy._cache.keys import (
    KeyHeaders,
    _get_digest,
    _post_digest,
    cache_scope,
    custom_digest,
    tenant_scope,
)
from edgeproxy._cache.known import Known, KnownRequests
from edgeproxy._cache.plan import (
    CachePlan,
    _directives,
    _plan_for_ctx,
    _seconds,
    request_dialect,
)
from edgeproxy._cache.recorder import CacheRecorder
from edgeproxy._cache.semantic import SemanticCache, open_semantic
from edgeproxy._core.answer import Answer
from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.outcome import Outcome
from edgeproxy._core.response import StreamResponse
from edgeproxy._core.types import Headers
from edgeproxy._protocol.compression import Compression
from edgeproxy._protocol.endpoints import ENDPOINT_NAMED, openai_endpoint
from edgeproxy._protocol.headers import request_id
from edgeproxy._upstream.endpoint import RegionEndpoints

if TYPE_CHECKING:
    from edgeproxy._local.model import LocalModel
    from edgeproxy._plugins import Plugins

__all__ = ["CachePlan", "CacheRecorder", "CacheStage"]

logger = logging.getLogger("edgeproxy.cache")

# A key's flight is led at most this many times in a row; after that, followers
# stop queueing behind one request at a time and go upstream on their own.
MAX_FLIGHT_ATTEMPTS: Final = 2


@dataclasses.dataclass(frozen=True, slots=True)
class Refresh:
    """A background refresh the cache asks for (stale-while-revalidate, early refresh):
    the request to send again, with a context of its own, and the plan to store its answer
    under. The pipeline obtains the answer (:meth:`CacheStage.take_refreshes`); the cache
    never calls back into it."""

    ctx: RequestContext
    plan: CachePlan


class CacheStats:
    """Counters for ``/status``: outcomes, why answers were not cached, refreshes."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.bypass: Counter[str] = Counter()
        self.not_cached: Counter[str] = Counter()
        self.stores = 0
        self.refreshes = 0
        self.refresh_failures = 0
        self.early_refreshes = 0
        self.purged = 0
        self.stale_if_error = 0

    def hit_ratio(self) -> float | None:
        outcomes = self.outcomes
        served = (
            outcomes["HIT"] + outcomes["STALE"] + outcomes["COALESCED"] + outcomes["SEMANTIC-HIT"]
        )
        total = served + self.outcomes["MISS"]
        return round(served / total, 4) if total else None


# An Answer built without the named tuple's keyword handling: once per cache hit.
_new_tuple = tuple.__new__


class CacheStage:
    """The cache as the pipeline sees it: lookup, coalescing, recording, stale-if-error.

    With ``refresh`` on, lookups ask for background refreshes (stale-while-revalidate,
    early refresh) as :class:`Refresh` values, which whoever can go upstream takes with
    :meth:`take_refreshes` and runs between :meth:`refresh_recorder` and
    :meth:`refresh_done`; off, there are none. Open and close it with the proxy
    (:meth:`open`, :meth:`close`).
    """

    def __init__(
        self,
        config: Config,
        plugins: Plugins,
        *,
        refresh: bool = False,
        clock: Callable[[], float] = time.time,
        regions: Iterable[RegionEndpoints] = (),
        local_model: LocalModel | None = None,
        serving: Callable[[str], frozenset[str] | None] | None = None,
    ) -> None:
        self.config = config.cache
        self.key_headers = KeyHeaders(config)
        self.compression = Compression(config)
        # Wall-clock seconds, as entries are shared across hosts: freshness, Age, stale windows.
        self.clock = clock
        self.plugins = plugins
        self.backend: CacheBackend | None = (
            make_backend(self.config) if self.config.enabled else None
        )
        self.coalescer = Coalescer()
        self.stats = CacheStats()
        # Routes asking for it share one semantic cache (its index is this worker's).
        self.semantic: SemanticCache | None = (
            open_semantic(
                config,
                self.backend,
                regions,
                spawn=self.spawn,
                local_model=local_model,
                serving=serving,
            )
            if self.backend is not None and any(r.semantic_cache for r in config.routes)
            else None
        )
        self.refresh = refresh
        # Refreshes asked for since the last take_refreshes(); each one's key is in
        # _refreshing until refresh_done() (or the cache closes).
        self.due: list[Refresh] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._refreshing: set[str] = set()
        self._random: Callable[[], float] = random.random
        self._closed = False
        # What the cache made of the requests it saw, and the one being looked up now
        # (from passes() to its lookup, which follows it at once).
        self.known = KnownRequests(self.key_headers.names)
        self._current: tuple[RequestContext, Known] | None = None

    # -- lifespan ----------------------------------------------------------

    async def open(self) -> None:
        """Connect the backend (a Redis that does not answer is a warning, not a failure)."""
        if self.backend is not None:
            await self.backend.open()
        if self.semantic is not None:
            await self.semantic.open()

    async def close(self) -> None:
        """Cancel refreshes and pending stores, then close the backend."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.semantic is not None:
            await self.semantic.close()
        if self.backend is not None:
            await self.backend.close()

    # -- keys and plans ----------------------------------------------------

    async def key(self, request: Exchange, ctx: RequestContext) -> str | None:
        """The scoped key of a cacheable request (the hook may replace the digest), or None."""
        plan = await self.plan(request, ctx)
        return plan.key if plan is not None else None

    async def plan(self, request: Exchange, ctx: RequestContext) -> CachePlan | None:
        """Decide what the cache does with ``ctx``; sets ``ctx.outcome.cache_key`` and, for a
        request the cache leaves alone, ``ctx.outcome.cache = "BYPASS"``."""
        if self.backend is None:
            return None
        reason = self._bypass_reason(ctx)
        if reason:
            self._bypass(ctx, reason)
            return None
        return await self._plan(request, ctx)

    async def _plan(self, request: Exchange, ctx: RequestContext) -> CachePlan:
        """The plan of a request :meth:`_bypass_reason` let through; that of an identical
        request before it when :meth:`passes` recognised this one."""
        current, self._current = self._current, None
        if current is not None and current[0] is ctx:
            known = current[1]
            plan = known.plan
            if plan is None:
                plan = known.plan = await self._new_plan(request, ctx)
            else:
                ctx.outcome.cache_key = plan.key
            return plan
        return await self._new_plan(request, ctx)

    async def _new_plan(self, request: Exchange, ctx: RequestContext) -> CachePlan:
        key = await self._cacheable_key(request, ctx)
        ctx.outcome.cache_key = key
        return _plan_for_ctx(ctx, key, coalesce=self.config.coalesce)

    def _bypass(self, ctx: RequestContext, reason: str) -> None:
        ctx.outcome.cache = "BYPASS"
        stats = self.stats
        stats.outcomes["BYPASS"] += 1
        stats.bypass[reason] += 1

    async def _key(self, request: Exchange, ctx: RequestContext) -> tuple[str | None, str]:
        reason = self._bypass_reason(ctx)
        if reason:
            return None, reason
        return await self._cacheable_key(request, ctx), ""

    async def _cacheable_key(self, request: Exchange, ctx: RequestContext) -> str:
        # Only now: the scope hashes the tenant or credential, wasted on a bypass.
        scope = cache_scope(ctx)
        digest = self._digest(ctx, scope)
        if "edgeproxy_cache_key" in self.plugins.active:
            custom = await self.plugins.call_first(
                "edgeproxy_cache_key", request=request, ctx=ctx, default_key=digest
            )
            if custom is not None:
                digest = custom_digest(ctx, custom)
        # The scope stays in front whatever the hook says: entries never cross tenants.
        return f"{scope}:{digest}"

    def _bypass_reason(self, ctx: RequestContext) -> str:
        """Why the cache leaves ``ctx`` alone (a ``bypass`` counter name); "" when cacheable."""
        mode = ctx.route.cache
        if mode == "off":
            return "route_off"
        if "no-store" in ctx.headers.get("cache-control", "").lower():
            return "no_store"
        method = ctx.method
        if method == "GET":
            return "get_with_body" if ctx.body else ""
        if method != "POST":
            return "method"
        # The endpoint looked up once (CACHEABLE_PATHS asks the same): the one the
        # request's facts name, once it has entered.
        facts = ctx.facts
        endpoint = (
            ENDPOINT_NAMED.get(facts.dialect) if facts is not None else openai_endpoint(ctx.path)
        )
        if mode != "always" and (endpoint is None or not endpoint.cacheable):
            return "path"
        body = ctx.json
        if not isinstance(body, dict):
            return "not_json"
        # Its API says which requests may share an answer: never one stored by the region or
        # depending on what is (a Responses chain), not even on a route that caches always.
        dialect = endpoint.dialect if endpoint is not None else request_dialect(ctx)
        if mode == "always" or dialect.cacheable(body):
            return "" if mode != "always" or dialect.stateless(body) else "stateful"
        # Chat's and the others' requests keep no state: not asked twice for the reason.
        return (
            "stateful"
            if dialect.keeps_state and not dialect.stateless(body)
            else ("not_deterministic")
        )

    def _digest(self, ctx: RequestContext, scope: str) -> str:
        """The key digest of a request :meth:`_bypass_reason` let through."""
        if ctx.method == "GET":
            return _get_digest(ctx, scope)
        return _post_digest(ctx, ctx.json, scope, self.key_headers)

    def storable(
        self, plan: CachePlan, status: int, headers: list[tuple[str, str]]
    ) -> tuple[tuple[float, float, float] | None, str]:
        """((ttl, stale-while-revalidate, stale-if-error), "") for an answer that may be
        stored, else (None, why not)."""
        if status != 200:
            return None, "status"
        cc_values = [v for k, v in headers if k.lower() == "cache-control"]
        cc = _directives(cc_values)
        if "no-store" in cc or "private" in cc:
            return None, "no_store"
        if plan.method != "GET":
            # The key does not cover Accept-Encoding: only identity bodies may be shared.
            encoding = next((v for k, v in headers if k.lower() == "content-encoding"), "")
            if encoding.strip().lower() not in ("", "identity"):
                return None, "encoded"
            return (plan.ttl, plan.swr, plan.sie), ""
        # A GET is stored only when its upstream says a shared cache may keep it.
        lowered = [(k.lower(), v) for k, v in headers]
        if any(k == "set-cookie" for k, _ in lowered):
            return None, "set_cookie"
        vary = {v.strip().lower() for k, value in lowered if k == "vary" for v in value.split(",")}
        if vary - {"accept", "accept-encoding", ""}:
            return None, "vary"
        if "no-cache" in cc:
            return None, "not_cacheable"
        if plan.credentials and "public" not in cc and "s-maxage" not in cc:
            return None, "not_cacheable"
        # s-maxage is for shared caches like this one, and wins over max-age.
        ttl = _seconds(cc["s-maxage"]) if "s-maxage" in cc else _seconds(cc.get("max-age"))
        age = next((_seconds(v) for k, v in lowered if k == "age"), None) or 0.0
        if ttl is None or ttl - age <= 0:
            return None, "not_cacheable"
        swr = _seconds(cc.get("stale-while-revalidate"))
        sie = _seconds(cc.get("stale-if-error"))
        return (
            ttl - age,
            plan.swr if swr is None else swr,
            plan.sie if sie is None else sie,
        ), ""

    # -- serving -------------------------------------------------------------

    def passes(self, ctx: RequestContext) -> bool:
        """Whether the cache leaves ``ctx`` alone (off, or a bypass, counted here): then
        :meth:`lookup` has nothing to do, and the pipeline skips its coroutine."""
        if self.backend is None:
            return True
        known = self.known.recognise(ctx, self.plugins.active, self._bypass_reason)
        reason = self._bypass_reason(ctx) if known is None else known.reason
        if reason:
            self._current = None
            self._bypass(ctx, reason)
            return True
        self._current = (ctx, known) if known is not None else None
        return False

    async def lookup(
        self, request: Exchange, ctx: RequestContext, *, checked: bool = False
    ) -> tuple[Answer | None, CacheRecorder | None]:
        """An answer from the cache or from an identical request in flight; else, for a
        cacheable request, the recorder that stores what the pipeline relays.

        ``checked``: :meth:`passes` was asked already, and said no."""
        if not checked and self.passes(ctx):
            return None, None
        assert self.backend is not None
        current = self._current
        known = current[1].plan if current is not None and current[0] is ctx else None
        if known is not None:
            # The plan of an identical request, recognised by passes(): no coroutine.
            self._current = None
            plan = known
            ctx.outcome.cache_key = plan.key
        else:
            plan = await self._plan(request, ctx)
        if plan.lookup:
            entry = await self.backend.get(plan.key)
            if entry is not None:
                answer = self._serve(request, ctx, plan, entry)
                if answer is not None:
                    return answer, None
            semantic = self.semantic
            if semantic is not None and ctx.route.semantic_cache:
                answer = await semantic.lookup(self, ctx, plan, ctx.route.semantic_threshold)
                if answer is not None:
                    return answer, None
        if plan.coalesce:
            return await self._coalesce(request, ctx, plan)
        return None, self._lead(ctx, plan, None)

    def _serve(
        self, request: Exchange, ctx: RequestContext, plan: CachePlan, entry: Entry
    ) -> Answer | None:
        """HIT while fresh (maybe refreshing early), STALE within stale-while-revalidate."""
        now = self.clock()
        if now < entry.fresh_until:
            beta = self.config.xfetch_beta
            # No draw where XFetch is off (beta 0): it could not refresh anything.
            if beta > 0 and entry.should_refresh_early(now, beta, 1.0 - self._random()):
                if self._refresh_later(ctx, plan):
                    self.stats.early_refreshes += 1
            return self.answer_of(ctx, plan, entry, "HIT", now)
        if now < entry.swr_until:
            self._refresh_later(ctx, plan)
            return self.answer_of(ctx, plan, entry, "STALE", now)
        return None

    def answer_of(
        self,
        ctx: RequestContext,
        plan: CachePlan,
        entry: Entry,
        outcome: str,
        now: float | None = None,
    ) -> Answer | None:
        """``entry`` as the client asked for it (stream or JSON), or None if that is impossible.

        A form served as stored comes from the entry's ready forms (:func:`ready_form`),
        its compressed body from ``entry.encoded``: each made on the first hit asking for it;
        a hit adds only what is its own (Age, the markers, its request id)."""
        ready = ready_form(
            entry,
            wants_sse=plan.wants_sse,
            include_usage=plan.include_usage,
            dialect=plan.dialect,
        )
        if ready is None:
            converted = replay_parts(
                entry,
                wants_sse=plan.wants_sse,
                include_usage=plan.include_usage,
                dialect=plan.dialect,
            )
            if converted is None:
                return None
            parts, sse = converted
            head = response_headers(entry, sse=sse)
            length = len(parts[0]) if len(parts) == 1 else None
        else:
            sse = ready.sse
            head = ready.head
            length = ready.length
        now = self.clock() if now is None else now
        # Stored headers never carry these names (Entry.build drops them): appended, in
        # one list (the response copies it into a CIMultiDict of its own anyway).
        region = entry.region if outcome == "COALESCED" and entry.region else "none"
        headers = [
            *head,
            ("Age", str(entry.age(now))),
            ("X-Edgeproxy-Cache", outcome),
            ("X-Edgeproxy-Cache-Key", plan.key),
            ("X-Edgeproxy-Region", region),
            ("X-Request-Id", ctx.request_id),
        ]
        encoding = self.compression.choose(ctx, entry.status, length, head, sse=sse)
        body: bytes | None
        if encoding is not None:
            # Made once per coding and form, kept with the entry for the hits after.
            form = f"{encoding} {'sse' if sse else 'json'} {plan.include_usage}"
            packed = entry.encoded.get(form)
            if packed is None:
                if ready is not None:
                    parts = [ready.body] if ready.body is not None else list(ready.parts or ())
                packed = entry.encoded[form] = self.compression.whole(parts, encoding)
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers += (("Content-Encoding", encoding), ("Vary", "Accept-Encoding"))
            body, chunks = packed, None
        elif ready is None:
            body, chunks = (parts[0], None) if not sse else (None, parts)
        else:
            # A list of the form's own (a response takes its parts as a list).
            body = ready.body
            chunks = list(ready.parts) if ready.parts is not None else None
        ctx.outcome.cache = outcome
        self.stats.outcomes[outcome] += 1
        if sse:
            if chunks is None:
                assert body is not None
                chunks = [body]
            return _new_tuple(
                Answer, (entry.status, headers, "cache", None, chunks, None, None, True, None, None)
            )
        return _new_tuple(
            Answer, (entry.status, headers, "cache", body, None, None, None, False, None, None)
        )

    async def recorder_for(self, request: Exchange, ctx: RequestContext) -> CacheRecorder | None:
        """The recorder storing the answer to ``ctx`` under its own key (a lighter model's
        request, answering for another), or None when that request is not cacheable."""
        if self.backend is None:
            return None
        plan = await self.plan(request, ctx)
        return None if plan is None else CacheRecorder(self, ctx, plan, None)

    def _lead(self, ctx: RequestContext, plan: CachePlan, flight: Flight | None) -> CacheRecorder:
        ctx.outcome.cache = "MISS"
        self.stats.outcomes["MISS"] += 1
        return CacheRecorder(self, ctx, plan, flight)

    async def _coalesce(
        self, request: Exchange, ctx: RequestContext, plan: CachePlan
    ) -> tuple[Answer | None, CacheRecorder | None]:
        attempt = 1
        while True:
            flight, leading = self.coalescer.join(plan.key, attempt)
            if leading:
                return None, self._lead(ctx, plan, flight)
            try:
                answer, action = await self._follow(request, ctx, plan, flight)
            finally:
                flight.followers -= 1
            if answer is not None:
                return answer, None
            if action == "alone":
                return None, self._lead(ctx, plan, None)
            # The leader gave up before anything reached this request.
            if flight.error:
                stale = await self._stale(request, ctx)
                if stale is not None:
                    return stale, None
            if flight.attempt >= MAX_FLIGHT_ATTEMPTS:
                return None, self._lead(ctx, plan, None)
            # The first follower to get here leads the retry; the others follow it.
            attempt = flight.attempt + 1

    async def _follow(
        self, request: Exchange, ctx: RequestContext, plan: CachePlan, flight: Flight
    ) -> tuple[Answer | None, str]:
        """Answer a follower from ``flight``: (answer, "") or (None, "retry" | "alone")."""
        await wait_started(flight)
        if flight.state == FAILED:
            return None, "retry"
        if plan.wants_sse and flight.sse and flight.shareable:
            # Same form as the leader's: chunks as the leader receives them.
            headers: Headers = [
                (name, value)
                for name, value in flight.headers
                if name.lower() not in ("content-length", "x-request-id", "date", "set-cookie")
            ]
            headers += (
                ("Age", "0"),
                ("X-Edgeproxy-Cache", "COALESCED"),
                ("X-Edgeproxy-Cache-Key", plan.key),
                ("X-Edgeproxy-Region", flight.region or "none"),
                ("X-Request-Id", ctx.request_id),
            )
            ctx.outcome.cache = "COALESCED"
            self.stats.outcomes["COALESCED"] += 1
            chunks = live_events(flight, include_usage=plan.include_usage, dialect=plan.dialect)
            # Still a follower while its answer streams (the leader notifies followers only):
            # until the Responder lets go of the answer.
            flight.followers += 1

            def unfollow() -> None:
                flight.followers -= 1

            live = Answer(
                flight.status,
                headers,
                source="coalesced",
                chunks=chunks,
                sse=True,
                release=unfollow,
            )
            return live, ""
        await wait_finished(flight)
        if flight.state != DONE:
            return None, "retry"
        if flight.entry is None:
            return None, "alone"
        answer = self.answer_of(ctx, plan, flight.entry, "COALESCED")
        return (answer, "") if answer is not None else (None, "alone")

    async def serve_stale(self, request: Exchange, ctx: RequestContext) -> StreamResponse | None:
        """The stale-if-error answer: a stored answer within its ``stale_if_error`` window
        (or still fresh), marked ``X-Edgeproxy-Cache: STALE`` and
        ``X-Edgeproxy-Degraded: stale-cache``, as the ladder's response; None when there is
        none."""
        answer = await self._stale(request, ctx)
        # Seen by the edgeproxy_fallback hook as the ladder's response.
        return answer.ready() if answer is not None else None

    async def _stale(self, request: Exchange, ctx: RequestContext) -> Answer | None:
        if self.backend is None:
            return None
        if ctx.outcome.cache_key is None and ctx.outcome.cache is None:
            # Shed by admission before the cache stage ran: work the key out now.
            ctx.outcome.cache_key, _ = await self._key(request, ctx)
        if ctx.outcome.cache_key is None:
            return None
        entry = await self.backend.get(ctx.outcome.cache_key)
        now = self.clock()
        if entry is None or now >= max(entry.sie_until, entry.fresh_until):
            return None
        plan = _plan_for_ctx(ctx, ctx.outcome.cache_key, coalesce=False)
        answer = self.answer_of(ctx, plan, entry, "STALE", now)
        if answer is None:
            return None
        answer.headers.append(("X-Edgeproxy-Degraded", "stale-cache"))
        self.stats.stale_if_error += 1
        return answer

    # -- storing and refreshing -------------------------------------------------

    def store(self, key: str, entry: Entry, flight: Flight | None) -> None:
        """Store ``entry`` in the background; the flight stays joinable until it is stored,
        so a request arriving meanwhile is answered from it rather than going upstream."""

        async def run() -> None:
            try:
                assert self.backend is not None
                if await self.backend.set(key, entry):
                    self.stats.stores += 1
                    if self.semantic is not None:
                        self.semantic.stored(key, entry, self.clock())
                else:
                    self.stats.not_cached["store_failed"] += 1
            finally:
                if flight is not None:
                    self.coalescer.end(flight)

        self.spawn(run())

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` in the background, cancelled when the cache closes (its task is
        kept until it ends)."""
        if self._closed:
            coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refresh_later(self, ctx: RequestContext, plan: CachePlan) -> bool:
        """Ask for a refresh of ``plan.key`` in the background, once: not if a refresh or a
        request for it is already in flight.

        The refresh outlives the client's handler: it gets a context of its own, copied
        now, and nothing of the client's request.
        """
        if not self.refresh or plan.key in self._refreshing or plan.key in self.coalescer.flights:
            return False
        self._refreshing.add(plan.key)
        self.due.append(Refresh(_refresh_context(ctx), plan))
        return True

    def take_refreshes(self) -> list[Refresh]:
        """The refreshes asked for since the last call; the taker runs each one."""
        due, self.due = self.due, []
        return due

    def refresh_recorder(self, refresh: Refresh) -> CacheRecorder | None:
        """The recorder that stores the refreshed answer, leading the key's flight; None
        when an identical request leads it already (then there is nothing to run)."""
        plan = refresh.plan
        flight, leading = self.coalescer.join(plan.key)
        if not leading:
            flight.followers -= 1
            self._refreshing.discard(plan.key)
            return None
        return CacheRecorder(self, refresh.ctx, plan, flight)

    def refresh_done(
        self, refresh: Refresh, recorder: CacheRecorder, error: str | None = None
    ) -> None:
        """A refresh ended, with the answer recorded or ``error`` (the stale entry stays)."""
        if error is None:
            self.stats.refreshes += 1
        else:
            self.stats.refresh_failures += 1
            logger.info("cache: background refresh of %s failed: %s", refresh.plan.key, error)
        recorder.release()
        self._refreshing.discard(refresh.plan.key)

    # -- admin -------------------------------------------------------------------

    async def purge(
        self, *, key: str | None = None, prefix: str | None = None, tenant: str | None = None
    ) -> int:
        """Delete the entry named ``key``, every entry of ``tenant``, or every entry whose key
        starts with ``prefix`` (``""``: all of them). Returns how many went."""
        if self.backend is None:
            return 0
        if tenant is not None:
            prefix = tenant_scope(tenant) + ":"
        if key is not None:
            count = await self.backend.delete(key)
            if self.semantic is not None:
                await self.semantic.purged(key)
        else:
            count = await self.backend.purge(prefix or "")
            if not prefix and self.semantic is not None:
                self.semantic.clear()
        self.stats.purged += count
        return count

    def status(self) -> dict[str, Any]:
        """The ``cache`` section of ``/status``."""
        stats = self.stats
        out: dict[str, Any] = {
            "enabled": self.backend is not None,
            "backend": self.config.backend,
            "hit_ratio": stats.hit_ratio(),
            "outcomes": dict(stats.outcomes),
            "bypass_reasons": dict(stats.bypass),
            "not_cached": dict(stats.not_cached),
            "stores": stats.stores,
            "refreshes": stats.refreshes,
            "early_refreshes": stats.early_refreshes,
            "refresh_failures": stats.refresh_failures,
            "stale_if_error": stats.stale_if_error,
            "purged": stats.purged,
            "in_flight": len(self.coalescer),
        }
        if self.semantic is not None:
            out["semantic"] = self.semantic.snapshot()
        if self.backend is not None:
            tiers = self.backend.status()
            out["tiers"] = tiers
            out["errors"] = _errors(tiers)
        return out


def _refresh_context(ctx: RequestContext) -> RequestContext:
    """A background refresh's own context: the client's request (its headers copied), as a
    new request with nothing answered yet."""
    return dataclasses.replace(
        ctx,
        request_id=request_id(None),
        headers=CIMultiDict(ctx.headers),
        started=time.monotonic(),
        outcome=Outcome(cache="REFRESH"),
        extra={},
    )


def _errors(tiers: dict[str, Any]) -> dict[str, int]:
    """Backend error counts, summed over the tiers that report them."""
    total: Counter[str] = Counter()
    stack = [tiers]
    while stack:
        node = stack.pop()
        for name, value in node.items():
            if name == "errors" and isinstance(value, dict):
                total.update(value)
            elif isinstance(value, dict):
                stack.append(value)
    return dict(total)
