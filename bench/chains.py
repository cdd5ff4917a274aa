"""What a Responses chain held at the edge costs, and what a rescue adds, against a chain
kept on its owner: instructions per follow-up (callgrind) and bytes the region receives.

A follow-up ``POST /v1/responses`` with ``previous_response_id`` goes to the region that
stored the previous response. On a route with ``responses_state = "edge"`` the proxy also
holds each stored response (one write per turn) and, when the owner cannot continue the
chain, sends the chain's whole input instead (a rescue). Rows, each one ``edgeproxy
serve`` under callgrind (``bench/instr.py``'s machinery): ``owner route`` (no edge state:
the baseline); ``edge, at owner`` (the owner up and storing: each turn held as well);
``edge, rescued`` (the region set ``stores_responses = false``: every follow-up expanded
from the edge's memory); then, when the Redis of ``--redis`` answers (under key prefixes
of this run, removed at the end), ``owner route, Redis``, ``edge, at owner, Redis`` (not
in ``--quick``) and ``edge, rescued, Redis``. One ``redis_url`` serves owners and chains,
so owners are looked up in Redis too: the notes compare each Redis edge row with ``owner
route, Redis`` as well.

The region is a ``FakeRegion`` (in this process, outside valgrind): stateful Responses,
deterministic answers of ``--tokens`` tokens. Chains of ``--turns`` turns run in
lockstep: turn 1 uninstrumented, then per later turn instrumentation on, that turn of
every chain, off, counters dumped, so each turn number has its own count; ``--warmup``
whole chains go uninstrumented first. Each process answers JSON chains, then streamed
ones (``--kinds``; paced ``--pace`` ms a token, so events reach the proxy one by one).

Bytes the region received: a TCP relay in front of it (in this process) parses the
HTTP/1.1 requests the proxy sends and adds up each ``POST /v1/responses``'s head and body.
Held bytes per turn: ``/status`` ``chains.held_bytes_total`` over ``held_total`` around
each counted turn. Rescue time: ``chains.rescue_seconds_sum`` over the rescues; under
callgrind it is tens of times the real one, so each rescued row also runs without
valgrind (``--native-chains`` JSON chains) and the table gives that mean.

Every answer is checked: the region names the messages of the conversation it answered
(``x-fake-conversation-messages``: 2t - 1 at turn t when the chain is whole), and only a
rescued answer carries ``X-Edgeproxy-State: edge``. ``--quick``: JSON chains only, 6
counted after 2, under 2 minutes. Results: ``bench/results/chains.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _util as u  # noqa: E402
import instr  # noqa: E402

from edgeproxy.testing import Behavior, FakeRegion  # noqa: E402

RESULTS = HERE / "results"
LOOPBACK = "127.0.0.1"
PATH = "/v1/responses"
MODEL = "fake-llm"
KINDS = ("json", "sse")


@dataclass(frozen=True)
class Setup:
    key: str
    label: str
    state: str  # the route's responses_state
    stores: bool  # the region's stores_responses
    redis: bool
    marker: str
    color: str
    quick: bool = True  # in --quick runs


SETUPS = (
    Setup("owner", "owner route", "owner", True, False, "o", "tab:gray"),
    Setup("edge", "edge, at owner", "edge", True, False, "s", "tab:blue"),
    Setup("rescued", "edge, rescued", "edge", False, False, "^", "tab:red"),
    Setup("owner-redis", "owner route, Redis", "owner", True, True, "D", "tab:olive"),
    Setup("edge-redis", "edge, at owner, Redis", "edge", True, True, "v", "tab:cyan", False),
    Setup("redis", "edge, rescued, Redis", "edge", False, True, "x", "tab:purple"),
)


# -- the region's side: a relay counting what the proxy sends -------------------------


class _Meter:
    """Splits one connection's bytes toward the region into HTTP/1.1 requests, their bodies
    by content-length (the proxy sends JSON bodies whole; a chunked one is counted in
    ``chunked`` and the rest of its connection in ``wire`` only)."""

    def __init__(self, totals: RelayTotals) -> None:
        self.totals = totals
        self.buf = bytearray()
        self.remaining = 0
        self.counted = False  # the request in progress is a POST /v1/responses
        self.lost = False

    def feed(self, data: bytes) -> None:
        totals, buf = self.totals, self.buf
        with totals.lock:
            totals.wire += len(data)
            buf += data
            while buf and not self.lost:
                if self.remaining:
                    n = min(self.remaining, len(buf))
                    totals.body += n if self.counted else 0
                    del buf[:n]
                    self.remaining -= n
                    continue
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buf[: end + 4])
                del buf[: end + 4]
                lines = head.decode("latin-1").lower().split("\r\n")
                fields = dict(line.partition(":")[::2] for line in lines[1:] if line)
                fields = {k.strip(): v.strip() for k, v in fields.items()}
                self.counted = lines[0].startswith(f"post {PATH} ")
                totals.requests += self.counted
                totals.head += len(head) if self.counted else 0
                if "chunked" in fields.get("transfer-encoding", ""):
                    totals.chunked += 1
                    self.lost = True
                self.remaining = int(fields.get("content-length") or 0)


@dataclass
class RelayTotals:
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    requests: int = 0  # POST /v1/responses
    head: int = 0  # their heads
    body: int = 0  # their bodies
    wire: int = 0  # every byte toward the region
    chunked: int = 0  # requests with a chunked body (not counted)

    def snapshot(self) -> tuple[int, int, int, int]:
        with self.lock:
            return self.requests, self.head, self.body, self.wire


class Relay:
    """A TCP relay on its own thread and loop: the proxy's upstream, in front of the region."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.totals = RelayTotals()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> Relay:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        self.port = fut.result(10)
        return self

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._accepted, LOOPBACK, 0, backlog=1024)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.target)
            meter = _Meter(self.totals)
            await asyncio.gather(
                self._pump(reader, up_writer, meter), self._pump(up_reader, writer, None)
            )
        except OSError:
            pass  # the region is gone: so is this connection
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()
            self._tasks.discard(task)

    @staticmethod
    async def _pump(
        src: asyncio.StreamReader, dst: asyncio.StreamWriter, meter: _Meter | None
    ) -> None:
        try:
            while data := await src.read(1 << 16):
                if meter is not None:
                    meter.feed(data)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()


