"""Memory per concurrent stream: N slow SSE streams held open through each proxy at once.

For each proxy and each N (``--streams``, default 1,000, 5,000 and 10,000), a fresh proxy
process is started, warmed up (``--warmup`` short streamed requests, 20 at a time), left
idle for two seconds and its resident set read (``VmRSS`` in ``/proc/PID/status``): that
is ``RSS idle``. Then N streamed chat completions are opened through it, at most
``--ramp`` of them still waiting for their first event at any moment, and held open;
once every one of them has had an event, and after ``--settle`` seconds more, the
resident set is sampled for ``--sample`` seconds (the median is ``RSS with N``), and the
events the client receives meanwhile are counted (each stream should get one a second).
``RSS per stream = (RSS with N - RSS idle) / N``. Then the streams are closed and the
proxy stopped. The proxies:

* ``reference``: ``bench/reference_proxy.py``, a bare aiohttp server + client pool (its
  upstream pool sized to N);
* ``edgeproxy h2c``: ``edgeproxy serve`` with an h2c upstream (8 connections at most);
* ``edgeproxy h1``: ``edgeproxy serve`` with an HTTP/1.1 upstream (one connection a stream).

edgeproxy's connection caps (``[limits]``) and its region circuit breaker (``[health]
max_concurrent`` and ``max_pending``, 1,024 by default) are raised above N: each stream is
a request in flight for as long as it lasts, so the defaults would turn the 1,025th away.

The upstream trickles: nginx, when installed, serves a static file of uniform
chat-completion chunks paced by ``limit_rate`` + ``sendfile_max_chunk`` to one event per
write every ``--interval`` seconds (the HTTP/1.1 file starts with an SSE comment that pads
the response head to a whole number of events, so writes are events; the head and the
first kilobyte go at once, so a stream's first event comes without a wait); a request with
``X-Bench-Fast`` gets a short unpaced stream (the warm-up). Without nginx the fake region
(``python -m edgeproxy.testing --ttft 0 --inter-token-delay INTERVAL``) does it, far more
slowly at large N; the output says which. A stream without an event after
``--first-timeout`` seconds counts as failed, and RSS per stream is taken over the
streams that were held.

The upstream's HTTP/2 side allows ``--h2-streams`` streams per connection, 16,000 by
default, so that one upstream connection carries every stream. With a limit below N (say
nginx's default of 128) the pool must spread the streams over several connections, and
on 2026-12-03, with streams arriving ``--ramp`` at a time, edgeproxy then answered most of
them 504 after ``pool_timeout`` or not at all, with connections to spare (sent all at
once, they went through); ``--h2-streams 128 --streams 1000 --proxies "edgeproxy h2c"
--callgrind-streams 0`` checks it.

A proxy with an HTTP/1.1 upstream holds two descriptors a stream, and the client one: a
tier that does not fit under the open-file hard limit (``ulimit -Hn``) is skipped with the
reason. The bench raises its own soft limit to the hard one; its children inherit it.

Then, with ``--callgrind-streams`` streams held (1,000 by default; 0 skips it), each proxy
runs under ``valgrind --tool=callgrind --instr-atstart=no``: instrumentation goes on for
``--callgrind-window`` seconds once the streams are all open, and the instructions the
proxy executed in that window divided by the events the client received in it is the
cost of relaying one event at that concurrency (``kept up`` says whether the slowed-down
proxy still relayed every event on time; if not, reads carry several events and the
figure is low).

Results: the tables printed, and ``bench/results/streams.{md,json,png}``. Everything talks
to 127.0.0.1 only; every phase is bounded in time.

    python bench/streams.py                      # 4 to 6 minutes
    python bench/streams.py --streams 1000 --callgrind-streams 0   # about a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _util as u  # noqa: E402
import instr  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "results"
LOOPBACK = "127.0.0.1"
PATH = "/v1/chat/completions"
PROXIES = ("reference", "edgeproxy h2c", "edgeproxy h1")
H2_CONNECTIONS = 8
EVENT_LEN = instr.EVENT_LEN
TARGET_RATIO = 1.5


def body(tokens: int) -> bytes:
    return instr.stream_body(tokens)


# -- the trickling upstream -------------------------------------------------------


@dataclass
class Origin:
    kind: str
    h1: str
    h2c: str
    describe: str


def nginx_conf(h1: int, h2: int, root: Path, interval: float, nofile: int, h2_streams: int) -> str:
    def server(port: int, opts: str, name: str) -> str:
        # Over HTTP/2 nginx counts each DATA frame's 9-byte header against the rate too.
        rate = max(1, round((EVENT_LEN + (9 if opts else 0)) / interval))
        return f"""
    server {{
        listen {LOOPBACK}:{port}{opts} backlog=4096;
        root {root};
        types {{ }}
        default_type text/event-stream;
        etag off;
        sendfile off;
        postpone_output 0;
        location / {{
            # edgeproxy warms an HTTP/1.1 pool with OPTIONS /: answer it, do not stream.
            if ($request_method != POST) {{ return 204; }}
            if ($http_x_bench_fast) {{ rewrite ^ /fast/ last; }}
            limit_rate {rate};
            limit_rate_after 1024;
            sendfile_max_chunk {EVENT_LEN};
            try_files /slow-{name}.txt =404;
            error_page 405 =200 /slow/;
        }}
        location /slow/ {{
            internal;
            limit_rate {rate};
            limit_rate_after 1024;
            sendfile_max_chunk {EVENT_LEN};
            try_files /slow-{name}.txt =404;
        }}
        location /fast/ {{
            try_files /fast.txt =404;
            error_page 405 =200 /fast/;
        }}
    }}"""

    return f"""
