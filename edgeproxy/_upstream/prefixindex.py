"""What each region probably holds in its KV cache: the prompt blocks recently routed to it.

A :class:`PrefixIndex` is one region's approximate memory of the chained
block hashes (:class:`~edgeproxy._protocol.prefix.PromptKey`) of the prompts
it answered. It does not see the region's cache; it assumes that what was
sent there recently is still cached, as the Gateway API Inference
Extension's approximate prefix-cache scorer and SGLang's cache-aware router
do:

* **bounded**: at most ``capacity`` block hashes, least recently used out
  first;
* **TTL**: a block not routed there for ``ttl`` seconds counts as evicted
  (the server's cache has moved on); expired blocks are dropped from the
  cold end as new ones come in, so memory follows the traffic;
* **O(blocks)** per request: :meth:`match` walks the request's blocks from
  the first until one is missing, :meth:`record` refreshes them from the last
  to the first, so that the LRU drops the ends of prompts before their
  beginnings (vLLM frees a finished request's blocks in that order too), and
  a match is a prefix.

Times are monotonic seconds given by the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """One region's LRU of recently routed block hashes, each with the time it was last routed."""

    __slots__ = ("capacity", "ttl", "evicted_total", "expired_total", "_blocks")

    def __init__(self, capacity: int, ttl: float) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity!r}")
        if not ttl > 0:
            raise ValueError(f"ttl must be above 0, not {ttl!r}")
        self.capacity = capacity
        self.ttl = ttl
        self.evicted_total = 0
        self.expired_total = 0
        # Oldest first: every record moves its blocks to the end with the same stamp.
        self._blocks: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def match(self, blocks: Sequence[int], now: float) -> int:
        """How many of ``blocks``, from the first, were routed here less than ``ttl`` ago."""
        entries = self._blocks
        if not entries:
            return 0
        horizon = now - self.ttl
        matched = 0
        for block in blocks:
            stamp = entries.get(block)
            if stamp is None or stamp < horizon:
                break
            matched += 1
        return matched

    def record(self, blocks: Sequence[int], now: float) -> None:
        """``blocks`` were routed here at ``now``: most recent, the first one last of all."""
        entries = self._blocks
        for block in reversed(blocks):
            entries[block] = now
            entries.move_to_end(block)
        while len(entries) > self.capacity:
            entries.popitem(last=False)
            self.evicted_total += 1
        self.expire(now)

    def expire(self, now: float) -> None:
        """Drop the blocks older than ``ttl`` (from the cold end, so O(expired))."""
        entries = self._blocks
        horizon = now - self.ttl
        while entries:
            block = next(iter(entries))
            if entries[block] >= horizon:
                break
            del entries[block]
            self.expired_total += 1

    def clear(self) -> None:
        self._blocks.clear()
