"""Plugin hooks: the pluggy hook specifications of edgeproxy.

A plugin is a module or an object with functions named after these specs and
decorated with :data:`edgeproxy.hookimpl`. An implementation may be a plain
function or an ``async def``; edgeproxy awaits coroutines itself. As in
pluggy, an implementation may accept any subset of the arguments, and
edgeproxy always calls hooks with keyword arguments.

Each spec's docstring says how results combine:

- *first result wins* (the specs marked ``firstresult=True``):
  implementations run in order until one returns something other than
  ``None``; that value is used and the rest are skipped;
- *all run*: every implementation runs; return values are ignored;
- *chained*: every implementation runs, each receiving the previous one's
  non-``None`` result; the last value is used.

Order follows pluggy: the plugin registered last runs first, and
``tryfirst``/``trylast`` move an implementation to the front or back.
Wrappers (``wrapper=True``, ``hookwrapper=True``) are refused when the plugin
is registered: they are generators around a synchronous call and cannot wrap
awaited implementations. So is an implementation of a hook with no spec.

``request`` is the client's :class:`edgeproxy.Exchange`, the same whichever
front end received it (the aiohttp listener, the ASGI application, the HTTP/2
listener): method, target, headers, client address, TLS and the body. A hook
that answers returns an :class:`edgeproxy.Response` (``Response.json({...})``
for a JSON body), never a server's own response type.

A background cache refresh (stale-while-revalidate, early refresh) has no
client: ``edgeproxy_route``, ``edgeproxy_upstream_request``,
``edgeproxy_upstream_response`` and ``edgeproxy_stream_chunk`` get
``request=None`` for it, and ``ctx.cache == "REFRESH"``; read the request
through ``ctx``.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext, UpstreamReply
    from edgeproxy._core.exchange import Exchange
    from edgeproxy._core.protocols import ProxyView, RegionView
    from edgeproxy._core.response import StreamResponse

__all__ = ["hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("edgeproxy")
hookimpl = pluggy.HookimplMarker("edgeproxy")


@hookspec
def edgeproxy_startup(proxy: ProxyView) -> Awaitable[None] | None:
    """The proxy opened its resources (pools warm) and is about to serve.

    *All run*, in order; return values are ignored. An exception aborts
    startup with the plugin's name.
    """


@hookspec
def edgeproxy_shutdown(proxy: ProxyView) -> Awaitable[None] | None:
    """The proxy is closing, after the last request drained.

    *All run*; return values are ignored. Exceptions are logged and do not
    stop the other plugins.
    """


@hookspec(firstresult=True)
def edgeproxy_request_received(
    request: Exchange, ctx: RequestContext
) -> Awaitable[StreamResponse | None] | StreamResponse | None:
    """A request arrived, before admission, cache and routing.

    Rewrite it through ``ctx``: ``ctx.target`` (path and query),
    ``ctx.headers`` (a mutable multidict), ``ctx.json`` / ``ctx.set_json()``
    for JSON bodies, ``ctx.tenant`` and ``ctx.priority``. Return a response
    (for example a 401, or a static answer) to answer directly.

    A WebSocket handshake (``request.websocket``; a Realtime session at a path ending
    ``/realtime``) comes here first too: a response refuses it before the upgrade.

    *First result wins*: the first non-``None`` result (a response) is
    sent, and later implementations do not run.
    """


@hookspec(firstresult=True)
def edgeproxy_route(
    request: Exchange, ctx: RequestContext, candidates: list[RegionView]
) -> Awaitable[list[RegionView] | None] | list[RegionView] | None:
    """The router ordered the regions this request may go to, best first.

    Return a new list to override or filter them (an empty list answers 503
    ``no_region``), or ``None`` to keep the router's choice.

    A WebSocket session is routed here at its handshake, and its regions are tried in
    this order until one completes its own; the session then stays on that region.

    *First result wins*: the first non-``None`` result is used, and later
    implementations do not run.
    """


@hookspec(firstresult=True)
def edgeproxy_cache_key(
    request: Exchange, ctx: RequestContext, default_key: str
) -> Awaitable[str | None] | str | None:
    """Compute the cache key of a cacheable request; ``default_key`` is edgeproxy's.

    Return a string to use instead (it is hashed before it reaches a backend),
    or ``None`` to keep the default.

    *First result wins*: the first non-``None`` result is used, and later
    implementations do not run.
    """


@hookspec
def edgeproxy_upstream_request(
    request: Exchange,
    ctx: RequestContext,
    region: RegionView,
    headers: list[tuple[str, str]],
) -> Awaitable[None] | None:
    """About to send to ``region``: edit ``headers`` in place (credentials, routing hints).

    Called once per attempt. Header names are lower-case.

    *All run*: every implementation runs; return values are ignored.
    """


@hookspec
def edgeproxy_upstream_response(
    request: Exchange, ctx: RequestContext, region: RegionView, reply: UpstreamReply
) -> Awaitable[None] | None:
    """Response headers arrived from ``region``, before anything reaches the client.

    Edit ``reply.status`` and ``reply.headers`` (a list of pairs) in place.

    *All run*: every implementation runs; return values are ignored.
    """


@hookspec
def edgeproxy_stream_chunk(
    request: Exchange, ctx: RequestContext, chunk: bytes
) -> Awaitable[bytes | None] | bytes | None:
    """A body chunk is about to be written to the client.

    Return the bytes to send instead: ``b""`` drops the chunk, ``None``
    keeps it. For SSE, chunks are the region's network reads, not
    necessarily whole events. While any plugin implements this hook, the
    proxy cannot send a ``Content-Length`` it cannot trust, so responses are
    chunked.

    *Chained*: every implementation runs, each receiving the previous one's
    non-``None`` result as ``chunk``; the last value is sent.
    """


@hookspec
def edgeproxy_response_complete(request: Exchange, ctx: RequestContext) -> Awaitable[None] | None:
    """The response is finished (or failed); for logging and usage accounting.

    ``ctx`` holds the timings (``ctx.started``, ``ctx.upstream_ttfb``,
    ``ctx.first_byte_at``, ``ctx.finished_at``), ``ctx.status``,
    ``ctx.bytes_out``, ``ctx.region``, ``ctx.attempts``, ``ctx.error`` and,
    for LLM answers, ``ctx.usage`` (the upstream's token counts). These are the fields of
    the request's outcome, ``ctx.outcome`` (an ``Outcome`` record: also its cache status,
    degradation, hedge and continuations), read the same on the context.

    A WebSocket session calls it once, when the session ends: ``ctx.status`` is 101,
    ``ctx.usage`` the sum of its Realtime responses' usage, and ``ctx.outcome.session``
    its totals (messages and bytes each way, responses, the close code, who ended it).

    The request is answered: an implementation may change ``ctx`` for the ones after
    it (a client address anonymized for the access log, say), its facts included;
    ``ctx.facts`` keeps what the request was.

    *All run*; return values are ignored. Exceptions are logged and never
    reach the client.
    """


@hookspec(firstresult=True)
def edgeproxy_fallback(
    request: Exchange, ctx: RequestContext, reason: str, answer: StreamResponse | None
) -> Awaitable[StreamResponse | bool | None] | StreamResponse | bool | None:
    """The regions cannot answer (``reason``) and a degraded ``answer`` is about to be used.

    ``reason`` is the error's type (``upstream_error``, ``upstream_timeout``,
    ``overloaded``, ``no_region``). ``answer`` is the stale-cache response, or the
    local model's answer before it is generated (its headers can be read; it
    holds a generation slot), or ``None`` when no rung could answer.

    Return ``False`` to veto the degraded answer (the client gets the error
    instead; a held slot goes back unused), a response to replace it (or to
    answer when ``answer`` is ``None``), or ``None`` to let it through.

    *First result wins*: the first non-``None`` result is used, and later
    implementations do not run.
    """


def hook_names() -> list[str]:
    """Names of every hook specification, for docs and tests."""
    return sorted(name for name in globals() if name.startswith("edgeproxy_"))
