"""The semantic cache: a request whose last user message means the same as a cached one's,
all else equal, is answered from that entry; a near miss never is.

Scope. Only the last user message is compared by meaning (the dialect says which text
that is: :meth:`~edgeproxy._protocol.dialects.Dialect.last_question`). Everything else is
in the *semantic scope*, a digest built like the exact key's (tenant or credential, API,
target, the headers that select behaviour, the whole body) with that one text taken out:
a different system prompt, earlier turn, model, sampling parameter, tool or
``response_format`` is another scope, and a search never leaves its scope.

Lookup, after an exact miss on a route with ``semantic_cache``: the question is embedded
(:mod:`~edgeproxy._stages.cache.semantic_embed`), the worker's index
(:mod:`~edgeproxy._stages.cache.semantic_index`) gives the nearest cached questions of the
scope, and each one above the route's ``semantic_threshold`` goes to the verifier
(:mod:`~edgeproxy._stages.cache.semantic_verify`), which rejects it for any difference
that changes the answer (negation, numbers, names, direction, target language, format).
The first candidate that passes, and whose entry is still fresh, answers: replayed in the
client's API like an exact hit, marked ``SEMANTIC-HIT`` with its similarity. A semantic
hit is never stored. What the request then stores upstream joins the index under its own
key. In shadow mode a would-be hit is counted and logged, never served.

A fault here (the embedder missing or failing) turns the semantic cache off or skips the
lookup; the exact cache goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any, Final, Protocol

from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext
from edgeproxy._core.response import StreamResponse
from edgeproxy._stages.cache.keys import KeyHeaders, semantic_scope
from edgeproxy._stages.cache.plan import CachePlan
from edgeproxy._stages.cache.semantic_verify import differences


class CacheStage(Protocol):
    """What the semantic cache uses of the cache stage (which imports this module)."""

    backend: Any
    clock: Callable[[], float]
    key_headers: KeyHeaders

    def _replay(
        self, ctx: RequestContext, plan: CachePlan, entry: Any, outcome: str
    ) -> StreamResponse | None: ...


__all__ = ["SemanticCache", "SemanticStats", "open_semantic"]

logger = logging.getLogger("edgeproxy.cache")

# Questions embedded for requests still on their way upstream, waiting to join the index
# once their answer is stored; the oldest are dropped past this.
_PENDING_MAX: Final = 4096
_CANDIDATES: Final = 4


@dataclasses.dataclass
class SemanticStats:
    """What the semantic cache did: lookups, hits, misses, candidates the verifier
    rejected by reason, would-be hits in shadow mode, and the lookup time."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    shadow_hits: int = 0
    rejected: Counter[str] = dataclasses.field(default_factory=Counter)
    skipped: Counter[str] = dataclasses.field(default_factory=Counter)
    lookup_seconds: float = 0.0
    lookup_seconds_max: float = 0.0

    def snapshot(self, entries: int) -> dict[str, Any]:
        return {
            "entries": entries,
            "lookups": self.lookups,
            "hits": self.hits,
            "misses": self.misses,
            "shadow_hits": self.shadow_hits,
            "rejected": dict(self.rejected),
            "skipped": dict(self.skipped),
            "lookup_ms_mean": round(1000 * self.lookup_seconds / self.lookups, 3)
            if self.lookups
            else 0.0,
            "lookup_ms_max": round(1000 * self.lookup_seconds_max, 3),
        }


