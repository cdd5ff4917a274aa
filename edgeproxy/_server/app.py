"""The embedding API and the listeners: :class:`EdgeProxy`."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_urldispatcher import AbstractResource
from yarl import URL

from edgeproxy._core.config import Config, ConfigError
from edgeproxy._observability.access_log import AccessLog
from edgeproxy._observability.metrics import Metrics
from edgeproxy._observability.tracing import Tracing
from edgeproxy._pipeline import JSON_BODY_LIMIT, Pipeline
from edgeproxy._plugins import Plugins
from edgeproxy._server.admin import admin_app
from edgeproxy._server.listener import (
    ConnectionGuard,
    GuardedSite,
    expect_handler,
    limits_middleware,
)
from edgeproxy._server.tls import ListenerTls
from edgeproxy._stages.loadview import LoadView
from edgeproxy._upstream.regions import RegionSet

if TYPE_CHECKING:
    from aiohttp.web_urldispatcher import _InfoDict

__all__ = ["EdgeProxy", "PROXY_KEY"]

logger = logging.getLogger("edgeproxy")

# Seconds a request cut at the end of the grace period has to let go of what it holds.
_STRAGGLER_TIMEOUT = 1.0


class _AsteriskResource(web.Resource):
    """The ``*`` request target (``OPTIONS *``), which no path route matches.

    Routed to the proxy like every path, so that the middleware answers it in
    the JSON shape, its ``Expect`` header included: unrouted, aiohttp's own
    404 or 417 would answer it in plain text.
    """

    @property
    def canonical(self) -> str:
        return "*"

    def add_prefix(self, prefix: str) -> None:
        """Nothing to prefix: mounted under a prefix, the proxy only ever sees paths."""

    def _match(self, path: str) -> dict[str, str] | None:
        return {} if path == "*" else None

    def raw_match(self, path: str) -> bool:
        return path == "*"

    def get_info(self) -> _InfoDict:
        return {"path": "*"}

    def url_for(self, **kwargs: str) -> URL:
        return URL("*")


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
        self._load_view: LoadView | None = None
        self._stack: contextlib.AsyncExitStack | None = None
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
        # Every path, a decoded newline (%0A) in it too, and the target "*"; Expect is
        # answered by the middleware.
        expect = expect_handler(config.limits)
        self.app.router.add_route("*", "/{tail:(?s:.*)}", self._handle, expect_handler=expect)
        asterisk = _AsteriskResource()
        self.app.router.register_resource(asterisk)
        asterisk.add_route("*", self._handle, expect_handler=expect)
        # The prefix _handle strips, by the route's resource.
        self._prefixes: dict[AbstractResource | None, str] = {}
        self.admin_app = admin_app(self, token=_admin_token(config))
        self.tls: ListenerTls | None = None
        self.admin_tls: ListenerTls | None = None

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
                self.plugins.register(AccessLog.from_config(config.access_log), name="access_log")

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

    @property
    def load_view(self) -> LoadView | None:
        """The load shared with every process on ``[shared_load] redis_url``; None when
        that is unset or the proxy is not open."""
        return self._load_view

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
        """Open the pools and warm them. Counted, so several host apps may share one proxy.

        Every resource is entered on one exit stack, so a failed start and
        :meth:`close` undo the same steps in the same (reverse) order.
        """
        self._users += 1
        if self._users > 1:
            return
        stack = contextlib.AsyncExitStack()
        try:
            regions = RegionSet(self.config)
            pipeline = Pipeline(self.config, regions, self.plugins)
            # The local model loads in a worker thread while the pools warm; never waited for.
            pipeline.fallback.open()
            stack.push_async_callback(pipeline.fallback.close)
            # Rate-limit buckets: Redis when configured (its absence only means local limits).
            await pipeline.admission.open()
            stack.push_async_callback(pipeline.admission.close)
            # The router lets go of its geo database once the regions are closed.
            stack.callback(pipeline.router.close)
            # Closing the regions stops the health checks too.
            stack.push_async_callback(regions.close)
            await regions.open()
            # The cache's backend: a Redis that does not answer is a warning (it fails open).
            # It closes before the pools, which its background refreshes use.
            await pipeline.cache.open()
            stack.push_async_callback(pipeline.cache.close)
            # The shared load view: a background task (Redis is never waited for here),
            # stopped before the regions it reads close.
            load_view = None
            if self.config.shared_load.enabled:
                load_view = LoadView(self.config.shared_load, regions, pop=self.config.pop.name)
                await load_view.open()
                stack.push_async_callback(load_view.close)
                # The router scores with its global in-flight counts while they are fresh.
                pipeline.router.load_view = load_view
            for region in regions:
                if not region.up:
                    logger.warning(
                        "region %s (%s) is not reachable at startup; /readyz reports it",
                        region.name,
                        region.config.url,
                    )
            # Plugins that did start get their shutdown hook, also when a later one fails.
            stack.push_async_callback(
                self.plugins.call_all_logged, "edgeproxy_shutdown", proxy=self
            )
            self._regions, self._pipeline, self._load_view = regions, pipeline, load_view
            await self.plugins.call_all("edgeproxy_startup", proxy=self)
        except BaseException:
            self._users -= 1
            try:
                await stack.aclose()
            finally:
                self._regions = self._pipeline = self._load_view = None
            raise
        self._stack = stack

    async def close(self) -> None:
        """Close what :meth:`open` opened, in reverse order, once its last user closes."""
        self._users -= 1
        if self._users > 0 or self._stack is None:
            return
        stack, self._stack = self._stack, None
        try:
            await stack.aclose()
        finally:
            self._regions = self._pipeline = self._load_view = None

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
        """Whether the proxy takes traffic: open, pools warmed, a region up, not draining."""
        return self.readiness()[0]

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Readiness and the admin ``/readyz`` body: its reasons when not ready."""
        model = self._local_model_state()
        model_ready = (
            model is None
            or not self.config.local_model.ready_requires_model
            or model["state"] == "ready"
        )
        regions = self._regions
        if regions is not None and regions.ready and not self.draining and model_ready:
            body: dict[str, Any] = {"status": "ready"}
            if model is not None:
                body["local_model"] = model
                if model["state"] in ("failed", "unavailable"):
                    body["warnings"] = [f"local model {model['state']}: {model['error']}"]
            return True, body
        reasons = []
        if not model_ready and model is not None:
            error = f": {model['error']}" if model["error"] else ""
            reasons.append(f"local model {model['state']}{error}")
        if self.draining:
            reasons.append("draining")
        if regions is None:
            reasons.append("not started")
        elif not regions.warmed:
            reasons.append("pools warming")
        else:
            for region in regions:
                if not region.up:
                    reasons.append(f"region {region.name} unreachable: {region.last_error}")
            if not any(r.up for r in regions):
                reasons.append("no region is reachable")
        body = {"status": "not ready", "reasons": reasons}
        if model is not None:
            body["local_model"] = model
        return False, body

    def _local_model_state(self) -> dict[str, Any] | None:
        """The local model's state; None when no model is configured or the proxy is closed."""
        if self._pipeline is None or not self._pipeline.fallback.local.enabled:
            return None
        local = self._pipeline.fallback.local
        return {"state": local.state, "error": local.error, "model": local.model_name}

    async def purge_cache(
        self, *, key: str | None = None, prefix: str | None = None, tenant: str | None = None
    ) -> int:
        """Delete cache entries: the one named ``key``, those of ``tenant``, or those whose key
        starts with ``prefix`` (``""``: all). Returns how many went."""
        return await self.pipeline.cache.purge(key=key, prefix=prefix, tenant=tenant)

    async def start(self, *, admin_socket: str | None = None) -> None:
        """Listen on ``[server]`` and, when enabled, ``[admin]``; returns once both listen.

        ``admin_socket``: serve the admin app on this Unix socket instead of ``[admin]``'s
        address (a worker under the supervisor, which owns the admin port).

        Raises :class:`~edgeproxy.ConfigError` when a TLS file of ``[server]`` or
        ``[admin]`` does not load, before anything opens.
        """
        server = self.config.server
        base_dir = self.config.base_dir
        if server.tls_cert and server.tls_key:
            self.tls = ListenerTls(
                "server",
                server.tls_cert,
                server.tls_key,
                client_ca=server.tls_client_ca,
                base_dir=base_dir,
            )
        admin_config = self.config.admin
        if admin_socket is None and admin_config.tls_cert and admin_config.tls_key:
            self.admin_tls = ListenerTls(
                "admin", admin_config.tls_cert, admin_config.tls_key, base_dir=base_dir
            )
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            # What aiohttp waits for handlers at cleanup, twice: none is left by then
            # (stop() cuts them at the end of the grace period), so this only bounds a
            # handler that ignores its cancellation.
            shutdown_timeout=_STRAGGLER_TIMEOUT,
        )
        await self._runner.setup()
        site = GuardedSite(
            self._runner,
            server.host,
            server.port,
            guard=self.guard,
            backlog=server.backlog,
            reuse_port=server.reuse_port,
            ssl_context=self.tls.context if self.tls is not None else None,
        )
        await site.start()
        if admin_socket is not None or self.config.admin.enabled:
            self._admin_runner = web.AppRunner(self.admin_app, access_log=None)
            await self._admin_runner.setup()
            admin: web.BaseSite
            if admin_socket is not None:
                admin = web.UnixSite(self._admin_runner, admin_socket)
            else:
                admin = web.TCPSite(
                    self._admin_runner,
                    admin_config.host,
                    admin_config.port,
                    ssl_context=self.admin_tls.context if self.admin_tls is not None else None,
                )
            await admin.start()
        logger.info("edgeproxy %s listening on %s", self.config.pop.name, self.url)

    @property
    def url(self) -> str:
        """The proxy listener's base URL, with the real port when port 0 was asked."""
        return _runner_url(self._runner, tls=self.tls is not None)

    @property
    def admin_url(self) -> str:
        return _runner_url(self._admin_runner, tls=self.admin_tls is not None)

    def reload_tls(self) -> bool:
        """Read the listeners' certificates and keys again (SIGHUP does this): new
        handshakes get the new ones; a pair that does not load is logged and the old one
        kept. False when one did not load."""
        results = [tls.reload() for tls in (self.tls, self.admin_tls) if tls is not None]
        return all(results)

    async def stop(self, grace: float | None = None) -> bool:
        """Drain: stop accepting, let in-flight requests finish for ``grace`` seconds, close.

        Request bodies still arriving must keep up ``limits.min_body_rate`` from
        now on, after a grace of a second at most: slow clients do not hold the
        drain open. What still runs when the grace period ends is cut then, not
        later: an SSE stream gets an ``event: error`` (``shutting_down``), a
        request not answered yet a 503, and the connections close.

        Returns false if requests were still running when the grace period ended.
        """
        grace = self.config.server.grace_period if grace is None else grace
        self.draining = True
        pipeline = self._pipeline
        if pipeline is not None:
            pipeline.draining = True
        drained = True
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()
            self.guard.start_draining()
            if pipeline is not None:
                drained = await pipeline.wait_idle(grace)
                if not drained:
                    logger.warning(
                        "grace period of %.1fs ended with %d requests in flight; cutting them",
                        grace,
                        pipeline.in_flight,
                    )
                    pipeline.stream.shutting_down = True
                    self.guard.cut_requests()
                    # Cancelled, they only let go of what they hold (upstream streams).
                    if not await pipeline.wait_idle(_STRAGGLER_TIMEOUT):
                        logger.warning(
                            "%d requests still running after being cut", pipeline.in_flight
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
        if self._load_view is not None:
            self._load_view.annotate(regions)
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
            "shared_load": self._load_view.snapshot() if self._load_view is not None else None,
        }


