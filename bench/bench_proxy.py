"""edgeproxy against a bare aiohttp forwarder, nginx and the raw upstream, in one run.

    .venv/bin/python bench/bench_proxy.py            # full run, about 4 minutes
    .venv/bin/python bench/bench_proxy.py --quick    # smoke run, under a minute

Sections (see bench/README.md for how to read them):

1. throughput   wrk, closed loop, POST /v1/chat/completions to: nginx directly,
                the reference forwarder, edgeproxy (HTTP/1.1 and h2c upstream)
                and nginx as a reverse proxy; then each proxy at half its own
                saturation with h2load --rps (open loop), next to nginx direct
                at the same rate, for the latency the hop adds.
2. stress       edgeproxy with an h2c upstream at 32..256 client connections,
                across nginx's GOAWAY every 1000 streams and its 128-stream limit.
3. ttfb         time to the first SSE byte of streaming completions from the
                fake region, direct and through edgeproxy.
4. profile      pyinstrument on edgeproxy under load; top hot spots in its code.

Results: bench/results/proxy.{md,json,png} and bench/results/profile-*.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:  # run as a script: make the helpers importable
    sys.path.insert(0, str(HERE))

import _report  # noqa: E402
import _util as u  # noqa: E402

PYTHON = sys.executable
SECTIONS = ("throughput", "stress", "ttfb", "profile")
T = TypeVar("T")

# Targets the lead set; the report marks each pass or miss.
TARGET_H1_RATIO = 0.9
TARGET_H2_RATIO = 0.8
TARGET_ADDED_P50_MS = 1.0
TARGET_ADDED_P99_MS = 5.0
TARGET_TTFB_ADDED_MS = 1.0


@dataclass(frozen=True)
class Plan:
    """How long each part runs; ``--quick`` shrinks everything for a smoke run."""

    duration: float  # each closed-loop throughput run (one round of one configuration)
    rounds: int  # interleaved rounds per configuration and connection count
    conns: tuple[int, ...]
    warmup: float  # untimed load before a configuration's first run
    rate_duration: float
    rate_warmup: float
    rate_rounds: int
    stress_conns: tuple[int, ...]
    stress_duration: float
    ttfb_n: int
    ttfb_warmup: int
    profile_duration: float

    @classmethod
    def make(cls, args: argparse.Namespace) -> Plan:
        if args.quick:
            plan = cls(2, 1, (16,), 0.5, 2, 0.5, 1, (32, 256), 2, 30, 3, 3)
        else:
            plan = cls(2, 4, (16, 64), 1, 2.5, 0.5, 2, (32, 64, 128, 256), 3, 200, 3, 5)
        overrides = {
            "duration": args.duration,
            "rounds": args.rounds,
            "conns": tuple(args.conns) if args.conns else None,
            "ttfb_n": args.ttfb_n,
        }
        return replace(plan, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class Origin:
    """The upstream every proxy forwards to: nginx, or the fake region when nginx is absent."""

    kind: str  # "nginx" or "fake region"
    h1_url: str
    h2_url: str | None
    h1_port: int
    service: u.Service


@dataclass(frozen=True)
class Target:
    name: str
    label: str
    url: str
    admin_url: str | None = None


class Bench:
    """Owns the temp dir, the server processes and the results of one run."""

    def __init__(self, args: argparse.Namespace, plan: Plan) -> None:
        self.args = args
        self.plan = plan
        self.pin = u.plan_pinning(args.harness_cpu, args.sut_cpu, args.layout)
        self.tmp = Path(tempfile.mkdtemp(prefix="edgeproxy-bench-"))
        self.results_dir: Path = args.results
        self.services: list[u.Service] = []
        self.notes: list[str] = []
        self.contended: list[str] = []
        self.patience: float = args.patience
        self.nginx = None if args.skip_nginx else u.nginx_binary()
        self.wrk_script = u.write_wrk_script(self.tmp)
        self.body_file = self.tmp / "request.json"
        self.body_file.write_text(u.REQUEST_JSON)
        self.data: dict[str, Any] = {
            "throughput": {},
            "half_saturation": {},
            "stress": [],
            "ttfb": {},
            "profile": {},
        }
        self._child_env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEPROXY_")}
        self._child_env["PYTHONUNBUFFERED"] = "1"

    # -- process management ------------------------------------------------------

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  note: {text}", flush=True)

    def launch(self, svc: u.Service) -> u.Service:
        self.services.append(svc)
        return svc.start()

    def stop(self, svc: u.Service) -> None:
        svc.stop()
        if svc in self.services:
            self.services.remove(svc)

    def close(self) -> None:
        for svc in reversed(self.services):
            with contextlib.suppress(Exception):
                svc.stop()
        self.services.clear()

    @contextlib.contextmanager
    def running(self, svc: u.Service, ready: Callable[[u.Service], None]) -> Iterator[u.Service]:
        self.launch(svc)
        try:
            ready(svc)
            yield svc
        finally:
            self.stop(svc)

    def python_service(self, name: str, argv: list[str], *, origin: bool = False) -> u.Service:
        pin = self.pin.origin_prefix() if origin else self.pin.sut_prefix()
        return u.Service(
            name,
            [*pin, PYTHON, *argv],
            self.tmp / f"{name}.log",
            env=self._child_env,
            cwd=REPO,
        )

    def edgeproxy_service(
        self,
        name: str,
        region_url: str,
        *,
        http2: bool,
        max_connections: int,
        profile_to: Path | None = None,
    ) -> tuple[u.Service, Target]:
        port, admin = u.free_port(), u.free_port()
        config = self.tmp / f"{name}.toml"
        config.write_text(
            _edgeproxy_toml(port, admin, region_url, http2=http2, max_connections=max_connections)
        )
        serve = ["serve", "--config", str(config), "--log-level", "warning"]
        if profile_to is None:
            argv = ["-m", "edgeproxy", *serve]
        else:
            argv = [str(HERE / "_profiled_serve.py"), str(profile_to), *serve]
        svc = self.python_service(name, argv)
        target = Target(
            name,
            _LABELS.get(name, name),
            f"http://{u.LOOPBACK}:{port}",
            f"http://{u.LOOPBACK}:{admin}",
        )
        return svc, target

    @staticmethod
    def edgeproxy_ready(target: Target) -> Callable[[u.Service], None]:
        def ready(svc: u.Service) -> None:
            svc.wait_http(f"{target.admin_url}/readyz", timeout=30)

        return ready

    def fake_region_service(self, name: str, ttft: float, itd: float) -> u.Service:
        port = u.free_port()
        return self.python_service(
            name,
            [
                "-m",
                "edgeproxy.testing",
                "--name",
                name,
                "--port",
                str(port),
                "--ttft",
                f"{ttft:g}",
                "--inter-token-delay",
                f"{itd:g}",
            ],
            origin=True,
        )

    @staticmethod
    def fake_region_url(svc: u.Service) -> str:
        line = svc.wait_line("listening on http://", timeout=30)
        return "http://" + line.split("listening on http://", 1)[1].split()[0].rstrip("/")

    # -- load --------------------------------------------------------------------

    def wrk(self, url: str, conns: int, duration: float) -> u.WrkResult:
        return u.run_wrk(
            url + u.REQUEST_PATH,
            conns=conns,
            duration=duration,
            script=self.wrk_script,
            pin=self.pin.harness_prefix(),
        )

    def rate(self, url: str, rate: float) -> u.LoadResult:
        return u.run_openloop(
            url + u.REQUEST_PATH,
            rate=rate,
            duration=self.plan.rate_duration,
            warmup=self.plan.rate_warmup,
            conns=32,
            body_file=self.body_file,
            pin=self.pin.harness_prefix(),
        )

    def closed(self, url: str, conns: int, duration: float, tag: str) -> u.LoadResult:
        # No h2load warm-up: requests in flight when its warm-up ends are logged
        # with status 0 (h2load drops their connections), which would read as
        # proxy errors. The pools are warm from the previous run anyway.
        return u.run_h2load(
            url + u.REQUEST_PATH,
            clients=conns,
            duration=duration,
            warmup=0,
            body_file=self.body_file,
            log_file=self.tmp / f"h2load-{tag}.log",
            pin=self.pin.harness_prefix(),
        )

    def _quiet(self) -> None:
        """Give other processes a moment to go quiet, out of a budget for the whole run:
        on a busy machine the benchmark still ends in bounded time, flagging what it had to
        measure while others ran."""
        if self.patience <= 0:
            return
        started = time.monotonic()
        u.wait_quiet(min(self.args.quiet_wait, self.patience), sample=0.2)
        waited = time.monotonic() - started
        # The sample itself is part of every run's cost, not of the waiting.
        self.patience -= max(0.0, waited - 0.2)

    def attempt(
        self, label: str, fn: Callable[[], T], sut: u.Service | None = None
    ) -> tuple[T, float, float]:
        """Run ``fn`` while metering everyone else's CPU; retry if that was too much.

        On a shared machine a colleague's test run can take a core for a few
        seconds and halve a proxy's req/s; the retry keeps the least disturbed
        attempt, and the report flags the runs that never got a quiet window.
        Returns the result, the cores others used, and the CPU seconds ``sut`` used.
        """
        best: tuple[T, float, float] | None = None
        sut_pids = [sut.proc.pid] if sut is not None and sut.proc is not None else []
        for attempt in range(1 + self.args.retries):
            self._quiet()
            pids = [svc.proc.pid for svc in self.services if svc.proc is not None]
            started = time.monotonic()
            with u.CpuMeter(pids, sut_pids) as meter:
                result = fn()
            if attempt:
                self.patience -= time.monotonic() - started
            if best is None or meter.foreign_cores < best[1]:
                best = (result, meter.foreign_cores, meter.sut_cpu_s)
            if meter.foreign_cores <= self.args.max_foreign or self.patience <= 0:
                break
            if attempt < self.args.retries:
                print(
                    f"    (other processes took {meter.foreign_cores:.2f} cores during "
                    f"{label}; running it again)",
                    flush=True,
                )
        assert best is not None
        if best[1] > self.args.max_foreign:
            self.contended.append(f"{label} ({best[1]:.2f} cores)")
        return best

    # -- the origin ----------------------------------------------------------------

    @contextlib.contextmanager
    def origin(self) -> Iterator[Origin | None]:
        if self.nginx:
            h1, h2 = u.free_port(), u.free_port()
            svc = u.nginx_service(
                "nginx-origin",
                self.nginx,
                self.tmp / "nginx-origin",
                u.nginx_origin_conf(h1, h2),
                self.pin.origin_prefix(),
            )
            url = f"http://{u.LOOPBACK}:{h1}"
            with self.running(svc, lambda s: s.wait_http(url + "/")):
                yield Origin("nginx", url, f"http://{u.LOOPBACK}:{h2}", h1, svc)
            return
        reason = "--skip-nginx given" if self.args.skip_nginx else "nginx is not installed"
        self.note(
            f"{reason}: the upstream is the fake region (Python, on the server core), "
            "so throughput ratios understate what edgeproxy can do; nginx rows skipped"
        )
        svc = self.fake_region_service("origin-fake", 0.0, 0.0)
        try:
            self.launch(svc)
            url = self.fake_region_url(svc)
        except u.ServiceError as exc:
            self.stop(svc)
            self.note(f"no upstream at all (fake region did not start): {_first_line(exc)}")
            yield None
            return
        try:
            yield Origin("fake region", url, url, int(url.rsplit(":", 1)[1]), svc)
        finally:
            self.stop(svc)

    # -- section 1: throughput and half-saturation latency -----------------------------

    def section_throughput(self, origin: Origin) -> None:
        plan = self.plan
        _header(
            f"throughput: wrk -t1, {plan.rounds} interleaved rounds of {plan.duration:g}s "
            f"per configuration, conns {list(plan.conns)}; upstream {origin.kind}"
        )
        direct = Target("direct", f"direct ({origin.kind})", origin.h1_url)
        self.data["throughput"]["direct"] = _entry(direct.label)
        with contextlib.ExitStack() as stack:
            # Every server runs for the whole section and the rounds take turns:
            # on a shared machine a slow minute then hits every configuration
            # alike instead of whichever happened to be measured during it.
            lineup: list[tuple[Target, u.Service]] = [(direct, origin.service)]
            for target, svc, ready in self._proxies(origin):
                entry = self.data["throughput"][target.name] = _entry(target.label)
                try:
                    stack.enter_context(self.running(svc, ready))
                except u.ServiceError as exc:
                    entry["skipped"] = f"did not start: {_first_line(exc)}"
                    self.note(f"{target.label}: {entry['skipped']}")
                    continue
                lineup.append((target, svc))
            for target, _ in lineup:
                # Fill keep-alive pools and warm caches before anything is timed.
                self.wrk(target.url, max(plan.conns), plan.warmup)
            for conns in plan.conns:
                for rnd in range(plan.rounds):
                    shift = rnd % len(lineup)
                    for target, svc in lineup[shift:] + lineup[:shift]:
                        self._closed_run(target, svc, conns, rnd)
                for target, _ in lineup:
                    self._summarize(target.name, conns)
            for target, _ in lineup:
                entry = self.data["throughput"][target.name]
                entry["saturation_rps"] = max(v["rps"] for v in entry["by_conns"].values())
                if target.admin_url:
                    entry["status"] = _status(target)
            for target, _ in lineup[1:]:
                self._half_saturation(target, direct)

    def _proxies(
        self, origin: Origin
    ) -> Iterator[tuple[Target, u.Service, Callable[[u.Service], None]]]:
        ref_port = u.free_port()
        ref = self.python_service(
            "reference",
            [
                str(HERE / "reference_proxy.py"),
                "--port",
                str(ref_port),
                "--upstream",
                origin.h1_url,
                "--limit",
                str(self.args.pool_size),
            ],
        )
        ref_target = Target("reference", _LABELS["reference"], f"http://{u.LOOPBACK}:{ref_port}")
        # /v1/models: nginx answers any path, the fake region only its API routes.
        yield ref_target, ref, lambda s: s.wait_http(ref_target.url + "/v1/models")
        svc, target = self.edgeproxy_service(
            "edgeproxy-h1", origin.h1_url, http2=False, max_connections=self.args.pool_size
        )
        yield target, svc, self.edgeproxy_ready(target)
        if origin.h2_url:
            svc, target = self.edgeproxy_service(
                "edgeproxy-h2", origin.h2_url, http2=True, max_connections=self.args.h2_connections
            )
            yield target, svc, self.edgeproxy_ready(target)
        if self.nginx and origin.kind == "nginx":
            port = u.free_port()
            peer = u.nginx_service(
                "nginx-proxy",
                self.nginx,
                self.tmp / "nginx-proxy",
                u.nginx_proxy_conf(port, origin.h1_port, self.args.pool_size),
                self.pin.sut_prefix(),
            )
            peer_target = Target(
                "nginx-proxy", _LABELS["nginx-proxy"], f"http://{u.LOOPBACK}:{port}"
            )
            yield peer_target, peer, lambda s: s.wait_http(peer_target.url + "/")
        else:
            self.data["throughput"]["nginx-proxy"] = {
                **_entry(_LABELS["nginx-proxy"]),
                "skipped": "nginx not available",
            }
            self.note(f"{_LABELS['nginx-proxy']}: skipped (nginx not available)")

    def _closed_run(self, target: Target, svc: u.Service, conns: int, rnd: int) -> None:
        res, foreign, cpu_s = self.attempt(
            f"{target.label} c={conns} round {rnd + 1}",
            lambda: self.wrk(target.url, conns, self.plan.duration),
            svc,
        )
        per_req = cpu_s / res.requests * 1e6 if res.requests else None
        self.data["throughput"][target.name]["runs"].append(
            {**res.as_dict(), "round": rnd, "foreign_cores": foreign, "cpu_us_per_req": per_req}
        )

    def _summarize(self, name: str, conns: int) -> None:
        """Best and median over the rounds.

        The best round is the headline: on a shared VM the same code runs up to
        twice as slow for a few seconds at a time (a pure-Python loop pinned to
        one core varies by a third between seconds, with nothing else running in
        the guest), and the best of several short rounds is each server's speed
        in a fast phase. The median and the range show how noisy that was.
        """
        entry = self.data["throughput"][name]
        runs = [r for r in entry["runs"] if r["conns"] == conns]
        if not runs:
            return
        ref_runs = [
            r
            for r in self.data["throughput"].get("reference", {}).get("runs", [])
            if r["conns"] == conns
        ]
        best = max(runs, key=lambda r: r["rps"])
        ref_best = max((r["rps"] for r in ref_runs), default=0.0)
        cpu = [r["cpu_us_per_req"] for r in runs if r.get("cpu_us_per_req")]
        summary = {
            "rps": best["rps"],
            "rps_median": _median([r["rps"] for r in runs]),
            "rps_min": min(r["rps"] for r in runs),
            "p50_ms": best["p50_ms"],
            "p99_ms": best["p99_ms"],
            "errors": sum(r["errors"] for r in runs),
            "non2xx": sum(r["non2xx"] for r in runs),
            "cpu_us_per_req": min(cpu) if cpu else None,
            "vs_reference": best["rps"] / ref_best if ref_best else None,
            "foreign_cores": max(r["foreign_cores"] for r in runs),
        }
        entry["by_conns"][str(conns)] = summary
        ratio = f"{summary['vs_reference']:.2f}x ref" if summary["vs_reference"] else ""
        print(
            f"    {entry['label']:<30} c={conns:<4} best {summary['rps']:7.0f} req/s "
            f"(median {summary['rps_median']:.0f}, min {summary['rps_min']:.0f})  "
            f"p50 {summary['p50_ms']:6.2f} ms  p99 {summary['p99_ms']:6.2f} ms  "
            f"errors {summary['errors']}  {summary['cpu_us_per_req'] or 0:5.0f} CPU us/req  "
            f"{ratio}",
            flush=True,
        )

    def _half_saturation(self, target: Target, direct: Target) -> None:
        entry = self.data["throughput"][target.name]
        # Half of the *median* round, not the best: at half of a fast phase's
        # rate, a slow phase of the VM is already saturation. The Python generator
        # stays accurate up to a few thousand req/s; only nginx needs the cap.
        typical = max(v["rps_median"] for v in entry["by_conns"].values())
        rate = min(self.args.max_rate, max(100.0, typical / 2))
        pairs = []
        foreign_max = 0.0
        for rnd in range(self.plan.rate_rounds):
            # Proxy and direct back to back, as one attempt: the difference is
            # only meaningful if both saw the same machine.
            (via, floor), foreign, _ = self.attempt(
                f"{target.label} at half saturation, round {rnd + 1}",
                lambda: (self.rate(target.url, rate), self.rate(direct.url, rate)),
            )
            pairs.append((via, floor))
            foreign_max = max(foreign_max, foreign)

        # As with throughput, the headline is the best pair (lowest proxy p50): one
        # slow phase of the VM turns "half load" into saturation for a few seconds.
        # The worst pair is reported next to it.
        best_via, best_floor = min(pairs, key=lambda pair: pair[0].p50_ms)
        worst_via, worst_floor = max(pairs, key=lambda pair: pair[0].p50_ms)
        keys = ("achieved_rps", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms")
        half = {
            "label": target.label,
            "foreign_cores": foreign_max,
            "rate": rate,
            "capped": rate < typical / 2,
            "rounds": [{"proxy": v.as_dict(), "direct": d.as_dict()} for v, d in pairs],
            "proxy": {k: getattr(best_via, k) for k in keys},
            "direct": {k: getattr(best_floor, k) for k in keys},
            "errors": sum(v.errors + d.errors for v, d in pairs),
            "added_p50_ms": best_via.p50_ms - best_floor.p50_ms,
            "added_p99_ms": best_via.p99_ms - best_floor.p99_ms,
            "worst_added_p50_ms": worst_via.p50_ms - worst_floor.p50_ms,
            "worst_added_p99_ms": worst_via.p99_ms - worst_floor.p99_ms,
        }
        self.data["half_saturation"][target.name] = half
        print(
            f"    {target.label:<30} @{rate:.0f} req/s: p50 {half['proxy']['p50_ms']:.3f} ms "
            f"(direct {half['direct']['p50_ms']:.3f}), p99 {half['proxy']['p99_ms']:.3f} ms "
            f"(direct {half['direct']['p99_ms']:.3f}), errors {half['errors']}",
            flush=True,
        )

    # -- section 2: HTTP/2 stress ------------------------------------------------------

    def section_stress(self, origin: Origin) -> None:
        if not origin.h2_url:
            self.note("stress: skipped (no h2c upstream)")
            return
        _header(
            f"HTTP/2 stress: edgeproxy -> h2c {origin.kind}, {self.plan.stress_duration:g}s per run"
        )
        # The second configuration squeezes every stream onto one upstream
        # connection, so 256 clients must queue for nginx's 128 stream slots
        # and ride through a GOAWAY every 1000 streams.
        cases = [(c, self.args.h2_connections) for c in self.plan.stress_conns]
        cases.append((max(self.plan.stress_conns), 1))
        for max_conns in sorted({m for _, m in cases}, reverse=True):
            svc, target = self.edgeproxy_service(
                f"stress-h2-{max_conns}", origin.h2_url, http2=True, max_connections=max_conns
            )
            try:
                with self.running(svc, self.edgeproxy_ready(target)):
                    self.wrk(target.url, max(self.plan.stress_conns), self.plan.warmup)
                    for conns, m in cases:
                        if m == max_conns:
                            self._stress_run(target, conns, m)
            except u.ServiceError as exc:
                self.note(
                    f"stress (max_connections={max_conns}): did not start: {_first_line(exc)}"
                )

    def _stress_run(self, target: Target, conns: int, max_conns: int) -> None:
        # h2load rather than wrk: its per-request log keeps the slowest requests
        # (wrk leaves answers slower than its timeout out of the histogram), and
        # a request starving for a stream slot is exactly what this run looks for.
        before = _status(target)
        res, foreign, _ = self.attempt(
            f"stress c={conns} max_connections={max_conns}",
            lambda: self.closed(
                target.url, conns, self.plan.stress_duration, f"stress-{conns}-{max_conns}"
            ),
        )
        after = _status(target)
        region_errors = _region_field(after, "errors_total") - _region_field(before, "errors_total")
        row = {
            "conns": conns,
            "max_connections": max_conns,
            **res.as_dict(),
            "region_errors": region_errors,
            "foreign_cores": foreign,
            "pool": (after.get("regions") or [{}])[0].get("pool") if after else None,
        }
        self.data["stress"].append(row)
        print(
            f"    c={conns:<4} pool max {max_conns}: {res.achieved_rps:7.0f} req/s  "
            f"p50 {res.p50_ms:6.1f} ms  p99.9 {res.p999_ms:7.1f} ms  max {res.max_ms:7.1f} ms  "
            f">1s {res.over_1s}  errors {res.errors} (non-2xx {res.statuses or 0}), "
            f"region errors {region_errors}",
            flush=True,
        )

    # -- section 3: streaming TTFB -----------------------------------------------------

    def section_ttfb(self) -> None:
        _header(
            f"streaming TTFB: {self.plan.ttfb_n} sequential streams per path "
            "(fake region ttft 0.05 s, inter-token 0.005 s)"
        )
        fake = self.fake_region_service("ttfb-region", 0.05, 0.005)
        try:
            self.launch(fake)
            region_url = self.fake_region_url(fake)
        except u.ServiceError as exc:
            self.stop(fake)
            self.data["ttfb"] = {"skipped": f"fake region did not start: {_first_line(exc)}"}
            self.note(f"ttfb: {self.data['ttfb']['skipped']}")
            return
        targets = {"direct": region_url}
        started: list[u.Service] = []
        try:
            # The reference shows what any aiohttp proxy hop adds here (an extra
            # process, two more sockets, wake-ups on another core); edgeproxy's own
            # share is the difference to it.
            ref_port = u.free_port()
            ref = self.python_service(
                "ttfb-reference",
                [
                    str(HERE / "reference_proxy.py"),
                    "--port",
                    str(ref_port),
                    "--upstream",
                    region_url,
                    "--limit",
                    str(self.args.pool_size),
                ],
            )
            try:
                self.launch(ref)
                started.append(ref)
                ref.wait_http(f"http://{u.LOOPBACK}:{ref_port}/v1/models")
                targets["ttfb-reference"] = f"http://{u.LOOPBACK}:{ref_port}"
            except u.ServiceError as exc:
                self.note(f"ttfb through the reference: did not start: {_first_line(exc)}")
            for name, http2 in (("ttfb-h2", True), ("ttfb-h1", False)):
                svc, target = self.edgeproxy_service(
                    name, region_url, http2=http2, max_connections=self.args.h2_connections
                )
                try:
                    self.launch(svc)
                    started.append(svc)
                    self.edgeproxy_ready(target)(svc)
                    targets[name] = target.url
                except u.ServiceError as exc:
                    self.note(f"ttfb through {_LABELS[name]}: did not start: {_first_line(exc)}")
            self._quiet()
            pids = [svc.proc.pid for svc in self.services if svc.proc is not None]
            with u.CpuMeter(pids) as meter:
                series, errors = _run_async(
                    _ttfb_series(targets, self.plan.ttfb_n, self.plan.ttfb_warmup)
                )
            if meter.foreign_cores > self.args.max_foreign:
                self.contended.append(f"streaming TTFB ({meter.foreign_cores:.2f} cores)")
        finally:
            for svc in started:
                self.stop(svc)
            self.stop(fake)
        paths: dict[str, Any] = {}
        for name, values in series.items():
            ordered = sorted(values)
            paths[name] = {
                "label": _LABELS.get(name, name),
                "n": len(ordered),
                "errors": errors[name],
                "p50_ms": u.percentile(ordered, 50),
                "p90_ms": u.percentile(ordered, 90),
                "p99_ms": u.percentile(ordered, 99),
            }
        base = paths.get("direct")
        ref_row = paths.get("ttfb-reference")
        for name, row in paths.items():
            if base and name != "direct":
                row["added_p50_ms"] = row["p50_ms"] - base["p50_ms"]
                row["added_p99_ms"] = row["p99_ms"] - base["p99_ms"]
            if ref_row and name.startswith("ttfb-h"):
                row["vs_reference_p50_ms"] = row["p50_ms"] - ref_row["p50_ms"]
            print(
                f"    {row['label']:<28} p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f}"
                f" ms  errors {row['errors']}",
                flush=True,
            )
        self.data["ttfb"] = {"paths": paths, "foreign_cores": meter.foreign_cores}

    # -- section 4: profile ---------------------------------------------------------

    def section_profile(self, origin: Origin) -> None:
        try:
            import _profile
        except ImportError as exc:  # pragma: no cover - pyinstrument is a bench extra
            self.note(f"profile: skipped ({exc})")
            return
        conns = max(self.plan.conns)
        _header(
            f"profile: pyinstrument on edgeproxy, wrk c={conns} for {self.plan.profile_duration:g}s"
        )
        variants = [("h1", origin.h1_url, False, self.args.pool_size)]
        if origin.h2_url:
            variants.append(("h2", origin.h2_url, True, self.args.h2_connections))
        for tag, url, http2, max_conns in variants:
            session_file = self.results_dir / f"profile-{tag}.pyisession"
            session_file.unlink(missing_ok=True)
            svc, target = self.edgeproxy_service(
                f"profile-{tag}",
                url,
                http2=http2,
                max_connections=max_conns,
                profile_to=session_file,
            )
            try:
                with self.running(svc, self.edgeproxy_ready(target)):
                    self.wrk(target.url, conns, self.plan.warmup)
                    self._quiet()
                    assert svc.proc is not None
                    # Sample only while wrk runs: start-up and idle time would dilute
                    # every share (see _profiled_serve.py).
                    svc.proc.send_signal(signal.SIGUSR1)
                    with u.CpuMeter([svc.proc.pid], [svc.proc.pid]) as meter:
                        res = self.wrk(target.url, conns, self.plan.profile_duration)
                    svc.proc.send_signal(signal.SIGUSR2)
                    deadline = time.monotonic() + 30
                    while not session_file.exists() and time.monotonic() < deadline:
                        svc.check_alive()
                        time.sleep(0.1)
            except u.ServiceError as exc:
                self.note(f"profile {tag}: did not start: {_first_line(exc)}")
                continue
            if not session_file.exists():
                self.note(f"profile {tag}: pyinstrument wrote no session")
                continue
            summary = _profile.summarize(session_file)
            text_path = self.results_dir / f"profile-{tag}.txt"
            text_path.write_text(summary.text_report)
            self.data["profile"][tag] = {
                **summary.as_dict(),
                "rps_under_profiler": res.rps,
                "cpu_cores": meter.server_cores,
                "foreign_cores": meter.foreign_cores,
                "report": str(text_path.relative_to(REPO))
                if text_path.is_relative_to(REPO)
                else str(text_path),
            }
            print(
                f"    {tag}: {res.rps:.0f} req/s under the profiler; edgeproxy code "
                f"{summary.edgeproxy_inclusive_share:.0%} inclusive, "
                f"{summary.edgeproxy_self_share:.0%} self; report {text_path}",
                flush=True,
            )
            for spot in summary.inclusive[:6]:
                print(f"      {spot.share:6.1%} incl {spot.self_share:6.1%} self  {spot.where}")

    # -- the whole run -------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        self.results_dir.mkdir(parents=True, exist_ok=True)
        print(f"pinning: {self.pin.describe()}", flush=True)
        wanted = set(self.args.only or SECTIONS)
        with self.origin() as origin:
            if origin is not None and "throughput" in wanted:
                self.section_throughput(origin)
            if origin is not None and "stress" in wanted:
                self.section_stress(origin)
            if origin is not None and "profile" in wanted:
                self.section_profile(origin)
        if "ttfb" in wanted:
            self.section_ttfb()
        self.data["meta"] = self.meta(time.monotonic() - started)
        if self.contended:
            self.note(
                "other processes took more than "
                f"{self.args.max_foreign:g} cores during: "
                + "; ".join(self.contended)
                + ". Those numbers are unreliable; rerun on a quiet machine."
            )
        self.data["notes"] = self.notes
        self.data["targets"] = _targets(self.data)
        return self.data

    def meta(self, elapsed: float) -> dict[str, Any]:
        from importlib import metadata

        import aiohttp

        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "edgeproxy"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return {
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "commit": commit + (" (edgeproxy/ has uncommitted changes)" if dirty else ""),
            "elapsed_s": round(elapsed, 1),
            "cpus": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "pinning": self.pin.describe(),
            "layout": self.pin.layout,
            "max_foreign": self.args.max_foreign,
            "python": platform.python_version(),
            "aiohttp": aiohttp.__version__,
            "uvloop": metadata.version("uvloop"),
            "nginx": u.tool_version([self.nginx, "-v"]) if self.nginx else None,
            "wrk": u.tool_version(["wrk", "-v"]),
            "h2load": u.tool_version(["h2load", "--version"]),
            "plan": self.plan.__dict__,
            "pool_size": self.args.pool_size,
            "h2_connections": self.args.h2_connections,
            "request": f"POST {u.REQUEST_PATH}, {len(u.REQUEST_JSON)} B JSON body",
            "response_bytes": len(u.UPSTREAM_JSON),
        }


# -- helpers -------------------------------------------------------------------------

_LABELS = {
    "direct": "direct",
    "reference": "reference (bare aiohttp)",
    "edgeproxy-h1": "edgeproxy, HTTP/1.1 upstream",
    "edgeproxy-h2": "edgeproxy, h2c upstream",
    "nginx-proxy": "nginx proxy_pass (peer)",
    "ttfb-h1": "edgeproxy, HTTP/1.1 upstream",
    "ttfb-reference": "reference (bare aiohttp)",
    "ttfb-h2": "edgeproxy, h2c upstream",
}


def _edgeproxy_toml(
    port: int, admin: int, region_url: str, *, http2: bool, max_connections: int
) -> str:
    # A short grace period: the benchmark stops each proxy only once it is idle.
    return f"""
