"""Plumbing for the proxy benchmarks: ports, pinned server processes, nginx, wrk and h2load.

Everything here talks to 127.0.0.1 only, and every load run is bounded by a
duration (and a subprocess timeout on top), so nothing can run away.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"

# A small non-streaming chat completion, about the size a short answer has:
# big enough that header handling is not the whole story, small enough that the
# benchmark measures per-request overhead rather than copying.
UPSTREAM_JSON = (
    '{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,'
    '"model":"bench","choices":[{"index":0,"message":{"role":"assistant",'
    '"content":"Hello from the benchmark upstream."},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":9,"completion_tokens":7,"total_tokens":16}}'
)

REQUEST_PATH = "/v1/chat/completions"
REQUEST_JSON = (
    '{"model":"bench","messages":[{"role":"system","content":"You are terse."},'
    '{"role":"user","content":"Say hello."}],"max_tokens":16}'
)


def edgeproxy_toml(port: int, admin: int, origin: str, *sections: str) -> str:
    """An ``edgeproxy serve`` config for a bench: loopback listeners, one HTTP/1.1 region
    called ``origin``, no entry-point plugins, then ``sections`` (TOML text) as given."""
    base = f"""
[server]
host = "{LOOPBACK}"
port = {port}
grace_period = 2.0
backlog = 4096

[admin]
host = "{LOOPBACK}"
port = {admin}

[upstream]
http2 = false
max_connections = 100

[[regions]]
name = "origin"
url = "{origin}"

[plugins]
entry_points = false
"""
    return base + "".join(sections)


def free_port() -> int:
    """A port the kernel just handed out; the tiny reuse race is fine on a bench box."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


# -- CPU pinning -----------------------------------------------------------------


@dataclass(frozen=True)
class Pinning:
    """Which CPUs the harness (load generators, driver, origin) and the proxy under test use.

    Empty tuples mean "not pinned". ``layout`` is ``split`` (the origin runs
    next to the load generator, the proxy has its core to itself) or
    ``shared`` (origin and proxy share the server core).
    """

    harness: tuple[int, ...]
    sut: tuple[int, ...]
    layout: str = "split"

    def describe(self) -> str:
        if not self.harness and not self.sut:
            return "not pinned (fewer than 2 CPUs available, or taskset missing)"
        if self.layout == "shared":
            return (
                f"wrk/h2load and the driver on CPU {_cpus(self.harness)}; the origin "
                f"(nginx or fake region) and the proxy under test share CPU {_cpus(self.sut)}"
            )
        return (
            f"wrk/h2load, the driver and the origin (nginx or fake region) on CPU "
            f"{_cpus(self.harness)}; the proxy under test alone on CPU {_cpus(self.sut)}"
        )

    def harness_prefix(self) -> list[str]:
        return _taskset(self.harness)

    def sut_prefix(self) -> list[str]:
        return _taskset(self.sut)

    def origin_prefix(self) -> list[str]:
        return self.sut_prefix() if self.layout == "shared" else self.harness_prefix()


def _cpus(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in cpus)


def _taskset(cpus: Sequence[int]) -> list[str]:
    return ["taskset", "-c", _cpus(cpus)] if cpus else []


def plan_pinning(harness_cpu: int | None, sut_cpu: int | None, layout: str = "split") -> Pinning:
    """Give the proxy under test a core of its own; everything else shares the other.

    With two cores, letting wrk float onto the proxy's core would make the
    proxy's req/s depend on how much CPU the load generator stole. The origin
    goes with the load generator by default (``split``): a real region is on
    another machine, and on the proxy's core it would both take CPU from the
    proxy and add scheduler hand-off delays (the proxy is always runnable at
    saturation, so the woken origin waits for a time slice) that have nothing
    to do with the proxy's own cost.
    """
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2 or shutil.which("taskset") is None:
        return Pinning((), (), layout)
    harness = harness_cpu if harness_cpu is not None else available[0]
    sut = sut_cpu if sut_cpu is not None else available[-1]
    return Pinning((harness,), (sut,), layout)


# -- server processes ------------------------------------------------------------


class ServiceError(RuntimeError):
    """A server did not start; the message carries the tail of its log."""


