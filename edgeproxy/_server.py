"""The embedding API and the listeners: :class:`EdgeProxy`."""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_urldispatcher import AbstractResource

from ._cache import purge_response
from ._config import Config
from ._limits import ConnectionGuard, GuardedSite, limits_middleware
from ._metrics import Metrics
from ._pipeline import JSON_BODY_LIMIT, Pipeline
from ._plugins import Plugins
from ._regions import RegionSet
from ._statuspage import StatusPage
from ._tracing import Tracing

__all__ = ["EdgeProxy", "PROXY_KEY"]

logger = logging.getLogger("edgeproxy")


class EdgeProxy:
    """An edge proxy built from a :class:`Config`.

    ``proxy.app`` is an aiohttp application that forwards every request; it
    can run on its own (:meth:`start` / :meth:`stop`) or be mounted in a host
    application with ``parent.add_subapp("/llm", proxy.app)``. Pools and other
    resources open and close with the application that runs them, through
    ``cleanup_ctx``.
    """

    def __init__(self, config: Config, *, plugins: Iterable[object] = ()) -> None:
        """Build the proxy and load its plugins: those given here, ``[plugins] enabled``,
        and the ``edgeproxy.plugins`` entry points. A plugin that cannot load raises
        :class:`~edgeproxy.PluginLoadError` naming it."""
        self.config = config
        self.plugins = Plugins(config.plugins.fail_open)
        for plugin in plugins:
            # Modules by their name, objects by their class: names appear in error logs.
            name = getattr(plugin, "__name__", None) or type(plugin).__name__
            if self.plugins.pm.has_plugin(name):
                name = f"{name}-{id(plugin):x}"
            self.plugins.register(plugin, name=name)
        self.plugins.load_configured(config.plugins, base_dir=config.base_dir)
        self._register_observability()
        self.started_at = time.time()
        self._regions: RegionSet | None = None
        self._pipeline: Pipeline | None = None
        self._users = 0
        self._runner: web.AppRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self.draining = False
        # Bodies are streamed or buffered by the pipeline itself, up to its own limit.
        # Input limits: connection guards on the own listener; the request-head
        # checks run before any stage or plugin sees the request.
        self.guard = ConnectionGuard(config.limits)
        self.app = web.Application(
            client_max_size=JSON_BODY_LIMIT + 1, middlewares=[limits_middleware(config.limits)]
        )
        self.app[PROXY_KEY] = self
        self.app.cleanup_ctx.append(self._lifespan)
        self.app.router.add_route("*", "/{tail:.*}", self._handle)
        # The prefix _handle strips, by the route's resource.
        self._prefixes: dict[AbstractResource | None, str] = {}
        self.admin_app = _admin_app(self)

    def _register_observability(self) -> None:
        """Built-in metrics, tracing and access log: plugins on the same hooks as any other.

        Their resources (tracer provider, log file, multiprocess sync) open
        and close in the lifespan, through ``edgeproxy_startup``/``_shutdown``.
        """
        config = self.config
        self.metrics: Metrics | None = None
        if config.metrics.enabled:
            self.metrics = Metrics(config, self.status)
            self.plugins.register(self.metrics, name="edgeproxy.metrics")
        self.tracing = Tracing.from_config(config.tracing, pop=config.pop.name)
        if self.tracing is not None:
            self.plugins.register(self.tracing, name="edgeproxy.tracing")
        # A fault in metrics or tracing is logged and skipped: it never fails a request.
        self.plugins.fail_open |= {"edgeproxy.metrics", "edgeproxy.tracing"}
        if config.access_log.enabled:
            if self.plugins.pm.has_plugin("access_log"):
                logger.warning("[access_log] is on and the access_log plugin is loaded: one log")
            else:
                # Imported here: the plugin package imports edgeproxy itself.
                access_log = importlib.import_module("edgeproxy.plugins.access_log")
                self.plugins.register(access_log.from_config(config.access_log), name="access_log")

    # -- resources -------------------------------------------------------

    @property
    def regions(self) -> RegionSet:
        if self._regions is None:
            raise RuntimeError("the proxy is not open: run its app, or call start()")
        return self._regions

    @property
    def pipeline(self) -> Pipeline:
        if self._pipeline is None:
            raise RuntimeError("the proxy is not open: run its app, or call start()")
        return self._pipeline

    async def _lifespan(self, app: web.Application) -> AsyncIterator[None]:
        await self.open()
        try:
            yield
        finally:
            await self.close()

    def setup(self, app: web.Application) -> None:
        """Tie the proxy's resources to a host ``app`` that calls :meth:`forward` itself."""
        app.cleanup_ctx.append(self._lifespan)

    async def open(self) -> None:
        """Open the pools and warm them. Counted, so several host apps may share one proxy."""
        self._users += 1
        if self._users > 1:
            return
        regions = RegionSet(self.config)
        self._regions = regions
        self._pipeline = Pipeline(self.config, regions, self.plugins)
        # The local model loads in a worker thread while the pools warm; never waited for.
        self._pipeline.fallback.open()
        # Rate-limit buckets: Redis when configured (its absence only means local limits).
        await self._pipeline.admission.open()
        # The cache's backend: a Redis that does not answer is a warning (it fails open).
        await self._pipeline.cache.open()
        await regions.open()
        for region in regions:
            if not region.up:
                logger.warning(
                    "region %s (%s) is not reachable at startup; /readyz reports it",
                    region.name,
                    region.config.url,
                )
        try:
            await self.plugins.call_all("edgeproxy_startup", proxy=self)
        except BaseException:
            # Plugins that did start get their shutdown hook.
            await self.plugins.call_all_logged("edgeproxy_shutdown", proxy=self)
            await self._pipeline.fallback.close()
            await self._pipeline.admission.close()
            await self._pipeline.cache.close()
            await regions.close()
            self._regions = None
            self._pipeline = None
            self._users -= 1
            raise

    async def close(self) -> None:
        self._users -= 1
        if self._users > 0 or self._regions is None:
            return
        await self.plugins.call_all_logged("edgeproxy_shutdown", proxy=self)
        if self._pipeline is not None:
            await self._pipeline.fallback.close()
            await self._pipeline.admission.close()
            # Before the pools: background cache refreshes use them.
            await self._pipeline.cache.close()
        # Stops the health checks too; then the router lets go of its geo database.
        await self._regions.close()
        if self._pipeline is not None:
            self._pipeline.router.close()
        self._regions = None
        self._pipeline = None

    # -- serving ---------------------------------------------------------

    async def forward(self, request: web.Request, *, strip_prefix: str = "") -> web.StreamResponse:
        """Serve ``request`` through the pipeline; usable from any aiohttp handler.

        ``strip_prefix`` is removed from the start of the path before it goes
        upstream (``/llm/v1/models`` becomes ``/v1/models``). The host app must
        run the proxy's resources: call :meth:`setup` on it.
        """
        return await self.pipeline.handle(request, strip_prefix=strip_prefix)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        # Mounted with add_subapp("/llm", proxy.app), the route carries the
        # prefix; the region must see the path without it.
        resource = request.match_info.route.resource
        prefix = self._prefixes.get(resource)
        if prefix is None:
            # Worked out once per resource (there are one or two), not per request.
            canonical = resource.canonical if resource is not None else ""
            prefix = canonical[: -len("/{tail}")] if canonical.endswith("/{tail}") else ""
            self._prefixes[resource] = prefix
        return await self.pipeline.handle(request, strip_prefix=prefix)

    def middleware(self, *prefixes: str, strip_prefix: bool = False) -> Middleware:
        """An aiohttp middleware forwarding requests whose path starts with one of ``prefixes``.

        Other requests go on to the host app's own handlers. Call
        :meth:`setup` on the host app too, so the proxy's pools open and close
        with it. With ``strip_prefix``, the matched prefix is removed before
        the request goes upstream.
        """
        if not prefixes:
            raise ValueError("middleware() needs at least one path prefix")

        @web.middleware
        async def edgeproxy_middleware(
            request: web.Request,
            handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
        ) -> web.StreamResponse:
            for prefix in prefixes:
                if request.path.startswith(prefix):
                    strip = prefix.rstrip("/") if strip_prefix else ""
                    return await self.pipeline.handle(request, strip_prefix=strip)
            return await handler(request)

        return edgeproxy_middleware

    @property
    def ready(self) -> bool:
        return (
            self._regions is not None
            and self._regions.ready
            and not self.draining
            and self._local_model_ready()
        )

    def _local_model_ready(self) -> bool:
        """False only while ``local_model.ready_requires_model`` waits for the model."""
        if not self.config.local_model.ready_requires_model or self._pipeline is None:
            return True
        return self._pipeline.fallback.local.ready

    async def start(self) -> None:
        """Listen on ``[server]`` and, when enabled, ``[admin]``; returns once both listen."""
        server = self.config.server
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=1.0,
        )
        await self._runner.setup()
        site = GuardedSite(
            self._runner,
            server.host,
            server.port,
            guard=self.guard,
            backlog=server.backlog,
            reuse_port=server.reuse_port,
        )
        await site.start()
        if self.config.admin.enabled:
            self._admin_runner = web.AppRunner(self.admin_app, access_log=None)
            await self._admin_runner.setup()
            admin = web.TCPSite(self._admin_runner, self.config.admin.host, self.config.admin.port)
            await admin.start()
        logger.info("edgeproxy %s listening on %s", self.config.pop.name, self.url)

    @property
    def url(self) -> str:
        """The proxy listener's base URL, with the real port when port 0 was asked."""
        return _runner_url(self._runner)

    @property
    def admin_url(self) -> str:
        return _runner_url(self._admin_runner)

    async def stop(self, grace: float | None = None) -> bool:
        """Drain: stop accepting, let in-flight requests finish for ``grace`` seconds, close.

        Returns false if requests were still running when the grace period ended.
        """
        grace = self.config.server.grace_period if grace is None else grace
        self.draining = True
        if self._pipeline is not None:
            self._pipeline.draining = True
        drained = True
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()
            if self._pipeline is not None:
                drained = await self._pipeline.wait_idle(grace)
                if not drained:
                    logger.warning(
                        "grace period of %.1fs ended with %d requests in flight",
                        grace,
                        self._pipeline.in_flight,
                    )
            await self._runner.cleanup()
            self._runner = None
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            self._admin_runner = None
        return drained

    def status(self) -> dict[str, Any]:
        """The JSON served at the admin ``/status``."""
        regions = self._regions.snapshot() if self._regions is not None else []
        return {
            "pop": self.config.pop.name,
            "ready": self.ready,
            "draining": self.draining,
            "uptime_s": round(time.time() - self.started_at, 3),
            "in_flight": self._pipeline.in_flight if self._pipeline is not None else 0,
            "regions": regions,
            "recent": self.metrics.recent() if self.metrics is not None else None,
            "fallback": self._pipeline.fallback.snapshot() if self._pipeline is not None else None,
            "admission": (
                self._pipeline.admission.snapshot() if self._pipeline is not None else None
            ),
            "limits": self.guard.snapshot(),
            "cache": self._pipeline.cache.status() if self._pipeline is not None else None,
        }


