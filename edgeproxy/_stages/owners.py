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

The map lives in each process's memory, and in Redis when ``[stateful]`` has one, so that
every PoP and worker sharing that Redis knows every owner: a map from id to region, rather
than the region written into the ids the client sees, because ids are opaque to the
clients and to the SDKs that check them, objects quote each other's ids (a batch its input
file, a vector store its files), and nothing of a region's name or address should reach a
client. The Redis write of a JSON answer's id is waited for (at most ``redis_timeout``)
before the answer goes out, as a client may send its follow-up through another PoP at
once; a stream's goes out at ``response.created`` and has the whole answer's time to land.
A read that Redis does not answer within ``redis_timeout`` is answered from memory. With
Redis down, a process knows the owners of the objects made through it.

A request whose object no process knows gets the API's own 404; one whose owner is
unavailable gets 503 with ``Retry-After`` (never another region, which would answer 404).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects import Dialect, dialect_named
from edgeproxy._protocol.endpoints import dialect_for
from edgeproxy._protocol.objects import object_path
from edgeproxy._protocol.sse import SSEEventTooLarge, SSEReader
from edgeproxy._stages.redisclient import RedisClient, make_client

if TYPE_CHECKING:
    from edgeproxy._core.config import StatefulConfig
    from edgeproxy._core.context import RequestContext

__all__ = [
    "Owners",
    "StateRef",
    "StatefulRequest",
    "created_id",
    "owner_unavailable",
    "stateful_request",
]

logger = logging.getLogger("edgeproxy")

# Seconds nothing waits on a Redis that just failed (writes still go out, unwaited).
_DOWN_FOR = 5.0


def owner_unavailable(retry_after: int) -> ProxyError:
    """The 503 of a request whose owner region cannot answer now: no other region may, as
    it would answer 404. No address or region detail reaches the client."""
    return ProxyError(
        503,
        "service_unavailable",
        "the region holding this request's state is unavailable; retry later",
        code="owner_unavailable",
        headers={"Retry-After": str(retry_after)},
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
    API reads them, whether its answer creates one, and the dialect that reads its id."""

    __slots__ = ("refs", "creates", "dialect")

    def __init__(self, refs: list[StateRef], creates: bool, dialect: Dialect) -> None:
        self.refs = refs
        self.creates = creates
        self.dialect = dialect


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
    return StatefulRequest(refs, creates, dialect)


def _field_missing(
    not_found: Callable[[str, str], ProxyError], field: str
) -> Callable[[str], ProxyError]:
    return lambda object_id: not_found(field, object_id)


def created_id(dialect: Dialect, first: bytes, sse: bool) -> str | None:
    """The id of the object a region made, as ``dialect`` reads it: from its JSON answer
    (held whole, or its beginning), or from the events its stream opens with."""
    if sse:
        try:
            events = SSEReader().feed(first)
        except SSEEventTooLarge:
            return None
        for event in events:
            object_id = dialect.created_in(event)
            if object_id is not None:
                return object_id
        return None
    try:
        answer = orjson.loads(first)
    except orjson.JSONDecodeError:
        return None
    return dialect.created_id(answer) if isinstance(answer, dict) else None


class Owners:
    """The owners of stored objects: this process's memory, and Redis when configured."""

    def __init__(
        self, config: StatefulConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.enabled = config.enabled
        self.clock = clock
        self._memory: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.redis: RedisClient | None = None
        # Background writes, kept until done (asyncio holds only weak references).
        self._writes: set[asyncio.Task[None]] = set()
        # After a Redis failure, nothing waits on it for a while: a Redis that does not
        # answer must not add redis_timeout to every stateful request.
        self._down_until = 0.0
        self.remembered_total = 0
        self.redis_errors_total = 0
        self.unknown_total = 0
        self.unavailable_total = 0

    async def open(self) -> None:
        """Connect to Redis when configured; an unreachable one only means memory alone."""
        config = self.config
        if not self.enabled or not config.redis_url:
            return
        timeout = config.redis_timeout
        self.redis = make_client(
            config.redis_settings(), connect_timeout=timeout, socket_timeout=timeout
        )

    async def close(self) -> None:
        writes = list(self._writes)
        if writes:
            await asyncio.wait(writes, timeout=self.config.redis_timeout)
        for task in writes:
            task.cancel()
        await asyncio.gather(*writes, return_exceptions=True)
        self._writes.clear()
        if self.redis is not None:
            await self.redis.aclose()
            self.redis = None

    async def owner(self, object_id: str) -> str | None:
        """The region holding ``object_id``, or None when no process knows it."""
        known = self._memory.get(object_id)
        now = self.clock()
        if known is not None:
            if known[1] > now:
                return known[0]
            del self._memory[object_id]
        if self.redis is None or now < self._down_until:
            return None
        try:
            async with asyncio.timeout(self.config.redis_timeout):
                value = await self.redis.get(self.config.redis_prefix + object_id)
        except Exception as exc:  # noqa: BLE001 - Redis down or slow: memory alone
            self._redis_failed("read", exc)
            return None
        if value is None:
            return None
        region = value.decode() if isinstance(value, bytes) else str(value)
        self._keep(object_id, region, now)
        return region

    def remember(self, object_id: str, region: str) -> asyncio.Task[None] | None:
        """``region`` made ``object_id``: remembered here now, and in Redis by the task
        returned (kept here too; None without Redis). A caller about to hand the id to
        the client waits for it, so that a follow-up through another PoP finds it."""
        self.remembered_total += 1
        self._keep(object_id, region, self.clock())
        if self.redis is None:
            return None
        task = asyncio.get_running_loop().create_task(self._write(object_id, region))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task if self.clock() >= self._down_until else None

    def _keep(self, object_id: str, region: str, now: float) -> None:
        memory = self._memory
        memory.pop(object_id, None)
        memory[object_id] = (region, now + self.config.ttl)
        if len(memory) > self.config.memory_entries:
            memory.popitem(last=False)

    async def _write(self, object_id: str, region: str) -> None:
        assert self.redis is not None
        try:
            async with asyncio.timeout(self.config.redis_timeout):
                await self.redis.set(
                    self.config.redis_prefix + object_id, region, ex=int(self.config.ttl)
                )
        except Exception as exc:  # noqa: BLE001 - another PoP may then not know it
            self._redis_failed("write", exc)

    def _redis_failed(self, what: str, exc: BaseException) -> None:
        self.redis_errors_total += 1
        self._down_until = self.clock() + _DOWN_FOR
        logger.warning("stateful: Redis %s of an owner failed: %r", what, exc)

    def snapshot(self) -> dict[str, Any]:
        """For ``/status``."""
        return {
            "enabled": self.enabled,
            "shared": self.redis is not None,
            "known": len(self._memory),
            "remembered_total": self.remembered_total,
            "unknown_total": self.unknown_total,
            "unavailable_total": self.unavailable_total,
            "redis_errors_total": self.redis_errors_total,
        }
