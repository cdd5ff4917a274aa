#!/usr/bin/env python3
"""Generate sibling-substitution near misses for the held-out semantic-cache set.

For every domain in siblings.json, every template in templates.json and every
group of sibling terms, a pair is (template with term t1, same template with a
sibling t2).  Siblings are terms of the same kind that are not interchangeable,
so the correct answer differs and the cache must miss.

Deterministic (fixed seed), stdlib only.  Writes generated.jsonl next to this
file, checks pairs.jsonl, and prints counts per category and per domain.

    python3 bench/heldout/generate.py            # write generated.jsonl + counts
    python3 bench/heldout/generate.py --check    # only validate and print counts
"""

import argparse
import collections
import itertools
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20240611
CAP = 1000  # total generated pairs, spread evenly over domains

PAIR_CATEGORIES = (
    "paraphrase",
    "negation",
    "antonym",
    "numbers",
    "entity",
    "sibling",
    "direction",
    "target-language",
    "format",
    "time",
    "scope",
)


def load(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return json.load(f)


def load_jsonl(name):
    path = os.path.join(HERE, name)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def words(s):
    return len(s.split())


def check_lists(siblings, templates):
    errors = []
    if set(siblings) != set(templates):
        errors.append("siblings.json and templates.json name different domains")
    for dom, groups in siblings.items():
        if len(groups) < 6:
            errors.append(f"{dom}: only {len(groups)} groups")
        seen = set()
        for g in groups:
            if not 2 <= len(g) <= 6:
                errors.append(f"{dom}: group size {len(g)}: {g}")
            for t in g:
                if t != t.lower():
                    errors.append(f"{dom}: term not lower-case: {t!r}")
                if t in seen:
                    errors.append(f"{dom}: term in two groups: {t!r}")
                seen.add(t)
    for dom, tpls in templates.items():
        if len(tpls) < 5:
            errors.append(f"{dom}: only {len(tpls)} templates")
        for t in tpls:
            if t.count("{x}") != 1:
                errors.append(f"{dom}: template needs exactly one {{x}}: {t!r}")
    return errors


def check_pairs(pairs):
    errors = []
    seen = set()
    for i, p in enumerate(pairs, 1):
        if set(p) != {"a", "b", "expect", "category", "domain"}:
            errors.append(f"pairs.jsonl:{i}: keys {sorted(p)}")
            continue
        if p["expect"] not in ("hit", "miss"):
            errors.append(f"pairs.jsonl:{i}: expect {p['expect']!r}")
        if p["category"] not in PAIR_CATEGORIES:
            errors.append(f"pairs.jsonl:{i}: category {p['category']!r}")
        if (p["category"] == "paraphrase") != (p["expect"] == "hit"):
            errors.append(f"pairs.jsonl:{i}: paraphrase must be hit, others miss")
        if p["a"].strip().lower() == p["b"].strip().lower():
            errors.append(f"pairs.jsonl:{i}: a == b")
        for q in (p["a"], p["b"]):
            if not 4 <= words(q) <= 25:
                errors.append(f"pairs.jsonl:{i}: {words(q)} words: {q!r}")
        key = (p["a"].lower(), p["b"].lower())
        if key in seen or key[::-1] in seen:
            errors.append(f"pairs.jsonl:{i}: duplicate pair")
        seen.add(key)
    return errors


def generate(siblings, templates, existing):
    rng = random.Random(SEED)
    domains = sorted(siblings)
    base, extra = divmod(CAP, len(domains))
    taken = {(p["a"], p["b"]) for p in existing} | {(p["b"], p["a"]) for p in existing}
    out = []
    for di, dom in enumerate(domains):
        quota = base + (1 if di < extra else 0)
        cells = []
        for tpl, group in itertools.product(templates[dom], siblings[dom]):
            cell = []
            for t1, t2 in itertools.combinations(group, 2):
                if rng.random() < 0.5:
                    t1, t2 = t2, t1
                cell.append((tpl.replace("{x}", t1), tpl.replace("{x}", t2)))
            rng.shuffle(cell)
            cells.append(cell)
        rng.shuffle(cells)
        picked = []
        # round-robin over (template, group) cells so every template and
        # every group is used before any is used twice
        while len(picked) < quota and any(cells):
            for cell in cells:
                if len(picked) >= quota:
                    break
                if cell:
                    a, b = cell.pop()
                    if (a, b) in taken:
                        continue
                    taken.add((a, b))
                    taken.add((b, a))
                    picked.append(
                        {
                            "a": a,
                            "b": b,
                            "expect": "miss",
                            "category": "sibling-substitution",
                            "domain": dom,
                        }
                    )
        out.extend(picked)
    return out


def table(title, counter):
    lines = [f"{title}", ""]
    width = max(len(k) for k in counter)
    for k, v in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {k:<{width}}  {v}")
    lines.append(f"  {'total':<{width}}  {sum(counter.values())}")
    return "\n".join(lines)


def counts(pairs, generated):
    parts = []
    parts.append(table("pairs.jsonl by expect", collections.Counter(p["expect"] for p in pairs)))
    parts.append(
        table("pairs.jsonl by category", collections.Counter(p["category"] for p in pairs))
    )
    parts.append(table("pairs.jsonl by domain", collections.Counter(p["domain"] for p in pairs)))
    parts.append(
        table(
            "generated.jsonl by domain (all sibling-substitution, expect miss)",
            collections.Counter(p["domain"] for p in generated),
        )
    )
    return "\n\n".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="validate and count only; write nothing")
    args = ap.parse_args()

    siblings = load("siblings.json")
    templates = load("templates.json")
    pairs = load_jsonl("pairs.jsonl")
    errors = check_lists(siblings, templates) + check_pairs(pairs)

    if args.check:
        generated = load_jsonl("generated.jsonl")
    else:
        generated = generate(siblings, templates, pairs)
        with open(os.path.join(HERE, "generated.jsonl"), "w", encoding="utf-8") as f:
            for p in generated:
                f.write(json.dumps(p, ensure_ascii=False) + "\n")
    for p in generated:
        for q in (p["a"], p["b"]):
            if not 4 <= words(q) <= 25:
                errors.append(f"generated: {words(q)} words: {q!r}")

    print(counts(pairs, generated))
    if errors:
        print("\nERRORS:", *errors, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
