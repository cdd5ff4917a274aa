"""The semantic cache's index in each worker: normalised vectors by scope, searched by
cosine similarity.

A search only ever looks at one scope (everything a hit must share but the question).
Most scopes are small, and for them a contiguous float32 matrix searched with one
matrix-vector product is exact and costs microseconds per thousand rows. Some are not: a
route whose clients send one system prompt and single questions puts every question of a
model in one scope, and at 100,000 rows the product costs milliseconds. A scope past
``graph_from`` rows therefore moves into a usearch HNSW graph of half-precision vectors
(approximate: a question the graph misses is a miss, an upstream call, never a wrong
hit, since every candidate still goes to the verifier). Without usearch installed,
scopes stay exact.

Measured on 100,000 random unit vectors in one scope, two cores
(bench/bench_semantic_cache.py): a search costs about 0.6 ms at p99 with recall@1 of
0.82 (random vectors are the graph's worst case; questions cluster), and an added entry
about 0.5 ms on the event loop. An inverted file in numpy (256 centroids drawn from the
scope, 16 probed) was tried instead: adds of 8 us, but searches of 0.8 ms at p99 for a
recall of 0.91, its lists unbalanced by the centroids' hubness in 256 dimensions.

Rows of an exact scope are appended; a removed row is marked dead and the matrix
compacted once half of it is. The index is bounded: past ``max_entries`` the oldest
entries go first.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from typing import Any, Final

import numpy as np

__all__ = ["GRAPH_FROM", "SemanticIndex"]

logger = logging.getLogger("edgeproxy.cache")

# Rows past which a scope is searched through a graph: below it the exact product is
# cheaper than the graph's search (bench/bench_semantic_cache.py --index).
GRAPH_FROM: Final = 4096


class _Exact:
    __slots__ = ("dead", "keys", "matrix", "size")

    def __init__(self, dimensions: int) -> None:
        self.matrix = np.zeros((8, dimensions), dtype=np.float32)
        self.keys: list[str | None] = []
        self.size = 0
        self.dead = 0

    @property
    def live(self) -> int:
        return self.size - self.dead

    def add(self, key: str, vector: Any) -> int:
        if self.size == len(self.matrix):
            grown = np.zeros((2 * len(self.matrix), self.matrix.shape[1]), dtype=np.float32)
            grown[: self.size] = self.matrix[: self.size]
            self.matrix = grown
        self.matrix[self.size] = vector
        self.keys.append(key)
        self.size += 1
        return self.size - 1

    def remove(self, row: int) -> dict[str, int]:
        """Mark ``row`` dead; the rows that moved, when this compacted the matrix."""
        self.keys[row] = None
        self.dead += 1
        if self.dead * 2 <= self.size or self.dead == self.size:
            return {}
        live = [i for i, key in enumerate(self.keys) if key is not None]
        self.matrix[: len(live)] = self.matrix[live]
        self.keys = [self.keys[i] for i in live]
        self.size = len(live)
        self.dead = 0
        return {key: i for i, key in enumerate(self.keys) if key is not None}

    def search(self, vector: Any, k: int) -> list[tuple[str, float]]:
        scores = self.matrix[: self.size] @ vector
        count = min(k + self.dead, self.size)
        if count < self.size:
            best = np.argpartition(-scores, count - 1)[:count]
        else:
            best = np.arange(self.size)
        out = []
        for row in best[np.argsort(-scores[best])]:
            key = self.keys[row]
            if key is not None:
                out.append((key, float(scores[row])))
                if len(out) == k:
                    break
        return out


class _Graph:
    """A usearch graph of one scope; rows are numbered by the index, never reused."""

    __slots__ = ("graph", "keys")

    def __init__(self, dimensions: int, graph_type: Any) -> None:
        self.graph = graph_type(ndim=dimensions, metric="ip", dtype="f16")
        self.keys: dict[int, str] = {}

    @property
    def live(self) -> int:
        return len(self.keys)

    def add(self, key: str, vector: Any, row: int) -> int:
        self.graph.add(row, vector)
        self.keys[row] = key
        return row

    def remove(self, row: int) -> dict[str, int]:
        if self.keys.pop(row, None) is not None:
            self.graph.remove(row)
        return {}

    def search(self, vector: Any, k: int) -> list[tuple[str, float]]:
        found = self.graph.search(vector, k)
        keys = self.keys
        # Inner-product distance is 1 - cosine for normalised vectors.
        return [
            (keys[int(row)], 1.0 - float(distance))
            for row, distance in zip(found.keys, found.distances, strict=True)
            if int(row) in keys
        ]


def _graph_type() -> Any:
    try:
        from usearch.index import Index
    except ImportError:
        return None
    return Index


class SemanticIndex:
    """Vectors by scope; ``add`` returns the keys it evicted to stay within bounds."""

    def __init__(
        self, dimensions: int, *, max_entries: int = 100_000, graph_from: int = GRAPH_FROM
    ) -> None:
        self.dimensions = dimensions
        self.max_entries = max_entries
        self.graph_from = graph_from
        self._graph_type = _graph_type()
        if self._graph_type is None:
            logger.info("semantic cache: usearch is not installed; every scope stays exact")
        self._scopes: dict[str, _Exact | _Graph] = {}
        # key -> (scope, row), oldest first.
        self._where: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._rows = itertools.count()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def graphs(self) -> int:
        """How many scopes are searched through a graph."""
        return sum(isinstance(table, _Graph) for table in self._scopes.values())

    def add(self, scope: str, key: str, vector: Any) -> list[str]:
        if key in self._where:
            self.remove(key)
        vector = np.asarray(vector, dtype=np.float32)
        table = self._scopes.get(scope)
        if table is None:
            table = self._scopes[scope] = _Exact(self.dimensions)
        elif isinstance(table, _Exact) and table.live >= self.graph_from and self._graph_type:
            table = self._to_graph(scope, table)
        if isinstance(table, _Graph):
            row = table.add(key, vector, next(self._rows))
        else:
            row = table.add(key, vector)
        self._where[key] = (scope, row)
        evicted = []
        while len(self._where) > self.max_entries:
            oldest = next(iter(self._where))
            self.remove(oldest)
            evicted.append(oldest)
        return evicted

    def _to_graph(self, scope: str, exact: _Exact) -> _Graph:
        graph = _Graph(self.dimensions, self._graph_type)
        live = [(row, key) for row, key in enumerate(exact.keys) if key is not None]
        rows = np.fromiter(itertools.islice(self._rows, len(live)), dtype=np.uint64)
        graph.graph.add(rows, exact.matrix[[row for row, _ in live]])
        for new_row, (_, key) in zip(rows.tolist(), live, strict=True):
            graph.keys[new_row] = key
            self._where[key] = (scope, new_row)
        self._scopes[scope] = graph
        return graph

    def remove(self, key: str) -> None:
        found = self._where.pop(key, None)
        if found is None:
            return
        scope, row = found
        table = self._scopes[scope]
        moved = table.remove(row)
        if table.live == 0:
            del self._scopes[scope]
        for other, new_row in moved.items():
            self._where[other] = (scope, new_row)

    def search(self, scope: str, vector: Any, k: int = 4) -> list[tuple[str, float]]:
        """The ``k`` nearest live entries of ``scope``, most similar first."""
        table = self._scopes.get(scope)
        if table is None:
            return []
        return table.search(np.asarray(vector, dtype=np.float32), k)
