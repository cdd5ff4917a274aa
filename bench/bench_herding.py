"""Herding: three PoPs in front of the same regions, with the shared load view off and on.

    .venv/bin/python bench/bench_herding.py            # about 3 minutes
    .venv/bin/python bench/bench_herding.py --quick    # about 1 minute, a smoke run

Everything runs on 127.0.0.1: three fake regions (``python -m edgeproxy.testing``, each
its own process: a FIFO queue in front of ``--max-running`` generation slots), three
``edgeproxy serve`` processes (PoPs in Frankfurt, Paris and Amsterdam) with real config
files, one ``redis-server`` for the shared view (started on a free port, stopped at the
end), and one driver process.

``eu-central`` is nearest to every PoP and has the shortest time to first token;
``us-east`` and ``ap-south`` are far (their TTFT includes the ocean). Answers are long
streams (``--tokens`` tokens ``--inter-token-ms`` apart: seconds), so a region's slots
stay taken long after the first byte that the PoPs' latency estimates learn from. Each
PoP has its own clients: Poisson arrivals at ``--rate``, and bursts of ``--burst``
requests spread over ``--burst-len`` seconds every ``--period`` seconds, at the same
moment at every PoP (``--stagger`` 0: a shared trigger, such as a scheduled job or a
notification sent to every user at once) or ``--stagger`` seconds apart.

Herding is every PoP sending to the region that looks best from its own, partial
view at the same moment: each PoP counts only its own requests in flight there. With
``[shared_load] redis_url`` set, each PoP scores the regions on the requests in flight
from every PoP instead. The run is the same schedule (same seed) with the view off,
then on. Routing is today's default (``--policy affinity+load``: prefix affinity and
the regions' load headers too).

Reported: the regions' queue depth (``requests_waiting``, sampled every 0.1 s: max,
p95 and mean per region), the client-side TTFT p50 / p99, and where the requests
went. Printed, and written to ``bench/results/herding.{md,json}`` and
``herding.png`` (queue depth over time, shared view off and on).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script: make the helpers importable
    sys.path.insert(0, str(HERE))

import _llmrig as rigmod  # noqa: E402
import _report  # noqa: E402
import _util as u  # noqa: E402
from _llmrig import (  # noqa: E402
    CHAT_PATH,
    REPO,
    Gauge,
    RegionSpec,
    Result,
    Rig,
    gauge_stats,
    ms,
    ratio,
    sample_regions,
    stream_chat,
)

MODES = ("shared view off", "shared view on")
# PoPs (name, lat, lon) and regions (name, lat, lon).
POPS = (("fra", 50.1, 8.7), ("par", 48.9, 2.4), ("ams", 52.4, 4.9))
REGIONS = (("eu-central", 50.1, 8.7), ("us-east", 38.9, -77.4), ("ap-south", 19.1, 72.9))


@dataclass
class Load:
    """Each PoP's own load: Poisson at ``rate`` throughout, and after ``warm`` seconds a
    burst of ``burst`` requests (over ``burst_len`` s) every ``period`` s, PoP *i*'s
    bursts ``i x stagger`` s after PoP 0's."""

    rate: float
    warm: float
    seconds: float
    burst: int
    period: float
    stagger: float
    burst_len: float

    def schedule(self, pop: int, rng: random.Random) -> list[float]:
        end = self.warm + self.seconds
        times, t = [], 0.0
        while self.rate > 0:
            t += rng.expovariate(self.rate)
            if t >= end:
                break
            times.append(t)
        first = self.warm + pop * self.stagger
        k = 0
        while self.burst > 0 and first + k * self.period + self.burst_len < end:
            at = first + k * self.period
            times += [at + rng.uniform(0.0, self.burst_len) for _ in range(self.burst)]
            k += 1
        return sorted(times)

    def offered(self) -> float:
        """Requests per second per PoP once the bursts started."""
        return self.rate + self.burst / self.period if self.period > 0 else self.rate


