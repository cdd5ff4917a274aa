"""Soak: ``edgeproxy serve`` for minutes under a steady mixed load with faults, watched for leaks.

    .venv/bin/python bench/soak.py                             # 10 minutes at 80 req/s
    .venv/bin/python bench/soak.py --minutes 1 --sample 10 --rate 40   # the CI form

Everything runs on 127.0.0.1, each server in its own process:

* three fake regions (``python -m edgeproxy.testing``), HTTP/2 (h2c) upstreams,
  each resetting a share of chat completions at its own point: ``r1`` after two
  body units (mid-stream), ``r2`` before the response headers (the proxy retries
  elsewhere), ``r3`` later in the stream;
* a ``redis-server`` started here on a free port (``--save ""``), holding the
  proxy's cache (``backend = "redis"``) and its rate-limit buckets;
* ``edgeproxy serve`` with a real config file, the process under watch.

The load is open-loop at ``--rate`` requests per second: JSON chat completions
(part deterministic, temperature 0 over a small set of prompts, so they hit
the cache), SSE streams (part of them closed by the client right after the
first event), and plain GETs (``/v1/models`` and a chunked ``/echo``). Meanwhile:

* Redis is frozen (SIGSTOP) for 10 s every 2 minutes, then resumed (SIGCONT);
* region ``r2`` is killed (SIGKILL) once in the middle and restarted on the
  same port 10 s later.

Shorter runs scale the timeline down (period ``min(120, duration / 2)``), so
the one-minute CI form goes through every event too.

Every ``--sample`` seconds the proxy process is sampled: RSS (``VmRSS`` in
``/proc/<pid>/status``), open fds (``/proc/<pid>/fd``, also split by kind
through ``/proc/net/tcp``: client connections, region connections, Redis
connections, listeners, other) and, from the admin ``/status``, requests in
flight, each region's in flight and pending requests and its pool's streams in
use and open connections, and the cache's coalesced requests in flight.
``/status`` has no asyncio task count, so tasks are not sampled.

A request is *lost* when it fails before its first byte (no response headers:
a connection error, a reset, a timeout) and was not one the client dropped on
purpose; a request that failed after its headers is *broken* (a stream cut by
a region reset or kill), which the faults make happen by design.

At the end the load stops, outstanding requests finish, the client closes its
connections, and after ``--settle`` seconds the proxy is sampled once more.
The run FAILS (exit code 1, reasons printed) when RSS or the fd count grew by
more than ``--max-growth`` percent (10) from the baseline sample (minute 2;
a third of the run for runs under 4 minutes) to the last one, when anything
is still in flight after the load (proxy, regions' pending requests, pool
streams, coalesced cache requests), when any request was lost, or when the
proxy exited during the run or with a non-zero code on SIGTERM at the end. The
baseline is sampled under load and the last sample without it, so client
connections make the fd check lenient; the fds without client connections are
in the table and the plot for a closer look. The proxy's log (warnings and up)
is summarised in the results.

Results: ``bench/results/soak.json`` and ``soak.png`` (RSS, fds and in-flight
over time; needs matplotlib from the ``bench`` extra), the table printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script: make the helpers importable
    sys.path.insert(0, str(HERE))

import _util as u  # noqa: E402

PYTHON = sys.executable
CHAT = "/v1/chat/completions"
REGIONS = ("r1", "r2", "r3")
KILLED = "r2"
# Each region resets this share of chat completions after this many body units
# (0: before the response headers, so the proxy retries on another region).
RESETS = {"r1": (0.08, 2), "r2": (0.08, 0), "r3": (0.05, 6)}
FIXED_PROMPTS = 24  # deterministic prompts: after the first round, mostly cache hits
CLIENT_TIMEOUT = 30.0  # seconds a request may take in all; bounds the drain too
MB = 1024.0


# -- the services ----------------------------------------------------------------


class Redis:
    """Our own redis-server: no persistence, loopback only, pausable with SIGSTOP."""

    def __init__(self, binary: str, work: Path) -> None:
        self.port = u.free_port()
        self.url = f"redis://{u.LOOPBACK}:{self.port}/0"
        self.paused = False
        data = work / "redis"
        data.mkdir()
        argv = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            u.LOOPBACK,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data),
        ]
        self.service = u.Service("redis", argv, work / "redis.log")

    def start(self) -> None:
        self.service.start()
        self.service.wait_line("Ready to accept connections", timeout=20)

    def _signal(self, sig: int) -> None:
        proc = self.service.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, sig)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        self.resume()  # a stopped process would hold SIGTERM until SIGCONT
        self.service.stop(timeout=5)


class Region:
    """One fake region in its own process; killed with SIGKILL and restarted on its port."""

    def __init__(self, name: str, work: Path, args: argparse.Namespace) -> None:
        self.name = name
        self.port = u.free_port()
        self.url = f"http://{u.LOOPBACK}:{self.port}"
        self.work = work
        self.args = args
        self.starts = 0
        self.service: u.Service | None = None

    def start(self) -> None:
        argv = [
            PYTHON,
            "-m",
            "edgeproxy.testing",
            "--name",
            self.name,
            "--port",
            str(self.port),
            "--ttft",
            f"{self.args.ttft:g}",
            "--inter-token-delay",
            f"{self.args.itd:g}",
            "--tokens",
            "16",
            # The model the soak asks for: the proxy learns each region's catalog.
            "--model",
            "soak",
        ]
        log = self.work / f"region-{self.name}-{self.starts}.log"
        self.starts += 1
        self.service = u.Service(f"region {self.name}", argv, log).start()
        self.service.wait_line("listening on http://", timeout=30)
        rate, after = RESETS[self.name]
        control(
            self.url,
            fault="reset",
            fault_rate=rate,
            fault_after_tokens=after,
            fault_paths=[CHAT],
        )

    def kill(self) -> None:
        if self.service is not None:
            self.service.stop(sig=signal.SIGKILL, timeout=5)
            self.service = None

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop(timeout=10)
            self.service = None

    def counters(self) -> dict[str, Any] | None:
        if self.service is None:
            return None
        try:
            data = u.http_json(self.url + "/_control", timeout=3)
        except OSError:
            return None
        counters: dict[str, Any] = data.get("counters", data)
        return counters


def control(region_url: str, **behavior: Any) -> None:
    req = urllib.request.Request(
        region_url + "/_control",
        data=json.dumps(behavior).encode(),
        method="POST",
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        resp.read()


def proxy_toml(port: int, admin: int, regions: list[Region], redis_url: str) -> str:
    region_tables = "".join(f'\n[[regions]]\nname = "{r.name}"\nurl = "{r.url}"\n' for r in regions)
    return f"""
