"""The semantic cache's entries in Redis: every worker and PoP searches what any stored.

Beside each cached answer (``<prefix><key>``) whose question joined a semantic index, a
hash ``<prefix><key>~q`` holds that question: its scope, its text, its vector and the
embedder that made it, with the answer's own lifetime. So an admin purge of a key prefix
or of a tenant takes the questions with the answers, and a question never outlives its
answer by more than the purge of a single key (which deletes both).

A log, the sorted set ``<prefix>~semantic-log`` (entry keys by the time they were
stored, capped), lets a worker that starts warm its index with the newest questions, and
a running worker pick up, every ``semantic_sync_interval``, what others stored since.
Questions embedded by another embedder are skipped: their vectors mean nothing here.

Where the server has vector search (Redis 8, or the search module) and is not a cluster,
found once at start with ``FT._LIST``, the questions are indexed there too
(``FT.CREATE`` on the hashes, HNSW, cosine), and a lookup asks Redis for the nearest
questions of its scope: nothing to poll, nothing to hold in each worker. A search that
fails falls back to the worker's own index, which always holds what the worker stored.

Every call goes through the Redis tier's timeout and circuit breaker and fails open: with
Redis down there is no shared state, and each worker serves from what it knows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Final

from redis.exceptions import ResponseError

from edgeproxy._cache.backends import RedisTier
from edgeproxy._cache.keys import hash_key

__all__ = ["SharedQuestion", "SharedQuestions"]

logger = logging.getLogger("edgeproxy.cache")

LOG_KEY: Final = "~semantic-log"
RECORD_SUFFIX: Final = "~q"
_BATCH: Final = 256
# Entries stored by hosts whose clocks run a little behind are still picked up.
_CLOCK_SLACK: Final = 5.0
_FIELDS: Final = ("k", "c", "q", "v", "e")

# (entry key, scope, question, vector)
SharedQuestion = tuple[str, str, str, Any]


def _float32(vector: Any) -> Any:
    # numpy only where the semantic cache runs (it embedded the vector with numpy).
    import numpy as np

    return np.asarray(vector, dtype=np.float32)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SharedQuestions:
    """The questions of one Redis tier, for one embedder."""

    def __init__(
        self,
        tier: RedisTier,
        embedder: str,
        *,
        max_entries: int,
        interval: float,
        redis_search: bool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.tier = tier
        self.prefix = tier.prefix
        # Scopes and embedder names are search tags as hex digests: no escaping needed.
        self.embedder_tag = hash_key(embedder)
        self.max_entries = max_entries
        self.interval = interval
        self.want_search = redis_search and not tier.config.redis_cluster
        self.clock = clock
        self.search_index: str | None = None
        self.detected = False
        self.since = 0.0
        self.published = 0
        self.received = 0
        self.searches = 0
        self.search_failures = 0

    def record_key(self, key: str) -> str:
        return self.prefix + key + RECORD_SUFFIX

    # -- writing -------------------------------------------------------------------

    async def publish(self, key: str, scope: str, text: str, vector: Any, ttl: float) -> None:
        """Share one question, for ``ttl`` seconds (its answer's lifetime)."""
        if ttl <= 0:
            return
        vector = _float32(vector)
        if self.search_index is None and self.detected:
            await self._create_index(len(vector))
        client = self.tier.client
        record = self.record_key(key)
        log = self.prefix + LOG_KEY
        fields: Any = {
            "k": key,
            "s": hash_key(scope),
            "c": scope,
            "q": text,
            "v": vector.tobytes(),
            "e": self.embedder_tag,
        }

        async def write() -> Any:
            # Two commands per slot (the record, the log) on a cluster: no MULTI.
            pipe = client.pipeline(transaction=False)
            pipe.hset(record, mapping=fields)
            pipe.pexpire(record, max(1, int(ttl * 1000)))
            pipe.zadd(log, {key: self.clock()})
            pipe.zremrangebyrank(log, 0, -self.max_entries - 1)
            return await pipe.execute()

        ok, _ = await self.tier.attempt("semantic HSET", write)
        if ok:
            self.published += 1

    async def forget(self, key: str) -> None:
        """The question of a purged entry goes with it."""
        client = self.tier.client
        await self.tier.attempt("semantic DEL", lambda: client.delete(self.record_key(key)))

    # -- reading -------------------------------------------------------------------

    async def warm(self) -> list[SharedQuestion]:
        """The newest shared questions of this embedder, at most ``max_entries``, oldest first."""
        client = self.tier.client
        ok, newest = await self.tier.attempt(
            "semantic ZREVRANGE",
            lambda: client.zrevrange(
                self.prefix + LOG_KEY, 0, self.max_entries - 1, withscores=True
            ),
        )
        if not ok or not newest:
            return []
        pairs: list[Any] = list(newest)
        self.since = max(float(score) for _, score in pairs)
        return await self._records([_text(key) for key, _ in reversed(pairs)])

    async def poll(self) -> list[SharedQuestion]:
        """What was shared since the last :meth:`warm` or :meth:`poll` (a few seconds more,
        for hosts whose clocks lag)."""
        client = self.tier.client
        low = self.since - _CLOCK_SLACK
        ok, found = await self.tier.attempt(
            "semantic ZRANGEBYSCORE",
            lambda: client.zrangebyscore(
                self.prefix + LOG_KEY, low, "+inf", start=0, num=self.max_entries, withscores=True
            ),
        )
        if not ok or not found:
            return []
        pairs: list[Any] = list(found)
        self.since = max(self.since, max(float(score) for _, score in pairs))
        return await self._records([_text(key) for key, _ in pairs])

    async def _records(self, keys: list[str]) -> list[SharedQuestion]:
        client = self.tier.client
        out: list[SharedQuestion] = []
        for start in range(0, len(keys), _BATCH):
            batch = keys[start : start + _BATCH]

            async def read(batch: list[str] = batch) -> Any:
                pipe = client.pipeline(transaction=False)
                for key in batch:
                    pipe.hmget(self.record_key(key), _FIELDS)
                return await pipe.execute()

            ok, rows = await self.tier.attempt("semantic HMGET", read)
            if not ok or rows is None:
                break
            for row in rows:
                question = self._question(row)
                if question is not None:
                    out.append(question)
        self.received += len(out)
        return out

    def _question(self, row: Any) -> SharedQuestion | None:
        if not isinstance(row, list | tuple) or len(row) != len(_FIELDS) or None in row:
            return None  # expired, purged, or not a record
        key, scope, text, raw, embedder = row
        if _text(embedder) != self.embedder_tag or len(raw) % 4:
            return None
        import numpy as np

        return (_text(key), _text(scope), _text(text), np.frombuffer(raw, dtype=np.float32))

    # -- Redis's own vector search ----------------------------------------------------

    async def detect(self) -> bool | None:
        """Whether the server has vector search: asked once, at start (and again later only
        while Redis has not answered). None: not known yet."""
        if not self.want_search:
            return False
        config = self.tier.config
        try:
            # Not through the tier's breaker: "unknown command" is an answer here, no fault.
            async with asyncio.timeout(config.redis_connect_timeout + config.redis_timeout):
                await self.tier.client.execute_command("FT._LIST")
        except ResponseError:
            self.want_search = False
            logger.info("semantic cache: Redis has no vector search; each worker searches its own")
            return False
        except Exception as exc:  # noqa: BLE001 - Redis down: asked again later
            logger.debug("semantic cache: could not ask Redis for vector search: %s", exc)
            return None
        self.detected = True
        logger.info("semantic cache: searching shared questions with Redis's vector search")
        return True

    async def _create_index(self, dimensions: int) -> None:
        name = f"{self.prefix}~semantic-{dimensions}"
        client = self.tier.client

        async def create() -> Any:
            try:
                return await client.execute_command(
                    "FT.CREATE", name, "ON", "HASH", "PREFIX", "1", self.prefix,
                    "SCHEMA", "s", "TAG", "e", "TAG",
                    "v", "VECTOR", "HNSW", "6", "TYPE", "FLOAT32", "DIM", str(dimensions),
                    "DISTANCE_METRIC", "COSINE",
                )  # fmt: skip
            except Exception as exc:
                if "already exists" not in str(exc).lower():
                    raise
                return "OK"

        ok, _ = await self.tier.attempt("FT.CREATE", create)
        if ok:
            self.search_index = name

    async def search(self, scope: str, vector: Any, k: int) -> list[tuple[str, float, str]] | None:
        """The ``k`` nearest shared questions of ``scope``, as (entry key, similarity,
        question); None when Redis cannot search them (the worker's index answers)."""
        index = self.search_index
        if index is None:
            return None
        client = self.tier.client
        query = f"(@s:{{{hash_key(scope)}}} @e:{{{self.embedder_tag}}})=>[KNN {k} @v $b AS d]"
        blob = _float32(vector).tobytes()
        self.searches += 1
        ok, reply = await self.tier.attempt(
            "FT.SEARCH",
            lambda: client.execute_command(
                "FT.SEARCH",
                index,
                query,
                "PARAMS",
                "2",
                "b",
                blob,
                "RETURN",
                "3",
                "k",
                "q",
                "d",
                "SORTBY",
                "d",
                "LIMIT",
                "0",
                str(k),
                "DIALECT",
                "2",
            ),  # fmt: skip
        )
        if not ok:
            self.search_failures += 1
            return None
        return parse_search(reply)

    def status(self) -> dict[str, Any]:
        return {
            "redis_search": self.search_index is not None,
            "published": self.published,
            "received": self.received,
            "searches": self.searches,
            "search_failures": self.search_failures,
        }


def parse_search(reply: Any) -> list[tuple[str, float, str]]:
    """FT.SEARCH's ``[total, id, [field, value, ...], ...]`` as (key, similarity, question)."""
    out: list[tuple[str, float, str]] = []
    if not isinstance(reply, list | tuple):
        return out
    for fields in reply[2::2]:
        values = dict(zip(map(_text, fields[::2]), fields[1::2], strict=False))
        try:
            key = _text(values["k"])
            # Cosine distance is 1 - similarity.
            similarity = 1.0 - float(_text(values["d"]))
            question = _text(values["q"])
        except (KeyError, ValueError):
            continue
        out.append((key, similarity, question))
    return out


async def poll_forever(
    shared: SharedQuestions, take: Callable[[list[SharedQuestion]], None]
) -> None:
    """Hand what others share to ``take`` every ``interval`` seconds, until cancelled."""
    while True:
        await asyncio.sleep(shared.interval)
        try:
            if shared.want_search and not shared.detected:
                await shared.detect()
            if shared.detected:
                continue  # Redis searches the shared questions itself
            found = await shared.poll()
        except Exception:  # noqa: BLE001 - a bad round is logged; the next one tries again
            logger.warning("semantic cache: reading shared questions failed", exc_info=True)
            continue
        if found:
            take(found)
