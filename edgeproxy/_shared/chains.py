"""Responses chains held at the edge: each stored response of a chain, as its region
returned it, with the input it answered, shared by every PoP through Redis.

A turn is one stored response: its id, the scope that made it, its parent
(``previous_response_id``), the ids of every turn before it (so that a chain is read in
one round trip), the request's own input items and the response object. A chain is
whole when every turn before the asked one is held; only a whole chain is used.

With Redis set, chains live there, each turn for ``[stateful] edge_retention``; while
Redis is down nothing new is held (and ``/status`` says so): chains go on at their owner
alone. Without Redis, each process holds chains in its memory, within
``edge_memory_bytes`` (the oldest turns forgotten first).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import orjson

from edgeproxy._core.config import StatefulConfig
from edgeproxy._shared.redisclient import RedisClient, make_client

__all__ = ["ChainStore", "Held", "Turn"]

logger = logging.getLogger("edgeproxy.stateful")

# Seconds Redis is left alone after it failed, before the next write tries it again.
_RETRY = 5.0


class Turn(NamedTuple):
    """One stored response of a chain, as the edge holds it."""

    id: str
    scope: str
    parent: str | None
    ancestors: tuple[str, ...]
    """The turns before it, oldest first."""
    chain_bytes: int
    """Bytes of this turn and every one before it."""
    input: list[Any]
    """The request's own input items (not those of the turns before it)."""
    response: dict[str, Any]
    """The stored response, as its region returned it."""

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "v": 1,
                "id": self.id,
                "scope": self.scope,
                "parent": self.parent,
                "ancestors": self.ancestors,
                "bytes": self.chain_bytes,
                "input": self.input,
                "response": self.response,
            }
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> Turn | None:
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("v") != 1:
            return None
        try:
            return cls(
                str(value["id"]),
                str(value["scope"]),
                value["parent"],
                tuple(value["ancestors"]),
                int(value["bytes"]),
                list(value["input"]),
                dict(value["response"]),
            )
        except (KeyError, TypeError, ValueError):
            return None


# Conversations' keys: <edge_prefix>conv:<id> (a response's: <edge_prefix><id>).
_CONVERSATION = "conv:"


