"""One request, top to bottom: admission, cache, route, upstream, stream, fallback.

:meth:`Pipeline.handle` is the single place to read to follow a request.
Each stage is a small object with one narrow method; stages raise
:class:`~edgeproxy._errors.ProxyError` for answers they give themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

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
from ._pool import Body, Headers, UpstreamError, UpstreamResponse, UpstreamTimeout
from ._regions import Region, RegionSet
from ._routing import Router

__all__ = ["Pipeline", "RequestContext"]

logger = logging.getLogger("edgeproxy")

# Bodies up to this size are read in one go (they arrive in one or two reads
# anyway); larger or chunked bodies stream upstream as they arrive.
SMALL_BODY = 64 * 1024

_NO_BODY_STATUS = frozenset({204, 304})


@dataclass(slots=True)
class RequestContext:
    """What the pipeline knows about one request as it moves through the stages."""

    request_id: str
    trace: TraceContext
    method: str
    target: str
    client_ip: str | None
    started: float
    region: str | None = None
    attempts: int = 0
    status: int = 0
    bytes_out: int = 0
    upstream_ttfb: float | None = None
    first_byte_at: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_request(cls, request: web.Request) -> RequestContext:
        return cls(
            request_id=request_id(request.headers.get("x-request-id")),
            trace=trace_context(request.headers.get("traceparent")),
            method=request.method,
            target=request.raw_path,
            client_ip=request.remote,
            started=time.monotonic(),
        )


class UpstreamStage:
    """Builds the upstream request from the client's and sends it to one region."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.via_name = config.server.via_name or config.pop.name
        drop = set(HOP_BY_HOP) | REQUEST_OWNED | {"x-forwarded-for", "x-request-id", "expect"}
        if not config.server.forward_client_credentials:
            drop |= CLIENT_CREDENTIAL_HEADERS
        self._drop = frozenset(drop)

    def headers(self, request: web.Request, ctx: RequestContext, region: Region) -> Headers:
        """The client's end-to-end headers plus forwarding, tracing and region credentials."""
        named = connection_tokens(request.headers.getall("connection", []))
        out: Headers = []
        for name, value in request.headers.items():
            lname = name.lower()
            if lname in self._drop or lname in named or lname.startswith(EDGEPROXY_PREFIX):
                continue
            out.append((lname, value))
        if request.content_length is not None:
            out.append(("content-length", str(request.content_length)))
        xff = append_forwarded_for(request.headers.get("x-forwarded-for"), ctx.client_ip)
        if xff:
            out.append(("x-forwarded-for", xff))
        out.append(("x-forwarded-proto", request.scheme))
        version = f"{request.version.major}.{request.version.minor}"
        out.append(("via", append_via(request.headers.get("via"), version, self.via_name)))
        out.append(("x-request-id", ctx.request_id))
        out.append(("traceparent", ctx.trace.traceparent))
        # Region credentials go last and replace anything of the same name.
        if region.credential_headers:
            injected = {k for k, _ in region.credential_headers}
            out = [(k, v) for k, v in out if k not in injected]
            out.extend(region.credential_headers)
        return out

    async def body(self, request: web.Request) -> Body:
        if not request.body_exists:
            return None
        length = request.content_length
        if length is not None and length <= SMALL_BODY:
            return await request.read()
        return request.content.iter_any()

    async def send(
        self, request: web.Request, ctx: RequestContext, region: Region
    ) -> UpstreamResponse:
        """Send to ``region``; connect failures answer 502 and timeouts 504."""
        headers = self.headers(request, ctx, region)
        body = await self.body(request)
        authority = request.host if self.config.server.preserve_host else region.authority
        ctx.region = region.name
        ctx.attempts += 1
        started = time.monotonic()
        try:
            upstream = await region.pool.request(
                request.method,
                region.base_path + request.raw_path,
                headers,
                body,
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

    async def relay(
        self,
        request: web.Request,
        ctx: RequestContext,
        region: Region,
        upstream: UpstreamResponse,
        *,
        close_connection: bool = False,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=upstream.status)
        if close_connection:
            resp.force_close()
        content_length: int | None = None
        for name, value in strip_hop_by_hop(upstream.headers):
            if name.lower() == "content-length":
                content_length = int(value) if value.isdigit() else None
                continue
            resp.headers.add(name, value)
        resp.headers["X-Edgeproxy-Region"] = region.name
        resp.headers["X-Request-Id"] = ctx.request_id
        if content_length is not None and upstream.status not in _NO_BODY_STATUS:
            resp.content_length = content_length
        ctx.status = upstream.status
        await resp.prepare(request)
        ctx.first_byte_at = time.monotonic()
        try:
            async for chunk in upstream.aiter_bytes():
                if chunk:
                    await resp.write(chunk)
                    ctx.bytes_out += len(chunk)
        except UpstreamError as exc:
            ctx.error = f"upstream broke mid-body: {exc}"
            region.errors_total += 1
            await self._abort(request, resp, exc)
            return resp
        except ConnectionResetError:
            # The client went away: the finally below cancels the upstream stream.
            ctx.error = "client disconnected"
            return resp
        await resp.write_eof()
        return resp

    async def _abort(
        self, request: web.Request, resp: web.StreamResponse, exc: UpstreamError
    ) -> None:
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
    """admission → cache → route → upstream → stream → fallback, for every request."""

    def __init__(self, config: Config, regions: RegionSet) -> None:
        self.config = config
        self.regions = regions
        self.router = Router(regions, config.pop)
        self.upstream = UpstreamStage(config)
        self.stream = StreamStage()
        self.in_flight = 0
        # While draining, responses close their connection so keep-alive
        # clients reconnect to a live instance.
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        ctx = RequestContext.from_request(request)
        self._enter()
        upstream: UpstreamResponse | None = None
        region: Region | None = None
        try:
            # route: the best region first.
            candidates = self.router.candidates()
            if not candidates:
                raise ProxyError(503, "no_region", "no region is configured", code="no_region")
            region = candidates[0]
            region.in_flight += 1
            region.requests_total += 1
            # upstream: response headers from the region, body still streaming.
            upstream = await self.upstream.send(request, ctx, region)
            # stream: relay chunk by chunk to the client.
            return await self.stream.relay(
                request, ctx, region, upstream, close_connection=self.draining
            )
        except ProxyError as err:
            ctx.status = err.status
            ctx.error = err.message
            return self._error_response(ctx, err)
        finally:
            if upstream is not None:
                # Also on cancellation (client gone): resets the upstream stream now.
                await upstream.aclose()
            if region is not None:
                region.in_flight -= 1
            self._exit()

    def _error_response(self, ctx: RequestContext, err: ProxyError) -> web.Response:
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
