"""Prompt-cache affinity: the client's own cache intent as the affinity key.

A client may say which of its requests share a provider-side prompt cache: OpenAI's
``prompt_cache_key`` names the cache, Anthropic's ``cache_control`` breakpoints mark where
the prefixes to cache end. The request's dialect reads them
(:meth:`~edgeproxy._protocol.dialects.Dialect.cache_intent`): the blocks in the
provider's cache order up to the last breakpoint, each with its mark. The provider keeps
an entry for a while after its last use, 5 minutes by default or an hour for Anthropic's
extended TTL, so the router remembers, for each cache key, the region that answered the
last request naming it, until that TTL passes without one:

* **keys** (:func:`intent_key`): hashes chained from the scope (the tenant, else the
  client's credentials: two tenants' equal keys never meet) and the model through each
  block, so that a key covers the whole prefix up to its block; the request's own key
  covers everything up to its last breakpoint;
* **lookups**: the hash at every block boundary up to the last breakpoint, longest first.
  The provider also reads an entry written at an earlier boundary (Anthropic looks back
  over the blocks before a breakpoint), so a conversation whose breakpoint moves to its
  newest turn each time finds the region holding its turns before;
* **records** (:meth:`IntentTable.record`): where a request is answered, each of its
  breakpoints is held for that region with its own TTL (``prompt_cache_ttl``, or
  ``prompt_cache_ttl_extended``), and the entry it found there is refreshed, as the
  provider refreshes the entry it reads.

Hashes are the process's own (Python's keyed hash, as prompt keys'), never shared.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["IntentKey", "IntentTable", "intent_key"]


@dataclass(frozen=True, slots=True)
class IntentKey:
    """One request's cache intent as chained hashes.

    ``key``: the prefix up to its last breakpoint; ``lookups``: the prefix at each block
    boundary up to there, longest first (``key`` first); ``writes``: each breakpoint's
    hash and whether it asks the extended TTL.
    """

    key: int
    lookups: tuple[int, ...]
    writes: tuple[tuple[int, bool], ...]


def _block(block: Any) -> bytes:
    try:
        return orjson.dumps(block, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        # Integers past 64 bits, say: the text stands for them.
        return repr(block).encode()


def intent_key(
    marked: Sequence[tuple[Any, bool | None]], *, scope: str, model: str | None
) -> IntentKey | None:
    """The hashes of ``marked`` (a dialect's :meth:`cache_intent`, ending at its last
    breakpoint) within ``scope`` and ``model``; None when it marks no block."""
    chained = hash(("edgeproxy.cache_intent", scope, model))
    lookups: list[int] = []
    writes: list[tuple[int, bool]] = []
    for block, mark in marked:
        chained = hash((chained, _block(block)))
        lookups.append(chained)
        if mark is not None:
            writes.append((chained, mark))
    if not writes:
        return None
    lookups.reverse()
    return IntentKey(lookups[0], tuple(lookups), tuple(writes))


class IntentTable:
    """The region holding each cache key, until its TTL passes with no request naming it.

    Bounded: at most ``capacity`` keys, least recently routed out first. Expired keys
    leave from the cold end as new ones come in (an extended key there keeps the shorter
    ones behind it until the capacity or a lookup drops them). Times are the router's
    clock, given by the caller.
    """

    __slots__ = ("capacity", "ttl", "ttl_extended", "evicted_total", "_entries")

    def __init__(self, capacity: int, ttl: float, ttl_extended: float) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity!r}")
        if not 0 < ttl <= ttl_extended:
            raise ValueError(f"ttls must be above 0, the extended one no shorter: {ttl!r}")
        self.capacity = capacity
        self.ttl = ttl
        self.ttl_extended = ttl_extended
        self.evicted_total = 0
        # key -> (region name, last routed, its TTL); least recently routed first.
        self._entries: OrderedDict[int, tuple[str, float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def holder(self, intent: IntentKey, now: float) -> tuple[str, int] | None:
        """The region holding the longest of ``intent``'s prefixes, and that prefix's hash;
        None when no region holds any."""
        entries = self._entries
        if not entries:
            return None
        for key in intent.lookups:
            entry = entries.get(key)
            if entry is None:
                continue
            if now - entry[1] <= entry[2]:
                return entry[0], key
            del entries[key]
        return None

    def record(self, intent: IntentKey, region: str, now: float) -> None:
        """``region`` answered the request: it holds the request's breakpoints from ``now``,
        and the entry it held for the request (if any) is refreshed."""
        entries = self._entries
        found = self.holder(intent, now)
        if found is not None and found[0] == region:
            _, _, ttl = entries[found[1]]
            entries[found[1]] = (region, now, ttl)
            entries.move_to_end(found[1])
        # The first breakpoint last: the shortest prefix is the one the most requests share.
        for key, extended in reversed(intent.writes):
            entries[key] = (region, now, self.ttl_extended if extended else self.ttl)
            entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)
            self.evicted_total += 1
        self.expire(now)

    def expire(self, now: float) -> None:
        """Drop the expired keys at the cold end."""
        entries = self._entries
        while entries:
            key = next(iter(entries))
            _, stamp, ttl = entries[key]
            if now - stamp <= ttl:
                break
            del entries[key]

    def clear(self) -> None:
        self._entries.clear()
