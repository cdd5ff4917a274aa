"""Which region holds each stored object: stateful requests go to their state.

An object a region stores exists in that region only: a Responses API response (``store``
not false), a conversation, a file, a batch, a vector store. OpenAI, Azure OpenAI and
vLLM's stores all keep it where it was made, and a request for it elsewhere gets 404. So
the region that answers a request creating such an object is remembered as its **owner**
(:meth:`Owners.remember`), and a request that refers to one (:func:`stateful_request`) is
routed to the owner alone. What creates an object and what refers to one is the API's
knowledge, not this module's: the paths and body fields of the stored collections are in
:mod:`edgeproxy._protocol.objects`, and a dialect names what its requests refer to
(``state_refs``: the Responses API's ``previous_response_id`` and ``conversation``) and
whether they store their answer (``stores``).

Each owner entry is bound to the **scope** of the request that made the object: the
tenant, else a hash of the client's credentials, else anonymous clients, the cache's own
scope (:func:`~edgeproxy._cache.keys.cache_scope`). With the proxy's own
credentials toward the regions, a region cannot tell clients apart, so the proxy answers a
request of another scope with the API's own 404, as the provider would answer a stranger.

The map lives in each process's memory, and in Redis when ``[stateful]`` has one, so that
every PoP and worker sharing that Redis knows every owner: a map from id to region, rather
than the region written into the ids the client sees, because ids are opaque to the
clients and to the SDKs that check them, objects quote each other's ids (a batch its input
file, a vector store its files), and nothing of a region's name or address should reach a
client.

Redis writes go through a bounded queue that one task drains in pipelined batches and
retries until Redis takes them, so an entry made while Redis is down or stalled lands once
it is back. The write of a JSON answer's id is waited for (at most ``redis_timeout``)
before the answer goes out, as a client may send its follow-up through another PoP at
once; a stream's goes out at ``response.created`` and has the whole answer's time to land.
A request's lookups go in pipelined batches over one connection at a time, and every
Redis call waits for one of ``redis_max_connections`` slots (bounded by
``redis_pool_timeout``), so no burst fails for want of a connection.

A lookup has three outcomes (:class:`Owner`, :attr:`Missing.UNKNOWN`,
:attr:`Missing.FAILED`): an id that Redis (or, without Redis, this process) does not know
gets the API's own 404; one that could not be looked up (Redis down, slow, or every slot
taken) gets 503 with ``Retry-After``, never a 404 that would lose a chain; one whose owner
is unavailable gets 503 too (never another region, which would answer 404).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from edgeproxy._cache.keys import cache_scope
from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects import Dialect, dialect_named
from edgeproxy._protocol.endpoints import dialect_for
from edgeproxy._protocol.objects import object_path
from edgeproxy._protocol.sse import SSEEvent, SSEEventTooLarge, events_of
from edgeproxy._shared.redisclient import RedisClient, make_client

if TYPE_CHECKING:
    from edgeproxy._core.config import StatefulConfig
    from edgeproxy._core.context import RequestContext

__all__ = [
    "Missing",
    "Owner",
    "Owners",
    "StateRef",
    "StatefulRequest",
    "created_id",
    "lookup_failed",
    "owner_unavailable",
    "stateful_request",
    "too_many_refs",
]

logger = logging.getLogger("edgeproxy")

# Consecutive failed Redis calls after which lookups stop waiting on it for _DOWN_FOR
# seconds (they fail at once, 503): a stalled Redis must not add redis_timeout to every
# stateful request. One failure is not enough: a burst that times out a few calls has not
# shown that Redis is down.
_FAILURES_TO_TRIP = 3
_DOWN_FOR = 2.0
# Ids per pipelined read or write: a request naming 500 objects costs 5 round trips on one
# connection, not 500 connections.
_BATCH = 100
# The write queue's retry delays: short at first, so that an entry lands soon after Redis
# is back (a follow-up through another PoP may be waiting on it), capped for a long outage.
_RETRY_FIRST = 0.05
_RETRY_MAX = 2.0
# The bounded wait of close() for queued writes, beyond one redis_timeout.
_CLOSE_WAIT = 1.0


def owner_unavailable(retry_after: int) -> ProxyError:
    """The 503 of a request whose owner region cannot answer now: no other region may, as
    it would answer 404. No address or region detail reaches the client."""
    message = "the region holding this request's state is unavailable; retry later"
    return _retry_later(message, "owner_unavailable", retry_after)


def lookup_failed(retry_after: int) -> ProxyError:
    """The 503 of a request whose objects' owners could not be looked up now (the shared
    map did not answer): the objects may well exist, so never the API's 404."""
    message = "where this request's state is held cannot be looked up now; retry later"
    return _retry_later(message, "owner_lookup_failed", retry_after)


