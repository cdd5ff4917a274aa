"""Draw ``bench/instr.py``'s last run: each path's cost against the bare loop, per tree.

Reads ``bench/results/instr.json`` (or ``--json``) and draws one group of bars per path
(the JSON request through each target, and each stream per event), one bar per tree
measured side by side (``--tree NAME=DIR`` rows, and ``now``, this checkout), with the
issue's target as a mark where one is given (``--target PATH=RATIO``). Ratios are to the
reference loop of the same run: per request for JSON, per event for a stream.

    .venv/bin/python bench/instr_plot.py --out bench/results/instr-lane.png \\
        --target h1=1.3 --target h2c=1.35 --target hit=0.5 --target "h1 sse=1.1"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# Each path drawn: (label, target row name, kind).
PATHS = [
    ("h1 JSON", "h1", "json"),
    ("h2c JSON", "h2c", "json"),
    ("cache hit", "hit", "json"),
    ("h1 SSE/event", "h1 sse", "sse"),
    ("h2c SSE/event", "h2c sse", "sse"),
    ("h2c Responses/event", "h2c responses sse", "responses"),
    ("h2c Messages/event", "h2c messages sse", "messages"),
]
_REFERENCE = {
    "json": "reference",
    "sse": "reference sse",
    "responses": "reference responses sse",
    "messages": "reference messages sse",
}


def ratios(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{tree: {path label: ratio to the reference}} of a run's rows."""
    rows = [r for r in data["rows"] if not r.get("skipped")]

    def cost(row: dict[str, Any], kind: str) -> float:
        if kind == "json":
            return float(row["instructions"]) / row["requests"]
        return float(row["instructions"]) / row["events"]

    refs = {
        kind: cost(row, kind)
        for kind, name in _REFERENCE.items()
        for row in rows
        if row["name"] == name and row["requests"] and (kind == "json" or row["events"])
    }
    out: dict[str, dict[str, float]] = {}
    for label, name, kind in PATHS:
        if kind not in refs:
            continue
        for row in rows:
            if row["name"] != name or not row["requests"] or (kind != "json" and not row["events"]):
                continue
            tree = "now" if row["tree"] in ("", "-") else row["tree"]
            out.setdefault(tree, {})[label] = cost(row, kind) / refs[kind]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "instr.json")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "instr.png")
    parser.add_argument(
        "--target", action="append", default=[], metavar="ROW=RATIO", help="a target's mark"
    )
    parser.add_argument("--order", nargs="+", help="the trees, in this order")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("instr_plot: matplotlib is not installed; no figure")
        return 0
    by_tree = ratios(json.loads(args.json.read_text()))
    trees = args.order or sorted(by_tree)
    labels = [label for label, _, _ in PATHS if any(label in by_tree.get(t, {}) for t in trees)]
    targets = {}
    for item in args.target:
        name, _, value = item.rpartition("=")
        for label, row, _ in PATHS:
            if row == name:
                targets[label] = float(value)
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / max(1, len(trees))
    for i, tree in enumerate(trees):
        xs = [j + (i - (len(trees) - 1) / 2) * width for j in range(len(labels))]
        values = [by_tree.get(tree, {}).get(label, 0.0) for label in labels]
        bars = ax.bar(xs, values, width, label=tree)
        for bar, value in zip(bars, values, strict=True):
            if value:
                ax.annotate(
                    f"{value:.2f}",
                    (bar.get_x() + bar.get_width() / 2, value),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    for j, label in enumerate(labels):
        if label in targets:
            ax.hlines(targets[label], j - 0.45, j + 0.45, colors="black", linestyles="dashed")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=15, fontsize=8)
    ax.set_ylabel("instructions, x the bare aiohttp loop")
    ax.set_title("edgeproxy per request / per event (callgrind); dashed: the target")
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"instr_plot: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
