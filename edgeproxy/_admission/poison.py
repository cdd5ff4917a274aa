"""Requests that regions reject: poison bodies, and the callers who send them.

A region's 5xx answer to a request is the region's fault, or the request's: a malformed
body makes several servers answer 500. :meth:`Health.blame
<edgeproxy._upstream.health.Health.blame>` decides for the region's health by counting
the callers; this module decides for the request:

* a request body that got 5xx answers from two regions within ``[health] poison_ttl``,
  each of them the caller's own (the region served others meanwhile, see
  :meth:`Health.blame <edgeproxy._upstream.health.Health.blame>`), is **poison** for
  that caller: the request that finds it out is not tried further, and the same body
  from the same caller later gets 502 ``upstream_rejected_request`` at once, with no
  attempt at all. Another caller's identical body is tried afresh: the mark belongs to
  the caller that earned it;
* each poison request is a **strike** against its caller (the tenant, else its hashed
  API key, else its client IP: :func:`caller_of`) on the route and model it sent; a
  caller with ``poison_strikes`` strikes within ``poison_ttl`` gets 429 from admission
  on that route and model until the oldest fades, like any other abuse, and is served
  on every other. Counted in ``/status`` ``limits``.

A capacity answer (429, 503, 529) or a transport failure is never a poison request,
however few callers there are: the callers (:mod:`edgeproxy._obtain.failover`) only ask
about the statuses a request can cause.

Bodies are known by a 16-byte BLAKE2b digest of the caller and the body, computed only on
the failure path and, while some body is known as poison, once per request: a proxy that
has seen none pays nothing per request. Both tables are bounded and forget on the clock.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edgeproxy._admission.ratelimit import api_key, identities
from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.modelnames import model_from_body

if TYPE_CHECKING:
    from edgeproxy._core.config import Config
    from edgeproxy._core.context import RequestContext

__all__ = ["Poison", "caller_key", "caller_of"]

# Bounds: bodies with a recent 5xx, callers with strikes.
_BODIES_KEPT = 4096
_CALLERS_KEPT = 4096


def caller_of(ctx: RequestContext, key_header: str) -> str:
    """The caller of ``ctx`` as the rate limits name it: ``t:<tenant>``, ``h:<hashed key>``
    (``key_header``, the API key), else the client IP."""
    key, ip = identities(ctx.tenant, api_key(ctx.headers, key_header), ctx.client_ip or "unknown")
    return key if key is not None else "ip:" + ip


def caller_key(ctx: RequestContext, key_header: str) -> int:
    """The caller of ``ctx`` as :func:`caller_of` names it, as a number cheap enough for
    every answered request (region health's evidence): Python's salted hash, which never
    leaves the process and keeps no key in memory."""
    tenant = ctx.tenant
    if tenant:
        return hash(("t", tenant))
    key = api_key(ctx.headers, key_header)
    if key:
        return hash(("h", key))
    return hash(("ip", ctx.client_ip or "unknown"))


def _scope(ctx: RequestContext, caller: str) -> str:
    """Where a caller's strikes apply: its caller, the route and the model it sent."""
    model = model_from_body(ctx.json)
    return f"{caller}\0{ctx.route.name}\0{model if isinstance(model, str) else ''}"


class _Body:
    """The 5xx answers one request body got: region → (when, status), latest last."""

    __slots__ = ("regions", "poison_until")

    def __init__(self) -> None:
        self.regions: dict[str, tuple[float, int]] = {}
        self.poison_until = 0.0


class Poison:
    """The proxy's poison bodies and its callers' strikes; see the module's docstring.

    ``clock`` (monotonic seconds) dates both; the tests inject one.
    """

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.monotonic) -> None:
        health = config.health
        self.ttl = health.poison_ttl
        self.strikes_allowed = health.poison_strikes
        self.key_header = config.admission.key_header
        self.clock = clock
        self._bodies: OrderedDict[bytes, _Body] = OrderedDict()
        self._strikes: OrderedDict[str, deque[float]] = OrderedDict()
        # Whether any body is poison, or any caller limited: the per-request checks run
        # only then.
        self.known = 0
        self.limiting = 0
        self.rejected_total = 0
        self.detected_total = 0
        self.limited_total = 0

    # -- bodies ------------------------------------------------------------------

    def digest(self, ctx: RequestContext) -> bytes | None:
        """The digest of the caller and the body; None for a request with no buffered body."""
        body = ctx.body
        if not ctx.body_read or not body:
            return None
        hasher = hashlib.blake2b(caller_of(ctx, self.key_header).encode(), digest_size=16)
        hasher.update(b"\0")
        hasher.update(body)
        return hasher.digest()

    def failed(self, ctx: RequestContext, region: str, status: int) -> ProxyError | None:
        """``region`` answered ``status`` (a 5xx) to ``ctx``: the 502 to answer when its
        body is now poison (a second region answered it 5xx within the ttl), else None."""
        key = self.digest(ctx)
        if key is None:
            return None
        now = self.clock()
        entry = self._bodies.get(key)
        if entry is None:
            entry = self._bodies[key] = _Body()
            if len(self._bodies) > _BODIES_KEPT:
                self._drop_oldest()
        else:
            self._bodies.move_to_end(key)
        horizon = now - self.ttl
        regions = entry.regions
        for name in [n for n, (at, _) in regions.items() if at < horizon]:
            del regions[name]
        regions.pop(region, None)
        regions[region] = (now, status)
        if len(regions) < 2:
            return None
        if not entry.poison_until:
            self.known += 1
            self.detected_total += 1
        entry.poison_until = now + self.ttl
        return rejected(regions)

    def rejection(self, ctx: RequestContext) -> ProxyError | None:
        """The 502 for a request whose body is known as poison, or None (most requests:
        only computed while some body is)."""
        if not self.known:
            return None
        key = self.digest(ctx)
        entry = self._bodies.get(key) if key is not None else None
        if entry is None or not entry.poison_until:
            return None
        now = self.clock()
        if entry.poison_until <= now:
            # Faded: the next failures decide again.
            entry.poison_until = 0.0
            self.known -= 1
            return None
        self.rejected_total += 1
        return rejected(entry.regions, int(entry.poison_until - now) + 1)

    def _drop_oldest(self) -> None:
        _, entry = self._bodies.popitem(last=False)
        if entry.poison_until:
            self.known -= 1

    # -- callers -------------------------------------------------------------------

    def strike(self, ctx: RequestContext) -> None:
        """One poison request from ``ctx``'s caller, on its route and model."""
        if not self.strikes_allowed:
            return
        caller = _scope(ctx, caller_of(ctx, self.key_header))
        now = self.clock()
        strikes = self._strikes.get(caller)
        if strikes is None:
            strikes = self._strikes[caller] = deque(maxlen=self.strikes_allowed)
            if len(self._strikes) > _CALLERS_KEPT:
                _, dropped = self._strikes.popitem(last=False)
                if len(dropped) == dropped.maxlen:
                    self.limiting -= 1
        else:
            self._strikes.move_to_end(caller)
            self._fade(strikes, now)
        was_full = len(strikes) == strikes.maxlen
        strikes.append(now)
        if not was_full and len(strikes) == strikes.maxlen:
            self.limiting += 1

    def _fade(self, strikes: deque[float], now: float) -> None:
        """Forget the strikes older than the ttl (a limited caller is free again)."""
        full = len(strikes) == strikes.maxlen
        horizon = now - self.ttl
        while strikes and strikes[0] <= horizon:
            strikes.popleft()
        if full and len(strikes) < self.strikes_allowed:
            self.limiting -= 1

    def limited(self, ctx: RequestContext) -> ProxyError | None:
        """The 429 for a caller with ``poison_strikes`` poison requests within the ttl on
        ``ctx``'s route and model, or None (most requests: only looked up while some caller
        is limited)."""
        if not self.limiting:
            return None
        strikes = self._strikes.get(_scope(ctx, caller_of(ctx, self.key_header)))
        if strikes is None or len(strikes) < self.strikes_allowed:
            return None
        now = self.clock()
        self._fade(strikes, now)
        if len(strikes) < self.strikes_allowed:
            return None
        wait = strikes[0] + self.ttl - now
        self.limited_total += 1
        return ProxyError(
            429,
            "rate_limit_exceeded",
            f"too many requests to this model that every region rejected while serving "
            f"others (the last {self.strikes_allowed} within {self.ttl:g}s): retry later",
            code="rejected_requests",
            headers={"Retry-After": str(int(wait) + 1)},
        )

    def snapshot(self) -> dict[str, Any]:
        """For ``/status`` ``limits``."""
        return {
            "poison_bodies": self.known,
            "poison_detected_total": self.detected_total,
            "poison_rejected_total": self.rejected_total,
            "callers_limited": self.limiting,
            "callers_limited_total": self.limited_total,
        }


def rejected(regions: dict[str, tuple[float, int]], retry_after: int | None = None) -> ProxyError:
    """502 ``upstream_rejected_request``: the regions that answered this request 5xx."""
    named = ", ".join(f"region {name} answered {status}" for name, (_, status) in regions.items())
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    return ProxyError(
        502,
        "upstream_rejected_request",
        f"the regions rejected this request ({named}); it is not sent again",
        code="upstream_rejected_request",
        headers=headers,
    )
