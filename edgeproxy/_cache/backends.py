"""Where cached answers live: a bounded in-memory LRU, Redis, or both in two tiers.

Both tiers are aiocache caches. aiocache's ``SimpleMemoryCache`` is a plain
dict with one timer per key and no size limit, which an edge process cannot
afford (a burst of large answers would grow it without bound), so the memory
tier subclasses its backend with an ``OrderedDict`` bounded by entries and by
bytes, evicting the least recently used, with expiry checked on read instead of
a timer per key. The Redis tier is aiocache's ``RedisCache`` with a serializer
that keeps bytes as bytes (the default JSON serializer, and any serializer
whose ``encoding`` is set, would hand back decoded ``str``), on a client from
:func:`~edgeproxy._shared.redisclient.make_client`: a standalone Redis or a
Redis Cluster. Entries are single keys (GET, PSETEX, DEL), so on a cluster
they spread over every slot; a purge scans every master and unlinks slot by slot.

Every backend call fails open: errors, timeouts and garbage values are counted
and read as a miss, never raised to a request. Redis calls each get a short
timeout, and a circuit breaker stops calling Redis for a while after repeated
failures.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from aiocache.backends.memory import SimpleMemoryBackend
from aiocache.serializers import BaseSerializer, NullSerializer

from edgeproxy._cache.entry import BadEntry, Entry
from edgeproxy._core.config import CacheConfig
from edgeproxy._shared.redisclient import RedisClient, make_client, safe_url

__all__ = [
    "BytesSerializer",
    "CacheBackend",
    "CircuitBreaker",
    "LRUMemoryCache",
    "MemoryTier",
    "RedisTier",
    "TieredBackend",
    "make_backend",
]

logger = logging.getLogger("edgeproxy.cache")

T = TypeVar("T")

# Admin purges scan the whole keyspace: they get longer than a request's call.
_PURGE_TIMEOUT = 30.0
_SCAN_BATCH = 500


class CacheBackend(Protocol):
    """What the cache stage needs from a tier. No method raises on a backend fault."""

    name: str

    async def get(self, key: str) -> Entry | None: ...

    async def set(self, key: str, entry: Entry) -> bool: ...

    async def delete(self, key: str) -> int: ...

    async def purge(self, prefix: str) -> int: ...

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


# -- memory ------------------------------------------------------------------------


def _default_size(value: object) -> int:
    size = getattr(value, "size", None)
    if isinstance(size, int):
        return size
    if isinstance(value, bytes | str):
        return len(value)
    return sys.getsizeof(value)


class LRUMemoryCache(SimpleMemoryBackend):  # type: ignore[misc]  # aiocache is untyped
    """aiocache's memory backend, bounded by ``max_entries`` and ``max_bytes`` with LRU eviction.

    Values are kept as given (``NullSerializer``); ``sizeof`` weighs them
    (``value.size`` when it has one, ``len()`` for bytes). A value bigger than
    ``max_bytes`` is not stored. TTLs are checked when a key is read, and
    expired keys also leave through LRU eviction, so there is no timer per key.
    """

    NAME = "lru-memory"

    def __init__(
        self,
        *,
        max_entries: int,
        max_bytes: int,
        sizeof: Callable[[object], int] = _default_size,
        clock: Callable[[], float] = time.monotonic,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("serializer", NullSerializer())
        # No asyncio.wait_for around dict operations: it would cost a task per call.
        kwargs.setdefault("timeout", None)
        super().__init__(**kwargs)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._sizeof = sizeof
        self._clock = clock
        # key -> (value, size, deadline or None)
        self._lru: OrderedDict[str, tuple[object, int, float | None]] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> list[str]:
        return list(self._lru)

    def _lookup(self, key: str) -> tuple[object, int, float | None] | None:
        item = self._lru.get(key)
        if item is None:
            return None
        if item[2] is not None and item[2] <= self._clock():
            self._remove(key)
            return None
        return item

    def _remove(self, key: str) -> int:
        item = self._lru.pop(key, None)
        if item is None:
            return 0
        self.bytes -= item[1]
        return 1

    def get_now(self, key: str) -> Any:
        """``get`` without aiocache's wrappers, for the hot path (no I/O to wait for)."""
        item = self._lookup(key)
        if item is None:
            return None
        self._lru.move_to_end(key)
        return item[0]

    def set_now(self, key: str, value: object, ttl: float | None = None) -> bool:
        """``set`` without aiocache's wrappers; False when the value cannot fit."""
        return bool(self._store(key, value, ttl))

    async def _get(self, key: str, encoding: str | None = "utf-8", _conn: Any = None) -> Any:
        return self.get_now(key)

    async def _gets(self, key: str, encoding: str | None = "utf-8", _conn: Any = None) -> Any:
        return await self._get(key, encoding=encoding)

    async def _multi_get(
        self, keys: list[str], encoding: str | None = "utf-8", _conn: Any = None
    ) -> list[Any]:
        return [await self._get(key) for key in keys]

    async def _set(
        self,
        key: str,
        value: object,
        ttl: float | None = None,
        _cas_token: Any = None,
        _conn: Any = None,
    ) -> bool | int:
        if _cas_token is not None:
            current = self._lookup(key)
            if current is None or current[0] != _cas_token:
                return 0
        return self._store(key, value, ttl)

    def _store(self, key: str, value: object, ttl: float | None) -> bool:
        size = self._sizeof(value)
        self._remove(key)
        if size > self.max_bytes:
            return False
        deadline = self._clock() + ttl if ttl else None
        self._lru[key] = (value, size, deadline)
        self.bytes += size
        while len(self._lru) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, old_size, _) = self._lru.popitem(last=False)
            self.bytes -= old_size
            self.evictions += 1
        return True

    async def _add(
        self, key: str, value: object, ttl: float | None = None, _conn: Any = None
    ) -> bool:
        if self._lookup(key) is not None:
            raise ValueError(f"Key {key} already exists, use .set to update the value")
        return bool(await self._set(key, value, ttl=ttl))

    async def _exists(self, key: str, _conn: Any = None) -> bool:
        return self._lookup(key) is not None

    async def _increment(self, key: str, delta: int, _conn: Any = None) -> int:
        item = self._lookup(key)
        if item is None:
            value = delta
        else:
            try:
                value = int(item[0]) + delta  # type: ignore[call-overload]
            except (TypeError, ValueError):
                raise TypeError("Value is not an integer") from None
        ttl = None if item is None or item[2] is None else item[2] - self._clock()
        await self._set(key, value, ttl=ttl)
        return value

    async def _expire(self, key: str, ttl: float | None, _conn: Any = None) -> bool:
        item = self._lookup(key)
        if item is None:
            return False
        self._lru[key] = (item[0], item[1], self._clock() + ttl if ttl else None)
        return True

    async def _delete(self, key: str, _conn: Any = None) -> int:
        return self._remove(key)

    async def _clear(self, namespace: str | None = None, _conn: Any = None) -> bool:
        self.purge_prefix(namespace or "")
        return True

    async def _raw(self, command: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("raw commands are not supported by the LRU memory cache")

    async def _redlock_release(self, key: str, value: object) -> int:
        item = self._lookup(key)
        if item is not None and item[0] == value:
            return self._remove(key)
        return 0

    def purge_prefix(self, prefix: str) -> int:
        """Drop every key starting with ``prefix`` (all keys for ``""``); returns how many."""
        if not prefix:
            count = len(self._lru)
            self._lru.clear()
            self.bytes = 0
            return count
        doomed = [k for k in self._lru if k.startswith(prefix)]
        for key in doomed:
            self._remove(key)
        return len(doomed)


class MemoryTier:
    """This process's cache: :class:`LRUMemoryCache` holding :class:`Entry` objects as they are.

    Reads and writes use the LRU's direct accessors rather than aiocache's public
    ``get``/``set``: those wrap every call in three decorator coroutines, an
    ``os.getenv`` (``AIOCACHE_DISABLE``), a plugin loop and debug logging, which
    is a measurable share of a cache hit when there is no I/O to wait for.
    """

    name = "memory"

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.cache = LRUMemoryCache(max_entries=max_entries, max_bytes=max_bytes)
        self.errors: Counter[str] = Counter()

    async def get(self, key: str) -> Entry | None:
        value = self.cache.get_now(key)
        return value if isinstance(value, Entry) else None

    async def set(self, key: str, entry: Entry) -> bool:
        ttl = entry.keep_until - time.time()
        if ttl <= 0:
            return False
        return self.cache.set_now(key, entry, ttl)

    async def delete(self, key: str) -> int:
        return int(await self.cache.delete(key))

    async def purge(self, prefix: str) -> int:
        return self.cache.purge_prefix(prefix)

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        self.cache.purge_prefix("")

    def status(self) -> dict[str, Any]:
        return {
            "entries": len(self.cache),
            "bytes": self.cache.bytes,
            "max_entries": self.cache.max_entries,
            "max_bytes": self.cache.max_bytes,
            "evictions": self.cache.evictions,
        }


# -- Redis -------------------------------------------------------------------------


class BytesSerializer(BaseSerializer):  # type: ignore[misc]  # aiocache is untyped
    """Values are bytes both ways. ``encoding = None`` makes aiocache's Redis backend
    hand back the raw bytes instead of decoding them to ``str``."""

    DEFAULT_ENCODING = None

    def dumps(self, value: bytes) -> bytes:
        return value

    def loads(self, value: bytes | None) -> bytes | None:
        return value


class CircuitBreaker:
    """Closed → open after ``failures`` consecutive failures → one probe after ``cooldown``.

    While open, callers skip the dependency altogether. A probe that succeeds
    closes the breaker; one that fails opens it for another ``cooldown``.
    """

    def __init__(
        self, failures: int, cooldown: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.threshold = failures
        self.cooldown = cooldown
        self._clock = clock
        self.state = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.opens_total = 0

    def allow(self) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open" and self._clock() >= self.opened_at + self.cooldown:
            self.state = "half_open"
            return True
        return False

    def success(self) -> None:
        if self.state != "closed":
            logger.warning("cache: Redis answers again; circuit breaker closed")
        self.state = "closed"
        self.failures = 0

    def failure(self) -> None:
        self.failures += 1
        if self.state == "half_open" or (
            self.state == "closed" and self.failures >= self.threshold
        ):
            if self.state == "closed":
                logger.warning(
                    "cache: %d Redis failures in a row; not calling Redis for %.1fs",
                    self.failures,
                    self.cooldown,
                )
            self.state = "open"
            self.opened_at = self._clock()
            self.opens_total += 1

    def abandon(self) -> None:
        """A call was cancelled (its request went away): neither success nor failure."""
        if self.state == "half_open":
            # Let the next call probe at once.
            self.state = "open"
            self.opened_at = self._clock() - self.cooldown

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "failures": self.failures, "opens_total": self.opens_total}


def _redis_client(config: CacheConfig) -> RedisClient:
    """The cache's Redis client from ``[cache]``: URL, cluster, AUTH and TLS."""
    # A busy pool makes a call wait for a free connection (within the call's timeout)
    # instead of failing at once and counting against the breaker. No socket_timeout:
    # RedisTier bounds each whole call itself, and redis-py's per-read timeout costs
    # ~20 us of CPU per call.
    return make_client(
        config.redis_settings(),
        connect_timeout=config.redis_connect_timeout,
        max_connections=config.redis_max_connections,
        pool_timeout=config.redis_timeout,
    )


_FAILED: Any = object()


class RedisTier:
    """Redis through aiocache's ``RedisCache``: encoded entries under ``key_prefix``.

    Each call runs under ``redis_timeout`` and the circuit breaker; failures
    are counted by kind (``timeout``, ``error``, ``garbage``, ``breaker_open``)
    and read as a miss.
    """

    name = "redis"

    def __init__(self, config: CacheConfig) -> None:
        from aiocache import RedisCache

        self.config = config
        self.prefix = config.key_prefix
        self.timeout = config.redis_timeout
        prefix = self.prefix
        self.cache = RedisCache(
            serializer=BytesSerializer(),
            # Our own timeout below; aiocache's would add a wait_for task per call.
            timeout=None,
            key_builder=lambda key, namespace=None: prefix + key,
        )
        # aiocache builds a standalone client of its own (no connection yet): ours
        # replaces it, a cluster client when configured.
        self.client: RedisClient = _redis_client(config)
        self.cache.client = self.client
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown)
        self.errors: Counter[str] = Counter()
        self.last_error: str | None = None

    async def _call(
        self, what: str, call: Callable[[], Awaitable[T]], timeout: float | None = None
    ) -> T:
        """Run one Redis call under the timeout and breaker; ``_FAILED`` when it did not work."""
        if not self.breaker.allow():
            self.errors["breaker_open"] += 1
            return _FAILED  # type: ignore[no-any-return]
        try:
            async with asyncio.timeout(timeout or self.timeout):
                result = await call()
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        except Exception as exc:  # noqa: BLE001 - any Redis fault fails open
            kind = "timeout" if "Timeout" in type(exc).__name__ else "error"
            self.errors[kind] += 1
            self.last_error = f"{what}: {type(exc).__name__}: {exc}"
            if self.breaker.state == "closed" and self.breaker.failures == 0:
                logger.warning("cache: Redis %s failed (%s); serving from upstream", what, exc)
            self.breaker.failure()
            return _FAILED  # type: ignore[no-any-return]
        self.breaker.success()
        return result

    async def attempt(
        self, what: str, call: Callable[[], Awaitable[T]], timeout: float | None = None
    ) -> tuple[bool, T | None]:
        """Run one Redis call under the timeout and breaker, as :meth:`get` does:
        ``(True, result)``, or ``(False, None)`` when it did not work (counted, logged)."""
        result = await self._call(what, call, timeout)
        return (False, None) if result is _FAILED else (True, result)

    async def get(self, key: str) -> Entry | None:
        raw = await self._call("GET", lambda: self.cache.get(key))
        if raw is _FAILED or raw is None:
            return None
        try:
            return Entry.decode(raw)
        except BadEntry as exc:
            self.errors["garbage"] += 1
            self.last_error = f"GET {key}: not an entry ({exc})"
            return None

    async def set(self, key: str, entry: Entry) -> bool:
        ttl = entry.keep_until - time.time()
        if ttl <= 0:
            return False
        data = entry.encode()
        # A float TTL makes aiocache use PSETEX (milliseconds).
        ok = await self._call("SET", lambda: self.cache.set(key, data, ttl=float(ttl)))
        return ok is not _FAILED and bool(ok)

    async def delete(self, key: str) -> int:
        n = await self._call("DEL", lambda: self.cache.delete(key))
        return 0 if n is _FAILED else int(n)

    async def purge(self, prefix: str) -> int:
        """Delete every key under ``key_prefix + prefix`` with SCAN (never KEYS) and UNLINK.

        On a cluster, ``scan_iter`` walks every master, each with its own cursor,
        and ``unlink`` splits a batch by slot.
        """
        client = self.client
        pattern = _glob_escape(self.prefix + prefix) + "*"
        deleted = 0
        async with asyncio.timeout(_PURGE_TIMEOUT):
            batch: list[bytes] = []
            async for name in client.scan_iter(match=pattern, count=_SCAN_BATCH):
                batch.append(name)
                if len(batch) >= _SCAN_BATCH:
                    deleted += await client.unlink(*batch)
                    batch = []
            if batch:
                deleted += await client.unlink(*batch)
        return deleted

    async def ping(self) -> bool:
        # Opens the first connection (TLS and AUTH included): it gets the connect timeout too.
        timeout = self.config.redis_connect_timeout + self.timeout
        ok = await self._call("PING", lambda: self.client.ping(), timeout)
        return ok is not _FAILED

    async def open(self) -> None:
        if not await self.ping():
            logger.warning(
                "cache: Redis at %s is not reachable (%s); the cache fails open until it is",
                safe_url(self.config.redis_url),
                self.last_error,
            )

    async def close(self) -> None:
        # redis-py's close() is deprecated (aiocache 0.12 still calls it): aclose().
        await self.client.aclose()

    def status(self) -> dict[str, Any]:
        return {
            "url": safe_url(self.config.redis_url),
            "cluster": self.config.redis_cluster,
            "key_prefix": self.prefix,
            "breaker": self.breaker.status(),
            "errors": dict(self.errors),
            "last_error": self.last_error,
        }


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