class Held(NamedTuple):
    """A conversation the edge holds: its items, in order, as the regions returned them."""

    id: str
    scope: str
    items: list[Any]
    taken: bool
    """The edge took it on (its owner could not go on): from then on the edge alone holds
    it whole, and every request of it is sent with its items."""
    size: int
    created_at: int

    def encode(self) -> bytes:
        return orjson.dumps({"v": 1, **self._asdict()})

    @classmethod
    def decode(cls, raw: bytes | str) -> Held | None:
        try:
            value = orjson.loads(raw)
            return cls(
                str(value["id"]),
                str(value["scope"]),
                list(value["items"]),
                bool(value["taken"]),
                int(value["size"]),
                int(value["created_at"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None


class ChainStore:
    """The turns of the chains the edge holds (see the module's docstring)."""

    def __init__(
        self, config: StatefulConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self.redis: RedisClient | None = None
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._memory_bytes = 0
        self._down_until = 0.0
        self.held_total = 0
        self.held_bytes_total = 0
        self.largest_chain_bytes = 0
        self.not_held: dict[str, int] = {"redis_down": 0, "too_long": 0, "too_many_turns": 0}
        self.read_failed_total = 0
        self.deleted_total = 0

    @property
    def shared(self) -> bool:
        return bool(self.config.redis_url)

    @property
    def up(self) -> bool:
        """Whether new turns are held now (Redis answering, or memory alone)."""
        return self.redis is None or self.clock() >= self._down_until

    async def open(self) -> None:
        config = self.config
        if config.redis_url:
            self.redis = make_client(
                config.redis_settings(),
                connect_timeout=config.redis_timeout,
                socket_timeout=config.redis_timeout,
                max_connections=8,
                pool_timeout=config.redis_pool_timeout,
            )

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()
            self.redis = None

    def _failed(self, what: str, exc: BaseException) -> None:
        if self.clock() >= self._down_until:
            logger.warning(
                "stateful: Redis failed to %s a chain (%s); the edge holds no new turn for "
                "%.0fs, chains go on at their owners",
                what,
                exc,
                _RETRY,
            )
        self._down_until = self.clock() + _RETRY

    # -- writes ---------------------------------------------------------------------

    def turn(
        self,
        response_id: str,
        scope: str,
        parent: Turn | None,
        own_input: list[Any],
        response: dict[str, Any],
    ) -> Turn | None:
        """The turn a stored response makes after ``parent`` (None: the chain's first), or
        None when it is past the chain's bounds."""
        size = len(orjson.dumps(own_input)) + len(orjson.dumps(response))
        ancestors = () if parent is None else (*parent.ancestors, parent.id)
        total = size + (parent.chain_bytes if parent is not None else 0)
        if total > self.config.edge_max_chain_bytes:
            self.not_held["too_long"] += 1
            return None
        if len(ancestors) + 1 > self.config.edge_max_turns:
            self.not_held["too_many_turns"] += 1
            return None
        return Turn(
            response_id, scope, parent.id if parent else None, ancestors, total, own_input, response
        )

    async def put(self, turn: Turn) -> bool:
        """Hold ``turn``; False when it is not held (Redis down or failing)."""
        raw = turn.encode()
        if not await self._write(self.config.edge_prefix + turn.id, raw):
            return False
        self.largest_chain_bytes = max(self.largest_chain_bytes, turn.chain_bytes)
        return True

    async def _write(self, key: str, raw: bytes) -> bool:
        if self.redis is None:
            self._keep(key, raw)
        else:
            if not self.up:
                self.not_held["redis_down"] += 1
                return False
            try:
                async with asyncio.timeout(self.config.redis_timeout):
                    await self.redis.set(key, raw, ex=int(self.config.edge_retention))
            except Exception as exc:  # noqa: BLE001 - Redis down or slow: not held
                self._failed("write", exc)
                self.not_held["redis_down"] += 1
                return False
        self.held_total += 1
        self.held_bytes_total += len(raw)
        return True

    def _keep(self, key: str, raw: bytes) -> None:
        memory = self._memory
        old = memory.pop(key, None)
        if old is not None:
            self._memory_bytes -= len(old)
        memory[key] = raw
        self._memory_bytes += len(raw)
        while self._memory_bytes > self.config.edge_memory_bytes and memory:
            _, dropped = memory.popitem(last=False)
            self._memory_bytes -= len(dropped)

    async def delete(self, object_id: str, *, conversation: bool = False) -> None:
        """Forget a held response, or a held conversation."""
        key = self.config.edge_prefix + (_CONVERSATION if conversation else "") + object_id
        if self.redis is None:
            raw = self._memory.pop(key, None)
            if raw is not None:
                self._memory_bytes -= len(raw)
                self.deleted_total += 1
            return
        try:
            async with asyncio.timeout(self.config.redis_timeout):
                if await self.redis.delete(key):
                    self.deleted_total += 1
        except Exception as exc:  # noqa: BLE001 - the copy expires with its retention
            self._failed("delete", exc)

    # -- reads ----------------------------------------------------------------------

    async def _get(self, ids: list[str]) -> list[bytes | str | None] | None:
        prefix = self.config.edge_prefix
        if self.redis is None:
            return [self._memory.get(prefix + i) for i in ids]
        try:
            async with asyncio.timeout(self.config.redis_timeout):
                values: list[bytes | str | None] = await self.redis.mget([prefix + i for i in ids])
        except Exception as exc:  # noqa: BLE001 - Redis down or slow: nothing read
            self.read_failed_total += 1
            self._failed("read", exc)
            return None
        return values

    async def get(self, response_id: str) -> Turn | None:
        """The turn of ``response_id``, when held."""
        values = await self._get([response_id])
        if not values or values[0] is None:
            return None
        return Turn.decode(values[0])

    async def chain(self, response_id: str) -> list[Turn] | None:
        """The whole chain up to ``response_id``, its first turn first; None when it is not
        held whole."""
        last = await self.get(response_id)
        if last is None:
            return None
        if not last.ancestors:
            return [last]
        values = await self._get(list(last.ancestors))
        if values is None or any(v is None for v in values):
            return None
        turns = [Turn.decode(v) for v in values if v is not None]
        if any(t is None for t in turns):
            return None
        return [t for t in turns if t is not None] + [last]

    # -- conversations --------------------------------------------------------------

    def conversation_of(
        self, conversation_id: str, scope: str, items: list[Any], held: Held | None = None
    ) -> Held | None:
        """``held`` (a new conversation when None) with ``items`` added, or None when it is
        past the chain's bounds."""
        size = len(orjson.dumps(items)) + (held.size if held is not None else 0)
        if size > self.config.edge_max_chain_bytes:
            self.not_held["too_long"] += 1
            return None
        if held is None:
            return Held(conversation_id, scope, list(items), False, size, int(time.time()))
        return held._replace(items=[*held.items, *items], size=size)

    async def put_conversation(self, held: Held) -> bool:
        if not await self._write(self.config.edge_prefix + _CONVERSATION + held.id, held.encode()):
            return False
        self.largest_chain_bytes = max(self.largest_chain_bytes, held.size)
        return True

    async def conversation(self, conversation_id: str) -> Held | None:
        values = await self._get([_CONVERSATION + conversation_id])
        if not values or values[0] is None:
            return None
        return Held.decode(values[0])

    def snapshot(self) -> dict[str, Any]:
        return {
            "shared": self.shared,
            "holding": self.up,
            "held_total": self.held_total,
            "held_bytes_total": self.held_bytes_total,
            "largest_chain_bytes": self.largest_chain_bytes,
            "memory_bytes": self._memory_bytes,
            "not_held": dict(self.not_held),
            "read_failed_total": self.read_failed_total,
            "deleted_total": self.deleted_total,
        }