def redis_answers(url: str) -> str | None:
    """None when the Redis at ``url`` answers PING, else why not."""
    try:
        import redis

        with redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2) as client:
            client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means: not there
        return f"{url} does not answer ({exc})"
    return None


def redis_clean(url: str, prefixes: list[str]) -> int:
    """Delete this run's keys (those under ``prefixes``); returns how many."""
    import redis

    removed = 0
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        for prefix in prefixes:
            keys = list(client.scan_iter(match=prefix + "*", count=1000))
            for i in range(0, len(keys), 500):
                removed += int(client.delete(*keys[i : i + 500]))
    return removed


# -- the proxy ---------------------------------------------------------------------------


def proxy_toml(port: int, admin: int, upstream: str, setup: Setup, redis: dict[str, str]) -> str:
    text = f"""
server = {{ host = "{LOOPBACK}", port = {port}, grace_period = 1.0 }}
admin = {{ host = "{LOOPBACK}", port = {admin} }}
upstream = {{ http2 = false, http1_max_connections = 100 }}
plugins = {{ entry_points = false }}
[[regions]]
name = "origin"
url = "{upstream}"
stores_responses = {str(setup.stores).lower()}
[[routes]]
name = "responses"
path = "{PATH}"
responses_state = "{setup.state}"
"""
    if setup.redis:
        text += f"""
[stateful]
redis_url = "{redis["url"]}"
redis_prefix = "{redis["owners"]}"
edge_prefix = "{redis["chains"]}"
"""
    return text


