"""JSON with one meaning: a document whose objects name a key twice is refused.

RFC 8259 §4 leaves duplicate names to the parser: some keep the first occurrence, some
the last. The proxy decides (cache key, routing, limits) on what it parsed and forwards
the raw bytes, so a body that parses two ways could be cached as one question and
answered as another. Such bodies are refused instead.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["DuplicateKey", "duplicate_key", "loads_unique"]

_dumps = orjson.dumps
_loads = orjson.loads


class DuplicateKey(ValueError):
    """A JSON object of the document names ``key`` more than once."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def duplicate_key(raw: bytes, value: Any) -> str | None:
    """The first key that an object of ``raw`` names twice, or None.

    ``value`` is ``raw`` as orjson parsed it (so ``raw`` is valid JSON). The check costs
    about as much as one more serialization: outside strings, every colon of a JSON
    document separates a key from its value, so ``raw`` has as many colons as its
    re-serialization unless a duplicate was collapsed, or a string spelled a colon as
    ``\\u003a`` (counted back in). Only a mismatch pays for a second, exact parse, which
    also names the key.
    """
    colons = raw.count(b":")
    if b"\\u003" in raw:
        # May over-count (an escaped backslash before "u003a"): the exact parse decides.
        colons += raw.count(b"\\u003a") + raw.count(b"\\u003A")
    try:
        if colons == _dumps(value).count(b":"):
            return None
    except TypeError:
        pass  # nested deeper than orjson serializes (254 levels): the exact parse decides
    try:
        json.loads(raw, object_pairs_hook=_unique_pairs)
    except DuplicateKey as dup:
        return dup.key
    except RecursionError:
        # Deeper than the exact parse can go, and the counts disagree: refused all the same.
        return "(nested too deeply to name)"
    return None


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return out


def loads_unique(raw: bytes) -> Any:
    """``raw`` parsed as JSON; raises ``orjson.JSONDecodeError`` when it is not JSON and
    :class:`DuplicateKey` when an object names a key twice."""
    value = _loads(raw)
    if type(value) is dict or type(value) is list:
        key = duplicate_key(raw, value)
        if key is not None:
            raise DuplicateKey(key)
    return value
