"""The front ends side by side: instructions per request and streams per process.

Ways for a client to reach the same pipeline, each a process of its own, in one run:

* ``aiohttp h1``: ``edgeproxy serve`` with its default HTTP/1.1 listener (aiohttp), the
  baseline every ratio is taken against;
* ``edgeproxy h2``: ``edgeproxy serve`` with ``server.http2`` and ``h2c`` (the HTTP/2
  listener on jh2), an HTTP/2 client (httpx, prior knowledge);
* ``edgeproxy h1 on h2 port``: the same listener, an HTTP/1.1 client (which it hands to
  the default listener's aiohttp handler);
* ``uvicorn asgi``: ``proxy.asgi`` under uvicorn (httptools, uvloop), an HTTP/1.1 client;
* ``granian h2`` / ``granian h1``: ``proxy.asgi`` under granian's embeddable server (Rust,
  one runtime thread); skipped without granian (``pip install granian``);
* with ``--tree DIR`` (a checkout of an earlier revision), ``edgeproxy h2 (before)``:
  ``server.http2`` + ``h2c`` run from DIR (``PYTHONPATH=DIR``), an HTTP/2 client; from a
  revision before the jh2 listener, that is hypercorn's. ``--tree NAME=DIR`` names the row
  ``edgeproxy h2 (NAME)``, and ``--tree`` may be given more than once (the compiled build
  beside the code before, say).

``--fronts NAME...`` runs only the named rows (quote the names: they have spaces).

**Instructions per request** (callgrind, as in ``bench/instr.py``, whose upstream, pacing
and counting this reuses): a JSON request and a streamed one of ``--events`` events, each
after a warm-up, only the proxy process counted. Each row's instructions per JSON request
and per SSE event are also given as a ratio to ``aiohttp h1`` in the same run.

**Streams per process** (wall clock, no valgrind), for ``aiohttp h1``, ``edgeproxy h2`` and
``edgeproxy h2 (before)``: ``--streams`` SSE streams opened at once against the fake
region (``--stream-tokens`` tokens, ``--stream-pace`` ms apart); reported: how many had
their first event (all, when the front end holds them), how many completed, the proxy's
resident memory per stream at the peak, and its CPU time per relayed event. The target
over HTTP/2 is at most ``TARGET_KIB`` KiB per held stream (hypercorn's figure).

A front end that fails (its port never opens, a request errors or answers other than 200)
keeps its row, with the failures counted and the first errors listed; its process's
output (stdout and stderr, tracebacks included) is kept as
``bench/results/frontends.<front end>.log``.

Results: printed, and ``bench/results/frontends.{md,json}`` with ``frontends.png`` (the
ratios, and KiB per held stream against the target).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _util as u  # noqa: E402
import instr as ins  # noqa: E402

RESULTS = HERE / "results"
BASELINE = "aiohttp h1"
# KiB of resident memory per held HTTP/2 stream: hypercorn's figure, not to be exceeded.
TARGET_KIB = 10.9
# Request errors kept per front end (the first ones; the count says how many in all).
KEEP_ERRORS = 5


@dataclass
class Outcome:
    failed: int = 0
    events: int = 0
    reads: int = 0
    errors: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failed += 1
        if len(self.errors) < KEEP_ERRORS:
            self.errors.append(what)


Driver = Callable[[int, int, bytes, int, dict[str, str]], Coroutine[Any, Any, Outcome]]


@dataclass
class FrontEnd:
    name: str
    http2: bool  # server.http2 + h2c
    server: str | None  # an ASGI server serving proxy.asgi: "uvicorn", "granian"
    h2_client: bool
    held: bool = False  # also in the held-streams test
    tree: Path | None = None  # run from this checkout (None: this one)

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")

    @property
    def pythonpath(self) -> Path:
        return self.tree or ins.ROOT


FRONT_ENDS = [
    FrontEnd(BASELINE, False, None, False, held=True),
    FrontEnd("edgeproxy h2", True, None, True, held=True),
    FrontEnd("edgeproxy h1 on h2 port", True, None, False),
    FrontEnd("uvicorn asgi", False, "uvicorn", False),
    FrontEnd("granian h2", False, "granian", True),
    FrontEnd("granian h1", False, "granian", False),
]
# Run from each --tree: that checkout's HTTP/2 listener, as "edgeproxy h2 (NAME)".
TREE_FRONT_END = FrontEnd("edgeproxy h2", True, None, True, held=True)
ALL_NAMES = [f.name for f in FRONT_ENDS] + [f"{TREE_FRONT_END.name} (NAME)"]


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


async def drive_h1(
    port: int, count: int, body: bytes, conc: int, headers: dict[str, str]
) -> Outcome:
    """:func:`instr.drive`, with each request's error counted instead of raised."""
    headers = {"content-type": "application/json", **headers}
    out = Outcome()
    sem = asyncio.Semaphore(conc)
    url = f"http://{ins.LOOPBACK}:{port}{ins.PATH}"
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> None:
            async with sem:
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        data = bytearray()
                        async for chunk in resp.content.iter_any():
                            data += chunk
                            out.reads += 1
                        if resp.status != 200:
                            out.fail(f"HTTP {resp.status}: {bytes(data[:200])!r}")
                        out.events += data.count(b"\ndata: ") + data.startswith(b"data: ")
                except (TimeoutError, aiohttp.ClientError) as exc:
                    out.fail(_error(exc))

        await asyncio.gather(*(one() for _ in range(count)))
    return out


