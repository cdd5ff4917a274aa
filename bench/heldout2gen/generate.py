#!/usr/bin/env python3
"""Generate sibling-substitution near-miss pairs for the semantic cache.

Written blind: from a one-paragraph description of the task only, without
looking at the cache's code or any existing evaluation data.

Each pair is one question template filled with two different sibling terms
(same kind, different correct answers), so the expected cache result is a
miss. Stdlib only, fixed seed, deterministic output.
"""

import collections
import itertools
import json
import os
import random
import re

SEED = 20240602
TOTAL = 1200
HERE = os.path.dirname(os.path.abspath(__file__))

# "a" before a vowel-initial term -> "an" (u excluded: "a ukulele", "a used ...").
_ARTICLE = re.compile(r"\ba (?=[aeio])")


def fill(template, term):
    return _ARTICLE.sub("an ", template.replace("{x}", term))


def style(q, rng):
    """Vary surface form a little, like real user input."""
    r = rng.random()
    if r < 0.45:  # "What is ...?"
        return q[0].upper() + q[1:] + "?"
    if r < 0.75:  # "what is ..."
        return q
    if r < 0.90:  # "what is ...?"
        return q + "?"
    return q[0].upper() + q[1:]  # "What is ..."


def main():
    rng = random.Random(SEED)
    with open(os.path.join(HERE, "siblings.json")) as f:
        siblings = json.load(f)
    with open(os.path.join(HERE, "templates.json")) as f:
        templates = json.load(f)
    domains = sorted(siblings)
    base, extra = divmod(TOTAL, len(domains))
    quota = {d: base + (1 if i < extra else 0) for i, d in enumerate(domains)}

    rows = []
    for d in domains:
        cands = [
            (t, g, a, b)
            for t in templates[d]
            for g, grp in enumerate(siblings[d])
            for a, b in itertools.combinations(grp, 2)
        ]
        rng.shuffle(cands)
        # spread over groups first: round-robin by group so no group dominates
        by_group = collections.defaultdict(list)
        for c in cands:
            by_group[c[1]].append(c)
        picked, order = [], list(by_group)
        rng.shuffle(order)
        while len(picked) < quota[d] and any(by_group.values()):
            for g in order:
                if by_group[g] and len(picked) < quota[d]:
                    picked.append(by_group[g].pop())
        for t, _, x, y in picked:
            if rng.random() < 0.5:
                x, y = y, x
            rows.append(
                {
                    "a": style(fill(t, x), rng),
                    "b": style(fill(t, y), rng),
                    "expect": "miss",
                    "category": "sibling-substitution",
                    "domain": d,
                }
            )
    rng.shuffle(rows)
    with open(os.path.join(HERE, "generated.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")

    counts = collections.Counter(r["domain"] for r in rows)
    for d in domains:
        print(f"{d:14s} {counts[d]}")
    print(f"{'total':14s} {len(rows)}")


if __name__ == "__main__":
    main()
