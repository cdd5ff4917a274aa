"""Token-bucket rate limits per API key or tenant and per client IP, local or shared in Redis.

Each configured limit is a bucket per identity (a key or tenant, a client
IP): ``burst`` units deep, refilled at ``rate`` units a second. A request
takes one unit from every request bucket it belongs to and, on LLM routes,
its estimated prompt tokens from the token buckets; it passes only if every
bucket can pay, and then all of them pay at once. Token buckets are settled
when the answer is complete: the difference between the estimate and the
upstream's ``usage.total_tokens`` is charged or refunded, so a bucket may go
into debt and hold the next requests back until it refills.

Buckets live in the process by default. With ``redis_url`` they live in Redis
and one Lua script reads, refills and charges all of a request's buckets
atomically, on Redis's clock, so every worker and PoP sharing that Redis
shares the limits. A bucket's key is ``<redis_prefix>{<identity>}:<limit>``:
the identity (key or tenant, client IP) is its hash tag, so on a Redis Cluster
(``redis_cluster``) the buckets of one identity share a slot. A request whose
buckets fall in several slots (its key's and its IP's) runs the script once
per slot, concurrently; if one refuses, the others' charges are given back
(all or nothing, though not atomic across slots: a concurrent request may
briefly see a charge that is then refunded).

When Redis fails or is too slow the request is limited by the local buckets
instead, and a background task keeps trying Redis every
``redis_retry_interval`` seconds: a Redis outage loosens the limits (each
process then allows the full rate) but never fails a request.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.crc import key_slot

from edgeproxy._core.config import AdmissionConfig, RedisSettings
from edgeproxy._core.errors import ProxyError
from edgeproxy._core.outcome import LimitLevel
from edgeproxy._shared.redisclient import make_client, ready

__all__ = [
    "Charge",
    "Limit",
    "LocalBuckets",
    "RateLimiter",
    "RateTicket",
    "api_key",
    "identities",
    "limit_levels",
]

logger = logging.getLogger("edgeproxy")

# KEYS: one bucket each. ARGV[1]: "take" (all or nothing) or "settle" (always
# applied; costs may be negative, a refund). Then rate, burst, cost per key.
# Returns {allowed, wait seconds, index of the limiting bucket, level of each bucket}.
# Levels and times are stored as strings: Lua numbers would be truncated to
# integers on the way out.
LUA_SCRIPT = """
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local take = ARGV[1] == 'take'
local levels = {}
local allowed = 1
local wait = 0
local worst = 0
for i, key in ipairs(KEYS) do
  local rate = tonumber(ARGV[i * 3 - 1])
  local burst = tonumber(ARGV[i * 3])
  local cost = tonumber(ARGV[i * 3 + 1])
  local state = redis.call('HMGET', key, 'level', 'ts')
  local level = tonumber(state[1])
  local ts = tonumber(state[2])
  if level == nil or ts == nil then
    level = burst
    ts = now
  end
  if now > ts then level = math.min(burst, level + (now - ts) * rate) end
  levels[i] = level
  if take then
    local need = math.min(cost, burst)
    if level < need then
      allowed = 0
      local w = (need - level) / rate
      if w > wait then
        wait = w
        worst = i
      end
    end
  end
end
if allowed == 1 then
  for i, key in ipairs(KEYS) do
    local rate = tonumber(ARGV[i * 3 - 1])
    local burst = tonumber(ARGV[i * 3])
    local cost = tonumber(ARGV[i * 3 + 1])
    local level = math.min(burst, levels[i] - cost)
    levels[i] = level
    redis.call('HSET', key, 'level', tostring(level), 'ts', tostring(now))
    redis.call('PEXPIRE', key, math.ceil((burst - level) / rate * 1000) + 1000)
  end
