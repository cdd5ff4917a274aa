"""The semantic index's layout: small scopes in the shared arena, larger ones in matrices of
their own, the largest in a graph. Whatever the layout, a search sees its own scope's live
entries only, eviction takes the oldest, a removed entry is never found, and a scope of one
question costs about one half-precision vector.

Vectors are one-hot, so every similarity is exactly 1 or 0, in half precision too, and a
search asked for every entry of a scope lists exactly that scope's live entries."""

from __future__ import annotations

import random

import numpy as np
import pytest

from edgeproxy._cache.semantic_index import SemanticIndex

DIMS = 64


def one_hot(i: int) -> np.ndarray:
    v = np.zeros(DIMS, dtype=np.float32)
    v[i % DIMS] = 1.0
    return v


def listed(index: SemanticIndex, scope: str) -> set[str]:
    return {key for key, _ in index.search(scope, one_hot(0), k=DIMS)}


def test_a_scope_of_one_question_costs_about_one_half_precision_vector() -> None:
    index = SemanticIndex(256, max_entries=5000)
    rng = np.random.default_rng(3)
    for i in range(3000):
        index.add(f"conversation-{i}", f"k{i}", rng.standard_normal(256))
    assert index.scopes() == {"small": 3000, "exact": 0, "graph": 0}
    # 512 bytes a vector, and at most one block of the arena unused.
    assert 3000 * 512 <= index.nbytes() <= 3000 * 512 + 1024 * 512
    for i in range(3000):
        index.remove(f"k{i}")
    assert len(index) == 0 and index.nbytes() == 0


def test_the_arena_follows_the_entries_it_holds_not_the_most_it_held() -> None:
    index = SemanticIndex(256, max_entries=5000)
    rng = np.random.default_rng(4)
    for i in range(4000):
        index.add(f"c{i}", f"k{i}", rng.standard_normal(256))
    # The newest go: the blocks they filled go back.
    for i in range(1000, 4000):
        index.remove(f"k{i}")
    assert index.nbytes() <= 2 * 1024 * 512
    # Those that come next fill the lowest free rows, and are found.
    for i in range(4000, 4500):
        index.add(f"c{i}", f"k{i}", rng.standard_normal(256))
    assert index.nbytes() <= 2 * 1024 * 512
    assert [key for key, _ in index.search("c4400", rng.standard_normal(256))] == ["k4400"]
    assert len(index) == 1500


def test_each_kind_of_scope_sees_its_own_entries_only() -> None:
    pytest.importorskip("usearch", reason="usearch is not installed")
    index = SemanticIndex(DIMS, max_entries=1000, graph_from=40, small_max=4)
    sizes = {"small": 3, "exact": 20, "graph": 60}
    for scope, size in sizes.items():
        for i in range(size):
            index.add(scope, f"{scope}-{i}", one_hot(i))
    assert index.scopes() == {"small": 1, "exact": 1, "graph": 1}
    for scope in sizes:
        # The same vector is in every scope: each search finds its own scope's.
        found = index.search(scope, one_hot(2), k=1)
        assert found == [(f"{scope}-2", pytest.approx(1.0, abs=1e-3))]
        assert all(key.startswith(scope) for key, _ in index.search(scope, one_hot(2), k=8))
    assert index.search("nowhere", one_hot(2)) == []


def test_a_small_scope_grows_into_a_matrix_and_keeps_its_entries() -> None:
    index = SemanticIndex(DIMS, small_max=4, graph_from=10_000)
    for i in range(4):
        index.add("s", f"k{i}", one_hot(i))
    assert index.scopes()["small"] == 1
    index.add("s", "k4", one_hot(4))
    assert index.scopes() == {"small": 0, "exact": 1, "graph": 0}
    assert listed(index, "s") == {f"k{i}" for i in range(5)}
    for i in range(5):
        assert index.search("s", one_hot(i), k=1)[0][0] == f"k{i}"
    # Its rows left the arena, which another scope now reuses.
    index.add("t", "t0", one_hot(9))
    assert index.search("t", one_hot(9), k=1)[0][0] == "t0"
    assert index.search("s", one_hot(9), k=8)[0][1] == pytest.approx(0.0)


