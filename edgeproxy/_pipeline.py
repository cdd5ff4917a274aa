"""One request, top to bottom: received, admission, cache, route, upstream, stream, fallback.

:meth:`Pipeline.handle` is the single place to read to follow a request.
Each stage is a small object with one narrow method; stages raise
:class:`~edgeproxy._errors.ProxyError` for answers they give themselves, and
plugin hooks are called at the points :mod:`edgeproxy.hookspecs` documents.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from ._cache import CacheStage
from ._config import Config
from ._errors import ProxyError, error_response
from ._headers import (
    CLIENT_CREDENTIAL_HEADERS,
    EDGEPROXY_PREFIX,
    HOP_BY_HOP,
    REQUEST_OWNED,
    TraceContext,
    append_forwarded_for,
    append_via,
    connection_tokens,
    request_id,
    strip_hop_by_hop,
    trace_context,
)
from ._plugins import PluginError, Plugins
from ._pool import Body, Headers, UpstreamError, UpstreamResponse, UpstreamTimeout
from ._regions import Region, RegionSet
from ._routing import Router
from ._usage import UsageTracker

__all__ = ["Pipeline", "RequestContext", "UpstreamReply"]

logger = logging.getLogger("edgeproxy")

# Bodies up to this size are read in one go (they arrive in one or two reads
# anyway), and so are JSON bodies up to ``JSON_BODY_LIMIT``, so that plugins,
# the cache and routing can look inside. Anything else streams upstream as it
# arrives.
SMALL_BODY = 64 * 1024
JSON_BODY_LIMIT = 4 * 1024 * 1024

_NO_BODY_STATUS = frozenset({204, 304})
_UNSET: Any = object()


@dataclass(slots=True)
class RequestContext:
    """What the pipeline knows about one request as it moves through the stages.

    Plugins read and rewrite the request through it: ``target`` (path and
    query), ``headers`` (a mutable copy of the client's), ``json`` and
    :meth:`set_json`, ``tenant`` and ``priority``.
    """

    request_id: str
    trace: TraceContext
    method: str
    target: str
    headers: CIMultiDict[str]
    client_ip: str | None
    started: float
    body: bytes | None = None
    body_read: bool = False
    tenant: str | None = None
    priority: int = 0
    client_country: str | None = None
    client_geo: tuple[float, float] | None = None
    region: str | None = None
    attempts: int = 0
    status: int = 0
    bytes_out: int = 0
    upstream_ttfb: float | None = None
    first_byte_at: float | None = None
    finished_at: float | None = None
    response_is_sse: bool = False
    cache: str | None = None
    cache_key: str | None = None
    degraded: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    _json: Any = _UNSET

    @classmethod
    def from_request(cls, request: web.Request, *, strip_prefix: str = "") -> RequestContext:
        headers = request.headers
        target = request.raw_path
        if strip_prefix and target.startswith(strip_prefix):
            target = target[len(strip_prefix) :] or "/"
            if target[0] == "?":
                target = "/" + target
        return cls(
            request_id=request_id(headers.get("x-request-id")),
            trace=trace_context(headers.get("traceparent")),
            method=request.method,
            target=target,
            headers=CIMultiDict(headers),
            client_ip=request.remote,
            started=time.monotonic(),
        )

    @property
    def path(self) -> str:
        """``target`` without its query string."""
        return self.target.split("?", 1)[0]

    @property
    def json(self) -> Any:
        """The request body parsed as JSON, or None when it is not a buffered JSON body."""
        if self._json is _UNSET:
            self._json = None
            if self.body and "json" in self.headers.get("content-type", ""):
                try:
                    self._json = orjson.loads(self.body)
                except orjson.JSONDecodeError:
                    pass
        return self._json

    def set_json(self, value: Any) -> None:
        """Replace the request body with ``value`` serialized as JSON."""
        self.body = orjson.dumps(value)
        self.body_read = True
        self._json = value
        self.headers["content-type"] = "application/json"


@dataclass(slots=True)
class UpstreamReply:
    """Status and headers of a region's response, editable by plugins before they are sent."""

    status: int
    headers: Headers


class UpstreamStage:
    """Builds the upstream request from the client's and sends it to one region."""

    def __init__(self, config: Config, plugins: Plugins) -> None:
        self.config = config
        self.plugins = plugins
        self.via_name = config.server.via_name or config.pop.name
        drop = set(HOP_BY_HOP) | REQUEST_OWNED | {"x-forwarded-for", "x-request-id", "expect"}
        if not config.server.forward_client_credentials:
            drop |= CLIENT_CREDENTIAL_HEADERS
        self._drop = frozenset(drop)

    def headers(self, request: web.Request, ctx: RequestContext, region: Region) -> Headers:
        """The client's end-to-end headers plus forwarding, tracing and region credentials."""
        named = connection_tokens(ctx.headers.getall("connection", []))
        out: Headers = []
        for name, value in ctx.headers.items():
            lname = name.lower()
            if lname in self._drop or lname in named or lname.startswith(EDGEPROXY_PREFIX):
                continue
            out.append((lname, value))
        if ctx.body_read:
            if ctx.body:
                out.append(("content-length", str(len(ctx.body))))
        elif request.content_length is not None:
            out.append(("content-length", str(request.content_length)))
        xff = append_forwarded_for(ctx.headers.get("x-forwarded-for"), ctx.client_ip)
        if xff:
            out.append(("x-forwarded-for", xff))
        out.append(("x-forwarded-proto", request.scheme))
        version = f"{request.version.major}.{request.version.minor}"
        out.append(("via", append_via(ctx.headers.get("via"), version, self.via_name)))
        out.append(("x-request-id", ctx.request_id))
        out.append(("traceparent", ctx.trace.traceparent))
        # Region credentials go last and replace anything of the same name.
        if region.credential_headers:
            injected = {k for k, _ in region.credential_headers}
            out = [(k, v) for k, v in out if k not in injected]
            out.extend(region.credential_headers)
        return out

    def body(self, request: web.Request, ctx: RequestContext) -> Body:
        if ctx.body_read:
            return ctx.body or None
        return request.content.iter_any()

    async def send(
        self, request: web.Request, ctx: RequestContext, region: Region
    ) -> UpstreamResponse:
        """Send to ``region``; connect failures answer 502 and timeouts 504."""
        headers = self.headers(request, ctx, region)
        if self.plugins.has("edgeproxy_upstream_request"):
            await self.plugins.call_all(
                "edgeproxy_upstream_request",
                request=request,
                ctx=ctx,
                region=region,
                headers=headers,
            )
        authority = request.host if self.config.server.preserve_host else region.authority
        ctx.region = region.name
        ctx.attempts += 1
        started = time.monotonic()
        try:
            upstream = await region.pool.request(
                ctx.method,
                region.base_path + ctx.target,
                headers,
                self.body(request, ctx),
                authority=authority,
            )
        except UpstreamTimeout as exc:
            region.errors_total += 1
            raise ProxyError(
                504,
                "upstream_timeout",
                f"region {region.name} timed out ({exc.phase})",
                code="upstream_timeout",
            ) from exc
        except UpstreamError as exc:
            region.errors_total += 1
            if exc.retryable:
                region.mark_down(str(exc))
            raise ProxyError(
                502, "upstream_error", f"region {region.name} failed: {exc}", code="bad_gateway"
            ) from exc
        ctx.upstream_ttfb = time.monotonic() - started
        region.mark_up()
        return upstream


class StreamStage:
    """Relays the upstream response to the client chunk by chunk, never buffering it."""

    def __init__(self, plugins: Plugins) -> None:
        self.plugins = plugins

    async def relay(
        self,
        request: web.Request,
        ctx: RequestContext,
        region: Region,
        upstream: UpstreamResponse,
        *,
        close_connection: bool = False,
    ) -> web.StreamResponse:
        reply = UpstreamReply(upstream.status, strip_hop_by_hop(upstream.headers))
        if self.plugins.has("edgeproxy_upstream_response"):
            await self.plugins.call_all(
                "edgeproxy_upstream_response", request=request, ctx=ctx, region=region, reply=reply
            )
        transform = self.plugins.has("edgeproxy_stream_chunk")
        resp = web.StreamResponse(status=reply.status)
        if close_connection:
            resp.force_close()
        content_length: int | None = None
        for name, value in reply.headers:
            if name.lower() == "content-length":
                content_length = int(value) if value.isdigit() else None
                continue
            resp.headers.add(name, value)
        resp.headers["X-Edgeproxy-Region"] = region.name
        resp.headers["X-Request-Id"] = ctx.request_id
        # A transformed body has an unknown length: let aiohttp chunk it.
        if content_length is not None and reply.status not in _NO_BODY_STATUS and not transform:
            resp.content_length = content_length
        content_type = resp.headers.get("content-type", "")
        ctx.response_is_sse = content_type.startswith("text/event-stream")
        usage = UsageTracker.for_response(ctx.path, content_type, reply.status)
        ctx.status = reply.status
        await resp.prepare(request)
        ctx.first_byte_at = time.monotonic()
        try:
            async for chunk in upstream.aiter_bytes():
                if usage is not None:
                    usage.feed(chunk)
                if transform:
                    chunk = await self.plugins.call_chain(
                        "edgeproxy_stream_chunk", "chunk", request=request, ctx=ctx, chunk=chunk
                    )
                if chunk:
                    await resp.write(chunk)
                    ctx.bytes_out += len(chunk)
        except UpstreamError as exc:
            ctx.error = f"upstream broke mid-body: {exc}"
            region.errors_total += 1
            await self._abort(request, resp, exc)
            return resp
        except ConnectionResetError:
            # The client went away: the pipeline's finally cancels the upstream stream.
            ctx.error = "client disconnected"
            return resp
        except PluginError as exc:
            # Too late for a 500: end the response so it cannot pass for complete.
            ctx.error = str(exc)
            logger.error("%s", exc, exc_info=exc.error)
            await self._abort(request, resp, exc)
            return resp
        if usage is not None:
            ctx.usage = usage.result()
        await resp.write_eof()
        return resp

    async def _abort(self, request: web.Request, resp: web.StreamResponse, exc: Exception) -> None:
        """End a response that already started, so the client cannot take it as complete.

        SSE clients get a well-formed ``error`` event first; then the connection
        is closed without the final chunk, which every client reads as a
        truncated body rather than a clean end.
        """
        content_type = resp.headers.get("content-type", "")
        if content_type.startswith("text/event-stream"):
            event = error_response(502, "upstream_error", f"upstream stream broke: {exc}")
            assert isinstance(event.body, bytes)
            try:
                await resp.write(b"event: error\ndata: " + event.body + b"\n\n")
            except ConnectionResetError:
                pass
        resp.force_close()
        if request.transport is not None:
            request.transport.close()


class Pipeline:
    """received → admission → cache → route → upstream → stream → fallback, for every request."""

    def __init__(self, config: Config, regions: RegionSet, plugins: Plugins) -> None:
        self.config = config
        self.regions = regions
        self.plugins = plugins
        self.router = Router(regions, config.pop)
        self.cache = CacheStage(plugins)
        self.upstream = UpstreamStage(config, plugins)
        self.stream = StreamStage(plugins)
        self.in_flight = 0
        # While draining, responses close their connection so keep-alive
        # clients reconnect to a live instance.
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def handle(self, request: web.Request, *, strip_prefix: str = "") -> web.StreamResponse:
        ctx = RequestContext.from_request(request, strip_prefix=strip_prefix)
        self._enter()
        upstream: UpstreamResponse | None = None
        region: Region | None = None
        response: web.StreamResponse | None = None
        try:
            await self._read_body(request, ctx)
            # received: plugins may rewrite the request through ctx, or answer it.
            if self.plugins.has("edgeproxy_request_received"):
                answer = await self.plugins.call_first(
                    "edgeproxy_request_received", request=request, ctx=ctx
                )
                if answer is not None:
                    response = self._local_answer(ctx, answer)
                    return response
            # cache: the key of a cacheable request (per tenant, prompt-free).
            ctx.cache_key = await self.cache.key(request, ctx)
            # route: the regions this request may use, best first.
            candidates = self.router.candidates()
            if self.plugins.has("edgeproxy_route"):
                chosen = await self.plugins.call_first(
                    "edgeproxy_route", request=request, ctx=ctx, candidates=candidates
                )
                if chosen is not None:
                    candidates = list(chosen)
            if not candidates:
                raise ProxyError(
                    503, "no_region", "no region may serve this request", code="no_region"
                )
            region = candidates[0]
            region.in_flight += 1
            region.requests_total += 1
            # upstream: response headers from the region, body still streaming.
            try:
                upstream = await self.upstream.send(request, ctx, region)
            except ProxyError as err:
                # fallback: the regions cannot answer; a plugin may give the answer.
                response = await self._fallback(request, ctx, err)
                return response
            # stream: relay chunk by chunk to the client.
            response = await self.stream.relay(
                request, ctx, region, upstream, close_connection=self.draining
            )
            return response
        except ProxyError as err:
            response = self._error_response(ctx, err)
            return response
        except PluginError as err:
            logger.error("%s (request %s)", err, ctx.request_id, exc_info=err.error)
            response = self._error_response(
                ctx,
                ProxyError(500, "plugin_error", f"plugin {err.plugin} failed", code="plugin_error"),
            )
            return response
        finally:
            if upstream is not None:
                # Also on cancellation (client gone): resets the upstream stream now.
                await upstream.aclose()
            if region is not None:
                region.in_flight -= 1
            ctx.finished_at = time.monotonic()
            if response is not None and not ctx.status:
                ctx.status = response.status
            if self.plugins.has("edgeproxy_response_complete"):
                await self.plugins.call_all_logged(
                    "edgeproxy_response_complete", request=request, ctx=ctx
                )
            self._exit()

    async def _read_body(self, request: web.Request, ctx: RequestContext) -> None:
        """Buffer small and JSON bodies; leave anything else to stream upstream."""
        if not request.body_exists:
            ctx.body_read = True
            return
        length = request.content_length
        if length is None:
            return
        is_json = "json" in request.headers.get("content-type", "")
        if length <= SMALL_BODY or (is_json and length <= JSON_BODY_LIMIT):
            ctx.body = await request.read()
            ctx.body_read = True

    async def _fallback(
        self, request: web.Request, ctx: RequestContext, err: ProxyError
    ) -> web.StreamResponse:
        """Every attempt failed before the first byte: a degraded answer, or the error."""
        answer: web.StreamResponse | None = None
        if self.plugins.has("edgeproxy_fallback"):
            verdict = await self.plugins.call_first(
                "edgeproxy_fallback", request=request, ctx=ctx, reason=err.type, answer=answer
            )
            if isinstance(verdict, web.StreamResponse):
                answer = verdict
        if answer is None:
            return self._error_response(ctx, err)
        ctx.degraded = ctx.degraded or "plugin"
        return self._local_answer(ctx, answer)

    def _local_answer(self, ctx: RequestContext, answer: web.StreamResponse) -> web.StreamResponse:
        """A response the proxy (or a plugin) gives itself, with the proxy's headers."""
        answer.headers.setdefault("X-Edgeproxy-Region", ctx.region or "none")
        answer.headers["X-Request-Id"] = ctx.request_id
        if ctx.degraded:
            answer.headers["X-Edgeproxy-Degraded"] = ctx.degraded
        ctx.status = answer.status
        return answer

    def _error_response(self, ctx: RequestContext, err: ProxyError) -> web.Response:
        ctx.status = err.status
        ctx.error = err.message
        headers = {"X-Edgeproxy-Region": ctx.region or "none", "X-Request-Id": ctx.request_id}
        headers.update(err.headers)
        return error_response(err.status, err.type, err.message, code=err.code, headers=headers)

    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; false if ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
