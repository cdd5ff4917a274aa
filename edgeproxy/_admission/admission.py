"""Admission: who may start now, who waits, and who is turned away.

:meth:`AdmissionStage.admit` runs right after the ``request_received`` hook,
before any cache, routing or upstream work:

1. the JSON body of LLM routes is validated (400): a JSON object, then, on a route
   with ``check_bodies``, what every server of its API would refuse (its dialect's
   ``check``), so that such a request never reaches, nor counts against, a region; its
   prompt tokens are estimated;
2. the rate limits of the request's API key or tenant and client IP are
   charged (429 with ``Retry-After`` and ``RateLimit-*``);
3. the request takes a slot under the global and per-route in-flight caps.
   With no slot free it waits in a priority queue: higher ``ctx.priority``
   first, then arrival order, for at most the route's queue time and never
   past its deadline. When the queue is full, a newcomer of higher priority
   pushes out the lowest-priority waiter; otherwise the newcomer is shed.
   Shed and timed-out requests get a 503 with ``Retry-After``
   (:class:`Overloaded`), which the pipeline sends down the fallback ladder
   instead when the route says ``on_overload = "degrade"``.

The returned :class:`Admitted` is released when the request ends, which frees
its slot for the best waiter and settles its token charge with the usage
the upstream reported.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from edgeproxy._admission.poison import Poison
from edgeproxy._admission.ratelimit import Charge, RateLimiter, RateTicket, api_key
from edgeproxy._core.config import Config, RouteConfig
from edgeproxy._core.errors import ProxyError
from edgeproxy._core.exchange import Exchange
from edgeproxy._protocol.bodies import (
    body_error,
    estimate_prompt_tokens,
    is_llm_request,
    read_json_body,
    requires_json,
)

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext

__all__ = ["Admitted", "AdmissionStage", "Overloaded"]

_MIN_PRIORITY, _MAX_PRIORITY = -9999, 9999
# Bodies found valid, remembered by their exact bytes (and all else the checks read): up
# to this size each, this many, this many bytes in all (the oldest forgotten first).
_VALID_BODY = 256 * 1024
_VALID_COUNT = 4096
_VALID_BYTES = 16 * 1024 * 1024
_WAITING, _GRANTED, _GONE = range(3)


class Overloaded(ProxyError):
    """No slot for this request now: 503 with Retry-After, or the fallback ladder."""

    def __init__(self, reason: str, message: str, retry_after: int) -> None:
        super().__init__(
            503,
            "overloaded",
            message,
            code=reason,
            headers={"Retry-After": str(retry_after)},
        )
        self.reason = reason


@dataclass(slots=True, eq=False)
class _Waiter:
    priority: int
    seq: int
    route: RouteConfig
    future: asyncio.Future[None]
    state: int = _WAITING

    def __lt__(self, other: _Waiter) -> bool:
        # Served first: higher priority, then earlier arrival.
        return (other.priority, self.seq) < (self.priority, other.seq)


class _Victim:
    """A waiter's place in the shedding order: lowest priority, then newest, first."""

    __slots__ = ("waiter",)

    def __init__(self, waiter: _Waiter) -> None:
        self.waiter = waiter

    def __lt__(self, other: _Victim) -> bool:
        a, b = self.waiter, other.waiter
        return (a.priority, b.seq) < (b.priority, a.seq)


class Admitted:
    """A request's hold on a slot (and its rate charges); :meth:`release` it exactly once."""

    __slots__ = ("_stage", "route", "rate", "started", "counted", "_released")

    def __init__(
        self, stage: AdmissionStage, route: RouteConfig, rate: RateTicket | None, counted: bool
    ) -> None:
        self._stage = stage
        self.route = route
        self.rate = rate
        # When the slot was taken, for the service time (only a counted slot has one).
        self.started = time.monotonic() if counted else 0.0
        self.counted = counted
        self._released = False

    def release(self, ctx: RequestContext) -> None:
        """Free the slot and settle the token charge with ``ctx.outcome.usage``."""
        if self._released:
            return
        self._released = True
        stage = self._stage
        if self.counted:
            stage._release(self.route, time.monotonic() - self.started)
        if self.rate is not None and stage.rate.counts_tokens:
            stage.rate.settle(self.rate, ctx.outcome.usage)


