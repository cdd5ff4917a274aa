"""The benchmark's markdown report and bar chart, both built from the results dict alone
(so ``proxy.json`` from an older run can be re-rendered)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _num(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _signed(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def _foreign(value: float | None, limit: float) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" + (" (!)" if value > limit else "")


def _codes(statuses: dict[str, int] | None) -> str:
    if not statuses:
        return ""
    return " (" + ", ".join(f"{n} x {code}" for code, n in sorted(statuses.items())) + ")"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def markdown(data: dict[str, Any]) -> str:
    meta = data.get("meta", {})
    lines = ["# edgeproxy proxy benchmark", ""]
    lines.append(
        f"{meta.get('when', '?')}, commit {meta.get('commit', '?')}, "
        f"{meta.get('cpus', '?')} x {meta.get('cpu_model', '?')}; run took "
        f"{meta.get('elapsed_s', '?')} s."
    )
    lines.append("")
    limit = float(meta.get("max_foreign", 0.2))
    lines.append(f"- Pinning ({meta.get('layout', '?')} layout): {meta.get('pinning', '?')}.")
    lines.append(
        '- "others\' CPU": cores used by processes outside the benchmark during the run '
        f"(the least disturbed of the attempts); (!) marks more than {limit:g}."
    )
    lines.append(
        f"- Request: {meta.get('request', '?')}; upstream answers "
        f"{meta.get('response_bytes', '?')} B of JSON. HTTP/1.1 keep-alive from the client."
    )
    lines.append(
        f"- Upstream pools: {meta.get('pool_size', '?')} HTTP/1.1 connections (reference, "
        f"edgeproxy, nginx alike); edgeproxy h2c: {meta.get('h2_connections', '?')} "
        "connections."
    )
    lines.append(
        f"- Python {meta.get('python', '?')}, aiohttp {meta.get('aiohttp', '?')}, uvloop "
        f"{meta.get('uvloop', '?')}; {meta.get('nginx') or 'no nginx'}; "
        f"{meta.get('wrk', '?')}; {meta.get('h2load', '?')}."
    )
    lines.append("")

    lines += ["## Targets", ""]
    rows = []
    for t in data.get("targets", []):
        verdict = {True: "pass", False: "**MISS**", None: "not measured"}[t["pass"]]
        if t["target"] == "(info)":
            verdict = "info"
        digits = 3 if isinstance(t["value"], float) and abs(t["value"]) < 10 else 1
        rows.append([t["metric"], _num(t["value"], digits), t["target"], verdict])
    lines += _table(["metric", "measured", "target", "result"], rows) + [""]

    tp = data.get("throughput", {})
    if tp:
        plan = meta.get("plan", {})
        lines += [
            "## Throughput (closed loop)",
            "",
            f"wrk, one thread; {plan.get('rounds', '?')} rounds of {plan.get('duration', '?')} s "
            "per configuration and connection count, the configurations taking turns. req/s is "
            "the best round (median and worst in brackets): on a shared VM the same code runs "
            "up to twice as slow for seconds at a time, and the best of several short rounds is "
            "each server's speed in a quiet phase. `x reference` and `x direct` divide best by "
            "best. Latencies are those of the best round and, at saturation, mostly queueing "
            "(p50 is about conns / req/s); the next table has the latency a hop adds. CPU us/req "
            "is the CPU time of the measured server itself (the proxy; nginx for the direct "
            "row) per request, lowest round.",
            "",
        ]
        direct_by_c = (tp.get("direct") or {}).get("by_conns", {})
        rows = []
        for entry in tp.values():
            if entry.get("skipped"):
                rows.append([entry["label"], "-", "skipped: " + entry["skipped"]] + [""] * 7)
                continue
            for c, r in entry.get("by_conns", {}).items():
                floor = (direct_by_c.get(c) or {}).get("rps")
                errors = _num(r["errors"])
                if r["errors"]:
                    errors += f" (non-2xx {r['non2xx']})"
                rows.append(
                    [
                        entry["label"],
                        c,
                        f"{_num(r['rps'], 0)} ({r['rps_median']:,.0f}, {r['rps_min']:,.0f})",
                        _num(r["p50_ms"]),
                        _num(r["p99_ms"]),
                        errors,
                        _num(r.get("vs_reference")),
                        _num(r["rps"] / floor if floor else None),
                        _num(r.get("cpu_us_per_req"), 0),
                        _foreign(r.get("foreign_cores"), limit),
                    ]
                )
        lines += _table(
            [
                "configuration",
                "conns",
                "req/s",
                "p50 ms",
                "p99 ms",
                "errors",
                "x reference",
                "x direct",
                "CPU us/req",
                "others' CPU",
            ],
            rows,
        ) + [""]

    half = data.get("half_saturation", {})
    if half:
        lines += [
            "## Latency at half saturation (open loop)",
            "",
            "Each proxy at 50% of its own median closed-loop req/s (`_openloop.py`: evenly "
            "spaced requests over 32 keep-alive connections), then nginx directly at the same "
            f"rate, {plan.get('rate_rounds', '?')} such pairs of {plan.get('rate_duration', '?')}"
            " s. added = proxy - direct within a pair; the best pair (lowest proxy p50) is the "
            "headline, the worst pair's added p50/p99 follow. A rate marked * was capped at what "
            "the Python generator sustains.",
            "",
        ]
        rows = []
        for h in half.values():
            p, d = h["proxy"], h["direct"]
            rate = _num(h["rate"], 0) + (" *" if h.get("capped") else "")
            rows.append(
                [
                    h["label"],
                    rate,
                    _num(p["achieved_rps"], 0),
                    _num(p["p50_ms"], 3),
                    _num(p["p99_ms"], 3),
                    _num(d["p50_ms"], 3),
                    _num(d["p99_ms"], 3),
                    _signed(h["added_p50_ms"]),
                    _signed(h["added_p99_ms"]),
                    f"{_signed(h.get('worst_added_p50_ms'))} / "
                    f"{_signed(h.get('worst_added_p99_ms'))}",
                    _num(h["errors"]),
                    _foreign(h.get("foreign_cores"), limit),
                ]
            )
        lines += _table(
            [
                "configuration",
                "rate",
                "achieved",
                "p50 ms",
                "p99 ms",
                "direct p50",
                "direct p99",
                "added p50",
                "added p99",
                "worst pair added p50 / p99",
                "errors",
                "others' CPU",
            ],
            rows,
        ) + [""]

    stress = data.get("stress", [])
    if stress:
        lines += [
            "## HTTP/2 stress (edgeproxy -> h2c nginx)",
            "",
            "h2load closed loop, one request at a time per client connection. nginx sends "
            "GOAWAY after 1000 streams per connection and allows 128 concurrent streams; every "
            "request must still succeed, and none should wait long for a stream slot.",
            "",
        ]
        rows = []
        for s in stress:
            pool = s.get("pool") or {}
            rows.append(
                [
                    str(s["conns"]),
                    str(s["max_connections"]),
                    _num(s["achieved_rps"], 0),
                    _num(s["requests"]),
                    _num(s["p50_ms"], 1),
                    _num(s["p99_ms"], 1),
                    _num(s["p999_ms"], 1),
                    _num(s["max_ms"], 1),
                    _num(s["over_1s"]),
                    _num(s["errors"]) + _codes(s.get("statuses")),
                    _num(s["region_errors"]),
                    _num(pool.get("requests_total")),
                    _foreign(s.get("foreign_cores"), limit),
                ]
            )
        lines += _table(
            [
                "client conns",
                "upstream max conns",
                "req/s",
                "requests",
                "p50 ms",
                "p99 ms",
                "p99.9 ms",
                "max ms",
                "> 1 s",
                "errors",
                "region errors",
                "pool requests",
                "others' CPU",
            ],
            rows,
        ) + [""]

    ttfb = data.get("ttfb", {})
    if ttfb.get("skipped"):
        lines += ["## Streaming TTFB", "", f"Skipped: {ttfb['skipped']}", ""]
    elif ttfb.get("paths"):
        lines += [
            "## Streaming TTFB",
            "",
            "Sequential streaming chat completions from the fake region (ttft 50 ms); time "
            "from sending the request to the first `data:` byte, paths interleaved. Others' "
            f"CPU during the series: {_foreign(ttfb.get('foreign_cores'), limit)} cores.",
            "",
        ]
        rows = []
        for p in ttfb["paths"].values():
            rows.append(
                [
                    p["label"],
                    str(p["n"]),
                    _num(p["p50_ms"], 3),
                    _num(p["p90_ms"], 3),
                    _num(p["p99_ms"], 3),
                    _signed(p.get("added_p50_ms")),
                    _signed(p.get("added_p99_ms")),
                    _signed(p.get("vs_reference_p50_ms")),
                    _num(p["errors"]),
                ]
            )
        lines += _table(
            [
                "path",
                "n",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "added p50",
                "added p99",
                "p50 vs reference",
                "errors",
            ],
            rows,
        ) + [""]

    prof = data.get("profile", {})
    for tag, p in prof.items():
        lines += [
            f"## Profile: edgeproxy, {'h2c' if tag == 'h2' else 'HTTP/1.1'} upstream",
            "",
            f"pyinstrument, {p['total_s']} s sampled while wrk ran, at "
            f"{_num(p['rps_under_profiler'], 0)} req/s (slower than unprofiled) with the proxy "
            f"using {_num(p.get('cpu_cores'))} cores. Code in edgeproxy/ is "
            f"{p['edgeproxy_inclusive_share']:.0%} of samples counting what it calls, "
            f"{p['edgeproxy_self_share']:.0%} in its own lines. Full tree: `{p['report']}`.",
            "",
        ]
        rows = [
            [f"`{h['where']}`", f"{h['share']:.1%}", f"{h['self_share']:.1%}"]
            for h in p["inclusive"][:10]
        ]
        lines += _table(["edgeproxy function", "inclusive", "self"], rows) + [""]
        rows = [[f"`{h['where']}`", f"{h['share']:.1%}"] for h in p["library_calls"][:10]]
        lines += _table(["call from edgeproxy into a library", "inclusive"], rows) + [""]
        rows = [[f"`{h['where']}`", f"{h['share']:.1%}"] for h in p.get("flat_self", [])[:12]]
        lines += _table(["any function, by self time", "self"], rows) + [""]

    notes = data.get("notes", [])
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def chart(data: dict[str, Any], path: Path) -> Path | None:
    """Three panels: throughput, added latency at half saturation, streaming TTFB."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5))

    ax = axes[0]
    tp = {k: v for k, v in data.get("throughput", {}).items() if v.get("by_conns")}
    conns = sorted({c for v in tp.values() for c in v["by_conns"]}, key=int)
    width = 0.8 / max(1, len(conns))
    for i, c in enumerate(conns):
        values = [(v["by_conns"].get(c) or {}).get("rps", 0) for v in tp.values()]
        xs = [j + i * width for j in range(len(tp))]
        bars = ax.bar(xs, values, width, label=f"{c} conns")
        ax.bar_label(bars, fmt="%.0f", fontsize=7, rotation=90, padding=2)
    ax.set_xticks([j + width * (len(conns) - 1) / 2 for j in range(len(tp))])
    ax.set_xticklabels([_wrap(v["label"]) for v in tp.values()], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("req/s (log scale)")
    ax.set_title("Throughput (wrk, closed loop, best round)")
    ax.legend(fontsize=8)
    ax.margins(y=0.15)

    ax = axes[1]
    half = data.get("half_saturation", {})
    labels = [_wrap(h["label"]) for h in half.values()]
    for i, (key, name) in enumerate((("added_p50_ms", "p50"), ("added_p99_ms", "p99"))):
        values = [h[key] for h in half.values()]
        bars = ax.bar([j + i * 0.4 for j in range(len(half))], values, 0.4, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axhline(5.0, color="grey", lw=0.8, ls=":")
    ax.set_xticks([j + 0.2 for j in range(len(half))])
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("ms added vs direct")
    ax.set_title("Added latency at half saturation\n(targets: 1 ms p50 dashed, 5 ms p99 dotted)")
    ax.legend(fontsize=8)

    ax = axes[2]
    # Added to the direct path: the 50 ms time to first token would dwarf the bars.
    paths = {
        k: v for k, v in (data.get("ttfb") or {}).get("paths", {}).items() if "added_p50_ms" in v
    }
    for i, (key, name) in enumerate((("added_p50_ms", "p50"), ("added_p99_ms", "p99"))):
        values = [p[key] for p in paths.values()]
        bars = ax.bar([j + i * 0.4 for j in range(len(paths))], values, 0.4, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks([j + 0.2 for j in range(len(paths))])
    ax.set_xticklabels([_wrap(p["label"]) for p in paths.values()], fontsize=8)
    ax.set_ylabel("ms added to the first SSE byte vs direct")
    ax.set_title("Streaming TTFB added (fake region, ttft 50 ms)\n(target: 1 ms p50, dashed)")
    ax.legend(fontsize=8)
    ax.margins(y=0.15)

    meta = data.get("meta", {})
    fig.suptitle(
        f"edgeproxy benchmark, {meta.get('when', '')}, commit {meta.get('commit', '')}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _wrap(label: str) -> str:
    return label.replace(", ", ",\n").replace(" (", "\n(")
