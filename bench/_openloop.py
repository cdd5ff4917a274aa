"""A fixed-rate (open loop) HTTP/1.1 load generator, in the spirit of wrk2.

    python bench/_openloop.py URL --rate 2000 --duration 4 --warmup 1 --conns 32 \\
        --body-file request.json

Prints one JSON object: achieved rate, latency percentiles in ms, errors.

Why not ``h2load --rps``: every h2load client fires on its own timer, all
started together, so the requests arrive in bursts of one per client. A burst
of 16 requests to a proxy that needs 0.25 ms each queues the last one for 4 ms,
so the "latency at half load" ends up measuring the burst size. Here one
scheduler spreads the requests evenly (or as a Poisson process) over a pool of
keep-alive connections.

Latency is counted from when a request is written, except that a request that
found every connection busy is counted from when it was due: the server's
backlog is charged to the server (no coordinated omission), while the event
loop's timer granularity (about 1 ms under uvloop: requests go out in small
groups each millisecond) is not charged to anyone.

Talks to one host:port only; stops after warm-up + duration (+ at most
``--drain`` seconds waiting for answers still in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import sys
import time
from collections import deque
from pathlib import Path
from urllib.parse import urlsplit


class _Conn(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, gen: _Generator) -> None:
        self.gen = gen
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.need: int | None = None  # body bytes still expected; -1 while chunked
        self.status = 0
        self.closing = False
        self.due = 0.0
        self.start = 0.0
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, due: float, charged_from_due: bool) -> None:
        assert self.transport is not None
        self.busy = True
        self.due = due
        # Before the write: on loopback the server may run, and even answer,
        # inside our write() call when it shares our CPU.
        self.start = due if charged_from_due else time.perf_counter()
        self.transport.write(self.gen.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.busy:
            if self.need is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buf[:end]).lower()
                del self.buf[: end + 4]
                self.status = int(head[9:12])
                self.closing = b"\r\nconnection: close" in head
                self.need = _content_length(head)
            if self.need >= 0:
                if len(self.buf) < self.need:
                    return
                del self.buf[: self.need]
            else:
                # Chunked: the benchmark bodies are tiny JSON, so finding the
                # last-chunk marker is enough; no chunk sizes to walk.
                end = self.buf.find(b"0\r\n\r\n")
                if end < 0 or (end > 0 and self.buf[end - 2 : end] != b"\r\n"):
                    return
                del self.buf[: end + 5]
            self.need = None
            self.busy = False
            self.gen.done(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.gen.lost(self)


def _content_length(head: bytes) -> int:
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return -1 if b"\r\ntransfer-encoding: chunked" in head else 0
    end = head.find(b"\r\n", at + 2)
    return int(head[at + 17 : end if end > 0 else None].strip())


class _Generator:
    def __init__(self, args: argparse.Namespace, loop: asyncio.AbstractEventLoop) -> None:
        parts = urlsplit(args.url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        body = Path(args.body_file).read_bytes() if args.body_file else b""
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        method = "POST" if body else "GET"
        self.request = (
            f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.loop = loop
        self.args = args
        self.idle: deque[_Conn] = deque()
        self.backlog: deque[float] = deque()
        self.measure_from = math.inf
        self.latencies: list[float] = []
        self.non2xx = 0
        self.errors = 0
        self.queued = 0
        self.in_flight = 0
        self.stopping = False

    async def connect(self) -> None:
        _, conn = await self.loop.create_connection(lambda: _Conn(self), self.host, self.port)
        self.idle.append(conn)
        self.dispatch_backlog()

    def dispatch_backlog(self) -> None:
        while self.backlog and self.idle:
            self._send(self.idle.popleft(), self.backlog.popleft(), charged_from_due=True)

    def _send(self, conn: _Conn, due: float, *, charged_from_due: bool) -> None:
        self.in_flight += 1
        conn.send(due, charged_from_due)

    def due(self, when: float) -> None:
        if self.idle and not self.backlog:
            self._send(self.idle.popleft(), when, charged_from_due=False)
        else:
            self.queued += when >= self.measure_from
            self.backlog.append(when)

    def done(self, conn: _Conn) -> None:
        self.in_flight -= 1
        if conn.due >= self.measure_from:
            self.latencies.append(time.perf_counter() - conn.start)
            if not 200 <= conn.status < 300:
                self.non2xx += 1
        if conn.closing:
            return  # connection_lost replaces it
        self.idle.append(conn)
        self.dispatch_backlog()

    def lost(self, conn: _Conn) -> None:
        if conn.busy:
            self.in_flight -= 1
            if conn.due >= self.measure_from:
                self.errors += 1
        try:
            self.idle.remove(conn)
        except ValueError:
            pass
        if not self.stopping:
            self.loop.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        try:
            await self.connect()
        except OSError:
            self.errors += 1

    async def run(self) -> dict[str, object]:
        args = self.args
        await asyncio.gather(*(self.connect() for _ in range(args.conns)))
        rng = random.Random(args.seed)
        gap = 1.0 / args.rate
        # perf_counter throughout: uvloop's loop.time() only ticks in milliseconds.
        start = time.perf_counter() + 0.01
        self.measure_from = start + args.warmup
        end = self.measure_from + args.duration
        when = start
        while when < end:
            now = time.perf_counter()
            while when <= now and when < end:
                self.due(when)
                when += rng.expovariate(args.rate) if args.poisson else gap
            await asyncio.sleep(max(0.0, when - time.perf_counter()))
        deadline = time.perf_counter() + args.drain
        while (self.in_flight or self.backlog) and time.perf_counter() < deadline:
            await asyncio.sleep(0.005)
        self.stopping = True
        unanswered = self.in_flight + len(self.backlog)
        for conn in list(self.idle):
            if conn.transport is not None:
                conn.transport.close()
        lat = sorted(x * 1000 for x in self.latencies)
        return {
            "target_rps": args.rate,
            "achieved_rps": len(lat) / args.duration,
            "requests": len(lat),
            "p50_ms": _pct(lat, 50),
            "p90_ms": _pct(lat, 90),
            "p99_ms": _pct(lat, 99),
            "p999_ms": _pct(lat, 99.9),
            "max_ms": lat[-1] if lat else math.nan,
            "over_1s": sum(1 for x in lat if x > 1000),
            "non2xx": self.non2xx,
            "errors": self.errors + self.non2xx + unanswered,
            "queued": self.queued,
        }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return values[max(0, min(len(values) - 1, math.ceil(q / 100 * len(values)) - 1))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fixed-rate HTTP/1.1 load generator")
    p.add_argument("url")
    p.add_argument("--rate", type=float, required=True, help="requests per second")
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    p.add_argument("--conns", type=int, default=32, help="keep-alive connections")
    p.add_argument("--body-file", help="POST this file (JSON); GET when absent")
    p.add_argument("--poisson", action="store_true", help="Poisson arrivals, not evenly spaced")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--drain", type=float, default=5.0, help="seconds to wait for stragglers")
    args = p.parse_args(argv)
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        gen = _Generator(args, runner.get_loop())
        result = runner.run(gen.run())
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
