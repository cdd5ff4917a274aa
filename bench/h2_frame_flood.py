"""Oversized HTTP/2 frames: what do clients declaring 16 MiB frames cost the listener?

    python bench/h2_frame_flood.py [--connections 20] [--megabytes 16] [--source DIR]

``edgeproxy serve`` (its own process, ``http2`` and ``h2c`` on) listens in front of a fake
region (its own process) whose answers stream slowly (a token a second). Each of
``--connections`` raw h2c clients opens one streaming chat request, waits for its answer's
head, then sends a DATA frame header declaring 16 MiB - 1 on that stream (past the 16 KiB
SETTINGS_MAX_FRAME_SIZE the proxy advertises) and ``--megabytes`` of its payload in 64 KiB
writes, for as long as the proxy reads them.

Prints the proxy's RSS before, once every client sent what it could, and after the
clients left, and what each client got back (GOAWAY and its error code, or nothing).
``--source`` runs the proxy from another checkout (an older commit, to compare). Exits 1
when the RSS grew by 20 MB or more. Everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import hpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util as u  # noqa: E402

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADER = struct.Struct(">BHBBL")
DATA, HEADERS, SETTINGS, GOAWAY = 0x0, 0x1, 0x4, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
CHUNK = 64 * 1024
BODY = json.dumps(
    {"model": "fake-llm", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    size = len(payload)
    return _HEADER.pack(size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Client:
    """One raw h2c connection: a streaming request, then the oversized frame."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.goaway: int | None = None
        self.sent = 0
        self.head = asyncio.Event()
        self.closed = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        reader, writer = await asyncio.open_connection(u.LOOPBACK, self.port)
        self.writer = writer
        fields = [
            (":method", "POST"),
            (":path", u.REQUEST_PATH),
            (":scheme", "http"),
            (":authority", "bench"),
            ("content-type", "application/json"),
        ]
        block = hpack.Encoder().encode(fields)
        writer.write(PREFACE + frame(SETTINGS, 0, 0))
        writer.write(frame(HEADERS, END_HEADERS, 1, block) + frame(DATA, 0, 1, BODY))
        asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        buffer = b""
        try:
            while data := await reader.read(65536):
                buffer += data
                while len(buffer) >= 9:
                    hi, lo, kind, flags, _ = _HEADER.unpack_from(buffer)
                    end = 9 + (hi << 16 | lo)
                    if len(buffer) < end:
                        break
                    if kind == SETTINGS and not flags & ACK and self.writer is not None:
                        self.writer.write(frame(SETTINGS, ACK, 0))
                    elif kind == HEADERS:
                        self.head.set()
                    elif kind == GOAWAY:
                        self.goaway = struct.unpack(">L", buffer[13:17])[0]
                    buffer = buffer[end:]
        except OSError:
            pass
        finally:
            self.closed.set()

    async def flood(self, megabytes: int) -> None:
        writer = self.writer
        assert writer is not None
        # Stream 1 stays open: its body never ends (END_STREAM never sent).
        writer.write(_HEADER.pack(0xFF, 0xFFFF, DATA, 0, 1))
        chunk = b"x" * CHUNK
        try:
            for _ in range(megabytes * 1024 * 1024 // CHUNK):
                if self.closed.is_set() or writer.is_closing():
                    return
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 5)
                self.sent += CHUNK
        except (OSError, TimeoutError):
            pass

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def drive(args: argparse.Namespace, port: int, pid: int) -> dict[str, object]:
    before = rss_mb(pid)
    clients = [Client(port) for _ in range(args.connections)]
    for client in clients:
        await client.open()
    await asyncio.wait_for(asyncio.gather(*(c.head.wait() for c in clients)), 30)
    started = time.monotonic()
    await asyncio.gather(*(c.flood(args.megabytes) for c in clients))
    await asyncio.sleep(1.0)
    during = rss_mb(pid)
    flood_s = time.monotonic() - started
    for client in clients:
        client.close()
    await asyncio.sleep(2.0)
    after = rss_mb(pid)
    goaways = Counter(str(c.goaway) if c.goaway is not None else "none" for c in clients)
    return {
        "connections": args.connections,
        "rss_before_mb": round(before, 1),
        "rss_flooded_mb": round(during, 1),
        "rss_after_mb": round(after, 1),
        "grown_mb": round(during - before, 1),
        "bytes_taken_by_proxy": sum(c.sent for c in clients),
        "goaway_codes": dict(goaways),
        "flood_s": round(flood_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=20)
    parser.add_argument("--megabytes", type=int, default=16, help="payload sent per client")
    parser.add_argument("--source", default="", help="a checkout to run the proxy from")
    args = parser.parse_args()
    env = None
    cwd = None
    if args.source:
        cwd = Path(args.source).resolve()
        env = {**os.environ, "PYTHONPATH": str(cwd)}
    with tempfile.TemporaryDirectory(prefix="h2-frame-flood-") as tmp:
        folder = Path(tmp)
        region_port, port, admin = u.free_port(), u.free_port(), u.free_port()
        region = u.Service(
            "fake region",
            [
                sys.executable,
                "-m",
                "edgeproxy.testing",
                "--port",
                str(region_port),
                "--http1-only",
                "--inter-token-delay",
                "1.0",
                "--tokens",
                "120",
            ],
            folder / "region.log",
        ).start()
        config = folder / "edge.toml"
        text = u.edgeproxy_toml(port, admin, f"http://{u.LOOPBACK}:{region_port}")
        config.write_text(text.replace("[server]\n", "[server]\nhttp2 = true\nh2c = true\n", 1))
        proxy = u.Service(
            "edgeproxy",
            [sys.executable, "-m", "edgeproxy", "serve", "--config", str(config)],
            folder / "edgeproxy.log",
            env=env,
            cwd=cwd,
        ).start()
        try:
            region.wait_http(f"http://{u.LOOPBACK}:{region_port}/healthz")
            proxy.wait_http(f"http://{u.LOOPBACK}:{admin}/readyz")
            assert proxy.proc is not None
            result = asyncio.run(drive(args, port, proxy.proc.pid))
            limits = u.http_json(f"http://{u.LOOPBACK}:{admin}/status")["limits"]
        finally:
            proxy.stop()
            region.stop()
    result["h2_protocol_errors"] = limits["h2_protocol_errors"]
    print(json.dumps(result, indent=2))
    return 0 if float(str(result["grown_mb"])) < 20 else 1


if __name__ == "__main__":
    sys.exit(main())