[server]
host = "{u.LOOPBACK}"
port = {port}
grace_period = 5.0

[admin]
host = "{u.LOOPBACK}"
port = {admin}

[pop]
name = "soak"

[upstream]
http2 = true
max_connections = 4
connect_timeout = 1.0
read_timeout = 10.0
{region_tables}
[[routes]]
name = "chat"
path = "{CHAT}"
deadline = 10.0
cache_ttl = 30.0
stale_while_revalidate = 5.0

[cache]
backend = "redis"
redis_url = "{redis_url}"
key_prefix = "edgeproxy:soak:"

[admission]
redis_url = "{redis_url}"
ip_requests_per_second = 100000.0

[plugins]
entry_points = false
"""


# -- the proxy process -----------------------------------------------------------


def proc_rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def proc_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _tcp_sockets() -> dict[str, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) of every TCP socket in /proc/net/tcp{,6}."""
    out: dict[str, tuple[int, int, str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9:
                        local, remote = cols[1], cols[2]
                        out[cols[9]] = (
                            int(local.rsplit(":", 1)[1], 16),
                            int(remote.rsplit(":", 1)[1], 16),
                            cols[3],
                        )
        except OSError:
            continue
    return out


def fd_kinds(pid: int, ports: dict[str, Any]) -> dict[str, int] | None:
    """The proxy's fds by what they are: listeners, client connections, region
    connections, Redis connections, other sockets, and everything else (files,
    pipes, the event loop's epoll and eventfds)."""
    try:
        links = []
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                links.append(os.readlink(f"/proc/{pid}/fd/{name}"))
            except OSError:
                continue  # closed while we looked
    except OSError:
        return None
    tcp = _tcp_sockets()
    kinds: Counter[str] = Counter()
    for link in links:
        if not link.startswith("socket:["):
            kinds["other"] += 1
            continue
        found = tcp.get(link[len("socket:[") : -1])
        if found is None:
            kinds["other sockets"] += 1
            continue
        local, remote, state = found
        if state == "0A":
            kinds["listen"] += 1
        elif local in (ports["proxy"], ports["admin"]):
            kinds["clients"] += 1
        elif remote in ports["regions"]:
            kinds["regions"] += 1
        elif remote == ports["redis"]:
            kinds["redis"] += 1
        else:
            kinds["other sockets"] += 1
    return dict(kinds)


# -- the load --------------------------------------------------------------------


@dataclass
class Tally:
    """What the client saw. Every request ends in exactly one of ``complete``,
    ``disconnected`` (closed on purpose after the first event), ``broken`` (failed
    after its headers) or ``lost`` (failed before them)."""

    sent: int = 0
    skipped: int = 0  # not sent: --max-outstanding requests were already waiting
    sent_by_kind: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    complete: int = 0
    disconnected: int = 0
    broken: int = 0
    lost: int = 0
    cache: Counter[str] = field(default_factory=Counter)
    stream_error_events: int = 0
    ttfb: list[float] = field(default_factory=list)
    lost_examples: list[dict[str, Any]] = field(default_factory=list)
    broken_examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return sum(self.statuses.values())


@dataclass(frozen=True)
class Plan:
    kind: str
    method: str
    path: str
    body: bytes | None = None
    cut: bool = False


def plan_request(rng: random.Random) -> Plan:
    """The mix: 45% JSON chat (half deterministic), 30% SSE (a fifth of them cut after
    the first event, a quarter deterministic), 25% GETs."""
    draw = rng.random()
    if draw < 0.45:
        if draw < 0.225:
            body = {
                "model": "soak",
                "messages": [{"role": "user", "content": f"fixed {rng.randrange(FIXED_PROMPTS)}"}],
                "temperature": 0,
                "max_tokens": 8,
            }
            return Plan("json-cached", "POST", CHAT, json.dumps(body).encode())
        body = {
            "model": "soak",
            "messages": [{"role": "user", "content": f"fresh {rng.getrandbits(64):x}"}],
            "temperature": 0.7,
            "max_tokens": 8,
        }
        return Plan("json", "POST", CHAT, json.dumps(body).encode())
    if draw < 0.75:
        cut = rng.random() < 0.2
        fixed = not cut and rng.random() < 0.25
        content = f"fixed stream {rng.randrange(8)}" if fixed else f"stream {rng.getrandbits(64):x}"
        body = {
            "model": "soak",
            "messages": [{"role": "user", "content": content}],
            "stream": True,
            "temperature": 0 if fixed else 0.7,
        }
        kind = "stream-cut" if cut else "stream"
        return Plan(kind, "POST", CHAT, json.dumps(body).encode(), cut=cut)
    if draw < 0.875:
        return Plan("get-models", "GET", "/v1/models")
    return Plan("get-echo", "GET", "/echo/soak?size=8192&chunks=4")


async def one_request(session: Any, base: str, plan: Plan, tally: Tally, t0: float) -> None:
    import aiohttp

    loop = asyncio.get_running_loop()
    started = loop.time()
    headers_at: float | None = None
    seen_error = False  # an SSE `event: error`: how the proxy reports a region that broke
    tail = b""
    tally.sent += 1
    tally.sent_by_kind[plan.kind] += 1
    headers = {"content-type": "application/json"} if plan.body is not None else None
    try:
        async with session.request(
            plan.method, base + plan.path, data=plan.body, headers=headers
        ) as resp:
            headers_at = loop.time()
            tally.statuses[resp.status] += 1
            tally.ttfb.append(headers_at - started)
            tally.cache[resp.headers.get("X-Edgeproxy-Cache", "-")] += 1
            async for chunk in resp.content.iter_any():
                if not seen_error and b"event: error" in tail + chunk:
                    seen_error = True
                tail = chunk[-16:]
                if plan.cut and resp.status == 200 and b"data:" in chunk:
                    resp.close()  # the first event is in: drop the connection
                    tally.disconnected += 1
                    return
            tally.complete += 1
    except asyncio.CancelledError:
        # Only the bounded drain at the end cancels: whatever was left counts as failed.
        _failed(tally, plan, headers_at, "abandoned by the bench after the drain", started, t0)
        raise
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        _failed(tally, plan, headers_at, f"{type(exc).__name__}: {exc}", started, t0)
    finally:
        tally.stream_error_events += seen_error


def _failed(
    tally: Tally, plan: Plan, headers_at: float | None, error: str, started: float, t0: float
) -> None:
    example = {"t": round(started - t0, 2), "kind": plan.kind, "error": error[:200]}
    if headers_at is None:
        tally.lost += 1
        if len(tally.lost_examples) < 50:
            tally.lost_examples.append(example)
    else:
        tally.broken += 1
        if len(tally.broken_examples) < 20:
            tally.broken_examples.append(example)


# -- the timeline ------------------------------------------------------------------


@dataclass(frozen=True)
class Timeline:
    duration: float
    period: float
    pause: float
    pauses: tuple[float, ...]
    kill_at: float
    down_for: float
    baseline_at: float

    def label(self, t: float) -> str:
        parts = []
        if any(p <= t < p + self.pause for p in self.pauses):
            parts.append("redis paused")
        if self.kill_at <= t < self.kill_at + self.down_for:
            parts.append(f"{KILLED} down")
        return ", ".join(parts)


def plan_timeline(duration: float) -> Timeline:
    """Redis pauses every ``period`` (2 minutes, or half the run), starting half a period
    in; the region kill in the middle, moved past a pause it would overlap."""
    period = min(120.0, duration / 2)
    pause = min(10.0, period / 3)
    pauses = []
    at = period / 2
    while at + pause + 2 <= duration:
        pauses.append(round(at, 3))
        at += period
    down_for = min(10.0, duration / 10)
    kill_at = duration / 2
    for p in pauses:
        if p - down_for - 2 < kill_at < p + pause + 2:
            kill_at = p + pause + 2
    baseline_at = 120.0 if duration >= 240 else duration / 3
    return Timeline(duration, period, pause, tuple(pauses), kill_at, down_for, baseline_at)


# -- sampling ---------------------------------------------------------------------


def sample(
    t: float,
    label: str,
    pid: int,
    admin_url: str,
    ports: dict[str, Any],
    tally: Tally,
    phase: str,
) -> dict[str, Any]:
    """One look at the proxy (blocking: run it in a thread)."""
    row: dict[str, Any] = {
        "t": round(t, 1),
        "phase": phase,
        "events": label,
        "rss_kb": proc_rss_kb(pid),
        "fds": proc_fds(pid),
        "fd_kinds": fd_kinds(pid, ports),
        "tasks": None,  # /status reports no asyncio task count
        "sent": tally.sent,
        "answered": tally.answered,
        "lost": tally.lost,
        "broken": tally.broken,
    }
    try:
        status = u.http_json(admin_url + "/status", timeout=5)
    except (OSError, ValueError) as exc:
        row["status_error"] = f"{type(exc).__name__}: {exc}"
        return row
    row["in_flight"] = status.get("in_flight")
    row["regions"] = {
        r["name"]: {
            "state": r.get("state"),
            "in_flight": r.get("in_flight"),
            "pending": r.get("pending"),
            "streams_in_use": r["pool"].get("streams_in_use"),
            "connections_open": r["pool"].get("connections_open"),
            "requests_total": r.get("requests_total"),
            "errors_total": r.get("errors_total"),
            "retries_total": r.get("retries_total"),
        }
        for r in status.get("regions", [])
    }
    cache = status.get("cache") or {}
    row["cache_in_flight"] = cache.get("in_flight")
    row["cache_outcomes"] = cache.get("outcomes")
    row["cache_errors"] = cache.get("errors")
    admission = status.get("admission") or {}
    row["admission_in_flight"] = admission.get("in_flight")
    return row


def streams_in_use(row: dict[str, Any]) -> int | None:
    regions = row.get("regions")
    if regions is None:
        return None
    return sum(r["streams_in_use"] or 0 for r in regions.values())


# -- the run ------------------------------------------------------------------------


async def drive(
    args: argparse.Namespace,
    proxy_url: str,
    admin_url: str,
    pid: int,
    redis: Redis,
    regions: dict[str, Region],
    timeline: Timeline,
    ports: dict[str, Any],
) -> tuple[Tally, list[dict[str, Any]], list[dict[str, Any]]]:
    import aiohttp

    tally = Tally()
    samples: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    rng = random.Random(args.seed)
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def now() -> float:
        return loop.time() - t0

    async def at(t: float) -> None:
        await asyncio.sleep(max(0.0, t0 + t - loop.time()))

    def note(what: str) -> None:
        events.append({"t": round(now(), 2), "event": what})
        print(f"  [{now():6.1f}s] {what}", flush=True)

    async def incidents() -> None:
        todo: list[tuple[float, str]] = []
        for p in timeline.pauses:
            todo += [(p, "redis-pause"), (p + timeline.pause, "redis-resume")]
        todo += [(timeline.kill_at, "kill"), (timeline.kill_at + timeline.down_for, "restart")]
        for when, what in sorted(todo):
            await at(when)
            if what == "redis-pause":
                redis.pause()
                note(f"redis paused (SIGSTOP) for {timeline.pause:g}s")
            elif what == "redis-resume":
                redis.resume()
                note("redis resumed (SIGCONT)")
            elif what == "kill":
                await asyncio.to_thread(regions[KILLED].kill)
                note(f"region {KILLED} killed (SIGKILL)")
            else:
                await asyncio.to_thread(regions[KILLED].start)
                note(f"region {KILLED} restarted on port {regions[KILLED].port}")

    async def sampler() -> None:
        k = 0
        while k * args.sample <= timeline.duration:
            await at(k * args.sample)
            t = now()
            row = await asyncio.to_thread(
                sample, t, timeline.label(t), pid, admin_url, ports, tally, "load"
            )
            samples.append(row)
            print_row(row, header=k == 0)
            k += 1

    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT, sock_connect=5)
    connector = aiohttp.TCPConnector(limit=1000, keepalive_timeout=15)
    session = aiohttp.ClientSession(timeout=timeout, connector=connector)
    background = [
        asyncio.create_task(incidents(), name="incidents"),
        asyncio.create_task(sampler(), name="sampler"),
    ]
    outstanding: set[asyncio.Task[None]] = set()
    try:
        total = int(timeline.duration * args.rate)
        for i in range(total):
            await at(i / args.rate)
            if len(outstanding) >= args.max_outstanding:
                tally.skipped += 1  # never expected at these rates
                continue
            plan = plan_request(rng)
            task = asyncio.create_task(one_request(session, proxy_url, plan, tally, t0))
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
        await at(timeline.duration)
        note(f"load stopped; {len(outstanding)} requests outstanding")
        if outstanding:
            _, left = await asyncio.wait(set(outstanding), timeout=CLIENT_TIMEOUT + 10)
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=5)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    finally:
        for task in (*outstanding, *background):
            task.cancel()
        await session.close()
    note(f"client closed; settling {args.settle:g}s")
    await asyncio.sleep(args.settle)
    t = now()
    final = await asyncio.to_thread(sample, t, "", pid, admin_url, ports, tally, "after")
    samples.append(final)
    print_row(final, header=False)
    for name, region in regions.items():
        final.setdefault("region_counters", {})[name] = await asyncio.to_thread(region.counters)
    return tally, samples, events


