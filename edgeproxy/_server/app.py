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

from edgeproxy._core.build import build
from edgeproxy._core.config import Config, ConfigError
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.response import StreamResponse
from edgeproxy._observability.access_log import AccessLog
from edgeproxy._observability.metrics import Metrics
from edgeproxy._observability.tracing import Tracing
from edgeproxy._pipeline import JSON_BODY_LIMIT, Pipeline
from edgeproxy._server.admin import AdminRunner, admin_app
from edgeproxy._server.aio import add_routes, exchange_for, mount_prefix, send_answer
from edgeproxy._server.asgi import AsgiApp
from edgeproxy._server.generation import (
    Generation,
    Retiring,
    build_plugins,
    open_generation,
    restart_errors,
)
from edgeproxy._server.h2server import H2Site
from edgeproxy._server.listener import (
    ConnectionGuard,
    GuardedSite,
    expect_handler,
    limits_middleware,
)
from edgeproxy._server.tls import ListenerTls
from edgeproxy._shared.loadview import LoadView
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

    ``proxy.asgi`` is the same proxy as an ASGI application: mount it in Starlette
    or FastAPI (``app.mount("/llm", proxy.asgi)``, with ``lifespan=proxy.lifespan``
    on the host) or serve it with an ASGI server, whose lifespan events then open
    and close the pools.
    """

    def __init__(self, config: Config, *, plugins: Iterable[object] = ()) -> None:
        """Build the proxy and load its plugins: those given here, ``[plugins] enabled``,
        and the ``edgeproxy.plugins`` entry points. A plugin that cannot load raises
        :class:`~edgeproxy.PluginLoadError` naming it."""
        self.config = config
        # The plugins given here and the built-in ones, kept to register again (the same
        # objects) when a reload loads [plugins] anew.
        self._given: list[tuple[str, object]] = []
        for plugin in plugins:
            # Modules by their name, objects by their class: names appear in error logs.
            name = getattr(plugin, "__name__", None) or type(plugin).__name__
            if any(name == known for known, _ in self._given):
                name = f"{name}-{id(plugin):x}"
            self._given.append((name, plugin))
        self._builtin = self._observability()
        self.plugins, self._configured = build_plugins(config, self._given, self._builtin)
        self.started_at = time.time()
        self._generation: Generation | None = None
        self._regions: RegionSet | None = None
        self._pipeline: Pipeline | None = None
        self._load_view: LoadView | None = None
        self._users = 0
        self.ever_opened = False
        """Whether :meth:`open` ever succeeded (an ASGI host without a lifespan opens the
        proxy on its first request, once, never again after it closed)."""
        # Generations replaced by a reload, draining in the background until closed.
        self._retiring = Retiring()
        self._reload_lock = asyncio.Lock()
        # What re-reads the config for SIGHUP and POST /reload (serve() sets it); None:
        # the admin's /reload answers 409 reload_unsupported.
        self.loader: Callable[[], Config] | None = None
        # The last reload, for /status: ok, errors, at.
        self.last_reload: dict[str, Any] | None = None
        self._runner: web.AppRunner | None = None
        # The HTTP/2 client listener (server.http2), in place of _runner's.
        self._h2: H2Site | None = None
        self._admin_runner: web.AppRunner | None = None
        self.draining = False
        # Bodies are streamed or buffered by the pipeline itself, up to its own limit.
        # Input limits: connection guards on the own listener; the request-head
        # checks run before any stage or plugin sees the request.
        # [server] needs a restart to change: read once, not per request.
        self._server_header = server_header = config.server.server_header
        self.guard = ConnectionGuard(config.limits, server_header)
        self.app = web.Application(
            client_max_size=JSON_BODY_LIMIT + 1,
            middlewares=[limits_middleware(config.limits, server_header)],
        )
        self.app[PROXY_KEY] = self
        self.app.cleanup_ctx.append(self._lifespan)
        # Every path, a decoded newline (%0A) in it too, and the target "*"; Expect is
        # answered by the middleware.
        expect = expect_handler(config.limits)
        self._own_paths = add_routes(self.app.router, self._handle, expect)
        asterisk = _AsteriskResource()
        self.app.router.register_resource(asterisk)
        asterisk.add_route("*", self._handle, expect_handler=expect)
        # The prefix _handle strips, by the route's resource.
        self._prefixes: dict[AbstractResource | None, str] = {}
        self.admin_app = admin_app(self, token=_admin_token(config))
        # The same proxy for ASGI hosts and servers (the HTTP/2 listener).
        self.asgi = AsgiApp(self)
        self.tls: ListenerTls | None = None
        self.admin_tls: ListenerTls | None = None

    def _observability(self) -> list[tuple[str, object]]:
        """Built-in metrics, tracing and access log: plugins on the same hooks as any other.

        Their resources (tracer provider, log file, multiprocess sync) open
        and close in the lifespan, through ``edgeproxy_startup``/``_shutdown``.
        """
        config = self.config
        builtin: list[tuple[str, object]] = []
        self.metrics: Metrics | None = None
        if config.metrics.enabled:
            self.metrics = Metrics(config, self.status)
            builtin.append(("edgeproxy.metrics", self.metrics))
        self.tracing = Tracing.from_config(config.tracing, pop=config.pop.name)
        if self.tracing is not None:
            builtin.append(("edgeproxy.tracing", self.tracing))
        if config.access_log.enabled:
            builtin.append(("access_log", AccessLog.from_config(config.access_log)))
        return builtin

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

    @contextlib.asynccontextmanager
    async def lifespan(self, app: object = None) -> AsyncIterator[None]:
        """The proxy open for the duration of the block: pass it as an ASGI host's
        ``lifespan`` (Starlette, FastAPI), whose router does not forward lifespan events
        to the apps it mounts."""
        await self.open()
        try:
            yield
        finally:
            await self.close()

    @property
    def is_open(self) -> bool:
        """Whether :meth:`open` has run (and :meth:`close` not yet): requests are served."""
        return self._generation is not None

    def setup(self, app: web.Application) -> None:
        """Tie the proxy's resources to a host ``app`` that calls :meth:`forward` itself."""
        app.cleanup_ctx.append(self._lifespan)

    async def open(self) -> None:
        """Open the pools and warm them. Counted, so several host apps may share one proxy.

        The first generation opens on its own exit stack (see :meth:`reload`); then
        the plugins' startup hooks run.
        """
        self._users += 1
        if self._users > 1:
            return
        try:
            generation = await open_generation(1, self.config, self.plugins)
        except BaseException:
            self._users -= 1
            raise
        self._swap(generation)
        self.ever_opened = True
        try:
            await self.plugins.call_all("edgeproxy_startup", proxy=self)
        except BaseException:
            self._users -= 1
            try:
                # Plugins that did start get their shutdown hook, also when a later one fails.
                await self.plugins.call_all_logged("edgeproxy_shutdown", proxy=self)
            finally:
                await self._close_current()
            raise

    async def close(self) -> None:
        """Close what :meth:`open` opened, in reverse order, once its last user closes.

        Generations a reload retired and that still drain are closed first.
        """
        self._users -= 1
        if self._users > 0 or self._generation is None:
            return
        try:
            await self._retiring.close()
            await self.plugins.call_all_logged("edgeproxy_shutdown", proxy=self)
        finally:
            await self._close_current()

    def _swap(self, generation: Generation) -> None:
        # No await here: a request sees the old generation whole or the new one whole.
        self._generation = generation
        self._regions, self._pipeline = generation.regions, generation.pipeline
        self._load_view = generation.load_view

    async def _close_current(self) -> None:
        generation, self._generation = self._generation, None
        try:
            if generation is not None:
                await generation.close()
        finally:
            self._regions = self._pipeline = self._load_view = None

    # -- reload ----------------------------------------------------------

    async def reload(self, config: Config) -> int:
        """Apply ``config`` in place, without dropping a connection or a request.

        A new generation (regions and their pools, the pipeline with its routes,
        limits, cache and fallback) opens and warms beside the running one, then
        takes every new request; requests already running finish on the old
        one, which closes once they are done (within ``server.grace_period``).
        Plugins are loaded again only when ``[plugins]`` changed: the new
        configured ones get ``edgeproxy_startup`` before the swap, the old ones
        ``edgeproxy_shutdown`` once the old generation drained.

        Raises :class:`~edgeproxy.ConfigError` naming each changed key of a
        section that needs a restart (``server``, ``admin``, ``limits``, ``pop``,
        ``metrics``, ``tracing``, ``access_log``), or the error that stopped the
        new generation from opening; then nothing changed. Returns the new
        generation's number.
        """
        async with self._reload_lock:
            try:
                number = await self._reload(config)
            except Exception as exc:
                errors = exc.errors if isinstance(exc, ConfigError) else [f"{exc}"]
                self._reloaded(errors)
                raise
            self._reloaded([])
            return number

    def _reloaded(self, errors: list[str]) -> None:
        self.last_reload = {"ok": not errors, "errors": errors, "at": time.time()}
        if errors:
            logger.error("reload refused, the running config stays: %s", "; ".join(errors))

    async def reload_from_loader(self) -> dict[str, Any]:
        """Read the config again with :attr:`loader` and :meth:`reload` it (SIGHUP and
        the admin's ``POST /reload``): ``{"reloaded": True, "generation": n, ...}`` or
        ``{"reloaded": False, "errors": [...]}``."""
        if self.loader is None:
            return {"reloaded": False, "errors": ["this proxy has no config loader"]}
        try:
            config = await asyncio.to_thread(self.loader)
        except ConfigError as exc:
            self._reloaded(exc.errors)
            return {"reloaded": False, "errors": exc.errors}
        try:
            number = await self.reload(config)
        except Exception:  # noqa: BLE001 - logged and recorded by reload()
            errors = self.last_reload["errors"] if self.last_reload else ["reload failed"]
            return {"reloaded": False, "errors": errors}
        return {"reloaded": True, "generation": number, "in_place": True}

    async def _reload(self, config: Config) -> int:
        current = self._generation
        if current is None or self.draining:
            raise RuntimeError("the proxy is not open or is draining; nothing to reload")
        errors = restart_errors(self.config, config)
        if errors:
            raise ConfigError(errors)
        if config.plugins == self.config.plugins:
            plugins, configured, started = self.plugins, self._configured, frozenset[str]()
        else:
            plugins, configured = build_plugins(config, self._given, self._builtin)
            started = configured
        generation = await open_generation(current.number + 1, config, plugins)
        try:
            if started:
                await plugins.call_all_of(started, "edgeproxy_startup", proxy=self)
            if self.draining:
                raise RuntimeError("the proxy began draining during the reload")
        except BaseException:
            try:
                await plugins.call_all_logged_of(started, "edgeproxy_shutdown", proxy=self)
            finally:
                await generation.close()
            raise
        stopped = self._configured if started else frozenset[str]()
        self.config, self.plugins, self._configured = config, plugins, configured
        self._swap(generation)
        self._retiring.add(current, config.server.grace_period, stopped, self)
        if self.metrics is not None:
            self.metrics.add_labels(config)
        logger.info("config reloaded: generation %d serving", generation.number)
        return generation.number

    # -- serving ---------------------------------------------------------

    async def forward(self, request: web.Request, *, strip_prefix: str = "") -> web.StreamResponse:
        """Serve ``request`` through the pipeline; usable from any aiohttp handler.

        ``strip_prefix`` is removed from the start of the path before it goes
        upstream (``/llm/v1/models`` becomes ``/v1/models``). The host app must
        run the proxy's resources: call :meth:`setup` on it.
        """
        return await self._serve(request, strip_prefix)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        # Mounted with add_subapp("/llm", proxy.app), the route carries the
        # prefix; the region must see the path without it.
        resource = request.match_info.route.resource
        prefix = self._prefixes.get(resource)
        if prefix is None:
            # Worked out once per resource (there are a few), not per request.
            prefix = self._prefixes[resource] = mount_prefix(resource, self._own_paths)
        return await self._serve(request, prefix)

    async def _serve(self, request: web.Request, strip_prefix: str) -> web.StreamResponse:
        # serve_exchange() inlined: the aiohttp listener's path is the hottest.
        exchange = exchange_for(request, strip_prefix, self._server_header, self.config.websocket)
        generation = self._generation
        if generation is None:
            raise RuntimeError("the proxy is not open: run its app, or call start()")
        task = asyncio.current_task()
        assert task is not None
        generation.tasks.add(task)
        try:
            answer = await generation.pipeline.handle(exchange)
        finally:
            generation.tasks.discard(task)
        return await send_answer(exchange, answer)

    async def serve_exchange(self, exchange: Exchange) -> StreamResponse:
        """Serve one request a front end received, through the current generation's pipeline.

        The answer returned was sent already, or is a whole-body :class:`Response` for the
        front end to send. Front ends other than aiohttp (the ASGI application) call this.
        """
        # The generation is read once: the request keeps it whatever a reload swaps in,
        # and is counted among its tasks, which it cuts if they outlast its drain.
        generation = self._generation
        if generation is None:
            raise RuntimeError("the proxy is not open: run its app, or call start()")
        # Every front end runs each request in a task of its own.
        task = asyncio.current_task()
        assert task is not None
        generation.tasks.add(task)
        try:
            return await generation.pipeline.handle(exchange)
        finally:
            generation.tasks.discard(task)

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
                    return await self._serve(request, strip)
            return await handler(request)

        return edgeproxy_middleware

    @property
    def ready(self) -> bool:
        """Whether the proxy takes traffic: open, pools warmed, a region up, not draining."""
        return self.readiness()[0]

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Readiness and the admin ``/readyz`` body: its reasons when not ready.

        ``/readyz`` answers probes without a token, so the body names states and regions
        only: an error's text may hold a region's address or a file's path, and stays in
        :meth:`status`.
        """
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
                    body["warnings"] = [f"local model {model['state']}"]
            return True, body
        reasons = []
        if not model_ready and model is not None:
            reasons.append(f"local model {model['state']}")
        if self.draining:
            reasons.append("draining")
        if regions is None:
            reasons.append("not started")
        elif not regions.warmed:
            reasons.append("pools warming")
        else:
            for region in regions:
                if not region.up:
                    reasons.append(f"region {region.name} unreachable")
            if not any(r.up for r in regions):
                reasons.append("no region is reachable")
        body = {"status": "not ready", "reasons": reasons}
        if model is not None:
            body["local_model"] = model
        return False, body

    def _local_model_state(self) -> dict[str, Any] | None:
        """The local model's state for ``/readyz``; None when no model is configured or the
        proxy is closed."""
        if self._pipeline is None or not self._pipeline.fallback.local.enabled:
            return None
        local = self._pipeline.fallback.local
        # The name clients see in its answers; its error (a path, a loader's text) is not.
        return {"state": local.state, "model": local.model_name}

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
                alpn=("h2", "http/1.1") if server.http2 else ("http/1.1",),
            )
        admin_config = self.config.admin
        if admin_socket is None and admin_config.tls_cert and admin_config.tls_key:
            self.admin_tls = ListenerTls(
                "admin", admin_config.tls_cert, admin_config.tls_key, base_dir=base_dir
            )
        ssl_context = self.tls.context if self.tls is not None else None
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
        site: GuardedSite
        if server.http2:
            # HTTP/2 and HTTP/1.1 on one port; HTTP/1.1 connections go to the same handler.
            site = self._h2 = H2Site(
                self._runner,
                server.host,
                server.port,
                guard=self.guard,
                proxy=self,
                send_stall_timeout=server.h2_send_stall_timeout,
                backlog=server.backlog,
                reuse_port=server.reuse_port,
                ssl_context=ssl_context,
            )
        else:
            site = GuardedSite(
                self._runner,
                server.host,
                server.port,
                guard=self.guard,
                backlog=server.backlog,
                reuse_port=server.reuse_port,
                ssl_context=ssl_context,
            )
        await site.start()
        if admin_socket is not None or self.config.admin.enabled:
            self._admin_runner = AdminRunner(self.admin_app, server_header=self._server_header)
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
        if admin_socket is None and self._admin_runner is not None:
            admin_url = self.admin_url
            logger.info(
                "edgeproxy admin on %s: the status page at %s/, its JSON at %s/status, "
                "metrics at %s/metrics",
                admin_url,
                admin_url,
                admin_url,
                admin_url,
            )

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
        for retiring in self._retiring.generations():
            retiring.pipeline.draining = True
        drained = True
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()
            self.guard.start_draining()
            if pipeline is not None:
                # The generations a reload retired drain within the same grace period.
                deadline = time.monotonic() + grace
                drained = await pipeline.wait_idle(grace)
                drained = await self._retiring.wait(deadline - time.monotonic()) and drained
                if not drained:
                    logger.warning(
                        "grace period of %.1fs ended with %d requests in flight; cutting them",
                        grace,
                        pipeline.in_flight,
                    )
                    pipeline.responder.shutting_down = True
                    for retiring in self._retiring.generations():
                        retiring.pipeline.responder.shutting_down = True
                    self.guard.cut_requests()
                    # Cancelled, they only let go of what they hold (upstream streams).
                    if not await pipeline.wait_idle(_STRAGGLER_TIMEOUT):
                        logger.warning(
                            "%d requests still running after being cut", pipeline.in_flight
                        )
            if self._h2 is not None:
                self._h2.close_connections()
                self._h2 = None
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
            "build": build(),
            "ready": self.ready,
            "draining": self.draining,
            "uptime_s": round(time.time() - self.started_at, 3),
            # Those still finishing on a generation a reload retired count too.
            "in_flight": (self._pipeline.in_flight if self._pipeline is not None else 0)
            + sum(g.pipeline.in_flight for g in self._retiring.generations()),
            "regions": regions,
            "recent": self.metrics.recent() if self.metrics is not None else None,
            "fallback": self._pipeline.fallback.snapshot() if self._pipeline is not None else None,
            "admission": (
                self._pipeline.admission.snapshot() if self._pipeline is not None else None
            ),
            "limits": {
                **self.guard.snapshot(),
                # Requests every region rejected (poison) and the callers limited for them.
                "rejected_requests": (
                    self._pipeline.poison.snapshot() if self._pipeline is not None else None
                ),
            },
            "cache": self._pipeline.cache.status() if self._pipeline is not None else None,
            "stateful": (self._pipeline.owners.snapshot() if self._pipeline is not None else None),
            "chains": self._pipeline.chains.snapshot() if self._pipeline is not None else None,
            "websocket": (
                self._pipeline.sessions.snapshot() if self._pipeline is not None else None
            ),
            "shared_load": self._load_view.snapshot() if self._load_view is not None else None,
            "generation": self._generation.number if self._generation is not None else None,
            "retiring_generations": len(self._retiring),
            "reload": self.last_reload,
        }


PROXY_KEY = web.AppKey("edgeproxy.proxy", EdgeProxy)


def _runner_url(runner: web.AppRunner | None, *, tls: bool = False) -> str:
    return _address_url(runner.addresses if runner is not None else [], tls=tls)


def _address_url(addresses: list[Any], *, tls: bool = False) -> str:
    if not addresses:
        raise RuntimeError("not listening")
    address = addresses[0]
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


async def serve(
    config: Config,
    *,
    admin_socket: str | None = None,
    loader: Callable[[], Config] | None = None,
) -> int:
    """Run until SIGTERM or SIGINT, then drain. Returns the process exit code.

    ``admin_socket`` is for a worker under the supervisor (see :meth:`EdgeProxy.start`).
    ``loader`` reads the config again: with it, SIGHUP and ``POST /reload`` reload it
    in place (:meth:`EdgeProxy.reload`).
    """
    proxy = EdgeProxy(config)
    proxy.loader = loader
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
    reloads: set[asyncio.Task[Any]] = set()
    loop.add_signal_handler(signal.SIGHUP, _on_sighup, proxy, reloads)
    try:
        await stop.wait()
        logger.info("draining for up to %.1fs", config.server.grace_period)
        await proxy.stop()
    finally:
        for task in reloads:
            task.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    return 0


def _on_sighup(proxy: EdgeProxy, reloads: set[asyncio.Task[Any]]) -> None:
    proxy.reload_tls()
    if proxy.loader is not None:
        # Kept referenced until done: the loop holds tasks only weakly.
        task = asyncio.create_task(proxy.reload_from_loader())
        reloads.add(task)
        task.add_done_callback(reloads.discard)
        return
    # A worker under the supervisor has no loader: its supervisor reloads by new workers.
    logger.warning(
        "SIGHUP: serve() was given no config loader; only the TLS certificates were reloaded"
    )
