"""Compare upstream client pools against a local nginx.

Starts nginx (one HTTP/1.1 and one h2c server block, ``return 200`` with a tiny
JSON body) in a temporary directory, then for each client measures sequential
latency and throughput at several concurrency levels for a fixed duration,
under uvloop. Prints a markdown table. Everything stays on 127.0.0.1 and every
loop is bounded by both a deadline and a request count.

Clients:

* ``aiohttp``  - aiohttp.ClientSession, HTTP/1.1 (the baseline)
* ``httpx-h1`` - httpx.AsyncClient, HTTP/1.1, limits sized to the concurrency
* ``httpx-h2`` - httpx.AsyncClient, HTTP/2
* ``h2pool``   - edgeproxy._upstream.h2pool.H2Pool, HTTP/2

Usage::

    python bench/pool_compare.py                 # ~45 s
    python bench/pool_compare.py --duration 1 --sequential 300 --clients aiohttp,h2pool
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402
import httpx  # noqa: E402

from edgeproxy._upstream.h2pool import H2Pool  # noqa: E402
from edgeproxy._upstream.pool import PoolLimits  # noqa: E402

HOST = "127.0.0.1"
BODY = b'{"ok":true}'

NGINX_CONF = """
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    keepalive_requests {keepalive_requests};
    http2_max_concurrent_streams {max_streams};
    server {{ listen {host}:{h1_port}; location / {{ return 200 '{body}'; }} }}
    server {{ listen {host}:{h2_port} http2; location / {{ return 200 '{body}'; }} }}
}}
"""

Fetch = Callable[[], Awaitable[None]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def run_nginx(binary: str, keepalive_requests: int, max_streams: int) -> Iterator[tuple[int, int]]:
    prefix = tempfile.mkdtemp(prefix="edgeproxy-bench-nginx-")
    h1_port, h2_port = _free_port(), _free_port()
    conf = os.path.join(prefix, "nginx.conf")
    with open(conf, "w") as fh:
        fh.write(
            NGINX_CONF.format(
                prefix=prefix,
                host=HOST,
                h1_port=h1_port,
                h2_port=h2_port,
                keepalive_requests=keepalive_requests,
                max_streams=max_streams,
                body=BODY.decode(),
            )
        )
    proc = subprocess.Popen(
        [binary, "-p", prefix, "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 10
        for port in (h1_port, h2_port):
            while True:
                try:
                    socket.create_connection((HOST, port), timeout=0.5).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        err = proc.stderr.read().decode() if proc.stderr else ""
                        raise SystemExit(f"nginx did not start: {err.strip()}") from None
                    time.sleep(0.05)
        yield h1_port, h2_port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
        shutil.rmtree(prefix, ignore_errors=True)


# -- clients ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def aiohttp_client(h1_port: int, h2_port: int, conc: int) -> AsyncIterator[Fetch]:
    url = f"http://{HOST}:{h1_port}/"
    connector = aiohttp.TCPConnector(limit=conc, limit_per_host=conc)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def fetch() -> None:
            async with session.get(url) as resp:
                if await resp.read() != BODY:
                    raise RuntimeError("bad body")

        yield fetch


def _httpx_client(http2: bool, conc: int) -> httpx.AsyncClient:
    # Tuned: enough keep-alive connections that none is closed and reopened
    # under load (the default max_keepalive_connections=20 churns).
    size = 8 if http2 else conc
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    return httpx.AsyncClient(http1=not http2, http2=http2, limits=limits, timeout=10.0)


@contextlib.asynccontextmanager
async def httpx_h1_client(h1_port: int, h2_port: int, conc: int) -> AsyncIterator[Fetch]:
    url = f"http://{HOST}:{h1_port}/"
    async with _httpx_client(False, conc) as client:

        async def fetch() -> None:
            resp = await client.get(url)
            if resp.content != BODY:
                raise RuntimeError("bad body")

        yield fetch


@contextlib.asynccontextmanager
async def httpx_h2_client(h1_port: int, h2_port: int, conc: int) -> AsyncIterator[Fetch]:
    url = f"http://{HOST}:{h2_port}/"
    async with _httpx_client(True, conc) as client:

        async def fetch() -> None:
            resp = await client.get(url)
            if resp.content != BODY:
                raise RuntimeError("bad body")

        yield fetch


@contextlib.asynccontextmanager
async def h2pool_client(h1_port: int, h2_port: int, conc: int) -> AsyncIterator[Fetch]:
    pool = H2Pool(f"http://{HOST}:{h2_port}", PoolLimits(max_connections=8))
    await pool.start()
    try:

        async def fetch() -> None:
            resp = await pool.request("GET", "/", [])
            try:
                data = b"".join([chunk async for chunk in resp.aiter_bytes()])
            finally:
                await resp.aclose()
            if data != BODY:
                raise RuntimeError("bad body")

        yield fetch
    finally:
        await pool.aclose()


CLIENTS: dict[str, Callable[[int, int, int], contextlib.AbstractAsyncContextManager[Fetch]]] = {
    "aiohttp": aiohttp_client,
    "httpx-h1": httpx_h1_client,
    "httpx-h2": httpx_h2_client,
    "h2pool": h2pool_client,
}


# -- measurement ----------------------------------------------------------------


@dataclass
class Result:
    client: str
    mode: str
    requests: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        data = sorted(self.latencies)
        return data[min(len(data) - 1, int(q * len(data)))] * 1e3


async def measure_sequential(name: str, fetch: Fetch, count: int, max_seconds: float) -> Result:
    result = Result(name, "sequential")
    for _ in range(min(50, count)):  # warm-up: connections, caches
        with contextlib.suppress(Exception):
            await fetch()
    start = time.perf_counter()
    deadline = start + max_seconds
    for _ in range(count):
        t0 = time.perf_counter()
        try:
            await fetch()
        except Exception as exc:
            result.errors[type(exc).__name__] += 1
        else:
            result.requests += 1
        t1 = time.perf_counter()
        result.latencies.append(t1 - t0)
        if t1 > deadline:
            break
    result.seconds = time.perf_counter() - start
    return result


async def measure_concurrent(
    name: str, fetch: Fetch, concurrency: int, duration: float, max_requests: int
) -> Result:
    result = Result(name, f"c={concurrency}")
    budget = max_requests

    async def worker() -> None:
        nonlocal budget
        while budget > 0 and time.perf_counter() < deadline:
            budget -= 1
            t0 = time.perf_counter()
            try:
                await fetch()
            except Exception as exc:
                result.errors[type(exc).__name__] += 1
            else:
                result.requests += 1
                result.latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    deadline = start + duration
    # A hard cap on top of the deadline so a wedged client cannot hang the run.
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), duration + 30)
    result.seconds = time.perf_counter() - start
    return result


async def bench_client(
    name: str, h1_port: int, h2_port: int, args: argparse.Namespace
) -> list[Result]:
    results = []
    factory = CLIENTS[name]
    async with factory(h1_port, h2_port, 1) as fetch:
        results.append(await measure_sequential(name, fetch, args.sequential, args.duration * 2))
    for conc in args.concurrency:
        gc.collect()
        async with factory(h1_port, h2_port, conc) as fetch:
            # A short warm-up opens the connections this level needs.
            await measure_concurrent(name, fetch, conc, 0.3, conc * 4)
            results.append(
                await measure_concurrent(name, fetch, conc, args.duration, args.max_requests)
            )
    return results


def render(results: list[Result]) -> str:
    base = {r.mode: r.rate for r in results if r.client == "aiohttp"}
    lines = [
        "| client | mode | req/s | p50 ms | p99 ms | errors | vs aiohttp |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = f"{r.rate / base[r.mode]:.2f}x" if base.get(r.mode) else "-"
        errors = sum(r.errors.values())
        lines.append(
            f"| {r.client} | {r.mode} | {r.rate:,.0f} | {r.percentile(0.5):.2f} | "
            f"{r.percentile(0.99):.2f} | {errors} | {ratio} |"
        )
    notes = [
        f"- {r.client} {r.mode}: " + ", ".join(f"{k} x{v}" for k, v in r.errors.most_common())
        for r in results
        if r.errors
    ]
    return "\n".join(lines + ([""] + notes if notes else []))


async def main_async(args: argparse.Namespace, h1_port: int, h2_port: int) -> list[Result]:
    results: list[Result] = []
    for name in args.clients:
        print(f"benchmarking {name} ...", file=sys.stderr, flush=True)
        results.extend(await bench_client(name, h1_port, h2_port, args))
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated subset")
    parser.add_argument("--concurrency", default="32,128,256", help="comma-separated levels")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per level")
    parser.add_argument("--sequential", type=int, default=1000, help="sequential requests")
    parser.add_argument(
        "--max-requests", type=int, default=200_000, help="cap on requests per level"
    )
    parser.add_argument("--keepalive-requests", type=int, default=1000, help="nginx setting")
    parser.add_argument("--max-streams", type=int, default=128, help="nginx h2 streams limit")
    parser.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    parser.add_argument("--no-uvloop", action="store_true", help="use the default event loop")
    args = parser.parse_args(argv)
    args.clients = [c for c in args.clients.split(",") if c]
    unknown = set(args.clients) - set(CLIENTS)
    if unknown:
        parser.error(f"unknown clients: {', '.join(sorted(unknown))}")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if args.duration <= 0 or args.duration > 60:
        parser.error("--duration must be in (0, 60]")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not os.access(args.nginx, os.X_OK):
        raise SystemExit(f"nginx not found at {args.nginx}")

    def runner(coro: Coroutine[Any, Any, list[Result]]) -> list[Result]:
        if args.no_uvloop:
            return asyncio.run(coro)
        import uvloop

        return uvloop.run(coro)

    with run_nginx(args.nginx, args.keepalive_requests, args.max_streams) as (h1_port, h2_port):
        started = time.perf_counter()
        results = runner(main_async(args, h1_port, h2_port))
        elapsed = time.perf_counter() - started
    loop_name = "asyncio" if args.no_uvloop else "uvloop"
    print(
        f"nginx keepalive_requests={args.keepalive_requests}, "
        f"http2_max_concurrent_streams={args.max_streams}, {loop_name}, "
        f"{args.duration:g}s per level, {os.cpu_count()} CPUs, took {elapsed:.0f}s\n"
    )
    print(render(results))
    if any(r.mode == "sequential" for r in results):
        seq = {r.client: r for r in results if r.mode == "sequential"}
        summary = ", ".join(
            f"{name} {statistics.median(r.latencies) * 1e3:.3f} ms"
            for name, r in seq.items()
            if r.latencies
        )
        print(f"\nsequential median latency: {summary}")


if __name__ == "__main__":
    main()