async def run_load(
    rig: Rig, load: Load, seed: int, tokens: int, system: str | None = None
) -> tuple[list[Result], list[Gauge]]:
    """Every PoP's schedule of streaming chat requests, each to its own PoP."""
    loop = asyncio.get_running_loop()
    results: list[Result] = []
    gauges: list[Gauge] = []
    stop = asyncio.Event()
    start = loop.time() + 0.2
    tasks: set[asyncio.Task[None]] = set()
    rng = random.Random(seed)

    async def one(session: aiohttp.ClientSession, pop: str, n: int, at: float) -> None:
        port = rig.proxy_ports[pop][0]
        messages = [{"role": "user", "content": f"{pop} request {n}: " + "word " * 40}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        body = {
            "model": "fake-llm",
            "messages": messages,
            "stream": True,
            "max_tokens": tokens,
            "temperature": 0.7,
        }
        result, _ = await stream_chat(session, f"http://127.0.0.1:{port}{CHAT_PATH}", body, loop)
        result.at, result.pop = at, pop
        results.append(result)

    async def generate(session: aiohttp.ClientSession, pop: str, times: list[float]) -> None:
        for n, t in enumerate(times):
            await asyncio.sleep(max(0.0, start + t - loop.time()))
            task = asyncio.create_task(one(session, pop, n, t))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    sampler = asyncio.create_task(sample_regions(rig, 0.1, stop, start, gauges))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        generators = [
            generate(session, pop, load.schedule(i, random.Random(rng.random())))
            for i, (pop, *_) in enumerate(POPS)
        ]
        await asyncio.gather(*generators)
        if tasks:
            await asyncio.wait(set(tasks), timeout=60)
        for task in list(tasks):
            task.cancel()
    stop.set()
    await sampler
    return results, gauges


def summarize(results: list[Result], gauges: list[Gauge], load: Load) -> dict[str, Any]:
    warm, seconds = load.warm, load.seconds
    regions = [name for name, *_ in REGIONS]
    loaded = [r for r in results if r.at >= warm]
    ok = [r.ttft for r in loaded if r.ttft is not None]
    busy = gauge_stats(gauges, regions, warm, warm + seconds)
    hottest = max(regions, key=lambda n: (busy[n]["max_waiting"], busy[n]["mean_waiting"]))
    served = Counter(r.region for r in loaded)
    # The deepest queue at any region in each period (a burst and what follows it): one
    # sample's peak is noisy, their mean less so.
    windows: list[int] = []
    step = load.period if load.burst and load.period > 0 else 10.0
    at = warm
    while at < warm + seconds - 1e-9:
        windows.append(max((g.waiting for g in gauges if at <= g.at < at + step), default=0))
        at += step
    return {
        "requests": len(loaded),
        "errors": sum(1 for r in loaded if r.ttft is None),
        "statuses": dict(Counter(str(r.status) for r in loaded if r.status != 200)),
        "ttft_p50_ms": ms(ok, 50),
        "ttft_p99_ms": ms(ok, 99),
        "region_requests": {n: served.get(n, 0) for n in regions},
        "region_queue": busy,
        "hottest": hottest,
        "peak_waiting": busy[hottest]["max_waiting"],
        "p95_waiting_hottest": busy[hottest]["p95_waiting"],
        "mean_waiting_hottest": busy[hottest]["mean_waiting"],
        "window_s": step,
        "window_peaks": windows,
        "mean_window_peak": sum(windows) / len(windows) if windows else 0.0,
        "series": {
            n: [(round(g.at, 2), g.waiting) for g in gauges if g.region == n] for n in regions
        },
    }


# -- report --------------------------------------------------------------------------


def markdown(data: dict[str, Any]) -> str:
    num = _report._num
    meta, w = data["meta"], data["workload"]
    lines = ["# Herding benchmark: three PoPs, shared load view off and on", ""]
    lines.append(
        f"{meta['when']}, commit {meta['commit']}, {meta['cpus']} CPUs; run took "
        f"{meta['elapsed_s']} s. Everything on 127.0.0.1: fake regions modelling an LLM "
        "server, three `edgeproxy serve` processes, `redis-server`, one driver."
    )
    lines += ["", "## Target", ""]
    rows = [[t["metric"], num(t["value"]), t["target"], _verdict(t)] for t in data["targets"]]
    lines += _report._table(["metric", "measured", "target", "result"], rows) + [""]
    for note in data["skipped"]:
        lines += [f"- skipped: {note}", ""]
    burst = (
        f"and after {w['warm']:g} s, a burst of {w['burst']} requests over {w['burst_len']:g} s "
        f"every {w['period']:g} s, "
        + (
            "at the same moment at every PoP"
            if w["stagger"] == 0
            else f"each PoP's {w['stagger']:g} s after the previous PoP's"
        )
        if w["burst"]
        else "no bursts"
    )
    lines += [
        "## Setup",
        "",
        f"PoPs {', '.join(p for p, *_ in POPS)}, each with its own clients: Poisson arrivals at "
        f"{w['rate']:g} req/s, {burst}: {3 * w['offered_per_pop']:.1f} req/s in all. Regions: "
        + ", ".join(
            f"{n} (TTFT {t:g} ms, {m} running at once)"
            for n, t, m in zip(w["regions"], w["ttft_ms"], w["max_running"], strict=True)
        )
        + ", a FIFO queue behind the slots; answers of "
        f"{w['tokens']} tokens streamed {w['inter_token_ms']:g} ms apart "
        f"({w['tokens'] * w['inter_token_ms'] / 1000:.1f} s); eu-central is nearest to every "
        f"PoP. Routing: {w['policy']}; the shared view: `[shared_load]` with its defaults "
        "(published and read every 0.25 s). Queue depth: the regions' `requests_waiting`, "
        f"sampled every 0.1 s over the {w['seconds']:g} s after the warm-up.",
        "",
    ]
    regions = [n for n, *_ in REGIONS]
    header = ["mode", "requests", "errors", "TTFT p50 ms", "p99 ms", "hottest", "peak per period"]
    header += [f"{n} waiting max / p95 / mean" for n in regions]
    header += ["requests per region"]
    rows = []
    for mode, s in data["modes"].items():
        row = [
            mode,
            num(s["requests"]),
            num(s["errors"]),
            num(s["ttft_p50_ms"], 1),
            num(s["ttft_p99_ms"], 1),
            s["hottest"],
            f"{s['mean_window_peak']:.1f} ({' '.join(str(p) for p in s['window_peaks'])})",
        ]
        queue = s["region_queue"]
        row += [
            f"{queue[n]['max_waiting']} / {queue[n]['p95_waiting']:.0f} / "
            f"{queue[n]['mean_waiting']:.2f}"
            for n in regions
        ]
        row.append(" / ".join(str(s["region_requests"][n]) for n in regions))
        rows.append(row)
    lines += _report._table(header, rows) + [""]
    return "\n".join(lines)


def _verdict(target: dict[str, Any]) -> str:
    if target.get("skipped"):
        return "skipped"
    return "pass" if target["pass"] else "**MISS**"


def plots(data: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    modes = data["modes"]
    if not modes:
        return []
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 3.2 * len(modes)), squeeze=False)
    top = max(
        (w for s in modes.values() for series in s["series"].values() for _, w in series),
        default=1,
    )
    warm = data["workload"]["warm"]
    for ax, (mode, s) in zip(axes[:, 0], modes.items(), strict=True):
        for region, series in s["series"].items():
            ax.plot([t for t, _ in series], [w for _, w in series], label=region, lw=1)
        ax.axvline(warm, color="grey", ls="--", lw=0.8)
        ax.set_ylim(0, top * 1.05 + 1)
        ax.set_ylabel("requests waiting")
        ax.set_title(
            f"{mode}: peak {s['peak_waiting']} at {s['hottest']}, TTFT p99 "
            f"{_report._num(s['ttft_p99_ms'], 0)} ms",
            fontsize=10,
        )
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds (dashed: bursts start)")
    fig.tight_layout()
    path = out / "herding.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# -- the run -------------------------------------------------------------------------


