"""The aiohttp front end: an aiohttp request as the pipeline's :class:`Exchange`, and the
pipeline's answers as aiohttp responses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from ssl import SSLObject
from typing import Final

from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http_writer import HttpVersion10, HttpVersion11, StreamWriter
from aiohttp.web_urldispatcher import AbstractResource
from multidict import CIMultiDict

from edgeproxy._core.config import WebSocketConfig
from edgeproxy._core.errors import error_response
from edgeproxy._core.exchange import Exchange, TlsInfo, Writer
from edgeproxy._core.response import Response, StreamResponse
from edgeproxy._core.websocket import Accept, WebSocket, is_websocket_upgrade
from edgeproxy._protocol.endpoints import ENDPOINTS
from edgeproxy._server.listener import EdgeRequestHandler
from edgeproxy._upstream.websocket import AiohttpSocket

__all__ = [
    "API_PATHS",
    "AiohttpExchange",
    "AiohttpWebSocketExchange",
    "UnnamedResponse",
    "add_routes",
    "exchange_for",
    "mount_prefix",
    "send_answer",
    "web_error",
    "web_response",
]

# The API's own paths (OpenAI's under /v1, Anthropic's): routed as plain resources, which
# aiohttp's router finds with one look-up in its index, where the catch-all is a regular
# expression tried after every miss there. Any other path is the catch-all's.
API_PATHS: Final = tuple(
    sorted(
        {
            e.suffix if e.suffix.startswith("/v1/") else "/v1" + e.suffix
            for e in ENDPOINTS
            if not e.websocket
        }
    )
)

# The version strings of the requests the listener accepts, made once.
_HTTP_VERSIONS = {HttpVersion10: "1.0", HttpVersion11: "1.1"}


# aiohttp gives an answer without a Server header its own, which names its version and
# Python's: an answer given one is left alone, and these take aiohttp's off again, for a
# listener configured to send none (``server.server_header = ""``).
class _UnnamedStream(web.StreamResponse):
    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self.headers.popall(hdrs.SERVER, None)


class UnnamedResponse(web.Response):
    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self.headers.popall(hdrs.SERVER, None)


def _target(request: web.Request, strip_prefix: str) -> str:
    target = request.raw_path
    if strip_prefix and target.startswith(strip_prefix):
        target = target[len(strip_prefix) :] or "/"
        if target[0] == "?":
            target = "/" + target
    return target


class AiohttpExchange(Exchange):
    """An aiohttp ``web.Request`` and the ``web.StreamResponse`` its answer goes out in;
    ``server``: the answer's Server header (``""``: none)."""

    __slots__ = ("request", "response", "server")

    def __init__(
        self, request: web.Request, strip_prefix: str = "", server: str = "edgeproxy"
    ) -> None:
        self.native = self.request = request
        self.server = server
        self.method = request.method
        self.target = _target(request, strip_prefix) if strip_prefix else request.raw_path
        headers = self.headers = request.headers
        self.client = request.remote
        self.scheme = scheme = request.scheme
        version = request.version
        self.version = _HTTP_VERSIONS.get(version) or f"{version.major}.{version.minor}"
        # What request.host answers, without its call when the client sent a Host.
        self.host = headers.get("Host") or request.host
        self.tls = _tls(request) if scheme == "https" else None
        self.content_length = request.content_length
        self.body_exists = request.body_exists
        self.response: web.StreamResponse | None = None

    async def read(self) -> bytes:
        request = self.request
        content = request.content
        if request._read_bytes is None and content.is_eof():
            # The whole body is in (a small one comes with its head): taken in one go,
            # where request.read() would wait on it twice; the same limit, and the bytes
            # kept for a later request.read() as it keeps them.
            data = content.read_nowait(-1)
            limit = request.client_max_size
            if limit and len(data) > limit:
                raise web.HTTPRequestEntityTooLarge(limit, len(data))
            request._read_bytes = data
            return data
        return await request.read()

    async def read_chunk(self) -> bytes:
        return await self.request.content.readany()

    def iter_body(self) -> AsyncIterator[bytes]:
        return self.request.content.iter_any()

    def client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    def queued(self, waiting: bool) -> None:
        # Only the proxy's own listener tells a half-close apart (a host app's closes).
        protocol = self.request.protocol
        if isinstance(protocol, EdgeRequestHandler):
            protocol.request_queued(waiting)

    async def start(
        self, status: int, headers: CIMultiDict[str], length: int | None, close: bool
    ) -> Writer:
        server = self.server
        if server:
            resp = self.response = web.StreamResponse(status=status, headers=headers)
            resp.headers[hdrs.SERVER] = server
        else:
            resp = self.response = _UnnamedStream(status=status, headers=headers)
        if length is not None:
            resp.content_length = length
        if close:
            resp.force_close()
        await resp.prepare(self.request)
        # aiohttp's own write, with the same contract: one call less per event.
        return resp.write

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self, data: bytes = b"") -> None:
        assert self.response is not None
        await self.response.write_eof(data)

    def abort(self) -> None:
        if self.response is not None:
            self.response.force_close()
        transport = self.request.transport
        if transport is not None:
            transport.close()

    async def cut(self, data: bytes) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            return
        writer = self.request.writer
        if self.response is not None and isinstance(writer, StreamWriter):
            # The writer keeps the chunked framing; drain=False never suspends, and the
            # connection closes once the event is flushed.
            await writer.write(data, drain=False)
        self.abort()