@contextlib.contextmanager
def proxy(
    setup: Setup, upstream: str, redis: dict[str, str], work: Path, *, valgrind: bool, wait: float
) -> Iterator[tuple[subprocess.Popen[bytes], int, int]]:
    """``edgeproxy serve`` for ``setup`` (under callgrind or not): (process, port, admin)."""
    port, admin = instr.free_port(), instr.free_port()
    conf = work / f"{setup.key}.toml"
    conf.write_text(proxy_toml(port, admin, upstream, setup, redis))
    cmd = [sys.executable, "-m", "edgeproxy", "serve", "--config", str(conf)]
    env = dict(os.environ, PYTHONPATH=str(instr.ROOT))
    if valgrind:
        proc = instr.callgrind(cmd, env, work)
    else:
        with open(work / f"{setup.key}.native.log", "wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True
            )
    try:
        if not (instr.wait_port(port, wait, proc) and instr.wait_port(admin, wait, proc)):
            logs = sorted(work.glob("*.log"), key=lambda p: p.stat().st_mtime)
            tail = logs[-1].read_text(errors="replace")[-2000:] if logs else ""
            raise RuntimeError(f"{setup.label}: the proxy did not start:\n{tail}")
        yield proc, port, admin
    finally:
        u.stop_process(proc)


# Turns fields taken as the difference around a counted turn: of the relay's totals (in
# the order of their snapshot), and of /status chains.
RELAY_DELTAS = ("region_requests", "head_bytes", "body_bytes", "wire_bytes")
STATUS_DELTAS = {
    "held": "held_total",
    "held_bytes": "held_bytes_total",
    "rescue_seconds": "rescue_seconds_sum",
}


def rescues_of(status: dict[str, Any]) -> int:
    return sum((status.get("rescued") or {}).values())


def chains_status(admin: int) -> dict[str, Any]:
    """``/status`` → ``chains`` (empty on a route without edge state)."""
    return u.http_json(f"http://{LOOPBACK}:{admin}/status", timeout=60).get("chains") or {}


@dataclass
class Chain:
    index: int
    previous: str | None = None


@dataclass
class Turns:
    """What one turn number's requests saw (summed over the chains)."""

    turn: int
    requests: int = 0
    failed: int = 0
    broken: int = 0  # the conversation answered was not the whole chain, or the
    # X-Edgeproxy-State mark was not the one expected
    edge_marked: int = 0  # answers with X-Edgeproxy-State: edge
    instructions: int = 0
    region_requests: int = 0
    head_bytes: int = 0
    body_bytes: int = 0
    wire_bytes: int = 0
    held: int = 0
    held_bytes: int = 0
    rescues: int = 0
    rescue_seconds: float = 0.0


def turn_body(chain: Chain, turn: int, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "input": f"Turn {turn} of chain {chain.index}: go on, briefly please.",
    }
    if chain.previous:
        body["previous_response_id"] = chain.previous
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


def completed_id(data: bytes, stream: bool) -> str | None:
    """The stored response's id: the JSON answer's, or ``response.completed``'s."""
    if not stream:
        value = json.loads(data)
        return value.get("id") if isinstance(value, dict) else None
    for line in data.split(b"\n"):
        if line.startswith(b"data: ") and b'"response.completed"' in line:
            event = json.loads(line[6:])
            if event.get("type") == "response.completed":
                return str(event["response"]["id"])
    return None