@dataclass
class Service:
    """A server in its own subprocess (and session), stopped by its own pid only."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> Service:
        log = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        finally:
            log.close()
        return self

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise ServiceError(f"{self.name} exited (code {code}):\n{self.log_tail()}")

    def wait_http(self, url: str, *, timeout: float = 20.0, method: str = "GET") -> None:
        """Poll ``url`` until it answers 200; fail early if the process dies."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                req = urllib.request.Request(url, method=method)
                with urllib.request.urlopen(req, timeout=2) as resp:
                    if resp.status == 200:
                        return
                    last = f"status {resp.status}"
            except urllib.error.HTTPError as exc:
                last = f"status {exc.code}"
            except (OSError, urllib.error.URLError) as exc:
                last = str(exc)
            time.sleep(0.1)
        raise ServiceError(
            f"{self.name} not ready at {url} after {timeout}s ({last}):\n{self.log_tail()}"
        )

    def wait_line(self, needle: str, *, timeout: float = 20.0) -> str:
        """Wait for a line containing ``needle`` in the log and return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            for line in self.log_path.read_text(errors="replace").splitlines():
                if needle in line:
                    return line
            time.sleep(0.05)
        raise ServiceError(f"{self.name} never printed {needle!r}:\n{self.log_tail()}")

    def stop(self, *, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Signal our process and wait; SIGKILL it (and only it) if it does not go."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.proc = None
        return proc.returncode


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM a server started with Popen and wait for it (under callgrind it writes its
    counts as it exits, which takes a while); SIGKILL it if it is not gone in ``timeout``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- nginx -----------------------------------------------------------------------


def nginx_binary() -> str | None:
    for candidate in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _nginx_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def nginx_origin_conf(h1_port: int, h2_port: int) -> str:
    """The upstream: the same JSON on an HTTP/1.1 port and an h2c (prior knowledge) port.

    ``keepalive_requests`` and ``http2_max_concurrent_streams`` are nginx's
    defaults, written out because the HTTP/2 stress relies on them: a GOAWAY
    every 1000 streams per connection and at most 128 streams at once.
    """
    body = _nginx_quote(UPSTREAM_JSON)
    return f"""
worker_processes 1;
error_log logs/error.log warn;
pid logs/nginx.pid;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    default_type application/json;
    keepalive_requests 1000;
    keepalive_timeout 75s;
    http2_max_concurrent_streams 128;
    server {{
        listen {LOOPBACK}:{h1_port} backlog=4096;
        location / {{ return 200 {body}; }}
    }}
    server {{
        listen {LOOPBACK}:{h2_port} http2 backlog=4096;
        location / {{ return 200 {body}; }}
    }}
}}
"""


def nginx_proxy_conf(port: int, upstream_port: int, keepalive: int) -> str:
    """nginx as a peer reverse proxy: an HTTP/1.1 keep-alive pool, no buffering (streams)."""
    return f"""
