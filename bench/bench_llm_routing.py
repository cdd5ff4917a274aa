"""LLM-aware routing: KV-cache (prefix) affinity and region load, and herding across PoPs.

    .venv/bin/python bench/bench_llm_routing.py            # about 7 minutes
    .venv/bin/python bench/bench_llm_routing.py --quick    # about 3 minutes, a smoke run

Everything runs on 127.0.0.1: fake regions (``python -m edgeproxy.testing``, each its
own process, modelling an LLM server: a FIFO queue in front of ``--max-running``
slots and an LRU prefix (KV) cache whose hits shorten the time to first token),
``edgeproxy serve`` processes with real config files, and one driver process.

**Part 1, prefix affinity.** A multi-turn chat workload: ``--users`` simulated users
(5 to 10 turns each) whose conversations start with one of 4 shared system prompts of
about 400 tokens, then a first user message of 150-300 tokens and 30-100 tokens per
later turn, plus the streamed answers, so each prompt is the previous turn's prompt
and a bit more. Users start at random over the first ``--ramp`` seconds and send
their next turn a think time (2-6 s) after the previous answer ended (open loop per
user). Three identical regions (``ttft`` 20 ms + 0.2 ms per uncached prompt token +
0.02 ms per cached one, 16 answer tokens 8 ms apart) each hold a ``--kv-share`` of the
workload's KV working set, so one region can keep its share of the users warm but
not everybody. The same workload (same seed) runs through three policies, one after
the other, each against a cold cache and zeroed counters:

* ``round-robin``: a 20-line plugin (``edgeproxy_route`` hook) that rotates the
  candidates in config order;
* ``p2c``: today's default (geo prior, peak-EWMA, power of two choices);
* ``affinity+load``: the LLM-aware policy: prefix affinity and the regions' own
  load reports on (its keys are read from docs/configuration.md; when they are
  not there yet the policy is reported as skipped).

Then ``p2c`` and ``affinity+load`` again with smaller caches (``--tight-kv-shares``).
Reported per policy: client-side TTFT (request sent to first streamed byte) p50 /
p90 / p99, the KV hit rate (cached / prompt tokens, from the regions' counters), and
the load spread: max / mean over the regions of their time-averaged requests in
flight (sampled every 0.25 s), and of their request counts.

**Part 2, herding.** Three ``edgeproxy serve`` processes (PoPs in Frankfurt, Paris
and Amsterdam) in front of three regions, one of which (``eu-central``) is nearest
to every PoP and answers fastest; each PoP gets its own load (Poisson arrivals, and
bursts that come 0.4 s after the previous PoP's), together more than ``eu-central``
can take alone, routed by today's default (``--herd-policy affinity+load``: the
LLM-aware policy, every request with one shared system prompt). Run with the shared
load view off, then on (a ``redis-server`` started on a free port, stopped at the end).
Reported: the regions' queue depth (``requests_waiting``, sampled every 0.1 s: max and
mean per region) and the client-side TTFT p50 / p99.

Printed, and written to ``bench/results/llm_routing.{md,json}``,
``llm_routing_ttft.png`` (TTFT CDF per policy) and ``llm_routing_herding.png``
(queue depth over time, shared view off and on).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:  # run as a script: make the helpers importable
    sys.path.insert(0, str(HERE))

import _report  # noqa: E402
import _util as u  # noqa: E402

PYTHON = sys.executable
CHAT_PATH = "/v1/chat/completions"
POLICIES = ("round-robin", "p2c", "affinity+load")
HERD_MODES = ("shared view off", "shared view on")
DOCS_CONFIG = REPO / "docs" / "configuration.md"

# Part 1: three identical regions.
KV_BLOCK = 16
SYSTEM_PROMPTS = 4
SYSTEM_TOKENS = 400
ANSWER_TOKENS = 16
# KV tokens per answer token: the fake's words are 3-8 letters, cut in 4-letter pieces.
KV_TOKENS_PER_ANSWER_TOKEN = 2

# Part 2: PoPs and regions (name, lat, lon, base ttft s: a round trip grows with distance).
HERD_POPS = (("fra", 50.1, 8.7), ("par", 48.9, 2.4), ("ams", 52.4, 4.9))
HERD_REGIONS = (
    ("eu-central", 50.1, 8.7, 0.020),
    ("us-east", 38.9, -77.4, 0.080),
    ("ap-south", 19.1, 72.9, 0.090),
)
HERD_TOKENS = 12

ROUND_ROBIN_PLUGIN = '''
"""Round-robin over the candidates, in config order (the benchmark's baseline)."""
import itertools

from edgeproxy import hookimpl

_order = {}
_turn = itertools.count()


@hookimpl
def edgeproxy_startup(proxy):
    _order.update((region.name, i) for i, region in enumerate(proxy.regions))


@hookimpl
def edgeproxy_route(candidates):
    ordered = sorted(candidates, key=lambda region: _order.get(region.name, 0))
    if not ordered:
        return None
    i = next(_turn) % len(ordered)
    return ordered[i:] + ordered[:i]
'''


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


# -- the workload ------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> str:
    """``n`` words of 3-4 letters: one KV token each for the fake region's tokeniser."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choices(letters, k=rng.choice((3, 4)))) for _ in range(n))


@dataclass
class User:
    index: int
    system: int
    start: float
    messages: list[str]
    thinks: list[float]


def make_users(n: int, ramp: float, seed: int) -> tuple[list[str], list[User]]:
    rng = random.Random(seed)
    systems = [
        f"You are assistant persona {i}. " + _words(rng, SYSTEM_TOKENS)
        for i in range(SYSTEM_PROMPTS)
    ]
    users = []
    for i in range(n):
        turns = rng.randint(5, 10)
        messages = [_words(rng, rng.randint(150, 300))]
        messages += [_words(rng, rng.randint(30, 100)) for _ in range(turns - 1)]
        users.append(
            User(
                index=i,
                system=rng.randrange(SYSTEM_PROMPTS),
                start=rng.uniform(0.0, ramp),
                messages=messages,
                thinks=[rng.uniform(2.0, 6.0) for _ in range(turns)],
            )
        )
    return systems, users


def working_set_blocks(systems: Sequence[str], users: Sequence[User]) -> int:
    """KV blocks of every distinct prompt prefix the workload builds, answers estimated."""
    system_blocks = [(len(s.split()) + 1) // KV_BLOCK for s in systems]
    total = sum(system_blocks)
    for user in users:
        tokens = len(systems[user.system].split()) + 1
        for message in user.messages:
            tokens += 1 + len(message.split()) + 1 + ANSWER_TOKENS * KV_TOKENS_PER_ANSWER_TOKEN
        total += tokens // KV_BLOCK - system_blocks[user.system]
    return total


# -- the rig -------------------------------------------------------------------------


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
    tokens: int = ANSWER_TOKENS
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
        import urllib.request

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
                lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
        for region, spec in self.specs.items():
            lines += [
                "[[regions]]",
                f"name = {_toml(region)}",
                f'url = "http://127.0.0.1:{self.region_ports[region]}"',
                f"lat = {spec.lat}",
                f"lon = {spec.lon}",
            ]
            lines += [f"{key} = {_toml(value)}" for key, value in (region_keys or {}).items()]
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


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


# -- measuring -----------------------------------------------------------------------


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


async def _stream(
    session: Any, url: str, body: dict[str, Any], loop: asyncio.AbstractEventLoop
) -> tuple[Result, str]:
    """Send one streaming chat request; (result, the answer's text)."""
    import aiohttp

    sent = loop.time()
    status, ttft, region, text = 0, None, "", []
    prompt = cached = 0
    try:
        async with session.post(url, json=body) as resp:
            status = resp.status
            region = resp.headers.get("x-fake-region", "")
            prompt = int(resp.headers.get("x-fake-kv-prompt-tokens", 0))
            cached = int(resp.headers.get("x-fake-kv-cached-tokens", 0))
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
    return Result(0.0, ttft, status, region, prompt, cached), "".join(text)


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
    import aiohttp

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


async def run_chat(
    rig: Rig, proxy: str, systems: list[str], users: list[User], cap: float
) -> tuple[list[Result], list[Gauge], float]:
    """Every user's conversation through ``proxy``; stops at ``cap`` seconds whatever."""
    import aiohttp

    port = rig.proxy_ports[proxy][0]
    url = f"http://127.0.0.1:{port}{CHAT_PATH}"
    loop = asyncio.get_running_loop()
    results: list[Result] = []
    gauges: list[Gauge] = []
    stop = asyncio.Event()
    start = loop.time() + 0.2
    deadline = start + cap

    async def converse(session: aiohttp.ClientSession, user: User) -> None:
        history: list[dict[str, str]] = [{"role": "system", "content": systems[user.system]}]
        await asyncio.sleep(max(0.0, start + user.start - loop.time()))
        for message, think in zip(user.messages, user.thinks, strict=True):
            if loop.time() >= deadline:
                return
            history.append({"role": "user", "content": message})
            body = {
                "model": "fake-llm",
                "messages": history,
                "stream": True,
                "max_tokens": ANSWER_TOKENS,
                "temperature": 0.7,
                "user": f"user-{user.index}",
            }
            at = loop.time() - start
            result, answer = await _stream(session, url, body, loop)
            result.at = at
            results.append(result)
            history.append({"role": "assistant", "content": answer})
            await asyncio.sleep(think)

    sampler = asyncio.create_task(sample_regions(rig, 0.25, stop, start, gauges))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(converse(session, user)) for user in users]
        done, pending = await asyncio.wait(tasks, timeout=cap + 35)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    stop.set()
    await sampler
    return results, gauges, loop.time() - start


@dataclass
class HerdLoad:
    """Each PoP's own load: Poisson at ``rate`` throughout, and after ``warm`` seconds a
    burst of ``burst`` requests (over ``burst_len`` s) every ``period`` s, PoP *i*'s bursts
    ``i x stagger`` s after PoP 0's: each PoP's clients are busy at their own moments."""

    rate: float
    warm: float
    seconds: float
    burst: int
    period: float
    stagger: float
    burst_len: float = 0.2

    def schedule(self, pop: int, rng: random.Random) -> list[float]:
        end = self.warm + self.seconds
        times, t = [], 0.0
        while self.rate > 0:
            t += rng.expovariate(self.rate)
            if t >= end:
                break
            times.append(t)
        first = self.warm + pop * self.stagger
        k = 0
        while first + k * self.period + self.burst_len < end and self.burst > 0:
            at = first + k * self.period
            times += [at + j * self.burst_len / self.burst for j in range(self.burst)]
            k += 1
        return sorted(times)

    def offered(self) -> float:
        """Requests per second per PoP once the bursts started."""
        return self.rate + self.burst / self.period if self.period > 0 else self.rate


async def run_herd(
    rig: Rig, load: HerdLoad, seed: int, system: str | None = None
) -> tuple[list[Result], list[Gauge]]:
    """Every PoP's schedule of streaming chat requests, each to its own PoP."""
    import aiohttp

    loop = asyncio.get_running_loop()
    results: list[Result] = []
    gauges: list[Gauge] = []
    stop = asyncio.Event()
    start = loop.time() + 0.2
    tasks: set[asyncio.Task[None]] = set()
    rng = random.Random(seed)

    async def one(session: aiohttp.ClientSession, pop: str, n: int, at: float) -> None:
        port = rig.proxy_ports[pop][0]
        messages = [{"role": "user", "content": f"{pop} request {n}: " + "word " * 40}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        body = {
            "model": "fake-llm",
            "messages": messages,
            "stream": True,
            "max_tokens": HERD_TOKENS,
            "temperature": 0.7,
        }
        result, _ = await _stream(session, f"http://127.0.0.1:{port}{CHAT_PATH}", body, loop)
        result.at, result.pop = at, pop
        results.append(result)

    async def generate(session: aiohttp.ClientSession, pop: str, times: list[float]) -> None:
        for n, t in enumerate(times):
            await asyncio.sleep(max(0.0, start + t - loop.time()))
            task = asyncio.create_task(one(session, pop, n, t))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    sampler = asyncio.create_task(sample_regions(rig, 0.1, stop, start, gauges))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        generators = [
            generate(session, pop, load.schedule(i, random.Random(rng.random())))
            for i, (pop, *_) in enumerate(HERD_POPS)
        ]
        await asyncio.gather(*generators)
        if tasks:
            await asyncio.wait(set(tasks), timeout=35)
        for task in list(tasks):
            task.cancel()
    stop.set()
    await sampler
    return results, gauges


# -- summaries -----------------------------------------------------------------------


def _ms(values: Sequence[float], q: float) -> float | None:
    return u.percentile(sorted(values), q) * 1000 if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
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


def summarize_chat(
    results: list[Result], gauges: list[Gauge], counters: dict[str, Any], seconds: float
) -> dict[str, Any]:
    ok = [r.ttft for r in results if r.ttft is not None]
    regions = sorted(counters)
    busy = gauge_stats(gauges, regions, 0.0, math.inf)
    prompt = sum(c["prompt_tokens_total"] for c in counters.values())
    cached = sum(c["cached_tokens_total"] for c in counters.values())
    hdr_prompt = sum(r.prompt_tokens for r in results)
    hdr_cached = sum(r.cached_tokens for r in results)
    requests = {name: counters[name]["requests_by_path"].get(CHAT_PATH, 0) for name in regions}
    return {
        "requests": len(results),
        "errors": sum(1 for r in results if r.ttft is None),
        "statuses": dict(Counter(str(r.status) for r in results if r.status != 200)),
        "seconds": round(seconds, 1),
        "rate": len(results) / seconds if seconds else None,
        "ttft_p50_ms": _ms(ok, 50),
        "ttft_p90_ms": _ms(ok, 90),
        "ttft_p99_ms": _ms(ok, 99),
        "kv_hit_rate": cached / prompt if prompt else None,
        "kv_hit_rate_headers": hdr_cached / hdr_prompt if hdr_prompt else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "region_requests": requests,
        "region_hit_rate": {n: counters[n]["kv_hit_rate"] for n in regions},
        "region_evicted_blocks": {n: counters[n]["kv_evicted_blocks_total"] for n in regions},
        "region_busy": busy,
        "spread_in_flight": spread([busy[n]["mean_in_flight"] for n in regions]),
        "spread_requests": spread([float(v) for v in requests.values()]),
        "mean_waiting": sum(b["mean_waiting"] for b in busy.values()),
        "ttft_ms": sorted(round(t * 1000, 2) for t in ok),
    }


def summarize_herd(
    results: list[Result], gauges: list[Gauge], warm: float, seconds: float
) -> dict[str, Any]:
    regions = [name for name, *_ in HERD_REGIONS]
    loaded = [r for r in results if r.at >= warm]
    ok = [r.ttft for r in loaded if r.ttft is not None]
    busy = gauge_stats(gauges, regions, warm, warm + seconds)
    hottest = max(regions, key=lambda n: (busy[n]["max_waiting"], busy[n]["mean_waiting"]))
    served = Counter(r.region for r in loaded)
    return {
        "requests": len(loaded),
        "errors": sum(1 for r in loaded if r.ttft is None),
        "statuses": dict(Counter(str(r.status) for r in loaded if r.status != 200)),
        "ttft_p50_ms": _ms(ok, 50),
        "ttft_p99_ms": _ms(ok, 99),
        "region_requests": {n: served.get(n, 0) for n in regions},
        "region_queue": busy,
        "hottest": hottest,
        "peak_waiting": busy[hottest]["max_waiting"],
        "mean_waiting_hottest": busy[hottest]["mean_waiting"],
        "series": {
            n: [(round(g.at, 2), g.waiting) for g in gauges if g.region == n] for n in regions
        },
    }


# -- report --------------------------------------------------------------------------


def _verdict(target: dict[str, Any]) -> str:
    if target.get("skipped"):
        return "skipped"
    return "pass" if target["pass"] else "**MISS**"


def markdown(data: dict[str, Any]) -> str:
    num = _report._num
    meta = data["meta"]
    chat = data["chat"]
    lines = ["# LLM-aware routing benchmark", ""]
    lines.append(
        f"{meta['when']}, commit {meta['commit']}, {meta['cpus']} CPUs; run took "
        f"{meta['elapsed_s']} s. Everything on 127.0.0.1: fake regions modelling an LLM "
        "server (FIFO queue, LRU prefix cache), `edgeproxy serve` processes, one driver."
    )
    lines += ["", "## Targets", ""]
    rows = [[t["metric"], num(t["value"]), t["target"], _verdict(t)] for t in data["targets"]]
    lines += _report._table(["metric", "measured", "target", "result"], rows) + [""]
    for note in data["skipped"]:
        lines.append(f"- skipped: {note}")
    if data["skipped"]:
        lines.append("")
    w = chat.get("workload")
    lines += (
        []
        if w is None
        else [
            "## 1. Prefix affinity: multi-turn chat",
            "",
            f"{w['users']} users, {w['turns']} turns in all (5-10 each), {SYSTEM_PROMPTS} system "
            f"prompts of ~{SYSTEM_TOKENS} tokens; users start over {w['ramp']:g} s, think 2-6 s "
            f"between turns; streamed answers of {ANSWER_TOKENS} tokens. Three identical regions: "
            f"ttft {w['ttft_ms']:g} ms + {w['per_uncached_ms']:g} ms per uncached prompt token + "
            f"{w['per_cached_ms']:g} ms per cached one, {w['max_running']} running at once (FIFO "
            f"queue behind), {w['kv_blocks']:,} KV blocks of {KV_BLOCK} tokens each "
            f"({w['kv_share']:.0%} of the {w['working_set_blocks']:,} blocks of every prompt "
            "prefix the workload builds). "
            "Policies run one after the other on the same workload (same seed), each from a cold "
            "cache. TTFT: request sent to first streamed byte, at the client. Spread: max / mean "
            "over the regions (1.0 is even, 3.0 all on one).",
            "",
        ]
    )
    if chat.get("policies"):
        header = [
            "policy", "requests", "errors", "TTFT p50 ms", "p90 ms", "p99 ms", "KV hit rate",
            "waiting (sum of means)", "spread in flight", "spread requests", "requests per region",
        ]  # fmt: skip
        rows = []
        for name, s in chat["policies"].items():
            rows.append(
                [
                    name,
                    num(s["requests"]),
                    num(s["errors"]),
                    num(s["ttft_p50_ms"], 1),
                    num(s["ttft_p90_ms"], 1),
                    num(s["ttft_p99_ms"], 1),
                    f"{s['kv_hit_rate']:.1%}" if s["kv_hit_rate"] is not None else "-",
                    num(s["mean_waiting"], 2),
                    num(s["spread_in_flight"], 2),
                    num(s["spread_requests"], 2),
                    " / ".join(str(v) for v in s["region_requests"].values()),
                ]
            )
        lines += _report._table(header, rows) + [""]
        tight = chat.get("tighter") or {}
        if tight:
            lines += [
                "The same workload with smaller KV caches (p2c against affinity+load):",
                "",
            ]
            rows = []
            for share, by_policy in tight.items():
                for name, s in by_policy.items():
                    rows.append(
                        [
                            f"{float(share):.0%} ({s['kv_blocks']:,} blocks)",
                            name,
                            num(s["errors"]),
                            num(s["ttft_p50_ms"], 1),
                            num(s["ttft_p99_ms"], 1),
                            f"{s['kv_hit_rate']:.1%}" if s["kv_hit_rate"] is not None else "-",
                            num(s["spread_in_flight"], 2),
                        ]
                    )
                p2c, new = by_policy.get("p2c"), by_policy.get("affinity+load")
                cut = _ratio(p2c and p2c["ttft_p50_ms"], new and new["ttft_p50_ms"])
                if cut is not None:
                    rows[-1][0] += f", p50 cut {cut:.2f}x"
            header = ["KV cache per region", "policy", "errors", "TTFT p50 ms", "p99 ms"]
            lines += _report._table(header + ["KV hit rate", "spread in flight"], rows) + [""]
        used = data["features"]
        if "affinity+load" in chat["policies"]:
            keys = [f"`routing.{k} = {_toml(v)}`" for k, v in used["routing"].items()]
            keys += [f"`regions.{k} = {_toml(v)}`" for k, v in used["region"].items()]
            lines += [f"affinity+load config: {', '.join(keys)}.", ""]
    herd = data["herding"]
    if herd.get("modes"):
        hw = herd["workload"]
        lines += [
            "## 2. Herding: three PoPs, shared load view off and on",
            "",
            f"PoPs {', '.join(p for p, *_ in HERD_POPS)}, each with its own clients: Poisson "
            f"arrivals at {hw['rate']:g} req/s, and after {hw['warm']:g} s of that alone, for "
            f"{hw['seconds']:g} s, a burst of {hw['burst']} requests (over "
            f"{hw['burst_len'] * 1000:.0f} ms) every {hw['period']:g} s, each PoP's bursts "
            f"{hw['stagger'] * 1000:.0f} ms after the previous PoP's: "
            f"{3 * hw['offered_per_pop']:.1f} req/s in all on average. Regions: "
            + ", ".join(
                f"{n} (ttft {t * 1000:.0f} ms, ~{cap:.0f} req/s)"
                for (n, *_, t), cap in zip(HERD_REGIONS, hw["capacity"], strict=True)
            )
            + f", each {hw['max_running']} running at once, {HERD_TOKENS} streamed tokens "
            f"{hw['inter_token_ms']:g} ms apart; eu-central is nearest to every PoP. Routing: "
            f"{hw.get('policy', 'p2c')}. Queue "
            "depth: the regions' `requests_waiting`, sampled every 0.1 s under the full load.",
            "",
        ]
        regions = [n for n, *_ in HERD_REGIONS]
        header = ["mode", "requests", "errors", "TTFT p50 ms", "p99 ms", "hottest"]
        header += [f"{n} waiting max / mean" for n in regions]
        header += ["requests per region"]
        rows = []
        for mode, s in herd["modes"].items():
            row = [
                mode,
                num(s["requests"]),
                num(s["errors"]),
                num(s["ttft_p50_ms"], 1),
                num(s["ttft_p99_ms"], 1),
                s["hottest"],
            ]
            queue = s["region_queue"]
            row += [f"{queue[n]['max_waiting']} / {queue[n]['mean_waiting']:.1f}" for n in regions]
            row.append(" / ".join(str(s["region_requests"][n]) for n in regions))
            rows.append(row)
        lines += _report._table(header, rows) + [""]
    return "\n".join(lines)


def plots(data: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    meta = data["meta"]
    policies = data["chat"]["policies"]
    if policies:
        fig, ax = plt.subplots(figsize=(9, 5))
        for name, s in policies.items():
            values = s["ttft_ms"]
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.plot(values, ys, label=f"{name} (p50 {s['ttft_p50_ms']:.0f} ms)")
        ax.set_xscale("log")
        ax.set_xlabel("client-side TTFT, ms (log)")
        ax.set_ylabel("share of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title(
            f"TTFT CDF, multi-turn chat through edgeproxy ({meta['when']}, {meta['commit']})",
            fontsize=10,
        )
        fig.tight_layout()
        path = out / "llm_routing_ttft.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    modes = data["herding"].get("modes") or {}
    if modes:
        fig, axes = plt.subplots(len(modes), 1, figsize=(10, 3.2 * len(modes)), squeeze=False)
        top = max(
            (w for s in modes.values() for series in s["series"].values() for _, w in series),
            default=1,
        )
        warm = data["herding"]["workload"]["warm"]
        for ax, (mode, s) in zip(axes[:, 0], modes.items(), strict=True):
            for region, series in s["series"].items():
                ax.plot([t for t, _ in series], [w for _, w in series], label=region, lw=1)
            ax.axvline(warm, color="grey", ls="--", lw=0.8)
            ax.set_ylim(0, top * 1.05 + 1)
            ax.set_ylabel("requests waiting")
            ax.set_title(
                f"{mode}: peak {s['peak_waiting']} at {s['hottest']}, TTFT p99 "
                f"{_report._num(s['ttft_p99_ms'], 0)} ms",
                fontsize=10,
            )
            ax.legend(loc="upper right", fontsize=8)
        axes[-1, 0].set_xlabel("seconds (dashed: full load starts)")
        fig.tight_layout()
        path = out / "llm_routing_herding.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# -- the run -------------------------------------------------------------------------


def chat_part(
    args: argparse.Namespace, rig: Rig, features: Features, skipped: list[str]
) -> dict[str, Any]:
    systems, users = make_users(args.users, args.ramp, args.seed)
    ws = working_set_blocks(systems, users)
    workload = {
        "users": len(users),
        "turns": sum(len(x.messages) for x in users),
        "ramp": args.ramp,
        "cap_s": args.cap,
        "seed": args.seed,
        "ttft_ms": args.ttft_ms,
        "per_uncached_ms": args.per_uncached_ms,
        "per_cached_ms": args.per_cached_ms,
        "inter_token_ms": args.inter_token_ms,
        "max_running": args.max_running,
        "kv_share": args.kv_share,
        "kv_blocks": max(64, round(ws * args.kv_share)),
        "working_set_blocks": ws,
    }
    print(f"part 1: {len(users)} users, {workload['turns']} turns, working set {ws} blocks")
    # The main comparison at --kv-share, then p2c against affinity+load with smaller caches.
    plan = [(args.kv_share, list(args.policies))]
    plan += [
        (share, [p for p in args.policies if p != "round-robin"]) for share in args.tight_kv_shares
    ]
    main: dict[str, Any] = {}
    tighter: dict[str, Any] = {}
    for n, (share, policies) in enumerate(plan):
        kv_blocks = max(64, round(ws * share))
        print(f"  KV cache: {kv_blocks} blocks per region ({share:.0%} of the working set)")
        for i in range(3):
            rig.start_region(
                RegionSpec(
                    name=f"region-{i + 1}",
                    ttft=args.ttft_ms / 1000,
                    per_uncached=args.per_uncached_ms / 1000,
                    per_cached=args.per_cached_ms / 1000,
                    kv_blocks=kv_blocks,
                    max_running=args.max_running,
                    inter_token=args.inter_token_ms / 1000,
                )
            )
        results = main if n == 0 else tighter.setdefault(f"{share:g}", {})
        for policy in policies:
            options: dict[str, Any] = {}
            if policy == "round-robin":
                options["plugin"] = ROUND_ROBIN_PLUGIN
            elif policy == "affinity+load":
                if features.affinity_missing:
                    note = f"policy affinity+load: {features.affinity_missing}"
                    print(f"  skipped: {note}", flush=True)
                    if note not in skipped:
                        skipped.append(note)
                    continue
                options["routing"] = features.routing
                options["region_keys"] = features.region
            rig.reset_regions()
            rig.start_proxy(policy, **options)
            try:
                began = time.monotonic()
                res, gauges, seconds = asyncio.run(run_chat(rig, policy, systems, users, args.cap))
                counters = rig.counters()
            finally:
                rig.stop_proxies()
            summary = summarize_chat(res, gauges, counters, seconds)
            summary["kv_share"], summary["kv_blocks"] = share, kv_blocks
            if n:
                summary.pop("ttft_ms")
            results[policy] = summary
            print(
                f"  {policy:<14} {summary['requests']} requests, {summary['errors']} errors, "
                f"TTFT p50 {_report._num(summary['ttft_p50_ms'], 1)} ms p99 "
                f"{_report._num(summary['ttft_p99_ms'], 1)} ms, KV hit "
                f"{summary['kv_hit_rate'] or 0:.1%}, spread "
                f"{_report._num(summary['spread_in_flight'])} ({time.monotonic() - began:.0f} s)",
                flush=True,
            )
        rig.stop_regions()
    return {"workload": workload, "policies": main, "tighter": tighter}


def herd_part(
    args: argparse.Namespace, rig: Rig, features: Features, skipped: list[str]
) -> dict[str, Any]:
    for name, lat, lon, ttft in HERD_REGIONS:
        rig.start_region(
            RegionSpec(
                name=name,
                lat=lat,
                lon=lon,
                ttft=ttft,
                max_running=args.herd_max_running,
                tokens=HERD_TOKENS,
                inter_token=args.herd_inter_token_ms / 1000,
            )
        )
    service = HERD_TOKENS * args.herd_inter_token_ms / 1000
    load = HerdLoad(
        rate=args.herd_rate,
        warm=args.herd_warm,
        seconds=args.herd_seconds,
        burst=args.herd_burst,
        period=args.herd_period,
        stagger=args.herd_stagger,
    )
    options: dict[str, Any] = {}
    system = None
    if args.herd_policy == "affinity+load":
        if features.affinity_missing:
            note = f"herding under affinity+load: {features.affinity_missing}; p2c instead"
            print(f"  skipped: {note}", flush=True)
            skipped.append(note)
        else:
            options = {"routing": features.routing, "region_keys": features.region}
            # Every request starts with the same system prompt: the prefix pulls them together.
            system = make_users(0, 0.0, args.seed)[0][0]
    workload = {
        **asdict(load),
        "offered_per_pop": load.offered(),
        "policy": args.herd_policy if options else "p2c",
        "max_running": args.herd_max_running,
        "inter_token_ms": args.herd_inter_token_ms,
        "capacity": [args.herd_max_running / (t + service) for *_, t in HERD_REGIONS],
    }
    print(
        f"part 2: 3 PoPs x {load.offered():.1f} req/s; region capacity "
        + ", ".join(f"{c:.0f}" for c in workload["capacity"])
        + " req/s",
        flush=True,
    )
    modes: dict[str, Any] = {}
    for mode in HERD_MODES:
        sections: dict[str, dict[str, Any]] = {}
        if mode == "shared view on":
            if features.shared_view_missing or features.shared_view_key is None:
                note = f"herding with the shared view on: {features.shared_view_missing}"
                print(f"  skipped: {note}", flush=True)
                skipped.append(note)
                continue
            url = rig.start_redis()
            section, key = features.shared_view_key.split(".", 1)
            sections[section] = {key: url}
        rig.reset_regions()
        for pop in HERD_POPS:
            rig.start_proxy(pop[0], pop=pop, sections=sections, **options)
        try:
            res, gauges = asyncio.run(run_herd(rig, load, args.seed, system))
        finally:
            rig.stop_proxies()
            if rig.redis is not None:
                rig.redis.stop()
                rig.redis = None
        s = summarize_herd(res, gauges, args.herd_warm, args.herd_seconds)
        modes[mode] = s
        print(
            f"  {mode:<16} {s['requests']} requests, {s['errors']} errors, TTFT p50 "
            f"{_report._num(s['ttft_p50_ms'], 1)} ms p99 {_report._num(s['ttft_p99_ms'], 1)} ms, "
            f"peak waiting {s['peak_waiting']} at {s['hottest']}",
            flush=True,
        )
    rig.stop_regions()
    return {"workload": workload, "modes": modes}


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pol = data["chat"].get("policies", {})
    p2c, new = pol.get("p2c"), pol.get("affinity+load")
    if p2c and new:
        cut = _ratio(p2c["ttft_p50_ms"], new["ttft_p50_ms"])
        worse = _ratio(new["spread_in_flight"], p2c["spread_in_flight"])
        out.append({"metric": "TTFT p50 cut, p2c / affinity+load (x)", "value": cut,
                    "target": ">= 2", "pass": (cut or 0) >= 2})  # fmt: skip
        out.append({"metric": "load spread, affinity+load / p2c (in flight)", "value": worse,
                    "target": "<= 1.5", "pass": worse is not None and worse <= 1.5})  # fmt: skip
    else:
        for metric, target in (
            ("TTFT p50 cut, p2c / affinity+load (x)", ">= 2"),
            ("load spread, affinity+load / p2c (in flight)", "<= 1.5"),
        ):
            out.append({"metric": metric, "value": None, "target": target, "pass": False,
                        "skipped": True})  # fmt: skip
    modes = data["herding"].get("modes", {})
    off, on = modes.get("shared view off"), modes.get("shared view on")
    if off and on:
        cut = _ratio(float(off["peak_waiting"]), float(on["peak_waiting"]) or 1.0)
        out.append({"metric": "herding: peak queue at the hottest region, off / on (x)",
                    "value": cut, "target": ">= 2", "pass": (cut or 0) >= 2})  # fmt: skip
    else:
        out.append({"metric": "herding: peak queue at the hottest region, off / on (x)",
                    "value": None, "target": ">= 2", "pass": False, "skipped": True})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller and shorter: a smoke run")
    parser.add_argument(
        "--only", nargs="+", choices=("chat", "herding"), default=["chat", "herding"]
    )
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--users", type=int, default=240)
    parser.add_argument("--ramp", type=float, default=20.0, help="seconds over which users start")
    parser.add_argument(
        "--cap", type=float, default=80.0, help="seconds of load per policy, at most"
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--kv-share",
        type=float,
        default=0.33,
        help="each region's KV capacity, as a share of the working set",
    )
    parser.add_argument(
        "--tight-kv-shares",
        type=float,
        nargs="*",
        default=[0.18],
        help="smaller KV caches to run p2c and affinity+load again with",
    )
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--per-uncached-ms", type=float, default=0.2)
    parser.add_argument("--per-cached-ms", type=float, default=0.02)
    parser.add_argument("--inter-token-ms", type=float, default=8.0)
    parser.add_argument("--max-running", type=int, default=6)
    parser.add_argument("--herd-rate", type=float, default=4.0, help="Poisson req/s per PoP")
    parser.add_argument("--herd-burst", type=int, default=8, help="requests per burst")
    parser.add_argument("--herd-period", type=float, default=4.0, help="seconds between bursts")
    parser.add_argument("--herd-stagger", type=float, default=0.4,
                        help="seconds between the bursts of two PoPs")  # fmt: skip
    parser.add_argument("--herd-warm", type=float, default=5.0)
    parser.add_argument(
        "--herd-policy",
        choices=("p2c", "affinity+load"),
        default="p2c",
        help="routing of the PoPs (affinity+load: every request shares one system prompt)",
    )
    parser.add_argument("--herd-seconds", type=float, default=40.0)
    parser.add_argument("--herd-max-running", type=int, default=4)
    parser.add_argument("--herd-inter-token-ms", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.users, args.ramp, args.cap = 120, 10.0, 40.0
        args.herd_seconds = 20.0
        args.tight_kv_shares = []
    args.out.mkdir(parents=True, exist_ok=True)
    features = detect_features(documented_keys())
    skipped: list[str] = []
    began = time.monotonic()
    data: dict[str, Any] = {"chat": {"policies": {}}, "herding": {}}
    with tempfile.TemporaryDirectory(prefix="bench-llm-routing-") as tmp:
        rig = Rig(Path(tmp))
        try:
            if "chat" in args.only:
                data["chat"] = chat_part(args, rig, features, skipped)
            if "herding" in args.only:
                data["herding"] = herd_part(args, rig, features, skipped)
        finally:
            rig.stop()
    import os

    data["features"] = features.describe()
    data["skipped"] = skipped
    data["meta"] = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "commit": u.tool_version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
        "cpus": len(os.sched_getaffinity(0)),
        "elapsed_s": round(time.monotonic() - began, 1),
        "quick": args.quick,
    }
    data["targets"] = targets(data)
    (args.out / "llm_routing.json").write_text(json.dumps(data, indent=1, default=str))
    report = markdown(data)
    (args.out / "llm_routing.md").write_text(report)
    pngs = plots(data, args.out)
    print()
    print(report)
    print(
        f"written: {args.out / 'llm_routing.md'}, llm_routing.json"
        + "".join(f", {p.name}" for p in pngs)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
