"""JSON with one meaning: a document whose objects name a key twice is refused, and so is
one nested deeper than :data:`MAX_DEPTH` levels.

RFC 8259 §4 leaves duplicate names to the parser: some keep the first occurrence, some
the last. The proxy decides (cache key, routing, limits) on what it parsed and forwards
the raw bytes, so a body that parses two ways could be cached as one question and
answered as another. Such bodies are refused instead.

RFC 8259 §9 lets a parser limit nesting too, and every parser does, each at its own depth
(orjson reads 1,024 levels and writes 254, Python's json stops near its recursion limit):
the proxy sets one limit of its own, below all of them, so that it reads, checks and
forwards only documents that every step can read.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = [
    "MAX_DEPTH",
    "DuplicateKey",
    "NestedTooDeeply",
    "duplicate_key",
    "loads_unique",
    "too_deep",
]

MAX_DEPTH = 128
"""Most levels of arrays and objects in a document the proxy reads (``[[1]]`` has two)."""

_dumps = orjson.dumps
_loads = orjson.loads


def _dumps_depth() -> int:
    """The deepest nesting orjson serializes (254 in orjson 3)."""
    low, high = 0, 4096
    while low < high:
        mid = (low + high + 1) // 2
        value: Any = 0
        for _ in range(mid):
            value = [value]
        try:
            _dumps(value)
        except TypeError:
            high = mid - 1
        else:
            low = mid
    return low


# The duplicate check serializes the document under this many wrapping lists: orjson's
# own limit then refuses exactly the documents nested past MAX_DEPTH, for nothing more.
_WRAP = _dumps_depth() - MAX_DEPTH
if _WRAP < 0:
    raise ImportError(f"orjson serializes fewer than {MAX_DEPTH} levels of nesting")


class DuplicateKey(ValueError):
    """A JSON object of the document names ``key`` more than once."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


class NestedTooDeeply(orjson.JSONDecodeError):
    """The document nests arrays and objects deeper than :data:`MAX_DEPTH` levels.

    A decode error, as orjson's own past its limit: the document is not one the proxy
    reads.
    """

    def __init__(self) -> None:
        super().__init__(f"depth limit exceeded: more than {MAX_DEPTH} levels", "", 0)

    def __str__(self) -> str:
        # No position: the whole document is refused, not a place in it.
        return self.msg


def duplicate_key(raw: bytes, value: Any) -> str | None:
    """The first key that an object of ``raw`` names twice, or None; raises
    :class:`NestedTooDeeply` past :data:`MAX_DEPTH` levels.

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
    # Fewer brackets than the limit, even counting those in strings: not too deep.
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:
        for _ in range(_WRAP):
            value = [value]
    try:
        serialized = _dumps(value)
    except TypeError:
        # orjson refuses nothing else that orjson parsed (it reads huge integers as floats).
        raise NestedTooDeeply() from None
    if colons == serialized.count(b":"):
        return None
    try:
        json.loads(raw, object_pairs_hook=_unique_pairs)
    except DuplicateKey as dup:
        return dup.key
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
    """``raw`` parsed as JSON; raises ``orjson.JSONDecodeError`` when it is not JSON
    (:class:`NestedTooDeeply`, one of them, when it nests past :data:`MAX_DEPTH`) and
    :class:`DuplicateKey` when an object names a key twice."""
    try:
        value = _loads(raw)
    except orjson.JSONDecodeError as exc:
        if too_deep(exc):
            raise NestedTooDeeply() from None
        raise
    if type(value) is dict or type(value) is list:
        key = duplicate_key(raw, value)
        if key is not None:
            raise DuplicateKey(key)
    return value


def too_deep(exc: orjson.JSONDecodeError) -> bool:
    """Whether orjson refused a document for its nesting (past its own limit, which is
    past :data:`MAX_DEPTH`)."""
    return exc.msg.startswith("depth limit exceeded")
