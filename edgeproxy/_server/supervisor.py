"""``edgeproxy serve --workers N``: one supervisor process, N workers sharing the port.

The workers are ``edgeproxy`` processes that bind the client port with SO_REUSEPORT, so
the kernel spreads connections over them. Each serves its admin app on a private Unix
socket in a directory only this user can open; the supervisor owns the one admin port
and answers it from theirs (``/status``, ``/readyz`` and ``/metrics`` summed; see
:mod:`~edgeproxy._observability.workermetrics`).

The supervisor restarts a worker that dies, after a pause that doubles while workers
keep dying young. SIGTERM or SIGINT drains every worker (the supervisor exits 0 when all
drained in their grace period). SIGHUP, or ``POST /reload`` on the admin port, reloads
the way nginx does: the config is read and checked again, new workers start on it and
take connections once they listen (their pools are warm by then), and the old ones
drain; a config that does not load leaves the running workers as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from edgeproxy._core.config import Config, ConfigError
from edgeproxy._observability.workermetrics import WorkerMetrics
from edgeproxy._server.admin import (
    AdminHandlers,
    AdminRunner,
    build_admin_app,
    json_response,
    reload_answer,
)
from edgeproxy._server.aio import web_error
from edgeproxy._server.tls import ListenerTls, check_tls_files

__all__ = ["Supervisor", "WORKER_COMMAND"]

logger = logging.getLogger("edgeproxy.supervisor")

# The hidden subcommand a worker runs (see edgeproxy._cli).
WORKER_COMMAND = "_worker"

# How long a new worker may take to listen (the pools open and warm before that).
_START_TIMEOUT = 60.0
# A worker that lived at least this long died of something new: its pause starts over.
_STABLE_AFTER = 10.0
_BACKOFF_FIRST = 0.5
_BACKOFF_MAX = 30.0
# Seconds a worker's admin socket gets to answer the supervisor.
_ASK_TIMEOUT = 5.0
# Past the workers' own grace period: what they need to cut the last streams and exit.
_EXIT_MARGIN = 15.0

# The counters and gauges of a region that add up over workers (the rest, such as the
# latency estimates and the health of a region, are each worker's own view).
_REGION_SUMS = (
    "in_flight",
    "pending",
    "requests_total",
    "errors_total",
    "retries_total",
    "hedges_total",
)
_POOL_SUMS = ("connections_open", "streams_in_use", "requests_total")


@dataclass
class Worker:
    """One worker process and what the supervisor knows of it."""

    index: int
    generation: int
    socket: str
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    failures: int = 0
    last_exit: str | None = None
    retiring: bool = False
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to the client address with SO_REUSEPORT, never listening.

    It checks the address before any worker starts, and it pins port 0's pick, so that
    every worker binds the same port; the kernel gives connections to listening sockets
    only, so it takes none.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class Supervisor:
    """Runs ``config.server.workers`` workers until SIGTERM; see the module docstring.

    ``load`` reads the config again for a reload (the file and the command-line flags);
    it raises :class:`~edgeproxy.ConfigError` for a config that does not load.
    """

    def __init__(
        self,
        config: Config,
        load: Callable[[], Config],
        *,
        log_level: str = "info",
        python: Sequence[str] = (sys.executable, "-m", "edgeproxy"),
    ) -> None:
        self.config = config
        self._load = load
        self._log_level = log_level
        self._python = tuple(python)
        self._dir = ""
        self._port = config.server.port
        self._generation = 0
        self._workers: list[Worker] = []
        self._stopping = False
        self._stop = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.last_reload: dict[str, Any] | None = None
        self.started_at = time.time()
        self.admin_url = ""
        self._admin_tls: ListenerTls | None = None
        self._worker_metrics = WorkerMetrics()

    # -- the run -----------------------------------------------------------

    async def run(self) -> int:
        """Serve until SIGTERM or SIGINT, then drain every worker. The exit code."""
        server = self.config.server
        try:
            reserved = _reserve_port(server.host, server.port)
        except OSError as exc:
            logger.error("server.port: cannot bind %s:%d: %s", server.host, server.port, exc)
            return 2
        self._port = reserved.getsockname()[1]
        self._dir = tempfile.mkdtemp(prefix="edgeproxy-")  # mode 0700: this user only
        admin = self.config.admin
        try:
            check_tls_files(self.config)
            token = admin.resolved_token()
            self._admin_tls = (
                ListenerTls("admin", admin.tls_cert, admin.tls_key, base_dir=self.config.base_dir)
                if admin.tls_cert and admin.tls_key
                else None
            )
        except (ConfigError, ValueError) as exc:
            logger.error("%s", exc)
            reserved.close()
            return 2
        runner = AdminRunner(self._admin_app(token), server_header=self.config.server.server_header)
        loop = asyncio.get_running_loop()
        signals = {signal.SIGTERM: self._stop.set, signal.SIGINT: self._stop.set}
        signals[signal.SIGHUP] = self._reload_in_background
        try:
            await runner.setup()
            tls = self._admin_tls
            site = web.TCPSite(
                runner, admin.host, admin.port, ssl_context=tls.context if tls else None
            )
            await site.start()
            host, port = runner.addresses[0][:2]
            scheme = "https" if tls else "http"
            self.admin_url = f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"
            for sig, handler in signals.items():
                loop.add_signal_handler(sig, handler)
            self._generation = 1
            started = await self._start_generation(self.config, self._generation)
            if not started:
                logger.error("the workers did not start; see their log above")
                return 1
            logger.info(
                "edgeproxy supervisor: %d workers serving on %s://%s:%d; admin on %s",
                len(self._workers),
                "https" if server.tls_cert else "http",
                server.host,
                self._port,
                self.admin_url,
            )
            await self._stop.wait()
            return await self._drain()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            await runner.cleanup()
            for task in list(self._tasks):
                task.cancel()
            for worker in self._workers:
                if worker.alive and worker.process is not None:
                    worker.process.kill()
            reserved.close()
            shutil.rmtree(self._dir, ignore_errors=True)

    async def _drain(self) -> int:
        """SIGTERM to every worker; 0 when all exited cleanly within the grace period."""
        self._stopping = True
        grace = self.config.server.grace_period
        logger.info("draining %d workers for up to %.1fs", len(self._workers), grace)
        workers = [w for w in self._workers if w.alive]
        for worker in workers:
            self._signal(worker, signal.SIGTERM)
        codes = await self._wait_exit(workers, grace + _EXIT_MARGIN)
        clean = all(code == 0 for code in codes)
        logger.info("workers stopped: %s", "all drained" if clean else f"exit codes {codes}")
        return 0 if clean else 1

    async def _wait_exit(self, workers: list[Worker], timeout: float) -> list[int | None]:
        procs = [w.process for w in workers if w.process is not None]
        waits = [asyncio.ensure_future(p.wait()) for p in procs]
        if waits:
            await asyncio.wait(waits, timeout=timeout)
        for proc in procs:
            if proc.returncode is None:
                logger.warning("worker pid %d did not exit in time; killing it", proc.pid)
                proc.kill()
        for wait in waits:
            wait.cancel()
        return [p.returncode for p in procs]

    # -- workers ------------------------------------------------------------

    def _worker_config(self, config: Config, generation: int) -> str:
        """The worker's config, as JSON in the private directory: the port fixed, shared."""
        data = config.model_dump(mode="json")
        data["server"].update(port=self._port, reuse_port=True, workers=1)
        # The workers' admin apps are on private sockets: the port, its TLS and token are ours.
        data["admin"].update(enabled=False, token=None, token_env=None, tls_cert=None, tls_key=None)
        if config.base_dir is not None:
            data["base_dir"] = str(config.base_dir)
        path = os.path.join(self._dir, f"config-{generation}.json")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(data))
        return path

    async def _start_generation(self, config: Config, generation: int) -> bool:
        """Start ``config``'s workers and wait until each listens; False (and none left
        running) when one does not."""
        path = self._worker_config(config, generation)
        workers = [
            Worker(index, generation, os.path.join(self._dir, f"worker-{generation}-{index}.sock"))
            for index in range(config.server.worker_count())
        ]
        for worker in workers:
            await self._spawn(worker, path)
        listening = await asyncio.gather(*(self._until_listening(w) for w in workers))
        if not all(listening):
            for worker in workers:
                if worker.alive and worker.process is not None:
                    worker.process.kill()
                    await worker.process.wait()
            return False
        for worker in workers:
            worker.watcher = self._keep(self._watch(worker, path))
        self._workers.extend(workers)
        return True

    async def _spawn(self, worker: Worker, config_path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(worker.socket)
        # Workers keep their series in memory; the supervisor sums them when scraped.
        env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
        worker.process = await asyncio.create_subprocess_exec(
            *self._python,
            WORKER_COMMAND,
            "--config-json",
            config_path,
            "--admin-socket",
            worker.socket,
            "--log-level",
            self._log_level,
            "--supervisor-pid",
            str(os.getpid()),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
        )
        worker.started_at = time.monotonic()

    async def _until_listening(self, worker: Worker) -> bool:
        """Whether the worker's admin socket answers before it exits or the time is up."""
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if not worker.alive:
                assert worker.process is not None and worker.process.returncode is not None
                logger.error(
                    "worker %d (pid %s) %s while starting",
                    worker.index,
                    worker.pid,
                    _exit_reason(worker.process.returncode),
                )
                return False
            if await self._ask(worker, "GET", "/healthz") is not None:
                return True
            await asyncio.sleep(0.05)
        logger.error(
            "worker %d (pid %s) did not listen within %.0fs",
            worker.index,
            worker.pid,
            _START_TIMEOUT,
        )
        return False

    async def _watch(self, worker: Worker, config_path: str) -> None:
        """Restart the worker whenever it dies, unless it was asked to stop."""
        while True:
            assert worker.process is not None
            code = await worker.process.wait()
            pid = worker.process.pid
            if self._stopping or worker.retiring:
                self._forget(worker)
                return
            worker.last_exit = _exit_reason(code)
            lived = time.monotonic() - worker.started_at
            worker.failures = 1 if lived >= _STABLE_AFTER else worker.failures + 1
            pause = min(_BACKOFF_MAX, _BACKOFF_FIRST * 2 ** (worker.failures - 1))
            logger.warning(
                "worker %d (pid %d) %s after %.1fs; restarting it in %.1fs",
                worker.index,
                pid,
                worker.last_exit,
                lived,
                pause,
            )
            await asyncio.sleep(pause)
            if self._stopping or worker.retiring:
                self._forget(worker)
                return
            worker.restarts += 1
            await self._spawn(worker, config_path)

    def _forget(self, worker: Worker) -> None:
        if worker in self._workers and worker.retiring:
            self._workers.remove(worker)

    def _signal(self, worker: Worker, sig: signal.Signals) -> None:
        if worker.alive and worker.process is not None:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(sig)

    def _keep(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- reload ---------------------------------------------------------------

    def _reload_in_background(self) -> None:
        # The admin listener's certificate, then the workers (theirs load as they start).
        if self._admin_tls is not None:
            self._admin_tls.reload()
        self._keep(self.reload())

    async def reload(self) -> dict[str, Any]:
        """Read the config again and, when it loads, replace the workers with new ones.

        Returns what happened: ``{"reloaded": True, "generation": n}`` or
        ``{"reloaded": False, "errors": [...]}`` (the running workers are untouched).
        """
        async with self._reload_lock:
            result = await self._reload()
            self.last_reload = dict(result, at=time.time())
            return result

    async def _reload(self) -> dict[str, Any]:
        if self._stopping:
            return {"reloaded": False, "errors": ["the supervisor is shutting down"]}
        try:
            config = await asyncio.to_thread(self._load)
            await asyncio.to_thread(check_tls_files, config)
        except ConfigError as exc:
            errors = [str(exc)]
            logger.error("reload refused, the running config stays: %s", exc)
            return {"reloaded": False, "errors": errors}
        moved = [
            f"{key}: listener address changes need a restart"
            for key, old, new in (
                ("server.host", self.config.server.host, config.server.host),
                ("server.port", self.config.server.port, config.server.port),
                ("admin.host", self.config.admin.host, config.admin.host),
                ("admin.port", self.config.admin.port, config.admin.port),
            )
            if old != new
        ]
        if moved:
            logger.error("reload refused, the running config stays: %s", "; ".join(moved))
            return {"reloaded": False, "errors": moved}
        old = [w for w in self._workers if not w.retiring]
        generation = self._generation + 1
        if not await self._start_generation(config, generation):
            message = "the new workers did not start; the running ones stay (see the log)"
            logger.error("reload refused: %s", message)
            return {"reloaded": False, "errors": [message]}
        self._generation = generation
        self.config = config
        for worker in old:
            worker.retiring = True
            self._signal(worker, signal.SIGTERM)
        logger.info(
            "reloaded: generation %d serving, %d old workers draining", generation, len(old)
        )
        return {"reloaded": True, "generation": generation}

    # -- the admin port ---------------------------------------------------------

    async def _ask(
        self, worker: Worker, method: str, path: str, **kwargs: Any
    ) -> tuple[int, bytes, str] | None:
        """A request to a worker's admin socket: (status, body, content type), None when it
        does not answer."""
        try:
            connector = aiohttp.UnixConnector(path=worker.socket)
            timeout = aiohttp.ClientTimeout(total=_ASK_TIMEOUT)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                async with session.request(method, "http://worker" + path, **kwargs) as resp:
                    return resp.status, await resp.read(), resp.content_type
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    def _serving(self) -> list[Worker]:
        return [w for w in self._workers if w.alive and not w.retiring]

    async def _ask_all(self, method: str, path: str, **kwargs: Any) -> list[Any]:
        workers = self._serving()
        answers = await asyncio.gather(*(self._ask(w, method, path, **kwargs) for w in workers))
        return list(zip(workers, answers, strict=True))

    async def status(self) -> dict[str, Any]:
        """The admin ``/status``: the first worker's, with what adds up summed over all,
        and a ``workers`` list."""
        statuses: list[tuple[Worker, dict[str, Any] | None]] = []
        for worker, answer in await self._ask_all("GET", "/status"):
            body = orjson.loads(answer[1]) if answer is not None and answer[0] == 200 else None
            statuses.append((worker, body))
        found = [s for _, s in statuses if s is not None]
        merged: dict[str, Any] = dict(found[0]) if found else {"pop": self.config.pop.name}
        merged["in_flight"] = sum(s.get("in_flight", 0) for s in found)
        merged["ready"] = any(s.get("ready") for s in found)
        merged["regions"] = _sum_regions([s.get("regions") or [] for s in found])
        if found:
            merged["cache"] = _sum_cache([s.get("cache") for s in found])
            merged["recent"] = _sum_recent([s.get("recent") for s in found])
        merged["supervisor"] = {
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "generation": self._generation,
            "workers": len(self._serving()),
            "last_reload": self.last_reload,
        }
        merged["workers"] = [
            {
                "index": worker.index,
                "generation": worker.generation,
                "pid": worker.pid,
                "restarts": worker.restarts,
                "last_exit": worker.last_exit,
                "answering": body is not None,
                "ready": bool(body and body.get("ready")),
                "in_flight": body.get("in_flight") if body else None,
                "requests_total": (
                    sum(r.get("requests_total", 0) for r in body.get("regions") or [])
                    if body
                    else None
                ),
            }
            for worker, body in statuses
        ]
        return merged

    def _admin_app(self, token: str | None) -> web.Application:
        async def healthz(request: web.Request) -> web.Response:
            alive = len(self._serving())
            return json_response(
                {"status": "ok" if alive else "no workers", "workers": alive},
                200 if alive > 0 else 503,
            )

        async def readyz(request: web.Request) -> web.Response:
            workers = []
            for worker, answer in await self._ask_all("GET", "/readyz"):
                ready = answer is not None and answer[0] == 200
                body = orjson.loads(answer[1]) if answer is not None else None
                workers.append(
                    {"index": worker.index, "pid": worker.pid, "ready": ready, "detail": body}
                )
            ready = any(w["ready"] for w in workers)
            return json_response({"ready": ready, "workers": workers}, 200 if ready else 503)

        async def status(request: web.Request) -> web.Response:
            return json_response(await self.status())

        async def metrics(request: web.Request) -> web.Response:
            # Every worker's own series, summed here (the text format, which every
            # prometheus-client version parses); rendered as the scraper asked.
            scraped = [
                (worker.pid, answer[1].decode())
                for worker, answer in await self._ask_all(
                    "GET", "/metrics", headers={"Accept": "text/plain"}
                )
                if answer is not None and answer[0] == 200
            ]
            if not scraped:
                return web_error(503, "server_error", "no worker answered", code="no_worker")
            alive = [w.pid for w in self._workers if w.alive]
            families = self._worker_metrics.merge(scraped, alive)
            encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Families(families))
            body = await asyncio.to_thread(encoder, registry)
            response = web.Response(body=body, headers={"Content-Type": content_type})
            response.enable_compression()
            return response

        async def purge(request: web.Request) -> web.Response:
            body = await request.read()
            purged = 0
            answered = 0
            last: tuple[int, bytes, str] | None = None
            for _, answer in await self._ask_all(
                "POST",
                "/cache/purge",
                data=body,
                params=request.query,
                headers={"Content-Type": request.headers.get("Content-Type", "application/json")},
            ):
                if answer is None:
                    continue
                last = answer
                if answer[0] == 200:
                    answered += 1
                    purged += int(orjson.loads(answer[1]).get("purged", 0))
            if answered == 0 and last is not None:
                return web.Response(status=last[0], body=last[1], content_type="application/json")
            return json_response({"purged": purged, "workers": answered})

        async def reload(request: web.Request) -> web.Response:
            return reload_answer(await self.reload())

        handlers = AdminHandlers(
            healthz=healthz,
            readyz=readyz,
            status=status,
            cache_purge=purge,
            reload=reload,
            metrics=metrics,
        )
        return build_admin_app(
            handlers, token=token, server_header=self.config.server.server_header
        )


class _Families:
    """A collector of families already built (the workers' summed series)."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families


def _sum_regions(per_worker: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The first worker's region entries, with the counters and gauges that add up summed
    over every worker, and ``share`` recomputed from the summed requests."""
    merged: dict[str, dict[str, Any]] = {}
    for regions in per_worker:
        for region in regions:
            name = str(region.get("name"))
            if name not in merged:
                merged[name] = dict(region)
                merged[name]["pool"] = dict(region.get("pool") or {})
                continue
            into = merged[name]
            for key in _REGION_SUMS:
                into[key] = into.get(key, 0) + region.get(key, 0)
            pool = region.get("pool") or {}
            for key in _POOL_SUMS:
                into["pool"][key] = into["pool"].get(key, 0) + pool.get(key, 0)
    total = sum(r.get("requests_total", 0) for r in merged.values())
    for region in merged.values():
        region["share"] = round(region.get("requests_total", 0) / total, 4) if total else 0.0
    return list(merged.values())


def _add_counts(into: dict[str, Any], other: dict[str, Any]) -> None:
    """Add ``other``'s numbers (not flags) into ``into``, one level of dicts deep."""
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key] = dict(into[key])
            for name, count in value.items():
                if isinstance(count, int | float) and not isinstance(count, bool):
                    into[key][name] = into[key].get(name, 0) + count
        elif isinstance(value, int | float) and not isinstance(value, bool):
            current = into.get(key)
            if isinstance(current, int | float) and not isinstance(current, bool):
                into[key] = current + value


