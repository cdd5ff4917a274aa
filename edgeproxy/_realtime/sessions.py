"""WebSocket sessions, from the client's handshake to the session's end.

A handshake is a request like any other until it is accepted: the entry hooks may refuse
it, admission charges it, the router ranks the regions by model, geo, load and health,
and any refusal is the usual JSON error, sent before the upgrade. Then the regions are
tried in rank until one completes its handshake (a region refusing with a 5xx or 429,
unreachable or too slow is failed over; a 4xx is the client's and goes back to it). Only
then is the client's handshake accepted, with the region's subprotocol, and the session
stays on that region until it ends (:mod:`edgeproxy._realtime.relay`).

A Realtime session that names no model in its query is accepted first: its first
``session.update`` (waited for a moment) names the model it is routed by, and a failure
to connect is then an ``error`` event and a close (1013), not a JSON answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Final

from edgeproxy._admission.admission import AdmissionStage
from edgeproxy._cache.keys import cache_scope
from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext, UpstreamReply
from edgeproxy._core.errors import ProxyError
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.outcome import SessionTotals
from edgeproxy._core.response import StreamResponse
from edgeproxy._core.websocket import TRY_AGAIN_LATER, Accept, Closed, WebSocket
from edgeproxy._obtain.failover import Failure
from edgeproxy._obtain.forward import UpstreamStage
from edgeproxy._obtain.obtainer import Obtainer
from edgeproxy._plugins import Plugins
from edgeproxy._protocol.endpoints import openai_endpoint
from edgeproxy._protocol.realtime import (
    client_event,
    error_event,
    offered_protocols,
    query_call,
    query_model,
    session_model,
)
from edgeproxy._realtime.meter import Meter
from edgeproxy._realtime.relay import Drain, Relay
from edgeproxy._routing.owners import Owner, Owners
from edgeproxy._routing.routeplan import RoutePlan
from edgeproxy._upstream.pool import split_origin
from edgeproxy._upstream.regions import Region, RegionSet, websocket_tls
from edgeproxy._upstream.websocket import WEBSOCKET_REQUEST_HEADERS, Refused, RegionSockets

__all__ = ["Sessions"]

logger = logging.getLogger("edgeproxy")

# Upper bounds of the histograms in /status (seconds): a session's length, and the time
# from a response.create to its first delta.
_DURATION_BUCKETS: Final = (1.0, 10.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, float("inf"))
_FIRST_DELTA_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))
# How long a Realtime session without a model in its query waits for its first event.
_MODEL_WAIT: Final = 2.0


class _Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return

    def snapshot(self) -> list[tuple[str, int]]:
        # Cumulative, as Prometheus takes its buckets.
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else f"{bound:g}", running))
        return out


class Sessions:
    """The WebSocket sessions of one pipeline (see the module's docstring)."""

    def __init__(
        self,
        config: Config,
        regions: RegionSet,
        plugins: Plugins,
        admission: AdmissionStage,
        obtainer: Obtainer,
        upstream: UpstreamStage,
        owners: Owners,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.settings = config.websocket
        self.regions = regions
        self.plugins = plugins
        self.admission = admission
        self.obtainer = obtainer
        self.upstream = upstream
        self.owners = owners
        self.clock = clock
        self.sockets = RegionSockets(
            connect_timeout=self.settings.connect_timeout,
            max_message=self.settings.max_message_size,
            compress=self.settings.compression == "both",
            ping_interval=self.settings.ping_interval,
            tls=lambda: websocket_tls(config),
        )
        self._open: set[Relay] = set()
        self._by_ip: dict[str, int] = {}
        self._by_tenant: dict[str, int] = {}
        self._drain: Drain | None = None
        self.opened_total = 0
        self.refused: dict[str, int] = {}
        self.failovers_total = 0
        self.messages_in_total = 0
        self.messages_out_total = 0
        self.bytes_in_total = 0
        self.bytes_out_total = 0
        self.responses_total = 0
        self.tokens: dict[str, int] = {}
        self.durations = _Histogram(_DURATION_BUCKETS)
        self.first_delta = _Histogram(_FIRST_DELTA_BUCKETS)

    # -- what takes a session ---------------------------------------------------

    def takes(self, request: Exchange, ctx: RequestContext) -> bool:
        """Whether ``request`` is a handshake its route relays as a session (others go on
        as plain requests)."""
        if not request.websocket:
            return False
        mode = ctx.route.websocket
        if mode == "off":
            return False
        if mode == "any":
            return True
        endpoint = openai_endpoint(ctx.path)
        return endpoint is not None and endpoint.websocket

    @property
    def open_count(self) -> int:
        return len(self._open)

    def drain(self, drain: Drain) -> None:
        """Close every open session once its response under way is done; refuse new ones."""
        self._drain = drain
        for relay in list(self._open):
            relay.drain(drain)

    async def close(self) -> None:
        await self.sockets.close()

    # -- the handshake ------------------------------------------------------------

    async def serve(self, request: Exchange, ctx: RequestContext, guard: bool) -> StreamResponse:
        """Serve the handshake ``request``: the session's whole life, or its refusal
        (raised as ``ProxyError``, answered as JSON before the upgrade)."""
        settings = self.settings
        if self._drain is not None:
            raise self._refuse(
                "draining",
                ProxyError(
                    503,
                    "service_unavailable",
                    "the proxy is shutting down",
                    code="shutting_down",
                    headers={"Retry-After": "1"},
                ),
            )
        if len(self._open) >= settings.max_sessions:
            raise self._refuse(
                "max_sessions",
                ProxyError(
                    503,
                    "service_unavailable",
                    "too many WebSocket sessions are open",
                    code="too_many_sessions",
                    headers={"Retry-After": "1"},
                ),
            )
        ip = ctx.client_ip or "unknown"
        tenant = ctx.tenant
        if settings.max_sessions_per_ip and self._by_ip.get(ip, 0) >= settings.max_sessions_per_ip:
            raise self._refuse("per_ip", _too_many("this client address"))
        if (
            tenant is not None
            and settings.max_sessions_per_tenant
            and self._by_tenant.get(tenant, 0) >= settings.max_sessions_per_tenant
        ):
            raise self._refuse("per_tenant", _too_many("this tenant"))
        try:
            charges = await self.admission.admit_session(ctx)
        except ProxyError:
            self.refused["admission"] = self.refused.get("admission", 0) + 1
            raise
        endpoint = openai_endpoint(ctx.path)
        realtime = endpoint is not None and endpoint.websocket
        model = query_model(ctx.target) if realtime else None
        outcome = ctx.outcome
        outcome.session = SessionTotals()
        meter = (
            Meter(rate=self.admission.rate, charges=charges, first_delta=self.first_delta.observe)
            if realtime
            else None
        )
        # Counted from here: a session waiting for its region holds its place in the caps.
        self._by_ip[ip] = self._by_ip.get(ip, 0) + 1
        if tenant is not None:
            self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1
        started = self.clock()
        try:
            if realtime and model is None:
                return await self._model_first(request, ctx, meter, guard)
            ctx.fix("realtime" if realtime else None, guard=guard, model=model)
            plan = await self._plan(request, ctx, await self._owner(ctx) if realtime else None)
            region, socket = await self._connect(request, ctx, plan)
            if meter is not None:
                self._owns(meter, ctx, region)
            client = await request.accept(self._accept(ctx, region, socket))
            return await self._run(request, ctx, client, socket, meter)
        finally:
            self._by_ip[ip] -= 1
            if not self._by_ip[ip]:
                del self._by_ip[ip]
            if tenant is not None:
                self._by_tenant[tenant] -= 1
                if not self._by_tenant[tenant]:
                    del self._by_tenant[tenant]
            if outcome.status == 101:
                self.durations.observe(self.clock() - started)
            if meter is not None:
                outcome.usage = meter.usage

    def _refuse(self, reason: str, error: ProxyError) -> ProxyError:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return error

    async def _owner(self, ctx: RequestContext) -> str | None:
        """The region holding the call or session a handshake joins (``call_id=``); None
        when any may take it. An id of another scope is the API's 404; one known nowhere
        is routed as any session (it may have been made where the proxy cannot see)."""
        call = query_call(ctx.target)
        owners = self.owners
        if call is None or not owners.enabled:
            return None
        known = await owners.owner(call)
        if not isinstance(known, Owner):
            return None
        if not owners.allows(known, cache_scope(ctx)):
            owners.other_scope_total += 1
            raise ProxyError(
                404,
                "invalid_request_error",
                f"Call with id '{call}' not found.",
                code="call_not_found",
                param="call_id",
            )
        return known.region if known.region in self.regions.by_name else None

    def _owns(self, meter: Meter, ctx: RequestContext, region: Region) -> None:
        """The session the region makes is its own: a handshake joining it goes there."""
        owners = self.owners
        if owners.enabled:
            scope = cache_scope(ctx)
            name = region.name
            # Not waited for: the id reaches the client before any other PoP is asked.
            meter.created = lambda made: owners.remember(made, name, scope)

    async def _plan(
        self, request: Exchange, ctx: RequestContext, owner: str | None = None
    ) -> RoutePlan:
        # The hooks' way when they route (one coroutine a session is no cost here).
        plan = await self.obtainer.route(request, ctx, owner=owner)
        if isinstance(plan, Failure):
            self.refused["route"] = self.refused.get("route", 0) + 1
            raise plan.error
        return plan

    async def _connect(
        self, request: Exchange, ctx: RequestContext, plan: RoutePlan
    ) -> tuple[Region, WebSocket]:
        """The first region in ``plan`` to complete the handshake; raises the JSON error
        for the client when none does."""
        outcome = ctx.outcome
        protocols = offered_protocols(
            ctx.headers.getall("sec-websocket-protocol", ()),
            credentials=self.config.server.forward_client_credentials,
        )
        last: Refused | None = None
        timed_out = True
        for region in plan:
            endpoint = region.pick_endpoint()
            origin, base = split_origin(endpoint.url)
            headers = [
                (k, v)
                for k, v in self.upstream.headers(request, ctx, region)
                if k not in WEBSOCKET_REQUEST_HEADERS
            ]
            if "edgeproxy_upstream_request" in self.plugins.active:
                await self.plugins.call_all(
                    "edgeproxy_upstream_request",
                    request=request,
                    ctx=ctx,
                    region=region,
                    headers=headers,
                )
            outcome.attempts += 1
            outcome.region = region.name
            region.in_flight += 1
            sent = self.clock()
            try:
                result = await self.sockets.connect(
                    origin + base + _aliased(ctx.target, region), headers, protocols
                )
            finally:
                region.in_flight -= 1
            region.requests_total += 1
            if "edgeproxy_upstream_response" in self.plugins.active:
                # The region's answer to the handshake, as a request's head is told: 101,
                # or the status it refused with (502 when it gave none).
                said = 101 if not isinstance(result, Refused) else (result.status or 502)
                await self.plugins.call_all(
                    "edgeproxy_upstream_response",
                    request=request,
                    ctx=ctx,
                    region=region,
                    reply=UpstreamReply(said, []),
                )
            if not isinstance(result, Refused):
                endpoint.mark_up()
                self.regions.health.record(region, failed=False)
                outcome.upstream_ttfb = self.clock() - sent
                return region, result
            last = result
            status = result.status
            if status is not None:
                timed_out = False
            if status is not None and status < 500 and status != 429:
                # The client's own fault (401, 403, 404...): another region would say the same.
                raise ProxyError(
                    status,
                    "invalid_request_error" if status != 401 else "authentication_error",
                    f"the region refused the session: {result.reason}",
                    code="websocket_refused",
                )
            region.errors_total += 1
            self.regions.health.record(region, failed=True)
            logger.warning("region %s refused a WebSocket session: %s", region.name, result.reason)
            self.failovers_total += 1
        self.refused["regions"] = self.refused.get("regions", 0) + 1
        reason = last.reason if last is not None else "no region"
        if timed_out:
            raise ProxyError(
                504,
                "upstream_error",
                f"no region took the session: {reason}",
                code="upstream_timeout",
            )
        retry: dict[str, str] = {}
        if last is not None and last.retry_after is not None:
            retry["Retry-After"] = str(max(1, int(last.retry_after)))
        raise ProxyError(
            502,
            "upstream_error",
            f"no region took the session: {reason}",
            code="upstream_unavailable",
            headers=retry,
        )

    def _accept(self, ctx: RequestContext, region: Region, socket: WebSocket) -> Accept:
        settings = self.settings
        return Accept(
            subprotocol=socket.subprotocol,
            headers=(("x-edgeproxy-region", region.name), ("x-request-id", ctx.request_id)),
            max_message=settings.max_message_size,
            compress=settings.compression != "off",
            buffer=settings.buffer,
        )

    async def _run(
        self,
        request: Exchange,
        ctx: RequestContext,
        client: WebSocket,
        region: WebSocket,
        meter: Meter | None,
        first: str | bytes | None = None,
    ) -> StreamResponse:
        outcome = ctx.outcome
        outcome.status = 101
        self.opened_total += 1
        relay = Relay(client, region, outcome, self.settings, meter, self.clock)
        self._open.add(relay)
        if self._drain is not None:
            relay.drain(self._drain)
        try:
            if first is not None:
                await region.send(first)
                relay.totals.messages_in += 1
                relay.totals.bytes_in += len(first)
            await relay.run()
        finally:
            self._open.discard(relay)
            self._count(relay, meter)
        return StreamResponse.sent_by(request, 101)

    def _count(self, relay: Relay, meter: Meter | None) -> None:
        totals = relay.totals
        self.messages_in_total += totals.messages_in
        self.messages_out_total += totals.messages_out
        self.bytes_in_total += totals.bytes_in
        self.bytes_out_total += relay.outcome.bytes_out
        if meter is not None:
            totals.responses = meter.responses
            self.responses_total += meter.responses
            for key, value in (meter.usage or {}).items():
                if isinstance(value, int):
                    self.tokens[key] = self.tokens.get(key, 0) + value

    async def _model_first(
        self, request: Exchange, ctx: RequestContext, meter: Meter | None, guard: bool
    ) -> StreamResponse:
        """A Realtime session with no model in its query: accepted first, routed by the
        model its first ``session.update`` names."""
        settings = self.settings
        client = await request.accept(
            Accept(
                headers=(("x-request-id", ctx.request_id),),
                max_message=settings.max_message_size,
                compress=settings.compression != "off",
                buffer=settings.buffer,
            )
        )
        first: str | bytes | Closed | None = None
        model: str | None = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_MODEL_WAIT):
                first = await client.receive()
        if isinstance(first, Closed):
            return StreamResponse.sent_by(request, 101)
        if isinstance(first, str):
            event = client_event(first)
            if event.type == "session.update" and event.body is not None:
                model = session_model(event.body)
        ctx.fix("realtime", guard=guard, model=model)
        try:
            plan = await self._plan(request, ctx, await self._owner(ctx))
            region, socket = await self._connect(request, ctx, plan)
        except ProxyError as err:
            ctx.outcome.status = err.status
            ctx.outcome.error = err.code or err.type
            await _close_with(client, err)
            return StreamResponse.sent_by(request, 101)
        assert not isinstance(first, Closed)
        if meter is not None:
            self._owns(meter, ctx, region)
        return await self._run(request, ctx, client, socket, meter, first)

    # -- /status --------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        live_in = sum(r.totals.messages_in for r in self._open)
        live_out = sum(r.totals.messages_out for r in self._open)
        return {
            "open": len(self._open),
            "opened_total": self.opened_total,
            "refused": dict(self.refused),
            "failovers_total": self.failovers_total,
            "messages_in_total": self.messages_in_total + live_in,
            "messages_out_total": self.messages_out_total + live_out,
            "bytes_in_total": self.bytes_in_total + sum(r.totals.bytes_in for r in self._open),
            "bytes_out_total": self.bytes_out_total + sum(r.outcome.bytes_out for r in self._open),
            "responses_total": self.responses_total,
            "tokens": dict(self.tokens),
            "duration_histogram": self.durations.snapshot(),
            "duration_seconds_sum": round(self.durations.total, 6),
            "first_delta_histogram": self.first_delta.snapshot(),
            "first_delta_seconds_sum": round(self.first_delta.total, 6),
        }


def _too_many(whose: str) -> ProxyError:
    return ProxyError(
        429,
        "rate_limit_error",
        f"too many WebSocket sessions are open for {whose}",
        code="too_many_sessions",
        headers={"Retry-After": "1"},
    )


def _aliased(target: str, region: Region) -> str:
    """``target`` with the region's own name for the model of its ``model=`` query."""
    aliases = region.config.model_aliases
    if not aliases or "model=" not in target:
        return target
    path, _, query = target.partition("?")
    parts = []
    for part in query.split("&"):
        key, eq, value = part.partition("=")
        if key == "model" and eq and value in aliases:
            part = f"model={aliases[value]}"
        parts.append(part)
    return path + "?" + "&".join(parts)


async def _close_with(client: WebSocket, err: ProxyError) -> None:
    """Tell an accepted client why its session cannot start, then close it."""
    with contextlib.suppress(ConnectionError):
        await client.send(error_event(err.message, code=err.code or "session_failed"))
    await client.close(TRY_AGAIN_LATER, (err.code or "unavailable")[:120])
