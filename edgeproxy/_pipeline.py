"""One request, top to bottom: received, admission, cache, route, upstream, stream, fallback.

:meth:`Pipeline.handle` is the single place to read to follow a request.
Each stage is a small object with one narrow method; stages raise
:class:`~edgeproxy._errors.ProxyError` for answers they give themselves, and
plugin hooks are called at the points :mod:`edgeproxy.hookspecs` documents.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from ._admission import AdmissionStage, Admitted, Overloaded
from ._cache import CacheRecorder, CacheStage
from ._config import Config, RouteConfig
from ._errors import ProxyError, error_response
from ._failover import AttemptResponse, Failover
from ._fallback import FallbackStage
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
from ._pool import Body, Headers, UpstreamError, UpstreamResponse
from ._regions import Endpoint, Region, RegionSet
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
_NO_TOKENS: frozenset[str] = frozenset()
# Response headers the stream stage sets itself (lower-cased), replacing a region's.
_OWN = frozenset({"x-edgeproxy-region", "x-request-id"})
_OWN_WITH_CACHE = _OWN | {"x-edgeproxy-cache"}
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
    route: RouteConfig
    body: bytes | None = None
    body_read: bool = False
    tenant: str | None = None
    priority: int = 0
    client_country: str | None = None
    client_geo: tuple[float, float] | None = None
    region: str | None = None
    attempts: int = 0
    hedged: bool = False
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
    def from_request(
        cls, request: web.Request, config: Config, *, strip_prefix: str = ""
    ) -> RequestContext:
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
            route=config.route_for(request.method, target.split("?", 1)[0]),
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
        connection = ctx.headers.getall("connection", None)
        named = connection_tokens(connection) if connection else _NO_TOKENS
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
        self, request: web.Request, ctx: RequestContext, region: Region, endpoint: Endpoint
    ) -> UpstreamResponse:
        """One attempt: send to ``endpoint`` of ``region``; raises :class:`UpstreamError`.

        The attempt loop around it (failover, hedging, accounting) is
        :class:`~edgeproxy._failover.Failover`.
        """
        headers = self.headers(request, ctx, region)
        if self.plugins.has("edgeproxy_upstream_request"):
            await self.plugins.call_all(
                "edgeproxy_upstream_request",
                request=request,
                ctx=ctx,
                region=region,
                headers=headers,
            )
        authority = request.host if self.config.server.preserve_host else endpoint.authority
        upstream = await endpoint.pool.request(
            ctx.method,
            endpoint.base_path + ctx.target,
            headers,
            self.body(request, ctx),
            authority=authority,
        )
        endpoint.mark_up()
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
        recorder: CacheRecorder | None = None,
    ) -> web.StreamResponse:
        """Send the region's answer on; ``recorder`` (the cache's) sees the headers and each
        chunk as it passes, and is told when the body ended cleanly."""
        reply = UpstreamReply(upstream.status, strip_hop_by_hop(upstream.headers))
        if self.plugins.has("edgeproxy_upstream_response"):
            await self.plugins.call_all(
                "edgeproxy_upstream_response", request=request, ctx=ctx, region=region, reply=reply
            )
        if recorder is not None:
            recorder.start(reply, region.name)
        transform = self.plugins.has("edgeproxy_stream_chunk")
        # The headers go into one list that becomes the response's CIMultiDict in a
        # single step; the proxy's own names replace any the region sent.
        own = _OWN_WITH_CACHE if ctx.cache else _OWN
        headers: Headers = []
        content_length: int | None = None
        for name, value in reply.headers:
            lname = name.lower()
            if lname == "content-length":
                content_length = int(value) if value.isdigit() else None
            elif lname not in own:
                headers.append((name, value))
        headers.append(("X-Edgeproxy-Region", region.name))
        headers.append(("X-Request-Id", ctx.request_id))
        if ctx.cache:
            headers.append(("X-Edgeproxy-Cache", ctx.cache))
        resp = web.StreamResponse(status=reply.status, headers=headers)
        if close_connection:
            resp.force_close()
        # A transformed body has an unknown length: let aiohttp chunk it.
        if content_length is not None and reply.status not in _NO_BODY_STATUS and not transform:
            resp.content_length = content_length
        content_type = resp.headers.get("content-type", "")
        ctx.response_is_sse = content_type.startswith("text/event-stream")
        usage = UsageTracker.for_response(ctx.path, content_type, reply.status)
        ctx.status = reply.status
        try:
            # Inside the try: the client may already be gone when headers go out.
            await resp.prepare(request)
            ctx.first_byte_at = time.monotonic()
            async for chunk in upstream.aiter_bytes():
                if usage is not None:
                    usage.feed(chunk)
                if transform:
                    chunk = await self.plugins.call_chain(
                        "edgeproxy_stream_chunk", "chunk", request=request, ctx=ctx, chunk=chunk
                    )
                if chunk:
                    if recorder is not None:
                        recorder.feed(chunk)
                    await resp.write(chunk)
                    ctx.bytes_out += len(chunk)
            if recorder is not None:
                recorder.finish()
            if usage is not None:
                ctx.usage = usage.result()
            await resp.write_eof()
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
        self.router = Router(config, regions)
        self.cache = CacheStage(config, plugins, fetch=self._refresh_upstream)
        self.upstream = UpstreamStage(config, plugins)
        self.failover = Failover(config, regions, self.upstream)
        self.stream = StreamStage(plugins)
        self.fallback = FallbackStage(config, plugins)
        self.admission = AdmissionStage(config)
        self.in_flight = 0
        # While draining, responses close their connection so keep-alive
        # clients reconnect to a live instance.
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def handle(self, request: web.Request, *, strip_prefix: str = "") -> web.StreamResponse:
        ctx = RequestContext.from_request(request, self.config, strip_prefix=strip_prefix)
        self._enter()
        upstream: AttemptResponse | None = None
        region: Region | None = None
        response: web.StreamResponse | None = None
        recorder: CacheRecorder | None = None
        admitted: Admitted | None = None
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
                # A plugin may have rewritten the path: match the route again.
                ctx.route = self.config.route_for(ctx.method, ctx.path)
            # admission: body validation, rate limits, then a slot (may queue, or shed).
            try:
                admitted = await self.admission.admit(request, ctx)
            except Overloaded as err:
                if ctx.route.on_overload != "degrade":
                    raise
                response = await self._fallback(request, ctx, err)
                return response
            # cache: a stored answer, or that of an identical request in flight; else a
            # cacheable request leads, and `recorder` stores what the stream stage relays.
            answer, recorder = await self.cache.lookup(request, ctx)
            if answer is not None:
                response = answer
                return response
            # route + upstream: the first byte from the best region, failing over (or
            # hedging) until then; residency violations are refused, never degraded.
            try:
                candidates = await self._candidates(request, ctx)
                upstream = await self.failover.send(request, ctx, candidates)
            except ProxyError as err:
                if err.code == "residency":
                    raise
                # fallback: the regions cannot answer; a plugin may give the answer.
                response = await self._fallback(request, ctx, err)
                return response
            region = upstream.region
            # stream: relay chunk by chunk to the client.
            response = await self.stream.relay(
                request, ctx, region, upstream, close_connection=self.draining, recorder=recorder
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
            if recorder is not None:
                # An answer that did not complete is not stored; its followers wake up.
                recorder.release()
            if upstream is not None:
                # Also on cancellation (client gone): resets the upstream stream now,
                # and frees the region's in-flight slot.
                await upstream.aclose()
            if admitted is not None:
                admitted.release(ctx)
            ctx.finished_at = time.monotonic()
            if response is not None and not ctx.status:
                ctx.status = response.status
            if self.plugins.has("edgeproxy_response_complete"):
                await self.plugins.call_all_logged(
                    "edgeproxy_response_complete", request=request, ctx=ctx
                )
            self._exit()

    @contextlib.asynccontextmanager
    async def _refresh_upstream(
        self, request: web.Request, ctx: RequestContext
    ) -> AsyncIterator[AttemptResponse]:
        """The region's answer for a background cache refresh (stale-while-revalidate, early
        refresh): routed and sent as :meth:`handle` does, with no client to relay to."""
        upstream = await self.failover.send(request, ctx, await self._candidates(request, ctx))
        try:
            yield upstream
        finally:
            await upstream.aclose()

    async def _candidates(self, request: web.Request, ctx: RequestContext) -> list[Region]:
        """The regions this request may use, best first; the edgeproxy_route hook may override."""
        candidates = self.router.candidates(ctx)
        if self.plugins.has("edgeproxy_route"):
            chosen = await self.plugins.call_first(
                "edgeproxy_route", request=request, ctx=ctx, candidates=candidates
            )
            if chosen is not None:
                candidates = list(chosen)
        if not candidates:
            raise ProxyError(503, "no_region", "no region may serve this request", code="no_region")
        return candidates

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
        """No region answered before the first byte: the degradation ladder, else the error."""
        # The cache's stale-if-error answer (rung 3), when it has one.
        stale = await self.cache.serve_stale(request, ctx)

        async def relay(upstream: AttemptResponse) -> web.StreamResponse:
            # An attempt that beat the local model after the deadline (deadline_action = "race").
            try:
                ctx.region = upstream.region.name
                return await self.stream.relay(
                    request, ctx, upstream.region, upstream, close_connection=self.draining
                )
            finally:
                await upstream.aclose()

        # Rungs 3 and 4 as the route orders them, the edgeproxy_fallback hook, then the error.
        return await self.fallback.respond(
            request,
            ctx,
            err,
            stale=stale,
            finish=self._local_answer,
            fail=self._error_response,
            relay=relay,
        )

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