async def drive_h2(
    port: int, count: int, body: bytes, conc: int, headers: dict[str, str]
) -> Outcome:
    """The same over HTTP/2 (one connection, ``conc`` streams at a time)."""
    headers = {"content-type": "application/json", **headers}
    out = Outcome()
    sem = asyncio.Semaphore(conc)
    url = f"http://{ins.LOOPBACK}:{port}{ins.PATH}"
    async with httpx.AsyncClient(http1=False, http2=True, timeout=300) as client:

        async def one() -> None:
            async with sem:
                try:
                    async with client.stream("POST", url, content=body, headers=headers) as resp:
                        data = bytearray()
                        async for chunk in resp.aiter_raw():
                            data += chunk
                            out.reads += 1
                        if resp.status_code != 200:
                            out.fail(f"HTTP {resp.status_code}: {bytes(data[:200])!r}")
                        out.events += data.count(b"\ndata: ") + data.startswith(b"data: ")
                except httpx.HTTPError as exc:
                    out.fail(_error(exc))

        await asyncio.gather(*(one() for _ in range(count)))
    return out


def config_file(
    work: Path,
    front: FrontEnd,
    port: int,
    origin: str,
    args: argparse.Namespace,
    *,
    upstream_h2: bool = False,
) -> Path:
    text = ins.proxy_toml(port, origin, http2=upstream_h2, cache=False)
    if front.http2:
        text = text.replace("grace_period = 1.0", "grace_period = 1.0\nhttp2 = true\nh2c = true")
    # Thousands of client connections in the streams test (HTTP/1.1: one per stream).
    text += "\n[limits]\nmax_connections = 20000\nmax_connections_per_ip = 0\n"
    if args.h2_max_control_frames is not None:
        text += f"h2_max_control_frames = {args.h2_max_control_frames}\n"
    path = work / f"{front.slug}.toml"
    path.write_text(text)
    return path


def command(front: FrontEnd, conf: Path, port: int) -> list[str]:
    if front.server is not None:
        script = HERE / f"_{'asgi' if front.server == 'uvicorn' else 'granian'}_serve.py"
        return [sys.executable, str(script), "--config", str(conf), "--port", str(port)]
    return [sys.executable, "-m", "edgeproxy", "serve", "--config", str(conf)]


def environment(front: FrontEnd) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(front.pythonpath))


