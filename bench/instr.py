"""Instructions per request, counted by callgrind: the noise-free cost of each proxy.

Wall-clock throughput on a shared 2-core machine swings by tens of percent between
runs; the number of instructions a process executes for the same requests does not.
Each target runs under ``valgrind --tool=callgrind --instr-atstart=no``: the warm-up
requests go uninstrumented, then instrumentation is switched on (``callgrind_control
-i on``), a fixed number of requests is sent, instrumentation goes off, the counters
are dumped, and the total is divided by the request count. Only the proxy process is
counted; the upstream and the client run outside valgrind.

Targets, in one run, against the same upstream (nginx with a canned answer when
installed, else the fake region of ``edgeproxy.testing``):

* ``reference``: ``bench/reference_proxy.py``, a bare aiohttp server + client pool;
* ``h1``: edgeproxy, HTTP/1.1 upstream, cache bypassed (non-deterministic body);
* ``h2c``: edgeproxy, h2c upstream, cache bypassed;
* ``hit``: edgeproxy, memory cache hit (deterministic body);
* ``sse``: edgeproxy, h2c upstream, a streamed answer (``--events`` tokens), counted per
  request and per event.

``--tree DIR`` runs edgeproxy from another checkout as well (``before`` rows), so a
change can be measured against the code before it in the same run::

    git worktree add /tmp/before HEAD~5
    python bench/instr.py --tree /tmp/before --count 300

Needs valgrind (Debian: ``apt-get install valgrind``). Results: the table printed, and
``bench/results/instr.{md,json}``. Everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
LOOPBACK = "127.0.0.1"
PATH = "/v1/chat/completions"
BYPASS = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"temperature":1}'
HIT = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"temperature":0}'


def stream_body(events: int) -> bytes:
    return (
        b'{"model":"m","messages":[{"role":"user","content":"hello there"}],'
        b'"temperature":1,"stream":true,"max_tokens":%d}' % events
    )


@dataclass
class Row:
    name: str
    tree: str
    instructions: float
    requests: int
    failed: int
    events: int = 0

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection((LOOPBACK, port), 0.5).close()
            return True
        except OSError:
            time.sleep(0.3)
    return False


async def drive(port: int, count: int, body: bytes, conc: int) -> tuple[int, int]:
    """Send ``count`` POSTs, ``conc`` at a time; returns (failed, SSE events seen)."""
    headers = {"content-type": "application/json"}
    failed = events = 0
    sem = asyncio.Semaphore(conc)
    url = f"http://{LOOPBACK}:{port}{PATH}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as session:

        async def one() -> None:
            nonlocal failed, events
            async with sem, session.post(url, data=body, headers=headers) as resp:
                data = await resp.read()
                failed += resp.status != 200
                events += data.count(b"\ndata: ") + data.startswith(b"data: ")

        await asyncio.gather(*(one() for _ in range(count)))
    return failed, events


def callgrind(cmd: list[str], env: dict[str, str], work: Path) -> subprocess.Popen[bytes]:
    out = work / "cg.out"
    log = open(work / "valgrind.log", "w")  # closed with the process
    return subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p"]
        + cmd,
        stdout=subprocess.DEVNULL,
        stderr=log,
        env=env,
    )


def control(pid: int, *args: str) -> None:
    subprocess.run(
        ["callgrind_control", *args, str(pid)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=120,
    )


def total_instructions(work: Path) -> int:
    total = 0
    for name in glob.glob(str(work / "cg.out*")):
        with open(name, errors="replace") as f:
            found = (re.match(r"(?:summary|totals):\s+(\d+)", line) for line in f)
            values = [int(m.group(1)) for m in found if m]
        total += max(values, default=0)
    return total


def measure(
    name: str,
    tree: str,
    cmd: list[str],
    env: dict[str, str],
    port: int,
    body: bytes,
    args: argparse.Namespace,
) -> Row:
    work = Path(tempfile.mkdtemp(prefix=f"instr-{name}-"))
    proc = callgrind(cmd, env, work)
    try:
        if not wait_port(port, args.wait):
            raise RuntimeError(f"{name}: port {port} never opened; see {work}/valgrind.log")
        asyncio.run(drive(port, args.warmup, body, args.concurrency))
        control(proc.pid, "-i", "on")
        failed, events = asyncio.run(drive(port, args.count, body, args.concurrency))
        control(proc.pid, "-i", "off")
        control(proc.pid, "-d")
        time.sleep(1.0)  # the dump is written asynchronously
        return Row(name, tree, total_instructions(work), args.count, failed, events)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def proxy_toml(port: int, origin: str, *, http2: bool, cache: bool) -> str:
    text = f"""
