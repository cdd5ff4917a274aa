"""Count and sanity-check bench/heldout2/pairs.jsonl (stdlib only).

Usage: python3 bench/heldout2/count.py [path]
"""

import collections
import json
import os
import sys

path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "pairs.jsonl")
rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]

problems = []
seen = set()
for i, r in enumerate(rows, 1):
    if set(r) != {"a", "b", "expect", "category", "domain"}:
        problems.append(f"line {i}: unexpected keys {sorted(r)}")
    if r["expect"] not in ("hit", "miss"):
        problems.append(f"line {i}: bad expect {r['expect']!r}")
    if (r["expect"] == "hit") != (r["category"] == "paraphrase"):
        problems.append(f"line {i}: expect/category mismatch")
    for k in ("a", "b"):
        n = len(r[k].split())
        if not 4 <= n <= 25:
            problems.append(f"line {i}: {k} has {n} words")
    if r["a"].strip().lower() == r["b"].strip().lower():
        problems.append(f"line {i}: a == b ignoring case")
    key = frozenset((r["a"].lower(), r["b"].lower()))
    if key in seen:
        problems.append(f"line {i}: duplicate pair")
    seen.add(key)

print(f"pairs: {len(rows)}")
for name in ("expect", "category", "domain"):
    c = collections.Counter(r[name] for r in rows)
    print(f"\nby {name} ({len(c)}):")
    for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {k:16s} {v}")
print("\nproblems:", len(problems))
for p in problems:
    print("  " + p)
sys.exit(1 if problems else 0)