class SemanticCache:
    """The semantic side of a :class:`~edgeproxy._stages.cache.stage.CacheStage`: an
    embedder, the worker's index and its questions, the verifier."""

    def __init__(self, embedder: Any, index: Any, *, shadow: bool = False) -> None:
        self.embedder = embedder
        self.index = index
        self.shadow = shadow
        self.stats = SemanticStats()
        self.questions: dict[str, str] = {}  # entry key -> its question, for the verifier
        self._pending: OrderedDict[str, tuple[str, str, Any]] = OrderedDict()

    async def lookup(
        self, stage: CacheStage, ctx: RequestContext, plan: CachePlan, threshold: float
    ) -> StreamResponse | None:
        """A fresh entry whose question means the same as ``ctx``'s, verified; else None
        (the question is kept, to join the index if the answer is stored)."""
        body = ctx.json
        asked = plan.dialect.last_question(body) if isinstance(body, dict) else None
        if asked is None:
            self.stats.skipped["no_question"] += 1
            return None
        text, rest = asked
        started = time.perf_counter()
        scope = semantic_scope(ctx, rest, stage.key_headers)
        try:
            vector = (await self.embedder.embed([text]))[0]
        except Exception as exc:  # noqa: BLE001 - a fault here skips the lookup only
            self.stats.skipped["embedder_error"] += 1
            logger.warning("semantic cache: embedding failed (%s); lookup skipped", exc)
            return None
        self._remember(plan.key, scope, text, vector)
        answer = await self._answer(stage, ctx, plan, threshold, scope, text, vector)
        elapsed = time.perf_counter() - started
        stats = self.stats
        stats.lookups += 1
        stats.lookup_seconds += elapsed
        stats.lookup_seconds_max = max(stats.lookup_seconds_max, elapsed)
        if answer is None:
            stats.misses += 1
        else:
            stats.hits += 1
        return answer

    async def _answer(
        self,
        stage: CacheStage,
        ctx: RequestContext,
        plan: CachePlan,
        threshold: float,
        scope: str,
        text: str,
        vector: Any,
    ) -> StreamResponse | None:
        assert stage.backend is not None
        for key, similarity in self.index.search(scope, vector, _CANDIDATES):
            if similarity < threshold:
                break
            question = self.questions.get(key)
            if question is None or key == plan.key:
                continue
            reasons = differences(text, question)
            if reasons:
                self.stats.rejected[reasons[0].split(":", 1)[0]] += 1
                continue
            entry = await stage.backend.get(key)
            if entry is None:
                # Purged, or evicted: it leaves the index too.
                self.forget(key)
                continue
            if stage.clock() >= entry.fresh_until:
                continue
            if self.shadow:
                self.stats.shadow_hits += 1
                logger.info(
                    "semantic cache (shadow): %s would be answered from %s (similarity %.3f)",
                    plan.key,
                    key,
                    similarity,
                )
                return None
            answer = stage._replay(ctx, dataclasses.replace(plan, key=key), entry, "SEMANTIC-HIT")
            if answer is not None:
                answer.headers["X-Edgeproxy-Semantic-Similarity"] = f"{similarity:.4f}"
                return answer
        return None

    def _remember(self, key: str, scope: str, text: str, vector: Any) -> None:
        pending = self._pending
        pending[key] = (scope, text, vector)
        pending.move_to_end(key)
        while len(pending) > _PENDING_MAX:
            pending.popitem(last=False)

    def stored(self, key: str) -> None:
        """The answer of a request looked up here was stored under ``key``: its question
        joins the index."""
        found = self._pending.pop(key, None)
        if found is None:
            return
        scope, text, vector = found
        for evicted in self.index.add(scope, key, vector) or ():
            self.questions.pop(evicted, None)
        self.questions[key] = text

    def snapshot(self) -> dict[str, Any]:
        """The ``semantic`` part of ``/status``'s cache section."""
        return {"shadow": self.shadow, **self.stats.snapshot(len(self.questions))}

    def forget(self, key: str) -> None:
        self.index.remove(key)
        self.questions.pop(key, None)

    def clear(self) -> None:
        """Every entry purged: the index empties too."""
        for key in list(self.questions):
            self.forget(key)


def open_semantic(config: Config) -> SemanticCache | None:
    """The semantic cache ``config`` asks for, or None (logged) when its embedder cannot
    load: the exact cache goes on without it."""
    cache = config.cache
    try:
        from edgeproxy._stages.cache.semantic_embed import make_embedder
        from edgeproxy._stages.cache.semantic_index import SemanticIndex

        embedder = make_embedder(cache, config.base_dir)
        index = SemanticIndex(embedder.dimensions, max_entries=cache.semantic_max_entries)
    except Exception as exc:  # noqa: BLE001 - a missing extra or model turns this part off
        logger.warning("semantic cache off: its embedder did not load (%s)", exc)
        return None
    return SemanticCache(embedder, index, shadow=cache.semantic_shadow)
