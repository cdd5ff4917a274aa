"""The semantic cache's index in each worker: normalised vectors by scope, searched by
cosine similarity, sized by its entries rather than by its scopes.

A search only ever looks at one scope (everything a hit must share but the question).
Scopes come in three sizes, each stored its own way:

* **Small** (up to ``SMALL_MAX`` questions): most scopes are one conversation, so one
  question. Their vectors share one arena of half-precision rows, allocated in blocks,
  the lowest free row first, its last blocks given back as they empty; a scope is a list
  of its row numbers. A one-question scope costs its vector (512 bytes at 256
  dimensions) and its bookkeeping, not a matrix of its own: a matrix per scope,
  preallocated, cost 9 to 10 KB an entry when every conversation was a scope. Searching
  one gathers at most ``SMALL_MAX`` rows. Half precision moves a cosine by about 1e-3,
  well inside what the threshold and the verifier decide on.
* **Exact** (up to ``graph_from``): a contiguous float32 matrix searched with one
  matrix-vector product (numpy has no fast half-precision product), grown by a quarter
  at a time. A removed row is marked dead and the matrix compacted once half of it is.
* **Graph** (past ``graph_from``): a route whose clients send one system prompt and single
  questions puts every question of a model in one scope, and at 100,000 rows the exact
  product costs milliseconds. Such a scope moves into a usearch HNSW graph of 8-bit
  vectors (each component times 127, rounded: searched by integer inner products, a
  quarter faster than half precision at the same recall, and half its bytes; a
  similarity comes out within about 0.003 of the exact one, 0.013 at most in 12,000
  measured). The graph is approximate: a question it misses is a miss, an upstream call,
  never a wrong hit, since every candidate still goes to the verifier. Without usearch
  installed, scopes stay exact.

Measured by bench/semantic_memory.py (RSS growth of a fresh process, 256 dimensions,
each entry with its key, scope and question text): 100,000 one-question scopes cost
1.37 KB an entry (9.1 KB with a matrix per scope), 100,000 questions in one scope (a
graph) 1.35 KB. An inverted file in numpy (256 centroids drawn from the scope, 16 probed)
was tried instead of the graph: adds of 8 us, but searches of 0.8 ms at p99 for a recall
of 0.91, its lists unbalanced by the centroids' hubness in 256 dimensions.

The index is bounded: past ``max_entries`` the oldest entries go first.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import OrderedDict
from typing import Any, Final

import numpy as np

__all__ = ["GRAPH_FROM", "SMALL_MAX", "SemanticIndex"]

logger = logging.getLogger("edgeproxy.cache")

# Rows past which a scope is searched through a graph: below it the exact product is
# cheaper than the graph's search (bench/bench_semantic_cache.py).
GRAPH_FROM: Final = 4096
# Rows a scope keeps in the shared arena: gathering that many rows for a search costs a
# few microseconds; past it the scope gets a matrix of its own, searched without a gather.
SMALL_MAX: Final = 16
# Arena rows per block: 512 KB at 256 dimensions in half precision, so the arena grows
# without copying what it holds and wastes at most one block.
_BLOCK_BITS: Final = 10
_BLOCK: Final = 1 << _BLOCK_BITS
_BLOCK_MASK: Final = _BLOCK - 1


class _Arena:
    """The vectors of every small scope, in blocks of half-precision rows. The lowest free
    row is given out first, so that as entries come and go the last blocks empty, and an
    empty last block is given back: the arena follows the entries it holds, not the most
    it ever held."""

    __slots__ = ("blocks", "dimensions", "free", "live", "top")

    def __init__(self, dimensions: int) -> None:
        self.dimensions = dimensions
        self.blocks: list[Any] = []
        self.live: list[int] = []  # rows in use, per block
        self.free: list[int] = []  # a heap of the free rows below top
        self.top = 0  # rows from there on were never given out

    def put(self, vector: Any) -> int:
        if self.free:
            row = heapq.heappop(self.free)
        else:
            row = self.top
            self.top += 1
            if row >> _BLOCK_BITS == len(self.blocks):
                self.blocks.append(np.empty((_BLOCK, self.dimensions), dtype=np.float16))
                self.live.append(0)
        self.live[row >> _BLOCK_BITS] += 1
        self.blocks[row >> _BLOCK_BITS][row & _BLOCK_MASK] = vector
        return row

    def row(self, row: int) -> Any:
        return self.blocks[row >> _BLOCK_BITS][row & _BLOCK_MASK]

    def rows(self, rows: list[int]) -> Any:
        """The rows as one float32 matrix."""
        blocks = self.blocks
        out = np.empty((len(rows), self.dimensions), dtype=np.float32)
        for i, row in enumerate(rows):
            out[i] = blocks[row >> _BLOCK_BITS][row & _BLOCK_MASK]
        return out

    def release(self, row: int) -> None:
        live = self.live
        live[row >> _BLOCK_BITS] -= 1
        heapq.heappush(self.free, row)
        if live[-1]:
            return
        while live and not live[-1]:
            live.pop()
            self.blocks.pop()
        self.top = min(self.top, len(live) << _BLOCK_BITS)
        self.free = [free for free in self.free if free < self.top]
        heapq.heapify(self.free)

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for block in self.blocks)


class _Small:
    """A scope of at most ``SMALL_MAX`` questions, its vectors in the arena: the row
    numbers and their keys, in two parallel lists."""

    __slots__ = ("keys", "rows")

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.keys: list[str] = []

    @property
    def live(self) -> int:
        return len(self.rows)

    def search(self, arena: _Arena, vector: Any, k: int) -> list[tuple[str, float]]:
        rows = self.rows
        if len(rows) == 1:
            return [(self.keys[0], float(arena.row(rows[0]).astype(np.float32) @ vector))]
        scores = (arena.rows(rows) @ vector).tolist()
        ranked = sorted(zip(scores, self.keys, strict=True), key=lambda pair: -pair[0])
        return [(key, score) for score, key in ranked[:k]]


class _Exact:
    __slots__ = ("dead", "keys", "matrix", "size")

    def __init__(self, matrix: Any, keys: list[str | None]) -> None:
        self.matrix = matrix
        self.keys = keys
        self.size = len(keys)
        self.dead = 0

    @property
    def live(self) -> int:
        return self.size - self.dead

    def add(self, key: str, vector: Any) -> int:
        if self.size == len(self.matrix):
            # A quarter more: the slack stays a quarter of a vector an entry at most.
            grown = np.empty((_grown(self.size), self.matrix.shape[1]), dtype=np.float32)
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
        # A new, tight matrix: compacting in place would keep the capacity of the largest
        # the scope ever was.
        matrix = np.empty((_grown(len(live)), self.matrix.shape[1]), dtype=np.float32)
        matrix[: len(live)] = self.matrix[live]
        self.matrix = matrix
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


def _grown(size: int) -> int:
    return size + max(4, size // 4)


# A graph's vectors are unit vectors times this, rounded to 8-bit integers.
_SCALE: Final = 127
# The graph's links per node and its search breadth, measured on 100,000 random vectors
# (bench/semantic_memory.py, 2 cores): usearch's own 16 and 64 find the nearest 83% of the
# time in 0.45 ms (p50); 32 and 32, 94% in 0.41 ms; 32 and 24, 89% in 0.35 ms, which keeps
# a whole lookup (embedding, search, verifier) under 1 ms at p99. The links cost about
# 100 bytes an entry more.
_CONNECTIVITY: Final = 32
_EXPANSION: Final = 24
_SCALE2: Final = float(_SCALE * _SCALE)


def _bytes(vectors: Any) -> Any:
    return np.clip(np.rint(vectors * _SCALE), -_SCALE, _SCALE).astype(np.int8)


class _Graph:
    """A usearch graph of one scope; rows are numbered by the index, never reused."""

    __slots__ = ("graph", "keys")

    def __init__(self, dimensions: int, graph_type: Any) -> None:
        # Quantized here, not by usearch: its inner product of 8-bit vectors is then the
        # integer dot product, whose scale is known (its own "cos" on 8 bits is no faster
        # than half precision).
        self.graph = graph_type(
            ndim=dimensions,
            metric="ip",
            dtype="i8",
            connectivity=_CONNECTIVITY,
            expansion_search=_EXPANSION,
        )
        self.keys: dict[int, str] = {}

    @property
    def live(self) -> int:
        return len(self.keys)

    def add(self, key: str, vector: Any, row: int) -> int:
        self.graph.add(row, _bytes(vector))
        self.keys[row] = key
        return row

    def add_many(self, rows: Any, matrix: Any, keys: list[str]) -> None:
        self.graph.add(rows, _bytes(matrix))
        for row, key in zip(rows.tolist(), keys, strict=True):
            self.keys[row] = key

    def remove(self, row: int) -> dict[str, int]:
        if self.keys.pop(row, None) is not None:
            self.graph.remove(row)
        return {}

    def search(self, vector: Any, k: int) -> list[tuple[str, float]]:
        found = self.graph.search(_bytes(vector), k)
        keys = self.keys
        # usearch's inner-product distance is 1 - the dot product, here of the vectors
        # times 127: the cosine, to within the rounding.
        return [
            (keys[int(row)], (1.0 - float(distance)) / _SCALE2)
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
        self,
        dimensions: int,
        *,
        max_entries: int = 100_000,
        graph_from: int = GRAPH_FROM,
        small_max: int = SMALL_MAX,
    ) -> None:
        self.dimensions = dimensions
        self.max_entries = max_entries
        self.graph_from = graph_from
        self.small_max = min(small_max, graph_from)
        self._graph_type = _graph_type()
        if self._graph_type is None:
            logger.info("semantic cache: usearch is not installed; every scope stays exact")
        self._arena = _Arena(dimensions)
        self._scopes: dict[str, _Small | _Exact | _Graph] = {}
        # key -> (scope, row), oldest first. A small scope's row is the arena's, an exact
        # scope's its matrix's, a graph's its own label.
        self._where: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._rows = itertools.count()
        self._graphs = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def graphs(self) -> int:
        """How many scopes are searched through a graph."""
        return self._graphs

    def scopes(self) -> dict[str, int]:
        """How many scopes are stored each way: ``small``, ``exact``, ``graph``."""
        out = {"small": 0, "exact": 0, "graph": 0}
        for table in self._scopes.values():
            kind = "small" if isinstance(table, _Small) else "exact"
            out["graph" if isinstance(table, _Graph) else kind] += 1
        return out

    def nbytes(self) -> int:
        """The bytes of the vectors held: the arena's blocks, the exact matrices, the
        graphs' 8-bit vectors. Bookkeeping (keys, scopes, a graph's links) comes on top."""
        held = self._arena.nbytes
        for table in self._scopes.values():
            if isinstance(table, _Exact):
                held += table.matrix.nbytes
            elif isinstance(table, _Graph):
                held += table.live * self.dimensions
        return held

    def add(self, scope: str, key: str, vector: Any) -> list[str]:
        if key in self._where:
            self.remove(key)
        vector = np.asarray(vector, dtype=np.float32)
        table = self._scopes.get(scope)
        if table is None:
            table = self._scopes[scope] = _Small()
        if isinstance(table, _Small):
            if table.live < self.small_max:
                row = self._arena.put(vector)
                table.rows.append(row)
                table.keys.append(key)
                self._where[key] = (scope, row)
                return self._evict()
            table = self._to_exact(scope, table)
        if isinstance(table, _Exact) and table.live >= self.graph_from and self._graph_type:
            table = self._to_graph(scope, table)
        if isinstance(table, _Graph):
            row = table.add(key, vector, next(self._rows))
        else:
            row = table.add(key, vector)
        self._where[key] = (scope, row)
        return self._evict()

    def _evict(self) -> list[str]:
        evicted = []
        while len(self._where) > self.max_entries:
            oldest = next(iter(self._where))
            self.remove(oldest)
            evicted.append(oldest)
        return evicted

    def _to_exact(self, scope: str, small: _Small) -> _Exact:
        arena = self._arena
        live = len(small.rows)
        matrix = np.empty((_grown(live), self.dimensions), dtype=np.float32)
        matrix[:live] = arena.rows(small.rows)
        for row in small.rows:
            arena.release(row)
        exact = _Exact(matrix, list(small.keys))
        for new_row, key in enumerate(small.keys):
            self._where[key] = (scope, new_row)
        self._scopes[scope] = exact
        return exact

    def _to_graph(self, scope: str, exact: _Exact) -> _Graph:
        graph = _Graph(self.dimensions, self._graph_type)
        live = [(row, key) for row, key in enumerate(exact.keys) if key is not None]
        rows = np.fromiter(itertools.islice(self._rows, len(live)), dtype=np.uint64)
        keys = [key for _, key in live]
        graph.add_many(rows, exact.matrix[[row for row, _ in live]], keys)
        for new_row, key in zip(rows.tolist(), keys, strict=True):
            self._where[key] = (scope, new_row)
        self._scopes[scope] = graph
        self._graphs += 1
        return graph

    def remove(self, key: str) -> None:
        found = self._where.pop(key, None)
        if found is None:
            return
        scope, row = found
        table = self._scopes[scope]
        if isinstance(table, _Small):
            at = table.rows.index(row)
            del table.rows[at], table.keys[at]
            self._arena.release(row)
            moved: dict[str, int] = {}
        else:
            moved = table.remove(row)
        if table.live == 0:
            del self._scopes[scope]
            self._graphs -= isinstance(table, _Graph)
        for other, new_row in moved.items():
            self._where[other] = (scope, new_row)

    def search(self, scope: str, vector: Any, k: int = 4) -> list[tuple[str, float]]:
        """The ``k`` nearest live entries of ``scope``, most similar first."""
        table = self._scopes.get(scope)
        if table is None:
            return []
        vector = np.asarray(vector, dtype=np.float32)
        if isinstance(table, _Small):
            return table.search(self._arena, vector, k)
        return table.search(vector, k)