class AiohttpWebSocketExchange(AiohttpExchange):
    """An aiohttp request asking to upgrade to a WebSocket (HTTP/1.1 Upgrade), which the
    pipeline refuses as any request or accepts as a session."""

    __slots__ = ("ping_interval",)

    websocket = True

    def __init__(
        self,
        request: web.Request,
        strip_prefix: str = "",
        server: str = "edgeproxy",
        ping_interval: float | None = None,
    ) -> None:
        super().__init__(request, strip_prefix, server)
        self.ping_interval = ping_interval

    async def accept(self, accept: Accept) -> WebSocket:
        ws = web.WebSocketResponse(
            # The region's choice, among those the client offered (the region saw them all).
            protocols=(accept.subprotocol,) if accept.subprotocol else (),
            compress=accept.compress,
            max_msg_size=accept.max_message,
            autoping=True,
            heartbeat=self.ping_interval,
            writer_limit=accept.buffer,
            timeout=2.0,
        )
        for name, value in accept.headers:
            ws.headers[name] = value
        if self.server:
            ws.headers[hdrs.SERVER] = self.server
        self.response = ws
        await ws.prepare(self.request)
        return AiohttpSocket(ws, beats=self.ping_interval is not None)


def add_routes(
    router: web.UrlDispatcher,
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    expect: Callable[[web.Request], Awaitable[None]],
) -> dict[AbstractResource, str]:
    """Every path to ``handler``, a decoded newline (%0A) in it too, the API's own among
    them as plain resources (:data:`API_PATHS`); ``expect``: their ``Expect`` handler.
    Returns each plain resource's own path, for :func:`mount_prefix`."""
    own: dict[AbstractResource, str] = {}
    for path in API_PATHS:
        resource = router.add_resource(path)
        resource.add_route("*", handler, expect_handler=expect)
        own[resource] = path
    router.add_route("*", "/{tail:(?s:.*)}", handler, expect_handler=expect)
    return own


def mount_prefix(resource: AbstractResource | None, own: Mapping[AbstractResource, str]) -> str:
    """The prefix the application of ``resource`` is mounted under (``add_subapp``), which
    the region must not see; ``own``: what :func:`add_routes` returned."""
    canonical = resource.canonical if resource is not None else ""
    path = own.get(resource) if resource is not None else None
    if path is not None:
        return canonical[: -len(path)]
    return canonical[: -len("/{tail}")] if canonical.endswith("/{tail}") else ""


def exchange_for(
    request: web.Request, strip_prefix: str, server: str, websocket: WebSocketConfig
) -> AiohttpExchange:
    """The pipeline's exchange for ``request``: a WebSocket handshake's when it asks for
    one (its fields read only when it names an Upgrade: most requests do not)."""
    headers = request.headers
    if hdrs.UPGRADE in headers and is_websocket_upgrade(
        headers.get(hdrs.CONNECTION), headers.get(hdrs.UPGRADE)
    ):
        return AiohttpWebSocketExchange(request, strip_prefix, server, websocket.ping_interval)
    return AiohttpExchange(request, strip_prefix, server)


def _tls(request: web.Request) -> TlsInfo | None:
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    if not isinstance(ssl_object, SSLObject):
        return None
    return TlsInfo(ssl_object.version(), ssl_object.selected_alpn_protocol(), None)