worker_processes 1;
error_log logs/error.log warn;
pid logs/nginx.pid;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    upstream origin {{
        server {LOOPBACK}:{upstream_port};
        keepalive {keepalive};
    }}
    server {{
        listen {LOOPBACK}:{port} backlog=4096;
        location / {{
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def nginx_service(name: str, binary: str, prefix: Path, conf: str, pin: list[str]) -> Service:
    """An nginx in the foreground (``daemon off``) under ``prefix``, so stopping it is a kill
    of our own child, and nothing touches the system's nginx directories."""
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    (prefix / "conf").mkdir(parents=True, exist_ok=True)
    conf_path = prefix / "conf" / "nginx.conf"
    conf_path.write_text(conf)
    argv = [
        *pin,
        binary,
        "-p",
        str(prefix),
        "-c",
        str(conf_path),
        "-e",
        str(prefix / "logs" / "error.log"),
        "-g",
        "daemon off;",
    ]
    return Service(name, argv, prefix / "logs" / "stdout.log")


def tool_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0] if text else "?"


# -- wrk: closed-loop throughput -------------------------------------------------


@dataclass
class WrkResult:
    """One wrk run. Latencies in milliseconds; ``errors`` counts non-2xx/3xx and socket errors."""

    conns: int
    duration_s: float
    requests: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    non2xx: int
    socket_errors: dict[str, int]

    @property
    def errors(self) -> int:
        return self.non2xx + sum(self.socket_errors.values())

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "errors": self.errors}


_WRK_LUA = """
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"

-- One JSON line from the single thread's summary: easier to trust than
-- parsing wrk's human-readable, unit-scaled text.
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {{\\"requests\\":%d,\\"duration_us\\":%d,\\"connect\\":%d,\\"read\\":%d," ..
    "\\"write\\":%d,\\"status\\":%d,\\"timeout\\":%d,\\"p50\\":%d,\\"p90\\":%d," ..
    "\\"p99\\":%d,\\"max\\":%d}}\\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


def write_wrk_script(directory: Path) -> Path:
    path = directory / "post.lua"
    lua_body = "[[" + REQUEST_JSON + "]]"
    path.write_text(_WRK_LUA.format(body=lua_body))
    return path


def run_wrk(
    url: str,
    *,
    conns: int,
    duration: float,
    script: Path,
    pin: list[str],
    timeout_s: float = 2.0,
) -> WrkResult:
    """Closed loop: ``conns`` keep-alive connections, each sending as fast as answers come.

    One wrk thread is plenty on one pinned core and keeps the load generator's
    own cost constant between configurations.
    """
    secs = max(1, round(duration))
    argv = [
        *pin,
        "wrk",
        "-t1",
        f"-c{conns}",
        f"-d{secs}s",
        f"--timeout={timeout_s:g}s",
        "-s",
        str(script),
        url,
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=secs + 30)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk gave no summary (rc {out.returncode}):\n{out.stdout}{out.stderr}")
    data = json.loads(line[len("WRKJSON ") :])
    seconds = data["duration_us"] / 1e6
    return WrkResult(
        conns=conns,
        duration_s=round(seconds, 3),
        requests=data["requests"],
        rps=data["requests"] / seconds if seconds else 0.0,
        p50_ms=data["p50"] / 1000,
        p90_ms=data["p90"] / 1000,
        p99_ms=data["p99"] / 1000,
        max_ms=data["max"] / 1000,
        non2xx=data["status"],
        socket_errors={k: data[k] for k in ("connect", "read", "write", "timeout")},
    )


# -- h2load: fixed-rate (open loop) latency --------------------------------------


@dataclass
class LoadResult:
    """An h2load run. Latencies in milliseconds, over the requests after the warm-up.

    ``errors`` is h2load's "failed" count (non-2xx answers and network errors);
    ``over_1s`` counts answers that took more than a second, which is how a
    starving request shows before it turns into a timeout.
    """

    target_rps: float | None
    achieved_rps: float
    requests: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    over_1s: int
    non2xx: int
    errors: int
    statuses: dict[str, int] = field(default_factory=dict)  # the non-2xx ones, by code

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (``q`` in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), math.ceil(q / 100 * len(sorted_values))))
    return float(sorted_values[rank - 1])


def run_h2load(
    url: str,
    *,
    clients: int,
    duration: float,
    warmup: float,
    body_file: Path,
    log_file: Path,
    pin: list[str],
    rate: float | None = None,
) -> LoadResult:
    """HTTP/1.1 load with a per-request log: closed loop, or open loop at ``rate`` req/s.

    Open loop: ``clients`` connections, each firing at ``rate/clients`` req/s.
    h2load times a request from when it is written, so a request that waits
    for its connection is not charged for the wait; with enough connections at
    half load that wait is rare, and ``achieved_rps`` below the target shows
    when the server fell behind.
    """
    per_client = max(1, round(rate / clients)) if rate else None
    argv = [
        *pin,
        "h2load",
        "--h1",
        "-t1",
        f"-c{clients}",
        *([f"--rps={per_client}"] if per_client else []),
        f"-D{int(duration * 1000)}ms",
        *([f"--warm-up-time={int(warmup * 1000)}ms"] if warmup > 0 else []),
        "-d",
        str(body_file),
        "-H",
        "content-type: application/json",
        f"--log-file={log_file}",
        url,
    ]
    log_file.unlink(missing_ok=True)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + warmup + 30)
    if out.returncode != 0 or not log_file.exists():
        raise RuntimeError(f"h2load failed (rc {out.returncode}):\n{out.stdout}{out.stderr}")
    # (start time us, status, duration us); h2load leaves the warm-up out of its log.
    rows: list[tuple[int, int, int]] = []
    for line in log_file.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 3:
            rows.append((int(parts[0]), int(parts[1]), int(parts[2])))
    if not rows:
        raise RuntimeError(f"h2load logged no requests:\n{out.stdout}{out.stderr}")
    lat = sorted(r[2] / 1000 for r in rows)
    counts = _h2load_counts(out.stdout)
    return LoadResult(
        target_rps=float(per_client * clients) if per_client else None,
        achieved_rps=len(rows) / duration,
        requests=len(rows),
        p50_ms=percentile(lat, 50),
        p90_ms=percentile(lat, 90),
        p99_ms=percentile(lat, 99),
        p999_ms=percentile(lat, 99.9),
        max_ms=lat[-1],
        over_1s=sum(1 for x in lat if x > 1000),
        non2xx=sum(1 for r in rows if not 200 <= r[1] < 300),
        # h2load's "failed" leaves some HTTP-level failures out; count both.
        errors=max(counts.get("failed", 0), sum(1 for r in rows if not 200 <= r[1] < 300)),
        statuses=dict(Counter(str(r[1]) for r in rows if not 200 <= r[1] < 300)),
    )


def run_openloop(
    url: str,
    *,
    rate: float,
    duration: float,
    warmup: float,
    conns: int,
    body_file: Path,
    pin: list[str],
) -> LoadResult:
    """Fixed-rate load from ``_openloop.py`` (evenly spaced requests; see its docstring for
    why not ``h2load --rps``), in its own process on the load generator's CPU."""
    import sys

    argv = [
        *pin,
        sys.executable,
        str(Path(__file__).with_name("_openloop.py")),
        url,
        "--rate",
        f"{rate:g}",
        "--duration",
        f"{duration:g}",
        "--warmup",
        f"{warmup:g}",
        "--conns",
        str(conns),
        "--body-file",
        str(body_file),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + warmup + 30)
    if out.returncode != 0:
        raise RuntimeError(f"_openloop failed (rc {out.returncode}):\n{out.stdout}{out.stderr}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    data.pop("queued", None)
    return LoadResult(**data)


def _h2load_counts(stdout: str) -> dict[str, int]:
    """``requests: N total, N started, N done, N succeeded, N failed, N errored, N timeout``."""
    for line in stdout.splitlines():
        if line.startswith("requests:"):
            words = line.replace(",", "").split()[1:]
            return {
                words[i + 1]: int(words[i])
                for i in range(0, len(words) - 1, 2)
                if words[i].isdigit()
            }
    return {}


# -- HTTP helpers ----------------------------------------------------------------


def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


# -- contention on a shared machine ------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    return total - idle, total


def _tree_jiffies(pid: int) -> int:
    """utime+stime of ``pid`` and its descendants (nginx's worker is a child of its master)."""
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
            # Fields after the parenthesised command name; utime and stime are 14 and 15.
            rest = stat.rsplit(")", 1)[1].split()
            total += int(rest[11]) + int(rest[12])
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except (OSError, IndexError, ValueError):
            continue
    return total


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """CPU used during a run by the proxy under test, and by everything outside the benchmark.

    On a shared box another job's burst silently halves a proxy's req/s;
    measuring it lets the report flag (and the driver retry) such a run instead
    of presenting it as a regression. ``foreign_cores`` = (all busy CPU - our
    servers - the load generator, a reaped child by the time the run ends -
    this driver) / wall time. ``sut_cpu_s`` is the CPU the proxy under test
    itself used: divided by the requests served it gives a cost per request
    that other processes barely disturb.
    """

    def __init__(self, pids: Sequence[int], sut_pids: Sequence[int] = ()) -> None:
        self.pids = list(pids)
        self.sut_pids = list(sut_pids)
        self.foreign_cores = 0.0
        self.server_cores = 0.0
        self.sut_cpu_s = 0.0

    def __enter__(self) -> CpuMeter:
        self._t = time.monotonic()
        self._busy, _ = _busy_jiffies()
        self._ours = sum(_tree_jiffies(p) for p in self.pids)
        self._sut = sum(_tree_jiffies(p) for p in self.sut_pids)
        self._children = _children_cpu_s()
        self._self = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(1e-6, time.monotonic() - self._t)
        busy = (_busy_jiffies()[0] - self._busy) / _CLK_TCK
        ours = (sum(_tree_jiffies(p) for p in self.pids) - self._ours) / _CLK_TCK
        self.sut_cpu_s = (sum(_tree_jiffies(p) for p in self.sut_pids) - self._sut) / _CLK_TCK
        gen = _children_cpu_s() - self._children
        driver = time.process_time() - self._self
        self.server_cores = round(ours / wall, 3)
        self.foreign_cores = round(max(0.0, busy - ours - gen - driver) / wall, 3)


def wait_quiet(max_wait: float, threshold: float = 0.15, sample: float = 0.3) -> float:
    """Wait (at most ``max_wait`` s) until other processes use under ``threshold`` cores.

    Returns the last busy reading in cores. Our own servers are idle between
    runs, so what shows up here is someone else's work.
    """
    deadline = time.monotonic() + max_wait
    ncpu = os.cpu_count() or 1
    while True:
        b0, t0 = _busy_jiffies()
        time.sleep(sample)
        b1, t1 = _busy_jiffies()
        cores = (b1 - b0) / max(1, t1 - t0) * ncpu
        if cores < threshold or time.monotonic() >= deadline:
            return round(cores, 3)
