"""The lag scenarios, before and after: each seed symptom against the same fake regions
behind the same WAN model, through the baselines and through edgeproxy, in one run.

    .venv/bin/python bench/scenarios.py            # the full run
    .venv/bin/python bench/scenarios.py --short    # seconds per scenario (tests/test_scenarios.py)
    .venv/bin/python bench/scenarios.py --only cross_region cache

The baselines: ``direct`` (the client calls the far region itself, a new connection per
request) and a plain reverse proxy (nginx where installed, else the bare aiohttp forwarder
``bench/reference_proxy.py``). edgeproxy runs with its defaults and with the scenario's
checked-in config, ``bench/scenarios/<name>.toml``. Every variant gets the same client,
regions and links (see ``bench/_scenario_rig.py``); each scenario prints a table with
ratios, writes ``bench/results/scenario-<name>.png``, and the run ends with a summary
table (``bench/results/scenarios.md``, ``scenarios.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import _scenario_rig as rig
from _scenario_rig import (
    Client,
    Mode,
    Outcome,
    Rec,
    World,
    chat_body,
    closed_loop,
    open_loop,
    pct,
    plain_proxy,
    ratio,
)
from _scenarios_load import backlog, cold_start, lighter, saturation

RESULTS = Path(__file__).resolve().parent / "results"


# -- 1. cross-region round trips ---------------------------------------------------------


async def cross_region(mode: Mode) -> Outcome:
    """TTFB of small JSON answers from a region 150 ms away, a user 5 ms from the PoP: with
    the region on plain TCP, then over HTTPS as a page calling it directly would (the direct
    client, the plain proxy and edgeproxy all verify its certificate, through the same far
    link; the user-to-PoP hop stays plain, as in every other scenario)."""
    rows: list[list[Any]] = []
    headlines: list[dict[str, Any]] = []
    offered = requests = answered = 0
    for tls in (False, True):
        half = await _cross_region(mode, tls=tls)
        rows += half[0]
        headlines.append(half[1])
        offered += half[2]
        requests += len(half[3])
        answered += sum(r.status == 200 for r in half[3])
    return Outcome(
        "cross_region",
        "1. Cross-region RTT: TTFB, user 5 ms from the PoP, region 150 ms one way",
        [
            "variant",
            "first TTFB ms",
            "TTFB p50 ms",
            "TTFB p95 ms",
            "TTFB p50, client conn reused ms",
            "set-up share %",
            "x better than worst baseline",
        ],
        rows,
        headlines[0],
        {"offered": offered, "requests": requests, "answered": answered},
        [
            "set-up share: (TTFB on a new client connection - TTFB on a reused one) / TTFB, "
            "what the handshakes on the client's path cost",
            "TLS rows: the region served over HTTPS (TLS 1.3, a test CA every client trusts); "
            "the ratio is against the worse baseline of the TLS rows",
        ],
        [headlines[1]],
    )


async def _cross_region(
    mode: Mode, *, tls: bool
) -> tuple[list[list[Any]], dict[str, Any], int, list[Rec]]:
    """One half of the scenario: its rows, its headline, the requests offered and made."""
    n = 2 if mode.short else 12
    world = World(mode.geometry)
    if tls:
        world.use_tls()
    await world.region("us-east", ttft=0.05, tokens=16)
    variants = [
        ("direct", "direct", None),
        (plain_proxy(), plain_proxy(), None),
        ("edgeproxy", "edgeproxy", None),
        ("edgeproxy+config", "edgeproxy", "cross_region"),
    ]
    suffix = ", TLS" if tls else ""
    rows: list[list[Any]] = []
    recs_all: list[Rec] = []
    medians: dict[str, float | None] = {}
    try:
        started = await world.start_all(variants)
        for i, (name, kind, _config) in enumerate(variants):
            proxy = started[name]
            direct = kind == "direct"
            url = world.direct_url("us-east") if direct else proxy.url
            client_tls = world.tls if direct else None
            fresh, reused = [], []
            async with Client(timeout=30, tls=client_tls) as client:
                for k in range(n):
                    body = chat_body(f"v{i} new {k}")
                    fresh.append(await client.call(name, url, body, label="new"))
            async with Client(timeout=30, keepalive=True, tls=client_tls) as client:
                for k in range(n + 1):
                    rec = await client.call(
                        name, url, chat_body(f"v{i} reused {k}"), label="reused"
                    )
                    reused.append(rec)
            recs_all += fresh + reused
            reused = reused[1:]  # the first opened the connection the others reuse
            await world.stop_proxy(proxy)
            new_ms = pct([r.ttfb for r in fresh[1:]] or [fresh[0].ttfb], 50)
            reuse_ms = pct([r.ttfb for r in reused], 50)
            setup = None if new_ms is None or reuse_ms is None else max(0.0, new_ms - reuse_ms)
            medians[name] = new_ms
            rows.append(
                [
                    name + suffix,
                    pct([fresh[0].ttfb], 50),
                    new_ms,
                    pct([r.ttfb for r in fresh], 95),
                    reuse_ms,
                    None if setup is None or not new_ms else 100 * setup / new_ms,
                ]
            )
    finally:
        await world.close()
    worst = max(medians[v[0]] or 0.0 for v in variants[:2])
    for row in rows:
        row.append(ratio(worst, row[2]))
    best = min(medians["edgeproxy"] or 1e9, medians["edgeproxy+config"] or 1e9)
    headline = {
        "metric": "TTFB p50 (new client connection" + (", TLS to the region)" if tls else ")"),
        "baseline": worst,
        "edgeproxy": best,
        "ratio": ratio(worst, best),
        "target": 3.0,
    }
    return rows, headline, len(variants) * (2 * n + 1), recs_all


# -- 2. no streaming ---------------------------------------------------------------------


async def streaming(mode: Mode) -> Outcome:
    """Time to the first visible token of a 400-token answer at 30 tokens/s."""
    tokens, rate, users = (20, 200.0, 2) if mode.short else (400, 30.0, 4)
    world = World(mode.geometry)
    await world.region("us-east", ttft=0.2, inter_token_delay=1 / rate, tokens=tokens)
    plain = plain_proxy()
    variants = [
        ("direct, buffered", "direct", None, False),
        (f"{plain}, buffered", plain, None, False),
        (f"{plain}, streamed", plain, None, True),
        ("edgeproxy, streamed", "edgeproxy", None, True),
        ("edgeproxy+config, streamed", "edgeproxy", "streaming", True),
    ]
    rows: list[list[Any]] = []
    recs_all: list[Rec] = []
    first_ms: dict[str, float | None] = {}
    try:
        started = await world.start_all([v[:3] for v in variants])
        for i, (name, kind, _config, stream) in enumerate(variants):
            proxy = started[name]
            url = world.direct["us-east"].url if kind == "direct" else proxy.url
            async with Client(timeout=120) as client:
                jobs = [
                    functools.partial(
                        client.call,
                        name,
                        url,
                        chat_body(f"s{i} {k}", stream=True, tokens=tokens),
                        buffered=not stream,
                    )
                    for k in range(users)
                ]
                recs = await closed_loop(users, jobs)
            recs_all += recs
            await world.stop_proxy(proxy)
            first_ms[name] = pct([r.first_token for r in recs], 50)
            rows.append(
                [
                    name,
                    first_ms[name],
                    pct([r.total for r in recs], 50),
                    sum(r.status == 200 for r in recs),
                ]
            )
    finally:
        await world.close()
    worst = max(first_ms[variants[0][0]] or 0.0, first_ms[variants[1][0]] or 0.0)
    for row in rows:
        row.append(ratio(worst, row[1]))
    best = min(v for k, v in first_ms.items() if k.startswith("edgeproxy") and v is not None)
    return Outcome(
        "streaming",
        f"2. No streaming: first visible token of a {tokens}-token answer at {rate:g} tokens/s",
        ["variant", "first token p50 ms", "whole answer p50 ms", "answered", "x sooner"],
        rows,
        {
            "metric": "first visible token p50",
            "baseline": worst,
            "edgeproxy": best,
            "ratio": ratio(worst, best),
            "target": 10.0,
        },
        {
            "offered": users * len(variants),
            "requests": len(recs_all),
            "answered": sum(r.status == 200 for r in recs_all),
        },
        [
            "buffered: the page shows the answer once it is whole (every variant is sent the "
            "same stream, since the fake region spends its generation time on streams only)",
        ],
    )


# -- 5. repeated questions ---------------------------------------------------------------


def zipf_questions(n: int, distinct: int, seed: int = 5, s: float = 1.1) -> list[int]:
    weights = [1 / (k**s) for k in range(1, distinct + 1)]
    return random.Random(seed).choices(range(distinct), weights, k=n)


async def cache(mode: Mode) -> Outcome:
    """A Zipf mix of questions: upstream calls, hit ratio and TTFB, cache off and on."""
    n, distinct, workers = (150, 25, 25) if mode.short else (10_000, 500, 64)
    questions = zipf_questions(n, distinct)
    world = World(mode.geometry)
    await world.region("us-east", ttft=0.05, tokens=16)
    variants = [
        ("direct", "direct", None),
        (plain_proxy(), plain_proxy(), None),
        ("edgeproxy, cache off", "edgeproxy", "cache_off"),
        ("edgeproxy", "edgeproxy", None),
        ("edgeproxy+config", "edgeproxy", "cache"),
    ]
    rows: list[list[Any]] = []
    recs_all: list[Rec] = []
    calls: dict[str, int] = {}
    try:
        started = await world.start_all(variants)
        for name, kind, _config in variants:
            proxy = started[name]
            url = world.direct["us-east"].url if kind == "direct" else proxy.url
            before = world.upstream_calls()
            async with Client(timeout=60) as client:
                jobs = [
                    functools.partial(client.call, name, url, chat_body(f"question {q}"))
                    for q in questions
                ]
                recs = await closed_loop(workers, jobs)
            await world.stop_proxy(proxy)
            recs_all += recs
            calls[name] = world.upstream_calls() - before
            served = sum(r.cache in ("HIT", "STALE", "COALESCED") for r in recs)
            rows.append(
                [
                    name,
                    len(recs),
                    sum(r.status == 200 for r in recs),
                    calls[name],
                    100 * served / len(recs),
                    pct([r.ttfb for r in recs], 50),
                    pct([r.ttfb for r in recs], 99),
                ]
            )
    finally:
        await world.close()
    worst = max(calls[variants[0][0]], calls[variants[1][0]])
    for row in rows:
        row.append(ratio(worst, row[3]))
    best = min(calls["edgeproxy"], calls["edgeproxy+config"])
    return Outcome(
        "cache",
        f"5. Repeated questions: {n:,} requests, Zipf over {distinct} questions, {workers} at once",
        [
            "variant",
            "requests",
            "answered",
            "upstream calls",
            "served by the cache %",
            "TTFB p50 ms",
            "TTFB p99 ms",
            "x fewer calls",
        ],
        rows,
        {
            "metric": "upstream calls",
            "baseline": worst,
            "edgeproxy": best,
            "ratio": ratio(worst, best),
            "target": 5.0,
        },
        {
            "requests": len(recs_all),
            "answered": sum(r.status == 200 for r in recs_all),
            "offered": n * len(variants),
            "calls_with_cache": best,
            "requests_per_variant": n,
        },
        ["served by the cache: HIT, STALE or COALESCED in X-Edgeproxy-Cache"],
    )


# -- 4. 504 storm ------------------------------------------------------------------------


async def storm(mode: Mode) -> Outcome:
    """Round robin against routing, failover and hedging while one region browns out, then dies."""
    phase, rate = (0.6, 10.0) if mode.short else (8.0, 10.0)
    timeout = 2.0
    world = World(mode.geometry)
    for name in ("us-east", "us-west"):
        await world.region(name, ttft=0.2, tokens=16)
    sick = world.regions["us-east"]
    plain = plain_proxy()
    variants = [
        ("direct, round robin", "direct", None),
        (f"{plain}, round robin", plain, None),
        ("edgeproxy", "edgeproxy", None),
        ("edgeproxy+config", "edgeproxy", "storm"),
    ]
    rows: list[list[Any]] = []
    recs_all: list[Rec] = []
    bad: dict[str, int] = {}
    offered = 0
    try:
        for i, (name, kind, config) in enumerate(variants):
            sick.configure(ttft=0.2)
            if not sick.running:
                await sick.restart()
            proxy = await world.proxy(
                name.replace(", ", "-").replace(" ", "-"), kind, config, read_timeout=timeout
            )
            urls = [link.url for link in world.direct.values()] if kind == "direct" else [proxy.url]
            sent = [0]
            # The direct page gives up when the plain proxy would: a timeout is its 504.
            async with Client(timeout=timeout if kind == "direct" else 30) as client:
                recs = await open_loop(
                    client,
                    name,
                    urls,
                    rate,
                    [
                        ("healthy", phase, None),
                        ("brownout", phase, lambda: sick.configure(ttft=2.0)),
                        ("dead", phase, sick.kill),
                    ],
                    prefix=f"t{i}",
                    sent=sent,
                )
            offered += sent[0]
            await world.stop_proxy(proxy)
            recs_all += recs
            gw = [r for r in recs if r.status == 504 or (kind == "direct" and r.status == 0)]
            failed = [r for r in recs if r.status != 200]
            bad[name] = len(gw)
            rows.append(
                [
                    name,
                    len(recs),
                    len(gw),
                    len(failed),
                    pct([r.total for r in recs if r.label == "healthy"], 99),
                    pct([r.total for r in recs if r.label == "brownout"], 99),
                    pct([r.total for r in recs if r.label == "dead"], 99),
                ]
            )
    finally:
        await world.close()
    worst = max(bad[variants[0][0]], bad[variants[1][0]])
    best = min(bad["edgeproxy"], bad["edgeproxy+config"])
    return Outcome(
        "storm",
        f"4. 504 storm: two regions, {rate:g} req/s; one healthy {phase:g} s, "
        f"10x slower {phase:g} s, dead {phase:g} s; {timeout:g} s gateway timeout",
        [
            "variant",
            "requests",
            "504s (direct: timeouts)",
            "not 200",
            "p99 healthy ms",
            "p99 brownout ms",
            "p99 dead ms",
        ],
        rows,
        {
            "metric": "client-visible 504s",
            "baseline": worst,
            "edgeproxy": best,
            "ratio": None,
            "target": "0",
        },
        {
            "offered": offered,
            "requests": len(recs_all),
            "answered": sum(r.status == 200 for r in recs_all),
        },
        [
            "504s for direct: client timeouts at the same 2 s; not 200: any failure, 502s included",
            "requests are put in the phase they were sent in: those sent in a phase's last round "
            "trip reach the region in the next one",
        ],
    )


# -- the run -----------------------------------------------------------------------------

SCENARIOS: dict[str, Callable[[Mode], Awaitable[Outcome]]] = {
    "cross_region": cross_region,
    "streaming": streaming,
    "cache": cache,
    "storm": storm,
    "saturation": saturation,
    "lighter": lighter,
    "backlog": backlog,
    "cold_start": cold_start,
}


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def summary(outcomes: list[Outcome]) -> str:
    rows = []
    pairs = [(o, h) for o in outcomes for h in (o.headline, *o.more_headlines)]
    for o, h in pairs:
        if "max" in h:
            met = h["edgeproxy"] is not None and h["edgeproxy"] <= h["max"]
            target = f"<= {h['max']:g}"
        elif h.get("target") is None:
            met = None
            target = "-"
        elif isinstance(h["target"], str):
            met = h["edgeproxy"] == int(h["target"])
            target = f"= {h['target']}"
        else:
            met = h["ratio"] is not None and h["ratio"] >= h["target"]
            target = f">= {h['target']:g}x"
        rows.append(
            [
                o.title.split(":")[0],
                h["metric"],
                h["baseline"],
                h["edgeproxy"],
                h["ratio"],
                target,
                "-" if met is None else "yes" if met else "no",
            ]
        )
    return table(
        ["scenario", "metric", "worse baseline", "best edgeproxy", "ratio", "target", "met"],
        rows,
    )


def plot(outcome: Outcome, path: Path) -> Path | None:
    """One bar chart per scenario: the table's first numeric column per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    column = {
        "cross_region": 2,
        "cross_region_tls": 2,
        "cache": 3,
        "storm": 2,
        "saturation": 7,
        "lighter": 9,
        "backlog": 4,
    }.get(outcome.name, 1)
    names = [str(r[0]) for r in outcome.rows]
    values = [float(r[column] or 0) for r in outcome.rows]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    colors = ["#c44" if not n.startswith("edgeproxy") else "#36a" for n in names]
    ax.barh(names, values, color=colors)
    ax.invert_yaxis()
    ax.set_xlabel(outcome.header[column])
    ax.set_title(outcome.title, fontsize=9)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def meta() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=rig.REPO,
        ).stdout.strip()
    except OSError:
        commit = "?"
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "machine": f"{os.cpu_count()} x {cpu}, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "plain_proxy": plain_proxy(),
    }


