"""The admin listener's app: health, readiness, status, metrics, the status page, cache purge.

:func:`build_admin_app` holds the routes and the middleware, for a proxy's handlers
(:func:`admin_app`) and for the supervisor's, which ask its workers. Every handler of a
proxy goes through :class:`~edgeproxy.EdgeProxy`'s public methods, those
:class:`AdminProxy` names.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware
from aiohttp.web_request import BaseRequest

from edgeproxy._core.errors import ProxyError
from edgeproxy._observability.statuspage import StatusPage
from edgeproxy._server.aio import UnnamedResponse, web_error

if TYPE_CHECKING:
    from edgeproxy._core.config import Config
    from edgeproxy._observability.metrics import Metrics

__all__ = [
    "AdminHandlers",
    "AdminProxy",
    "AdminRunner",
    "admin_app",
    "admin_auth",
    "build_admin_app",
    "json_response",
    "name_answers",
    "reload_answer",
]


class AdminProxy(Protocol):
    """What the proxy's admin handlers use of :class:`~edgeproxy.EdgeProxy`: a Protocol,
    as the proxy's module imports this one to build its admin app."""

    @property
    def config(self) -> Config: ...

    @property
    def loader(self) -> Callable[[], Config] | None: ...

    @property
    def metrics(self) -> Metrics | None: ...

    def readiness(self) -> tuple[bool, dict[str, Any]]: ...

    def status(self) -> dict[str, Any]: ...

    async def purge_cache(
        self, *, key: str | None = None, prefix: str | None = None, tenant: str | None = None
    ) -> int: ...

    async def reload_from_loader(self) -> dict[str, Any]: ...


def json_response(data: Any, status: int = 200) -> web.Response:
    """``data`` as an orjson-encoded JSON answer: the admin listeners' one way to write one."""
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


async def _purge_params(request: web.Request) -> tuple[str, str]:
    """The one of ``key``, ``prefix`` or ``tenant`` a purge names, from JSON or the query."""
    params: dict[str, Any] = dict(request.query)
    if request.body_exists:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise ProxyError(400, "invalid_request_error", f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "invalid_request_error", "body must be a JSON object")
        params.update(body)
    given = [name for name in ("key", "prefix", "tenant") if name in params]
    if len(given) != 1:
        raise ProxyError(
            400, "invalid_request_error", "give exactly one of 'key', 'prefix' or 'tenant'"
        )
    value = params[given[0]]
    if not isinstance(value, str) or (given[0] != "prefix" and not value):
        raise ProxyError(400, "invalid_request_error", f"'{given[0]}' must be a non-empty string")
    return given[0], value


# What probes and load balancers call, often unable to send a header: open without a token.
_OPEN_PATHS = frozenset({"/healthz", "/readyz"})


def admin_auth(token: str) -> Middleware:
    """A middleware that lets a request through only with ``Authorization: Bearer <token>``
    (``/healthz`` and ``/readyz`` excepted); others get a 401 in the OpenAI error shape."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def edgeproxy_admin_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in _OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                response = web_error(
                    401,
                    "authentication_error",
                    "the admin listener needs Authorization: Bearer <admin.token>",
                    code="invalid_admin_token",
                )
                response.headers["WWW-Authenticate"] = 'Bearer realm="edgeproxy admin"'
                return response
        return await handler(request)

    return edgeproxy_admin_auth


def name_answers(app: web.Application, server_header: str) -> None:
    """Send ``server_header`` as the Server header of every answer ``app`` routes (``""``:
    none), in place of aiohttp's, which names its version and Python's.

    A signal, run after aiohttp set its own: an admin listener's answers are few, and come
    from handlers, the router and the auth middleware alike.
    """

    async def edgeproxy_server_header(request: web.Request, response: web.StreamResponse) -> None:
        if server_header:
            response.headers[hdrs.SERVER] = server_header
        else:
            response.headers.popall(hdrs.SERVER, None)

    app.on_response_prepare.append(edgeproxy_server_header)


class _NamedHandler(web.RequestHandler):
    """aiohttp's connection handler, whose own answers (a malformed request's 400, which
    no app signal sees) carry the admin listener's Server header instead of aiohttp's."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        response = super().handle_error(request, status, exc, message)
        header: str = getattr(self._manager, "server_header", "")
        if header:
            response.headers[hdrs.SERVER] = header
        elif type(response) is web.Response:
            response.__class__ = UnnamedResponse
        return response


