"""The semantic cache on questions nobody tuned it on: the held-out set of bench/heldout/.

    python bench/semantic_heldout.py [--set heldout2 heldout2gen] [--name round2]
                                     [--old-rev 40275a3] [--threshold 0.68]

The set was written blind to the verifier (bench/heldout/README.md) and the verifier was
frozen (its commit) before this ran. For each pair ``b`` is the new question and ``a`` the
cached one; a pair is *served* when the static embedder finds them at least
``--threshold`` alike and the verifier finds no difference. Printed side by side, in one
run: the verifier of ``--old-rev`` (read from git) and the current one, by category and
by domain, with each near-miss rate's exact (Clopper-Pearson) 95% upper bound, for the
verifier alone and for the cache (embedding and verifier). Writes the tables to
bench/results/semantic_heldout.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from edgeproxy._cache.semantic_verify import differences  # noqa: E402

sys.path.insert(0, str(HERE))
from bench_semantic_cache import similarities  # noqa: E402

VERIFIER = "edgeproxy/_cache/semantic_verify.py"
Verifier = Callable[[str, str], list[str]]


def load(folders: list[Path]) -> list[dict[str, Any]]:
    pairs = []
    for folder in folders:
        for name in ("pairs.jsonl", "generated.jsonl"):
            path = folder / name
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                if line.strip():
                    pairs.append(json.loads(line))
    return pairs


def old_verifier(rev: str) -> Verifier:
    """``differences`` as the verifier was at ``rev`` (read from git)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{VERIFIER}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    spec = importlib.util.spec_from_loader("old_semantic_verify", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"{rev}:{VERIFIER}", "exec"), module.__dict__)  # noqa: S102
    return module.differences  # type: ignore[no-any-return]


def upper_bound(k: int, n: int, confidence: float = 0.95) -> float:
    """The exact one-sided Clopper-Pearson upper bound of a rate seen k times in n."""
    if n == 0:
        return 1.0
    if k >= n:
        return 1.0
    alpha = 1.0 - confidence

    def cdf(p: float) -> float:  # P(X <= k) for X ~ Binomial(n, p), in log space
        log_p, log_q = math.log(p), math.log1p(-p)
        head = math.lgamma(n + 1)
        return sum(
            math.exp(
                head - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
            )
            for i in range(k + 1)
        )

    low, high = k / n, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if cdf(mid) > alpha:
            low = mid
        else:
            high = mid
    return high


def rows(
    pairs: list[dict[str, Any]],
    sims: list[float],
    threshold: float,
    verifiers: dict[str, Verifier],
    key: str,
) -> list[dict[str, Any]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, pair in enumerate(pairs):
        # By domain, near misses and paraphrases apart: their rates mean opposite things.
        name = pair[key] if key == "category" else f"{pair[key]} ({pair['expect']})"
        groups[name].append(i)
    out = []
    for name, members in sorted(groups.items()):
        expect = pairs[members[0]]["expect"]
        row: dict[str, Any] = {"group": name, "expect": expect, "n": len(members)}
        for label, verify in verifiers.items():
            alone = sum(1 for i in members if not verify(pairs[i]["b"], pairs[i]["a"]))
            cached = sum(
                1
                for i in members
                if sims[i] >= threshold and not verify(pairs[i]["b"], pairs[i]["a"])
            )
            row[f"{label} alone"] = alone
            row[f"{label} cache"] = cached
        out.append(row)
    return out


def total(
    pairs: list[dict[str, Any]], sims: list[float], threshold: float, verify: Verifier, expect: str
) -> tuple[int, int, int]:
    members = [i for i, p in enumerate(pairs) if p["expect"] == expect]
    alone = sum(1 for i in members if not verify(pairs[i]["b"], pairs[i]["a"]))
    cached = sum(
        1 for i in members if sims[i] >= threshold and not verify(pairs[i]["b"], pairs[i]["a"])
    )
    return len(members), alone, cached


def markdown(title: str, table: list[dict[str, Any]], labels: list[str]) -> str:
    head = ["group", "expect", "n"] + [
        f"{lab} {kind}" for lab in labels for kind in ("alone", "cache")
    ]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table:
        cells = [row["group"], row["expect"], str(row["n"])]
        for lab in labels:
            for kind in ("alone", "cache"):
                k = row[f"{lab} {kind}"]
                cells.append(f"{k} ({100 * k / row['n']:.1f}%)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-rev", default="40275a3", help="the verifier to compare with")
    parser.add_argument("--threshold", type=float, default=0.68)
    parser.add_argument(
        "--set", nargs="+", default=["heldout"], help="the folders of bench/ with the set"
    )
    parser.add_argument("--name", default="heldout", help="the results file's suffix")
    parser.add_argument("--new-rev", help="the verifier to measure, if not the checkout's")
    args = parser.parse_args()
    pairs = load([HERE / name for name in args.set])
    sims = asyncio.run(similarities(pairs))
    new = differences if args.new_rev is None else old_verifier(args.new_rev)
    verifiers = {"old": old_verifier(args.old_rev), "new": new}
    labels = list(verifiers)
    out = [
        f"Held-out set: {len(pairs)} pairs ({', '.join(f'bench/{n}/' for n in args.set)}), "
        f"threshold {args.threshold}, "
        f"old verifier {args.old_rev}, new verifier {args.new_rev or 'of the checkout'}.\n"
    ]
    summary = [
        "| verifier | what | n | alone | alone 95% upper | cache | cache 95% upper |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, verify in verifiers.items():
        for expect, what in (
            ("miss", "near misses served (false hits)"),
            ("hit", "paraphrases served"),
        ):
            n, alone, cached = total(pairs, sims, args.threshold, verify, expect)
            bounds = [
                f"{100 * upper_bound(k, n):.2f}%" if expect == "miss" else ""
                for k in (alone, cached)
            ]
            summary.append(
                f"| {label} | {what} | {n} | {alone} ({100 * alone / n:.2f}%) | {bounds[0]} "
                f"| {cached} ({100 * cached / n:.2f}%) | {bounds[1]} |"
            )
    out.append("\n".join(summary) + "\n")
    out.append(
        markdown("By category", rows(pairs, sims, args.threshold, verifiers, "category"), labels)
    )
    out.append(
        markdown(
            "By domain",
            rows(pairs, sims, args.threshold, verifiers, "domain"),
            labels,
        )
    )
    started = time.perf_counter()
    for pair in pairs:
        differences(pair["b"], pair["a"])
    per = (time.perf_counter() - started) / len(pairs) * 1e6
    out.append(f"New verifier: {per:.0f} µs per pair on average (warm lemma cache).\n")
    text = "\n".join(out)
    print(text)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / f"semantic_{args.name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
