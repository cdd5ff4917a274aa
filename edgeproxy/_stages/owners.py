"""Which region holds each stored object: stateful requests go to their state.

A Responses API response stored by a region (``store`` not false) exists in that region
only: OpenAI, Azure OpenAI and vLLM's response store all keep it where it was made. A
follow-up elsewhere gets 404 ``previous_response_not_found``. So the region that answers
a request creating such an object is remembered as its **owner** (:meth:`Owners.remember`),
and a request that refers to one (:func:`state_ref`: ``previous_response_id`` in the body,
``/v1/responses/{id}`` and what is under it) is routed to the owner alone.

The map lives in each process's memory, and in Redis when ``[stateful]`` has one, so that
every PoP and worker sharing that Redis knows every owner: a map from id to region, rather
than the region written into the ids the client sees, because ids are opaque to the
clients and to the SDKs that check them, and nothing of a region's name or address should
reach a client. The Redis write of a JSON answer's id is waited for (at most
``redis_timeout``) before the answer goes out, as a client may send its follow-up through
another PoP at once; a stream's goes out at ``response.created`` and has the whole answer's
time to land. A read that Redis does not answer within ``redis_timeout`` is answered from
memory. With Redis down, a process knows the owners of the objects made through it.

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
from edgeproxy._stages.redisclient import RedisClient, make_client

if TYPE_CHECKING:
    from edgeproxy._core.config import StatefulConfig
    from edgeproxy._core.context import RequestContext

__all__ = [
    "RESPONSES_PATH",
    "Owners",
    "StateRef",
    "created_id",
    "creates_state",
    "owner_unavailable",
    "state_ref",
]

logger = logging.getLogger("edgeproxy")

RESPONSES_PATH = "/v1/responses"
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
    """A request's reference to a stored object: its id, and where the reference is."""

    __slots__ = ("id", "param")

    def __init__(self, object_id: str, param: str | None) -> None:
        self.id = object_id
        self.param = param  # the body field that names it; None: the path does

    def not_found(self) -> ProxyError:
        """The API's own 404 for an object no region is known to hold."""
        if self.param == "previous_response_id":
            return ProxyError(
                404,
                "invalid_request_error",
                f"Previous response with id '{self.id}' not found.",
                code="previous_response_not_found",
                param=self.param,
            )
        return ProxyError(
            404,
            "invalid_request_error",
            f"Response with id '{self.id}' not found.",
            code="response_not_found",
        )


def state_ref(ctx: RequestContext) -> StateRef | None:
    """The stored object ``ctx`` refers to, or None (most requests)."""
    path = ctx.path
    if RESPONSES_PATH not in path:
        return None
    head, _, rest = path.partition(RESPONSES_PATH)
    if rest.startswith("/"):
        # GET/DELETE /v1/responses/{id}, .../input_items, POST .../cancel
        object_id = rest[1:].split("/", 1)[0]
        return StateRef(object_id, None) if object_id else None
    if rest or ctx.method != "POST":
        return None
    body = ctx.json
    if isinstance(body, dict):
        previous = body.get("previous_response_id")
        if isinstance(previous, str) and previous:
            return StateRef(previous, "previous_response_id")
    return None


def creates_state(ctx: RequestContext) -> bool:
    """Whether ``ctx`` asks a region to store what it answers (a Responses request with
    ``store`` not false)."""
    if ctx.method != "POST" or not ctx.path.endswith(RESPONSES_PATH):
        return False
    body = ctx.json
    return isinstance(body, dict) and body.get("store") is not False


def created_id(first: bytes, sse: bool) -> str | None:
    """The id of the response a region made, from its JSON answer or from the first event
    of its stream (``response.created``)."""
    if sse:
        for line in first.split(b"\n"):
            if line.startswith(b"data:") and b'"response.created"' in line:
                first = line[5:]
                break
        else:
            return None
    try:
        answer = orjson.loads(first)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(answer, dict):
        return None
    inner = answer.get("response") if sse else answer
    object_id = inner.get("id") if isinstance(inner, dict) else None
    return object_id if isinstance(object_id, str) and object_id else None


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
