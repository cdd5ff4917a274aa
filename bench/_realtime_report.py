"""The tables and the chart of ``bench/realtime.py``, from its results dict alone (so a
``realtime.json`` can be rendered again)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _report

DIRECT = "direct"
BARE = "bare relay"


def _us(value: float) -> str:
    return f"{value:,.1f}"


def report(data: dict[str, Any]) -> str:
    num, table = _report._num, _report._table
    meta = data["meta"]
    out = [
        "# WebSocket relay benchmark",
        "",
        f"{meta['when']}, commit {meta['commit']}, {meta['cpus']} CPUs; {meta['pinning']}. "
        f"Events: small {meta['event_bytes']['small']} B, audio {meta['event_bytes']['audio']} B. "
        f"Run took {meta['elapsed_s']} s.",
        "",
    ]
    if data["latency"]:
        out += [
            "## Round trip of a small event (region echoes it)",
            "",
            "Paths take turns in blocks; `added` is the path's percentile minus direct's, "
            "`x direct` the ratio; `others' CPU`: cores busy outside the benchmark meanwhile "
            "(all paths of a session count together).",
            "",
        ]
        rows = [
            [
                r["path"],
                str(r["sessions"]),
                num(r["messages"]),
                _us(r["p50_us"]),
                _us(r["p99_us"]),
                "-" if r["path"] == DIRECT else f"{r['added_p50_us']:+,.1f}",
                "-" if r["path"] == DIRECT else f"{r['added_p99_us']:+,.1f}",
                num(r["x_direct_p50"]),
                num(r["x_direct_p99"]),
                _report._foreign(r.get("foreign_cores"), 0.2),
            ]
            for r in data["latency"]
        ]
        head = ["path", "sessions", "messages", "p50 µs", "p99 µs", "added p50 µs"]
        head += ["added p99 µs", "x direct p50", "x direct p99", "others' CPU"]
        out += table(head, rows) + [""]
    if data["cpu"]:
        out += [
            "## CPU per relayed message",
            "",
            "The relay process's CPU time over the messages it relayed (a round trip is two); "
            "median round (min - max). `relay cores`: its CPU over the wall time of a round; "
            "`others' CPU`: cores busy outside the benchmark, the worst round.",
            "",
        ]
        rows = [
            [
                r["relay"],
                f"{r['event']} ({r['event_bytes']:,} B)",
                f"{r['rounds']} x {r['messages_per_round']:,}",
                f"{r['cpu_us_per_message']:.1f} ({r['cpu_us_min']:.1f} - {r['cpu_us_max']:.1f})",
                num(r["x_bare"]),
                num(r["relay_cores"]),
                num(r["messages_per_s"], 0),
                _report._foreign(r["foreign_cores"], 0.2),
            ]
            for r in data["cpu"]
        ]
        head = ["relay", "event", "messages", "CPU µs / message", "x bare", "relay cores"]
        head += ["messages/s", "others' CPU"]
        out += table(head, rows) + [""]
    if data["memory"]:
        out += [
            "## Memory per open session",
            "",
            "Idle sessions, each after its `session.created` and one round trip; "
            "(RSS with N - RSS after warm-up) / N. The region is a fresh process for each "
            "row; `direct` is the region alone.",
            "",
        ]
        bare = next((r for r in data["memory"] if r["path"] == BARE), None)
        rows = [
            [
                r["path"],
                num(r["sessions"]),
                "-" if r["path"] == DIRECT else f"{r['relay_rss_before_kib'] / 1024:.1f} MiB",
                "-" if r["path"] == DIRECT else f"{r['relay_rss_with_n_kib'] / 1024:.1f} MiB",
                "-" if r["path"] == DIRECT else f"{r['relay_kib_per_session']:.1f}",
                "-"
                if r["path"] in (DIRECT, BARE) or not bare
                else num(r["relay_kib_per_session"] / bare["relay_kib_per_session"]),
                f"{r['region_kib_per_session']:.1f}",
                f"{r['open_s']:.1f} s",
            ]
            for r in data["memory"]
        ]
        head = ["path", "sessions", "relay RSS before", "relay RSS with N"]
        head += ["relay KiB / session", "x bare", "region KiB / session", "opened in"]
        out += table(head, rows) + [""]
    if data["instructions"]:
        out += ["## Instructions per relayed message (callgrind)", ""]
        rows = [
            [
                r["relay"],
                r["event"],
                num(r["messages"]),
                f"{r['per_message'] / 1000:,.1f} k",
                num(r["x_bare"]),
            ]
            for r in data["instructions"]
        ]
        out += table(["relay", "event", "messages", "instructions / message", "x bare"], rows)
        out += [""]
    if data["notes"]:
        out += ["## Notes", ""] + [f"- {n}" for n in data["notes"]] + [""]
    return "\n".join(out)


def plot(data: dict[str, Any], path: Path) -> str | None:
    """Three panels: latency, CPU per message, KiB per session. A note when no PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no PNG"
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))

    def bars(ax: Any, groups: list[str], series: dict[str, list[float]], fmt: str) -> None:
        width = 0.8 / max(1, len(series))
        for i, (label, values) in enumerate(series.items()):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
            drawn = ax.bar(xs, values, width, label=label)
            ax.bar_label(drawn, fmt=fmt, fontsize=7, padding=2)
        ax.set_xticks(range(len(groups)), groups, fontsize=8)
        ax.legend(fontsize=8)
        ax.margins(y=0.15)

    lat = data["latency"]
    groups = [f"{r['path']}\n{r['sessions']} session(s)" for r in lat]
    bars(axes[0], groups, {q: [r[f"{q}_us"] for r in lat] for q in ("p50", "p99")}, "%.0f")
    axes[0].set_yscale("log")  # a p99 can be a hundred times its p50
    axes[0].set_ylabel("round trip, µs (log scale)")
    axes[0].set_title("Round trip of a small event")
    cpu = data["cpu"]
    relays = list(dict.fromkeys(r["relay"] for r in cpu))
    series = {
        kind: [
            next(r["cpu_us_per_message"] for r in cpu if r["relay"] == x and r["event"] == kind)
            for x in relays
        ]
        for kind in dict.fromkeys(r["event"] for r in cpu)
    }
    bars(axes[1], [x.replace(", ", ",\n") for x in relays], series, "%.1f")
    axes[1].set_ylabel("relay CPU µs per relayed message")
    axes[1].set_title("CPU per relayed message (median round)")
    mem = [r for r in data["memory"] if r["path"] != DIRECT]
    series = {
        "relay": [r["relay_kib_per_session"] for r in mem],
        "region": [r["region_kib_per_session"] for r in mem],
    }
    bars(axes[2], [r["path"] for r in mem], series, "%.1f")
    axes[2].set_ylabel("KiB per open session")
    n = mem[0]["sessions"] if mem else 0
    axes[2].set_title(f"RSS per idle session ({n:,} open)")
    meta = data["meta"]
    fig.suptitle(f"WebSocket relay benchmark, {meta['when']}, commit {meta['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
