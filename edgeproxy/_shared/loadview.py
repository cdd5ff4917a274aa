"""The load of every region as all PoPs and workers see it together, shared through Redis.

Each process runs one background task (:class:`LoadView`). Every
``[shared_load] interval`` it runs, for each region, one Lua script that
publishes this process's load there (requests in flight, time-to-first-byte
peak-EWMA, request rate), stamped with Redis's clock, and reads back the load
every other process published. The request path never waits on Redis: it
reads what the last round brought.

Key layout, safe on a Redis Cluster: one hash per region,
``<redis_prefix>{<region>}``, with a field per process (its id:
``<pop>/<host>/<pid>/<random>``) holding ``"<stamp_ms> <in_flight> <ttft_ms>
<rate>"``. Each script touches that one key, whose hash tag is the region. The
script drops fields older than ``ttl`` (a process that went away) and the hash
itself expires ``ttl`` after the last write. Stamps are Redis's, so PoPs with
skewed clocks agree on what is fresh. A process that stops cleanly removes its
fields. Each round costs one script call per region and reads a field per live
process: processes x regions fields every interval.

Freshness: the view is fresh while its last successful round is younger than
``ttl`` (by this process's monotonic clock). Stale or missing data means local
values only: :meth:`LoadView.global_in_flight` and the other ``global_*``
methods return None, and the router keeps its own counts. When Redis fails,
the first failure is logged, every failure counted, and rounds are retried
with a pause that doubles from ``interval`` up to ``retry_max``.

Using it in the router's score (not wired here): the view is
``EdgeProxy.load_view``, built in ``EdgeProxy.open`` once the pipeline (and
so the router) exists, or None when ``[shared_load] redis_url`` is unset; the
router can be handed it there. ``view.global_in_flight(region.name)`` is the
requests in flight at that region over every process sharing the Redis,
this process's live count included (read at the call, not at the last
round): it replaces ``region.in_flight``, it is not added to it. It is None
when there is no fresh shared data (view stale, Redis down, no round yet):
use ``region.in_flight`` then. ``global_rate`` and ``global_ttft`` work the
same way. Every call is a few dictionary reads, cheap enough for each request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgeproxy._core.config import SharedLoadConfig
from edgeproxy._shared.redisclient import RedisClient, make_client, ready, safe_url
from edgeproxy._upstream.regions import Region, RegionSet

__all__ = ["LUA_PUBLISH", "LoadView", "Peer", "RegionLoad"]

logger = logging.getLogger("edgeproxy.loadview")

# KEYS[1]: one region's hash, a field per process. ARGV: this process's id, its
# entry ("<in_flight> <ttft_ms> <rate>"), the TTL in milliseconds. Stamps the entry
# with Redis's clock, drops entries older than the TTL, and returns
# {now_ms, id, "<stamp_ms> <in_flight> <ttft_ms> <rate>", ...} for every live entry.
LUA_PUBLISH = """
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d ', now) .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], ttl)
local all = redis.call('HGETALL', KEYS[1])
local out = {string.format('%d', now)}
for i = 1, #all, 2 do
  local stamp = tonumber(string.match(all[i + 1], '^(%d+) '))
  if stamp == nil or now - stamp > ttl then
    redis.call('HDEL', KEYS[1], all[i])
  else
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
"""

# Seconds over which the published request rate forgets.
_RATE_DECAY = 2.0


@dataclass(frozen=True, slots=True)
class Peer:
    """What another process published for one region."""

    in_flight: float
    ttft: float | None  # seconds; None before its first answer
    rate: float  # requests per second
    age: float  # seconds between its stamp and the read, on Redis's clock


@dataclass(slots=True)
class RegionLoad:
    """One region over every process: this one's live values plus the others' last ones."""

    in_flight: float
    rate: float
    ttft: float | None
    processes: int  # this one included


@dataclass(slots=True)
class _Own:
    """This process's rate for one region, from its request counter."""

    total: int = 0
    at: float = 0.0
    rate: float = 0.0


@dataclass(slots=True)
class _Errors:
    total: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    last: str | None = None


def _process_id(pop: str) -> str:
    return f"{pop}/{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"


