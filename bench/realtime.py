"""WebSocket sessions (the Realtime API) through edgeproxy, next to a bare aiohttp relay.

Every server is its own process: the region, an aiohttp WebSocket server that sends a
``session.created`` on connect and echoes every message; the **bare relay** (the
baseline, in this file: ``--serve bare``), an aiohttp server that accepts the client,
opens the same path at the region with an aiohttp client and runs two pump loops, and
nothing else (no routing, metering, pings, limits); and ``edgeproxy serve`` on its
aiohttp listener, one region with ``serves_any_model``. The driver (this process) is the
client. With two CPUs or more the relay under test gets one to itself and the driver
and the region share another (``taskset``), so the relays' CPU is theirs alone.

No hop compresses: the clients offer no permessage-deflate, and the region declines
edgeproxy's offer (``[websocket] compression`` is left at its default). Events: ``small``
is a ``conversation.item.create`` of 183 bytes; ``audio`` an ``input_audio_buffer.append``
carrying 8 KiB of base64 (6 KiB of audio: 128 ms of 24 kHz PCM16). The region answers
each with the same bytes.

1. **Added latency per message**: round trips of the small event (send, wait for the
   echo) direct to the region, through the bare relay and through edgeproxy
   (``/v1/realtime``): one session in sequential ping-pong, then ``--concurrent``
   sessions at once, each in ping-pong. The paths take turns in blocks, after a warm-up,
   so a slow phase of a shared machine hits them alike. p50/p99 per path, the difference
   to direct and the ratio.
2. **CPU per relayed message**: ``--cpu-sessions`` sessions in ping-pong through each
   relay, the relays taking turns for ``--rounds`` rounds; the relay process's CPU time
   (``/proc/PID/task/*/schedstat``) over the messages it relayed (each round trip is two:
   one each way). The median round, the range, and the ratio to the bare relay. Rows:
   the bare relay, edgeproxy on ``/v1/realtime`` (events metered: each client event is
   parsed, each region event's type read) and edgeproxy on a plain WebSocket route
   (``websocket = "any"``, ``/ws/...``: relayed as they are). CPU time includes the
   kernel's work on the relay's sockets, the same for every relay, so its ratios are
   smaller than those of 4., which counts the process's own instructions. edgeproxy
   freezes the GC and raises its young-generation threshold at start; the bare relay runs
   with Python's defaults.
3. **Memory per open session**: on fresh relay processes, after a warm-up, the resident
   set (``VmRSS``), then ``--sessions`` idle sessions opened through the relay (each
   with its ``session.created`` and one round trip) and the resident set again; the
   difference over the sessions, for the relay and (a fresh process for each row) the
   region; the ``direct`` row is the region alone, the floor of one aiohttp WebSocket.
4. With ``--callgrind`` (on by default, off with ``--quick``): instructions per relayed
   message, counted by callgrind as ``bench/instr.py`` does, for the same rows as 2.:
   four sessions in ping-pong, a warm-up, then instrumentation on for the counted round
   trips only, the relay process alone under valgrind.

Results: the tables printed, ``bench/results/realtime.{md,json}`` and ``realtime.png``
(``--out NAME`` for other names; no PNG without matplotlib). Everything talks to
127.0.0.1; every process started is stopped at the end, on errors too.

    python bench/realtime.py --quick     # about 25 s, no callgrind
    python bench/realtime.py             # 2 to 3 minutes, callgrind included
    python bench/realtime.py --only cpu --no-callgrind --rounds 5

``others' CPU`` columns are the cores busy outside the benchmark meanwhile (``_util.
CpuMeter``), marked (!) over 0.2: on a shared machine a p99 or a CPU figure taken then is
suspect. ``--no-pin`` leaves every process unpinned.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _realtime_report  # noqa: E402
import _util as u  # noqa: E402
import instr  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "results"
LOOPBACK = u.LOOPBACK
MODEL = "gpt-realtime-bench"
REALTIME = f"/v1/realtime?model={MODEL}"
PLAIN = "/ws/echo"
MAX_MESSAGE = 16 * 1024 * 1024
SMALL = json.dumps(
    {
        "type": "conversation.item.create",
        "event_id": "evt_bench_0000000001",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "What is the weather in Lisbon?"}],
        },
    },
    separators=(",", ":"),
)
AUDIO = json.dumps(
    {
        "type": "input_audio_buffer.append",
        "event_id": "evt_bench_0000000002",
        "audio": base64.b64encode(bytes(range(256)) * 24).decode(),  # 6 KiB -> 8 KiB
    },
    separators=(",", ":"),
)
EVENTS = {"small": SMALL, "audio": AUDIO}
BARE = "bare relay"
EDGE = "edgeproxy"
EDGE_PLAIN = "edgeproxy, plain route"
DIRECT = "direct"
PHASE_LIMIT_S = 900.0


# -- the servers (run as ``--serve region|bare``) ------------------------------------


async def _region_session(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(
        protocols=("realtime",), compress=False, max_msg_size=MAX_MESSAGE, autoping=True
    )
    await ws.prepare(request)
    model = request.query.get("model", "")
    await ws.send_str(
        '{"type":"session.created","event_id":"evt_region_0","session":{"id":"sess_bench",'
        f'"object":"realtime.session","model":"{model}"}}}}'
    )
    async for msg in ws:
        if msg.type is WSMsgType.TEXT:
            await ws.send_str(msg.data)
        elif msg.type is WSMsgType.BINARY:
            await ws.send_bytes(msg.data)
    return ws


UPSTREAM = web.AppKey("upstream", str)
CLIENT = web.AppKey("client", aiohttp.ClientSession)


async def _pump(
    source: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
    sink: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
) -> None:
    async for msg in source:
        if msg.type is WSMsgType.TEXT:
            await sink.send_str(msg.data)
        elif msg.type is WSMsgType.BINARY:
            await sink.send_bytes(msg.data)
        else:
            return


async def _bare_session(request: web.Request) -> web.WebSocketResponse:
    """The baseline: the client's handshake waits for the region's, then two pumps."""
    offered = request.headers.get("Sec-WebSocket-Protocol", "")
    protocols = tuple(p.strip() for p in offered.split(",") if p.strip())
    region = await request.app[CLIENT].ws_connect(
        request.app[UPSTREAM] + request.raw_path,
        protocols=protocols,
        max_msg_size=MAX_MESSAGE,
        autoping=True,
    )
    ws = web.WebSocketResponse(
        protocols=(region.protocol,) if region.protocol else (),
        compress=False,
        max_msg_size=MAX_MESSAGE,
        autoping=True,
    )
    await ws.prepare(request)
    pumps = [asyncio.create_task(_pump(ws, region)), asyncio.create_task(_pump(region, ws))]
    try:
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await region.close()
        await ws.close()
    return ws


async def _serve(kind: str, port: int, upstream: str) -> None:
    app = web.Application()
    if kind == "bare":
        app[UPSTREAM] = "ws" + upstream[4:] if upstream.startswith("http") else upstream

        async def client_ctx(app: web.Application) -> Any:
            # One connection per session, never pooled: a WebSocket keeps its connection.
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=connector) as client:
                app[CLIENT] = client
                yield

        app.cleanup_ctx.append(client_ctx)
        app.router.add_get("/{tail:.*}", _bare_session)
    else:
        app.router.add_get("/{tail:.*}", _region_session)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, port, backlog=4096).start()
    print(f"{kind} listening on {port}", flush=True)
    await asyncio.Event().wait()  # until SIGTERM (its default action ends the process)


# -- the client ---------------------------------------------------------------------


async def open_session(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientWebSocketResponse:
    ws = await http.ws_connect(url, protocols=("realtime",), max_msg_size=MAX_MESSAGE)
    first = await ws.receive()
    if first.type is not WSMsgType.TEXT or "session.created" not in first.data:
        await ws.close()
        raise RuntimeError(f"{url}: no session.created but {first.type.name} {first.data!r}")
    return ws


async def ping_pong(
    ws: aiohttp.ClientWebSocketResponse, event: str, count: int, out: list[int] | None = None
) -> None:
    clock = time.perf_counter_ns
    for _ in range(count):
        start = clock()
        await ws.send_str(event)
        msg = await ws.receive()
        if out is not None:
            out.append(clock() - start)
        if msg.type is not WSMsgType.TEXT or len(msg.data) != len(event):
            raise RuntimeError(f"expected the echo, got {msg.type.name} {str(msg.data)[:80]!r}")


@contextlib.asynccontextmanager
async def sessions(http: aiohttp.ClientSession, url: str, n: int, ramp: int = 50) -> Any:
    """``n`` sessions at ``url``, ``ramp`` at most opening at once; closed on exit."""
    opened: list[aiohttp.ClientWebSocketResponse] = []
    gate = asyncio.Semaphore(ramp)

    async def one() -> None:
        async with gate:
            ws = await open_session(http, url)
            opened.append(ws)
            await ping_pong(ws, SMALL, 1)

    try:
        results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise RuntimeError(f"{len(failed)} of {n} sessions at {url} failed: {failed[0]!r}")
        yield opened
    finally:
        await asyncio.gather(*(ws.close() for ws in opened), return_exceptions=True)


def client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


# -- measuring processes ------------------------------------------------------------


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in ns (schedstat: no 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


async def rss_median(pid: int, samples: int = 5) -> int:
    values = []
    for _ in range(samples):
        values.append(rss_kib(pid))
        await asyncio.sleep(0.2)
    return int(statistics.median(values))


def proxy_toml(port: int, region: str, sessions: int) -> str:
    cap = sessions + 1000
    return f"""