worker_processes 1;
worker_rlimit_nofile {nofile};
error_log logs/error.log warn;
pid logs/nginx.pid;
events {{ worker_connections {nofile}; }}
http {{
    access_log off;
    server_tokens off;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    send_timeout 300s;
    http2_max_concurrent_streams {h2_streams};
    {server(h1, "", "h1")}
    {server(h2, " http2", "h2")}
}}
"""


@contextlib.contextmanager
def nginx_origin(
    nginx: str, interval: float, tokens: int, nofile: int, h2_streams: int
) -> Iterator[Origin]:
    work = Path(tempfile.mkdtemp(prefix="streams-origin-"))
    work.chmod(0o755)  # nginx's worker runs as another user when started as root
    html = work / "html"
    html.mkdir()
    slow = instr.sse_answer(tokens)
    (html / "slow-h1.txt").write_bytes(slow)
    (html / "slow-h2.txt").write_bytes(slow)
    (html / "fast.txt").write_bytes(instr.sse_answer(20))
    h1, h2 = instr.free_port(), instr.free_port()
    conf = nginx_conf(h1, h2, html, interval, nofile, h2_streams)
    svc = u.nginx_service("nginx-origin", nginx, work, conf, []).start()
    try:
        if not instr.wait_port(h1, 10) or not instr.wait_port(h2, 10):
            raise RuntimeError(f"the nginx upstream did not start:\n{svc.log_tail()}")
        pad = instr.sse_pad(instr.response_head_len(h1, {}), slow)
        (html / "slow-h1.txt").write_bytes(pad + slow)
        version = u.tool_version([nginx, "-v"]).replace("nginx version: ", "")
        yield Origin(
            "nginx",
            f"http://{LOOPBACK}:{h1}",
            f"http://{LOOPBACK}:{h2}",
            f"{version}, a static file of {EVENT_LEN}-byte chunks, one event per write "
            f"every {interval:g} s, {h2_streams:,} streams per HTTP/2 connection",
        )
    finally:
        svc.stop()
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def fake_origin(interval: float, tokens: int, h2_streams: int, reason: str) -> Iterator[Origin]:
    port = instr.free_port()
    argv = [sys.executable, "-m", "edgeproxy.testing", "--port", str(port), "--ttft", "0"]
    argv += ["--inter-token-delay", str(interval), "--tokens", str(tokens)]
    argv += ["--max-concurrent-streams", str(h2_streams), "--log-level", "warning"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, cwd=ROOT)
    try:
        if not instr.wait_port(port, 30):
            raise RuntimeError("the fake region did not start")
        url = f"http://{LOOPBACK}:{port}"
        yield Origin(
            "fake region",
            url,
            url,
            f"the fake region (python -m edgeproxy.testing), one token every {interval:g} s, "
            f"{h2_streams:,} streams per HTTP/2 connection, because {reason}",
        )
    finally:
        proc.terminate()
        proc.wait(10)


# -- the proxies ------------------------------------------------------------------


def edgeproxy_toml(port: int, origin: str, *, http2: bool, streams: int) -> str:
    return f"""
[server]
host = "{LOOPBACK}"
port = {port}
grace_period = 1.0
backlog = 4096

[limits]
max_connections = {streams + 1000}
max_connections_per_ip = 0

