"""The semantic cache: a request whose last user message means the same as a cached one's,
all else equal, is answered from that entry; a near miss never is.

Scope. Only the last user message is compared by meaning (the dialect says which text
that is: :meth:`~edgeproxy._protocol.dialects.Dialect.last_question`). Everything else is
in the *semantic scope*, a digest built like the exact key's (tenant or credential, API,
target, the headers that select behaviour, the whole body) with that one text taken out:
a different system prompt, earlier turn, model, sampling parameter, tool or
``response_format`` is another scope, and a search never leaves its scope.

Lookup, after an exact miss on a route with ``semantic_cache``: the question is embedded
(:mod:`~edgeproxy._cache.semantic_embed`), the worker's index
(:mod:`~edgeproxy._cache.semantic_index`) gives the nearest cached questions of the
scope, and each one above the route's ``semantic_threshold`` goes to the verifier
(:mod:`~edgeproxy._cache.semantic_verify`), which rejects it for any difference
that changes the answer (negation, numbers, names, direction, target language, format).
The first candidate that passes, and whose entry is still fresh, answers: replayed in the
client's API like an exact hit, marked ``SEMANTIC-HIT`` with its similarity. With a model
verifier (:mod:`~edgeproxy._cache.semantic_model`), that candidate is first put to
a model, whose ``yes`` alone keeps the hit. A semantic hit is never stored. What the
request then stores upstream joins the index under its own key. In shadow mode a would-be
hit is counted and logged, never served.

With a Redis backend (and ``semantic_share``), each question that joins the index is also
stored in Redis beside its answer (:mod:`~edgeproxy._cache.semantic_share`): a
worker that starts warms its index from them, running workers pick up what the others
stored, and where Redis has vector search it searches them itself.

A fault here (the embedder missing or failing, Redis down) turns the semantic cache off
or skips the lookup, or leaves each worker with what it knows; the exact cache goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, Protocol

from edgeproxy._cache.backends import RedisTier
from edgeproxy._cache.entry import Entry
from edgeproxy._cache.keys import KeyHeaders, semantic_scope
from edgeproxy._cache.plan import CachePlan
from edgeproxy._cache.semantic_model import ModelVerifier, make_model_verifier
from edgeproxy._cache.semantic_share import SharedQuestion, SharedQuestions, poll_forever
from edgeproxy._cache.semantic_verify import differences
from edgeproxy._core.answer import Answer
from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext
from edgeproxy._upstream.endpoint import RegionEndpoints

if TYPE_CHECKING:
    # numpy, and so the index, only once a route asks for the semantic cache: the plain
    # install has no numpy.
    from edgeproxy._cache.semantic_index import SemanticIndex
    from edgeproxy._local.model import LocalModel


class CacheStage(Protocol):
    """What the semantic cache uses of the cache stage (which imports this module)."""

    backend: Any
    clock: Callable[[], float]
    key_headers: KeyHeaders

    def answer_of(
        self, ctx: RequestContext, plan: CachePlan, entry: Any, outcome: str
    ) -> Answer | None: ...


__all__ = ["SemanticCache", "SemanticStats", "open_semantic"]

logger = logging.getLogger("edgeproxy.cache")

# Questions embedded for requests still on their way upstream, waiting to join the index
# once their answer is stored; the oldest are dropped past this.
_PENDING_MAX: Final = 4096
_CANDIDATES: Final = 4
LOOKUP_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)


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
    # Lookups by time taken: the upper bounds (seconds) of LOOKUP_BUCKETS, and +Inf.
    lookup_buckets: list[int] = dataclasses.field(
        default_factory=lambda: [0] * (len(LOOKUP_BUCKETS) + 1)
    )

    def observe(self, elapsed: float) -> None:
        self.lookups += 1
        self.lookup_seconds += elapsed
        self.lookup_seconds_max = max(self.lookup_seconds_max, elapsed)
        for i, bound in enumerate(LOOKUP_BUCKETS):
            if elapsed <= bound:
                self.lookup_buckets[i] += 1
                return
        self.lookup_buckets[-1] += 1

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
            "lookup_seconds_sum": self.lookup_seconds,
            # Cumulative counts by upper bound, as Prometheus histograms have them.
            "lookup_histogram": [
                [bound, sum(self.lookup_buckets[: i + 1])]
                for i, bound in enumerate([*LOOKUP_BUCKETS, "+Inf"])
            ],
        }


class SemanticCache:
    """The semantic side of a :class:`~edgeproxy._cache.stage.CacheStage`: an
    embedder, the worker's index and its questions, the verifier, and the questions
    shared through Redis."""

    def __init__(
        self,
        embedder: Any,
        *,
        spawn: Callable[[Any], None],
        max_entries: int = 100_000,
        shadow: bool = False,
        shared: SharedQuestions | None = None,
        model_verifier: ModelVerifier | None = None,
    ) -> None:
        self.embedder = embedder
        self.model_verifier = model_verifier
        self.max_entries = max_entries
        # Made with the first vector: a model's dimensions are known once it has embedded.
        self.index: SemanticIndex | None = None
        self.shadow = shadow
        self.shared = shared
        self.stats = SemanticStats()
        self.questions: dict[str, str] = {}  # entry key -> its question, for the verifier
        self._pending: OrderedDict[str, tuple[str, str, Any]] = OrderedDict()
        # The cache stage's: its background work, cancelled when the stage closes.
        self._spawn = spawn
        self.warmed = False  # the shared questions of Redis have been read once

    # -- lifespan ----------------------------------------------------------------

    async def open(self) -> None:
        """Find out whether Redis searches shared questions; otherwise warm the index with
        the newest of them and keep picking up new ones, in the background: a start does
        not wait for up to ``semantic_max_entries`` questions to come from Redis."""
        shared = self.shared
        if shared is None:
            return
        if await shared.detect():
            return
        self._spawn(self._warm_then_poll(shared))

    async def _warm_then_poll(self, shared: SharedQuestions) -> None:
        try:
            self._take(await shared.warm())
        except Exception:  # noqa: BLE001 - a failed warm-up leaves polling to catch up
            logger.warning("semantic cache: warming from Redis failed", exc_info=True)
        self.warmed = True
        await poll_forever(shared, self._take)

    async def close(self) -> None:
        """Let go of the embedder (the stage has cancelled the background work)."""
        await self.embedder.close()

    def _take(self, found: list[SharedQuestion]) -> None:
        """Questions others shared join this worker's index (those it has, and vectors of
        another size, are skipped)."""
        for key, scope, text, vector in found:
            if key in self.questions:
                continue
            index = self._index_for(vector)
            if index is not None:
                self._add(index, scope, key, text, vector)

    def _index_for(self, vector: Any) -> SemanticIndex | None:
        index = self.index
        if index is None:
            from edgeproxy._cache.semantic_index import SemanticIndex

            index = self.index = SemanticIndex(len(vector), max_entries=self.max_entries)
        return index if len(vector) == index.dimensions else None

    def _add(self, index: SemanticIndex, scope: str, key: str, text: str, vector: Any) -> None:
        for evicted in index.add(scope, key, vector):
            self.questions.pop(evicted, None)
        self.questions[key] = text

    # -- lookups ---------------------------------------------------------------------

    async def lookup(
        self, stage: CacheStage, ctx: RequestContext, plan: CachePlan, threshold: float
    ) -> Answer | None:
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
        stats = self.stats
        stats.observe(time.perf_counter() - started)
        if answer is None:
            stats.misses += 1
        else:
            stats.hits += 1
        return answer

    async def _candidates(self, scope: str, vector: Any) -> Iterable[tuple[str, float, str]]:
        """The nearest cached questions of ``scope``: (entry key, similarity, question)."""
        if self.shared is not None:
            found = await self.shared.search(scope, vector, _CANDIDATES)
            if found is not None:
                return found
        index = self.index
        if index is None or len(vector) != index.dimensions:
            return ()
        questions = self.questions
        return (
            (key, similarity, questions.get(key, ""))
            for key, similarity in index.search(scope, vector, _CANDIDATES)
        )

    async def _answer(
        self,
        stage: CacheStage,
        ctx: RequestContext,
        plan: CachePlan,
        threshold: float,
        scope: str,
        text: str,
        vector: Any,
    ) -> Answer | None:
        assert stage.backend is not None
        for key, similarity, question in await self._candidates(scope, vector):
            if similarity < threshold:
                break
            if not question or key == plan.key:
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
            verifier = self.model_verifier
            if verifier is not None and not await verifier.same(question, text):
                # One model call a lookup at most: the other candidates are less similar
                # than the one it turned down, and each call costs a round trip.
                return None
            if self.shadow:
                self.stats.shadow_hits += 1
                logger.info(
                    "semantic cache (shadow): %s would be answered from %s (similarity %.3f)",
                    plan.key,
                    key,
                    similarity,
                )
                return None
            answer = stage.answer_of(ctx, dataclasses.replace(plan, key=key), entry, "SEMANTIC-HIT")
            if answer is not None:
                answer.headers.append(("X-Edgeproxy-Semantic-Similarity", f"{similarity:.4f}"))
                return answer
        return None

    def _remember(self, key: str, scope: str, text: str, vector: Any) -> None:
        pending = self._pending
        pending[key] = (scope, text, vector)
        pending.move_to_end(key)
        while len(pending) > _PENDING_MAX:
            pending.popitem(last=False)

    # -- entries -----------------------------------------------------------------------

    def stored(self, key: str, entry: Entry, now: float) -> None:
        """The answer of a request looked up here was stored under ``key``: its question
        joins the index, and is shared for as long as the answer is kept."""
        found = self._pending.pop(key, None)
        if found is None:
            return
        scope, text, vector = found
        index = self._index_for(vector)
        if index is None:
            return
        self._add(index, scope, key, text, vector)
        if self.shared is not None:
            self._spawn(self.shared.publish(key, scope, text, vector, entry.keep_until - now))

    def snapshot(self) -> dict[str, Any]:
        """The ``semantic`` part of ``/status``'s cache section."""
        out = {
            "shadow": self.shadow,
            "embedder": self.embedder.name,
            "graph_scopes": self.index.graphs() if self.index is not None else 0,
            **self.stats.snapshot(len(self.questions)),
        }
        if self.shared is not None:
            out["shared"] = {**self.shared.status(), "warmed": self.warmed}
        if self.model_verifier is not None:
            out["model_verifier"] = self.model_verifier.snapshot()
        return out

    def forget(self, key: str) -> None:
        if self.index is not None:
            self.index.remove(key)
        self.questions.pop(key, None)

    async def purged(self, key: str) -> None:
        """The entry ``key`` was purged: its question goes, here and in Redis."""
        self.forget(key)
        if self.shared is not None:
            await self.shared.forget(key)

    def clear(self) -> None:
        """Every entry purged: the index empties too."""
        for key in list(self.questions):
            self.forget(key)