[server]
host = "{LOOPBACK}"
port = {port}
grace_period = 1.0
backlog = 4096

[limits]
max_connections = {cap}
max_connections_per_ip = 0

[admin]
enabled = false

[websocket]
max_sessions = {cap}
max_sessions_per_ip = 0

[health]
max_concurrent = {cap}
max_pending = {cap}

# The region speaks HTTP/1.1 only: no HTTP/2 probe at start.
[upstream]
http2 = false

[[regions]]
name = "region"
url = "{region}"
serves_any_model = true

[[routes]]
name = "plain"
path = "/ws"
websocket = "any"

[[routes]]
name = "api"
path = "/"

[plugins]
entry_points = false
"""


@dataclass
class Rig:
    """The processes of a run, each stopped by its own pid when the rig closes."""

    work: Path
    pin: u.Pinning
    sessions: int
    services: dict[str, u.Service] = field(default_factory=dict)
    others: list[subprocess.Popen[bytes]] = field(default_factory=list)  # under callgrind
    ports: dict[str, int] = field(default_factory=dict)

    def start(
        self, name: str, argv: Callable[[int], list[str]], prefix: list[str], timeout: float = 60
    ) -> None:
        old = self.services.pop(name, None)
        if old is not None:
            old.stop()
        port = self.ports.setdefault(name, u.free_port())
        log = self.work / f"{name.replace(' ', '-').replace(',', '')}.log"
        svc = u.Service(name, [*prefix, *argv(port)], log, cwd=ROOT).start()
        self.services[name] = svc
        if not instr.wait_port(port, timeout, svc.proc):
            raise u.ServiceError(f"{name} did not listen on {port}:\n{svc.log_tail()}")

    def start_region(self) -> None:
        here = str(HERE / "realtime.py")
        argv = [sys.executable, here, "--serve", "region", "--port"]
        self.start(DIRECT, lambda port: [*argv, str(port)], self.pin.origin_prefix())

    def start_relays(self) -> None:
        region = f"http://{LOOPBACK}:{self.ports[DIRECT]}"
        for name in (BARE, EDGE):
            argv = functools.partial(self.relay_argv, name, region)
            self.start(name, argv, self.pin.sut_prefix())

    def relay_argv(self, name: str, region: str, port: int) -> list[str]:
        if name == BARE:
            here = str(HERE / "realtime.py")
            return [
                sys.executable,
                here,
                "--serve",
                "bare",
                "--port",
                str(port),
                "--upstream",
                region,
            ]
        conf = self.work / f"edgeproxy-{port}.toml"
        conf.write_text(proxy_toml(port, region, self.sessions))
        return [sys.executable, "-m", "edgeproxy", "serve", "--config", str(conf)]

    def pid(self, name: str) -> int:
        svc = self.services[name]
        assert svc.proc is not None
        svc.check_alive()
        return svc.proc.pid

    def url(self, name: str, path: str = REALTIME) -> str:
        port = self.ports[EDGE if name == EDGE_PLAIN else name]
        return f"ws://{LOOPBACK}:{port}{path if name != EDGE_PLAIN else PLAIN}"

    def close(self) -> None:
        """Stop every process started, each by its own pid (idempotent)."""
        for proc in self.others:
            with contextlib.suppress(Exception):
                u.stop_process(proc, timeout=10)
        self.others.clear()
        for svc in reversed(list(self.services.values())):
            with contextlib.suppress(Exception):
                svc.stop(timeout=5)
        self.services.clear()


# -- 3. memory per session ----------------------------------------------------------


async def measure_memory(rig: Rig, n: int) -> list[dict[str, Any]]:
    rows = []
    for name in (DIRECT, BARE, EDGE):
        rig.start_region()  # fresh: its heap holds nothing of the row before
        pid_region = rig.pid(DIRECT)
        pid_relay = rig.pid(name)
        async with client() as http:
            async with sessions(http, rig.url(name), 20) as warm:
                await asyncio.gather(*(ping_pong(ws, AUDIO, 3) for ws in warm))
            await asyncio.sleep(1.0)
            relay0, region0 = await rss_median(pid_relay), rss_kib(pid_region)
            start = time.monotonic()
            async with sessions(http, rig.url(name), n):
                opened_s = time.monotonic() - start
                await asyncio.sleep(1.0)
                relay1, region1 = await rss_median(pid_relay), rss_kib(pid_region)
        row = {
            "path": name,
            "sessions": n,
            "open_s": round(opened_s, 2),
            "relay_rss_before_kib": relay0,
            "relay_rss_with_n_kib": relay1,
            "relay_kib_per_session": (relay1 - relay0) / n,
            "region_kib_per_session": (region1 - region0) / n,
        }
        rows.append(row)
        print(
            f"memory {name:12} {n:,} sessions: {row['relay_kib_per_session']:6.1f} KiB a "
            f"session ({relay0 / 1024:.1f} -> {relay1 / 1024:.1f} MiB), region "
            f"{row['region_kib_per_session']:.1f} KiB",
            flush=True,
        )
    return rows


# -- 1. added latency ---------------------------------------------------------------


async def measure_latency(rig: Rig, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    paths = (DIRECT, BARE, EDGE)
    async with client() as http:
        for conc in (1, args.concurrent):
            per_session = max(1, args.messages // conc)
            block = max(1, min(per_session, args.block // conc))
            opened = {p: [await open_session(http, rig.url(p)) for _ in range(conc)] for p in paths}
            try:
                for p in paths:
                    await asyncio.gather(*(ping_pong(ws, SMALL, args.warmup) for ws in opened[p]))
                lat: dict[str, list[int]] = {p: [] for p in paths}
                done = 0
                turn = 0
                with u.CpuMeter([rig.pid(p) for p in paths]) as meter:
                    while done < per_session:
                        step = min(block, per_session - done)
                        for p in paths[turn % 3 :] + paths[: turn % 3]:
                            await asyncio.gather(
                                *(ping_pong(ws, SMALL, step, lat[p]) for ws in opened[p])
                            )
                        done += step
                        turn += 1
            finally:
                for p in paths:
                    await asyncio.gather(*(ws.close() for ws in opened[p]), return_exceptions=True)
            floor = summary_us(lat[DIRECT])
            for p in paths:
                s = summary_us(lat[p])
                rows.append(
                    {
                        "path": p,
                        "sessions": conc,
                        "messages": len(lat[p]),
                        **s,
                        "added_p50_us": s["p50_us"] - floor["p50_us"],
                        "added_p99_us": s["p99_us"] - floor["p99_us"],
                        "x_direct_p50": s["p50_us"] / floor["p50_us"],
                        "x_direct_p99": s["p99_us"] / floor["p99_us"],
                        "foreign_cores": meter.foreign_cores,
                    }
                )
                print(
                    f"latency {p:12} {conc} session(s): p50 {s['p50_us']:7.1f} us, p99 "
                    f"{s['p99_us']:7.1f} us",
                    flush=True,
                )
    return rows


def summary_us(values_ns: list[int]) -> dict[str, float]:
    ordered = sorted(values_ns)
    return {
        "p50_us": u.percentile(ordered, 50) / 1000,
        "p90_us": u.percentile(ordered, 90) / 1000,
        "p99_us": u.percentile(ordered, 99) / 1000,
        "max_us": ordered[-1] / 1000,
    }


# -- 2. CPU per relayed message -----------------------------------------------------


async def measure_cpu(rig: Rig, args: argparse.Namespace) -> list[dict[str, Any]]:
    relays = (BARE, EDGE, EDGE_PLAIN)
    counts = {"small": args.cpu_messages, "audio": max(1, args.cpu_messages // 4)}
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    async with client() as http:
        opened = {}
        for r in relays:
            opened[r] = [await open_session(http, rig.url(r)) for _ in range(args.cpu_sessions)]
        try:
            for r in relays:
                for ev in EVENTS.values():
                    await asyncio.gather(*(ping_pong(ws, ev, 30) for ws in opened[r]))
            for rnd in range(args.rounds):
                for kind, event in EVENTS.items():
                    per_session = max(1, counts[kind] // args.cpu_sessions)
                    order = relays[rnd % 3 :] + relays[: rnd % 3]
                    for r in order:
                        pid = rig.pid(EDGE if r == EDGE_PLAIN else r)
                        meter = u.CpuMeter([pid, rig.pid(DIRECT)], [pid])
                        start, t0 = cpu_ns(pid), time.monotonic()
                        with meter:
                            await asyncio.gather(
                                *(ping_pong(ws, event, per_session) for ws in opened[r])
                            )
                        wall, used = time.monotonic() - t0, cpu_ns(pid) - start
                        relayed = 2 * per_session * args.cpu_sessions
                        runs.setdefault((r, kind), []).append(
                            {
                                "messages": relayed,
                                "cpu_us_per_message": used / 1000 / relayed,
                                "relay_cores": used / 1e9 / wall,
                                "messages_per_s": relayed / wall,
                                "foreign_cores": meter.foreign_cores,
                            }
                        )
        finally:
            for r in relays:
                await asyncio.gather(*(ws.close() for ws in opened[r]), return_exceptions=True)
    rows: list[dict[str, Any]] = []
    for kind in EVENTS:
        for r in relays:
            got = runs[(r, kind)]
            per = sorted(x["cpu_us_per_message"] for x in got)
            rows.append(
                {
                    "relay": r,
                    "event": kind,
                    "event_bytes": len(EVENTS[kind]),
                    "messages_per_round": int(got[0]["messages"]),
                    "rounds": len(got),
                    "cpu_us_per_message": statistics.median(per),
                    "cpu_us_min": per[0],
                    "cpu_us_max": per[-1],
                    "relay_cores": statistics.median(x["relay_cores"] for x in got),
                    "messages_per_s": statistics.median(x["messages_per_s"] for x in got),
                    "foreign_cores": max(x["foreign_cores"] for x in got),
                    "runs": got,
                }
            )
    for row in rows:
        bare = next(x for x in rows if x["relay"] == BARE and x["event"] == row["event"])
        row["x_bare"] = row["cpu_us_per_message"] / bare["cpu_us_per_message"]
        print(
            f"cpu {row['relay']:22} {row['event']:5}: {row['cpu_us_per_message']:6.1f} us a "
            f"message ({row['x_bare']:.2f}x bare)",
            flush=True,
        )
    return rows


# -- 4. instructions per relayed message (callgrind) ---------------------------------


async def measure_instructions(rig: Rig, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    region = f"http://{LOOPBACK}:{rig.ports[DIRECT]}"
    counts = {"small": args.cg_messages, "audio": max(1, args.cg_messages // 4)}
    for name in (BARE, EDGE):
        cg = rig.work / f"cg-{name.replace(' ', '-')}"
        cg.mkdir()
        port = u.free_port()
        proc = instr.callgrind(rig.relay_argv(name, region, port), dict(os.environ), cg)
        rig.others.append(proc)
        if rig.pin.sut:
            # Pinned from outside: valgrind would run a taskset prefix, not what it execs.
            os.sched_setaffinity(proc.pid, rig.pin.sut)
        try:
            if not await asyncio.to_thread(instr.wait_port, port, args.wait, proc):
                raise RuntimeError(f"{name} did not start under callgrind (log in {cg})")
            paths = [(name, REALTIME)] + ([(EDGE_PLAIN, PLAIN)] if name == EDGE else [])
            async with client() as http:
                for row_name, path in paths:
                    url = f"ws://{LOOPBACK}:{port}{path}"
                    opened = [await open_session(http, url) for _ in range(4)]
                    try:
                        for kind, event in EVENTS.items():
                            await asyncio.gather(*(ping_pong(ws, event, 20) for ws in opened))
                            per_session = max(1, counts[kind] // len(opened))
                            await asyncio.to_thread(instr.control, proc.pid, "-i", "on")
                            await asyncio.gather(
                                *(ping_pong(ws, event, per_session) for ws in opened)
                            )
                            await asyncio.to_thread(instr.control, proc.pid, "-i", "off")
                            total = await asyncio.to_thread(instr.dump_instructions, proc.pid, cg)
                            relayed = 2 * per_session * len(opened)
                            rows.append(
                                {
                                    "relay": row_name,
                                    "event": kind,
                                    "messages": relayed,
                                    "instructions": total,
                                    "per_message": total / relayed,
                                }
                            )
                            print(
                                f"callgrind {row_name:22} {kind:5}: "
                                f"{total / relayed / 1000:,.1f} k instructions a message",
                                flush=True,
                            )
                    finally:
                        await asyncio.gather(*(ws.close() for ws in opened), return_exceptions=True)
        finally:
            u.stop_process(proc)
    for row in rows:
        bare = next((x for x in rows if x["relay"] == BARE and x["event"] == row["event"]), None)
        row["x_bare"] = row["per_message"] / bare["per_message"] if bare else None
    return rows


# -- main ---------------------------------------------------------------------------

# flag: (default, --quick, help)
SIZES = {
    "messages": (20_000, 2000, "round trips a path (1.)"),
    "concurrent": (4, 4, "sessions at once (1.)"),
    "block": (500, 250, "round trips a turn (1.)"),
    "warmup": (200, 100, "uncounted round trips first (1.)"),
    "cpu-messages": (20_000, 4000, "small-event round trips a round, a quarter of that audio (2.)"),
    "cpu-sessions": (8, 8, "sessions at once (2.)"),
    "rounds": (3, 2, "rounds (2.)"),
    "sessions": (1000, 200, "idle sessions held (3.)"),
    "cg-messages": (2000, 400, "small-event round trips counted, a quarter of that audio (4.)"),
}


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _dirty() -> bool:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "edgeproxy"],
        capture_output=True,
        text=True,
        check=False,
    )
    return bool(out.stdout.strip())


async def run(args: argparse.Namespace, rig: Rig) -> dict[str, Any]:
    data: dict[str, Any] = {"latency": [], "cpu": [], "memory": [], "instructions": []}
    notes: list[str] = []
    phases: list[tuple[str, Callable[[], Awaitable[list[dict[str, Any]]]]]] = []
    rig.start_region()
    rig.start_relays()
    if "memory" in args.only:
        phases.append(("memory", lambda: measure_memory(rig, args.sessions)))
    if "latency" in args.only:
        phases.append(("latency", lambda: measure_latency(rig, args)))
    if "cpu" in args.only:
        phases.append(("cpu", lambda: measure_cpu(rig, args)))
    if args.callgrind and shutil.which("callgrind_control") is None:
        notes.append("instructions: skipped (valgrind is not installed)")
    elif args.callgrind:
        phases.append(("instructions", lambda: measure_instructions(rig, args)))
    else:
        notes.append("instructions: not counted (--callgrind to count them)")
    for name, phase in phases:
        try:
            # Bounded: a relay that stops answering must not hold the run (or its processes).
            async with asyncio.timeout(PHASE_LIMIT_S):
                data[name] = await phase()
        except (RuntimeError, OSError, aiohttp.ClientError, u.ServiceError) as exc:
            notes.append(f"{name}: failed ({exc!r:.300})")
            print(notes[-1], flush=True)
    data["notes"] = notes
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    for flag, (full, quick, text) in SIZES.items():
        parser.add_argument(f"--{flag}", type=int, help=f"{text} ({full:,}; --quick {quick:,})")
    parser.add_argument(
        "--callgrind",
        action=argparse.BooleanOptionalAction,
        help="count instructions per message under callgrind (4.; default: not with --quick)",
    )
    parser.add_argument("--wait", type=float, default=240.0, help="seconds to start (4.)")
    parser.add_argument(
        "--only",
        nargs="+",
        default=["latency", "cpu", "memory"],
        choices=["latency", "cpu", "memory"],
        help="the wall-clock parts to run (1. latency, 2. cpu, 3. memory; default all)",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the relay under test on a CPU of its own (default), the rest on another",
    )
    parser.add_argument("--out", default="realtime", metavar="NAME", help="bench/results/NAME.*")
    parser.add_argument("--keep", action="store_true", help="keep the logs and configs")
    parser.add_argument("--serve", choices=["region", "bare"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import uvloop

    if args.serve:
        uvloop.run(_serve(args.serve, args.port, args.upstream))
        return 0
    for flag, sizes in SIZES.items():
        if getattr(args, flag.replace("-", "_")) is None:
            setattr(args, flag.replace("-", "_"), sizes[1] if args.quick else sizes[0])
    if args.callgrind is None:
        args.callgrind = not args.quick
    signal.signal(signal.SIGTERM, _exit_on_signal)
    instr.raise_nofile()
    pin = u.plan_pinning(None, None) if args.pin else u.Pinning((), ())
    if pin.harness:
        os.sched_setaffinity(0, pin.harness)  # the driver is the load: away from the relay
    started = time.monotonic()
    rig = Rig(Path(tempfile.mkdtemp(prefix="realtime-")), pin, args.sessions)
    try:
        data = uvloop.run(run(args, rig))
    finally:
        rig.close()
        if args.keep:
            print(f"logs and configs kept in {rig.work}")
        else:
            shutil.rmtree(rig.work, ignore_errors=True)
    data["meta"] = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "commit": u.tool_version(["git", "-C", str(ROOT), "log", "-1", "--format=%h"])
        + (" + uncommitted edgeproxy/ changes" if _dirty() else ""),
        "cpus": os.cpu_count(),
        "pinning": (
            f"the relay under test alone on CPU {pin.sut[0]}, the driver and the region on "
            f"CPU {pin.harness[0]}"
            if pin.sut
            else "not pinned"
        ),
        "python": sys.version.split()[0],
        "aiohttp": aiohttp.__version__,
        "elapsed_s": round(time.monotonic() - started),
        "event_bytes": {kind: len(event) for kind, event in EVENTS.items()},
    }
    data["settings"] = {
        k: v for k, v in vars(args).items() if k not in ("serve", "port", "upstream")
    }
    RESULTS.mkdir(exist_ok=True)
    if data["latency"] or data["cpu"] or data["memory"]:
        note = _realtime_report.plot(data, RESULTS / f"{args.out}.png")
        data["notes"].append(note or f"plot: bench/results/{args.out}.png")
    text = _realtime_report.report(data)
    print()
    print(text)
    (RESULTS / f"{args.out}.md").write_text(text + "\n")
    (RESULTS / f"{args.out}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    return 1 if any("failed" in n for n in data["notes"]) else 0


if __name__ == "__main__":
    sys.exit(main())