async def run_chains(
    port: int,
    n: int,
    args: argparse.Namespace,
    stream: bool,
    rescued: bool,
    *,
    first: int = 0,
    counted: TurnCounter | None = None,
) -> list[Turns]:
    """``n`` chains of ``args.turns`` turns in lockstep, ``args.concurrency`` requests at a
    time; ``rescued``: every follow-up is expected to be taken on by the edge. With
    ``counted``, each turn after the first is measured (``counted(turn, None)`` before it,
    ``counted(turn, stats)`` after)."""
    url = f"http://{LOOPBACK}:{port}{PATH}"
    chains = [Chain(first + i) for i in range(n)]
    out: list[Turns] = []
    sem = asyncio.Semaphore(args.concurrency)
    headers = {"content-type": "application/json"}

    async def one(session: aiohttp.ClientSession, chain: Chain, into: Turns) -> None:
        turn = into.turn
        body = turn_body(chain, turn, stream)
        async with sem, session.post(url, data=body, headers=headers) as r:
            data = await r.read()
            into.requests += 1
            if r.status != 200:
                into.failed += 1
                chain.previous = None  # the chain starts again
                return
            marked = r.headers.get("x-edgeproxy-state") == "edge"
            whole = r.headers.get("x-fake-conversation-messages") == str(2 * turn - 1)
            into.edge_marked += marked
            into.broken += not whole or marked != (rescued and turn > 1)
            chain.previous = completed_id(data, stream)
            into.failed += chain.previous is None

    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for turn in range(1, args.turns + 1):
            stats = Turns(turn)
            measured = counted if turn > 1 else None
            if measured is not None:
                measured(turn, None)
            await asyncio.gather(*(one(session, c, stats) for c in chains))
            if measured is not None:
                measured(turn, stats)
            out.append(stats)
    return out


@dataclass
class Row:
    key: str
    label: str
    kind: str  # json, sse
    turns: list[Turns] = field(default_factory=list)
    skipped: str = ""
    native_rescue_ms: float | None = None
    native_held_bytes_per_turn: float | None = None

    def total(self, name: str) -> float:
        return float(sum(getattr(t, name) for t in self.turns))

    def per_followup(self, name: str) -> float | None:
        n = self.total("requests")
        return self.total(name) / n if n else None

    @property
    def held_per_turn(self) -> float | None:
        held = self.total("held")
        return self.total("held_bytes") / held if held else None

    @property
    def rescue_ms(self) -> float | None:
        rescues = self.total("rescues")
        return 1000 * self.total("rescue_seconds") / rescues if rescues else None


class TurnCounter:
    """Around each counted turn: instrumentation on, then off, the counters dumped, and
    what the relay and ``/status`` saw meanwhile."""

    def __init__(self, pid: int, work: Path, admin: int, relay: Relay) -> None:
        self.pid, self.work, self.admin, self.relay = pid, work, admin, relay
        self.status: dict[str, Any] = {}
        self.bytes = (0, 0, 0, 0)

    def __call__(self, turn: int, stats: Turns | None) -> None:
        if stats is None:
            self.status = chains_status(self.admin)
            self.bytes = self.relay.totals.snapshot()
            instr.control(self.pid, "-i", "on")
            return
        instr.control(self.pid, "-i", "off")
        stats.instructions = instr.dump_instructions(self.pid, self.work)
        after, now, then = self.relay.totals.snapshot(), chains_status(self.admin), self.status
        for name, was, got in zip(RELAY_DELTAS, self.bytes, after, strict=True):
            setattr(stats, name, got - was)
        for name, key in STATUS_DELTAS.items():
            setattr(stats, name, now.get(key, 0) - then.get(key, 0))
        stats.rescues = rescues_of(now) - rescues_of(then)