# -- verdict and report ---------------------------------------------------------


def growth(base: int | None, last: int | None) -> float | None:
    if not base or last is None:
        return None
    return 100.0 * (last - base) / base


def judge(
    samples: list[dict[str, Any]], tally: Tally, timeline: Timeline, max_growth: float
) -> tuple[dict[str, Any], list[str]]:
    load = [s for s in samples if s["phase"] == "load"]
    last = samples[-1]
    base = next((s for s in load if s["t"] >= timeline.baseline_at - 0.5), load[-1])
    checks: dict[str, Any] = {
        "baseline_t": base["t"],
        "last_t": last["t"],
        "fd_kinds": {"baseline": base.get("fd_kinds"), "last": last.get("fd_kinds")},
    }
    failures: list[str] = []
    for key, what in (("rss_kb", "RSS"), ("fds", "open fds")):
        g = growth(base.get(key), last.get(key))
        checks[key] = {"baseline": base.get(key), "last": last.get(key), "growth_pct": g}
        if g is None:
            failures.append(f"{what}: no reading (baseline {base.get(key)}, last {last.get(key)})")
        elif g > max_growth:
            failures.append(
                f"{what} grew {g:.1f}% (> {max_growth:g}%): {base[key]} at t={base['t']}s "
                f"-> {last[key]} at t={last['t']}s"
            )
    if "status_error" in last:
        failures.append(f"/status did not answer after the load: {last['status_error']}")
    else:
        left = {
            "proxy in_flight": last.get("in_flight"),
            "cache coalesced in_flight": last.get("cache_in_flight"),
            "admission in_flight": last.get("admission_in_flight"),
        }
        for name, region in (last.get("regions") or {}).items():
            for key in ("in_flight", "pending", "streams_in_use"):
                left[f"{name} {key}"] = region.get(key)
        checks["left_in_flight"] = left
        busy = {k: v for k, v in left.items() if v}
        if busy:
            failures.append(f"still in flight {timeline_after(last)}: {busy}")
    checks["lost"] = tally.lost
    if tally.lost:
        first = "; ".join(f"t={e['t']}s {e['kind']}: {e['error']}" for e in tally.lost_examples[:5])
        failures.append(f"{tally.lost} requests lost before their first byte (first: {first})")
    return checks, failures


