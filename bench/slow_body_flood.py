"""Slow-body flood: can 1,000 slow clients from one address starve good requests?

    python bench/slow_body_flood.py [--slow 1000] [--max-connections 1000] [--good 100]

``edgeproxy serve`` (its own process) listens with ``[limits] max_connections``
of ``--max-connections``, every other limit at its default, in front of a fake
region (its own process). From 127.0.0.2, ``--slow`` clients each send a chat
request head announcing a 100 kB body and then trickle it, one byte a second:
never idle long enough for ``body_timeout``. A client that is refused or cut
(503, 408, a closed connection) reconnects half a second later, so the flood
never lets up. Once the flood is in place, ``--good`` chat requests from
127.0.0.1 go out, ``--spacing`` seconds apart (so they span the slow clients'
rate grace and their reconnections), each with a 10 s timeout.

The target: at least 99 of 100 good requests answered 200. Prints the result
and the listener's counters from the admin ``/status``; exits 1 when the target
is missed. Everything talks to 127.0.0.1/127.0.0.2 only and is bounded in time
(about ``--good * --spacing`` seconds plus start-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util as u  # noqa: E402

SLOW_ADDRESS = "127.0.0.2"
GOOD_ADDRESS = "127.0.0.1"
BODY = json.dumps({"model": "fake-llm", "messages": [{"role": "user", "content": "Say hello."}]})
SLOW_LENGTH = 100_000


def slow_head() -> bytes:
    return (
        f"POST {u.REQUEST_PATH} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {SLOW_LENGTH}\r\n\r\n{{"
    ).encode()


class Flood:
    """The slow clients: each holds one connection and trickles its body, reconnecting when
    the proxy refuses or cuts it."""

    def __init__(self, port: int, clients: int) -> None:
        self.port = port
        self.clients = clients
        self.stop = asyncio.Event()
        self.connected = 0  # connections open right now
        self.answers: Counter[int] = Counter()  # what the proxy answered them
        self.connects = 0
        self.connect_errors = 0

    async def run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(self.clients)))

    async def _client(self, index: int) -> None:
        # Spread the first connections over a second, as a real flood ramps up.
        await asyncio.sleep(index / self.clients)
        while not self.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(
                    u.LOOPBACK, self.port, local_addr=(SLOW_ADDRESS, 0)
                )
            except OSError:
                self.connect_errors += 1
                await self._pause(0.5)
                continue
            self.connects += 1
            self.connected += 1
            try:
                writer.write(slow_head())
                while not self.stop.is_set():
                    try:
                        data = await asyncio.wait_for(reader.read(256), 1.0)
                    except TimeoutError:
                        writer.write(b" ")  # one byte a second
                        continue
                    if data.startswith(b"HTTP/1.1 "):
                        self.answers[int(data[9:12])] += 1
                    else:
                        self.answers[0] += 1  # closed without an answer
                    break
            except (ConnectionError, OSError):
                self.answers[0] += 1
            finally:
                self.connected -= 1
                writer.close()
            await self._pause(0.5)

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            pass


async def good_requests(url: str, count: int, spacing: float) -> Counter[str]:
    """``count`` chat requests from 127.0.0.1, ``spacing`` seconds apart; outcome counts."""
    outcomes: Counter[str] = Counter()
    timeout = aiohttp.ClientTimeout(total=10)
    connector = aiohttp.TCPConnector(limit=16, local_addr=(GOOD_ADDRESS, 0))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:

        async def one() -> None:
            try:
                async with client.post(
                    url + u.REQUEST_PATH,
                    data=BODY,
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    await resp.read()
                    outcomes[str(resp.status)] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcomes[type(exc).__name__] += 1

        tasks = []
        for _ in range(count):
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(spacing)
        await asyncio.gather(*tasks)
    return outcomes


async def drive(args: argparse.Namespace, port: int, admin: int) -> dict[str, Any]:
    flood = Flood(port, args.slow)
    flooding = asyncio.create_task(flood.run())
    # The flood in place: every slow client connected once (taken in or refused).
    deadline = time.monotonic() + 30
    while flood.connects < args.slow and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    held_before = u.http_json(f"http://{u.LOOPBACK}:{admin}/status")["limits"]
    started = time.monotonic()
    outcomes = await good_requests(f"http://{u.LOOPBACK}:{port}", args.good, args.spacing)
    elapsed = time.monotonic() - started
    limits = u.http_json(f"http://{u.LOOPBACK}:{admin}/status")["limits"]
    flood.stop.set()
    await flooding
    return {
        "slow_clients": args.slow,
        "max_connections": args.max_connections,
        "good_requests": args.good,
        "good_ok": outcomes.get("200", 0),
        "good_outcomes": dict(outcomes),
        "good_window_s": round(elapsed, 1),
        "connections_open_when_good_started": held_before["connections_open"],
        "slow_connects": flood.connects,
        "slow_answers": {str(k): v for k, v in sorted(flood.answers.items())},
        "limits": limits,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", type=int, default=1000, help="slow clients (127.0.0.2)")
    parser.add_argument("--max-connections", type=int, default=1000)
    parser.add_argument("--good", type=int, default=100, help="good requests (127.0.0.1)")
    parser.add_argument("--spacing", type=float, default=0.15, help="seconds between two")
    parser.add_argument(
        "--limits", default="", help='extra [limits] TOML lines, e.g. "max_connections_per_ip = 0"'
    )
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.slow + args.good + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))

    with tempfile.TemporaryDirectory(prefix="slow-flood-") as tmp:
        folder = Path(tmp)
        region_port, port, admin = u.free_port(), u.free_port(), u.free_port()
        region = u.Service(
            "fake region",
            [
                sys.executable,
                "-m",
                "edgeproxy.testing",
                "--name",
                "origin",
                "--port",
                str(region_port),
                "--http1-only",
            ],
            folder / "region.log",
        ).start()
        config = folder / "edge.toml"
        config.write_text(
            u.edgeproxy_toml(
                port,
                admin,
                f"http://{u.LOOPBACK}:{region_port}",
                f"\n[limits]\nmax_connections = {args.max_connections}\n{args.limits}\n",
            )
        )
        proxy = u.Service(
            "edgeproxy",
            [sys.executable, "-m", "edgeproxy", "serve", "--config", str(config)],
            folder / "edgeproxy.log",
        ).start()
        try:
            region.wait_http(f"http://{u.LOOPBACK}:{region_port}/healthz")
            proxy.wait_http(f"http://{u.LOOPBACK}:{admin}/readyz")
            result = asyncio.run(drive(args, port, admin))
        finally:
            proxy.stop()
            region.stop()

    limits = result["limits"]
    print(
        f"good requests: {result['good_ok']}/{result['good_requests']} answered 200 "
        f"over {result['good_window_s']} s ({result['good_outcomes']})"
    )
    print(
        f"slow clients: {result['slow_clients']} from {SLOW_ADDRESS} against max_connections "
        f"{result['max_connections']} (per address: {limits['max_connections_per_ip']}); "
        f"{result['connections_open_when_good_started']} connections open when the good "
        f"requests started; {result['slow_connects']} slow connects in all"
    )
    print(
        f"listener: refused {limits['connections_refused']} (listener full), "
        f"{limits['connections_refused_per_ip']} (address over its cap); 408s: "
        f"{limits['slow_bodies']} under min_body_rate, {limits['body_deadlines']} past "
        f"body_deadline, {limits['body_timeouts']} idle"
    )
    print(json.dumps(result, indent=2))
    target = 0.99 * result["good_requests"]
    return 0 if result["good_ok"] >= target else 1


if __name__ == "__main__":
    sys.exit(main())
