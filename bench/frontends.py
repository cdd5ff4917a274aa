"""The front ends side by side: instructions per request and streams per process.

Four ways for a client to reach the same pipeline, each a process of its own, in one run:

* ``aiohttp h1``: ``edgeproxy serve`` with its default HTTP/1.1 listener (aiohttp);
* ``hypercorn h2``: ``edgeproxy serve`` with ``server.http2`` and ``h2c``, an HTTP/2
  client (httpx, prior knowledge);
* ``hypercorn h1``: the same listener, an HTTP/1.1 client;
* ``uvicorn asgi``: ``proxy.asgi`` under uvicorn (httptools, uvloop), an HTTP/1.1 client;
* ``granian h2`` / ``granian h1``: ``proxy.asgi`` under granian's embeddable server (Rust,
  one runtime thread), the candidate HTTP/2 server against hypercorn; skipped without
  granian (``pip install granian``).

**Instructions per request** (callgrind, as in ``bench/instr.py``, whose upstream, pacing
and counting this reuses): a JSON request and a streamed one of ``--events`` events, each
after a warm-up, only the proxy process counted.

**Streams per process** (wall clock, no valgrind): ``--streams`` SSE streams opened at
once against the fake region (``--stream-tokens`` tokens, ``--stream-pace`` ms apart);
reported: how many had their first event (all, when the front end holds them), the
proxy's resident memory per stream at the peak, and its CPU time per relayed event.

Results: printed, and ``bench/results/frontends.{md,json}`` with ``frontends.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _util as u  # noqa: E402
import instr as ins  # noqa: E402

RESULTS = HERE / "results"
Driver = Callable[[int, int, bytes, int, dict[str, str]], Awaitable[tuple[int, int, int]]]


@dataclass
class FrontEnd:
    name: str
    http2: bool  # server.http2 (hypercorn)
    server: str | None  # an ASGI server serving proxy.asgi: "uvicorn", "granian"
    h2_client: bool


FRONT_ENDS = [
    FrontEnd("aiohttp h1", False, None, False),
    FrontEnd("hypercorn h2", True, None, True),
    FrontEnd("hypercorn h1", True, None, False),
    FrontEnd("uvicorn asgi", False, "uvicorn", False),
    FrontEnd("granian h2", False, "granian", True),
    FrontEnd("granian h1", False, "granian", False),
]


async def drive_h2(
    port: int, count: int, body: bytes, conc: int, headers: dict[str, str]
) -> tuple[int, int, int]:
    """:func:`instr.drive` over HTTP/2 (one connection, ``conc`` streams at a time)."""
    headers = {"content-type": "application/json", **headers}
    failed = events = reads = 0
    sem = asyncio.Semaphore(conc)
    url = f"http://{ins.LOOPBACK}:{port}{ins.PATH}"
    async with httpx.AsyncClient(http1=False, http2=True, timeout=300) as client:

        async def one() -> None:
            nonlocal failed, events, reads
            async with sem, client.stream("POST", url, content=body, headers=headers) as resp:
                data = bytearray()
                async for chunk in resp.aiter_raw():
                    data += chunk
                    reads += 1
                failed += resp.status_code != 200
                events += data.count(b"\ndata: ") + data.startswith(b"data: ")

        await asyncio.gather(*(one() for _ in range(count)))
    return failed, events, reads


def config_file(
    work: Path, front: FrontEnd, port: int, origin: str, *, upstream_h2: bool = False
) -> Path:
    text = ins.proxy_toml(port, origin, http2=upstream_h2, cache=False)
    if front.http2:
        text = text.replace("grace_period = 1.0", "grace_period = 1.0\nhttp2 = true\nh2c = true")
    # Thousands of client connections in the streams test (HTTP/1.1: one per stream).
    text += "\n[limits]\nmax_connections = 20000\nmax_connections_per_ip = 0\n"
    path = work / f"{front.name.replace(' ', '-')}.toml"
    path.write_text(text)
    return path


def command(front: FrontEnd, conf: Path, port: int) -> list[str]:
    if front.server is not None:
        script = HERE / f"_{'asgi' if front.server == 'uvicorn' else 'granian'}_serve.py"
        return [sys.executable, str(script), "--config", str(conf), "--port", str(port)]
    return [sys.executable, "-m", "edgeproxy", "serve", "--config", str(conf)]


# -- instructions per request ------------------------------------------------------


def count_instructions(
    front: FrontEnd, origin: ins.Origin, args: argparse.Namespace
) -> list[ins.Row]:
    work = Path(tempfile.mkdtemp(prefix="frontends-"))
    port = ins.free_port()
    conf = config_file(work, front, port, origin.h1)
    env = dict(os.environ, PYTHONPATH=str(ins.ROOT))
    proc = ins.callgrind(command(front, conf, port), env, work)
    drive: Driver = drive_h2 if front.h2_client else ins.drive
    sse = {ins.SSE_HEADER: "1"} if origin.kind == "nginx" else {}
    rows = []
    try:
        if not ins.wait_port(port, args.wait, proc):
            raise RuntimeError(f"{front.name}: port {port} never opened")
        for row, body, streamed, headers in (
            (front.name, ins.BYPASS, False, {}),
            (f"{front.name} sse", ins.stream_body(args.events), True, sse),
        ):
            count = args.sse_count if streamed else args.count
            warmup = args.sse_warmup if streamed else args.warmup
            conc = 2 if streamed else 8
            asyncio.run(drive(port, warmup, body, conc, headers))
            ins.control(proc.pid, "-i", "on")
            started = time.monotonic()
            failed, events, reads = asyncio.run(drive(port, count, body, conc, headers))
            seconds = time.monotonic() - started
            ins.control(proc.pid, "-i", "off")
            total = ins.dump_instructions(proc.pid, work)
            result = ins.Row(
                row,
                front.name,
                "now",
                total,
                count,
                failed,
                events if streamed else 0,
                reads if streamed else 0,
                round(seconds, 2),
            )
            rows.append(result)
            print(ins._line(result), flush=True)
        return rows
    finally:
        u.stop_process(proc)
        shutil.rmtree(work, ignore_errors=True)


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


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _hold(front: FrontEnd, port: int, n: int, pid: int) -> tuple[int, int, int, int]:
    """``n`` streams at once; (first events seen, completed, events, peak RSS KiB)."""
    url = f"http://{ins.LOOPBACK}:{port}{ins.PATH}"
    body = ins.stream_body(10)
    firsts = completed = events = 0
    peak = 0
    all_first = asyncio.Event()

    async def on_first() -> None:
        nonlocal firsts
        firsts += 1
        if firsts == n:
            all_first.set()

    async def h1(session: aiohttp.ClientSession) -> None:
        nonlocal completed, events
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
            first = True
            async for chunk in r.content.iter_any():
                if first:
                    first = False
                    await on_first()
                events += chunk.count(b"data: ")
            completed += r.status == 200

    async def h2(client: httpx.AsyncClient) -> None:
        nonlocal completed, events
        headers = {"content-type": "application/json"}
        async with client.stream("POST", url, content=body, headers=headers) as r:
            first = True
            async for chunk in r.aiter_raw():
                if first:
                    first = False
                    await on_first()
                events += chunk.count(b"data: ")
            completed += r.status_code == 200

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
    return firsts, completed, events, peak


def hold_streams(front: FrontEnd, origin_url: str, args: argparse.Namespace) -> Streams:
    work = Path(tempfile.mkdtemp(prefix="frontends-streams-"))
    port = ins.free_port()
    # h2c upstream: the region holds them all on a few connections.
    conf = config_file(work, front, port, origin_url, upstream_h2=True)
    env = dict(os.environ, PYTHONPATH=str(ins.ROOT))
    proc = subprocess.Popen(command(front, conf, port), env=env, stdout=subprocess.DEVNULL)
    try:
        if not ins.wait_port(port, 60, proc):
            raise RuntimeError(f"{front.name}: port {port} never opened")
        # A few streams first, so the pools and imports are warm before the baseline.
        asyncio.run(_hold(front, port, 4, proc.pid))
        base_rss, base_cpu = _rss_kib(proc.pid), _cpu_seconds(proc.pid)
        firsts, completed, events, peak = asyncio.run(_hold(front, port, args.streams, proc.pid))
        cpu = _cpu_seconds(proc.pid) - base_cpu
        result = Streams(
            front.name,
            args.streams,
            firsts,
            completed,
            round((peak - base_rss) / args.streams, 1),
            round(cpu / max(events, 1) * 1e6, 1),
            events,
        )
        print(
            f"{front.name:14} {completed}/{args.streams} streams  "
            f"{result.kib_per_stream} KiB/stream  {result.cpu_us_per_event} us CPU/event",
            flush=True,
        )
        return result
    finally:
        u.stop_process(proc)
        shutil.rmtree(work, ignore_errors=True)


# -- report --------------------------------------------------------------------------


def report(rows: list[ins.Row], streams: list[Streams]) -> str:
    base = {r.name.removeprefix("aiohttp h1"): r for r in rows if r.process == "aiohttp h1"}
    lines = [
        "| front end | request | instructions/req | x aiohttp h1 | per SSE event |",
        "|---|---|---:|---:|---:|",
    ]
    for row in rows:
        kind = "sse" if row.name.endswith("sse") else "json"
        ref = base.get(" sse" if kind == "sse" else "")
        ratio = row.per_request / ref.per_request if ref else float("nan")
        event = f"{row.per_event / 1000:,.1f} k" if row.events else "-"
        lines.append(
            f"| {row.process} | {kind} | {row.per_request / 1000:,.0f} k | {ratio:.2f} | {event} |"
        )
    lines += [
        "",
        "| front end | streams held at once | completed | KiB per stream | CPU us per event |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in streams:
        lines.append(
            f"| {s.name} | {s.first_events}/{s.opened} | {s.completed} | {s.kib_per_stream} | "
            f"{s.cpu_us_per_event} |"
        )
    return "\n".join(lines)


def plot(rows: list[ins.Row], streams: list[Streams], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = [s.name for s in streams]
    json_rows = {r.process: r.per_request / 1000 for r in rows if not r.name.endswith("sse")}
    sse_rows = {r.process: r.per_event / 1000 for r in rows if r.name.endswith("sse")}
    axes[0].bar(names, [json_rows.get(n, 0) for n in names], color="tab:blue")
    axes[0].set_title("instructions per JSON request (k)")
    axes[1].bar(names, [sse_rows.get(n, 0) for n in names], color="tab:orange")
    axes[1].set_title("instructions per SSE event (k)")
    by_name = {s.name: s for s in streams}
    axes[2].bar(names, [by_name[n].kib_per_stream if n in by_name else 0 for n in names])
    axes[2].set_title(f"KiB per held stream ({streams[0].opened if streams else 0} at once)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run (CI smoke)")
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--sse-count", type=int, default=60)
    parser.add_argument("--sse-warmup", type=int, default=20)
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--pace", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--stream-tokens", type=int, default=100)
    parser.add_argument("--stream-pace", type=float, default=50.0)
    parser.add_argument("--skip-nginx", action="store_true")
    parser.add_argument("--skip-instr", action="store_true", help="streams per process only")
    parser.add_argument("--wait", type=float, default=240.0)
    args = parser.parse_args(argv)
    args.keep = False
    if args.quick:
        args.count, args.warmup, args.sse_count, args.sse_warmup = 60, 40, 12, 6
        args.streams = min(args.streams, 200)
    ins.raise_nofile()
    fronts = FRONT_ENDS
    if importlib.util.find_spec("granian") is None:
        print("granian: skipped (not installed)")
        fronts = [f for f in fronts if f.server != "granian"]
    started = time.monotonic()
    rows: list[ins.Row] = []
    if not args.skip_instr and shutil.which("callgrind_control"):
        with ins.origin_for(args) as origin:
            print(f"upstream: {origin.describe}")
            for front in fronts:
                rows += count_instructions(front, origin, args)
    streams: list[Streams] = []
    reason = "the streams test needs a slow, long-lived upstream"
    with ins.fake_origin(args.stream_tokens, args.stream_pace, reason) as slow:
        for front in fronts:
            streams.append(hold_streams(front, slow.h2c, args))
    text = report(rows, streams)
    print(text)
    print(f"({time.monotonic() - started:.0f} s)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "frontends.md").write_text(text + "\n")
    data = {
        "settings": vars(args),
        "instructions": [asdict(r) | {"per_request": r.per_request} for r in rows],
        "streams": [asdict(s) for s in streams],
    }
    (RESULTS / "frontends.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(rows, streams, RESULTS / "frontends.png")
    return 1 if any(r.failed for r in rows) or any(s.completed < s.opened for s in streams) else 0


if __name__ == "__main__":
    sys.exit(main())
