"""Routing under brownout, outage and a slow tail: round-robin against edgeproxy, hedging on/off.

    .venv/bin/python bench/bench_routing.py            # about 2 minutes
    .venv/bin/python bench/bench_routing.py --quick    # about 1 minute

Three fake regions (``python -m edgeproxy.testing``, each its own process) and
three proxies (``edgeproxy serve``, each its own process) in front of the same
three regions:

* ``round-robin``: edgeproxy with a plugin that rotates through every region in
  config order, health-blind (the same failover and retry budget behind it);
* ``edgeproxy``: the default routing (geo prior, peak-EWMA, load, health);
* ``edgeproxy+hedge``: the same, with hedging on for chat completions (after
  the region's p95 time to first byte, within the 5% hedge budget).

One open-loop load (fixed rate, the same for every proxy, requests sent to all
three at the same instants) runs through these phases, on the same regions:

1. ``healthy``: every region answers in 30-50 ms (nearest fastest);
2. ``brownout``: the nearest region's latency is raised tenfold;
3. ``killed``: it is back to normal speed, then its process is SIGKILLed;
4. ``restored``: it is started again on the same port;
5. ``slow tail``: every region answers 1% of requests one second late.

Printed and written to ``bench/results/routing.{md,json,png}``: p50/p99 and
errors per phase and per 5-second slice for each proxy, and the extra upstream
requests hedging cost in the slow-tail phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:  # run as a script: make the helpers importable
    sys.path.insert(0, str(HERE))

import _report  # noqa: E402
import _util as u  # noqa: E402

PYTHON = sys.executable
PROXIES = ("round-robin", "edgeproxy", "edgeproxy+hedge")
BODY = json.dumps(
    {"model": "fake-llm", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
).encode()
# name, ttft (s), lat, lon: the PoP is in Frankfurt; eu-central is nearest and fastest.
REGIONS = (
    ("eu-central", 0.030, 50.1, 8.7),
    ("eu-west", 0.040, 53.3, -6.3),
    ("us-east", 0.050, 38.9, -77.4),
)
VICTIM = "eu-central"
SLICE = 5.0

RR_PLUGIN = '''
"""Health-blind round-robin over every configured region (the benchmark's baseline)."""
import itertools

from edgeproxy import hookimpl

_regions = []
_turn = itertools.count()


@hookimpl
def edgeproxy_startup(proxy):
    _regions[:] = list(proxy.regions)


@hookimpl
def edgeproxy_route(candidates):
    i = next(_turn) % len(_regions)
    return _regions[i:] + _regions[:i]
'''


@dataclass
class Phase:
    name: str
    seconds: float
    started: float = 0.0


@dataclass
class Sample:
    proxy: str
    phase: str
    at: float  # seconds since the load started
    latency: float
    ok: bool
    status: int


@dataclass
class Rig:
    tmp: Path
    regions: dict[str, u.Service] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    proxies: dict[str, u.Service] = field(default_factory=dict)
    proxy_ports: dict[str, tuple[int, int]] = field(default_factory=dict)

    def start_region(self, name: str, ttft: float) -> None:
        port = self.ports.setdefault(name, u.free_port())
        service = u.Service(
            f"region-{name}",
            [
                PYTHON,
                "-m",
                "edgeproxy.testing",
                "--name",
                name,
                "--port",
                str(port),
                "--ttft",
                f"{ttft}",
                "--seed",
                "7",
            ],
            self.tmp / f"region-{name}.log",
            cwd=REPO,
        ).start()
        service.wait_http(f"http://127.0.0.1:{port}/healthz")
        self.regions[name] = service

    def control(self, name: str, **behaviour: Any) -> None:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.ports[name]}/_control",
            data=json.dumps(behaviour).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            resp.read()

    def start_proxy(self, name: str) -> None:
        port, admin = u.free_port(), u.free_port()
        lines = [
            "[server]",
            'host = "127.0.0.1"',
            f"port = {port}",
            "grace_period = 2.0",
            "[admin]",
            'host = "127.0.0.1"',
            f"port = {admin}",
            "[pop]",
            'name = "bench-fra"',
            "lat = 50.1",
            "lon = 8.7",
            "[upstream]",
            "connect_timeout = 1.0",
            "read_timeout = 10.0",
        ]
        if name == "round-robin":
            plugin = self.tmp / "round_robin.py"
            plugin.write_text(RR_PLUGIN)
            lines += ["[plugins]", f'enabled = ["{plugin}"]', "entry_points = false"]
        else:
            lines += ["[plugins]", "entry_points = false"]
        if name == "edgeproxy+hedge":
            lines += [
                "[[routes]]",
                'name = "chat"',
                'path = "/v1/chat/completions"',
                "hedge = true",
            ]
        for region, _ttft, lat, lon in REGIONS:
            lines += [
                "[[regions]]",
                f'name = "{region}"',
                f'url = "http://127.0.0.1:{self.ports[region]}"',
                f"lat = {lat}",
                f"lon = {lon}",
            ]
        config = self.tmp / f"{name}.toml"
        config.write_text("\n".join(lines) + "\n")
        service = u.Service(
            f"proxy-{name}",
            [PYTHON, "-m", "edgeproxy", "serve", "--config", str(config), "--log-level", "error"],
            self.tmp / f"proxy-{name}.log",
            cwd=REPO,
        ).start()
        service.wait_http(f"http://127.0.0.1:{admin}/readyz")
        self.proxies[name] = service
        self.proxy_ports[name] = (port, admin)

    def status(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = u.http_json(f"http://127.0.0.1:{self.proxy_ports[name][1]}/status")
        return data

    def upstream_requests(self, name: str) -> int:
        return sum(r["requests_total"] for r in self.status(name)["regions"])

    def stop(self) -> None:
        for service in [*self.proxies.values(), *self.regions.values()]:
            service.stop()


async def load(rig: Rig, phases: list[Phase], rate: float, actions: dict[str, Any]) -> list[Sample]:
    """Open loop: every 1/rate s, one request to each proxy at the same instant."""
    import aiohttp

    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=15)
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    start = loop.time()
    pending: list[asyncio.Future[None]] = []

    async def one(session: aiohttp.ClientSession, proxy: str, phase: str, due: float) -> None:
        port = rig.proxy_ports[proxy][0]
        ok, status = False, 0
        try:
            async with session.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=BODY,
                headers={"content-type": "application/json"},
            ) as resp:
                status = resp.status
                body = await resp.read()
                ok = status == 200 and b'"choices"' in body
        except (aiohttp.ClientError, TimeoutError):
            pass
        # Timed from when it was due, so a stalled generator is charged too.
        samples.append(Sample(proxy, phase, due - start, loop.time() - due, ok, status))

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t = start
        for phase in phases:
            phase.started = t - start
            action = actions.get(phase.name)
            if action is not None:
                # In a thread: starting a region takes a moment, and the load must not wait.
                pending.append(loop.run_in_executor(None, action))
            print(f"  {phase.name:<10} {phase.seconds:4.0f} s", flush=True)
            end = t + phase.seconds
            while t < end:
                await asyncio.sleep(max(0.0, t - loop.time()))
                for proxy in PROXIES:
                    task = loop.create_task(one(session, proxy, phase.name, t))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                t += 1 / rate
        await asyncio.gather(*tasks, *pending)
    return samples


def _pct(values: list[float], q: float) -> float | None:
    return u.percentile(sorted(values), q) * 1000 if values else None


def summarize(samples: list[Sample], phases: list[Phase]) -> dict[str, Any]:
    by_phase: dict[str, dict[str, Any]] = {}
    for phase in phases:
        row: dict[str, Any] = {}
        for proxy in PROXIES:
            mine = [s for s in samples if s.proxy == proxy and s.phase == phase.name]
            good = [s.latency for s in mine if s.ok]
            row[proxy] = {
                "requests": len(mine),
                "errors": sum(1 for s in mine if not s.ok),
                "p50_ms": _pct(good, 50),
                "p99_ms": _pct(good, 99),
                "p999_ms": _pct(good, 99.9),
            }
        by_phase[phase.name] = row
    end = max((s.at for s in samples), default=0.0)
    slices = []
    for i in range(int(math.ceil(end / SLICE))):
        lo, hi = i * SLICE, (i + 1) * SLICE
        name = next((p.name for p in reversed(phases) if p.started <= lo + 1e-9), phases[0].name)
        row = {"t": lo, "phase": name}
        for proxy in PROXIES:
            mine = [s for s in samples if s.proxy == proxy and lo <= s.at < hi]
            good = [s.latency for s in mine if s.ok]
            row[proxy] = {
                "p50_ms": _pct(good, 50),
                "p99_ms": _pct(good, 99),
                "errors": sum(1 for s in mine if not s.ok),
            }
        slices.append(row)
    return {"phases": by_phase, "slices": slices}


def _verdict(target: dict[str, Any]) -> str:
    if target["target"] == "(info)":
        return "info"
    return "pass" if target["pass"] else "**MISS**"


def markdown(data: dict[str, Any]) -> str:
    num = _report._num
    lines = ["# Routing benchmark", ""]
    meta = data["meta"]
    lines.append(
        f"{meta['when']}, commit {meta['commit']}. Open loop at {meta['rate']:g} req/s to each "
        f"of the three proxies (the same instants), non-streaming chat completions. Regions: "
        + ", ".join(f"{n} (ttft {t * 1000:.0f} ms)" for n, t, *_ in REGIONS)
        + f"; PoP in Frankfurt. Victim of the brownout and the kill: {VICTIM}. Latency is timed "
        "from when each request was due, over the successful ones; errors are non-200 answers "
        "and failed connections."
    )
    lines += ["", "## Targets", ""]
    rows = [[t["metric"], num(t["value"]), t["target"], _verdict(t)] for t in data["targets"]]
    lines += _report._table(["metric", "measured", "target", "result"], rows) + [""]
    lines += ["## By phase", ""]
    header = ["phase", "seconds"]
    for proxy in PROXIES:
        header += [f"{proxy} p50", f"{proxy} p99", f"{proxy} errors"]
    rows = []
    for phase in data["plan"]:
        row = [phase["name"], num(phase["seconds"], 0)]
        for proxy in PROXIES:
            cell = data["phases"][phase["name"]][proxy]
            row += [
                num(cell["p50_ms"], 1),
                num(cell["p99_ms"], 1),
                f"{cell['errors']}/{cell['requests']}",
            ]
        rows.append(row)
    lines += _report._table(header, rows) + [""]
    tail = data["hedging"]
    lines += [
        "## Hedging under the 1% slow tail",
        "",
        f"edgeproxy without hedging: p99 {num(tail['p99_off_ms'], 1)} ms, p99.9 "
        f"{num(tail['p999_off_ms'], 1)} ms; with hedging: p99 {num(tail['p99_on_ms'], 1)} ms, "
        f"p99.9 {num(tail['p999_on_ms'], 1)} ms (p99 cut {num(tail['p99_cut'], 1)}x). Upstream "
        f"requests per client request: {num(tail['attempts_per_request_off'], 3)} without, "
        f"{num(tail['attempts_per_request_on'], 3)} with hedging "
        f"({num(tail['extra_upstream_pct'], 2)}% extra).",
        "",
        "## Over time (5 s slices: p50 / p99 ms, errors)",
        "",
    ]
    rows = []
    for s in data["slices"]:
        row = [f"{s['t']:.0f}", s["phase"]]
        for proxy in PROXIES:
            c = s[proxy]
            row.append(f"{num(c['p50_ms'], 0)} / {num(c['p99_ms'], 0)}, {c['errors']}")
        rows.append(row)
    lines += _report._table(["t (s)", "phase", *PROXIES], rows) + [""]
    return "\n".join(lines)


def chart(data: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(3, 1, figsize=(12, 10), sharex=True)
    ts = [s["t"] + SLICE / 2 for s in data["slices"]]
    for proxy in PROXIES:
        axes[0].plot(ts, [s[proxy]["p50_ms"] for s in data["slices"]], marker=".", label=proxy)
        axes[1].plot(ts, [s[proxy]["p99_ms"] for s in data["slices"]], marker=".", label=proxy)
        axes[2].bar(
            [t + (PROXIES.index(proxy) - 1) * 1.4 for t in ts],
            [s[proxy]["errors"] for s in data["slices"]],
            width=1.4,
            label=proxy,
        )
    axes[0].set_ylabel("p50 ms")
    axes[1].set_ylabel("p99 ms (log)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("errors per 5 s")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        for phase in data["plan"]:
            ax.axvline(phase["started"], color="grey", lw=0.8, ls="--")
        ax.legend(fontsize=8, loc="upper left")
    for phase in data["plan"]:
        axes[0].annotate(
            phase["name"],
            (phase["started"] + 0.5, 0.97),
            xycoords=("data", "axes fraction"),
            fontsize=8,
            va="top",
        )
    meta = data["meta"]
    fig.suptitle(
        f"edgeproxy routing: {VICTIM} browned out (10x), killed, restored; then a 1% "
        f"slow tail everywhere ({meta['when']}, {meta['commit']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=20.0, help="req/s to each proxy")
    parser.add_argument("--quick", action="store_true", help="every phase shortened")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    scale = 0.5 if args.quick else 1.0
    phases = [
        Phase("healthy", 15 * scale),
        Phase("brownout", 20 * scale),
        Phase("killed", 15 * scale),
        Phase("restored", 15 * scale),
        Phase("slow tail", 30 * scale),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        rig = Rig(Path(tmp))
        try:
            for name, ttft, *_ in REGIONS:
                rig.start_region(name, ttft)
            for proxy in PROXIES:
                rig.start_proxy(proxy)
            ttft = dict((n, t) for n, t, *_ in REGIONS)
            counts: dict[str, dict[str, int]] = {}

            def brownout() -> None:
                rig.control(VICTIM, ttft=ttft[VICTIM] * 10)

            def kill() -> None:
                rig.control(VICTIM, ttft=ttft[VICTIM])
                rig.regions[VICTIM].stop(sig=9)

            def restore() -> None:
                rig.start_region(VICTIM, ttft[VICTIM])

            def slow_tail() -> None:
                for name, *_ in REGIONS:
                    rig.control(
                        name,
                        fault="slow_headers",
                        fault_rate=0.01,
                        slow_headers_delay=1.0,
                        fault_paths=["/v1/"],
                    )
                counts["before"] = {p: rig.upstream_requests(p) for p in PROXIES}

            print("routing benchmark: 3 regions, 3 proxies", flush=True)
            samples = asyncio.run(
                load(
                    rig,
                    phases,
                    args.rate,
                    {
                        "brownout": brownout,
                        "killed": kill,
                        "restored": restore,
                        "slow tail": slow_tail,
                    },
                )
            )
            counts["after"] = {p: rig.upstream_requests(p) for p in PROXIES}
            final_status = {p: rig.status(p) for p in PROXIES}
        finally:
            rig.stop()

    data: dict[str, Any] = summarize(samples, phases)
    data["plan"] = [{"name": p.name, "seconds": p.seconds, "started": p.started} for p in phases]
    data["meta"] = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "commit": u.tool_version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
        "rate": args.rate,
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    phase = data["phases"]
    tail_requests = {p: phase["slow tail"][p]["requests"] for p in PROXIES}
    per_request = {
        p: (counts["after"][p] - counts["before"][p]) / max(1, tail_requests[p]) for p in PROXIES
    }
    off, on = phase["slow tail"]["edgeproxy"], phase["slow tail"]["edgeproxy+hedge"]
    hedging = {
        "p99_off_ms": off["p99_ms"],
        "p99_on_ms": on["p99_ms"],
        "p999_off_ms": off["p999_ms"],
        "p999_on_ms": on["p999_ms"],
        "p99_cut": (off["p99_ms"] / on["p99_ms"]) if off["p99_ms"] and on["p99_ms"] else None,
        "attempts_per_request_off": per_request["edgeproxy"],
        "attempts_per_request_on": per_request["edgeproxy+hedge"],
        "extra_upstream_pct": 100 * (per_request["edgeproxy+hedge"] - 1),
    }
    data["hedging"] = hedging
    healthy_p99 = phase["healthy"]["edgeproxy"]["p99_ms"] or float("nan")
    brown = phase["brownout"]
    data["targets"] = [
        {
            "metric": "edgeproxy errors in the kill phase",
            "value": phase["killed"]["edgeproxy"]["errors"],
            "target": "0",
            "pass": phase["killed"]["edgeproxy"]["errors"] == 0,
        },
        {
            "metric": "edgeproxy brownout p99 / healthy p99",
            "value": (brown["edgeproxy"]["p99_ms"] or math.nan) / healthy_p99,
            "target": "<= 2",
            "pass": (brown["edgeproxy"]["p99_ms"] or math.inf) <= 2 * healthy_p99,
        },
        {
            "metric": "round-robin brownout p99 / healthy p99 (baseline)",
            "value": (brown["round-robin"]["p99_ms"] or math.nan)
            / (phase["healthy"]["round-robin"]["p99_ms"] or math.nan),
            "target": "(info)",
            "pass": True,
        },
        {
            "metric": "hedging: p99 cut under the slow tail (x)",
            "value": hedging["p99_cut"],
            "target": ">= 5",
            "pass": (hedging["p99_cut"] or 0) >= 5,
        },
        {
            "metric": "hedging: extra upstream requests (%)",
            "value": hedging["extra_upstream_pct"],
            "target": "<= 5",
            "pass": hedging["extra_upstream_pct"] <= 5,
        },
    ]
    data["final_status"] = final_status
    (args.out / "routing.json").write_text(json.dumps(data, indent=2, default=str))
    report = markdown(data)
    (args.out / "routing.md").write_text(report)
    png = chart(data, args.out / "routing.png")
    print()
    print(report)
    print(f"written: {args.out / 'routing.md'}, routing.json" + (f", {png.name}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
