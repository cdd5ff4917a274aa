"""Chaos under load with real parts: TLS regions, a TLS Redis, llama.cpp, `edgeproxy serve`.

Each scenario runs bounded concurrent load (all on 127.0.0.1), breaks one real
component in the middle of it (a TLS region, a ``rediss://`` Redis, every
region, one of two processes sharing a port) and checks what each request
got. Nothing is timed: every request runs under a generous hang guard, and
what the test waits for it polls for.

1. Two TLS regions (HTTP/2 over ALPN, HTTP/1.1 over TLS), one killed: every
   request whose answer had not started is answered by the other region.
2. A ``rediss://`` Redis behind the cache and the rate limits, killed and
   restarted, or frozen (SIGSTOP) and thawed: no request fails or hangs, and
   both use Redis again afterwards.
3. Every region killed under 80 concurrent chat requests: each gets the local
   model's answer or a 503 with Retry-After, nothing else.
4. Two ``edgeproxy serve`` processes on one port (``reuse_port``), one
   SIGKILLed: only requests it held fail, new ones succeed on the survivor.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory, eventually

CHAT = "/v1/chat/completions"
# A request that takes longer than this hangs: the test fails on it. Far above
# anything a request needs here, even on a busy 2-core machine.
HANG_GUARD = 30.0
REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat(content: str, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        **extra,
    }
    if stream:
        body["stream"] = True
    return body


# -- one request, classified ----------------------------------------------------


@dataclass
class Outcome:
    """What one request got.

    ``kind`` is ``ok`` (a 200 with a complete answer), ``cut`` (a 200 whose
    body then broke: the answer had started), ``status`` (a complete answer
    with another status), ``error`` (no response at all: the connection
    failed before the status line) or ``hung`` (past :data:`HANG_GUARD`).
    """

    kind: str
    status: int | None
    headers: dict[str, str]
    body: bytes
    started: float
    ended: float
    detail: str = ""

    @property
    def region(self) -> str | None:
        return self.headers.get("X-Edgeproxy-Region")

    @property
    def attempts(self) -> int:
        return int(self.headers.get("X-Edgeproxy-Attempts", "1"))


def complete(body: bytes, stream: bool) -> bool:
    """A whole answer: every SSE event up to ``[DONE]`` and no error event, or a JSON body."""
    if stream:
        events = [e for e in body.split(b"\n\n") if e.strip()]
        return (
            bool(events)
            and events[-1].strip() == b"data: [DONE]"
            and not any(b'"error"' in e for e in events)
        )
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(answer, dict) and bool(answer.get("choices"))


async def ask(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Outcome:
    loop = asyncio.get_running_loop()
    started = loop.time()
    stream = bool(body.get("stream"))
    status: int | None = None
    got: dict[str, str] = {}
    try:
        async with asyncio.timeout(HANG_GUARD):
            async with client.post(url, json=body, headers=headers) as resp:
                status, got = resp.status, dict(resp.headers)
                try:
                    raw = await resp.read()
                except aiohttp.ClientError as exc:
                    return Outcome("cut", status, got, b"", started, loop.time(), repr(exc))
    except TimeoutError:
        return Outcome("hung", status, got, b"", started, loop.time())
    except aiohttp.ClientError as exc:
        return Outcome("error", None, {}, b"", started, loop.time(), repr(exc))
    if status != 200:
        return Outcome("status", status, got, raw, started, loop.time())
    kind = "ok" if complete(raw, stream) else "cut"
    return Outcome(kind, status, got, raw, started, loop.time())


async def run_load(
    total: int,
    concurrency: int,
    one: Callable[[int], Awaitable[Outcome]],
    done: list[Outcome],
) -> None:
    """``total`` requests, ``concurrency`` at a time; outcomes appended to ``done`` as they end."""
    numbers = iter(range(total))

    async def worker() -> None:
        for i in numbers:
            done.append(await one(i))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def summary(outcomes: list[Outcome]) -> str:
    kinds = Counter(o.kind for o in outcomes)
    details = Counter(o.detail.split("(")[0] for o in outcomes if o.detail)
    return f"{dict(kinds)} {dict(details)}"


# -- certificates -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    folder = tmp_path_factory.mktemp("chaos-tls")
    certfile, keyfile = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
        + ["-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
        + ["-keyout", str(keyfile), "-out", str(certfile)],
        check=True,
        capture_output=True,
    )
    return str(certfile), str(keyfile)


@pytest.fixture
async def regions_to_stop() -> AsyncIterator[list[FakeRegion]]:
    started: list[FakeRegion] = []
    yield started
    for region in started:
        await region.stop()


# -- 1. TLS regions, one killed under load ----------------------------------------


@pytest.mark.parametrize("victim", ["h2", "h1"])
async def test_tls_region_killed_under_load_fails_over(
    make_proxy: ProxyFactory,
    tls_cert: tuple[str, str],
    regions_to_stop: list[FakeRegion],
    victim: str,
) -> None:
    certfile, keyfile = tls_cert
    behavior = {"ttft": 0.05, "inter_token_delay": 0.01, "tokens": 4}
    h2 = FakeRegion("h2", certfile=certfile, keyfile=keyfile)
    h1 = FakeRegion("h1", certfile=certfile, keyfile=keyfile, http1_only=True)
    for region in (h2, h1):
        region.configure(**behavior)
        regions_to_stop.append(region)
        await region.start()
    assert h2.url.startswith("https://") and h1.url.startswith("https://")
    proxy = await make_proxy(
        # An HTTP/2 pool insists on h2 by ALPN; an HTTP/1.1-only region is configured so.
        [{"name": "h2", "url": h2.url}, {"name": "h1", "url": h1.url, "http2": False}],
        upstream={"ca_file": certfile},
    )
    dead, survivor = (h2, h1) if victim == "h2" else (h1, h2)

    # With the default retry budget (10 retries plus a fifth of the requests in 10 s),
    # the retries of up to 12 requests cut at once, and of those sent to the dead
    # region until outlier detection ejects it, stay within budget.
    total, concurrency = 160, 12
    outcomes: list[Outcome] = []
    killed_at: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as client:

        async def one(i: int) -> Outcome:
            return await ask(client, proxy.url + CHAT, chat(f"q{i}", stream=i % 2 == 0))

        async def kill() -> int:
            await eventually(lambda: len(outcomes) >= 40, timeout=HANG_GUARD)
            counters = await dead.wait_until(lambda c: c.in_flight >= 2, timeout=HANG_GUARD)
            await dead.kill()
            killed_at.append(asyncio.get_running_loop().time())
            return counters.in_flight

        load = asyncio.ensure_future(run_load(total, concurrency, one, outcomes))
        in_flight_at_kill = await kill()
        await load

    # Both protocols carried traffic before the kill.
    assert h2.counters().requests_by_http_version.get("2", 0) >= 1
    assert h1.counters().requests_by_http_version.get("1.1", 0) >= 1

    kinds = Counter(o.kind for o in outcomes)
    assert len(outcomes) == total
    assert kinds["hung"] == 0, summary(outcomes)
    # Nothing failed before its answer started: no error status, no connection failure.
    assert kinds["status"] == 0 and kinds["error"] == 0, summary(outcomes)
    # Only answers already under way on the killed region broke, and only at the kill.
    cut = [o for o in outcomes if o.kind == "cut"]
    assert all(o.region == dead.name and o.started < killed_at[0] for o in cut)
    # After the kill every answer came from the survivor.
    after = [o for o in outcomes if o.started > killed_at[0]]
    assert after and all(o.kind == "ok" and o.region == survivor.name for o in after)
    # Requests the dead region had taken (or was picked for) went on to the survivor.
    retried = [o for o in outcomes if o.kind == "ok" and o.attempts > 1]
    assert all(o.region == survivor.name for o in retried)
    print(
        f"\nTLS {victim} killed with {in_flight_at_kill} in flight there: "
        f"{kinds['ok']} ok, {len(cut)} cut mid-answer, {len(retried)} answered by "
        f"{survivor.name} after a failed attempt, {len(after)} sent after the kill"
    )
    assert kinds["ok"] + len(cut) == total
    # Nothing leaked: no request, attempt or upstream stream is left behind.
    await eventually(lambda: proxy.status()["in_flight"] == 0 and survivor.in_flight == 0)


# -- 2. rediss:// under a Redis kill ----------------------------------------------


class TlsRedis:
    """A redis-server of this test's own serving TLS only, to kill and restart on one port."""

    def __init__(self, workdir: Path, certfile: str, keyfile: str) -> None:
        assert REDIS_SERVER is not None
        self.port = free_port()
        self.certfile = certfile
        self.argv = [
            REDIS_SERVER,
            "--port", "0",
            "--tls-port", str(self.port),
            "--tls-cert-file", certfile,
            "--tls-key-file", keyfile,
            "--tls-ca-cert-file", certfile,
            "--tls-auth-clients", "no",
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(workdir),
        ]  # fmt: skip
        self.log = workdir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)

    async def wait_ready(self) -> str | None:
        """None once it answers PING over TLS; else why it never will (it exited)."""
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(
            self.url, ssl_ca_certs=self.certfile, socket_connect_timeout=1.0, socket_timeout=1.0
        )
        try:
            for _ in range(200):
                if self.proc is not None and self.proc.poll() is not None:
                    tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
                    return " / ".join(tail) or f"exit status {self.proc.returncode}"
                try:
                    if await client.ping():
                        return None
                except (OSError, aioredis.RedisError):
                    pass
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()
        raise AssertionError("redis-server with TLS did not answer")

    def freeze(self) -> None:
        """SIGSTOP: connections stay open and nothing answers, the worse outage."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def tls_redis(tmp_path: Path, tls_cert: tuple[str, str]) -> Iterator[TlsRedis]:
    if REDIS_SERVER is None:
        pytest.skip("no redis-server binary to start")
    server = TlsRedis(tmp_path, *tls_cert)
    try:
        yield server
    finally:
        server.kill()


@pytest.mark.redis
@pytest.mark.parametrize("outage", ["kill", "freeze"])
async def test_rediss_outage_under_load_fails_open_and_recovers(
    make_region: RegionFactory, make_proxy: ProxyFactory, tls_redis: TlsRedis, outage: str
) -> None:
    import redis.asyncio as aioredis

    tls_redis.start()
    why = await tls_redis.wait_ready()
    if why is not None:
        pytest.skip(f"this redis-server does not serve TLS ({why})")
    certfile = tls_redis.certfile
    region = await make_region("r1", ttft=0.01)
    proxy = await make_proxy(
        [region],
        cache={
            "backend": "redis",
            "redis_url": tls_redis.url,
            "redis_tls_ca_file": certfile,
            # Generous: TLS handshakes on a busy 2-core machine are not what is tested.
            "redis_timeout": 1.0,
            "redis_connect_timeout": 1.0,
            "breaker_failures": 3,
            "breaker_cooldown": 0.3,
            "xfetch_beta": 0.0,
        },
        admission={
            "redis_url": tls_redis.url,
            "redis_tls_ca_file": certfile,
            "redis_timeout": 1.0,
            "redis_retry_interval": 0.2,
            # Limits far above this load: each request pays Redis, none is refused.
            "ip_requests_per_second": 100_000.0,
        },
    )
    rate = proxy.pipeline.admission.rate
    assert proxy.status()["admission"]["rate_limit"]["backend"] == "redis"

    def cache() -> dict[str, Any]:
        status: dict[str, Any] = proxy.status()["cache"]
        return status

    phases: dict[str, list[Outcome]] = {"up": [], "down": [], "back": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as client:

        def one_of(phase: str) -> Callable[[int], Awaitable[Outcome]]:
            async def one(i: int) -> Outcome:
                # 12 prompts, deterministic: hits, misses and coalesced requests.
                body = chat(f"{phase} {i % 12}", stream=i % 3 == 0, temperature=0)
                return await ask(client, proxy.url + CHAT, body)

            return one

        # Redis up: the cache stores and serves through it.
        await run_load(60, 12, one_of("up"), phases["up"])
        assert cache()["stores"] >= 1 and cache()["outcomes"].get("HIT", 0) >= 1

        # Killed (SIGKILL) or frozen (SIGSTOP) while 12 requests at a time are in flight.
        load = asyncio.ensure_future(run_load(150, 12, one_of("down"), phases["down"]))
        await eventually(lambda: len(phases["down"]) >= 30, timeout=HANG_GUARD)
        if outage == "kill":
            tls_redis.kill()
        else:
            tls_redis.freeze()
        await load
        errors = cache()["errors"]
        assert errors.get("error", 0) + errors.get("timeout", 0) >= 1, cache()
        assert rate.redis_errors >= 1 and not rate.redis_up

        # Back (on the same port, or thawed) mid-load: both find it again.
        load = asyncio.ensure_future(run_load(100, 12, one_of("back"), phases["back"]))
        await eventually(lambda: len(phases["back"]) >= 20, timeout=HANG_GUARD)
        if outage == "kill":
            tls_redis.start()
        else:
            tls_redis.thaw()
        assert await tls_redis.wait_ready() is None
        await load

        async def stored_and_hit(prompt: str) -> bool:
            body = chat(prompt, temperature=0)
            first = await ask(client, proxy.url + CHAT, body)
            assert first.kind == "ok", first
            await eventually(lambda: not proxy.pipeline.cache.coalescer.flights)
            again = await ask(client, proxy.url + CHAT, body)
            assert again.kind == "ok", again
            return again.headers.get("X-Edgeproxy-Cache") == "HIT"

        for attempt in range(100):
            if await stored_and_hit(f"recovered {attempt}"):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"the cache never used Redis again: {cache()}")
        # The rate limits are paid in Redis again: no more local fallbacks.
        await eventually(lambda: rate.redis_up, timeout=HANG_GUARD)
        local_fallbacks = rate.local_fallbacks
        for i in range(5):
            assert (await ask(client, proxy.url + CHAT, chat(f"limited {i}"))).kind == "ok"
        assert rate.local_fallbacks == local_fallbacks

    if outage == "kill":
        # The restarted Redis started empty: what it holds the proxy wrote after recovery.
        admin = aioredis.Redis.from_url(tls_redis.url, ssl_ca_certs=certfile)
        try:
            cached = [k async for k in admin.scan_iter(match="edgeproxy:*")]
            buckets = [k async for k in admin.scan_iter(match="edgeproxy:rl:*")]
        finally:
            await admin.aclose()
        assert len(cached) > len(buckets) > 0
    assert cache()["tiers"]["breaker"]["state"] == "closed"
    assert proxy.status()["admission"]["rate_limit"]["backend"] == "redis"

    everything = [o for phase in phases.values() for o in phase]
    assert len(everything) == 310
    await eventually(lambda: proxy.status()["in_flight"] == 0)
    # No request failed, hung or was limited because of Redis.
    assert all(o.kind == "ok" for o in everything), summary(everything)
    by_phase = {
        name: dict(Counter(o.headers.get("X-Edgeproxy-Cache", "-") for o in outcomes))
        for name, outcomes in phases.items()
    }
    print(
        f"\nrediss:// {outage} under load: {len(everything)} requests all 200; cache by phase "
        f"{by_phase}; cache errors {cache()['errors']}; breaker opens "
        f"{cache()['tiers']['breaker']['opens_total']}; rate-limit Redis errors "
        f"{rate.redis_errors}, local fallbacks {rate.local_fallbacks}"
    )


# -- 3. every region killed: the local model under load ---------------------------


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from edgeproxy.testing import tiny_llama_gguf

    return tiny_llama_gguf("Q4_0")


@pytest.mark.model
@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'edgeproxy[local]')",
)
@pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None,
    reason="building the test model needs gguf and numpy (pip install 'edgeproxy[testing]')",
)
async def test_full_outage_under_load_answers_from_the_ladder(
    make_region: RegionFactory, make_proxy: ProxyFactory, tiny_model: Path
) -> None:
    # The regions take every request and never answer before they are killed.
    regions = [await make_region(name, ttft=60.0) for name in ("r1", "r2")]
    proxy = await make_proxy(
        regions,
        local_model={
            "path": str(tiny_model),
            "n_ctx": 256,
            "max_tokens": 8,
            "concurrency": 1,
            "max_queue": 16,
            "max_queue_wait": 5.0,
        },
    )
    local = proxy.pipeline.fallback.local
    await eventually(lambda: local.state not in ("idle", "loading"), timeout=HANG_GUARD)
    assert local.ready, local.snapshot()

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    ) as client:

        async def one(i: int) -> tuple[Outcome, bool]:
            stream = i % 2 == 1
            body = chat(f"outage {i}", stream=stream, max_tokens=4)
            return await ask(client, proxy.url + CHAT, body), stream

        # 60 requests reach the regions; both die under them; 20 more come after.
        before = [asyncio.ensure_future(one(i)) for i in range(60)]
        await eventually(lambda: sum(r.in_flight for r in regions) >= 40, timeout=HANG_GUARD)
        for region in regions:
            await region.kill()
        after = [asyncio.ensure_future(one(i)) for i in range(60, 80)]
        results = await asyncio.gather(*before, *after)

    degraded: list[Outcome] = []
    refused: Counter[str] = Counter()
    other: list[Outcome] = []
    for outcome, stream in results:
        if (
            outcome.kind == "ok"
            and outcome.headers.get("X-Edgeproxy-Degraded") == "local-model"
            and complete(outcome.body, stream)
        ):
            degraded.append(outcome)
            continue
        if outcome.kind == "status" and outcome.status == 503:
            code = orjson.loads(outcome.body)["error"].get("code")
            if code in ("local_model_busy", "fallback_unavailable") and int(
                outcome.headers.get("Retry-After", "0")
            ):
                refused[code] += 1
                continue
        other.append(outcome)
    assert not other, [(o.kind, o.status, o.headers, o.body[:200], o.detail) for o in other]
    assert len(degraded) + sum(refused.values()) == 80
    # The model answered some of them: the ladder worked, not only its last rung.
    assert degraded
    snapshot = local.snapshot()
    print(
        f"\nfull outage, 80 concurrent chats: {len(degraded)} answered by the local model, "
        f"503 {dict(refused)}; model answered {snapshot['answered_total']}, rejected "
        f"{snapshot['rejected_total']}"
    )


# -- 4. two serve processes on one port, one SIGKILLed ----------------------------


def serve_config(path: Path, port: int, admin_port: int, region: FakeRegion) -> Path:
    path.write_text(
        f"""