def _parse(raw: bytes | str) -> tuple[int, float, float | None, float] | None:
    """``"<stamp_ms> <in_flight> <ttft_ms> <rate>"``; None when it is not that."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    parts = text.split(" ")
    if len(parts) != 4:
        return None
    try:
        stamp = int(parts[0])
        in_flight = float(parts[1])
        ttft = None if parts[2] == "-" else float(parts[2]) / 1000.0
        rate = float(parts[3])
    except ValueError:
        return None
    values = (in_flight, rate) if ttft is None else (in_flight, rate, ttft)
    if not all(math.isfinite(v) and v >= 0 for v in values):
        return None
    return stamp, in_flight, ttft, rate


class LoadView:
    """This process's view of every region's load over all processes sharing one Redis.

    ``clock`` (monotonic seconds) dates the rounds and the rate; ``process_id``
    names this process in Redis (by default ``<pop>/<host>/<pid>/<random>``,
    drawn at :meth:`open`, so forked workers differ).
    """

    def __init__(
        self,
        config: SharedLoadConfig,
        regions: RegionSet,
        *,
        pop: str = "edge",
        clock: Callable[[], float] = time.monotonic,
        process_id: str | None = None,
    ) -> None:
        self.config = config
        self.regions = regions
        self.pop = pop
        self.clock = clock
        self.process_id = process_id or ""
        self._fixed_id = process_id is not None
        self.enabled = config.enabled
        self.client: RedisClient | None = None
        self._script: Any = None
        self._task: asyncio.Task[None] | None = None
        # region -> process id -> what it published, as of the last good round.
        self._peers: dict[str, dict[str, Peer]] = {r.name: {} for r in regions}
        self._own: dict[str, _Own] = {r.name: _Own() for r in regions}
        self._read_at: float | None = None
        self._failures = 0  # in a row
        self._loaded = False  # the script, in every master
        self.rounds_total = 0
        self.errors = _Errors()

    # -- lifecycle -----------------------------------------------------------------

    async def open(self, *, background: bool = True) -> None:
        """Start the background rounds; returns at once (Redis is not waited for).

        ``background=False`` only builds the client: the caller runs :meth:`round`.
        """
        if not self.enabled or self.client is not None:
            return
        if not self._fixed_id:
            self.process_id = _process_id(self.pop)
        now = self.clock()
        for name, own in self._own.items():
            own.total, own.at = self.regions.by_name[name].requests_total, now
        config = self.config
        self.client = make_client(
            config.redis_settings(),
            connect_timeout=config.redis_timeout,
            socket_timeout=config.redis_timeout,
            max_connections=len(self._own) + 4,
        )
        self._script = self.client.register_script(LUA_PUBLISH)
        if background:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="edgeproxy-shared-load"
            )

    async def close(self) -> None:
        """Stop the rounds and, if Redis answers at once, withdraw this process's entries."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        client, self.client = self.client, None
        if client is None:
            return
        try:
            if self._failures == 0 and self._read_at is not None:
                async with asyncio.timeout(self.config.redis_timeout):
                    await asyncio.gather(
                        *(client.hdel(self._key(n), self.process_id) for n in self._own)
                    )
        except Exception:  # noqa: BLE001 - the entries expire after ttl anyway
            pass
        finally:
            await client.aclose()

    # -- rounds --------------------------------------------------------------------

    def _key(self, region: str) -> str:
        return f"{self.config.redis_prefix}{{{region}}}"

    async def _run(self) -> None:
        config = self.config
        while True:
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down or slow: local values
                self._failed(exc)
            if self._failures:
                pause = min(config.retry_max, config.interval * 2.0**self._failures)
                pause *= random.uniform(0.75, 1.0)
            else:
                pause = config.interval
            await asyncio.sleep(pause)

    async def round(self) -> None:
        """Publish this process's load for every region and read the others' (one script each).

        Raises on a Redis fault; :meth:`_run` counts it. Exposed for tests.
        """
        now = self.clock()
        entries = {region.name: self._entry(region, now) for region in self.regions}
        ttl_ms = str(max(1, round(self.config.ttl * 1000)))
        script = self._script
        assert script is not None
        async with asyncio.timeout(self.config.redis_timeout):
            if not self._loaded:
                # Once, and again after a failure (Redis may have restarted without it):
                # concurrent calls then find the script instead of all loading it at once.
                assert self.client is not None
                await ready(self.client)
                await self.client.script_load(LUA_PUBLISH)
                self._loaded = True
            replies = await asyncio.gather(
                *(
                    script(keys=[self._key(name)], args=[self.process_id, entry, ttl_ms])
                    for name, entry in entries.items()
                )
            )
        for name, reply in zip(entries, replies, strict=True):
            self._peers[name] = self._peers_from(reply)
        self._read_at = self.clock()
        self.rounds_total += 1
        if self._failures:
            logger.warning(
                "shared load: Redis answers again after %d failed rounds; sharing the load view",
                self._failures,
            )
        self._failures = 0

    def _entry(self, region: Region, now: float) -> str:
        own = self._own[region.name]
        total = region.requests_total
        dt = now - own.at
        if dt > 0:
            w = math.exp(-dt / _RATE_DECAY)
            own.rate = own.rate * w + (max(total - own.total, 0) / dt) * (1.0 - w)
            own.total, own.at = total, now
        latency = region.latency
        ttft = f"{latency.value * 1000:.3f}" if latency.samples else "-"
        return f"{max(region.in_flight, 0)} {ttft} {own.rate:.4f}"

    def _peers_from(self, reply: list[Any]) -> dict[str, Peer]:
        peers: dict[str, Peer] = {}
        if not reply:
            return peers
        try:
            now_ms = int(reply[0])
        except (TypeError, ValueError):
            return peers
        me = self.process_id
        for i in range(1, len(reply) - 1, 2):
            raw_id = reply[i]
            pid = raw_id.decode("utf-8", "replace") if isinstance(raw_id, bytes) else str(raw_id)
            if pid == me:
                continue
            parsed = _parse(reply[i + 1])
            if parsed is None:
                self.errors.by_kind["garbage"] += 1
                continue
            stamp, in_flight, ttft, rate = parsed
            peers[pid] = Peer(in_flight, ttft, rate, max(now_ms - stamp, 0) / 1000.0)
        return peers

    def _failed(self, exc: BaseException) -> None:
        self._loaded = False
        kind = (
            "timeout"
            if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__
            else "error"
        )
        self.errors.total += 1
        self.errors.by_kind[kind] += 1
        self.errors.last = f"{type(exc).__name__}: {exc}"
        if self._failures == 0:
            logger.warning(
                "shared load: Redis at %s failed (%s); routing on local load until it answers",
                safe_url(self.config.redis_url),
                self.errors.last,
            )
        self._failures += 1

    # -- the view --------------------------------------------------------------------

    @property
    def fresh(self) -> bool:
        """Whether the last good round is younger than ``ttl``: shared values, else local."""
        read_at = self._read_at
        return read_at is not None and self.clock() - read_at <= self.config.ttl

    def _fresh_peers(self, region_name: str) -> dict[str, Peer] | None:
        if not self.fresh:
            return None
        return self._peers.get(region_name)

    def global_in_flight(self, region_name: str) -> float | None:
        """Requests in flight at the region over every process: this one's live count plus
        the others' last published ones. None when the view is off, stale or has never
        read (use the region's own ``in_flight`` then) or the region is unknown."""
        peers = self._fresh_peers(region_name)
        if peers is None:
            return None
        own = self.regions.by_name[region_name].in_flight
        return float(own) + sum(p.in_flight for p in peers.values())

    def global_rate(self, region_name: str) -> float | None:
        """Requests per second sent to the region by every process; None as above."""
        peers = self._fresh_peers(region_name)
        if peers is None:
            return None
        return self._own[region_name].rate + sum(p.rate for p in peers.values())

    def global_ttft(self, region_name: str) -> float | None:
        """Time-to-first-byte EWMA (seconds) over every process that has one, weighted by
        each one's request rate; None as above or when no process has a sample."""
        peers = self._fresh_peers(region_name)
        if peers is None:
            return None
        region = self.regions.by_name[region_name]
        samples = [(p.ttft, p.rate) for p in peers.values() if p.ttft is not None]
        if region.latency.samples:
            samples.append((region.latency.value, self._own[region_name].rate))
        if not samples:
            return None
        weight = sum(rate for _, rate in samples)
        if weight <= 0:
            return sum(t for t, _ in samples) / len(samples)
        return sum(t * rate for t, rate in samples) / weight

    def region_load(self, region_name: str) -> RegionLoad | None:
        """The region over every process, or None when there is no fresh shared data."""
        peers = self._fresh_peers(region_name)
        if peers is None:
            return None
        in_flight = self.global_in_flight(region_name)
        rate = self.global_rate(region_name)
        assert in_flight is not None and rate is not None
        return RegionLoad(in_flight, rate, self.global_ttft(region_name), len(peers) + 1)

    # -- /status -----------------------------------------------------------------------

    def annotate(self, regions: list[dict[str, Any]]) -> None:
        """Add ``shared_load`` to each region of a ``/status`` region list, in place.

        ``fresh`` false means the values are this process's own.
        """
        for data in regions:
            name = data.get("name")
            if not isinstance(name, str) or name not in self._own:
                continue
            load = self.region_load(name)
            if load is None:
                region = self.regions.by_name[name]
                ttft = region.latency.value if region.latency.samples else None
                load = RegionLoad(float(region.in_flight), self._own[name].rate, ttft, 1)
                fresh = False
            else:
                fresh = True
            data["shared_load"] = {
                "fresh": fresh,
                "in_flight": load.in_flight,
                "requests_per_second": round(load.rate, 3),
                "ttft_ms": None if load.ttft is None else round(load.ttft * 1000, 3),
                "processes": load.processes,
            }

    def snapshot(self) -> dict[str, Any]:
        read_at = self._read_at
        return {
            "enabled": self.enabled,
            "url": safe_url(self.config.redis_url) if self.enabled else None,
            "cluster": self.config.redis_cluster,
            "process_id": self.process_id or None,
            "fresh": self.fresh,
            "age_s": None if read_at is None else round(self.clock() - read_at, 3),
            "rounds_total": self.rounds_total,
            "errors_total": self.errors.total,
            "errors": dict(self.errors.by_kind),
            "last_error": self.errors.last,
        }