end
local out = {allowed, tostring(wait), worst}
for i = 1, #levels do out[#out + 1] = tostring(levels[i]) end
return out
"""


@dataclass(frozen=True, slots=True)
class Limit:
    """One configured limit: ``burst`` units refilled at ``rate`` per second, per identity."""

    name: str  # "key-requests", "ip-tokens", ...
    scope: str  # "key" or "ip"
    unit: str  # "requests" or "tokens"
    rate: float
    burst: float

    @property
    def window(self) -> float:
        """Seconds an empty bucket takes to refill: the ``w`` of ``RateLimit-Policy``."""
        return self.burst / self.rate

    def policy(self) -> str:
        return f'{int(self.burst)};w={self.window:g};comment="{self.name}"'


@dataclass(slots=True)
class Charge:
    """What one request takes from one bucket."""

    limit: Limit
    bucket: str
    cost: float


@dataclass(slots=True)
class Decision:
    allowed: bool
    wait: float = 0.0
    limit: Limit | None = None
    remaining: float = 0.0
    levels: tuple[float, ...] = ()
    """An allowed take's: each bucket's level once charged, in the charges' order."""


class LocalBuckets:
    """Token buckets in this process, the least recently used forgotten past ``max_buckets``.

    A forgotten bucket comes back full: under a flood of distinct keys, the
    oldest lose their history rather than the process its memory.
    """

    def __init__(self, max_buckets: int) -> None:
        self.max_buckets = max_buckets
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, charge: Charge, now: float) -> list[float]:
        state = self._buckets.get(charge.bucket)
        limit = charge.limit
        if state is None:
            state = [limit.burst, now]
            self._buckets[charge.bucket] = state
            if len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(charge.bucket)
            if now > state[1]:
                state[0] = min(limit.burst, state[0] + (now - state[1]) * limit.rate)
                state[1] = now
        return state

    def take(self, charges: Sequence[Charge], now: float | None = None) -> Decision:
        """Charge every bucket, or none if one cannot pay."""
        now = time.monotonic() if now is None else now
        states = [self._level(c, now) for c in charges]
        worst: Decision | None = None
        for charge, state in zip(charges, states, strict=True):
            need = min(charge.cost, charge.limit.burst)
            if state[0] < need:
                wait = (need - state[0]) / charge.limit.rate
                if worst is None or wait > worst.wait:
                    worst = Decision(False, wait, charge.limit, state[0])
        if worst is not None:
            return worst
        for charge, state in zip(charges, states, strict=True):
            state[0] -= charge.cost
        return Decision(True, levels=tuple(state[0] for state in states))

    def settle(self, charges: Sequence[Charge], now: float | None = None) -> None:
        """Apply costs unconditionally (negative ones refund), capped at each bucket's size."""
        now = time.monotonic() if now is None else now
        for charge in charges:
            state = self._level(charge, now)
            state[0] = min(charge.limit.burst, state[0] - charge.cost)