class _NamedServer(web.Server):
    server_header = ""

    def __call__(self) -> web.RequestHandler:
        return _NamedHandler(self, loop=self._loop, **self._kwargs)


class AdminRunner(web.AppRunner):
    """The runner of an admin application: every answer it sends, its connection
    handler's own included, carries ``server_header`` (see :func:`name_answers`)."""

    def __init__(self, app: web.Application, *, server_header: str) -> None:
        super().__init__(app, access_log=None)
        self._server_header = server_header

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp builds its Server inside Application: the subclass only changes the
        # handler it makes for each connection.
        server.__class__ = _NamedServer
        server.server_header = self._server_header  # type: ignore[attr-defined]
        return server


@dataclass(frozen=True, slots=True)
class AdminHandlers:
    """The handlers of the admin routes that differ between a proxy and a supervisor;
    ``metrics`` None: no ``/metrics`` route."""

    healthz: Handler
    readyz: Handler
    status: Handler
    cache_purge: Handler
    reload: Handler
    metrics: Handler | None = None


def build_admin_app(
    handlers: AdminHandlers, *, token: str | None, server_header: str
) -> web.Application:
    """An admin application: ``handlers`` on ``/healthz``, ``/readyz``, ``/status``,
    ``/metrics``, ``POST /cache/purge`` and ``POST /reload``, the status page on ``/``,
    behind :func:`admin_auth` when ``token`` is set, every answer named ``server_header``
    (:func:`name_answers`)."""
    app = web.Application(middlewares=[admin_auth(token)] if token else [])
    name_answers(app, server_header)
    app.router.add_get("/healthz", handlers.healthz)
    app.router.add_get("/readyz", handlers.readyz)
    app.router.add_get("/status", handlers.status)
    if handlers.metrics is not None:
        app.router.add_get("/metrics", handlers.metrics)
    app.router.add_post("/cache/purge", handlers.cache_purge)
    app.router.add_post("/reload", handlers.reload)
    app.router.add_get("/", StatusPage().handle)
    return app


def reload_answer(result: dict[str, Any]) -> web.Response:
    """``POST /reload``'s answer to a reload's ``result``: it, or 409 with the reasons."""
    if result["reloaded"]:
        return json_response(result)
    return web_error(
        409, "invalid_request_error", "; ".join(result["errors"]), code="reload_refused"
    )


def admin_app(proxy: AdminProxy, *, token: str | None = None) -> web.Application:
    """The admin listener's application for ``proxy``; ``token``: see :func:`admin_auth`."""

    async def healthz(request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        ready, body = proxy.readiness()
        return json_response(body, status=200 if ready else 503)

    async def status(request: web.Request) -> web.Response:
        return json_response(proxy.status())

    async def cache_purge(request: web.Request) -> web.Response:
        """``POST /cache/purge``: JSON (or query) ``key``, ``prefix`` or ``tenant``.

        ``key`` is an entry's name as ``X-Edgeproxy-Cache-Key`` shows it;
        ``prefix`` matches the start of names (``""`` purges everything);
        ``tenant`` purges every entry of that tenant.
        """
        try:
            name, value = await _purge_params(request)
            purged = await proxy.purge_cache(**{name: value})
        except ProxyError as err:
            return web_error(err.status, err.type, err.message, code=err.code)
        return json_response({"purged": purged, name: value})

    async def reload(request: web.Request) -> web.Response:
        # Without a loader (embedded, or a worker: its supervisor reloads) there is no
        # config to read again; say so rather than 404.
        if proxy.loader is None:
            return web_error(
                409,
                "invalid_request_error",
                "this proxy has no config file to read again: call EdgeProxy.reload(config) "
                "in the host app, or restart it",
                code="reload_unsupported",
            )
        return reload_answer(await proxy.reload_from_loader())

    handlers = AdminHandlers(
        healthz=healthz,
        readyz=readyz,
        status=status,
        cache_purge=cache_purge,
        reload=reload,
        metrics=proxy.metrics.handle if proxy.metrics is not None else None,
    )
    return build_admin_app(handlers, token=token, server_header=proxy.config.server.server_header)