[admin]
enabled = false

# The per-region circuit breaker (1,024 in flight by default) would refuse the rest.
[health]
max_concurrent = {streams + 100}
max_pending = {streams + 100}

[upstream]
http2 = {str(http2).lower()}
max_connections = {H2_CONNECTIONS}
http1_max_connections = {streams + 100}
pool_timeout = 30.0

[[regions]]
name = "origin"
url = "{origin}"

[plugins]
entry_points = false
"""


def proxy_argv(name: str, port: int, origin: Origin, streams: int, work: Path) -> list[str]:
    if name == "reference":
        return [
            sys.executable,
            str(HERE / "reference_proxy.py"),
            "--port",
            str(port),
            "--upstream",
            origin.h1,
            "--limit",
            str(streams + 100),
        ]
    http2 = name == "edgeproxy h2c"
    conf = work / f"edge-{'h2c' if http2 else 'h1'}-{streams}.toml"
    url = origin.h2c if http2 else origin.h1
    conf.write_text(edgeproxy_toml(port, url, http2=http2, streams=streams))
    return [sys.executable, "-m", "edgeproxy", "serve", "--config", str(conf)]


def fds_needed(name: str, streams: int) -> int:
    """Descriptors the proxy needs for ``streams`` streams (client side + upstream side)."""
    upstream = H2_CONNECTIONS if name == "edgeproxy h2c" else streams
    return streams + upstream + 200


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


# -- the client: N raw streams ----------------------------------------------------


class Stream(asyncio.Protocol):
    """One streamed request over its own connection; counts the bytes after the head."""

    def __init__(self, request: bytes, first: asyncio.Future[bool]) -> None:
        self.request = request
        self.first = first
        self.transport: asyncio.Transport | None = None
        self.head = bytearray()
        self.head_done = False
        self.status_ok = False
        self.received = 0  # body bytes
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if not self.head_done:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head_done = True
            self.status_ok = self.head.startswith(b"HTTP/1.1 200")
            data = bytes(self.head[end + 4 :])
            del self.head[end + 4 :]
            if not self.status_ok and not self.first.done():
                self.first.set_result(False)
        self.received += len(data)
        if self.received >= EVENT_LEN and not self.first.done():
            self.first.set_result(True)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.first.done():
            self.first.set_result(False)


@dataclass
class Held:
    streams: list[Stream] = field(default_factory=list)
    failed: int = 0
    ramp_s: float = 0.0

    @property
    def received(self) -> int:
        return sum(s.received for s in self.streams)

    @property
    def open(self) -> int:
        return sum(not s.closed for s in self.streams)

    def close(self) -> None:
        for s in self.streams:
            if s.transport is not None and not s.closed:
                s.transport.close()


def stream_request(port: int, tokens: int, fast: bool = False) -> bytes:
    payload = body(tokens)
    head = [
        f"POST {PATH} HTTP/1.1",
        f"Host: {LOOPBACK}:{port}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(payload)}",
    ]
    if fast:
        head.append("X-Bench-Fast: 1")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


@contextlib.asynccontextmanager
async def hold(port: int, n: int, tokens: int, ramp: int, timeout: float) -> AsyncIterator[Held]:
    """Open ``n`` streams, ``ramp`` at most still waiting for their first event."""
    loop = asyncio.get_running_loop()
    held = Held()
    request = stream_request(port, tokens)
    sem = asyncio.Semaphore(ramp)
    start = time.monotonic()

    async def one() -> bool:
        async with sem:
            first: asyncio.Future[bool] = loop.create_future()
            proto = Stream(request, first)
            try:
                await loop.create_connection(lambda: proto, LOOPBACK, port)
                held.streams.append(proto)
                return await asyncio.wait_for(first, timeout)
            except (TimeoutError, OSError):
                return False

    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    try:
        # Bounded: a stream that had no event after ``timeout`` is a failure, and a ramp
        # slower than 40 streams a second is cut (edgeproxy h2c took 37 s for 5,000).
        done, pending = await asyncio.wait(tasks, timeout=timeout + n / 40)
        for task in pending:
            task.cancel()
        held.failed = len(pending) + sum(not t.result() for t in done)
        held.ramp_s = time.monotonic() - start
        yield held
    finally:
        held.close()
        await asyncio.sleep(0.5)


async def warm_up(port: int, count: int) -> int:
    """``count`` short streamed requests, 20 at a time; returns how many failed."""
    failed = 0
    sem = asyncio.Semaphore(20)
    url = f"http://{LOOPBACK}:{port}{PATH}"
    headers = {"content-type": "application/json", "x-bench-fast": "1"}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one() -> None:
            nonlocal failed
            async with sem, session.post(url, data=body(20), headers=headers) as resp:
                await resp.read()
                failed += resp.status != 200

        await asyncio.gather(*(one() for _ in range(count)))
    return failed


# -- one run ----------------------------------------------------------------------


@dataclass
class MemRow:
    proxy: str
    streams: int
    rss_idle_kib: int
    rss_held_kib: int
    failed: int
    warmup_failed: int
    open_at_end: int
    ramp_s: float
    events_per_s: float
    samples_kib: list[int]

    @property
    def per_stream_kib(self) -> float:
        """Over the streams that were held (all of them unless some failed)."""
        held = self.streams - self.failed
        return (self.rss_held_kib - self.rss_idle_kib) / held if held > 0 else float("nan")


@dataclass
class CgRow:
    proxy: str
    streams: int
    window_s: float
    events: float
    instructions: int
    kept_up: float

    @property
    def per_event(self) -> float:
        return self.instructions / self.events if self.events else float("nan")


def start(argv: list[str], work: Path, name: str) -> subprocess.Popen[bytes]:
    log = open(work / f"{name.replace(' ', '-')}.log", "w")  # closed with the process
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
    )


async def measure_memory(
    name: str, n: int, origin: Origin, args: argparse.Namespace, work: Path
) -> MemRow:
    port = instr.free_port()
    proc = start(proxy_argv(name, port, origin, n, work), work, name)
    try:
        if not await asyncio.to_thread(instr.wait_port, port, 60, proc):
            raise RuntimeError(f"{name} did not start (log in {work})")
        warm_failed = await warm_up(port, args.warmup)
        await asyncio.sleep(2.0)
        idle = rss_kib(proc.pid)
        async with hold(port, n, args.tokens, args.ramp, args.first_timeout) as held:
            await asyncio.sleep(args.settle)
            before, t0 = held.received, time.monotonic()
            samples = []
            while time.monotonic() - t0 < args.sample:
                samples.append(rss_kib(proc.pid))
                await asyncio.sleep(0.5)
            rate = (held.received - before) / EVENT_LEN / (time.monotonic() - t0)
            return MemRow(
                name,
                n,
                idle,
                int(statistics.median(samples)),
                held.failed,
                warm_failed,
                held.open,
                round(held.ramp_s, 1),
                round(rate, 1),
                samples,
            )
    finally:
        u.stop_process(proc)


async def measure_callgrind(
    name: str, n: int, origin: Origin, args: argparse.Namespace, work: Path
) -> CgRow:
    port = instr.free_port()
    cg = work / f"cg-{name.replace(' ', '-')}"
    cg.mkdir()
    proc = instr.callgrind(proxy_argv(name, port, origin, n, work), dict(os.environ), cg)
    try:
        if not await asyncio.to_thread(instr.wait_port, port, 240, proc):
            raise RuntimeError(f"{name} did not start under callgrind (log in {cg})")
        await warm_up(port, 50)
        async with hold(port, n, args.tokens, args.ramp, 120) as held:
            if held.failed:
                raise RuntimeError(f"{held.failed} of {n} streams had no event under callgrind")
            await asyncio.sleep(2.0)
            await asyncio.to_thread(instr.control, proc.pid, "-i", "on")
            before, t0 = held.received, time.monotonic()
            await asyncio.sleep(args.callgrind_window)
            await asyncio.to_thread(instr.control, proc.pid, "-i", "off")
            window = time.monotonic() - t0
            events = (held.received - before) / EVENT_LEN
            total = await asyncio.to_thread(instr.dump_instructions, proc.pid, cg)
            expected = n * window / args.interval
            return CgRow(name, n, round(window, 1), round(events), total, events / expected)
    finally:
        u.stop_process(proc)


# -- report ---------------------------------------------------------------------


def mem_table(rows: list[MemRow]) -> str:
    lines = [
        "| proxy | streams | RSS idle | RSS with N | RSS per stream | x reference "
        "| failed | open at end | ramp | events/s seen |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ref = next((x for x in rows if x.proxy == "reference" and x.streams == r.streams), None)
        ratio = f"{r.per_stream_kib / ref.per_stream_kib:.2f}" if ref else "-"
        lines.append(
            f"| {r.proxy} | {r.streams:,} | {r.rss_idle_kib / 1024:,.1f} MiB "
            f"| {r.rss_held_kib / 1024:,.1f} MiB | {r.per_stream_kib:,.1f} KiB | {ratio} "
            f"| {r.failed} | {r.open_at_end:,} | {r.ramp_s:g} s | {r.events_per_s:,.0f} |"
        )
    return "\n".join(lines)


def cg_table(rows: list[CgRow]) -> str:
    lines = [
        "| proxy | streams held | window | events relayed | instructions per event "
        "| x reference | kept up |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ref = next((x for x in rows if x.proxy == "reference"), None)
    for r in rows:
        ratio = f"{r.per_event / ref.per_event:.2f}" if ref else "-"
        lines.append(
            f"| {r.proxy} | {r.streams:,} | {r.window_s:g} s | {r.events:,.0f} "
            f"| {r.per_event / 1000:,.1f} k | {ratio} | {r.kept_up:.0%} |"
        )
    return "\n".join(lines)


def plot(rows: list[MemRow], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no PNG"
    tiers = sorted({r.streams for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(PROXIES)
    for i, name in enumerate(PROXIES):
        xs, ys = [], []
        for j, n in enumerate(tiers):
            row = next((r for r in rows if r.proxy == name and r.streams == n), None)
            if row:
                xs.append(j + (i - (len(PROXIES) - 1) / 2) * width)
                ys.append(row.per_stream_kib)
        bars = ax1.bar(xs, ys, width, label=name)
        ax1.bar_label(bars, fmt="%.0f", fontsize=8)
        pts = [(r.streams - r.failed, r.rss_held_kib / 1024) for r in rows if r.proxy == name]
        idle = [r.rss_idle_kib / 1024 for r in rows if r.proxy == name]
        if pts:
            ax2.plot(
                [0] + [p[0] for p in pts],
                [statistics.median(idle)] + [p[1] for p in pts],
                marker="o",
                label=name,
            )
    ax1.set_xticks(range(len(tiers)), [f"{n:,}" for n in tiers])
    ax1.set_xlabel("streams held at once")
    ax1.set_ylabel("KiB per stream")
    ax1.set_title("(RSS with N - RSS idle) / N")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("streams held at once (those that had an event)")
    ax2.set_ylabel("proxy RSS, MiB")
    ax2.set_title("resident set (0 = idle after warm-up)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


@contextlib.contextmanager
def origin_for(args: argparse.Namespace, nofile: int) -> Iterator[Origin]:
    nginx = None if args.skip_nginx else u.nginx_binary()
    if nginx:
        with nginx_origin(nginx, args.interval, args.tokens, nofile, args.h2_streams) as origin:
            yield origin
    else:
        reason = "--skip-nginx was given" if args.skip_nginx else "nginx is not installed"
        with fake_origin(args.interval, args.tokens, args.h2_streams, reason) as origin:
            yield origin


async def run(args: argparse.Namespace, nofile: int) -> dict[str, object]:
    mem: list[MemRow] = []
    cg: list[CgRow] = []
    notes: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="streams-"))
    with origin_for(args, nofile) as origin:
        print(f"upstream: {origin.describe}", flush=True)
        for n in args.streams:
            for name in args.proxies:
                need = fds_needed(name, n)
                if need > nofile or n + 200 > nofile:
                    line = (
                        f"{name} at {n:,} streams: skipped (needs about {need:,} open files in "
                        f"the proxy; the hard limit is {nofile:,})"
                    )
                    notes.append(line)
                    print(line, flush=True)
                    continue
                try:
                    row = await measure_memory(name, n, origin, args, work)
                except (RuntimeError, OSError) as exc:
                    line = f"{name} at {n:,} streams: failed ({exc})"
                    notes.append(line)
                    print(line, flush=True)
                    continue
                mem.append(row)
                print(
                    f"{name:14} {n:6,} streams: idle {row.rss_idle_kib / 1024:6.1f} MiB, "
                    f"held {row.rss_held_kib / 1024:7.1f} MiB, {row.per_stream_kib:6.1f} KiB "
                    f"a stream ({row.failed} failed, ramp {row.ramp_s:g} s, "
                    f"{row.events_per_s:,.0f} events/s)",
                    flush=True,
                )
        if args.callgrind_streams and shutil.which("valgrind") is None:
            notes.append("callgrind: skipped (valgrind is not installed)")
        elif args.callgrind_streams:
            for name in args.proxies:
                try:
                    row2 = await measure_callgrind(name, args.callgrind_streams, origin, args, work)
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    line = f"callgrind {name}: failed ({exc})"
                    notes.append(line)
                    print(line, flush=True)
                    continue
                cg.append(row2)
                print(
                    f"callgrind {name:14} {row2.streams:,} streams: "
                    f"{row2.per_event / 1000:,.1f} k instructions an event "
                    f"({row2.events:,.0f} events in {row2.window_s:g} s, kept up "
                    f"{row2.kept_up:.0%})",
                    flush=True,
                )
        else:
            notes.append("callgrind: skipped (--callgrind-streams 0)")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return {"origin": origin, "mem": mem, "cg": cg, "notes": notes}


def verdicts(mem: list[MemRow]) -> list[str]:
    out = []
    for r in mem:
        if r.proxy == "reference":
            continue
        ref = next((x for x in mem if x.proxy == "reference" and x.streams == r.streams), None)
        if ref and ref.per_stream_kib > 0:
            ratio = r.per_stream_kib / ref.per_stream_kib
            mark = "meets" if ratio <= TARGET_RATIO else "misses"
            out.append(
                f"{r.proxy} at {r.streams:,} streams: {ratio:.2f}x the reference's memory per "
                f"stream, {mark} the {TARGET_RATIO:g}x target"
            )
    return out


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--proxies", nargs="+", default=list(PROXIES), choices=PROXIES)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between events")
    parser.add_argument(
        "--tokens", type=int, default=900, help="events a stream could last (times --interval)"
    )
    parser.add_argument("--warmup", type=int, default=200, help="short streams before idle RSS")
    parser.add_argument("--ramp", type=int, default=200, help="streams opening at once")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds before sampling")
    parser.add_argument("--sample", type=float, default=5.0, help="seconds of RSS samples")
    parser.add_argument(
        "--first-timeout", type=float, default=30.0, help="seconds a stream may wait for an event"
    )
    parser.add_argument(
        "--h2-streams",
        type=int,
        default=16000,
        help="the upstream's SETTINGS_MAX_CONCURRENT_STREAMS (default: one connection holds all)",
    )
    parser.add_argument("--callgrind-streams", type=int, default=1000, help="0 skips callgrind")
    parser.add_argument("--callgrind-window", type=float, default=10.0)
    parser.add_argument("--skip-nginx", action="store_true", help="no nginx, even if installed")
    parser.add_argument("--keep", action="store_true", help="keep logs and callgrind files")
    args = parser.parse_args(argv)
    # A SIGTERM (CI's timeout) unwinds, so that the servers this started are stopped.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    nofile = instr.raise_nofile()
    started = time.monotonic()
    try:
        import uvloop

        result = uvloop.run(run(args, nofile))
    except ImportError:
        result = asyncio.run(run(args, nofile))
    origin = result["origin"]
    mem: list[MemRow] = result["mem"]  # type: ignore[assignment]
    cg: list[CgRow] = result["cg"]  # type: ignore[assignment]
    notes: list[str] = result["notes"]  # type: ignore[assignment]
    assert isinstance(origin, Origin)
    RESULTS.mkdir(exist_ok=True)
    png_note = plot(mem, RESULTS / "streams.png")
    if png_note:
        notes.append(png_note)
    notes = [f"upstream: {origin.describe}", f"open-file limit: {nofile:,}"] + notes
    text = "## Memory per stream\n\n" + mem_table(mem)
    verdict = verdicts(mem)
    if verdict:
        text += "\n\n" + "\n".join(f"* {v}" for v in verdict)
    if cg:
        text += "\n\n## Instructions per relayed event\n\n" + cg_table(cg)
    text += "\n\n" + "\n".join(f"* {n}" for n in notes)
    print()
    print(text)
    print(f"({time.monotonic() - started:.0f} s)")
    (RESULTS / "streams.md").write_text(text + "\n")
    data = {
        "upstream": origin.kind,
        "upstream_detail": origin.describe,
        "nofile": nofile,
        "settings": {k: v for k, v in vars(args).items() if k != "keep"},
        "memory": [asdict(r) | {"per_stream_kib": r.per_stream_kib} for r in mem],
        "callgrind": [asdict(r) | {"per_event": r.per_event} for r in cg],
        "verdicts": verdict,
        "notes": notes,
    }
    (RESULTS / "streams.json").write_text(json.dumps(data, indent=2) + "\n")
    return 1 if any(r.failed for r in mem) else 0


if __name__ == "__main__":
    sys.exit(main())
