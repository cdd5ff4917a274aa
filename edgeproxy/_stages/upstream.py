"""One upstream attempt: the region's request built from the client's, sent on its pool.

Everything the region's request needs is in the request context (the client's
scheme, HTTP version and Host included), so the client's exchange is only used
for a body that streams through unbuffered, and is handed to the plugin
hooks; it is None for a request with no client (a background cache refresh).
"""

from __future__ import annotations

import orjson

from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.types import Body, Headers
from edgeproxy._plugins import Plugins
from edgeproxy._protocol.headers import (
    CLIENT_CREDENTIAL_HEADERS,
    EDGEPROXY_PREFIX,
    HOP_BY_HOP,
    REQUEST_OWNED,
    append_forwarded_for,
    append_via,
    connection_tokens,
)
from edgeproxy._upstream.pool import UpstreamResponse
from edgeproxy._upstream.regions import Endpoint, Region
from edgeproxy._upstream.reported import LOAD_FORMAT_HEADER

__all__ = ["UpstreamStage"]

_NO_TOKENS: frozenset[str] = frozenset()


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
        # This hop's Via value by HTTP version, for requests that arrive without a Via.
        self._hops = {v: append_via(None, v, self.via_name) for v in ("1.0", "1.1")}

    def headers(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        region: Region,
        sent: bytes | None = None,
    ) -> Headers:
        """The client's end-to-end headers plus forwarding, tracing and region credentials.

        ``sent`` is the body sent instead of ``ctx.body`` (the region's name for the model).
        """
        connection = ctx.headers.getall("connection", None)
        named = connection_tokens(connection) if connection else _NO_TOKENS
        out: Headers = []
        for name, value in ctx.headers.items():
            lname = name.lower()
            if lname in self._drop or lname in named or lname.startswith(EDGEPROXY_PREFIX):
                continue
            out.append((lname, value))
        if ctx.body_read:
            body = ctx.body if sent is None else sent
            if body:
                out.append(("content-length", str(len(body))))
        elif request is not None and request.content_length is not None:
            out.append(("content-length", str(request.content_length)))
        headers = ctx.headers
        xff = headers.get("x-forwarded-for")
        # The hop this proxy saw, not the client resolved behind it: the chain stays whole.
        if ctx.peer:
            xff = append_forwarded_for(xff, ctx.peer)
        if xff:
            out.append(("x-forwarded-for", xff))
        out.append(("x-forwarded-proto", ctx.scheme))
        via = headers.get("via")
        hop = self._hops.get(ctx.http_version) if via is None else None
        if hop is None:
            hop = append_via(via, ctx.http_version, self.via_name)
        out.append(("via", hop))
        out.append(("x-request-id", ctx.request_id))
        out.append(("traceparent", ctx.trace.traceparent))
        if region.asks_load and LOAD_FORMAT_HEADER not in ctx.headers:
            # load_reporting = "header": the region's answer carries its load (ORCA).
            out.append((LOAD_FORMAT_HEADER, "TEXT"))
        # Region credentials go last and replace anything of the same name.
        if region.credential_headers:
            injected = {k for k, _ in region.credential_headers}
            out = [(k, v) for k, v in out if k not in injected]
            out.extend(region.credential_headers)
        return out

    def body(self, request: Exchange | None, ctx: RequestContext) -> Body:
        if ctx.body_read:
            return ctx.body or None
        if request is None:
            raise ValueError("a request with no client must have a buffered body")
        return request.iter_body()

    async def send(
        self, request: Exchange | None, ctx: RequestContext, region: Region, endpoint: Endpoint
    ) -> UpstreamResponse:
        """One attempt: send to ``endpoint`` of ``region``; raises :class:`UpstreamError`.

        The attempt loop around it (failover, hedging, accounting) is
        :class:`~edgeproxy._stages.failover.Failover`.
        """
        aliased: bytes | None = None
        if ctx.model is not None and region.config.model_aliases:
            # The region's own name for the client's model; ctx.body (and so the cache key)
            # keeps the client's.
            target = region.config.model_aliases.get(ctx.model)
            if target is not None:
                aliased = orjson.dumps({**ctx.json, "model": target})
        headers = self.headers(request, ctx, region, aliased)
        if "edgeproxy_upstream_request" in self.plugins.active:
            await self.plugins.call_all(
                "edgeproxy_upstream_request",
                request=request,
                ctx=ctx,
                region=region,
                headers=headers,
            )
        authority = ctx.host if self.config.server.preserve_host else endpoint.authority
        upstream = await endpoint.pool.request(
            ctx.method,
            endpoint.base_path + ctx.target,
            headers,
            self.body(request, ctx) if aliased is None else aliased,
            authority=authority,
        )
        endpoint.mark_up()
        return upstream