[server]
host = "{u.LOOPBACK}"
port = {port}
grace_period = 2.0
backlog = 4096

[admin]
host = "{u.LOOPBACK}"
port = {admin}

[pop]
name = "bench"

[upstream]
max_connections = {max_connections}
read_timeout = 30.0

[[regions]]
name = "origin"
url = "{region_url}"
http2 = {"true" if http2 else "false"}
"""


def _entry(label: str) -> dict[str, Any]:
    return {"label": label, "runs": [], "by_conns": {}, "skipped": None}


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _header(text: str) -> None:
    print(f"\n== {text}", flush=True)


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    # The most telling line of a child's traceback is its last one.
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _status(target: Target) -> dict[str, Any]:
    if not target.admin_url:
        return {}
    try:
        data: dict[str, Any] = u.http_json(f"{target.admin_url}/status")
    except (OSError, ValueError):
        return {}
    return data


def _region_field(status: dict[str, Any], key: str) -> int:
    return sum(int(r.get(key, 0)) for r in status.get("regions", []))


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _run_async(coro: Any) -> Any:
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


_STREAM_BODY = (
    b'{"model":"bench","stream":true,"max_tokens":2,'
    b'"messages":[{"role":"user","content":"Say hello."}]}'
)


async def _ttfb_series(
    targets: dict[str, str], n: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Sequential streams, the paths interleaved so drift (timer slack, a noisy
    neighbour) lands on every path alike rather than on whichever ran last."""
    import aiohttp

    series: dict[str, list[float]] = {name: [] for name in targets}
    errors: dict[str, int] = dict.fromkeys(targets, 0)
    names = list(targets)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
        for i in range(warmup + n):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                try:
                    ttfb = await _one_ttfb(session, targets[name] + u.REQUEST_PATH)
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    errors[name] += 1
                    continue
                if i >= warmup:
                    series[name].append(ttfb * 1000)
    return series, errors


