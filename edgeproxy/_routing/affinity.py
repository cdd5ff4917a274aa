"""Prefix (KV-cache) affinity: a conversation's next turn goes where its last turn went.

With ``[routing] prefix_affinity`` on, the router ranks the candidates of a
chat or completions request by a weighted sum, highest first, of

* the **prefix match**: how much of the request's prompt the region was
  recently sent (its :class:`~edgeproxy._upstream.prefixindex.PrefixIndex`),
  as matched blocks over the prompt's blocks, 0 to 1, weight
  ``prefix_weight`` (3);
* the **load**: the best candidate's score over the region's (the
  router's score, expected latency x (in flight + 1), where the expected
  latency includes the load the region reports, see
  :mod:`edgeproxy._upstream.reported`), 0 to 1, weight ``load_weight`` (4).

The weights follow the Gateway API Inference Extension's default profile
(prefix-cache scorer 3, queue and KV-utilisation scorers 2 each): here the
queue depth and KV utilisation are folded into one load term, through the
expected latency, which takes both their weights. Against a region that
holds nothing of the prompt and has the best score, a region holding all of
it keeps the request while its score is under 4 times the best (3 + 4/4 = 4),
one holding 80% of it while under 2.5 times (2.4 + 4/2.5 = 4).

Priority tiers still come first, and residency, the model catalog and health
have already filtered the candidates: affinity only ranks what is left, as one
of the ranking policies of ``[routing] rank``
(:mod:`edgeproxy._routing.ranking`): by default after the load tiers, so that
it chooses among the regions whose reported queues are alike.

**Balance guard** (SGLang's cache-aware router): when the loads of the
candidates are too uneven, affinity is ignored and the router's own choice
stands (power of two choices among the best). Loads are the requests each
region holds, as the proxy sees them in flight (over every process sharing
the load view, when it is fresh) or as the region reports them waiting and
running, whichever is larger; too uneven is
``max - min > balance_abs_threshold`` (64) and
``max > min x balance_rel_threshold`` (1.5).

When no candidate matches any block, or the request has no prompt key, the
router chooses as it does without affinity. After the first byte, the
request's blocks are recorded for the region that answered (whichever it
was: failover and hedging included).

**Cache intent** (``prompt_cache_affinity``, :mod:`edgeproxy._routing.cacheintent`):
a request that states its own (OpenAI's ``prompt_cache_key``, Anthropic's
``cache_control`` breakpoints) is keyed by it instead of its prompt's blocks. The
region holding its key (the one that answered the last request naming it, within
the key's TTL) counts as a whole match, the others as none, weighed against load
and under the balance guard as above; the region that answers holds the key from
then on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgeproxy._cache.keys import cache_scope
from edgeproxy._protocol.endpoints import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    MESSAGES,
    RESPONSES,
    openai_endpoint,
)
from edgeproxy._protocol.prefix import PromptKey, prompt_key
from edgeproxy._routing.cacheintent import IntentKey, IntentTable, intent_key

if TYPE_CHECKING:
    from edgeproxy._core.config import RoutingConfig
    from edgeproxy._core.context import RequestContext
    from edgeproxy._upstream.regions import Region

__all__ = ["Affinity", "AffinityPlan"]


@dataclass(slots=True)
class AffinityPlan:
    """One request's prompt key and what affinity decided for it.

    ``key``: the prompt's blocks, None for a request keyed by its cache intent;
    ``intent``: that intent, and ``table`` the keys' regions it is looked up in;
    ``chosen``: the region affinity put first because a prefix (or the intent's key)
    matched there; ``balanced``: the balance guard set affinity aside; ``matched``: the
    candidates holding some of the prompt, when affinity ranked them.
    """

    key: PromptKey | None
    chosen: Region | None = None
    balanced: bool = False
    matched: tuple[Region, ...] = ()
    intent: IntentKey | None = None
    table: IntentTable | None = None


class Affinity:
    """Prompt keys and cache intents, the ranking by match and load, and the balance guard."""

    def __init__(self, routing: RoutingConfig) -> None:
        self.block_chars = routing.prefix_block_chars
        self.max_blocks = routing.prefix_max_blocks
        self.prefix_weight = routing.prefix_weight
        self.load_weight = routing.load_weight
        self.balance_abs = routing.balance_abs_threshold
        self.balance_rel = routing.balance_rel_threshold
        self.session_header = routing.session_header
        self.session_from_user = routing.session_from_user
        # The region of each cache key the clients named (prompt-cache affinity).
        self.intents: IntentTable | None = (
            IntentTable(
                routing.prompt_cache_index_size,
                routing.prompt_cache_ttl,
                routing.prompt_cache_ttl_extended,
            )
            if routing.prompt_cache_affinity
            else None
        )

    def plan(self, ctx: RequestContext) -> AffinityPlan | None:
        """The prompt key of a chat, completions, Responses or Messages POST with a JSON
        body, or its cache intent where it states one; None for any other request, or a
        prompt too short to key and no session."""
        if ctx.method != "POST":
            return None
        endpoint = openai_endpoint(ctx.path)
        if endpoint is None:
            return None
        body = ctx.json
        if not isinstance(body, dict):
            return None
        if endpoint is COMPLETIONS:
            chat = False
        elif endpoint is CHAT_COMPLETIONS or endpoint is RESPONSES or endpoint is MESSAGES:
            chat = True
        else:
            return None
        if self.intents is not None:
            marked = endpoint.dialect.cache_intent(body)
            if marked:
                model = body.get("model")
                intent = intent_key(
                    marked, scope=cache_scope(ctx), model=model if isinstance(model, str) else None
                )
                if intent is not None:
                    return AffinityPlan(None, intent=intent, table=self.intents)
        turns: list[Any] | None = None
        if endpoint is RESPONSES or endpoint is MESSAGES:
            # Their turns written as chat's: the system prompt, then the conversation.
            turns = endpoint.dialect.conversation(body)
        session = ctx.headers.get(self.session_header) if self.session_header else None
        if not session and self.session_from_user:
            user = body.get("user")
            session = user if isinstance(user, str) else None
        key = prompt_key(
            body,
            chat=chat,
            block_chars=self.block_chars,
            max_blocks=self.max_blocks,
            session=session or None,
            turns=turns,
        )
        return None if key is None else AffinityPlan(key)

    def keys(
        self,
        plan: AffinityPlan,
        scored: list[tuple[float, Region]],
        now: float,
        load: Callable[[Region, float], float],
    ) -> list[float] | None:
        """A sort key per candidate of ``scored`` ((score, region)), lower first: minus its
        prefix match and load; None when affinity has nothing to say (no match anywhere)
        or the balance guard sets it aside. Sets ``plan.matched``."""
        plan.matched = ()
        if plan.intent is not None and plan.table is not None:
            return self._intent_keys(plan, plan.intent, plan.table, scored, now, load)
        if plan.key is None:
            return None
        blocks = plan.key.blocks
        matches = [region.prefix_index.match(blocks, now) for _, region in scored]
        if not any(matches):
            return None
        if self.unbalanced([load(region, now) for _, region in scored]):
            plan.balanced = True
            return None
        best = min([score for score, _ in scored])
        prefix_weight = self.prefix_weight / len(blocks)
        load_weight = self.load_weight * best
        keys: list[float] = []
        matched: list[Region] = []
        for i, (score, region) in enumerate(scored):
            blocks_matched = matches[i]
            if blocks_matched:
                matched.append(region)
            keys.append(-(prefix_weight * blocks_matched + load_weight / score))
        plan.matched = tuple(matched)
        return keys

    def _intent_keys(
        self,
        plan: AffinityPlan,
        intent: IntentKey,
        table: IntentTable,
        scored: list[tuple[float, Region]],
        now: float,
        load: Callable[[Region, float], float],
    ) -> list[float] | None:
        """:meth:`keys` for a request keyed by its cache intent: the region holding the key
        matches it whole, the others not at all."""
        held = table.holder(intent, now)
        if held is None:
            return None
        name = held[0]
        # Not a candidate (down, ejected, filtered out): the router's own choice.
        holder = next((i for i, (_, region) in enumerate(scored) if region.name == name), None)
        if holder is None:
            return None
        if self.unbalanced([load(region, now) for _, region in scored]):
            plan.balanced = True
            return None
        load_weight = self.load_weight * min([score for score, _ in scored])
        keys = [-load_weight / score for score, _ in scored]
        keys[holder] -= self.prefix_weight
        plan.matched = (scored[holder][1],)
        return keys

    def unbalanced(self, loads: list[float]) -> bool:
        """SGLang's guard: the loads differ by more than both thresholds."""
        low, high = min(loads), max(loads)
        return high - low > self.balance_abs and high > low * self.balance_rel

    @staticmethod
    def routed(plan: AffinityPlan, region: Region, now: float) -> None:
        """``region`` answered the request (its first byte came): it now holds the prompt,
        or the cache the request named."""
        if plan.intent is not None and plan.table is not None:
            plan.table.record(plan.intent, region.name, now)
        elif plan.key is not None:
            region.prefix_index.record(plan.key.blocks, now)
        region.affinity_requests_total += 1
        if plan.chosen is region:
            region.affinity_hits_total += 1
        if plan.balanced:
            region.affinity_balanced_total += 1