def measure(
    setup: Setup,
    upstream: str,
    relay: Relay,
    region: FakeRegion,
    redis: dict[str, str],
    args: argparse.Namespace,
) -> list[Row]:
    """One proxy process under callgrind: a row per kind (JSON, streamed)."""
    work = Path(tempfile.mkdtemp(prefix=f"chains-{setup.key}-"))
    rows: list[Row] = []
    try:
        with proxy(setup, upstream, redis, work, valgrind=True, wait=args.wait) as started:
            proc, port, admin = started
            rescue = not setup.stores and setup.state == "edge"
            for kind in args.kinds:
                stream = kind == "sse"
                region.configure(inter_token_delay=args.pace / 1000 if stream else 0.0)
                asyncio.run(run_chains(port, args.warmup, args, stream, rescue, first=10_000))
                counted = TurnCounter(proc.pid, work, admin, relay)
                chains = run_chains(port, args.chains, args, stream, rescue, counted=counted)
                turns = [t for t in asyncio.run(chains) if t.turn > 1]
                rows.append(Row(setup.key, setup.label, kind, turns))
                print(_line(rows[-1]), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def native_pass(
    setup: Setup, upstream: str, redis: dict[str, str], args: argparse.Namespace
) -> tuple[float | None, float | None]:
    """The same process without valgrind, JSON chains only: (rescue ms, held bytes per
    turn) from its ``/status``."""
    work = Path(tempfile.mkdtemp(prefix=f"chains-native-{setup.key}-"))
    try:
        with proxy(setup, upstream, redis, work, valgrind=False, wait=60) as (_, port, admin):
            rescue = not setup.stores and setup.state == "edge"
            asyncio.run(run_chains(port, args.native_chains, args, False, rescue, first=20_000))
            status = chains_status(admin)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rescues, held = rescues_of(status), status.get("held_total") or 0
    return (
        1000 * status["rescue_seconds_sum"] / rescues if rescues else None,
        status["held_bytes_total"] / held if held else None,
    )


def _line(row: Row) -> str:
    if row.skipped:
        return f"{row.label:22} {row.kind:4} skipped: {row.skipped}"
    instr_k, body = (row.per_followup(n) or 0 for n in ("instructions", "body_bytes"))
    return (
        f"{row.label:22} {row.kind:4} {instr_k / 1000:9,.0f} k/follow-up  {body:8,.0f} B body  "
        f"rescued {row.total('rescues'):.0f}/{row.total('requests'):.0f}  "
        f"({row.total('failed') + row.total('broken'):.0f} bad)"
    )


# -- the report ---------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 0, suffix: str = "") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{suffix}"


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}"


def _per(rows: list[Row], key: str, kind: str, name: str = "instructions") -> float | None:
    """Row ``key``'s ``name`` per follow-up for ``kind`` (None: not measured)."""
    row = next((r for r in rows if r.key == key and r.kind == kind and not r.skipped), None)
    return row.per_followup(name) if row else None


def summary_table(rows: list[Row]) -> str:
    lines = [
        "| row | request | instructions per follow-up | x owner route | added | "
        "region received (body) | x owner route | added | head | held per turn | "
        "rescued | rescue ms (native) | failed / broken |",
        "|" + " --- |" * 13,
    ]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.label} | {r.kind} | skipped: {r.skipped} |" + " - |" * 10)
            continue
        ins, body = r.per_followup("instructions"), r.per_followup("body_bytes")
        b_ins, b_body = _per(rows, "owner", r.kind), _per(rows, "owner", r.kind, "body_bytes")
        added_ins = "-" if ins is None or b_ins is None else f"{(ins - b_ins) / 1000:+,.0f} k"
        added_body = "-" if body is None or b_body is None else f"{body - b_body:+,.0f} B"
        lines.append(
            f"| {r.label} | {r.kind} | {_fmt(ins and ins / 1000, suffix=' k')} "
            f"| {_ratio(ins, b_ins)} | {added_ins} | {_fmt(body, suffix=' B')} "
            f"| {_ratio(body, b_body)} | {added_body} "
            f"| {_fmt(r.per_followup('head_bytes'), suffix=' B')} "
            f"| {_fmt(r.held_per_turn, suffix=' B')} "
            f"| {r.total('rescues'):.0f} / {r.total('requests'):.0f} "
            f"| {_fmt(r.native_rescue_ms, 3)} "
            f"| {r.total('failed'):.0f} / {r.total('broken'):.0f} |"
        )
    return "\n".join(lines)