def targets(modes: dict[str, Any]) -> list[dict[str, Any]]:
    metric = "peak queue at the hottest region, off / on (x)"
    off, on = modes.get("shared view off"), modes.get("shared view on")
    if not (off and on):
        return [{"metric": metric, "value": None, "target": ">= 2", "pass": False,
                 "skipped": True}]  # fmt: skip
    cut = ratio(float(off["peak_waiting"]), float(on["peak_waiting"]) or 1.0)
    return [{"metric": metric, "value": cut, "target": ">= 2", "pass": (cut or 0) >= 2}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter: a smoke run")
    parser.add_argument("--policy", choices=("p2c", "affinity+load"), default="p2c")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--rate", type=float, default=0.6, help="Poisson req/s per PoP")
    parser.add_argument("--burst", type=int, default=3, help="requests per burst per PoP")
    parser.add_argument("--burst-len", type=float, default=1.0, help="seconds a burst lasts")
    parser.add_argument("--period", type=float, default=10.0, help="seconds between bursts")
    parser.add_argument("--stagger", type=float, default=0.0,
                        help="seconds between the bursts of two PoPs")  # fmt: skip
    parser.add_argument("--warm", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--ttft-ms", type=float, nargs=3, default=[60.0, 250.0, 300.0],
                        help="TTFT of eu-central, us-east, ap-south")  # fmt: skip
    parser.add_argument("--max-running", type=int, nargs=3, default=[6, 6, 6],
                        help="generation slots of eu-central, us-east, ap-south")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--inter-token-ms", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = 30.0
    args.out.mkdir(parents=True, exist_ok=True)
    features = rigmod.detect_features(rigmod.documented_keys())
    skipped: list[str] = []
    began = time.monotonic()
    load = Load(args.rate, args.warm, args.seconds, args.burst, args.period, args.stagger,
                args.burst_len)  # fmt: skip
    options: dict[str, Any] = {}
    system = None
    policy = args.policy
    if policy == "affinity+load":
        if features.affinity_missing:
            skipped.append(f"affinity+load: {features.affinity_missing}; p2c instead")
            policy = "p2c"
        else:
            options = {"routing": features.routing, "region_keys": features.region}
            # Every request starts with the same system prompt: the prefix pulls them together.
            system = "You are a helpful assistant. " + "rule " * 400
    workload = {
        **asdict(load),
        "offered_per_pop": load.offered(),
        "policy": policy,
        "regions": [n for n, *_ in REGIONS],
        "ttft_ms": args.ttft_ms,
        "max_running": args.max_running,
        "tokens": args.tokens,
        "inter_token_ms": args.inter_token_ms,
    }
    print(f"herding: 3 PoPs x {load.offered():.1f} req/s, {policy}", flush=True)
    modes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-herding-") as tmp:
        rig = Rig(Path(tmp))
        try:
            for (name, lat, lon), ttft, slots in zip(
                REGIONS, args.ttft_ms, args.max_running, strict=True
            ):
                rig.start_region(
                    RegionSpec(
                        name=name,
                        lat=lat,
                        lon=lon,
                        ttft=ttft / 1000,
                        max_running=slots,
                        tokens=args.tokens,
                        inter_token=args.inter_token_ms / 1000,
                    )  # fmt: skip
                )
            for mode in args.modes:
                sections: dict[str, dict[str, Any]] = {}
                if mode == "shared view on":
                    if features.shared_view_key is None:
                        skipped.append(f"shared view on: {features.shared_view_missing}")
                        continue
                    section, key = features.shared_view_key.split(".", 1)
                    sections[section] = {key: rig.start_redis()}
                rig.reset_regions()
                for pop in POPS:
                    rig.start_proxy(pop[0], pop=pop, sections=sections, **options)
                try:
                    res, gauges = asyncio.run(run_load(rig, load, args.seed, args.tokens, system))
                finally:
                    rig.stop_proxies()
                    if rig.redis is not None:
                        rig.redis.stop()
                        rig.redis = None
                s = summarize(res, gauges, load)
                modes[mode] = s
                print(
                    f"  {mode:<16} {s['requests']} requests, {s['errors']} errors, TTFT p50 "
                    f"{_report._num(s['ttft_p50_ms'], 1)} ms p99 "
                    f"{_report._num(s['ttft_p99_ms'], 1)} ms, peak waiting {s['peak_waiting']} "
                    f"(p95 {s['p95_waiting_hottest']:.0f}) at {s['hottest']}, per period "
                    f"{s['window_peaks']}, per region "
                    + " / ".join(str(v) for v in s["region_requests"].values()),
                    flush=True,
                )
        finally:
            rig.stop()
    data: dict[str, Any] = {"workload": workload, "modes": modes, "skipped": skipped}
    data["meta"] = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "commit": u.tool_version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
        "cpus": len(os.sched_getaffinity(0)),
        "elapsed_s": round(time.monotonic() - began, 1),
        "quick": args.quick,
    }
    data["targets"] = targets(modes)
    (args.out / "herding.json").write_text(json.dumps(data, indent=1, default=str))
    report = markdown(data)
    (args.out / "herding.md").write_text(report)
    pngs = plots(data, args.out)
    print()
    print(report)
    print(
        f"written: {args.out / 'herding.md'}, herding.json" + "".join(f", {p.name}" for p in pngs)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