def _redis_tier(backend: Any) -> RedisTier | None:
    tier = getattr(backend, "redis", backend)
    return tier if isinstance(tier, RedisTier) else None


def open_semantic(
    config: Config,
    backend: Any,
    regions: Iterable[RegionEndpoints],
    *,
    spawn: Callable[[Any], None],
    local_model: LocalModel | None = None,
    serving: Callable[[str], frozenset[str] | None] | None = None,
) -> SemanticCache | None:
    """The semantic cache ``config`` asks for, or None (logged) when its embedder cannot
    load: the exact cache goes on without it. ``spawn`` runs its background work (the
    cache stage's, which cancels it when the stage closes). ``local_model`` and
    ``serving`` (the model catalog's regions for a model name) are for its model
    verifier, when one is asked for."""
    cache = config.cache
    regions = list(regions)
    try:
        from edgeproxy._cache.semantic_embed import make_embedder

        embedder = make_embedder(cache, config.base_dir, regions)
    except Exception as exc:  # noqa: BLE001 - a missing extra or model turns this part off
        logger.warning("semantic cache off: its embedder did not load (%s)", exc)
        return None
    try:
        verifier = make_model_verifier(cache, regions, local_model=local_model, serving=serving)
    except Exception as exc:  # noqa: BLE001 - serving no hit beats serving unchecked ones
        logger.warning("semantic cache off: its model verifier is missing (%s)", exc)
        return None
    tier = _redis_tier(backend)
    shared = (
        SharedQuestions(
            tier,
            embedder.name,
            max_entries=cache.semantic_max_entries,
            interval=cache.semantic_sync_interval,
            redis_search=cache.semantic_redis_search == "auto",
        )
        if tier is not None and cache.semantic_share
        else None
    )
    return SemanticCache(
        embedder,
        max_entries=cache.semantic_max_entries,
        shadow=cache.semantic_shadow,
        shared=shared,
        spawn=spawn,
        model_verifier=verifier,
    )