class AdmissionStage:
    """Input validation, rate limits, in-flight caps and the priority queue of one proxy."""

    def __init__(self, config: Config, *, poison: Poison | None = None) -> None:
        self.config = config.admission
        # Callers whose requests every region rejected too often (429); see poison.py.
        self.poison = poison
        self.max_body_size = config.limits.max_body_size
        self.rate = RateLimiter(config.admission)
        self.max_in_flight = config.admission.max_in_flight or None
        self._has_route_caps = any(r.max_in_flight for r in config.routes)
        self.in_flight = 0
        self._route_in_flight: dict[str, int] = {}
        self._queues: dict[str, list[_Waiter]] = {}
        self._victims: list[_Victim] = []
        self.waiting = 0
        self._seq = itertools.count()
        # Mean time a request holds its slot, for Retry-After estimates.
        self._service_time = 1.0
        self.admitted_total = 0
        self.queued_total = 0
        self.shed: dict[str, int] = {"queue_full": 0, "queue_timeout": 0, "evicted": 0}
        self.invalid_total = 0
        # The bodies validation passed (their checks, exactly as it made them): the same
        # bytes again are only parsed. A refused body is never in it.
        self._valid: dict[tuple[object, ...], int] = {}
        self._valid_bytes = 0

    async def open(self) -> None:
        await self.rate.open()

    async def close(self) -> None:
        await self.rate.close()

    # -- the stage ---------------------------------------------------------------

    async def admit(self, request: Exchange, ctx: RequestContext) -> Admitted:
        """Validate, rate-limit and find a slot for ``ctx``, waiting in the queue if needed.

        Raises ``ProxyError`` (400/413 bad body, 429 rate limit) or
        :class:`Overloaded` (503: queue full or queue time over).
        """
        route = ctx.route
        body: dict[str, Any] | None = None
        if requires_json(ctx.method, ctx.path, route):
            raw = ctx.body
            seen: tuple[object, ...] | None = None
            if ctx.body_read and raw is not None and len(raw) <= _VALID_BODY:
                headers = ctx.headers
                seen = (
                    raw,
                    ctx.path,
                    ctx.method,
                    route.check_bodies,
                    headers.get("content-type"),
                    headers.get("content-encoding"),
                )
                if seen in self._valid:
                    # Valid bytes are valid again: parsed, not checked (a fresh value:
                    # what reads the request may change its JSON).
                    body = ctx._json = orjson.loads(raw)
                    seen = None
            if body is None:
                try:
                    body = await read_json_body(request, ctx, self.max_body_size)
                    if route.check_bodies and ctx.method == "POST":
                        refused = body_error(ctx.path, body)
                        if refused is not None:
                            raise refused
                except ProxyError:
                    self.invalid_total += 1
                    raise
                if seen is not None:
                    self._remember_valid(seen, len(raw or b""))
        self._caller(ctx)
        ticket: RateTicket | None = None
        if self.rate.enabled:
            ticket = await self._rate_limit(request, ctx, body)
        if self.max_in_flight is None and route.max_in_flight is None:
            self.admitted_total += 1
            counted = False  # no cap applies: nothing to hold
        else:
            try:
                counted = await self._acquire(request, ctx)
            except BaseException:
                if ticket is not None:
                    # Shed, not served: the client keeps its quota.
                    self.rate.refund(ticket)
                raise
        header = self.config.deadline_header
        if header:
            left = int((ctx.started + route.deadline - time.monotonic()) * 1000)
            ctx.headers[header] = str(left if left > 1 else 1)
        return Admitted(self, route, ticket, counted)

    def _remember_valid(self, seen: tuple[object, ...], size: int) -> None:
        valid = self._valid
        valid[seen] = size
        self._valid_bytes += size
        while len(valid) > _VALID_COUNT or self._valid_bytes > _VALID_BYTES:
            oldest = next(iter(valid))
            self._valid_bytes -= valid.pop(oldest)

    async def admit_session(self, ctx: RequestContext) -> list[Charge]:
        """A WebSocket handshake: the checks of :meth:`admit` that a session takes (its
        priority, a caller limited for poison, the request-rate limits, charged once per
        session), without a slot: ``[websocket]`` caps sessions. Returns the session's
        token-unit charges, which each Realtime ``response.create`` is checked against
        (empty: no token limit applies). Raises ``ProxyError`` (429) as :meth:`admit`."""
        self._caller(ctx)
        rate = self.rate
        self.admitted_total += 1
        if not rate.enabled:
            return []
        key, ip_id = rate.identities(
            ctx.tenant, api_key(ctx.headers, self.config.key_header), ctx.client_ip or "unknown"
        )
        charges = rate.charges(key, ip_id, 1)
        requests = [c for c in charges if c.limit.unit == "requests"]
        if requests:
            await rate.take(requests, 0)
        return [c for c in charges if c.limit.unit == "tokens"]

    async def _rate_limit(
        self, request: Exchange, ctx: RequestContext, body: dict[str, Any] | None
    ) -> RateTicket | None:
        rate = self.rate
        estimate = 0
        if rate.counts_tokens and is_llm_request(ctx.method, ctx.path):
            if body is None:
                value = ctx.json
                body = value if isinstance(value, dict) else None
            if body is not None:
                estimate = estimate_prompt_tokens(body)
        key_value = api_key(ctx.headers, self.config.key_header)
        ip = ctx.client_ip or "unknown"
        key, ip_id = rate.identities(ctx.tenant, key_value, ip)
        charges = rate.charges(key, ip_id, estimate)
        if not charges:
            return None
        return await rate.take(charges, estimate)

    def _caller(self, ctx: RequestContext) -> None:
        """The caller's priority (for the queue, and for logs even when nothing queues), and
        a caller limited for poison refused (``ProxyError``)."""
        header = self.config.priority_header
        if header and not ctx.priority:
            raw = ctx.headers.get(header)
            if raw is not None:
                self._priority(ctx, raw)
        poison = self.poison
        if poison is not None and poison.limiting:
            refused = poison.limited(ctx)
            if refused is not None:
                raise refused

    def _priority(self, ctx: RequestContext, raw: str) -> None:
        """``ctx.priority`` from the priority header's value ``raw``."""
        try:
            value = int(raw.strip())
        except ValueError:
            return  # a hint, never a reason to fail the request
        ctx.priority = max(_MIN_PRIORITY, min(_MAX_PRIORITY, value))

    def _has_room(self, route: RouteConfig) -> bool:
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            return False
        cap = route.max_in_flight
        return cap is None or self._route_in_flight.get(route.name, 0) < cap

    def _take(self, route: RouteConfig) -> None:
        self.in_flight += 1
        self.admitted_total += 1
        if route.max_in_flight is not None:
            self._route_in_flight[route.name] = self._route_in_flight.get(route.name, 0) + 1

    async def _acquire(self, request: Exchange, ctx: RequestContext) -> bool:
        route = ctx.route
        if self.max_in_flight is None and route.max_in_flight is None:
            self.admitted_total += 1
            return False  # no cap applies: nothing to hold
        queue = self._queues.get(route.name)
        while queue and queue[0].state != _WAITING:
            heapq.heappop(queue)
        if not queue and self._has_room(route):
            self._take(route)
            return True
        priority = ctx.priority
        wait = self.config.max_queue_time if route.max_queue_time is None else route.max_queue_time
        wait = min(wait, ctx.started + route.deadline - time.monotonic())
        if wait <= 0:
            raise self._overloaded("queue_timeout", route)
        if self.config.max_queue == 0:
            raise self._overloaded("queue_full", route)
        if self.waiting >= self.config.max_queue:
            victim = self._lowest()
            if victim is None or victim.priority >= priority:
                raise self._overloaded("queue_full", route)
            self._evict(victim)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(priority, next(self._seq), route, loop.create_future())
        heapq.heappush(self._queues.setdefault(route.name, []), waiter)
        heapq.heappush(self._victims, _Victim(waiter))
        self.waiting += 1
        self.queued_total += 1
        if self._has_room(route):
            self._dispatch()  # this waiter may be the best one already
        timer = loop.call_later(wait, self._expire, waiter)
        try:
            # A client that half-closed (before or while it waits) is taken as gone: its
            # front end cancels the request rather than hold a place for it.
            request.queued(True)
            await waiter.future
        except asyncio.CancelledError:
            # The client went away while waiting, or just after being granted.
            if waiter.state == _GRANTED:
                self._release(route, 0.0)
            else:
                self._forget(waiter)
            raise
        finally:
            timer.cancel()
            request.queued(False)
        return True

    # -- the queue ---------------------------------------------------------------

    def _release(self, route: RouteConfig, held: float) -> None:
        self.in_flight -= 1
        if route.max_in_flight is not None:
            self._route_in_flight[route.name] -= 1
        if held > 0:
            self._service_time += (held - self._service_time) * 0.1
        if self.waiting:
            self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to the best waiters whose route has room too."""
        while self.waiting and (self.max_in_flight is None or self.in_flight < self.max_in_flight):
            best: _Waiter | None = None
            for queue in self._queues.values():
                while queue and queue[0].state != _WAITING:
                    heapq.heappop(queue)
                if queue and self._has_room(queue[0].route) and (best is None or queue[0] < best):
                    best = queue[0]
            if best is None:
                return
            heapq.heappop(self._queues[best.route.name])
            best.state = _GRANTED
            self.waiting -= 1
            self._take(best.route)
            best.future.set_result(None)

    def _lowest(self) -> _Waiter | None:
        victims = self._victims
        while victims and victims[0].waiter.state != _WAITING:
            heapq.heappop(victims)
        return victims[0].waiter if victims else None

    def _evict(self, waiter: _Waiter) -> None:
        self._forget(waiter)
        self.shed["evicted"] += 1
        waiter.future.set_exception(
            self._overloaded("evicted", waiter.route, count=False, evicted=True)
        )

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.state != _WAITING:
            return
        self._forget(waiter)
        self.shed["queue_timeout"] += 1
        waiter.future.set_exception(self._overloaded("queue_timeout", waiter.route, count=False))

    def _forget(self, waiter: _Waiter) -> None:
        if waiter.state != _WAITING:
            return
        waiter.state = _GONE
        self.waiting -= 1
        # Gone waiters are dropped lazily; rebuild when they pile up.
        if len(self._victims) > 2 * self.waiting + 64:
            self._victims = [v for v in self._victims if v.waiter.state == _WAITING]
            heapq.heapify(self._victims)
            for name, queue in self._queues.items():
                self._queues[name] = [w for w in queue if w.state == _WAITING]
                heapq.heapify(self._queues[name])

    def _overloaded(
        self, reason: str, route: RouteConfig, *, count: bool = True, evicted: bool = False
    ) -> Overloaded:
        if count:
            self.shed[reason] += 1
        cap = self.max_in_flight or route.max_in_flight or 1
        retry_after = max(1, min(60, math.ceil((self.waiting + 1) * self._service_time / cap)))
        if reason == "queue_timeout":
            message = "The proxy is overloaded: no capacity freed up in time. Retry shortly."
        elif evicted:
            message = "The proxy is overloaded and served higher-priority requests first."
        else:
            message = "The proxy is overloaded: its queue is full. Retry shortly."
        return Overloaded(reason, message, retry_after)

    def snapshot(self) -> dict[str, Any]:
        """The ``admission`` section of ``/status``."""
        routes: dict[str, dict[str, int]] = {}
        for name, count in self._route_in_flight.items():
            routes.setdefault(name, {})["in_flight"] = count
        for name, queue in self._queues.items():
            routes.setdefault(name, {})["queued"] = sum(1 for w in queue if w.state == _WAITING)
        return {
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight or 0,
            "queued": self.waiting,
            "max_queue": self.config.max_queue,
            "routes": routes,
            "admitted_total": self.admitted_total,
            "queued_total": self.queued_total,
            "shed": dict(self.shed),
            "invalid_total": self.invalid_total,
            "service_time_s": round(self._service_time, 4),
            "rate_limit": self.rate.snapshot(),
        }