async def _one_ttfb(session: Any, url: str) -> float:
    """Seconds from sending the request to the first ``data:`` bytes; reads the stream to
    its end so the keep-alive connection (and the proxy's upstream one) is reused."""
    headers = {"content-type": "application/json", "accept": "text/event-stream"}
    started = time.perf_counter()
    first: float | None = None
    seen = b""
    async with session.post(url, data=_STREAM_BODY, headers=headers) as resp:
        if resp.status != 200:
            raise ValueError(f"status {resp.status}")
        async for chunk in resp.content.iter_any():
            if first is None:
                seen += chunk
                if b"data:" in seen:
                    first = time.perf_counter() - started
    if first is None:
        raise ValueError("no SSE data in the response")
    return first


def _targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target the lead set, with the measured value and pass/miss (None: not measured)."""
    rows: list[dict[str, Any]] = []
    tp = data["throughput"]
    ref = (tp.get("reference") or {}).get("saturation_rps")

    def add(metric: str, value: float | None, target: str, ok: bool | None) -> None:
        rows.append({"metric": metric, "value": value, "target": target, "pass": ok})

    for name, goal in (("edgeproxy-h1", TARGET_H1_RATIO), ("edgeproxy-h2", TARGET_H2_RATIO)):
        sat = (tp.get(name) or {}).get("saturation_rps")
        ratio = sat / ref if sat and ref else None
        add(
            f"{_LABELS[name]}: throughput / reference",
            ratio,
            f">= {goal}",
            None if ratio is None else ratio >= goal,
        )
    # Cross-check that other processes barely disturb: the reference's CPU per
    # request over edgeproxy's, at the highest connection count.
    ref_cpu = _cpu_per_req(tp.get("reference"))
    for name in ("edgeproxy-h1", "edgeproxy-h2"):
        ours = _cpu_per_req(tp.get(name))
        ratio = ref_cpu / ours if ref_cpu and ours else None
        add(
            f"{_LABELS[name]}: reference CPU/req / edgeproxy CPU/req (cross-check)",
            ratio,
            "(info)",
            None,
        )
    for name in ("edgeproxy-h1", "edgeproxy-h2"):
        half = data["half_saturation"].get(name)
        p50 = half["added_p50_ms"] if half else None
        p99 = half["added_p99_ms"] if half else None
        add(
            f"{_LABELS[name]}: added p50 at half saturation (ms)",
            p50,
            f"<= {TARGET_ADDED_P50_MS}",
            None if p50 is None else p50 <= TARGET_ADDED_P50_MS,
        )
        add(
            f"{_LABELS[name]}: added p99 at half saturation (ms)",
            p99,
            f"<= {TARGET_ADDED_P99_MS}",
            None if p99 is None else p99 <= TARGET_ADDED_P99_MS,
        )
    if data["stress"]:
        errs = sum(r["errors"] + r["region_errors"] for r in data["stress"])
        add("h2c stress: errors over all runs", errs, "0", errs == 0)
        # Not one of the stated targets, but against a 50 us upstream a request
        # that takes a second is starving, and at pool_timeout it becomes a 504.
        slow = sum(r["over_1s"] for r in data["stress"])
        add("h2c stress: requests slower than 1 s", slow, "0", slow == 0)
    paths = (data.get("ttfb") or {}).get("paths", {})
    for name in ("ttfb-h1", "ttfb-h2"):
        added = (paths.get(name) or {}).get("added_p50_ms")
        add(
            f"{_LABELS[name]}: added streaming TTFB p50 (ms)",
            added,
            f"<= {TARGET_TTFB_ADDED_MS}",
            None if added is None else added <= TARGET_TTFB_ADDED_MS,
        )
    return rows


def _cpu_per_req(entry: dict[str, Any] | None) -> float | None:
    by_conns = (entry or {}).get("by_conns") or {}
    if not by_conns:
        return None
    value = by_conns[max(by_conns, key=int)].get("cpu_us_per_req")
    return float(value) if value else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="edgeproxy vs reference vs nginx, one run.")
    p.add_argument(
        "--duration", type=float, help="seconds per closed-loop run, i.e. per round (default 2)"
    )
    p.add_argument(
        "--rounds", type=int, help="interleaved rounds per configuration and conns (default 4)"
    )
    p.add_argument("--quick", action="store_true", help="short smoke run (under a minute)")
    p.add_argument(
        "--skip-nginx",
        action="store_true",
        help="do not use nginx (the fake region becomes the upstream)",
    )
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--conns", type=int, nargs="+", help="wrk connection counts (default 16 64)")
    p.add_argument("--ttfb-n", type=int, help="streams per path for TTFB (default 200)")
    p.add_argument(
        "--pool-size",
        type=int,
        default=100,
        help="HTTP/1.1 upstream pool size: reference TCPConnector limit, edgeproxy "
        "upstream.max_connections, nginx keepalive (default 100)",
    )
    p.add_argument(
        "--h2-connections",
        type=int,
        default=8,
        help="edgeproxy upstream.max_connections for h2c regions (default 8)",
    )
    p.add_argument(
        "--layout",
        choices=("split", "shared"),
        default="split",
        help="split: origin on the load generator's core, proxy alone (default); "
        "shared: origin and proxy share the server core",
    )
    p.add_argument(
        "--harness-cpu",
        type=int,
        help="CPU for wrk/h2load, the driver and (split) the origin (default first)",
    )
    p.add_argument("--sut-cpu", type=int, help="CPU for the proxy under test (default last)")
    p.add_argument(
        "--retries",
        type=int,
        default=1,
        help="extra attempts for a run during which other processes were busy",
    )
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.2,
        help="cores other processes may use during a run before it is retried",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=5.0,
        help="seconds to wait before each run for other processes to go quiet",
    )
    p.add_argument(
        "--patience",
        type=float,
        default=45.0,
        help="seconds the whole run may spend on such waits and on retries",
    )
    p.add_argument(
        "--max-rate",
        type=float,
        default=5000.0,
        help="cap on the half-saturation rate (the open-loop generator's limit)",
    )
    p.add_argument("--keep-tmp", action="store_true", help="keep server logs and configs")
    p.add_argument("--results", type=Path, default=HERE / "results", help="output directory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan.make(args)
    bench = Bench(args, plan)
    # The driver shares the load generators' core so it never steals from the servers.
    if bench.pin.harness:
        os.sched_setaffinity(0, set(bench.pin.harness))
    try:
        data = bench.run()
    finally:
        bench.close()
        if args.keep_tmp:
            print(f"server logs and configs kept in {bench.tmp}")
        else:
            shutil.rmtree(bench.tmp, ignore_errors=True)
    markdown = _report.markdown(data)
    out = args.results
    (out / "proxy.md").write_text(markdown)
    (out / "proxy.json").write_text(json.dumps(data, indent=2, default=str))
    chart = _report.chart(data, out / "proxy.png")
    print("\n" + markdown)
    print(f"wrote {out / 'proxy.md'}, {out / 'proxy.json'}" + (f", {chart}" if chart else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