[server]
host = "127.0.0.1"
port = {port}
reuse_port = true
grace_period = 1.0

[admin]
host = "127.0.0.1"
port = {admin_port}

[upstream]
read_timeout = 60.0

[[regions]]
name = "{region.name}"
url = "{region.url}"
# The region counts the requests it holds; one asking for its models would be one more.
learn_models = false
"""
    )
    return path


@pytest.fixture
async def serve_processes() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    procs: list[asyncio.subprocess.Process] = []
    yield procs
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="needs SO_REUSEPORT")
async def test_reuse_port_survivor_serves_after_one_process_is_killed(
    make_region: RegionFactory,
    tmp_path: Path,
    serve_processes: list[asyncio.subprocess.Process],
) -> None:
    # Each process has a region of its own, so the answer names the process. The
    # victim's region holds every request until the victim dies: the requests it
    # held at the kill are known, not guessed.
    held = await make_region("held", fault="stall")
    fast = await make_region("fast", ttft=0.01)
    port = free_port()
    admin = {"victim": free_port(), "survivor": free_port()}
    for name, region in (("victim", held), ("survivor", fast)):
        config = serve_config(tmp_path / f"{name}.toml", port, admin[name], region)
        with (tmp_path / f"{name}.log").open("wb") as log:  # kept for a failing run
            serve_processes.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "edgeproxy",
                    "serve",
                    "--config",
                    str(config),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            )
    victim, survivor = serve_processes

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as probe:

        async def ready(admin_port: int) -> bool:
            try:
                async with probe.get(f"http://127.0.0.1:{admin_port}/readyz") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        for admin_port in admin.values():
            for _ in range(600):
                if await ready(admin_port):
                    break
                assert victim.returncode is None and survivor.returncode is None
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("a proxy process did not become ready")

    total, concurrency = 150, 16
    outcomes: list[Outcome] = []
    killed_at: list[float] = []
    # A new connection per request, so the kernel spreads them over both listeners.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as client:

        async def one(i: int) -> Outcome:
            return await ask(
                client,
                f"http://127.0.0.1:{port}{CHAT}",
                chat(f"q{i}", stream=i % 2 == 0),
                headers={"Connection": "close"},
            )

        load = asyncio.ensure_future(run_load(total, concurrency, one, outcomes))
        # Both are serving: the survivor has passed requests on and the victim holds
        # some (or every client, when the kernel gave it all of them so far).
        await eventually(
            lambda: (
                held.in_flight >= 4 and (fast.requests_total >= 1 or held.in_flight == concurrency)
            ),
            timeout=HANG_GUARD,
        )
        victim.send_signal(signal.SIGKILL)
        await victim.wait()
        killed_at.append(asyncio.get_running_loop().time())
        held_at_kill = held.requests_total
        await load

    kinds = Counter(o.kind for o in outcomes)
    failed = [o for o in outcomes if o.kind != "ok"]
    assert len(outcomes) == total
    assert kinds["hung"] == 0, summary(outcomes)
    # What failed was on the victim's connections: requests sent before the kill that
    # lost their connection (reset, or a response cut short), never an HTTP error.
    assert all(o.kind in ("error", "cut") and o.started < killed_at[0] for o in failed), [
        (o.kind, o.status, o.detail) for o in failed
    ]
    assert all(o.region in (None, held.name) for o in failed)
    # Every request the victim had passed upstream failed with it.
    assert len(failed) >= held_at_kill >= 4
    # Every success came from the survivor (the victim answered nothing), and after
    # the kill every request succeeded.
    assert all(o.region == fast.name for o in outcomes if o.kind == "ok")
    after = [o for o in outcomes if o.started > killed_at[0]]
    assert after and all(o.kind == "ok" for o in after)
    assert survivor.returncode is None
    async with aiohttp.ClientSession() as probe:
        async with probe.get(f"http://127.0.0.1:{admin['survivor']}/readyz") as r:
            assert r.status == 200
    print(
        f"\nreuse_port, one of two processes SIGKILLed: {kinds['ok']} ok through the "
        f"survivor ({len(after)} sent after the kill), {len(failed)} failed on the "
        f"victim's connections ({held_at_kill} of them held upstream): {summary(failed)}"
    )