def _retry_later(message: str, code: str, retry_after: int) -> ProxyError:
    return ProxyError(
        503, "service_unavailable", message, code=code, headers={"Retry-After": str(retry_after)}
    )


def too_many_refs(count: int, limit: int) -> ProxyError:
    """The 400 of a request naming more stored objects than ``[stateful] max_refs``."""
    return ProxyError(
        400,
        "invalid_request_error",
        f"This request refers to {count} stored objects; at most {limit} are allowed.",
        code="too_many_references",
    )


class StateRef:
    """A request's reference to a stored object: its id, and the API's 404 for it."""

    __slots__ = ("id", "_missing")

    def __init__(self, object_id: str, missing: Callable[[str], ProxyError]) -> None:
        self.id = object_id
        self._missing = missing

    def not_found(self) -> ProxyError:
        """The API's own 404 for an object no region is known to hold."""
        return self._missing(self.id)


class StatefulRequest:
    """What a request has to do with stored objects: those it refers to, in the order the
    API reads them, whether its answer creates one, the dialect that reads its id, and the
    scope of its caller, which a new object is bound to and a referred one must have."""

    __slots__ = ("refs", "creates", "dialect", "scope")

    def __init__(
        self, refs: list[StateRef], creates: bool, dialect: Dialect, scope: str = "pub"
    ) -> None:
        self.refs = refs
        self.creates = creates
        self.dialect = dialect
        self.scope = scope


def stateful_request(ctx: RequestContext) -> StatefulRequest | None:
    """What ``ctx`` has to do with stored objects; None for most requests (nothing)."""
    path = ctx.path
    target = object_path(path)
    facts = ctx.facts
    dialect = dialect_named(facts.dialect) if facts is not None else dialect_for(path)
    if target is None and not dialect.keeps_state:
        return None
    refs: list[StateRef] = []
    creates = False
    if target is not None and target.object_id is not None:
        # /v1/files/{id}/content, /v1/conversations/{id}/items...: whatever the method.
        refs.append(StateRef(target.object_id, target.kind.not_found))
    post = ctx.method == "POST"
    # A body that is not JSON (a file's multipart upload) is not parsed: ctx.json is None.
    body = ctx.json if post else None
    if isinstance(body, dict):
        if dialect.keeps_state:
            for field, object_id in dialect.state_refs(body):
                refs.append(StateRef(object_id, _field_missing(dialect.ref_not_found, field)))
            creates = dialect.stores(body)
        elif target is not None:
            for _, object_id, kind in target.kind.body_refs(body):
                refs.append(StateRef(object_id, kind.not_found))
    if post and target is not None and target.object_id is None and target.kind.creates:
        creates = True  # POST /v1/files, /v1/batches...: the answer's id is the new object's
    if not refs and not creates:
        return None
    return StatefulRequest(refs, creates, dialect, cache_scope(ctx))


def _field_missing(
    not_found: Callable[[str, str], ProxyError], field: str
) -> Callable[[str], ProxyError]:
    return lambda object_id: not_found(field, object_id)


def created_id(
    dialect: Dialect, first: bytes, sse: bool, opening: list[SSEEvent] | None = None
) -> str | None:
    """The id of the object a region made, as ``dialect`` reads it: from its JSON answer
    (held whole, or its beginning), or from the events its stream opens with (``opening``,
    as the attempt read them, else read from ``first``)."""
    if sse:
        if opening is None:
            try:
                opening = events_of(first)
            except SSEEventTooLarge:
                return None
        for event in opening:
            object_id = dialect.created_in(event)
            if object_id is not None:
                return object_id
        return None
    try:
        answer = orjson.loads(first)
    except orjson.JSONDecodeError:
        return None
    return dialect.created_id(answer) if isinstance(answer, dict) else None


@dataclass(frozen=True, slots=True)
class Owner:
    """Who holds a stored object: its region, and the scope of the request that made it."""

    region: str
    scope: str | None
    """None for an entry written before entries were bound to a scope: any scope may use it."""

    def encode(self) -> str:
        # A scope is "pub" or a hex digest behind one letter: it never holds a newline, and
        # the region after it may hold anything.
        return self.region if self.scope is None else f"{self.scope}\n{self.region}"

    @classmethod
    def decode(cls, value: bytes | str) -> Owner:
        text = value.decode() if isinstance(value, bytes) else value
        scope, sep, region = text.partition("\n")
        return cls(region, scope) if sep else cls(text, None)


class Missing(enum.Enum):
    """Why a lookup gave no owner."""

    UNKNOWN = "unknown"
    """Nobody knows the id: Redis answered that it holds no entry (without Redis, this
    process made no such object). The API's 404."""
    FAILED = "failed"
    """The lookup could not be made: Redis down or slow, or no connection free in time. The
    object may exist: 503, retryable."""