def timeline_after(row: dict[str, Any]) -> str:
    return f"at t={row['t']}s, after the load"


def print_row(row: dict[str, Any], *, header: bool) -> None:
    if header:
        print(
            f"  {'t s':>6} {'RSS MB':>7} {'fds':>5} {'cl/rg/rd/ls/os/o':>16} "
            f"{'in-fl':>5} {'streams':>8} "
            f"{'sent':>7} {'answ':>7} {'lost':>5} {'broken':>6}  events",
            flush=True,
        )
    rss = row.get("rss_kb")
    regions = row.get("regions") or {}
    per_region = "/".join(str(r.get("streams_in_use", "?")) for r in regions.values()) or "-"
    print(
        f"  {row['t']:>6.1f} {(rss or 0) / MB:>7.1f} {row.get('fds') or 0:>5} "
        f"{fd_split(row):>16} {_cell(row.get('in_flight')):>5} {per_region:>8} {row['sent']:>7} "
        f"{row['answered']:>7} {row['lost']:>5} {row['broken']:>6}  "
        f"{row['events'] or ('after the load' if row['phase'] == 'after' else '')}",
        flush=True,
    )


def _cell(value: Any) -> str:
    return "?" if value is None else str(value)


FD_KINDS = ("clients", "regions", "redis", "listen", "other sockets", "other")