def _sum_cache(sections: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The workers' cache counters summed and the hit ratio worked out from the sums; the
    tiers as the first worker sees them (a shared Redis is the same for all)."""
    found = [s for s in sections if s]
    if not found:
        return None
    merged = dict(found[0])
    for other in found[1:]:
        _add_counts(merged, {k: v for k, v in other.items() if k not in ("hit_ratio", "tiers")})
    outcomes = merged.get("outcomes") or {}
    served = sum(outcomes.get(k, 0) for k in ("HIT", "STALE", "COALESCED"))
    total = served + outcomes.get("MISS", 0)
    merged["hit_ratio"] = round(served / total, 4) if total else None
    return merged


def _sum_recent(sections: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The recent window: requests, errors and per-region counts summed, each series step
    summed; the latency percentiles are the first worker's (percentiles do not add up)."""
    found = [s for s in sections if s]
    if not found:
        return None
    merged = dict(found[0])
    for key in ("requests", "errors", "tokens_per_s"):
        merged[key] = sum(s.get(key) or 0 for s in found)
    regions: dict[str, Any] = {}
    for section in found:
        for name, count in (section.get("regions") or {}).items():
            regions[name] = regions.get(name, 0) + count
    merged["regions"] = regions
    series = [dict(step) for step in found[0].get("series") or []]
    for other in found[1:]:
        for step, add in zip(series, other.get("series") or [], strict=False):
            for key in ("requests", "errors"):
                step[key] = (step.get(key) or 0) + (add.get(key) or 0)
    merged["series"] = series
    merged["percentiles_from"] = "the first worker"
    return merged
