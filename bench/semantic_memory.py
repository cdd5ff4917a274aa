"""What a semantic cache entry costs in memory, and what a lookup costs, with 100,000
entries in the two layouts that matter:

* ``scopes``: 100,000 scopes of one question each (every multi-turn conversation is a
  scope of its own: its earlier turns are part of it);
* ``one``: 100,000 questions in one scope (a route whose clients send one system prompt
  and single questions), searched through the usearch graph.

Entries join the index as a worker adds them (:class:`SemanticCache`, which also keeps
each question's text for the verifier), with keys and scopes shaped as the cache makes
them and questions of about 70 characters; vectors are random unit rows of the static
embedder's 256 dimensions. Memory is measured two ways, each in a fresh process:

* ``rss``: how much the process's resident set grew while the entries were added
  (everything: numpy's arrays, usearch's graph, Python's objects, the allocator's slack);
* ``tracemalloc``: what Python's allocators hold once the entries are in (numpy's arrays
  included; not usearch's graph, which tracemalloc cannot see, nor the allocator's slack).

A lookup is timed as :func:`bench_semantic_cache.lookup_cost` times it: embedding a
question (static embedder), searching the scope for a vector near a stored one, and the
rule verifier on a paraphrase; p50 and p99 of 2,000 lookups, and the share where the
stored vector came first (recall@1). Each lookup is timed twice: by the wall clock, and by
the CPU time of its thread (``time.thread_time``), which leaves out the time other
processes of a shared machine took the core: the lookup's own cost.

    .venv/bin/python bench/semantic_memory.py          # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

RESULTS = HERE / "results"
ENTRIES = 100_000
DIMENSIONS = 256
LAYOUTS = {"scopes": ENTRIES, "one": 1}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _NoEmbedder:
    name = "bench"

    async def close(self) -> None:
        return None


def _fill(scopes: int, vectors: Any, digests: list[str]) -> Any:
    """A semantic cache holding ``len(vectors)`` entries over ``scopes`` scopes; every
    string it keeps is made here, inside what is measured."""
    from edgeproxy._cache.semantic import SemanticCache

    cache = SemanticCache(_NoEmbedder(), spawn=lambda _: None, max_entries=len(vectors))
    index = cache._index_for(vectors[0])
    assert index is not None
    tenant = "t0f3a9c2d41b7e856"
    for i, vector in enumerate(vectors):
        # As keys.py makes them: '<tenant>:<40 hex>' and '<tenant>:sem:<40 hex>'.
        scope = f"{tenant}:sem:{digests[i % scopes]}"
        key = f"{tenant}:{digests[-1 - i]}"
        question = f"How do I change setting number {i} of the billing page for my team?"
        cache._add(index, scope, key, question, vector)
    return cache


def measure(layout: str, how: str, repeat: int) -> dict[str, Any]:
    """One layout, one way of measuring memory, in this process (a fresh one)."""
    import numpy as np

    scopes = LAYOUTS[layout]
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((ENTRIES, DIMENSIONS)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    digests = [f"{i:040x}" for i in rng.integers(0, 2**62, size=ENTRIES)]
    # Imported and warmed before the measurement: module objects are not per entry.
    from edgeproxy._cache.semantic_index import SemanticIndex

    warm = SemanticIndex(DIMENSIONS, graph_from=8)
    for i in range(16):
        warm.add("w", f"w{i}", vectors[i])
    del warm
    gc.collect()
    out: dict[str, Any] = {"layout": layout, "entries": ENTRIES, "scopes": scopes}
    if how == "tracemalloc":
        import tracemalloc

        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        cache = _fill(scopes, vectors, digests)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        out["tracemalloc_bytes_per_entry"] = round(held / ENTRIES, 1)
        return out
    before = _rss()
    started = time.perf_counter()
    cache = _fill(scopes, vectors, digests)
    out["add_us"] = round(1e6 * (time.perf_counter() - started) / ENTRIES, 1)
    gc.collect()
    out["rss_bytes_per_entry"] = round((_rss() - before) / ENTRIES, 1)
    index = cache.index
    out["vector_bytes_per_entry"] = round(index.nbytes() / ENTRIES, 1)
    out["kinds"] = index.scopes()
    out.update(_lookups(index, vectors, digests, scopes, repeat))
    return out


def _lookups(
    index: Any, vectors: Any, digests: list[str], scopes: int, repeat: int
) -> dict[str, Any]:
    import numpy as np
    from bench_semantic_cache import _embed_sync

    from edgeproxy._cache.semantic_embed import make_embedder
    from edgeproxy._cache.semantic_verify import differences
    from edgeproxy._core.config import config_from_mapping

    config = config_from_mapping({"regions": [{"name": "r", "url": "http://127.0.0.1:1"}]})
    embedder = make_embedder(config.cache, config.base_dir)
    rng = np.random.default_rng(2)
    question = "How can I turn on two-factor authentication for my account?"
    cached = "How do I enable two-factor authentication on my account?"
    tenant = "t0f3a9c2d41b7e856"
    parts: dict[str, list[float]] = {
        "embed": [],
        "search": [],
        "verify": [],
        "lookup": [],
        "lookup_cpu": [],
    }
    found = 0
    for i in range(repeat + 20):
        target = int(rng.integers(ENTRIES))
        near = vectors[target] + 0.04 * rng.standard_normal(DIMENSIONS).astype(np.float32)
        near /= np.linalg.norm(near)
        scope = f"{tenant}:sem:{digests[target % scopes]}"
        c0 = time.thread_time()
        t0 = time.perf_counter()
        _embed_sync(embedder, question)
        t1 = time.perf_counter()
        best = index.search(scope, near, 4)
        t2 = time.perf_counter()
        differences(question, cached)
        t3 = time.perf_counter()
        c3 = time.thread_time()
        if i >= 20:  # the first are a warm-up
            found += bool(best) and best[0][0] == f"{tenant}:{digests[-1 - target]}"
            parts["embed"].append(t1 - t0)
            parts["search"].append(t2 - t1)
            parts["verify"].append(t3 - t2)
            parts["lookup"].append(t3 - t0)
            parts["lookup_cpu"].append(c3 - c0)
    out: dict[str, Any] = {"recall_at_1": round(found / repeat, 3)}
    for name, values in parts.items():
        values.sort()
        out[f"{name}_p50_us"] = round(1e6 * values[len(values) // 2], 1)
        out[f"{name}_p99_us"] = round(1e6 * values[int(len(values) * 0.99)], 1)
    return out


def _child(layout: str, how: str, repeat: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", layout, how, "--repeat", str(repeat)],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{ENTRIES:,} entries, {DIMENSIONS} dimensions; memory per entry with its key, scope "
        "and question text.",
        "",
        "| layout | scopes | RSS growth | tracemalloc | vectors | add | lookup p50 | lookup p99 "
        "| lookup CPU p50 | lookup CPU p99 | search p99 | recall@1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['scopes']:,} | {r['rss_bytes_per_entry']:,.0f} B "
            f"| {r['tracemalloc_bytes_per_entry']:,.0f} B | {r['vector_bytes_per_entry']:,.0f} B "
            f"| {r['add_us']} us | {r['lookup_p50_us']} us | {r['lookup_p99_us']} us "
            f"| {r['lookup_cpu_p50_us']} us | {r['lookup_cpu_p99_us']} us "
            f"| {r['search_p99_us']} us | {r['recall_at_1']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("LAYOUT", "HOW"), help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=2000, help="lookups timed per layout")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.repeat)))
        return 0
    rows = []
    for layout in LAYOUTS:
        row = _child(layout, "rss", args.repeat)
        row.update(_child(layout, "tracemalloc", args.repeat))
        rows.append(row)
    text = markdown(rows)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "semantic_memory.md").write_text(text)
    (RESULTS / "semantic_memory.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