def fd_split(row: dict[str, Any]) -> str:
    """``clients/regions/redis/listen/other sockets/other``, e.g. ``22/3/4/2/0/9``."""
    kinds = row.get("fd_kinds")
    if kinds is None:
        return "?"
    return "/".join(str(kinds.get(k, 0)) for k in FD_KINDS)


def fds_without_clients(row: dict[str, Any]) -> int | None:
    kinds = row.get("fd_kinds")
    return None if kinds is None else sum(v for k, v in kinds.items() if k != "clients")


def table(samples: list[dict[str, Any]]) -> str:
    names = list((samples[-1].get("regions") or {}).keys())
    head = (
        "| t (s) | RSS (MB) | fds | fds: clients/regions/redis/listen/other sockets/other "
        "| in flight | "
        + " | ".join(f"{n} in flight / streams / conns" for n in names)
        + " | sent | answered | lost | broken | events |"
    )
    lines = [head, "|" + " --- |" * (10 + len(names))]
    for s in samples:
        regions = s.get("regions") or {}
        cells = [
            f"{s['t']:.0f}" + (" (after)" if s["phase"] == "after" else ""),
            f"{(s.get('rss_kb') or 0) / MB:.1f}",
            _cell(s.get("fds")),
            fd_split(s),
            _cell(s.get("in_flight")),
            *(
                "{} / {} / {}".format(
                    _cell(regions.get(n, {}).get("in_flight")),
                    _cell(regions.get(n, {}).get("streams_in_use")),
                    _cell(regions.get(n, {}).get("connections_open")),
                )
                for n in names
            ),
            str(s["sent"]),
            str(s["answered"]),
            str(s["lost"]),
            str(s["broken"]),
            s["events"] or "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(data: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    samples = data["samples"]
    ts = [s["t"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    axes[0].plot(ts, [(s.get("rss_kb") or math.nan) / MB for s in samples], marker="o", ms=3)
    axes[0].set_ylabel("RSS (MB)")
    axes[1].plot(
        ts, [_num(s.get("fds")) for s in samples], marker="o", ms=3, color="C1", label="all"
    )
    axes[1].plot(
        ts,
        [_num(fds_without_clients(s)) for s in samples],
        marker="s",
        ms=3,
        color="C4",
        label="all but client connections",
    )
    axes[1].set_ylabel("open fds")
    axes[1].legend(fontsize=8, loc="upper left")
    axes[2].plot(
        ts,
        [_num(s.get("in_flight")) for s in samples],
        marker="o",
        ms=3,
        color="C2",
        label="proxy in flight",
    )
    axes[2].plot(
        ts,
        [_num(streams_in_use(s)) for s in samples],
        marker="s",
        ms=3,
        color="C3",
        label="pool streams in use (all regions)",
    )
    axes[2].set_ylabel("in flight")
    axes[2].set_xlabel("seconds since the load started")
    axes[2].legend(fontsize=8, loc="upper left")
    tl = data["timeline"]
    for ax in axes:
        for p in tl["pauses"]:
            ax.axvspan(p, p + tl["pause"], color="tab:red", alpha=0.12, lw=0)
        ax.axvspan(tl["kill_at"], tl["kill_at"] + tl["down_for"], color="tab:purple", alpha=0.12)
        ax.axvline(tl["duration"], color="grey", ls="--", lw=0.8)
        ax.axvline(tl["baseline_at"], color="grey", ls=":", lw=0.8)
        ax.grid(alpha=0.3)
    verdict = "PASS" if data["passed"] else "FAIL"
    axes[0].set_title(
        f"edgeproxy soak: {data['args']['rate']:g} req/s for {data['args']['minutes']:g} min, "
        f"{verdict} (red: Redis paused, purple: {KILLED} down, dashed: load stops, "
        "dotted: baseline)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)


def log_summary(path: Path) -> dict[str, Any]:
    """Log lines by level and tracebacks in the proxy's log (``--log-level warning``)."""
    levels: Counter[str] = Counter()
    tracebacks = 0
    first_errors: list[str] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("Traceback"):
            tracebacks += 1
        for level in ("WARNING", "ERROR", "CRITICAL"):
            if f" {level} " in line:
                levels[level] += 1
                if level != "WARNING" and len(first_errors) < 20:
                    first_errors.append(line[:300])
                break
    return {"levels": dict(levels), "tracebacks": tracebacks, "first_errors": first_errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=10.0, help="load duration")
    parser.add_argument("--rate", type=float, default=80.0, help="requests per second")
    parser.add_argument("--sample", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after the load")
    parser.add_argument("--max-growth", type=float, default=10.0, help="RSS/fd growth limit, %%")
    parser.add_argument("--ttft", type=float, default=0.02, help="fake regions' TTFT, s")
    parser.add_argument("--itd", type=float, default=0.03, help="fake regions' inter-token delay")
    parser.add_argument("--max-outstanding", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the logs and config")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0 or args.sample <= 0:
        parser.error("--minutes, --rate and --sample must be positive")

    redis_binary = shutil.which("redis-server")
    if redis_binary is None:
        print("soak: needs redis-server (apt-get install redis-server)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="edgeproxy-soak-"))
    timeline = plan_timeline(args.minutes * 60)
    began = time.time()

    redis = Redis(redis_binary, work)
    regions = {name: Region(name, work, args) for name in REGIONS}
    proxy: u.Service | None = None
    died: int | None = None  # the proxy's exit code, had it exited during the run
    proxy_rc: int | None = None  # its exit code on SIGTERM at the end
    try:
        redis.start()
        for region in regions.values():
            region.start()
        port, admin = u.free_port(), u.free_port()
        config = work / "edge.toml"
        config.write_text(proxy_toml(port, admin, list(regions.values()), redis.url))
        proxy = u.Service(
            "edgeproxy",
            [PYTHON, "-m", "edgeproxy", "serve", "--config", str(config), "--log-level", "warning"],
            work / "edgeproxy.log",
        ).start()
        admin_url = f"http://{u.LOOPBACK}:{admin}"
        proxy.wait_http(admin_url + "/readyz", timeout=60)
        assert proxy.proc is not None
        pid = proxy.proc.pid
        print(
            f"soak: {args.rate:g} req/s for {args.minutes:g} min; proxy pid {pid}; "
            f"redis paused {timeline.pause:g}s at {list(timeline.pauses)}s; "
            f"{KILLED} killed at {timeline.kill_at:g}s for {timeline.down_for:g}s; "
            f"baseline at {timeline.baseline_at:g}s; logs in {work}",
            flush=True,
        )
        ports = {
            "proxy": port,
            "admin": admin,
            "regions": {r.port for r in regions.values()},
            "redis": redis.port,
        }
        tally, samples, events = asyncio.run(
            drive(
                args,
                f"http://{u.LOOPBACK}:{port}",
                admin_url,
                pid,
                redis,
                regions,
                timeline,
                ports,
            )
        )
        died = proxy.proc.poll()
    except u.ServiceError as exc:
        print(f"soak: FAIL: {exc}", file=sys.stderr)
        return 1
    finally:
        if proxy is not None:
            proxy_rc = proxy.stop(timeout=15)
        for region in regions.values():
            region.stop()
        redis.stop()

    checks, failures = judge(samples, tally, timeline, args.max_growth)
    if died is not None:
        failures.append(f"edgeproxy exited during the run (code {died})")
    elif proxy_rc != 0:
        failures.append(f"edgeproxy exited with code {proxy_rc} on SIGTERM after the run")
    log = log_summary(work / "edgeproxy.log")
    ttfb = sorted(tally.ttfb)
    data: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(began)),
        "wall_s": round(time.time() - began, 1),
        "timeline": {
            "duration": timeline.duration,
            "period": timeline.period,
            "pause": timeline.pause,
            "pauses": list(timeline.pauses),
            "kill_at": timeline.kill_at,
            "down_for": timeline.down_for,
            "baseline_at": timeline.baseline_at,
        },
        "tasks": "not sampled: /status reports no asyncio task count",
        "events": events,
        "requests": {
            "sent": tally.sent,
            "skipped": tally.skipped,
            "answered": tally.answered,
            "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
            "complete": tally.complete,
            "disconnected_on_purpose": tally.disconnected,
            "broken_after_headers": tally.broken,
            "lost": tally.lost,
            "sent_by_kind": dict(tally.sent_by_kind),
            "cache_header": dict(tally.cache),
            "stream_error_events": tally.stream_error_events,
            "ttfb_p50_ms": round(statistics.median(ttfb) * 1000, 2) if ttfb else None,
            "ttfb_p99_ms": round(u.percentile(ttfb, 99) * 1000, 2) if ttfb else None,
            "lost_examples": tally.lost_examples,
            "broken_examples": tally.broken_examples,
        },
        "samples": samples,
        "proxy_log": log,
        "checks": checks,
        "failures": failures,
        "passed": not failures,
    }
    (args.out / "soak.json").write_text(json.dumps(data, indent=2) + "\n")
    png = chart(data, args.out / "soak.png")

    print()
    print(table(samples))
    print()
    r = data["requests"]
    print(
        f"requests: sent {r['sent']}, answered {r['answered']} {r['statuses']}, "
        f"complete {r['complete']}, disconnected on purpose {r['disconnected_on_purpose']}, "
        f"broken after headers {r['broken_after_headers']}, lost {r['lost']}; "
        f"cache {r['cache_header']}; TTFB p50 {r['ttfb_p50_ms']} ms, p99 {r['ttfb_p99_ms']} ms"
    )
    for key, what in (("rss_kb", "RSS (kB)"), ("fds", "open fds")):
        c = checks[key]
        g = "?" if c["growth_pct"] is None else f"{c['growth_pct']:+.1f}%"
        print(
            f"{what}: {c['baseline']} at t={checks['baseline_t']}s -> {c['last']} at "
            f"t={checks['last_t']}s ({g})"
        )
    print(
        "fds by kind (clients/regions/redis/listen/other sockets/other): "
        f"start {fd_split(samples[0])}, "
        f"baseline {fd_split({'fd_kinds': checks['fd_kinds']['baseline']})}, "
        f"after the load {fd_split(samples[-1])}"
    )
    print(f"in flight after the load: {checks.get('left_in_flight')}")
    print("asyncio tasks: not sampled (/status has no task count)")
    print(
        f"proxy log: {log['levels']}, {log['tracebacks']} tracebacks"
        + "".join(f"\n  {line}" for line in log["first_errors"][:5])
    )
    print(f"results: {args.out / 'soak.json'}")
    print(
        f"plot: {png}" if png else "plot: skipped (matplotlib missing: pip install -e '.[bench]')"
    )
    if args.keep_tmp or failures:
        print(f"logs and config kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        print("\nsoak: FAIL")
        for reason in failures:
            print(f"  - {reason}")
        return 1
    print("\nsoak: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
