"""One upstream attempt: the region's request built from the client's, sent on its pool.

Everything the region's request needs is in the request context (the client's
scheme, HTTP version and Host included), so the client's exchange is only used
for a body that streams through unbuffered, and is handed to the plugin
hooks; it is None for a request with no client (a background cache refresh).

A region that does not speak the request's API (``[[regions]] apis``, or learnt here from
its 404 or 405) is sent the request translated to chat completions, and its answer comes
back already in the client's API (:mod:`edgeproxy._upstream.translated`): the attempt's
caller sees nothing new. The request that teaches it is translated and sent again within
the same attempt.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable

import orjson

from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.types import Body, Headers
from edgeproxy._plugins import Plugins
from edgeproxy._protocol.dialects import dialect_named
from edgeproxy._protocol.endpoints import openai_endpoint
from edgeproxy._protocol.headers import (
    CLIENT_CREDENTIAL_HEADERS,
    EDGEPROXY_PREFIX,
    HOP_BY_HOP,
    REQUEST_OWNED,
    append_forwarded_for,
    append_via,
    connection_tokens,
)
from edgeproxy._protocol.modelnames import model_from_body
from edgeproxy._protocol.objects import RESPONSES, object_path
from edgeproxy._protocol.refusals import REFUSAL_READ_LIMIT
from edgeproxy._protocol.translate import TRANSLATED, Translation, cannot_store, translate
from edgeproxy._upstream.pool import UpstreamResponse
from edgeproxy._upstream.regions import Endpoint, Region
from edgeproxy._upstream.reported import LOAD_FORMAT_HEADER
from edgeproxy._upstream.translated import held, read_body, refusal, translated

__all__ = ["UpstreamStage"]

logger = logging.getLogger("edgeproxy.regions")

_NO_TOKENS: frozenset[str] = frozenset()
# A region's answers to a path it does not serve: what teaches that it lacks an API.
_NOT_HERE = frozenset({404, 405})


def _endpoint_of(ctx: RequestContext) -> str | None:
    """The endpoint table's name of the request (its dialect's), None for another."""
    if ctx.method != "POST":
        return None
    facts = ctx.facts
    if facts is not None:
        return facts.dialect
    endpoint = openai_endpoint(ctx.path)
    return endpoint.name if endpoint is not None else None


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
        :class:`~edgeproxy._obtain.failover.Failover`.
        """
        apis = region.apis
        if apis.lacking:
            # A region known not to speak some API: this request's may be one.
            lacked = self._lacked(request, ctx, region, endpoint)
            if lacked is not None:
                return await lacked
        aliased: bytes | None = None
        if ctx.model is not None and region.config.model_aliases:
            # The region's own name for the client's model; ctx.body (and so the cache key)
            # keeps the client's.
            target = region.config.model_aliases.get(ctx.model)
            if target is not None:
                aliased = orjson.dumps({**ctx.json, "model": target})
        headers = self.headers(request, ctx, region, aliased)
        if "edgeproxy_upstream_request" in self.plugins.active:
            await self._upstream_request_hook(request, ctx, region, headers)
        authority = ctx.host if self.config.server.preserve_host else endpoint.authority
        upstream = await endpoint.pool.request(
            ctx.method,
            endpoint.base_path + ctx.target,
            headers,
            self.body(request, ctx) if aliased is None else aliased,
            authority=authority,
        )
        endpoint.mark_up()
        status = upstream.status
        if (status == 404 or status == 405) and apis.learns:
            return await self._learn(request, ctx, region, endpoint, upstream)
        return upstream

    async def _upstream_request_hook(
        self, request: Exchange | None, ctx: RequestContext, region: Region, headers: Headers
    ) -> None:
        await self.plugins.call_all(
            "edgeproxy_upstream_request", request=request, ctx=ctx, region=region, headers=headers
        )

    # send()'s own path, for the requests it sends besides the client's (inlined there, as
    # every request takes it).
    async def _request(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        region: Region,
        endpoint: Endpoint,
        target: str,
        headers: Headers,
        body: Body,
    ) -> UpstreamResponse:
        if "edgeproxy_upstream_request" in self.plugins.active:
            await self._upstream_request_hook(request, ctx, region, headers)
        authority = ctx.host if self.config.server.preserve_host else endpoint.authority
        upstream = await endpoint.pool.request(
            ctx.method, target, headers, body, authority=authority
        )
        endpoint.mark_up()
        return upstream

    # -- a region that lacks the request's API -------------------------------------------

    def _lacked(
        self, request: Exchange | None, ctx: RequestContext, region: Region, endpoint: Endpoint
    ) -> Awaitable[UpstreamResponse] | None:
        """The answer to a request of an API ``region`` lacks, to await; None when the
        region is sent it as it is (an API it speaks, or none it can be translated to)."""
        apis = region.apis
        name = _endpoint_of(ctx)
        if name is None:
            # A stored response read or deleted where none can be stored.
            found = object_path(ctx.path) if "responses" in apis.lacking else None
            if found is not None and found.kind is RESPONSES and apis.translates("responses"):
                err = cannot_store(region.name, "the response's id")
                return _ready(refusal(err, dialect_named("responses")))
            return None
        if name not in apis.lacking or not apis.translates(name):
            return None
        return self._translated(request, ctx, region, endpoint, name)

    def _translation(
        self, ctx: RequestContext, region: Region, name: str
    ) -> Translation | UpstreamResponse | None:
        """The request as chat completions for ``region``, or the refusal to send it
        (its client's API's 400), or None when it cannot be read (no buffered JSON)."""
        body = ctx.json if ctx.body_read else None
        if not isinstance(body, dict):
            return None
        model = model_from_body(body)
        aliases = region.config.model_aliases
        alias = aliases.get(model) if aliases and isinstance(model, str) else None
        config = region.config
        out = translate(
            name, body, model=alias, region=region.name, method=config.continuation_method
        )
        if out is None or isinstance(out, Translation):
            return out
        return refusal(out, dialect_named(name))

    async def _translated(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        region: Region,
        endpoint: Endpoint,
        name: str,
        translation: Translation | UpstreamResponse | None = None,
    ) -> UpstreamResponse:
        if translation is None:
            translation = self._translation(ctx, region, name)
            if translation is None:
                # Nothing to translate: the region is sent the request as it is.
                return await self._request(
                    request,
                    ctx,
                    region,
                    endpoint,
                    endpoint.base_path + ctx.target,
                    self.headers(request, ctx, region),
                    self.body(request, ctx),
                )
        if not isinstance(translation, Translation):
            return translation  # refused
        sent = translation.sent()
        headers = [
            (k, v) for k, v in self.headers(request, ctx, region, sent) if k != "accept-encoding"
        ]
        # The proxy reads the answer to translate it: plain bytes, whatever the client takes.
        headers.append(("accept-encoding", "identity"))
        target = endpoint.base_path + translation.target(ctx.path)
        upstream = await self._request(request, ctx, region, endpoint, target, headers, sent)
        region.apis.translated[name] += 1
        return await translated(upstream, translation)

    async def _learn(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        region: Region,
        endpoint: Endpoint,
        upstream: UpstreamResponse,
    ) -> UpstreamResponse:
        """``region`` answered 404 or 405 (``upstream``): for a request of an API that can
        be translated, its chat completion is sent at once; if the region answers that,
        it lacks the API (learnt, and shown on /status), and the translation's answer is
        the attempt's. Otherwise the region's own answer stands, as it came."""
        name = _endpoint_of(ctx)
        if name not in TRANSLATED:
            return upstream
        translation = self._translation(ctx, region, name)
        if not isinstance(translation, Translation):
            return upstream
        status = upstream.status
        body = await read_body(upstream, REFUSAL_READ_LIMIT)
        answer = await self._translated(request, ctx, region, endpoint, name, translation)
        if answer.status in _NOT_HERE:
            # Its chat completions are not there either (or not for this model): nothing
            # is learnt, and the region's first answer is the client's.
            await answer.aclose()
            return held(upstream, body)
        if name in region.apis.lacking:
            return answer  # another request learnt it meanwhile
        region.apis.learn(name, status)
        logger.info(
            "region %s answered %d to %s: it speaks chat completions, and its %s requests "
            "are translated from now on",
            region.name,
            status,
            ctx.path,
            name,
        )
        return answer


async def _ready(response: UpstreamResponse) -> UpstreamResponse:
    return response