class RedisBuckets:
    """The same buckets in Redis, read and charged by one atomic Lua script per hash slot."""

    def __init__(self, settings: RedisSettings, prefix: str, timeout: float) -> None:
        self.prefix = prefix
        self.timeout = timeout
        self.cluster = settings.cluster
        self.client = make_client(settings, connect_timeout=timeout, socket_timeout=timeout)
        self.script = self.client.register_script(LUA_SCRIPT)

    def key(self, charge: Charge) -> str:
        """``<prefix>{<identity>}:<limit>``: a bucket's identity is its hash tag."""
        name = charge.limit.name
        bucket = charge.bucket
        who = bucket[len(name) + 1 :] if bucket.startswith(name + ":") else bucket
        return f"{self.prefix}{{{who}}}:{name}"

    async def run(self, mode: str, charges: Sequence[Charge]) -> Decision:
        """Take (all or nothing) or settle ``charges``, within ``timeout`` in all."""
        keys = [self.key(c) for c in charges]
        async with asyncio.timeout(self.timeout):
            if not self.cluster:
                return await self._run_slot(mode, charges, keys)
            await ready(self.client)
            slots: dict[int, list[int]] = {}
            for i, key in enumerate(keys):
                slots.setdefault(key_slot(key.encode("utf-8", "surrogatepass")), []).append(i)
            if len(slots) == 1:
                return await self._run_slot(mode, charges, keys)
            groups = [([charges[i] for i in idx], [keys[i] for i in idx]) for idx in slots.values()]
            decisions = await asyncio.gather(*(self._run_slot(mode, c, k) for c, k in groups))
            refused = [d for d in decisions if not d.allowed]
            if mode != "take" or not refused:
                return Decision(True)
            # All or nothing: the slots that paid get their charges back.
            paid = [(c, k) for (c, k), d in zip(groups, decisions, strict=True) if d.allowed]
            await asyncio.gather(
                *(
                    self._run_slot("settle", [Charge(x.limit, x.bucket, -x.cost) for x in c], k)
                    for c, k in paid
                )
            )
            return max(refused, key=lambda d: d.wait)

    async def _run_slot(self, mode: str, charges: Sequence[Charge], keys: list[str]) -> Decision:
        args: list[str | float] = [mode]
        for c in charges:
            args += [repr(c.limit.rate), repr(c.limit.burst), repr(c.cost)]
        reply = await self.script(keys=keys, args=args)
        allowed, wait, worst = int(reply[0]), float(reply[1]), int(reply[2])
        if allowed:
            return Decision(True, levels=tuple(float(level) for level in reply[3:]))
        charge = charges[worst - 1]
        return Decision(False, wait, charge.limit, float(reply[2 + worst]))

    async def ping(self) -> None:
        """Whether Redis answers; loads the script too, so that the first requests find it."""
        async with asyncio.timeout(self.timeout):
            await ready(self.client)
            await self.client.ping()
            await self.client.script_load(LUA_SCRIPT)

    async def aclose(self) -> None:
        await self.client.aclose()


@dataclass(slots=True)
class RateTicket:
    """The charges a request paid, for settling once its usage is known."""

    charges: list[Charge]
    shared: bool  # paid in Redis
    estimate: int
    levels: tuple[float, ...] = ()

    def state(self) -> dict[str, LimitLevel] | None:
        """The levels the answer's rate-limit headers state (None: unknown)."""
        if len(self.levels) != len(self.charges):
            return None
        return limit_levels(self.charges, self.levels)


def limit_levels(charges: Sequence[Charge], levels: Sequence[float]) -> dict[str, LimitLevel]:
    """Each unit's most constrained bucket: its size, what is left, when it is full."""
    out: dict[str, LimitLevel] = {}
    for charge, level in zip(charges, levels, strict=True):
        limit = charge.limit
        left = max(0.0, level)
        known = out.get(limit.unit)
        if known is not None and known.remaining / max(known.limit, 1) <= left / limit.burst:
            continue
        out[limit.unit] = LimitLevel(
            int(limit.burst), math.floor(left), max(0.0, (limit.burst - left) / limit.rate)
        )
    return out


def _identity(value: str) -> str:
    # Raw API keys never become Redis keys or log lines.
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def api_key(headers: Mapping[str, str], key_header: str) -> str | None:
    """The API key a request carries, for the per-key limits: ``key_header``'s value; with
    ``Authorization`` (the default), Anthropic's ``x-api-key`` when it is absent, as the
    Messages API's clients send their key there."""
    if not key_header:
        return None
    value = headers.get(key_header)
    if value is None and key_header.lower() == "authorization":
        value = headers.get("x-api-key")
    return value


def identities(tenant: str | None, key_value: str | None, ip: str) -> tuple[str | None, str]:
    """Who a request is for, as the rate limits (and region health) name callers: the key
    identity (the tenant, else the hashed key header; None without either) and the IP's."""
    key: str | None = None
    if tenant:
        readable = len(tenant) <= 64 and tenant.isprintable()
        key = "t:" + (tenant if readable else _identity(tenant))
    elif key_value:
        key = "h:" + _identity(key_value)
    return key, ip