PROXY_KEY = web.AppKey("edgeproxy.proxy", EdgeProxy)


def _runner_url(runner: web.AppRunner | None, *, tls: bool = False) -> str:
    if runner is None or not runner.addresses:
        raise RuntimeError("not listening")
    address = runner.addresses[0]
    if isinstance(address, str):  # a Unix socket
        return f"unix:{address}"
    host, port = address[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def _admin_token(config: Config) -> str | None:
    try:
        return config.admin.resolved_token()
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None


# Allocations (net of frees) between young-generation collections in `serve`.
_GC_YOUNG_THRESHOLD = 7000


async def serve(config: Config, *, admin_socket: str | None = None) -> int:
    """Run until SIGTERM or SIGINT, then drain. Returns the process exit code.

    ``admin_socket`` is for a worker under the supervisor (see :meth:`EdgeProxy.start`).
    """
    proxy = EdgeProxy(config)
    await proxy.start(admin_socket=admin_socket)
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
    # A reload is the supervisor's: it starts workers on the new config and drains these.
    # A lone process reloads its certificates and keeps serving.
    loop.add_signal_handler(signal.SIGHUP, _on_sighup, proxy)
    try:
        await stop.wait()
        logger.info("draining for up to %.1fs", config.server.grace_period)
        await proxy.stop()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    return 0


def _on_sighup(proxy: EdgeProxy) -> None:
    proxy.reload_tls()
    logger.warning(
        "SIGHUP: a single process reloads its TLS certificates only, not its config; run with "
        "[server] workers >= 2 (the supervisor reloads by starting new workers) or restart"
    )