# -- two tiers ---------------------------------------------------------------------


class TieredBackend:
    """Memory first, then Redis; a Redis hit fills the memory tier for the rest of its life."""

    name = "tiered"

    def __init__(self, memory: MemoryTier, redis: RedisTier) -> None:
        self.memory = memory
        self.redis = redis

    async def get(self, key: str) -> Entry | None:
        entry = await self.memory.get(key)
        if entry is not None:
            return entry
        entry = await self.redis.get(key)
        if entry is not None:
            await self.memory.set(key, entry)
        return entry

    async def set(self, key: str, entry: Entry) -> bool:
        stored = await self.memory.set(key, entry)
        return await self.redis.set(key, entry) or stored

    async def delete(self, key: str) -> int:
        return max(await self.memory.delete(key), await self.redis.delete(key))

    async def purge(self, prefix: str) -> int:
        return max(await self.memory.purge(prefix), await self.redis.purge(prefix))

    async def open(self) -> None:
        await self.redis.open()

    async def close(self) -> None:
        await self.memory.close()
        await self.redis.close()

    def status(self) -> dict[str, Any]:
        return {"memory": self.memory.status(), "redis": self.redis.status()}


def make_backend(config: CacheConfig) -> MemoryTier | RedisTier | TieredBackend:
    """The backend ``[cache] backend`` names."""
    if config.backend == "redis":
        return RedisTier(config)
    memory = MemoryTier(config.max_entries, config.max_bytes)
    if config.backend == "tiered":
        return TieredBackend(memory, RedisTier(config))
    return memory