def test_eviction_takes_the_oldest_across_scopes_and_a_re_add_is_new() -> None:
    index = SemanticIndex(DIMS, max_entries=6, small_max=2, graph_from=10_000)
    for i in range(6):
        assert index.add(f"s{i % 3}", f"k{i}", one_hot(i)) == []
    # k0 asked again, in another scope: it moves there, and is now the newest.
    assert index.add("s2", "k0", one_hot(0)) == []
    assert "k0" not in listed(index, "s0") and "k0" in listed(index, "s2")
    assert index.add("s0", "k6", one_hot(6)) == ["k1"]
    assert index.add("s0", "k7", one_hot(7)) == ["k2"]
    assert index.add("s9", "k8", one_hot(8)) == ["k3"]
    assert len(index) == 6
    assert set().union(*(listed(index, f"s{i}") for i in (0, 1, 2, 9))) == {
        "k0",
        "k4",
        "k5",
        "k6",
        "k7",
        "k8",
    }


def test_random_adds_and_removals_match_a_plain_model() -> None:
    """Against a dict of scopes: what each search lists, after each step, across small and
    exact scopes, promotions, compactions and evictions."""
    rng = random.Random(11)
    index = SemanticIndex(DIMS, max_entries=48, small_max=3, graph_from=10_000)
    model: dict[str, str] = {}  # key -> scope, oldest first
    keys = [f"k{i}" for i in range(DIMS)]  # each its own one-hot vector
    scopes = [f"s{i}" for i in range(5)]
    for step in range(3000):
        key = rng.choice(keys)
        if rng.random() < 0.3:
            index.remove(key)
            model.pop(key, None)
        else:
            scope = rng.choice(scopes)
            evicted = index.add(scope, key, one_hot(int(key[1:])))
            model.pop(key, None)
            model[key] = scope
            expected = []
            while len(model) > 48:
                oldest = next(iter(model))
                del model[oldest]
                expected.append(oldest)
            assert evicted == expected, step
        assert len(index) == len(model)
        scope = rng.choice(scopes)
        members = {k for k, s in model.items() if s == scope}
        assert listed(index, scope) == members, step
        for member in list(members)[:3]:
            found = index.search(scope, one_hot(int(member[1:])), k=1)
            assert found[0][0] == member and found[0][1] == pytest.approx(1.0, abs=1e-3)
    for key in list(model):
        index.remove(key)
    assert len(index) == 0 and index.scopes() == {"small": 0, "exact": 0, "graph": 0}


def test_an_exact_scope_compacts_into_a_tighter_matrix() -> None:
    index = SemanticIndex(DIMS, small_max=2, graph_from=10_000)
    for i in range(60):
        index.add("s", f"k{i}", one_hot(i))
    big = index.nbytes()
    for i in range(50):
        index.remove(f"k{i}")
    assert index.nbytes() < big / 2
    assert listed(index, "s") == {f"k{i}" for i in range(50, 60)}


def test_a_graph_gives_similarities_close_to_the_exact_ones() -> None:
    pytest.importorskip("usearch", reason="usearch is not installed")
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((300, DIMS)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    index = SemanticIndex(DIMS, graph_from=64)
    for i, row in enumerate(rows):
        index.add("g", f"k{i}", row)
    assert index.graphs() == 1
    for i in range(0, 300, 15):
        near = rows[i] + 0.05 * rng.standard_normal(DIMS).astype(np.float32)
        near /= np.linalg.norm(near)
        found = index.search("g", near, k=4)
        assert found and found[0][0] == f"k{i}"
        for key, similarity in found:
            assert similarity == pytest.approx(float(rows[int(key[1:])] @ near), abs=0.03)
