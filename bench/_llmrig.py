"""The rig shared by the LLM-routing benchmarks: fake LLM regions, ``edgeproxy serve``
processes, Redis, streaming clients, and the regions' gauges sampled as they run.

Used by ``bench_llm_routing.py`` (prefix affinity) and ``bench_herding.py`` (PoPs
sharing a load view).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:  # run as a script: make the helpers importable
    sys.path.insert(0, str(HERE))

import _util as u  # noqa: E402

PYTHON = sys.executable
CHAT_PATH = "/v1/chat/completions"
DOCS_CONFIG = REPO / "docs" / "configuration.md"
KV_BLOCK = 16

# -- which features have landed ------------------------------------------------------


def documented_keys(path: Path = DOCS_CONFIG) -> dict[str, str]:
    """``key -> type`` from the config table of docs/configuration.md (a test keeps that
    table equal to ``edgeproxy config-docs``)."""
    keys: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return keys
    for match in re.finditer(r"^\| `([a-z0-9_.]+)` \| `([^`]*)` \|", text, re.M):
        keys[match.group(1)] = match.group(2)
    return keys


# The LLM-aware policy's keys, and the values that turn it on.
AFFINITY_ROUTING = {"prefix_affinity": True}
AFFINITY_REGION = {"load_reporting": "header"}  # ask every answer for its ORCA load header
SHARED_VIEW_KEY = "shared_load.redis_url"


@dataclass
class Features:
    """The config keys of the LLM-aware routing found in the docs, and the values used."""

    routing: dict[str, Any] = field(default_factory=dict)  # [routing] key -> value
    region: dict[str, Any] = field(default_factory=dict)  # per [[regions]] key -> value
    affinity_missing: str | None = None
    shared_view_key: str | None = None  # "section.key" of the shared view's Redis URL
    shared_view_missing: str | None = None

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def detect_features(keys: dict[str, str]) -> Features:
    found = Features(routing=dict(AFFINITY_ROUTING), region=dict(AFFINITY_REGION))
    missing = [f"routing.{k}" for k in AFFINITY_ROUTING if f"routing.{k}" not in keys]
    missing += [f"regions.{k}" for k in AFFINITY_REGION if f"regions.{k}" not in keys]
    if missing:
        found.affinity_missing = f"{', '.join(missing)} not in docs/configuration.md"
    if SHARED_VIEW_KEY in keys:
        found.shared_view_key = SHARED_VIEW_KEY
    else:
        found.shared_view_missing = f"{SHARED_VIEW_KEY} not in docs/configuration.md"
    return found


@dataclass
class RegionSpec:
    name: str
    lat: float = 0.0
    lon: float = 0.0
    ttft: float = 0.02
    per_uncached: float = 0.0
    per_cached: float = 0.0
    kv_blocks: int = 0
    max_running: int = 0
    tokens: int = 16
    inter_token: float = 0.008


@dataclass
class Rig:
    tmp: Path
    regions: dict[str, u.Service] = field(default_factory=dict)
    region_ports: dict[str, int] = field(default_factory=dict)
    specs: dict[str, RegionSpec] = field(default_factory=dict)
    proxies: dict[str, u.Service] = field(default_factory=dict)
    proxy_ports: dict[str, tuple[int, int]] = field(default_factory=dict)
    redis: u.Service | None = None

    def start_region(self, spec: RegionSpec) -> None:
        port = u.free_port()
        argv = [
            PYTHON, "-m", "edgeproxy.testing",
            "--name", spec.name, "--port", str(port), "--seed", "7",
            "--ttft", f"{spec.ttft}",
            "--tokens", str(spec.tokens),
            "--inter-token-delay", f"{spec.inter_token}",
            "--kv-capacity-blocks", str(spec.kv_blocks),
            "--kv-block-size", str(KV_BLOCK),
            "--ttft-per-uncached-token", f"{spec.per_uncached}",
            "--ttft-per-cached-token", f"{spec.per_cached}",
            "--max-running", str(spec.max_running),
        ]  # fmt: skip
        service = u.Service(f"region-{spec.name}", argv, self.tmp / f"region-{spec.name}.log")
        service.cwd = REPO
        service.start()
        service.wait_http(f"http://127.0.0.1:{port}/healthz")
        self.regions[spec.name] = service
        self.region_ports[spec.name] = port
        self.specs[spec.name] = spec

    def region_post(self, name: str, path: str) -> None:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.region_ports[name]}{path}", data=b"{}", method="POST"
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            resp.read()

    def reset_regions(self) -> None:
        for name in self.regions:
            self.region_post(name, "/_control/clear-kv-cache")
            self.region_post(name, "/_control/reset-counters")

    def counters(self) -> dict[str, dict[str, Any]]:
        return {
            name: u.http_json(f"http://127.0.0.1:{port}/_control")["counters"]
            for name, port in self.region_ports.items()
        }

    def start_redis(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise u.ServiceError("redis-server not found")
        port = u.free_port()
        data = self.tmp / "redis"
        data.mkdir(exist_ok=True)
        argv = [
            binary, "--port", str(port), "--bind", u.LOOPBACK, "--save", "",
            "--appendonly", "no", "--dir", str(data),
        ]  # fmt: skip
        self.redis = u.Service("redis", argv, self.tmp / "redis.log").start()
        self.redis.wait_line("Ready to accept connections", timeout=20)
        return f"redis://127.0.0.1:{port}/0"

    def start_proxy(
        self,
        name: str,
        *,
        pop: tuple[str, float, float] = ("bench", 0.0, 0.0),
        routing: dict[str, Any] | None = None,
        region_keys: dict[str, Any] | None = None,
        sections: dict[str, dict[str, Any]] | None = None,
        plugin: str | None = None,
    ) -> None:
        port, admin = u.free_port(), u.free_port()
        tables: dict[str, dict[str, Any]] = {
            "server": {"host": u.LOOPBACK, "port": port, "grace_period": 2.0},
            "admin": {"host": u.LOOPBACK, "port": admin},
            "pop": {"name": pop[0], "lat": pop[1], "lon": pop[2]},
            "upstream": {"connect_timeout": 1.0, "read_timeout": 30.0},
            "cache": {"enabled": False},
            "plugins": {"entry_points": False},
            "routing": dict(routing or {}),
        }
        if plugin is not None:
            path = self.tmp / f"{name}-plugin.py"
            path.write_text(plugin)
            tables["plugins"]["enabled"] = [str(path)]
        for section, values in (sections or {}).items():
            tables.setdefault(section, {}).update(values)
        lines: list[str] = []
        for section, values in tables.items():
            if values:
                lines.append(f"[{section}]")
                lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
        for region, spec in self.specs.items():
            lines += [
                "[[regions]]",
                f"name = {toml_value(region)}",
                f'url = "http://127.0.0.1:{self.region_ports[region]}"',
                f"lat = {spec.lat}",
                f"lon = {spec.lon}",
            ]
            lines += [f"{key} = {toml_value(value)}" for key, value in (region_keys or {}).items()]
        config = self.tmp / f"{name}.toml"
        config.write_text("\n".join(lines) + "\n")
        argv = [PYTHON, "-m", "edgeproxy", "serve", "--config", str(config)]
        service = u.Service(
            f"proxy-{name}", [*argv, "--log-level", "warning"], self.tmp / f"{name}.log"
        )
        service.cwd = REPO
        service.start()
        service.wait_http(f"http://127.0.0.1:{admin}/readyz", timeout=30)
        self.proxies[name] = service
        self.proxy_ports[name] = (port, admin)

    def proxy_status(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = u.http_json(f"http://127.0.0.1:{self.proxy_ports[name][1]}/status")
        return data

    def stop_proxies(self) -> None:
        for service in self.proxies.values():
            service.stop()
        self.proxies.clear()
        self.proxy_ports.clear()

    def stop_regions(self) -> None:
        for service in self.regions.values():
            service.stop()
        self.regions.clear()
        self.region_ports.clear()
        self.specs.clear()

    def stop(self) -> None:
        self.stop_proxies()
        self.stop_regions()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


@dataclass
class Result:
    """One client request."""

    at: float  # seconds since the load started, when it was sent
    ttft: float | None  # seconds to the first streamed byte; None when it failed
    status: int
    region: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pop: str = ""
    # What the region says it took: its queue wait plus its modelled TTFT (seconds),
    # free of the client's and the proxy's CPU time.
    region_ttft: float | None = None


async def stream_chat(
    session: Any, url: str, body: dict[str, Any], loop: asyncio.AbstractEventLoop
) -> tuple[Result, str]:
    """Send one streaming chat request; (result, the answer's text)."""
    sent = loop.time()
    status, ttft, region, text = 0, None, "", []
    prompt = cached = 0
    region_ttft: float | None = None
    try:
        async with session.post(url, json=body) as resp:
            status = resp.status
            region = resp.headers.get("x-fake-region", "")
            prompt = int(resp.headers.get("x-fake-kv-prompt-tokens", 0))
            cached = int(resp.headers.get("x-fake-kv-cached-tokens", 0))
            modelled = resp.headers.get("x-fake-ttft-ms")
            queued = resp.headers.get("x-fake-queue-ms")
            if modelled is not None and queued is not None:
                region_ttft = (float(modelled) + float(queued)) / 1000
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                if ttft is None and chunk:
                    ttft = loop.time() - sent
                buf += chunk
        if status == 200:
            for line in bytes(buf).split(b"\n"):
                if line.startswith(b"data: {"):
                    delta = json.loads(line[6:])["choices"][0].get("delta", {})
                    text.append(delta.get("content") or "")
        else:
            ttft = None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        ttft = None
    result = Result(0.0, ttft, status, region, prompt, cached, region_ttft=region_ttft)
    return result, "".join(text)


@dataclass
class Gauge:
    at: float
    region: str
    running: int
    waiting: int


async def sample_regions(
    rig: Rig, every: float, stop: asyncio.Event, start: float, out: list[Gauge]
) -> None:
    """Poll each region's counters (``GET /_control``) every ``every`` s until ``stop``."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while not stop.is_set():
            tick = loop.time()

            async def one(name: str, port: int, at: float) -> None:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/_control") as resp:
                        c = (await resp.json())["counters"]
                    out.append(Gauge(at, name, c["requests_running"], c["requests_waiting"]))
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                    pass

            await asyncio.gather(*(one(n, p, tick - start) for n, p in rig.region_ports.items()))
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, tick + every - loop.time()))
            except TimeoutError:
                pass


def ms(values: Sequence[float], q: float) -> float | None:
    return u.percentile(sorted(values), q) * 1000 if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def gauge_stats(
    gauges: list[Gauge], regions: Sequence[str], lo: float, hi: float
) -> dict[str, Any]:
    per: dict[str, Any] = {}
    for name in regions:
        mine = [g for g in gauges if g.region == name and lo <= g.at < hi]
        load = [g.running + g.waiting for g in mine]
        waiting = [g.waiting for g in mine]
        per[name] = {
            "samples": len(mine),
            "mean_in_flight": sum(load) / len(load) if load else 0.0,
            "max_in_flight": max(load, default=0),
            "mean_waiting": sum(waiting) / len(waiting) if waiting else 0.0,
            "max_waiting": max(waiting, default=0),
            "p95_waiting": u.percentile(sorted(waiting), 95) if waiting else 0.0,
        }
    return per


def spread(values: Sequence[float]) -> float | None:
    """max / mean: 1.0 is a perfect spread, 3.0 everything on one of three."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else None
