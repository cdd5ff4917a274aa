"""One request, top to bottom: received, admission, cache, route, upstream, fallback, stream.

:meth:`Pipeline.handle` is the single place to read to follow a request.
Each stage is a small object with one narrow method; stages raise
:class:`~edgeproxy._core.errors.ProxyError` for answers they give themselves, and
plugin hooks are called at the points :mod:`edgeproxy.hookspecs` documents.

The pipeline owns what a request holds and lets go of it on every way out
(an answer, an error, the client leaving, shutdown): its admission slot, the
cache's recording, the upstream answer it relays, the attempts kept running
past the deadline for the fallback to race, and a local answer's generation
slot. Stages borrow them; none releases what it does not own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple

from multidict import CIMultiDict

from edgeproxy._admission.admission import AdmissionStage, Admitted, Overloaded
from edgeproxy._admission.poison import Poison
from edgeproxy._answer.heartbeat import Heartbeat
from edgeproxy._answer.responder import Responder
from edgeproxy._cache.stage import CacheRecorder, CacheStage, Refresh
from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext, start_context
from edgeproxy._core.errors import ProxyError
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.response import Response, StreamResponse
from edgeproxy._local.model import LocalAnswer
from edgeproxy._obtain import Obtainer
from edgeproxy._obtain.continuation import ContinuationStage
from edgeproxy._obtain.failover import AttemptResponse, Failover, Failure, FailureKind
from edgeproxy._obtain.fallback import Degraded, FallbackStage
from edgeproxy._obtain.forward import UpstreamStage
from edgeproxy._obtain.modellist import ModelList
from edgeproxy._plugins import PluginError, Plugins, hook_answer
from edgeproxy._protocol.clientip import client_ip_resolver
from edgeproxy._protocol.compression import Compression
from edgeproxy._protocol.dialects import RESPONSES
from edgeproxy._protocol.endpoints import openai_endpoint
from edgeproxy._protocol.headers import request_ids
from edgeproxy._realtime.relay import Drain
from edgeproxy._realtime.sessions import Sessions
from edgeproxy._routing.chains import ChainRecord, EdgeChains, HeldObject
from edgeproxy._routing.owners import (
    Missing,
    Owner,
    Owners,
    StatefulRequest,
    created_id,
    lookup_failed,
    owner_unavailable,
    stateful_request,
    too_many_refs,
)
from edgeproxy._routing.routeplan import RoutePlan
from edgeproxy._routing.router import Router
from edgeproxy._upstream.pool import UpstreamError
from edgeproxy._upstream.regions import RegionSet

__all__ = ["JSON_BODY_LIMIT", "Pipeline"]

logger = logging.getLogger("edgeproxy")

# Bodies up to this size are read in one go (they arrive in one or two reads
# anyway), and so are JSON bodies up to ``JSON_BODY_LIMIT``, so that plugins,
# the cache and routing can look inside. Anything else streams upstream as it
# arrives.
SMALL_BODY = 64 * 1024
JSON_BODY_LIMIT = 4 * 1024 * 1024
# What is read of a JSON answer creating a stored object to find its id (objects are small).
_CREATED_ANSWER_LIMIT = 1024 * 1024


# How open WebSocket sessions are closed when the proxy stops, or reloads.
SHUTDOWN = Drain(1001, "going away", "the proxy is shutting down; reconnect")
RELOAD = Drain(1012, "service restart", "the proxy is reloading its configuration; reconnect")


class _Chained(NamedTuple):
    """What :meth:`Pipeline._chained` made of a request whose chain the edge may hold."""

    ctx: RequestContext
    state: StatefulRequest | None
    owner: str | None
    chain: ChainRecord | None
    held: HeldObject | None
    answer: Response | None


class Pipeline:
    """received → admission → cache → route → upstream → fallback → stream, for every request."""

    def __init__(self, config: Config, regions: RegionSet, plugins: Plugins) -> None:
        self.config = config
        # The one trusted-proxy list, parsed once for this config (a reload builds a new
        # pipeline): every request's client is resolved with it at entry.
        self.clients = client_ip_resolver(config.server.trusted_proxies)
        self.regions = regions
        self.plugins = plugins
        self.router = Router(config, regions)
        self.fallback = FallbackStage(config, plugins)
        # The semantic cache's model verifier asks the local model, or a model of the
        # regions the catalog says serve it.
        self.cache = CacheStage(
            config,
            plugins,
            refresh=True,
            regions=regions,
            local_model=self.fallback.local,
            serving=self.router.models.serving,
        )
        self.upstream = UpstreamStage(config, plugins)
        # Poison bodies and the callers who send them: failover finds them, admission
        # limits their callers.
        self.poison = Poison(config, clock=regions.clock)
        self.failover = Failover(config, regions, self.upstream, poison=self.poison)
        self.continuation = ContinuationStage()
        # The one path from a request to its answer: route, failover, fallback.
        self.obtainer = Obtainer(
            plugins, self.router, self.failover, self.fallback, self.cache, self.continuation
        )
        # The one writer of downstream bytes, whatever answers.
        self.responder = Responder(plugins, Compression(config))
        self.admission = AdmissionStage(config, poison=self.poison)
        # Where each stored object lives (a stored response, a conversation, a file, a batch,
        # a vector store): the requests that refer to it go there.
        self.owners = Owners(config.stateful, clock=regions.clock)
        # Responses chains held at the edge (routes with responses_state = "edge").
        self.chains = EdgeChains(config, regions, clock=regions.clock)
        self.models = ModelList(config, regions, self.failover)
        # WebSocket sessions (the Realtime API): routed at their handshake, then relayed.
        self.sessions = Sessions(
            config, regions, plugins, self.admission, self.obtainer, self.upstream, self.owners
        )
        self.in_flight = 0
        # Futures of wait_idle() callers, resolved when in_flight drops to zero.
        self._idle_waiters: list[asyncio.Future[None]] = []

    @property
    def draining(self) -> bool:
        """While draining, answers close their connection so keep-alive clients reconnect to
        a live instance (the Responder's to do)."""
        return self.responder.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.responder.draining = value
        if value:
            self.sessions.drain(SHUTDOWN)

    def retire(self) -> None:
        """A reload replaced this pipeline: its open sessions end once their response under
        way is done (1012: reconnect, to the new configuration)."""
        self.sessions.drain(RELOAD)

    async def handle(self, request: Exchange) -> StreamResponse:
        """Answer ``request``. The answer returned was sent already, or (a :class:`Response`
        not yet prepared) is for the front end to send."""
        # The request's context, as the stages and hooks will see it (built here, not in a
        # helper: a call less on every request).
        headers = request.headers
        target = request.target
        method = request.method
        peer = request.client
        rid, trace = request_ids(headers.get("x-request-id"), headers.get("traceparent"))
        # The one place the client is resolved: limits, geo, plugins and the access log read it.
        clients = self.clients
        client_ip, peer_trusted = clients.resolve_peer(
            peer, headers.getall("x-forwarded-for", ()) if clients.networks else ()
        )
        ctx = start_context(
            rid,
            trace,
            method,
            target,
            CIMultiDict(headers),
            client_ip,
            time.monotonic(),
            self.config.route_for(method, target.split("?", 1)[0]),
            request.scheme,
            request.version,
            request.host,
            peer,
            peer_trusted,
        )
        self.in_flight += 1
        active = self.plugins.active
        # What the request holds, each let go of in `finally` whatever happens: its
        # admission slot, the cache's recording, the upstream answer relayed, the attempts
        # still running past the deadline (deadline_action = "race") and a local answer.
        admitted: Admitted | None = None
        recorder: CacheRecorder | None = None
        upstream: AttemptResponse | None = None
        degraded: StreamResponse | None = None
        response: StreamResponse | None = None
        # Early SSE heartbeats (the route's sse_heartbeat) while no first token came;
        # `early` is the response they started, in which the answer or an error goes on.
        heartbeat: Heartbeat | None = None
        early: StreamResponse | None = None
        try:
            # Small bodies, and JSON ones up to JSON_BODY_LIMIT, are read now so that
            # plugins, the cache and routing can look inside; others stream upstream.
            if not request.body_exists:
                ctx.body_read = True
            else:
                length = request.content_length
                if length is not None and (
                    length <= SMALL_BODY
                    or (length <= JSON_BODY_LIMIT and "json" in ctx.headers.get("content-type", ""))
                ):
                    ctx.body = await request.read()
                    ctx.body_read = True
            # received: plugins may rewrite the request through ctx, or answer it.
            if "edgeproxy_request_received" in active:
                method, target = ctx.method, ctx.target
                answer = await self.plugins.call_first(
                    "edgeproxy_request_received", request=request, ctx=ctx
                )
                if answer is not None:
                    answer = hook_answer("edgeproxy_request_received", answer)
                    response = self.responder.own(ctx, answer)
                    return response
                if ctx.target != target or ctx.method != method:
                    # A plugin rewrote the request: match its route again.
                    ctx.route = self.config.route_for(ctx.method, ctx.path)
            if request.websocket and self.sessions.takes(request, ctx):
                # A WebSocket session: refused as any request until its region accepts it,
                # then relayed until it ends (its own limits, routing and metering).
                response = await self.sessions.serve(request, ctx, self.plugins.guards_facts)
                return response
            # admission: body validation, rate limits, then a slot (may queue, or shed).
            shed: ProxyError | None = None
            route: RoutePlan | Failure | None = None  # the regions ranked, or why none
            owner: str | None = None  # the one region holding the request's state
            state: StatefulRequest | None = None  # the stored objects it refers to or makes
            chain: ChainRecord | None = None  # a stored response whose chain the edge holds
            held: HeldObject | None = None  # a response or conversation the edge holds
            try:
                admitted = await self.admission.admit(request, ctx)
                if admitted.rate is not None and ctx.route.rate_limit_headers:
                    ctx.outcome.limits = admitted.rate.state()
            except Overloaded as overloaded:
                if ctx.route.on_overload != "degrade":
                    raise
                shed = overloaded  # shed: to the fallback, never upstream
            # The request has entered: what it is is fixed from here on (RequestFacts).
            endpoint = openai_endpoint(ctx.path)
            ctx.fix(
                endpoint.name if endpoint is not None else None,
                guard=self.plugins.guards_facts,
            )
            if shed is None:
                if self.models.active and self.models.answers(ctx):
                    # GET /v1/models, once regions list models: the proxy's own merged list.
                    response = self.responder.own(ctx, await self.models.respond(ctx))
                    return response
                # cache: a stored answer, or that of an identical request in flight; else a
                # cacheable request leads, and `recorder` stores what the Responder relays.
                # The bypass (most sampled requests) is decided without the lookup's coroutine.
                if not self.cache.passes(ctx):
                    found, recorder = await self.cache.lookup(request, ctx, checked=True)
                    if self.cache.due:
                        self._start_refreshes()
                    if found is not None:
                        if found.chunks is None and found.release is None:
                            response = self.responder.ready(ctx, found)
                        else:
                            response = await self.responder.send(request, ctx, found)
                        return response
                # A request referring to a stored object goes to the region holding it (no
                # coroutine for the others: most requests have nothing to do with one).
                if self.owners.enabled:
                    state = stateful_request(ctx)
                    if state is not None and self.chains.active:
                        # A chain the edge holds: to its owner, or taken on here.
                        chained = await self._chained(ctx, state)
                        if chained.answer is not None:
                            response = self.responder.own(chained.ctx, chained.answer)
                            return response
                        ctx, state, owner, chain, held = chained[:5]
                    elif state is not None and state.refs:
                        owner = await self._owner(state)
                # route: the one ranked plan that failover, hedging and continuation draw on.
                if "edgeproxy_route" in active:
                    route = await self.obtainer.route(request, ctx, owner=owner)
                else:
                    route = self.obtainer.ranked(ctx, owner=owner)
                if ctx.route.sse_heartbeat is not None and not isinstance(route, Failure):
                    heartbeat = self.responder.heartbeats(request, ctx)
            # route + upstream + fallback: the first byte from the best region, failing over
            # (or hedging) until then; else the ladder (stale cache, local model), which races
            # the attempts still running past the deadline (deadline_action = "race").
            obtained = await self.obtainer.obtain(
                request,
                ctx,
                route=route,
                shed=shed,
                keep_late=ctx.route.deadline_action == "race",
            )
            if chain is not None and owner is not None and ctx.outcome.state is None:
                # The owner could not continue the chain (down, restarted, keeps none):
                # the edge takes it on, if it holds it.
                again = await self._taken_on(request, ctx, chain, obtained, shed)
                if again is not None:
                    ctx, obtained = again
                    owner = None
            elif held is not None and (
                (isinstance(obtained, AttemptResponse) and obtained.status == 404)
                or (isinstance(obtained, Failure) and obtained.kind is FailureKind.UPSTREAM)
            ):
                # The owner forgot a response the edge holds (a restart), or could not be
                # reached: the edge's copy answers.
                answer = await self.chains.answer(ctx, held)
                if answer is not None:
                    if isinstance(obtained, AttemptResponse):
                        await obtained.aclose()
                    response = self.responder.own(ctx, answer)
                    return response
            if isinstance(obtained, Failure):
                error = obtained.error
                if owner is not None and obtained.kind is FailureKind.UPSTREAM:
                    # The one region holding the state failed (cannot connect, reset, a
                    # gateway status): unavailable, as when it is known down.
                    error = owner_unavailable(self.config.stateful.retry_after)
                response = await self._error(request, ctx, error, heartbeat)
                return response
            if isinstance(obtained, Degraded):
                degraded = obtained.response
                if heartbeat is not None:
                    early = await heartbeat.stop()
                response = await self._send_degraded(request, ctx, degraded, early)
                return response
            # stream: relay chunk by chunk to the client; with the route's continue_on_break,
            # a stream that breaks after tokens were sent goes on at another region.
            upstream = obtained
            if upstream.other_model is not None and recorder is not None:
                # Another model answered (lighter, or larger for a long request): never
                # stored as the requested model's answer, and stored as the model's that
                # answered (when its request is cacheable).
                recorder.release()
                recorder = await self.cache.recorder_for(request, upstream.other_model)
            if state is not None and state.creates and 200 <= upstream.status < 300:
                await self._remember(upstream, state)
                if chain is not None and not upstream.attempt.sse:
                    # A JSON answer is held whole (read by _remember): its turn is held
                    # before the client has its id, for a follow-up through another PoP.
                    await self.chains.hold_answer(chain, upstream.attempt.first)
                    chain = None
                elif self.chains.active and self.chains.conversation_made(ctx):
                    try:
                        answer = await upstream.read_more(_CREATED_ANSWER_LIMIT)
                    except UpstreamError:
                        answer = b""  # the relay reports the broken answer
                    await self.chains.hold_created(ctx, answer)
            plan = route if isinstance(route, RoutePlan) else None
            if plan is not None and plan.affinity is not None:
                plan.routed(upstream.region)  # its KV cache now holds the prompt
            if heartbeat is not None:
                early = await heartbeat.stop()
            response = await self.responder.relay(
                request,
                ctx,
                upstream,
                recorder=recorder,
                started=early,
                legs=(
                    self.obtainer.continuer(plan)
                    if plan is not None and ctx.route.continue_on_break
                    else None
                ),
            )
            if 200 <= upstream.status < 300 and self.chains.active:
                if chain is not None:
                    await self.chains.hold(chain, ctx.outcome.stored)
                elif (added := self.chains.items_added(ctx)) is not None:
                    await self.chains.add_items(added, added.own_input)
            return response
        except ProxyError as err:
            response = await self._error(request, ctx, err, heartbeat)
            return response
        except PluginError as failed:
            logger.error("%s (request %s)", failed, ctx.request_id, exc_info=failed.error)
            response = await self._error(
                request,
                ctx,
                ProxyError(
                    500, "plugin_error", f"plugin {failed.plugin} failed", code="plugin_error"
                ),
                heartbeat,
            )
            return response
        finally:
            if heartbeat is not None:
                await heartbeat.stop()  # its task, on any way out
            if isinstance(degraded, LocalAnswer):
                degraded.abandon()  # its generation slot, unless it was sent
            if recorder is not None:
                # An answer that did not complete is not stored; its followers wake up.
                recorder.release()
            if upstream is not None:
                # Also on cancellation (client gone): resets the upstream stream now,
                # and frees the region's in-flight slot.
                await upstream.aclose()
            if admitted is not None:
                admitted.release(ctx)
            out = ctx.outcome
            out.finished_at = time.monotonic()
            if response is not None and not out.status:
                out.status = response.status
            if out.degraded == "lighter-model" and ctx.model is not None:
                self.fallback.count_lighter_usage(ctx.model, out.usage)
            usage = out.usage
            if usage is not None and out.region is not None and not out.degraded:
                # Each region's prompt-cache hit ratio (the status page shows it).
                answered = self.regions.by_name.get(out.region)
                if answered is not None:
                    prompt = usage.get("prompt_tokens")
                    cached = usage.get("cached_tokens")
                    if type(prompt) is int and prompt > 0:
                        answered.prompt_tokens_total += prompt
                        if type(cached) is int and cached > 0:
                            answered.cached_tokens_total += min(cached, prompt)
            if "edgeproxy_response_complete" in active:
                await self.plugins.call_all_logged(
                    "edgeproxy_response_complete", request=request, ctx=ctx
                )
            self.in_flight -= 1
            if not self.in_flight and self._idle_waiters:
                self._now_idle()

    async def _chained(self, ctx: RequestContext, state: StatefulRequest) -> _Chained:
        """A request on a route whose Responses chains the edge holds: the request (its
        chain's whole input when the edge takes it on), its state, its owner, the turn it
        will hold, a held response it retrieves or deletes, or the edge's own answer (while
        the owner cannot give it)."""
        chains = self.chains
        chain = chains.record_of(ctx)
        held = chains.object_of(ctx) if chain is None else None
        if held is None and (chain is None or not chain.continues):
            # Nothing held to look at (a chain's first turn is held as it is answered).
            owner = await self._owner(state) if state.refs else None
            return _Chained(ctx, state, owner, chain, None, None)
        failure: ProxyError | None = None
        try:
            owner = await self._owner(state)
        except ProxyError as err:
            owner, failure = None, err
        why = chains.takes_over(owner)
        if why is None and chain is not None:
            why = await chains.taken(chain)
        if why is not None:
            if chain is not None:
                expanded = await chains.expanded(ctx, chain, why)
                if expanded is not None:
                    ctx, rescued, owner = await self._rescued(ctx, expanded)
                    return _Chained(ctx, rescued, owner, chain, None, None)
            else:
                assert held is not None
                answer = await chains.answer(ctx, held)
                if answer is not None:
                    return _Chained(ctx, state, owner, None, held, answer)
        if failure is not None:
            raise failure
        if held is not None and ctx.method == "DELETE":
            await chains.forget(held)  # the owner deletes its own; the edge's goes too
        return _Chained(ctx, state, owner, chain, held, None)

    async def _rescued(
        self, ctx: RequestContext, expanded: dict[str, Any]
    ) -> tuple[RequestContext, StatefulRequest | None, str | None]:
        """The request with its chain's whole input (its own outcome kept), its state and
        the owner of what else it refers to."""
        rescued = ctx.with_json(expanded)
        rescued.outcome = ctx.outcome
        rescued.outcome.state = "edge"
        state = stateful_request(rescued)
        owner = await self._owner(state) if state is not None and state.refs else None
        return rescued, state, owner

    async def _taken_on(
        self,
        request: Exchange,
        ctx: RequestContext,
        chain: ChainRecord,
        obtained: AttemptResponse | Degraded | Failure,
        shed: ProxyError | None,
    ) -> tuple[RequestContext, AttemptResponse | Degraded | Failure] | None:
        """When the owner could not continue the chain (unreachable, or its answer says it
        holds no such response or keeps none), the chain taken on by the edge: the request
        expanded, and its answer from the regions the router ranks. None: the owner's
        answer stands."""
        if isinstance(obtained, Failure):
            if obtained.kind is not FailureKind.UPSTREAM:
                return None
            why = "owner_unavailable"
        elif isinstance(obtained, AttemptResponse) and obtained.status in (400, 404):
            try:
                answer = await obtained.read_error(_CREATED_ANSWER_LIMIT)
            except UpstreamError:
                return None
            if not RESPONSES.forgot(obtained.status, answer):
                return None
            why = "owner_forgot"
            if obtained.status == 400:
                # Not a response it lost: it keeps none (llama-server). Asked no more.
                self.chains.learn_stateless(obtained.region.name)
                why = "owner_cannot_store"
        else:
            return None
        expanded = await self.chains.expanded(ctx, chain, why)
        if expanded is None:
            return None
        if isinstance(obtained, AttemptResponse):
            await obtained.aclose()
        ctx, _, owner = await self._rescued(ctx, expanded)
        route = self.obtainer.ranked(ctx, owner=owner)
        again = await self.obtainer.obtain(
            request, ctx, route=route, shed=shed, keep_late=ctx.route.deadline_action == "race"
        )
        return ctx, again

    async def _owner(self, state: StatefulRequest) -> str | None:
        """The region holding the objects a request refers to; None when any may answer
        it (a single region). Raises the API's own 404 for an object no region is known
        to hold, held apart from the others (no region holds them all), or made by
        another scope (tenant, credentials); 503 when an owner could not be looked up
        (the object may exist: never a 404); 400 past ``[stateful] max_refs``."""
        refs = state.refs
        owners = self.owners
        config = self.config.stateful
        if len(refs) > config.max_refs:
            distinct = len({ref.id for ref in refs})
            if distinct > config.max_refs:
                raise too_many_refs(distinct, config.max_refs)
        found = await owners.lookup(ref.id for ref in refs)
        regions = self.regions.by_name
        single = len(regions) == 1
        owner: str | None = None
        failed = False
        for ref in refs:
            known = found[ref.id]
            if isinstance(known, Owner):
                if not owners.allows(known, state.scope):
                    # Another tenant's object: the provider's answer to a stranger.
                    owners.other_scope_total += 1
                    raise ref.not_found()
                if known.region in regions:
                    if owner is None:
                        owner = known.region
                    elif known.region != owner:
                        # The first object's region does not hold this one: it would say so.
                        raise ref.not_found()
                    continue
            if single:
                continue  # one region: it is the owner, whoever made the object
            if known is Missing.FAILED:
                failed = True
                continue
            # Unknown here and in Redis, or its region is gone from the config.
            owners.unknown_total += 1
            raise ref.not_found()
        if failed:
            raise lookup_failed(config.retry_after)
        return owner

    async def _remember(self, upstream: AttemptResponse, state: StatefulRequest) -> None:
        """The region that answered a request creating an object owns it; for a JSON
        answer, known in Redis before the client has the id."""
        attempt = upstream.attempt
        first = attempt.first or b""
        object_id = created_id(state.dialect, first, attempt.sse, attempt.opening)
        if object_id is None and not attempt.sse and not attempt.eof:
            # Only an LLM endpoint's JSON answer is held whole: read on until the id is in.
            try:
                first = await upstream.read_more(_CREATED_ANSWER_LIMIT)
            except UpstreamError as exc:
                logger.warning("region %s broke its answer: %s", upstream.region.name, exc)
                raise ProxyError(
                    502,
                    "upstream_error",
                    "the region broke its answer",
                    code="upstream_stream_broken",
                ) from None
            object_id = created_id(state.dialect, first, attempt.sse, attempt.opening)
        if object_id is None:
            return
        write = self.owners.remember(object_id, upstream.region.name, state.scope)
        if write is not None and not attempt.sse:
            # Done once written or after redis_timeout; shielded, so that a client leaving
            # does not cancel the wait (the write itself is queued and retried apart).
            await asyncio.shield(write)

    def _start_refreshes(self) -> None:
        """Run the background refreshes the cache asked for, each in a task it keeps."""
        for refresh in self.cache.take_refreshes():
            self.cache.spawn(self._refresh(refresh))

    async def _refresh(self, refresh: Refresh) -> None:
        """A background cache refresh (stale-while-revalidate, early refresh), with no client:
        obtained as :meth:`handle` does (no fallback: the stale entry stays), and its answer
        read into the cache by the Responder's own loop. The hooks get ``request=None``."""
        recorder = self.cache.refresh_recorder(refresh)
        if recorder is None:
            return
        error: str | None = None
        try:
            obtained = await self.obtainer.obtain(None, refresh.ctx, degrade=False)
            if isinstance(obtained, Failure):
                error = obtained.error.message
            else:
                assert isinstance(obtained, AttemptResponse)
                try:
                    await self.responder.drain(refresh.ctx, obtained, recorder)
                finally:
                    await obtained.aclose()
        except asyncio.CancelledError:
            error = "cancelled"
            raise
        except Exception as exc:  # noqa: BLE001 - a failed refresh keeps the stale entry
            error = str(exc) or type(exc).__name__
        finally:
            self.cache.refresh_done(refresh, recorder, error)

    async def _send_degraded(
        self,
        request: Exchange,
        ctx: RequestContext,
        answer: StreamResponse,
        early: StreamResponse | None = None,
    ) -> StreamResponse:
        """A fallback answer with the proxy's headers, through the Responder: the local
        model's generated as it is sent, another (stale, a plugin's) sent as it is.

        After heartbeats (``early``), a streamed local answer goes on in their response;
        another answer cannot follow a 200 already sent, and an error event says so."""
        responder = self.responder
        if isinstance(answer, LocalAnswer):
            responder.own(ctx, answer)
            return await responder.send(
                request,
                ctx,
                answer.answer(request),
                started=early,
            )
        if early is not None:
            err = ProxyError(503, "service_unavailable", "no region answered", code="no_region")
            return await responder.error_after(request, ctx, err, early)
        return responder.own(ctx, answer)

    async def _error(
        self,
        request: Exchange,
        ctx: RequestContext,
        err: ProxyError,
        heartbeat: Heartbeat | None,
    ) -> StreamResponse:
        """The error answer; after heartbeats (their 200 already sent), an SSE error event."""
        early = await heartbeat.stop() if heartbeat is not None else None
        if early is None:
            return self.responder.error(ctx, err)
        return await self.responder.error_after(request, ctx, err, early)

    def _now_idle(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; false if ``timeout`` passed first."""
        if not self.in_flight:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            return False
        return True
