"""The semantic cache's index in each worker: normalised vectors by scope, searched by
cosine similarity.

A search only ever looks at one scope (everything a hit must share but the question), so
scopes are small: a dictionary of scopes, each a contiguous float32 matrix searched with
one matrix-vector product, is exact and costs microseconds per thousand rows; an
approximate graph index would add a dependency for no gain at these sizes. Rows are
appended; a removed row is marked dead and the matrix compacted once half of it is.
The index is bounded: past ``max_entries`` the oldest entries go first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["SemanticIndex"]


class _Scope:
    __slots__ = ("dead", "keys", "matrix", "size")

    def __init__(self, dimensions: int) -> None:
        self.matrix = np.zeros((8, dimensions), dtype=np.float32)
        self.keys: list[str | None] = []
        self.size = 0
        self.dead = 0

    def add(self, key: str, vector: Any) -> int:
        if self.size == len(self.matrix):
            grown = np.zeros((2 * len(self.matrix), self.matrix.shape[1]), dtype=np.float32)
            grown[: self.size] = self.matrix[: self.size]
            self.matrix = grown
        self.matrix[self.size] = vector
        self.keys.append(key)
        self.size += 1
        return self.size - 1

    def compact(self) -> dict[str, int]:
        live = [i for i, key in enumerate(self.keys) if key is not None]
        self.matrix[: len(live)] = self.matrix[live]
        self.keys = [self.keys[i] for i in live]
        self.size = len(live)
        self.dead = 0
        return {key: i for i, key in enumerate(self.keys) if key is not None}


class SemanticIndex:
    """Vectors by scope; ``add`` returns the keys it evicted to stay within bounds."""

    def __init__(self, dimensions: int, *, max_entries: int = 100_000) -> None:
        self.dimensions = dimensions
        self.max_entries = max_entries
        self._scopes: dict[str, _Scope] = {}
        # key -> (scope, row), oldest first.
        self._where: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def add(self, scope: str, key: str, vector: Any) -> list[str]:
        if key in self._where:
            self.remove(key)
        table = self._scopes.get(scope)
        if table is None:
            table = self._scopes[scope] = _Scope(self.dimensions)
        self._where[key] = (scope, table.add(key, vector))
        evicted = []
        while len(self._where) > self.max_entries:
            oldest = next(iter(self._where))
            self.remove(oldest)
            evicted.append(oldest)
        return evicted

    def remove(self, key: str) -> None:
        found = self._where.pop(key, None)
        if found is None:
            return
        scope, row = found
        table = self._scopes[scope]
        table.keys[row] = None
        table.dead += 1
        if table.dead == table.size:
            del self._scopes[scope]
        elif table.dead * 2 > table.size:
            for moved, new_row in table.compact().items():
                self._where[moved] = (scope, new_row)

    def search(self, scope: str, vector: Any, k: int = 4) -> list[tuple[str, float]]:
        """The ``k`` nearest live entries of ``scope``, most similar first."""
        table = self._scopes.get(scope)
        if table is None:
            return []
        scores = table.matrix[: table.size] @ np.asarray(vector, dtype=np.float32)
        count = min(k + table.dead, table.size)
        if count < table.size:
            best = np.argpartition(-scores, count - 1)[:count]
        else:
            best = np.arange(table.size)
        ordered = best[np.argsort(-scores[best])]
        out = []
        for row in ordered:
            key = table.keys[row]
            if key is not None:
                out.append((key, float(scores[row])))
                if len(out) == k:
                    break
        return out