def turn_table(rows: list[Row], kind: str) -> str:
    mine = [r for r in rows if r.kind == kind and not r.skipped]
    if not mine:
        return ""
    head = ["turn"] + [f"{r.label}: k instr" for r in mine] + [f"{r.label}: body B" for r in mine]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for i, t in enumerate(mine[0].turns):
        cells = [str(t.turn)]
        for r in mine:
            tt = r.turns[i]
            cells.append(_fmt(tt.instructions / tt.requests / 1000 if tt.requests else None))
        for r in mine:
            tt = r.turns[i]
            cells.append(_fmt(tt.body_bytes / tt.requests if tt.requests else None))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    setups = {s.key: s for s in SETUPS}
    for r in rows:
        if r.skipped or not r.turns:
            continue
        style = "-" if r.kind == "json" else "--"
        xs = [t.turn for t in r.turns]
        name = f"{r.label} ({'JSON' if r.kind == 'json' else 'stream'})"
        for ax, ys in (
            (left, [t.instructions / t.requests / 1000 for t in r.turns]),
            (right, [t.body_bytes / t.requests for t in r.turns]),
        ):
            setup = setups[r.key]
            ax.plot(xs, ys, style, marker=setup.marker, color=setup.color, alpha=0.8, label=name)
    left.set(
        xlabel="turn", ylabel="k instructions per follow-up", title="proxy instructions (callgrind)"
    )
    right.set(
        xlabel="turn",
        ylabel="bytes",
        title="request body the region received (rows with equal bytes overlap)",
    )
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    notes: list[str] = []
    rows: list[Row] = []
    setups = [s for s in SETUPS if s.key in args.rows]
    tag = secrets.token_hex(4)
    redis = {
        "url": args.redis,
        "owners": f"edgeproxy-bench-chains:{tag}:owner:",
        "chains": f"edgeproxy-bench-chains:{tag}:chain:",
    }
    redis_used = False
    region = FakeRegion(name="origin", behavior=Behavior(tokens=args.tokens))
    relay: Relay | None = None
    region.start_sync()
    try:
        relay = Relay(region.port).start()
        upstream = f"http://{LOOPBACK}:{relay.port}"
        for setup in setups:
            if setup.redis:
                why = redis_answers(args.redis)
                if why is not None:
                    rows += [Row(setup.key, setup.label, k, skipped=why) for k in args.kinds]
                    notes.append(f"{setup.label}: skipped ({why})")
                    print(_line(rows[-1]), flush=True)
                    continue
                redis_used = True
            got = measure(setup, upstream, relay, region, redis, args)
            if setup.state == "edge" and not setup.stores and args.native_chains:
                rescue_ms, held = native_pass(setup, upstream, redis, args)
                for row in got:
                    row.native_rescue_ms, row.native_held_bytes_per_turn = rescue_ms, held
            rows += got
    finally:
        if relay is not None:
            relay.stop()
            if relay.totals.chunked:
                notes.append(f"{relay.totals.chunked} chunked request bodies: bytes undercounted")
        region.stop_sync()
        if redis_used:
            removed = redis_clean(args.redis, [redis["owners"], redis["chains"]])
            notes.append(f"Redis: removed this run's {removed} keys ({redis['chains']}*, ...)")
    return rows, notes