class Owners:
    """The owners of stored objects: this process's memory, and Redis when configured."""

    def __init__(
        self, config: StatefulConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.enabled = config.enabled
        self.clock = clock
        self._memory: OrderedDict[str, tuple[Owner, float]] = OrderedDict()
        self.redis: RedisClient | None = None
        # Entries Redis has not taken yet, oldest first (id -> encoded owner), drained by
        # one task; and the futures of the callers waiting for theirs.
        self._pending: OrderedDict[str, str] = OrderedDict()
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._writer: asyncio.Task[None] | None = None
        # Redis calls other than the writer's: one slot fewer than the pool, which the
        # writer keeps, so that lookups never starve the writes other PoPs wait on.
        self._slots = asyncio.Semaphore(max(1, config.redis_max_connections - 1))
        self._failures = 0
        self._down_until = 0.0
        self.remembered_total = 0
        self.redis_errors_total = 0
        self.unknown_total = 0
        self.unavailable_total = 0
        self.lookup_failed_total = 0
        self.other_scope_total = 0
        self.write_retries_total = 0
        self.writes_dropped_total = 0

    async def open(self) -> None:
        """Connect to Redis when configured; an unreachable one only means memory alone."""
        config = self.config
        if not self.enabled or not config.redis_url:
            return
        timeout = config.redis_timeout
        # A blocking pool: past redis_max_connections a call waits for a free connection
        # (our slots keep it from ever being full) instead of failing at once.
        self.redis = make_client(
            config.redis_settings(),
            connect_timeout=timeout,
            socket_timeout=timeout,
            max_connections=config.redis_max_connections,
            pool_timeout=config.redis_pool_timeout,
        )
        self._writer = asyncio.get_running_loop().create_task(self._write_queue())

    async def close(self) -> None:
        """Give the queued writes a last, bounded chance, then let go of Redis."""
        writer, self._writer = self._writer, None
        if writer is not None:
            if self._pending:
                try:
                    async with asyncio.timeout(self.config.redis_timeout + _CLOSE_WAIT):
                        await self._drained.wait()
                except TimeoutError:
                    logger.warning(
                        "stateful: %d owners made here were never written to Redis; other "
                        "PoPs will not find them",
                        len(self._pending),
                    )
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        for waiter in self._waiters.values():
            _settle(waiter)
        self._waiters.clear()
        if self.redis is not None:
            await self.redis.aclose()
            self.redis = None

    def allows(self, owner: Owner, scope: str) -> bool:
        """Whether a request of ``scope`` may use the object ``owner`` holds."""
        return not self.config.tenant_binding or owner.scope is None or owner.scope == scope

    async def lookup(self, ids: Iterable[str]) -> dict[str, Owner | Missing]:
        """The owner of each of ``ids`` (each once), or why none is known."""
        now = self.clock()
        found: dict[str, Owner | Missing] = {}
        asked: list[str] = []
        for object_id in ids:
            if object_id in found:
                continue
            known = self._known(object_id, now)
            if known is not None:
                found[object_id] = known
            else:
                found[object_id] = Missing.UNKNOWN
                asked.append(object_id)
        if not asked or self.redis is None:
            return found
        if now < self._down_until:
            for object_id in asked:
                found[object_id] = Missing.FAILED
            return found
        prefix = self.config.redis_prefix
        for start in range(0, len(asked), _BATCH):
            batch = asked[start : start + _BATCH]
            values = await self._read([prefix + object_id for object_id in batch])
            if values is None:
                for object_id in asked[start:]:
                    found[object_id] = Missing.FAILED
                break
            for object_id, value in zip(batch, values, strict=True):
                if value is not None:
                    owner = Owner.decode(value)
                    found[object_id] = owner
                    self._keep(object_id, owner, now)
        return found

    async def owner(self, object_id: str) -> Owner | Missing:
        """The owner of ``object_id``, or why none is known."""
        return (await self.lookup((object_id,)))[object_id]

    def remember(self, object_id: str, region: str, scope: str) -> asyncio.Future[None] | None:
        """``region`` made ``object_id`` for a request of ``scope``: remembered here now,
        and queued for Redis. The future returned is done once Redis has it, or after
        ``redis_timeout`` (None without Redis, or while it is known down): a caller about to
        hand the id to the client waits for it, so that a follow-up through another PoP
        finds it. The entry stays queued and retried until Redis takes it."""
        self.remembered_total += 1
        owner = Owner(region, scope)
        self._keep(object_id, owner, self.clock())
        if self.redis is None:
            return None
        pending = self._pending
        pending.pop(object_id, None)
        pending[object_id] = owner.encode()
        if len(pending) > self.config.write_queue:
            dropped, _ = pending.popitem(last=False)
            self._release(dropped)
            self.writes_dropped_total += 1
            if self.writes_dropped_total == 1 or not self.writes_dropped_total % 1000:
                logger.warning(
                    "stateful: the Redis write queue is full (write_queue = %d): %d owners "
                    "dropped so far, known only to this process",
                    self.config.write_queue,
                    self.writes_dropped_total,
                )
        self._drained.clear()
        self._wake.set()
        if self.clock() < self._down_until:
            return None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._release(object_id)
        self._waiters[object_id] = waiter
        loop.call_later(self.config.redis_timeout, _settle, waiter)
        return waiter

    def _known(self, object_id: str, now: float) -> Owner | None:
        known = self._memory.get(object_id)
        if known is not None:
            if known[1] > now:
                return known[0]
            del self._memory[object_id]
        # Made here and not in Redis yet, though memory may have let go of it.
        value = self._pending.get(object_id)
        return Owner.decode(value) if value is not None else None

    def _keep(self, object_id: str, owner: Owner, now: float) -> None:
        memory = self._memory
        memory.pop(object_id, None)
        memory[object_id] = (owner, now + self.config.ttl)
        if len(memory) > self.config.memory_entries:
            memory.popitem(last=False)

    def _release(self, object_id: str) -> None:
        waiter = self._waiters.pop(object_id, None)
        if waiter is not None:
            _settle(waiter)

    async def _read(self, keys: list[str]) -> list[Any] | None:
        """The values of ``keys`` in one round trip; None when Redis could not answer."""
        assert self.redis is not None
        config = self.config
        try:
            async with asyncio.timeout(config.redis_pool_timeout):
                await self._slots.acquire()
        except TimeoutError:
            # Every slot busy: this process is congested, Redis did not fail.
            self.lookup_failed_total += 1
            return None
        try:
            async with asyncio.timeout(config.redis_timeout):
                if len(keys) == 1:
                    return [await self.redis.get(keys[0])]
                pipe = self.redis.pipeline(transaction=False)
                for key in keys:
                    pipe.get(key)
                values: list[Any] = await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - Redis down or slow: the lookup failed
            self.lookup_failed_total += 1
            self._redis_failed("read", exc)
            return None
        else:
            self._answered()
            return values
        finally:
            self._slots.release()

    async def _write_queue(self) -> None:
        """Drain the queue into Redis, oldest first, retrying until Redis takes each batch."""
        delay = _RETRY_FIRST
        pending = self._pending
        while True:
            await self._wake.wait()
            batch = list(itertools.islice(pending.items(), _BATCH))
            if batch and not await self._write(batch):
                self.write_retries_total += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)
                continue
            delay = _RETRY_FIRST
            for object_id, value in batch:
                # Unless it was remembered anew (or dropped) while the batch was out.
                if pending.get(object_id) == value:
                    del pending[object_id]
                    self._release(object_id)
            if not pending:
                self._wake.clear()
                self._drained.set()

    async def _write(self, batch: list[tuple[str, str]]) -> bool:
        assert self.redis is not None
        config = self.config
        prefix, ttl = config.redis_prefix, int(config.ttl)
        try:
            async with asyncio.timeout(config.redis_timeout):
                pipe = self.redis.pipeline(transaction=False)
                for object_id, value in batch:
                    pipe.set(prefix + object_id, value, ex=ttl)
                await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - kept queued, and tried again
            self._redis_failed("write", exc)
            return False
        self._answered()
        return True

    def _answered(self) -> None:
        self._failures = 0
        self._down_until = 0.0

    def _redis_failed(self, what: str, exc: BaseException) -> None:
        self.redis_errors_total += 1
        self._failures += 1
        if self._failures >= _FAILURES_TO_TRIP:
            self._down_until = self.clock() + _DOWN_FOR
        logger.warning("stateful: Redis %s of owners failed: %r", what, exc)

    def snapshot(self) -> dict[str, Any]:
        """For ``/status``."""
        return {
            "enabled": self.enabled,
            "shared": self.redis is not None,
            "known": len(self._memory),
            "pending_writes": len(self._pending),
            "remembered_total": self.remembered_total,
            "unknown_total": self.unknown_total,
            "unavailable_total": self.unavailable_total,
            "lookup_failed_total": self.lookup_failed_total,
            "other_scope_total": self.other_scope_total,
            "redis_errors_total": self.redis_errors_total,
            "write_retries_total": self.write_retries_total,
            "writes_dropped_total": self.writes_dropped_total,
        }


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