async def run(names: list[str], mode: Mode, per_scenario_timeout: float) -> list[Outcome]:
    outcomes = []
    for name in names:
        started = time.monotonic()
        outcome = await asyncio.wait_for(SCENARIOS[name](mode), per_scenario_timeout)
        outcome.invariants["elapsed_s"] = round(time.monotonic() - started, 1)
        outcomes.append(outcome)
        print(f"\n## {outcome.title}\n\n{table(outcome.header, outcome.rows)}")
        for note in outcome.notes:
            print(f"\n- {note}")
        print(f"\n({outcome.invariants['elapsed_s']} s)", flush=True)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--short", action="store_true", help="seconds per scenario")
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per scenario")
    args = parser.parse_args(argv)
    mode = Mode(short=args.short)
    timeout = args.timeout or (60.0 if args.short else 600.0)
    info = meta()
    started = time.monotonic()
    outcomes = asyncio.run(run(args.only, mode, timeout))
    info["elapsed_s"] = round(time.monotonic() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    text = summary(outcomes)
    heading = (
        f"{info['when']}, commit {info['commit']}, {info['machine']}; plain proxy: "
        f"{info['plain_proxy']}; run took {info['elapsed_s']} s"
        + (" (--short)" if args.short else "")
    )
    print(f"\n## Summary\n\n{heading}\n\n{text}")
    for outcome in outcomes:
        plot(outcome, args.out / f"scenario-{outcome.name}.png")
    body = [f"# Lag scenarios\n\n{heading}\n\n## Summary\n\n{text}\n"]
    body += [f"\n## {o.title}\n\n{table(o.header, o.rows)}\n" for o in outcomes]
    (args.out / "scenarios.md").write_text("".join(body))
    (args.out / "scenarios.json").write_text(
        json.dumps({"meta": info, "outcomes": [asdict(o) for o in outcomes]}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
