from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import trustme
from aiohttp import web

from edgeproxy import Config, EdgeProxy
from edgeproxy.testing import Behavior, FakeRegion

ProxyFactory = Callable[..., Awaitable[EdgeProxy]]
RegionFactory = Callable[..., Awaitable[FakeRegion]]


@pytest.fixture
async def make_region() -> AsyncIterator[RegionFactory]:
    """Start fake regional clusters (real hypercorn, h2c + HTTP/1.1); all stopped afterwards."""
    started: list[FakeRegion] = []

    async def factory(name: str = "r1", model: str = "fake-llm", **behavior: Any) -> FakeRegion:
        region = FakeRegion(name=name, model=model, behavior=Behavior(**behavior))
        await region.start()
        started.append(region)
        return region

    yield factory
    for region in started:
        await region.stop()


def proxy_config(regions: list[dict[str, Any]], **sections: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0, "grace_period": 5.0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "pop": {"name": "edge-test", "lat": 1.35, "lon": 103.82},
        "upstream": {"read_timeout": 10.0, "connect_timeout": 2.0},
        # A test is one caller, and its fake regions fail for every caller: each 5xx counts
        # against the region, as Envoy counts them. The tests of the caller rule
        # (test_caller_blame.py) set [health] min_failing_callers themselves.
        "health": {"min_failing_callers": 1},
        # A fake region answers any model but lists one, and a test counts the requests its
        # regions get: the regions' catalogs are learnt where a test says so
        # (test_model_catalog.py), with learn_models or models_refresh.
        "regions": [
            r
            if r.get("models") or r.keys() & {"learn_models", "models_refresh"}
            else {**r, "learn_models": False}
            for r in regions
        ],
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


class FakeClock:
    """A clock that moves only when the test says so: ``clock()`` is ``start`` plus
    everything :meth:`advance` added.

    :meth:`following` makes one on top of another clock instead, for a running
    proxy: its request path dates attempts with the real monotonic clock, so
    the routing and health clocks must never be behind it. Such a clock reads
    ``time.monotonic()`` plus what was advanced, and a test that advances it
    by ``n`` seconds sees what the proxy does ``n`` seconds later without
    waiting for them.
    """

    def __init__(self, start: float = 0.0, *, base: Callable[[], float] | None = None) -> None:
        self._base = base
        self.offset = start

    @classmethod
    def following(cls, base: Callable[[], float]) -> FakeClock:
        return cls(base=base)

    def __call__(self) -> float:
        return self.offset + (self._base() if self._base is not None else 0.0)

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a clock does not go back"
        self.offset += seconds


def use_clock(proxy: EdgeProxy, clock: Callable[[], float]) -> None:
    """Make ``clock`` the monotonic clock of the proxy's routing, health, latency history
    and poison requests."""
    regions = proxy.regions
    regions.clock = clock
    regions.health.clock = clock
    for region in regions:
        region.latency.clock = clock
    proxy.pipeline.router.clock = clock
    proxy.pipeline.poison.clock = clock


@pytest.fixture
async def make_proxy() -> AsyncIterator[ProxyFactory]:
    """Start an EdgeProxy on ephemeral ports in front of the given regions; all stopped after.

    ``regions`` are config tables or :class:`FakeRegion` objects (name and URL
    taken from them). ``routes=[...]``, ``plugins=[...]`` and any config
    section (``cache={...}``, ``server={...}``...) may be given, or a whole
    ``config`` instead of regions and sections. ``clock`` replaces the
    monotonic clock of routing, health and latency history (see
    :func:`use_clock`); ``cache_clock`` the cache's wall clock (freshness, Age).
    """
    started: list[EdgeProxy] = []

    async def factory(
        regions: Sequence[dict[str, Any] | FakeRegion] = (),
        *,
        routes: list[dict[str, Any]] | None = None,
        plugins: Iterable[object] = (),
        config: Config | None = None,
        clock: Callable[[], float] | None = None,
        cache_clock: Callable[[], float] | None = None,
        **sections: dict[str, Any],
    ) -> EdgeProxy:
        if config is None:
            tables = [
                {"name": r.name, "url": r.url} if isinstance(r, FakeRegion) else r for r in regions
            ]
            data = proxy_config(tables, **sections)
            if routes is not None:
                data["routes"] = routes
            config = Config.from_mapping(data, environ={})
        else:
            assert not (regions or routes or sections), "a whole config, or its parts"
        proxy = EdgeProxy(config, plugins=list(plugins))
        await proxy.start()
        started.append(proxy)
        if clock is not None:
            use_clock(proxy, clock)
        if cache_clock is not None:
            proxy.pipeline.cache.clock = cache_clock
        return proxy

    yield factory
    for proxy in started:
        await proxy.stop(grace=2.0)


async def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll until ``predicate`` holds; fails the test after a generous ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def _redis_answers(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis: the machine's at 127.0.0.1:6379, else one started here, else a skip."""
    import shutil
    import socket
    import subprocess
    import time

    if _redis_answers("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no Redis at 127.0.0.1:6379 and no redis-server binary to start one")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            if _redis_answers("127.0.0.1", port):
                break
            time.sleep(0.05)
        else:
            pytest.skip("redis-server did not start")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
async def redis_prefix(redis_server: str) -> AsyncIterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    import uuid

    import redis.asyncio as aioredis

    prefix = f"edgeproxy-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = aioredis.Redis.from_url(redis_server)
    try:
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def spawn_serve(
    config: Path, *flags: str, stdout: int | None = None, stderr: int | None = None
) -> asyncio.subprocess.Process:
    """``edgeproxy serve --config CONFIG FLAGS...`` as a real process, its output unbuffered;
    the caller waits for it and stops it."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "edgeproxy",
        "serve",
        "--config",
        str(config),
        *flags,
        stdout=stdout,
        stderr=stderr,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def wait_ready(admin_url: str, tries: int = 300) -> None:
    """Wait until the admin listener at ``admin_url`` answers /readyz with 200."""
    async with aiohttp.ClientSession() as client:
        for _ in range(tries):
            try:
                async with client.get(admin_url + "/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("proxy did not become ready")


def write_pair(ca: trustme.CA, folder: Path, name: str = "proxy") -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost issued by ``ca``, written to ``folder``
    with its chain (``name``.pem) and key (``name``.key); returns both paths."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    return str(cert_path), str(key_path)


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Terminate a helper process the test started (Chromium, nginx); kill it if it has
    not gone within ``timeout``."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def check_disconnect_cancels_upstream(
    url: str, body: dict[str, Any], region: FakeRegion, proxy: EdgeProxy
) -> None:
    """Drop a stream from ``url`` (the proxy's chat route, whatever serves it) after its
    first event: the region sees the cancel, the proxy and the region's pool let go of
    it, and the pool serves the next request."""
    async with aiohttp.ClientSession() as client:
        resp = await client.post(url, json={**body, "stream": True})
        await resp.content.readuntil(b"\n\n")
        assert region.in_flight == 1
        resp.close()  # drop the connection mid-stream
    await eventually(lambda: region.cancelled_total == 1 and region.in_flight == 0)
    await eventually(lambda: proxy.pipeline.in_flight == 0)
    pool = proxy.regions.by_name[region.name].pool
    await eventually(lambda: pool.stats().streams_in_use == 0)
    async with aiohttp.ClientSession() as client:
        async with client.post(url, json=body) as again:
            assert again.status == 200


CustomRegion = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def custom_region() -> AsyncIterator[CustomRegion]:
    """Serve an aiohttp app as a hand-written region (HTTP/1.1); returns its URL. Every
    app served is stopped afterwards."""
    runners: list[web.AppRunner] = []

    async def factory(app: web.Application) -> str:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield factory
    for runner in runners:
        await runner.cleanup()


# Three equally near regions behind two PoPs sharing one Redis (the stateful tests).
Pops = tuple[list[FakeRegion], list[openai.AsyncOpenAI], list[EdgeProxy]]


def tables(regions: list[FakeRegion]) -> list[dict[str, Any]]:
    # Equally near: without the owner rule, follow-ups would spread over all three.
    return [{"name": r.name, "url": r.url, "lat": 1.3, "lon": 103.8} for r in regions]


@pytest.fixture
async def two_pops(
    make_region: RegionFactory, make_proxy: ProxyFactory, redis_server: str, redis_prefix: str
) -> AsyncIterator[Pops]:
    regions = [await make_region(f"r{i}", tokens=3) for i in range(3)]
    stateful = {"redis_url": redis_server, "redis_prefix": redis_prefix + "owner:"}
    pops = [await make_proxy(tables(regions), stateful=stateful) for _ in range(2)]
    clients = [
        openai.AsyncOpenAI(base_url=pop.url + "/v1", api_key="sk-test", max_retries=0)
        for pop in pops
    ]
    try:
        yield regions, clients, pops
    finally:
        for client in clients:
            await client.close()


# -- real llama.cpp regions: llama-cpp-python's OpenAI server ----------------------------

# The marks of a test against real llama.cpp regions (the llama_servers fixture).
needs_llama_server = [
    pytest.mark.model,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None
        or importlib.util.find_spec("sse_starlette") is None,
        reason="llama_cpp.server is not installed (pip install 'edgeproxy[local]')",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None or importlib.util.find_spec("numpy") is None,
        reason="building the test model needs gguf and numpy (pip install 'edgeproxy[testing]')",
    ),
]

LlamaServers = Callable[..., Awaitable[str]]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text("utf-8", "replace").splitlines()[-lines:])


async def _llama_server_up(url: str, proc: subprocess.Popen[bytes], log: Path) -> bool:
    """Wait until the server at ``url`` answers ``GET /v1/models``; False when it exited
    first (its port was taken: started again on another), an error for any other exit."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as client:
        for _ in range(1200):
            if proc.poll() is not None:
                if "address already in use" in log.read_text("utf-8", "replace").lower():
                    return False
                raise AssertionError(
                    f"llama.cpp server for {url} exited with {proc.returncode}:\n{_tail(log)}"
                )
            try:
                async with client.get(url + "/v1/models") as resp:
                    if resp.status == 200:
                        return True
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"llama.cpp server at {url} did not start:\n{_tail(log)}")


@pytest.fixture
async def llama_servers(tmp_path: Path) -> AsyncIterator[LlamaServers]:
    """Start llama-cpp-python's OpenAI server as a real region: ``await llama_servers()``
    returns its URL once its ``/v1/models`` answers (``asyncio.gather`` starts several at
    once); all are stopped after the test. Mark the test with ``needs_llama_server``.

    The server runs through ``python -m edgeproxy.testing._llama_server``, its command line
    unchanged, which loads the model as the proxy loads its own (clear of ggml's AMX kernels
    where a GCC before 13 miscompiled them). Defaults: the tiny generated model (Q8_0),
    ``n_ctx`` 256; ``args`` are more of the server's flags. Its stderr is kept in the test's
    ``tmp_path`` and shown when it fails to start.
    """
    from edgeproxy.testing import tiny_llama_gguf

    started: list[subprocess.Popen[bytes]] = []

    async def start(
        model: Path | None = None, *, n_ctx: int = 256, args: Sequence[str] = ()
    ) -> str:
        path = model if model is not None else tiny_llama_gguf("Q8_0")
        for _ in range(3):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = tmp_path / f"llama-server-{port}.log"
            with log.open("wb") as stderr:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "edgeproxy.testing._llama_server",
                        "--model",
                        str(path),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--n_ctx",
                        str(n_ctx),
                        "--verbose",
                        "false",
                        *args,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
            started.append(proc)
            if await _llama_server_up(url, proc, log):
                return url
        raise AssertionError("no free port for a llama.cpp server in 3 tries")

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
    for proc in started:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- real llama.cpp regions: llama.cpp's C++ llama-server --------------------------------


def llama_server_binary() -> Path | str:
    """The C++ ``llama-server`` for the tests: ``$EDGEPROXY_LLAMA_SERVER``, else the one
    ``.ci/build-llama-server`` caches for the installed llama-cpp-python; or why there is
    none (a string)."""
    named = os.environ.get("EDGEPROXY_LLAMA_SERVER")
    if named:
        path = Path(named)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        return f"$EDGEPROXY_LLAMA_SERVER ({named}) is not an executable file"
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("llama-cpp-python")
    except PackageNotFoundError:
        return "llama-cpp-python is not installed: no llama-server version to look for"
    cache = os.environ.get("EDGEPROXY_LLAMA_SERVER_DIR") or str(
        Path.home() / ".cache" / "edgeproxy" / "llama-server"
    )
    path = Path(cache) / installed / "llama-server"
    if path.is_file() and os.access(path, os.X_OK):
        return path
    return f"no llama-server binary at {path} (.ci/build-llama-server builds it)"


async def _llama_cpp_server_up(url: str, proc: subprocess.Popen[bytes], log: Path) -> bool:
    """Wait until llama-server at ``url`` answers ``GET /health`` with 200 (its model is
    loaded); False when it exited first because its port was taken, an error for any other
    exit."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as client:
        for _ in range(1200):
            if proc.poll() is not None:
                if "couldn't bind" in log.read_text("utf-8", "replace").lower():
                    return False
                raise AssertionError(
                    f"llama-server for {url} exited with {proc.returncode}:\n{_tail(log)}"
                )
            try:
                async with client.get(url + "/health") as resp:
                    if resp.status == 200:
                        return True
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"llama-server at {url} did not start:\n{_tail(log)}")


class LlamaCppServers:
    """The C++ ``llama-server`` processes of one test (the ``llama_cpp_server`` fixture)."""

    def __init__(self, binary: Path, folder: Path) -> None:
        self.binary = binary
        self.folder = folder
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    async def __call__(
        self, model: Path | None = None, *, n_ctx: int = 256, args: Sequence[str] = ()
    ) -> str:
        """Start one on a free port; its URL once its model is loaded."""
        from edgeproxy.testing import tiny_llama_gguf

        path = model if model is not None else tiny_llama_gguf("Q8_0")
        for _ in range(3):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = self.folder / f"llama-cpp-server-{port}.log"
            with log.open("wb") as stderr:
                proc = subprocess.Popen(
                    [
                        str(self.binary),
                        "--model",
                        str(path),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--ctx-size",
                        str(n_ctx),
                        "--parallel",
                        "1",
                        "--threads",
                        "1",
                        "--no-webui",
                        *args,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
            self.processes[url] = proc
            if await _llama_cpp_server_up(url, proc, log):
                return url
        raise AssertionError("no free port for llama-server in 3 tries")

    def kill(self, url: str) -> None:
        """SIGKILL the server at ``url``, as a crash would end it."""
        proc = self.processes[url]
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def llama_cpp_server(tmp_path: Path) -> Iterator[LlamaCppServers]:
    """Start llama.cpp's C++ ``llama-server`` as a real region: ``await llama_cpp_server()``
    returns its URL once its ``/health`` answers 200 (``asyncio.gather`` starts several at
    once), ``llama_cpp_server.kill(url)`` kills one; all are stopped after the test. Skips,
    saying why, when there is no binary (:func:`llama_server_binary`; run
    ``.ci/build-llama-server``).

    Defaults: the tiny generated model (Q8_0), a context of 256 tokens, one slot, one
    thread, no web UI; ``args`` are more of the server's flags. Its log is kept in the
    test's ``tmp_path`` and shown when it fails to start.
    """
    binary = llama_server_binary()
    if isinstance(binary, str):
        pytest.skip(binary)
    servers = LlamaCppServers(binary, tmp_path)
    try:
        yield servers
    finally:
        servers.stop()