def report(rows: list[Row], notes: list[str], args: argparse.Namespace, seconds: float) -> str:
    parts = [
        "# Responses chains held at the edge: what a rescue costs",
        "",
        f"Chains of {args.turns} turns, {args.tokens} tokens an answer; {args.warmup} chains "
        f"warm up uninstrumented, then {args.chains} chains are counted, turns 2..{args.turns} "
        f"(each a follow-up with previous_response_id), {args.concurrency} requests at a time; "
        f"streams paced {args.pace:g} ms a token. Instructions: the proxy process under "
        "callgrind. Region received: the request body of each POST /v1/responses, counted by "
        "a relay in front of the fake region (HTTP/1.1 upstream); `head` is its HTTP head. "
        "Held per turn: /status chains held_bytes_total / held_total during the counted turns. "
        "Rescue ms: /status rescue_seconds_mean of the same process run without valgrind "
        f"({args.native_chains} JSON chains). `x owner route` and `added` compare with the "
        "owner route's row of the same request kind.",
        "",
        summary_table(rows),
        "",
    ]
    for kind, name in (("json", "JSON answers"), ("sse", "streamed answers")):
        table = turn_table(rows, kind)
        if table:
            parts += [f"## By turn, {name} (per follow-up)", "", table, ""]
    for kind in args.kinds:
        b_ins = _per(rows, "owner-redis", kind)
        for row in (r for r in rows if r.kind == kind and r.key in ("edge-redis", "redis")):
            ins = _per(rows, row.key, kind)
            if ins is None or not b_ins:
                continue
            notes = notes + [
                f"{kind}: {row.label} against owner route, Redis (owners in Redis for both): "
                f"x{ins / b_ins:.2f} instructions ({(ins - b_ins) / 1000:+,.0f} k per follow-up)"
            ]
    parts += [f"* {n}" for n in notes]
    parts.append(f"* run took {seconds:.0f} s")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run (about 2 minutes)")
    for flag, kind, default, text in (
        ("--turns", int, 8, "turns per chain (8)"),
        ("--chains", int, None, "counted chains (16; quick 6)"),
        ("--warmup", int, None, "uncounted chains first (8; quick 2)"),
        ("--concurrency", int, 4, "requests at a time (4)"),
        ("--tokens", int, 32, "tokens per answer (32)"),
        ("--pace", float, 10.0, "ms between streamed tokens (10)"),
        ("--native-chains", int, None, "JSON chains run without valgrind (20; quick 10; 0: none)"),
        ("--wait", float, 240.0, "seconds for a port to open (240)"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, help="json, sse (both; quick json)")
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=[s.key for s in SETUPS],
        help="rows to run (all; quick: all but edge-redis)",
    )
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="for the Redis row")
    parser.add_argument("--keep", action="store_true", help="keep the callgrind files")
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, short in (("chains", 16, 6), ("warmup", 8, 2), ("native_chains", 20, 10)):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    if args.kinds is None:
        args.kinds = ["json"] if quick else list(KINDS)
    if args.rows is None:
        args.rows = [s.key for s in SETUPS if s.quick or not quick]
    if args.turns < 2 or args.chains < 1 or args.concurrency < 1:
        parser.error("--turns must be at least 2, --chains and --concurrency at least 1")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("chains: valgrind is not installed (Debian: apt-get install valgrind); skipped")
        return 0
    # A SIGTERM unwinds, so that the proxy, the region and the relay are stopped.
    signal.signal(signal.SIGTERM, instr._exit_on_signal)
    instr.raise_nofile()
    started = time.monotonic()
    rows, notes = run(args)
    seconds = time.monotonic() - started
    text = report(rows, notes, args, seconds)
    print("\n" + text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chains.md").write_text(text)
    data = {
        "settings": {k: v for k, v in vars(args).items() if k != "keep"},
        "notes": notes,
        "seconds": round(seconds, 1),
        "rows": [
            asdict(r)
            | {
                "instructions_per_followup": r.per_followup("instructions"),
                "body_bytes_per_followup": r.per_followup("body_bytes"),
                "head_bytes_per_followup": r.per_followup("head_bytes"),
                "held_bytes_per_turn": r.held_per_turn,
                "rescue_ms_under_callgrind": r.rescue_ms,
            }
            for r in rows
        ],
    }
    (RESULTS / "chains.json").write_text(json.dumps(data, indent=2) + "\n")
    if plot(rows, RESULTS / "chains.png"):
        print(f"plot: {RESULTS / 'chains.png'}")
    bad = any(r.total("failed") or r.total("broken") for r in rows if not r.skipped)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
