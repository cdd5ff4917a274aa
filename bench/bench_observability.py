"""What observability costs: metrics and the access log, on against off, in one run.

Three edgeproxy processes side by side in front of one nginx origin (HTTP/1.1):

* *off*: ``[metrics] enabled = false``, no access log (W3C traceparent
  propagation cannot be turned off, so it is in every row);
* *metrics*: the per-request histograms and counters, the recent window for
  ``/status``, and ``/metrics`` scraped every ``--scrape-interval`` seconds;
* *metrics + access log*: the same plus ``[access_log]`` writing JSON lines
  to a file.

wrk drives ``POST /v1/chat/completions`` over keep-alive connections. The
configurations take turns, back to back, over several rounds (the order
rotating each round), so that drift on a shared machine hits them alike; the
cost is the median over rounds of each round's ratio to *off*, with the best
round of each configuration and the CPU the proxy itself used per request
(from /proc) as cross-checks.

    python bench/bench_observability.py [--duration 3] [--rounds 4] [--conns 16]

Target: metrics + access log cost under 5% of throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util as u  # noqa: E402

CONFIGS = {
    "off": {"metrics": False, "access_log": False},
    "metrics": {"metrics": True, "access_log": False},
    "metrics + access log": {"metrics": True, "access_log": True},
}


def proxy_toml(port: int, admin: int, origin: str, *, metrics: bool, log: Path | None) -> str:
    access = f'\n[access_log]\nenabled = true\npath = "{log}"\n' if log else ""
    metrics_on = "true" if metrics else "false"
    return u.edgeproxy_toml(port, admin, origin, f"\n[metrics]\nenabled = {metrics_on}\n", access)


class Scraper:
    """Scrapes one /metrics every ``interval`` seconds while a run lasts, like Prometheus."""

    def __init__(self, url: str, interval: float) -> None:
        self.url = url
        self.interval = interval
        self.scrapes = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        if self.interval > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    self.bytes += len(resp.read())
                    self.scrapes += 1
            except OSError:
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument(
        "--quiet-wait", type=float, default=2.0, help="seconds to wait for others to go quiet"
    )
    parser.add_argument("--conns", type=int, default=16)
    parser.add_argument("--scrape-interval", type=float, default=5.0, help="0: never scrape")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)

    nginx = u.nginx_binary()
    if nginx is None:
        print("bench_observability: needs nginx as the origin (not installed)", file=sys.stderr)
        return 2
    pin = u.plan_pinning(None, None)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="edgeproxy-bench-observability-"))
    script = u.write_wrk_script(work)

    h1, h2 = u.free_port(), u.free_port()
    origin = u.nginx_service(
        "nginx-origin", nginx, work / "nginx", u.nginx_origin_conf(h1, h2), pin.origin_prefix()
    ).start()
    origin_url = f"http://{u.LOOPBACK}:{h1}"

    services: dict[str, tuple[u.Service, str, str]] = {}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    log_path = work / "access.jsonl"
    try:
        origin.wait_http(origin_url + "/", method="POST")
        for i, (name, spec) in enumerate(CONFIGS.items()):
            port, admin = u.free_port(), u.free_port()
            toml = work / f"{i}.toml"
            toml.write_text(
                proxy_toml(
                    port,
                    admin,
                    origin_url,
                    metrics=spec["metrics"],
                    log=log_path if spec["access_log"] else None,
                )
            )
            service = u.Service(
                name,
                [*pin.sut_prefix(), sys.executable, "-m", "edgeproxy", "serve",
                 "--config", str(toml), "--log-level", "warning"],
                work / f"{i}.log",
            ).start()  # fmt: skip
            admin_url = f"http://{u.LOOPBACK}:{admin}"
            service.wait_http(admin_url + "/readyz")
            url = f"http://{u.LOOPBACK}:{port}/v1/chat/completions"
            services[name] = (service, url, admin_url)
        for _, url, _ in services.values():  # warm-up
            u.run_wrk(url, conns=args.conns, duration=1, script=script, pin=pin.harness_prefix())
        names = list(services)
        for round_no in range(args.rounds):
            # Rotate the order: whoever runs first in a round must not always be the same.
            for name in names[round_no % len(names) :] + names[: round_no % len(names)]:
                service, url, admin_url = services[name]
                assert service.proc is not None
                u.wait_quiet(args.quiet_wait)
                scraper = Scraper(admin_url + "/metrics", args.scrape_interval)
                with u.CpuMeter([service.proc.pid], [service.proc.pid]) as cpu, scraper:
                    run = u.run_wrk(
                        url, conns=args.conns, duration=args.duration, script=script,
                        pin=pin.harness_prefix(),
                    )  # fmt: skip
                cpu_us = 1e6 * cpu.sut_cpu_s / run.requests if run.requests else 0.0
                results[name].append(
                    {**run.as_dict(), "round": round_no, "cpu_us_per_req": cpu_us,
                     "foreign_cores": cpu.foreign_cores, "scrapes": scraper.scrapes,
                     "scrape_bytes": scraper.bytes}
                )  # fmt: skip
        metrics_sample = ""
        with urllib.request.urlopen(services["metrics"][2] + "/metrics", timeout=5) as resp:
            metrics_sample = resp.read().decode()
    finally:
        for service, _, _ in services.values():
            service.stop()
        origin.stop()

    log_lines = len(log_path.read_bytes().splitlines()) if log_path.exists() else 0
    hooks = hook_cost_us(work)
    off_by_round = {r["round"]: r for r in results["off"]}
    lines = [
        "# Observability cost",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; {pin.describe()}; "
        f"wrk -c{args.conns}, {args.rounds} rounds of {args.duration:g} s, configurations "
        f"back to back in rotating order; /metrics scraped every {args.scrape_interval:g} s.",
        "",
        "| configuration | cost (median of per-round ratios) | req/s median | req/s best "
        "| best vs best | CPU us/req | CPU cost | p99 ms | errors | others' CPU (max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    summary: dict[str, Any] = {}
    best_off = max(r["rps"] for r in results["off"])
    cpu_off = statistics.median(r["cpu_us_per_req"] for r in results["off"])
    for name, runs in results.items():
        paired = [
            r["rps"] / off_by_round[r["round"]]["rps"]
            for r in runs
            if off_by_round[r["round"]]["rps"]
        ]
        ratio = statistics.median(paired) if paired else 0.0
        best = max(r["rps"] for r in runs)
        cpu_us = statistics.median(r["cpu_us_per_req"] for r in runs)
        summary[name] = {
            "ratio": ratio,
            "paired_ratios": paired,
            "rps_median": statistics.median(r["rps"] for r in runs),
            "rps_best": best,
            "best_ratio": best / best_off if best_off else 0.0,
            "cpu_us_per_req": cpu_us,
            "cpu_ratio": cpu_us / cpu_off if cpu_off else 0.0,
            "p99_ms": statistics.median(r["p99_ms"] for r in runs),
            "errors": sum(r["errors"] for r in runs),
            "foreign_cores": max(r["foreign_cores"] for r in runs),
            "runs": runs,
        }
        v = summary[name]
        lines.append(
            f"| {name} | {100 * (1 - ratio):+.1f}% | {v['rps_median']:,.0f} | {best:,.0f} "
            f"| {100 * (1 - v['best_ratio']):+.1f}% | {cpu_us:.0f} "
            f"| {100 * (v['cpu_ratio'] - 1):+.1f}% | {v['p99_ms']:.2f} | {v['errors']} "
            f"| {v['foreign_cores']:.2f} |"
        )
    full = summary["metrics + access log"]
    cost = 100 * (1 - full["ratio"])
    verdict = "pass" if full["ratio"] >= 0.95 else "MISS"
    series = sum(1 for line in metrics_sample.splitlines() if line and not line.startswith("#"))
    lines += [
        "",
        f"Target: metrics + access log cost under 5% of throughput -> {cost:.1f}% "
        f"(best vs best {100 * (1 - full['best_ratio']):.1f}%, CPU per request "
        f"{100 * (full['cpu_ratio'] - 1):+.1f}%): **{verdict}**",
        "",
        f"Access log lines written: {log_lines:,}. A scrape of the metrics row after the run: "
        f"{series} series, {len(metrics_sample):,} bytes. Costs are positive when slower; "
        "others' CPU is what processes outside the benchmark used (cores), a noisy run's mark.",
    ]
    lines += [
        "",
        "In-process cost of the hooks alone (`edgeproxy_response_complete` as the pipeline "
        "calls it, the log writer thread included), set against the *off* proxy's CPU per "
        f"request ({cpu_off:.0f} us):",
        "",
        "| configuration | hook CPU us/req | share of a request |",
        "| --- | --- | --- |",
    ]
    for name, us in hooks.items():
        lines.append(f"| {name} | {us:.1f} | {100 * us / cpu_off if cpu_off else 0:.1f}% |")
        summary[name]["hook_us_per_req"] = us
    report = "\n".join(lines)
    print(report)
    (args.out / "observability.md").write_text(report + "\n")
    (args.out / "observability.json").write_text(json.dumps(summary, indent=2))
    chart(summary, args.out / "observability.png")
    return 0


def hook_cost_us(work: Path, n: int = 20000) -> dict[str, float]:
    """CPU per request of the observability hooks alone, called as the pipeline calls them.

    A steadier figure than req/s on a busy machine: set against the *off*
    proxy's CPU per request it gives the share observability adds.
    """
    import asyncio

    from multidict import CIMultiDict

    from edgeproxy import Config
    from edgeproxy._core.context import RequestContext
    from edgeproxy._observability.metrics import Metrics
    from edgeproxy._plugins import Plugins
    from edgeproxy._protocol.headers import trace_context
    from edgeproxy.plugins.access_log import AccessLog

    config = Config.from_mapping({"regions": [{"name": "origin", "url": "http://x"}]}, environ={})
    out: dict[str, float] = {}
    for name, spec in CONFIGS.items():
        plugins = Plugins()
        if spec["metrics"]:
            plugins.register(Metrics(config, lambda: {}), name="edgeproxy.metrics")
        log = AccessLog(str(work / f"hook-{len(out)}.jsonl")) if spec["access_log"] else None
        if log is not None:
            plugins.register(log, name="access_log")

        async def run(plugins: Plugins = plugins, log: AccessLog | None = log) -> float:
            if log is not None:
                await log.edgeproxy_startup()
            now = time.monotonic()
            ctx = RequestContext(
                request_id="0af7651916cd43dd8448eb211c80319c",
                trace=trace_context(None),
                method="POST",
                target=u.REQUEST_PATH,
                headers=CIMultiDict({"content-type": "application/json"}),
                client_ip="127.0.0.1",
                started=now,
                route=config.route_for("POST", u.REQUEST_PATH),
            )
            ctx.region, ctx.status, ctx.attempts, ctx.bytes_out = "origin", 200, 1, 280
            ctx.upstream_ttfb, ctx.first_byte_at, ctx.finished_at = 0.0004, now + 0.0005, now + 6e-4
            ctx.usage = {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}
            cpu = time.process_time()
            if plugins.has("edgeproxy_response_complete"):
                for _ in range(n):
                    await plugins.call_all_logged(
                        "edgeproxy_response_complete", request=None, ctx=ctx
                    )
            spent = time.process_time() - cpu  # the writer thread's share included
            if log is not None:
                await log.edgeproxy_shutdown()
            return 1e6 * spent / n

        out[name] = asyncio.run(run())
    return out


def chart(summary: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(summary)
    for ax, key, label in (
        (axes[0], "rps_median", "req/s (median round)"),
        (axes[1], "cpu_us_per_req", "proxy CPU us per request"),
    ):
        bars = ax.bar(names, [summary[n][key] for n in names], color=["#888", "#3572d6", "#d08a16"])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("edgeproxy: cost of metrics and access log (target < 5%)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