class RateLimiter:
    """The rate limits of one proxy: configured limits, buckets, Redis state, counters."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.cached_weight = config.cached_token_weight
        self.config = config
        self.key_limits = _limits(
            "key", config.key_requests_per_second, config.key_burst, config.key_tokens_per_minute
        )
        self.ip_limits = _limits(
            "ip", config.ip_requests_per_second, config.ip_burst, config.ip_tokens_per_minute
        )
        self.enabled = bool(self.key_limits or self.ip_limits)
        self.counts_tokens = any(
            lim.unit == "tokens" for lim in (*self.key_limits, *self.ip_limits)
        )
        self.local = LocalBuckets(config.max_local_buckets)
        self.redis: RedisBuckets | None = None
        self.redis_up = False
        self._probe: asyncio.Task[None] | None = None
        self._settling: set[asyncio.Task[None]] = set()
        self.allowed_total = 0
        self.rejected: dict[str, int] = {lim.name: 0 for lim in (*self.key_limits, *self.ip_limits)}
        self.redis_errors = 0
        self.local_fallbacks = 0

    async def open(self) -> None:
        """Connect to Redis when configured; an unreachable Redis only means local limits."""
        if not self.enabled or not self.config.redis_url:
            return
        self.redis = RedisBuckets(
            self.config.redis_settings(), self.config.redis_prefix, self.config.redis_timeout
        )
        try:
            await self.redis.ping()
            self.redis_up = True
        except Exception as exc:  # noqa: BLE001 - any failure means "not now"
            logger.warning("rate limits: Redis unreachable at startup (%s); limiting locally", exc)
            self._redis_failed(exc)

    async def close(self) -> None:
        tasks = [t for t in (self._probe, *self._settling) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._probe = None
        self._settling.clear()
        if self.redis is not None:
            await self.redis.aclose()
            self.redis = None
        self.redis_up = False

    # -- per request -------------------------------------------------------

    def identities(
        self, tenant: str | None, key_value: str | None, ip: str
    ) -> tuple[str | None, str]:
        """The key identity (tenant, else the hashed key header) and the IP identity."""
        return identities(tenant, key_value, ip)

    def charges(self, key: str | None, ip: str, tokens: int) -> list[Charge]:
        out: list[Charge] = []
        for limits, who in ((self.key_limits, key), (self.ip_limits, ip)):
            if who is None:
                continue
            for lim in limits:
                if lim.unit == "requests":
                    out.append(Charge(lim, f"{lim.name}:{who}", 1.0))
                elif tokens:
                    out.append(Charge(lim, f"{lim.name}:{who}", float(tokens)))
        return out

    async def take(self, charges: list[Charge], estimate: int) -> RateTicket:
        """Charge the buckets or raise a 429 ``ProxyError`` with Retry-After and RateLimit-*."""
        shared = False
        decision: Decision | None = None
        if self.redis is not None and self.redis_up:
            try:
                decision = await self.redis.run("take", charges)
                shared = True
            except Exception as exc:  # noqa: BLE001 - Redis down or slow: limit locally
                self._redis_failed(exc)
        if decision is None:
            if self.redis is not None:
                self.local_fallbacks += 1
            decision = self.local.take(charges)
        if not decision.allowed:
            assert decision.limit is not None
            self.rejected[decision.limit.name] += 1
            raise self._rejection(decision)
        self.allowed_total += 1
        return RateTicket(charges, shared, estimate, decision.levels)

    def settle(self, ticket: RateTicket, usage: dict[str, Any] | None) -> None:
        """Charge or refund the difference between the token estimate and the real usage
        (a cached prompt token counting ``cached_token_weight``)."""
        total = _total_tokens(usage)
        if total is None:
            return
        assert usage is not None
        cached = usage.get("cached_tokens")
        if self.cached_weight != 1.0 and type(cached) is int and cached > 0:
            total -= math.floor(cached * (1.0 - self.cached_weight))
        delta = total - ticket.estimate
        if not delta:
            return
        charges = [
            Charge(c.limit, c.bucket, float(delta))
            for c in ticket.charges
            if c.limit.unit == "tokens"
        ]
        if charges:
            self._apply(charges, ticket.shared)

    def refund(self, ticket: RateTicket) -> None:
        """Give a request's charges back: it was shed, not served."""
        self._apply([Charge(c.limit, c.bucket, -c.cost) for c in ticket.charges], ticket.shared)

    def _apply(self, charges: list[Charge], shared: bool) -> None:
        if not shared:
            self.local.settle(charges)
            return
        if self.redis is None or not self.redis_up:
            return  # the shared bucket is out of reach; a local one never paid
        task = asyncio.get_running_loop().create_task(self._settle_shared(charges))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle_shared(self, charges: list[Charge]) -> None:
        assert self.redis is not None
        try:
            await self.redis.run("settle", charges)
        except Exception as exc:  # noqa: BLE001
            self._redis_failed(exc)

    def _rejection(self, decision: Decision) -> ProxyError:
        limit = decision.limit
        assert limit is not None
        retry = max(1, math.ceil(decision.wait))
        scope = "API key" if limit.scope == "key" else "client IP"
        per = "second" if limit.unit == "requests" else "minute"
        amount = limit.rate if limit.unit == "requests" else limit.rate * 60
        policies = [limit] + [
            lim for lim in (*self.key_limits, *self.ip_limits) if lim is not limit
        ]
        refusal = ProxyError(
            429,
            limit.unit,
            f"Rate limit reached for this {scope}: {amount:g} {limit.unit} per {per}. "
            f"Retry after {retry} s.",
            code="rate_limit_exceeded",
            headers={
                "Retry-After": str(retry),
                "RateLimit-Limit": str(int(limit.burst)),
                "RateLimit-Remaining": str(max(0, math.floor(decision.remaining))),
                "RateLimit-Reset": str(retry),
                "RateLimit-Policy": ", ".join(p.policy() for p in policies),
            },
        )
        refusal.limits = {
            limit.unit: LimitLevel(
                int(limit.burst), max(0, math.floor(decision.remaining)), decision.wait
            )
        }
        return refusal

    # -- Redis health ------------------------------------------------------

    def _redis_failed(self, exc: BaseException) -> None:
        self.redis_errors += 1
        if self.redis_up:
            logger.warning("rate limits: Redis failed (%r); limiting locally", exc)
        self.redis_up = False
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        while self.redis is not None:
            await asyncio.sleep(self.config.redis_retry_interval)
            try:
                await self.redis.ping()
            except Exception:  # noqa: BLE001 - still down
                continue
            self.redis_up = True
            logger.info("rate limits: Redis is back; sharing limits again")
            return

    def snapshot(self) -> dict[str, Any]:
        backend = "local"
        if self.redis is not None:
            backend = "redis" if self.redis_up else "local (redis down)"
        return {
            "enabled": self.enabled,
            "backend": backend,
            "redis_cluster": self.redis is not None and self.redis.cluster,
            "limits": [
                {"name": lim.name, "rate_per_s": lim.rate, "burst": lim.burst}
                for lim in (*self.key_limits, *self.ip_limits)
            ],
            "allowed_total": self.allowed_total,
            "rejected": dict(self.rejected),
            "local_buckets": len(self.local),
            "redis_errors": self.redis_errors,
            "local_fallbacks": self.local_fallbacks,
        }


def _limits(scope: str, rps: float, burst: float, tpm: float) -> tuple[Limit, ...]:
    out = []
    if rps > 0:
        out.append(Limit(f"{scope}-requests", scope, "requests", rps, burst or max(1.0, rps)))
    if tpm > 0:
        out.append(Limit(f"{scope}-tokens", scope, "tokens", tpm / 60.0, tpm))
    return tuple(out)


def _total_tokens(usage: dict[str, Any] | None) -> int | None:
    if not usage:
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int) and not isinstance(total, bool) and total >= 0:
        return total
    parts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
    if all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in parts):
        return int(parts[0]) + int(parts[1])  # type: ignore[arg-type]
    return None