[server]
host = "{LOOPBACK}"
port = {port}
grace_period = 1.0

[admin]
enabled = false

[upstream]
http2 = {str(http2).lower()}
max_connections = {8 if http2 else 100}

[[regions]]
name = "origin"
url = "{origin}"

[plugins]
entry_points = false
"""
    if cache:
        text += '\n[cache]\nbackend = "memory"\nxfetch_beta = 0.0\n'
    return text


@contextlib.contextmanager
def upstream(events: int) -> Iterator[str]:
    """The fake region (h2c and HTTP/1.1 on one port), answering ``events`` tokens a stream."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgeproxy.testing",
            "--port",
            str(port),
            "--tokens",
            str(events),
        ],
        stdout=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        if not wait_port(port, 30):
            raise RuntimeError("the fake region did not start")
        yield f"http://{LOOPBACK}:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def run(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    trees = [("now", ROOT)] + ([("before", Path(args.tree).resolve())] if args.tree else [])
    with upstream(args.events) as origin:
        if "reference" in args.only:
            port = free_port()
            cmd = [
                sys.executable,
                str(HERE / "reference_proxy.py"),
                "--port",
                str(port),
                "--upstream",
                origin,
            ]
            rows.append(measure("reference", "-", cmd, dict(os.environ), port, BYPASS, args))
            print(_line(rows[-1], rows[0]), flush=True)
        for tree_name, tree in trees:
            env = dict(os.environ, PYTHONPATH=str(tree))
            for name, http2, cache, body in (
                ("h1", False, False, BYPASS),
                ("h2c", True, False, BYPASS),
                ("hit", False, True, HIT),
                ("sse", True, False, stream_body(args.events)),
            ):
                if name not in args.only:
                    continue
                port = free_port()
                conf = Path(tempfile.mkdtemp(prefix="instr-conf-")) / "edge.toml"
                conf.write_text(proxy_toml(port, origin, http2=http2, cache=cache))
                cmd = [sys.executable, "-m", "edgeproxy", "serve", "--config", str(conf)]
                rows.append(measure(name, tree_name, cmd, env, port, body, args))
                print(_line(rows[-1], rows[0]), flush=True)
    return rows


def _line(row: Row, ref: Row) -> str:
    ratio = row.per_request / ref.per_request if ref.name == "reference" else float("nan")
    return f"{row.name:10} {row.tree:7} {row.per_request / 1000:10,.0f} k/req  x{ratio:.2f}"


def table(rows: list[Row]) -> str:
    ref = next((r for r in rows if r.name == "reference"), None)
    lines = [
        "| target | tree | instructions per request | x reference | per SSE event | failed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = f"{r.per_request / ref.per_request:.2f}" if ref else "-"
        per_event = f"{r.instructions / r.events / 1000:,.1f} k" if r.events > r.requests else "-"
        lines.append(
            f"| {r.name} | {r.tree} | {r.per_request / 1000:,.0f} k | {ratio} | {per_event} "
            f"| {r.failed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=300, help="instrumented requests per target")
    parser.add_argument("--warmup", type=int, default=200, help="uninstrumented requests first")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--events", type=int, default=100, help="tokens per streamed answer")
    parser.add_argument("--tree", help="another checkout of edgeproxy to measure as 'before'")
    parser.add_argument(
        "--only",
        nargs="+",
        default=["reference", "h1", "h2c", "hit", "sse"],
        help="targets to run",
    )
    parser.add_argument("--wait", type=float, default=240.0, help="seconds for a port to open")
    parser.add_argument("--keep", action="store_true", help="keep the callgrind files")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instr: valgrind is not installed (Debian: apt-get install valgrind); skipped")
        return 0
    rows = run(args)
    text = table(rows)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "instr.md").write_text(text + "\n")
    (RESULTS / "instr.json").write_text(
        json.dumps([asdict(r) | {"per_request": r.per_request} for r in rows], indent=2)
    )
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