def check_tree(front: FrontEnd, work: Path) -> None:
    """Make sure a process started like the front end's (same environment, same working
    directory) imports edgeproxy from its tree: ``python -m`` puts the working directory
    ahead of PYTHONPATH, so one started inside another checkout would run that one."""
    probe = subprocess.run(
        [sys.executable, "-c", "import edgeproxy; print(edgeproxy.__file__)"],
        env=environment(front),
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    found = Path(probe.stdout.strip() or "?").resolve()
    if not found.is_relative_to(front.pythonpath.resolve()):
        raise RuntimeError(
            f"{front.name}: edgeproxy imports from {found}, not from {front.pythonpath}: "
            f"{probe.stderr.strip()[-300:]}"
        )


def keep_log(front: FrontEnd, log: Path, why: str, out: str, suffix: str = "") -> None:
    """Keep a failed front end's process output in the results, and print its tail."""
    RESULTS.mkdir(exist_ok=True)
    kept = RESULTS / f"{out}.{front.slug}{suffix}.log"
    text = log.read_text(errors="replace") if log.exists() else "(no output)\n"
    kept.write_text(f"# {front.name}: {why}\n{text}")
    print(f"--- {front.name}: {why}; its output ({kept}), last lines:", flush=True)
    print("\n".join(text.splitlines()[-40:]), flush=True)


# -- instructions per request ------------------------------------------------------


@dataclass
class Counted:
    front: str
    kind: str  # "json" or "sse"
    instructions: int
    requests: int
    failed: int
    events: int
    reads: int
    seconds: float
    errors: list[str]

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests if self.requests else math.nan

    @property
    def per_event(self) -> float:
        return self.instructions / self.events if self.events else math.nan


def count_instructions(
    front: FrontEnd, origin: ins.Origin, args: argparse.Namespace
) -> tuple[list[Counted], str]:
    """The JSON and SSE rows of one front end, and what went wrong ("" if nothing)."""
    work = Path(tempfile.mkdtemp(prefix="frontends-"))
    port = ins.free_port()
    conf = config_file(work, front, port, origin.h1, args)
    check_tree(front, work)
    proc = ins.callgrind(command(front, conf, port), environment(front), work)
    drive: Driver = drive_h2 if front.h2_client else drive_h1
    sse = {ins.SSE_HEADER: "1"} if origin.kind == "nginx" else {}
    rows: list[Counted] = []
    problem = ""
    try:
        if not ins.wait_port(port, args.wait, proc):
            problem = f"port {port} never opened (exit code {proc.poll()})"
            return rows, problem
        for kind, body, headers in (
            ("json", ins.BYPASS, {}),
            ("sse", ins.stream_body(args.events), sse),
        ):
            streamed = kind == "sse"
            count = args.sse_count if streamed else args.count
            warmup = args.sse_warmup if streamed else args.warmup
            conc = 2 if streamed else 8
            warm = asyncio.run(drive(port, warmup, body, conc, headers))
            ins.control(proc.pid, "-i", "on")
            started = time.monotonic()
            out = asyncio.run(drive(port, count, body, conc, headers))
            seconds = time.monotonic() - started
            ins.control(proc.pid, "-i", "off")
            total = ins.dump_instructions(proc.pid, work)
            row = Counted(
                front.name,
                kind,
                total,
                count,
                out.failed,
                out.events if streamed else 0,
                out.reads if streamed else 0,
                round(seconds, 2),
                warm.errors + out.errors,
            )
            rows.append(row)
            print(_line(row, warm.failed), flush=True)
            if warm.failed or out.failed:
                problem = problem or (
                    f"{kind}: {warm.failed}/{warmup} warm-up and {out.failed}/{count} counted "
                    f"requests failed"
                )
        return rows, problem
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        problem = _error(exc)
        return rows, problem
    finally:
        u.stop_process(proc)
        if problem:
            keep_log(front, work / "valgrind.log", problem, args.out)
            for row in rows:
                for err in row.errors:
                    print(f"    {row.kind}: {err}", flush=True)
        shutil.rmtree(work, ignore_errors=True)


def _line(row: Counted, warm_failed: int = 0) -> str:
    text = f"{row.front:26} {row.kind:4} {row.per_request / 1000:10,.0f} k/req"
    if row.events:
        text += f"  {row.per_event / 1000:,.1f} k/event"
    return text + f"  ({row.failed} failed, {warm_failed} in warm-up, {row.seconds:g} s)"


# -- streams per process -----------------------------------------------------------


@dataclass
class Streams:
    name: str
    opened: int
    first_events: int
    completed: int
    kib_per_stream: float
    cpu_us_per_event: float
    events: int
    errors: list[str] = field(default_factory=list)
    failed: int = 0


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _hold(
    front: FrontEnd, port: int, n: int, pid: int, body: bytes
) -> tuple[int, int, Outcome, int]:
    """``n`` streams at once; (first events seen, completed, outcome, peak RSS KiB)."""
    url = f"http://{ins.LOOPBACK}:{port}{ins.PATH}"
    headers = {"content-type": "application/json"}
    firsts = completed = 0
    out = Outcome()
    peak = 0

    async def h1(session: aiohttp.ClientSession) -> None:
        nonlocal firsts, completed
        try:
            async with session.post(url, data=body, headers=headers) as r:
                first = True
                async for chunk in r.content.iter_any():
                    if first:
                        first = False
                        firsts += 1
                    out.events += chunk.count(b"data: ")
                if r.status == 200:
                    completed += 1
                else:
                    out.fail(f"HTTP {r.status}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            out.fail(_error(exc))

    async def h2(client: httpx.AsyncClient) -> None:
        nonlocal firsts, completed
        try:
            async with client.stream("POST", url, content=body, headers=headers) as r:
                first = True
                async for chunk in r.aiter_raw():
                    if first:
                        first = False
                        firsts += 1
                    out.events += chunk.count(b"data: ")
                if r.status_code == 200:
                    completed += 1
                else:
                    out.fail(f"HTTP {r.status_code}")
        except httpx.HTTPError as exc:
            out.fail(_error(exc))

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, _rss_kib(pid))
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    timeout = aiohttp.ClientTimeout(total=600)
    try:
        if front.h2_client:
            limits = httpx.Limits(max_connections=max(1, n // 100 + 1))
            async with httpx.AsyncClient(http1=False, http2=True, timeout=600, limits=limits) as c:
                await asyncio.gather(*(h2(c) for _ in range(n)))
        else:
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                await asyncio.gather(*(h1(session) for _ in range(n)))
    finally:
        watcher.cancel()
    return firsts, completed, out, peak


def served_model(origin_url: str) -> str:
    """The model the fake region lists: the proxy learns its list and answers 404 for any
    other."""
    answer = httpx.get(f"{origin_url}/v1/models", timeout=30)
    answer.raise_for_status()
    return str(answer.json()["data"][0]["id"])


def hold_streams(front: FrontEnd, origin_url: str, model: str, args: argparse.Namespace) -> Streams:
    body = ins.stream_body(args.stream_tokens, model)
    work = Path(tempfile.mkdtemp(prefix="frontends-streams-"))
    port = ins.free_port()
    # h2c upstream: the region holds them all on a few connections.
    conf = config_file(work, front, port, origin_url, args, upstream_h2=True)
    check_tree(front, work)
    log = work / "proxy.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            command(front, conf, port),
            env=environment(front),
            stdout=sink,
            stderr=sink,
            cwd=work,
        )
    result = Streams(front.name, args.streams, 0, 0, math.nan, math.nan, 0)
    problem = ""
    try:
        if not ins.wait_port(port, 60, proc):
            problem = f"port {port} never opened (exit code {proc.poll()})"
            result.errors.append(problem)
            return result
        # A few streams first, so the pools and imports are warm before the baseline.
        asyncio.run(_hold(front, port, 4, proc.pid, body))
        base_rss, base_cpu = _rss_kib(proc.pid), _cpu_seconds(proc.pid)
        firsts, completed, out, peak = asyncio.run(_hold(front, port, args.streams, proc.pid, body))
        cpu = _cpu_seconds(proc.pid) - base_cpu
        result = Streams(
            front.name,
            args.streams,
            firsts,
            completed,
            round((peak - base_rss) / args.streams, 1),
            round(cpu / max(out.events, 1) * 1e6, 1),
            out.events,
            out.errors,
            out.failed,
        )
        print(
            f"{front.name:26} {firsts}/{args.streams} first events, {completed} completed  "
            f"{result.kib_per_stream} KiB/stream  {result.cpu_us_per_event} us CPU/event",
            flush=True,
        )
        if out.failed or completed < args.streams:
            problem = f"streams: {completed}/{args.streams} completed, {out.failed} failed"
        return result
    finally:
        u.stop_process(proc)
        if problem:
            keep_log(front, log, problem, args.out, ".streams")
            for err in result.errors:
                print(f"    streams: {err}", flush=True)
        shutil.rmtree(work, ignore_errors=True)


# -- report --------------------------------------------------------------------------


@dataclass
class Summary:
    """One front end's line of the table."""

    name: str
    json_per_request: float = math.nan
    json_ratio: float = math.nan
    sse_per_event: float = math.nan
    sse_ratio: float = math.nan
    kib_per_stream: float = math.nan
    failed: int = 0
    problem: str = ""


def summarise(
    fronts: list[FrontEnd],
    rows: list[Counted],
    streams: list[Streams],
    problems: dict[str, str],
) -> list[Summary]:
    def find(name: str, kind: str) -> Counted | None:
        return next((r for r in rows if r.front == name and r.kind == kind), None)

    base_json, base_sse = find(BASELINE, "json"), find(BASELINE, "sse")
    held = {s.name: s for s in streams}
    out = []
    for front in fronts:
        s = Summary(front.name, problem=problems.get(front.name, ""))
        j, e = find(front.name, "json"), find(front.name, "sse")
        if j:
            s.json_per_request = j.per_request
            s.failed += j.failed
            if base_json and not base_json.failed:
                s.json_ratio = j.per_request / base_json.per_request
        if e:
            s.sse_per_event = e.per_event
            s.failed += e.failed
            if base_sse and not base_sse.failed:
                s.sse_ratio = e.per_event / base_sse.per_event
        if front.name in held:
            s.kib_per_stream = held[front.name].kib_per_stream
            s.failed += held[front.name].failed
        out.append(s)
    return out


def _k(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value / 1000:,.{digits}f} k"


def _x(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def report(summary: list[Summary], streams: list[Streams], trees: dict[str, str]) -> str:
    lines = [
        f"| front end | JSON instructions/request | x {BASELINE} | SSE instructions/event "
        f"| x {BASELINE} | KiB per held stream | failed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        kib = "-" if math.isnan(s.kib_per_stream) else f"{s.kib_per_stream}"
        failed = f"{s.failed}" + (f" ({s.problem})" if s.problem else "")
        lines.append(
            f"| {s.name} | {_k(s.json_per_request, 0)} | {_x(s.json_ratio)} "
            f"| {_k(s.sse_per_event, 1)} | {_x(s.sse_ratio)} | {kib} | {failed} |"
        )
    if streams:
        lines += [
            "",
            f"Held streams ({streams[0].opened} at once); target over HTTP/2: at most "
            f"{TARGET_KIB} KiB per held stream.",
            "",
            "| front end | first events | completed | KiB per held stream | CPU us per event "
            "| target |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for h in streams:
            target = "-"
            if h.completed < h.opened or h.failed:
                target = "no figure: streams failed"
            elif h.name.startswith("edgeproxy h2") and not math.isnan(h.kib_per_stream):
                target = "met" if h.kib_per_stream <= TARGET_KIB else "missed"
            lines.append(
                f"| {h.name} | {h.first_events}/{h.opened} | {h.completed} | "
                f"{h.kib_per_stream} | {h.cpu_us_per_event} | {target} |"
            )
    if trees:
        lines += ["", *(f"* {name}: {where}" for name, where in trees.items())]
    return "\n".join(lines)


def plot(summary: list[Summary], streams: list[Streams], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, (ratios, held) = plt.subplots(
        1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [3, 1.4]}
    )
    names = [s.name for s in summary]
    xs = list(range(len(names)))
    width = 0.38
    for offset, label, values, color in (
        (-width / 2, "per JSON request", [s.json_ratio for s in summary], "tab:blue"),
        (width / 2, "per SSE event", [s.sse_ratio for s in summary], "tab:orange"),
    ):
        heights = [0 if math.isnan(v) else v for v in values]
        bars = ratios.bar([x + offset for x in xs], heights, width, label=label, color=color)
        for bar, value in zip(bars, values, strict=True):
            if not math.isnan(value):
                ratios.annotate(
                    f"{value:.2f}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
    ratios.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ratios.set_xticks(xs, names, rotation=20, ha="right")
    ratios.set_title(f"instructions as a ratio to {BASELINE} (callgrind)")
    ratios.legend()
    held_names = [h.name for h in streams]
    held_values = [0 if math.isnan(h.kib_per_stream) else h.kib_per_stream for h in streams]
    held.bar(held_names, held_values, color="tab:green")
    held.axhline(
        TARGET_KIB, color="tab:red", linewidth=0.8, linestyle="--", label=f"{TARGET_KIB} KiB"
    )
    held.legend(title="HTTP/2 target", fontsize=8)
    held.set_title(f"KiB per held stream ({streams[0].opened if streams else 0} at once)")
    held.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plain(value: object) -> object:
    """``value`` with NaN as null, so that the file is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _revision(tree: Path) -> str:
    """The checkout's commit, and the last one that changed its edgeproxy package (what
    the front ends run)."""

    def log(*extra: str) -> str:
        proc = subprocess.run(
            ["git", "-C", str(tree), "log", "-1", "--format=%h %s", *extra],
            capture_output=True,
            text=True,
            check=False,
        )
        return proc.stdout.strip()[:90]

    head, package = log(), log("--", "edgeproxy")
    if not head:
        return "(not a git checkout)"
    if head.split()[0] == package.split()[0]:
        return head
    return f"{head.split()[0]}; edgeproxy/ as of {package}"


def select(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[FrontEnd]:
    fronts = list(FRONT_ENDS)
    t = TREE_FRONT_END
    fronts += [
        FrontEnd(f"{t.name} ({name})", t.http2, t.server, t.h2_client, t.held, Path(tree).resolve())
        for name, tree in args.trees
    ]
    if args.fronts:
        wanted = {n.lower() for n in args.fronts}
        unknown = wanted - {f.name.lower() for f in fronts}
        if unknown:
            parser.error(
                f"--fronts: unknown {sorted(unknown)}; known: {ALL_NAMES} "
                "(a tree's row needs its --tree NAME=DIR)"
            )
        fronts = [f for f in fronts if f.name.lower() in wanted]
    if importlib.util.find_spec("granian") is None:
        if any(f.server == "granian" for f in fronts):
            print("granian: skipped (not installed)")
        fronts = [f for f in fronts if f.server != "granian"]
    return fronts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run (CI smoke)")
    parser.add_argument("--count", type=int, default=300, help="counted JSON requests")
    parser.add_argument("--warmup", type=int, default=200, help="uncounted JSON requests first")
    parser.add_argument("--sse-count", type=int, default=60, help="counted streamed requests")
    parser.add_argument("--sse-warmup", type=int, default=20, help="uncounted streamed first")
    parser.add_argument("--events", type=int, default=100, help="tokens per streamed answer")
    parser.add_argument("--pace", type=float, default=10.0, help="ms between streamed events")
    parser.add_argument("--streams", type=int, default=500, help="SSE streams held at once")
    parser.add_argument("--stream-tokens", type=int, default=100)
    parser.add_argument("--stream-pace", type=float, default=50.0)
    parser.add_argument("--skip-nginx", action="store_true")
    parser.add_argument("--skip-instr", action="store_true", help="streams per process only")
    parser.add_argument("--skip-streams", action="store_true", help="instructions only")
    parser.add_argument("--wait", type=float, default=240.0)
    parser.add_argument(
        "--h2-max-control-frames",
        type=int,
        metavar="N",
        help="limits.h2_max_control_frames for every front end (default: the proxy's)",
    )
    parser.add_argument(
        "--out",
        default="frontends",
        metavar="NAME",
        help="results as bench/results/NAME.{md,json,png} (default: frontends)",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="another checkout: adds its row 'edgeproxy h2 (NAME)' ('before' unless named); "
        "may be given more than once",
    )
    parser.add_argument(
        "--fronts",
        nargs="+",
        default=[],
        metavar="NAME",
        help=f"run only these rows (quoted): {', '.join(ALL_NAMES)}",
    )
    args = parser.parse_args(argv)
    args.trees = ins.named_trees(parser, args.tree)
    args.keep = False
    if args.quick:
        args.count, args.warmup, args.sse_count, args.sse_warmup = 60, 40, 12, 6
        args.streams = min(args.streams, 200)
    fronts = select(args, parser)
    ins.raise_nofile()
    trees = {"now": f"{ins.ROOT}: {_revision(ins.ROOT)}"}
    for name, tree in args.trees:
        trees[name] = f"{Path(tree).resolve()}: {_revision(Path(tree))}"
    for name, where in trees.items():
        print(f"{name}: {where}")
    started = time.monotonic()
    rows: list[Counted] = []
    problems: dict[str, str] = {}
    upstream = ""
    if args.skip_instr:
        pass
    elif not shutil.which("callgrind_control"):
        print("valgrind is not installed (Debian: apt-get install valgrind): no instructions")
    else:
        with ins.origin_for(args) as origin:
            upstream = origin.describe
            print(f"upstream: {upstream}", flush=True)
            for front in fronts:
                counted, problem = count_instructions(front, origin, args)
                rows += counted
                if problem:
                    problems[front.name] = problem
    streams: list[Streams] = []
    held = [f for f in fronts if f.held]
    if held and not args.skip_streams:
        reason = "the streams test needs a slow, long-lived upstream"
        with ins.fake_origin(args.stream_tokens, args.stream_pace, reason) as slow:
            model = served_model(slow.h1)
            for front in held:
                streams.append(hold_streams(front, slow.h2c, model, args))
                if streams[-1].errors and front.name not in problems:
                    problems[front.name] = f"streams: {streams[-1].errors[0]}"
    summary = summarise(fronts, rows, streams, problems)
    text = report(summary, streams, trees)
    if args.h2_max_control_frames is not None:
        text += f"\n* limits.h2_max_control_frames = {args.h2_max_control_frames} everywhere"
    if upstream:
        text += f"\n* upstream: {upstream}"
    text += f"\n* {len(fronts)} front ends, {time.monotonic() - started:.0f} s"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text(text + "\n")
    data = {
        "settings": {k: v for k, v in vars(args).items() if k != "keep"},
        "trees": trees,
        "upstream": upstream,
        "target_kib_per_held_stream": TARGET_KIB,
        "summary": [asdict(s) for s in summary],
        "instructions": [
            asdict(r) | {"per_request": r.per_request, "per_event": r.per_event} for r in rows
        ],
        "streams": [asdict(s) for s in streams],
        "problems": problems,
    }
    (RESULTS / f"{args.out}.json").write_text(
        json.dumps(_plain(data), indent=2, allow_nan=False) + "\n"
    )
    plot(summary, streams, RESULTS / f"{args.out}.png")
    bad = problems or any(r.failed for r in rows) or any(s.completed < s.opened for s in streams)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
