"""``edgeproxy serve --workers 1`` against ``--workers 2``, in one run, reported as ratios.

    .venv/bin/python bench/bench_workers.py            # about 2 minutes
    .venv/bin/python bench/bench_workers.py --quick    # under a minute

wrk (one thread, closed loop, keep-alive connections) posts the same small chat completion
to each configuration; the origin is nginx (the fake region when nginx is absent); every
configuration runs at once and the rounds are interleaved, so a slow minute on a shared
machine hurts all of them alike. The median round of each is reported.

On a machine with two cores there is no placement that gives two workers two cores of
their own and the load generator a third, so the run measures four placements:

- ``1w pinned``: one worker on CPU 1; wrk and the origin on CPU 0 (the baseline: one core
  for the proxy, the harness away from it);
- ``1w pinned, mp metrics``: the baseline writing its metrics to prometheus-client's
  multiprocess files, as workers under a supervisor do;
- ``2w pinned``: two workers, both on CPU 1; wrk and the origin on CPU 0. Same CPU as the
  baseline: the ratio is the cost of the supervisor model itself (two processes taking turns
  on one core, SO_REUSEPORT, the multiprocess metrics), not scaling;
- ``1w free`` and ``2w free``: no pinning of the proxy; wrk and the origin still on CPU 0,
  so the workers take what CPU 0 has left besides CPU 1. ``2w free / 1w pinned`` is the
  scaling that two cores can show: at most 1 + (the share of CPU 0 the harness leaves), far
  below the 2.0 of a machine with spare cores; ``proxy cores`` says how much CPU the
  workers got.

Results: bench/results/workers.{md,json,png}. The table of the last run is in
docs/deployment.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:  # run as a script: make the helpers importable
    sys.path.insert(0, str(HERE))

import _util as u  # noqa: E402

PYTHON = sys.executable


@dataclass
class Config:
    """One placement: how many workers, and the CPUs the proxy may use (None: any)."""

    name: str
    workers: int
    cpus: tuple[int, ...] | None
    # One process writing its metrics the way workers do (prometheus-client's multiprocess
    # files), to tell that cost from two processes sharing a core.
    multiprocess_metrics: bool = False
    # Metrics off ([metrics] enabled = false): with its pair, what metrics cost per request.
    metrics: bool = True
    port: int = 0
    admin: int = 0
    service: u.Service | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{u.LOOPBACK}:{self.port}"

    def summary(self) -> dict[str, Any]:
        def median(key: str) -> float:
            return round(statistics.median(r[key] for r in self.rounds), 3)

        return {
            "name": self.name,
            "workers": self.workers,
            "cpus": "any" if self.cpus is None else ",".join(map(str, self.cpus)),
            "rps": median("rps"),
            "p50_ms": median("p50_ms"),
            "p99_ms": median("p99_ms"),
            "proxy_cores": median("proxy_cores"),
            "cpu_us_per_request": median("cpu_us_per_request"),
            "foreign_cores": max(r["foreign_cores"] for r in self.rounds),
            "best_rps": round(max(r["rps"] for r in self.rounds), 1),
            "errors": sum(r["errors"] for r in self.rounds),
            "rounds": self.rounds,
        }


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="edgeproxy-bench-workers-"))
        self.services: list[u.Service] = []
        self.cpus = sorted(os.sched_getaffinity(0))
        self.harness: tuple[int, ...] = (self.cpus[0],) if len(self.cpus) >= 2 else ()
        self.proxy_cpu: tuple[int, ...] = (self.cpus[-1],) if len(self.cpus) >= 2 else ()
        if shutil.which("taskset") is None:
            self.harness = self.proxy_cpu = ()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEPROXY_")}
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.script = u.write_wrk_script(self.tmp)

    def launch(self, svc: u.Service) -> u.Service:
        self.services.append(svc)
        return svc.start()

    def close(self) -> None:
        for svc in reversed(self.services):
            with contextlib.suppress(Exception):
                svc.stop(timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def pin(self, cpus: tuple[int, ...] | None) -> list[str]:
        return ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []

    @contextlib.contextmanager
    def origin(self) -> Iterator[tuple[str, str]]:
        """The upstream: (its URL, what it is)."""
        nginx = u.nginx_binary()
        if nginx is not None:
            h1, h2 = u.free_port(), u.free_port()
            svc = u.nginx_service(
                "nginx-origin",
                nginx,
                self.tmp / "nginx-origin",
                u.nginx_origin_conf(h1, h2),
                self.pin(self.harness),
            )
            self.launch(svc)
            url = f"http://{u.LOOPBACK}:{h1}"
            svc.wait_http(url + "/", timeout=20)
            yield url, "nginx"
            return
        svc = u.Service(
            "fake-region",
            [*self.pin(self.harness), PYTHON, "-m", "edgeproxy.testing", "--port", "0"],
            self.tmp / "fake-region.log",
            env=self.env,
            cwd=REPO,
        )
        self.launch(svc)
        line = svc.wait_line("listening on http://", timeout=30)
        yield (
            "http://" + line.split("listening on http://", 1)[1].split()[0].rstrip("/"),
            ("fake region"),
        )

    def start(self, config: Config, origin: str) -> None:
        config.port, config.admin = u.free_port(), u.free_port()
        path = self.tmp / f"{config.name.replace(' ', '-')}.toml"
        # edgeproxy_toml writes the [server] table first: the workers key goes into it.
        toml = u.edgeproxy_toml(config.port, config.admin, origin)
        toml = toml.replace("[server]\n", f"[server]\nworkers = {config.workers}\n", 1)
        if not config.metrics:
            toml += "\n[metrics]\nenabled = false\n"
        path.write_text(toml)
        argv = [
            *self.pin(config.cpus),
            PYTHON,
            "-m",
            "edgeproxy",
            "serve",
            "--config",
            str(path),
            "--log-level",
            "warning",
        ]
        env = dict(self.env)
        if config.multiprocess_metrics:
            metrics_dir = self.tmp / f"metrics-{config.port}"
            metrics_dir.mkdir()
            env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        config.service = self.launch(
            u.Service(config.name, argv, self.tmp / f"{config.name}.log", env=env, cwd=REPO)
        )

    def ready(self, config: Config) -> None:
        assert config.service is not None
        config.service.wait_http(f"http://{u.LOOPBACK}:{config.admin}/readyz", timeout=120)

    def run_once(self, config: Config, duration: float) -> dict[str, Any]:
        assert config.service is not None and config.service.proc is not None
        pid = config.service.proc.pid
        u.wait_quiet(self.args.quiet_wait, sample=0.2)
        with u.CpuMeter([pid], [pid]) as meter:
            result = u.run_wrk(
                config.url + u.REQUEST_PATH,
                conns=self.args.conns,
                duration=duration,
                script=self.script,
                pin=self.pin(self.harness),
            )
        seconds = max(result.duration_s, 1e-6)
        return {
            "rps": round(result.rps, 1),
            "p50_ms": result.p50_ms,
            "p99_ms": result.p99_ms,
            "errors": result.errors,
            "proxy_cores": round(meter.sut_cpu_s / seconds, 3),
            "cpu_us_per_request": round(meter.sut_cpu_s / max(1, result.requests) * 1e6, 1),
            "foreign_cores": meter.foreign_cores,
        }

    def least_disturbed(self, config: Config, duration: float) -> dict[str, Any]:
        """A round, run again (up to ``--retries`` times) while others used more than
        ``--max-foreign`` cores during it; the least disturbed attempt, with its number."""
        best: dict[str, Any] | None = None
        for attempt in range(1 + self.args.retries):
            result = self.run_once(config, duration)
            result["attempt"] = attempt + 1
            if best is None or result["foreign_cores"] < best["foreign_cores"]:
                best = result
            if result["foreign_cores"] <= self.args.max_foreign:
                break
        assert best is not None
        return best


def report(data: dict[str, Any]) -> str:
    rows = data["configs"]
    base = next(r for r in rows if r["name"] == "1w pinned")["rps"] or 1.0
    lines = [
        f"edgeproxy serve --workers 1 vs 2 ({data['date']}, commit {data['commit']},"
        f" {data['cpus']} CPUs, {data['python']}; origin {data['origin']};"
        f" wrk -t1 -c{data['conns']}, {data['duration']:g}s x {data['rounds']} rounds,"
        f" median round)",
        "",
        "| placement | workers | proxy CPUs | req/s | vs 1w pinned | best round req/s |"
        " vs 1w pinned | p50 ms | p99 ms | proxy cores | CPU us/req | errors |"
        " others' cores (max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    best = next(r for r in rows if r["name"] == "1w pinned")["best_rps"] or 1.0
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['workers']} | {r['cpus']} | {r['rps']:.0f} |"
            f" {r['rps'] / base:.2f} | {r['best_rps']:.0f} | {r['best_rps'] / best:.2f} |"
            f" {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |"
            f" {r['proxy_cores']:.2f} | {r['cpu_us_per_request']:.0f} | {r['errors']} |"
            f" {r['foreign_cores']:.2f} |"
        )
    by = {r["name"]: r for r in rows}
    lines += [
        "",
        f"scaling, 2w free / 1w pinned: {by['2w free']['rps'] / base:.2f}x median rounds,"
        f" {by['2w free']['best_rps'] / best:.2f}x best rounds"
        f" (2w free / 1w free: {by['2w free']['rps'] / (by['1w free']['rps'] or 1):.2f}x;"
        f" the cost of the supervisor model on one core, 2w pinned / 1w pinned:"
        f" {by['2w pinned']['rps'] / base:.2f}x; a process writing prometheus-client's"
        f" multiprocess files, as workers did before the supervisor summed their own:"
        f" {by['1w pinned, mp metrics']['rps'] / base:.2f}x)",
        "",
        "What metrics cost per request (CPU us/req with metrics over without): one process"
        f" {_share(by, '1w pinned')}, two workers {_share(by, '2w pinned')}.",
    ]
    return "\n".join(lines)


def _share(by: dict[str, Any], name: str) -> str:
    on = by[name]["cpu_us_per_request"]
    off = by[f"{name}, no metrics"]["cpu_us_per_request"] or 1.0
    return f"{on:.0f} / {off:.0f} us = {on / off:.3f}x"


def chart(data: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = data["configs"]
    first = next(r for r in rows if r["name"] == "1w pinned")
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    xs = range(len(rows))
    for offset, key, label, color in (
        (-0.2, "rps", "median round", "#48c"),
        (0.2, "best_rps", "best round", "#26a"),
    ):
        ratios = [r[key] / (first[key] or 1.0) for r in rows]
        bars = ax.bar([x + offset for x in xs], ratios, width=0.4, label=label, color=color)
        ax.bar_label(bars, labels=[f"{x:.2f}x" for x in ratios], fontsize=8)
    ax.set_xticks(list(xs), [r["name"] for r in rows])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.margins(y=0.15)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_ylabel("req/s vs 1 worker pinned")
    ax.set_title(f"serve --workers, {data['cpus']} CPUs, wrk and origin on CPU 0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, for a smoke test")
    parser.add_argument("--duration", type=float, help="seconds per run (default 5; quick 2)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; quick 1)")
    parser.add_argument("--conns", type=int, default=64, help="wrk connections (default 64)")
    parser.add_argument(
        "--quiet-wait", type=float, default=3.0, help="seconds to wait for a quiet machine"
    )
    parser.add_argument(
        "--retries", type=int, default=3, help="runs again of a disturbed round (default 3)"
    )
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.3,
        help="cores others may use during a round before it is run again (default 0.3)",
    )
    parser.add_argument("--results", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    duration = args.duration or (2.0 if args.quick else 5.0)
    rounds = args.rounds or (1 if args.quick else 3)
    if shutil.which("wrk") is None:
        print("bench_workers: wrk is not installed", file=sys.stderr)
        return 2
    bench = Bench(args)
    proxy_cpu = bench.proxy_cpu or None
    configs = [
        Config("1w pinned", 1, proxy_cpu),
        Config("1w pinned, mp metrics", 1, proxy_cpu, multiprocess_metrics=True),
        Config("1w pinned, no metrics", 1, proxy_cpu, metrics=False),
        Config("2w pinned", 2, proxy_cpu),
        Config("2w pinned, no metrics", 2, proxy_cpu, metrics=False),
        Config("1w free", 1, None),
        Config("2w free", 2, None),
    ]
    try:
        with bench.origin() as (origin, kind):
            for config in configs:
                bench.start(config, origin)
            for config in configs:
                bench.ready(config)
                bench.run_once(config, 1.0)  # warm the pools and the code
            for round_ in range(rounds):
                for config in configs if round_ % 2 == 0 else reversed(configs):
                    result = bench.least_disturbed(config, duration)
                    config.rounds.append(result)
                    print(f"  round {round_ + 1} {config.name}: {result}", flush=True)
    finally:
        bench.close()
    data = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git_commit(),
        "cpus": len(bench.cpus),
        "python": f"Python {platform.python_version()}",
        "origin": kind,
        "conns": args.conns,
        "duration": duration,
        "rounds": rounds,
        "harness_cpus": list(bench.harness),
        "configs": [c.summary() for c in configs],
    }
    text = report(data)
    print()
    print(text)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "workers.md").write_text(text + "\n")
    (args.results / "workers.json").write_text(json.dumps(data, indent=2) + "\n")
    png = chart(data, args.results / "workers.png")
    print(f"\nwrote {args.results / 'workers.md'}, workers.json" + (", workers.png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