def web_response(answer: Response, server: str | None = None) -> web.Response:
    """A whole-body answer as an aiohttp response, with ``server`` as its Server header
    (``""``: none; None: what the app's ``on_response_prepare`` makes of aiohttp's)."""
    if server is None or server:
        resp = web.Response(status=answer.status, body=answer.body, headers=answer.headers)
        if server:
            resp.headers[hdrs.SERVER] = server
    else:
        resp = UnnamedResponse(status=answer.status, body=answer.body, headers=answer.headers)
    if not answer.keep_alive:
        resp.force_close()
    return resp


class _Framed(web.StreamResponse):
    """A whole 200 answer framed here, head and body in one write, as aiohttp frames a
    ``web.Response`` (the same fields in the same order: the answer's, Server,
    Content-Length, Content-Type's default, Date, Connection) without building one: the
    answer of most cache hits. Sent when aiohttp prepares it, after the handler, as a
    ``web.Response`` is."""

    def __init__(self, data: bytes, keep_alive: bool, length: int) -> None:
        super().__init__(status=200)
        self._data = data
        self._keep_alive = keep_alive
        self._length = length

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if self._eof_sent:
            return None
        writer = request.writer
        self._eof_sent = True
        await writer.write_eof(self._data)
        self._body_length = self._length
        return writer

    async def write_eof(self, data: bytes = b"") -> None:
        """Sent whole by :meth:`prepare`."""


_FIELD = ": ".join


def _framed(request: web.Request, answer: Response, server: str) -> _Framed | None:
    """``answer`` framed as aiohttp would frame it, where that is plain: a 200 with a body
    and no length of its own, to an HTTP/1.1 request other than HEAD on the proxy's own
    listener, with no application's ``on_response_prepare`` to see it. None: aiohttp
    frames it (:func:`web_response`)."""
    body = answer.body
    if (
        answer.status != 200
        or not body
        or request.version != HttpVersion11
        or request.method in (hdrs.METH_HEAD, hdrs.METH_CONNECT)
        or not isinstance(request.protocol, EdgeRequestHandler)
    ):
        return None
    for app in request.match_info.apps:
        if app.on_response_prepare:
            return None
    headers = answer.headers
    if hdrs.CONTENT_LENGTH in headers:
        return None
    if server:
        headers[hdrs.SERVER] = server
    elif hdrs.SERVER in headers:
        del headers[hdrs.SERVER]
    headers[hdrs.CONTENT_LENGTH] = str(len(body))
    if hdrs.CONTENT_TYPE not in headers:
        headers[hdrs.CONTENT_TYPE] = "application/octet-stream"
    if hdrs.DATE not in headers:
        headers[hdrs.DATE] = rfc822_formatted_time()
    keep_alive = answer.keep_alive and request.keep_alive
    if not keep_alive and hdrs.CONNECTION not in headers:
        headers[hdrs.CONNECTION] = "close"
    # "name: value" for each field, joined in C (no Python frame per field).
    head = "\r\n".join(map(_FIELD, headers.items()))
    # A field holding a line break would break the framing: aiohttp refuses it, as before.
    breaks = len(headers) - 1
    if head.count("\n") != breaks or head.count("\r") != breaks:
        return None
    data = b"HTTP/1.1 200 OK\r\n" + head.encode() + b"\r\n\r\n" + body
    return _Framed(data, keep_alive, len(body))


async def send_answer(exchange: AiohttpExchange, answer: StreamResponse) -> web.StreamResponse:
    """What the handler returns to aiohttp for the pipeline's ``answer``: the response it
    was already streamed in, or (an answer not yet sent) the answer sent now."""
    if type(answer) is Response and exchange.response is None:
        # The common whole-body answer, not sent yet: aiohttp sends it after the handler,
        # framed here where that is plain.
        framed = _framed(exchange.request, answer, exchange.server)
        if framed is not None:
            return framed
        return web_response(answer, exchange.server)
    if not answer.prepared:
        started = exchange.response
        if started is None or not started.prepared:
            await answer.prepare(exchange)
            await answer.write_eof()
    assert exchange.response is not None
    return exchange.response


def web_error(
    status: int,
    type: str,
    message: str,
    *,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
    param: str | None = None,
) -> web.Response:
    """An OpenAI-shaped JSON error as an aiohttp response (the one builder is
    :func:`~edgeproxy._core.errors.error_response`)."""
    return web_response(
        error_response(status, type, message, code=code, headers=headers, param=param)
    )