PROXY_KEY = web.AppKey("edgeproxy.proxy", EdgeProxy)


def _runner_url(runner: web.AppRunner | None) -> str:
    if runner is None or not runner.addresses:
        raise RuntimeError("not listening")
    host, port = runner.addresses[0][:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _local_model_readiness(proxy: EdgeProxy) -> dict[str, Any] | None:
    """The local model's state for /readyz; None when no model is configured."""
    if proxy._pipeline is None or not proxy._pipeline.fallback.local.enabled:
        return None
    local = proxy._pipeline.fallback.local
    return {"state": local.state, "error": local.error, "model": local.model_name}


def _admin_app(proxy: EdgeProxy) -> web.Application:
    async def healthz(request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        model = _local_model_readiness(proxy)
        if proxy.ready:
            ready: dict[str, Any] = {"status": "ready"}
            if model is not None:
                ready["local_model"] = model
                if model["state"] in ("failed", "unavailable"):
                    ready["warnings"] = [f"local model {model['state']}: {model['error']}"]
            return _json(ready)
        reasons = []
        if model is not None and not proxy._local_model_ready():
            error = f": {model['error']}" if model["error"] else ""
            reasons.append(f"local model {model['state']}{error}")
        if proxy.draining:
            reasons.append("draining")
        if proxy._regions is None:
            reasons.append("not started")
        elif not proxy._regions.warmed:
            reasons.append("pools warming")
        else:
            for region in proxy._regions:
                if not region.up:
                    reasons.append(f"region {region.name} unreachable: {region.last_error}")
            if not any(r.up for r in proxy._regions):
                reasons.append("no region is reachable")
        body: dict[str, Any] = {"status": "not ready", "reasons": reasons}
        if model is not None:
            body["local_model"] = model
        return _json(body, status=503)

    async def status(request: web.Request) -> web.Response:
        return _json(proxy.status())

    app = web.Application()
    app[PROXY_KEY] = proxy
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)

    async def cache_purge(request: web.Request) -> web.Response:
        return await purge_response(proxy._pipeline.cache if proxy._pipeline else None, request)

    app.router.add_post("/cache/purge", cache_purge)
    app.router.add_get("/", StatusPage().handle)
    if proxy.metrics is not None:
        app.router.add_get("/metrics", proxy.metrics.handle)
    return app


# Allocations (net of frees) between young-generation collections in `serve`.
_GC_YOUNG_THRESHOLD = 7000


async def serve(config: Config) -> int:
    """Run until SIGTERM or SIGINT, then drain. Returns the process exit code."""
    import signal

    proxy = EdgeProxy(config)
    await proxy.start()
    # Garbage collector tuning for a serving process (embedding apps keep their own).
    # What start-up built (modules, config, plugins, the apps) lives as long as the
    # process: frozen, it is left out of the full passes, which otherwise walk all of
    # it (~40 ms) every few thousand requests. And with the default first-generation
    # threshold (700) the objects of a few in-flight requests alone trigger a young
    # pass every couple of dozen requests; cycles are still collected, a little later.
    # Together about 15-20 us of CPU per request, measured under load (16 connections).
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        logger.info("draining for up to %.1fs", config.server.grace_period)
        await proxy.stop()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0
