"""The request model every stage and hook sees: the request context and the upstream reply."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson
from multidict import CIMultiDict

from edgeproxy._core.config import RouteConfig
from edgeproxy._core.strictjson import DuplicateKey, loads_unique
from edgeproxy._core.types import Headers, TraceContext

__all__ = ["Continuation", "FixedFact", "RequestContext", "RequestFacts", "UpstreamReply"]

_UNSET: Any = object()


class Continuation(NamedTuple):
    """One try at continuing a stream that broke after tokens were sent."""

    source: str
    """The region (or ``local``) whose leg broke."""
    target: str
    """The region (or ``local``) that took the answer on; ``none`` when none did."""
    outcome: str
    """``continued``, or why not: ``failed``, ``limit``, ``impossible``, ``budget``."""


class FixedFact(RuntimeError):
    """Something tried to change one of a request's facts after they were fixed."""


class RequestFacts(NamedTuple):
    """What a request is, fixed once it has entered (the ``edgeproxy_request_received``
    hooks and admission are behind it) and never written again.

    Every stage after entry (cache, routing, failover, the fallback ladder, the relay)
    and the hooks they call see these values; a hook that changes one of them on the
    context after entry fails (:class:`FixedFact`), and so does :meth:`RequestContext.set_json`.
    A named tuple: immutable, and built in a fraction of a frozen dataclass's time, once
    a request.
    """

    client_ip: str | None
    """The client's address, resolved once through ``[server] trusted_proxies``."""
    route: RouteConfig
    """The ``[[routes]]`` entry the request matched (again, if a hook rewrote it)."""
    dialect: str | None
    """The API it speaks: the endpoint table's name (``chat.completions``,
    ``embeddings``, ...), None for plain HTTP."""
    stream: bool
    """Whether the client asked for a streamed answer (``"stream": true``)."""
    tenant: str | None
    """Who the request is for, as the hooks at entry decided (the cache's scope)."""
    body: bytes | None
    """The buffered body as it is forwarded; None for a body that streams through."""

    def changed(self, ctx: RequestContext) -> str | None:
        """The name of a fact ``ctx`` no longer agrees with, or None."""
        if ctx.tenant != self.tenant:
            return "tenant"
        if ctx.route is not self.route:
            return "route"
        if ctx.body is not self.body:
            return "body"
        if ctx.client_ip != self.client_ip:
            return "client_ip"
        return None

    def restore(self, ctx: RequestContext) -> None:
        """Put the facts back on ``ctx`` (after a hook changed one)."""
        ctx.tenant = self.tenant
        ctx.route = self.route
        ctx.body = self.body
        ctx.client_ip = self.client_ip


@dataclass(slots=True)
class RequestContext:
    """What the pipeline knows about one request as it moves through the stages.

    Plugins read and rewrite the request through it: ``target`` (path and
    query), ``headers`` (a mutable copy of the client's), ``json`` and
    :meth:`set_json`, ``tenant`` and ``priority``. Once it has entered, what the
    request is is fixed in ``facts`` (:class:`RequestFacts`).

    What happened to it, its outcome, is filled in from what the stages return, for the
    hooks (``edgeproxy_response_complete``), the metrics and the access log to read; the
    stages themselves write none of it. Who fills each field:

    * ``region``: the region that answered, or the latest one tried; a continued
      stream's, the region that took it on. Recorded by the obtain path
      (``edgeproxy._obtain``) from failover's returned value, and by its ``Continuer``.
    * ``attempts``: upstream attempts sent, a continuation's legs' included. The obtain
      path, from failover's value (its ``attempts``) and each leg's.
    * ``hedged``: a hedge was sent. The obtain path, from failover's value.
    * ``upstream_ttfb``: seconds from sending the answering attempt to its headers. The
      obtain path, from the ``AttemptResponse``.
    * ``degraded``: ``stale-cache``, ``local-model`` or ``plugin`` when the fallback
      ladder answered (or the local model continued a stream), else None. The obtain
      path, from the ladder's ``Degraded`` kind (already as the ``edgeproxy_fallback``
      hook runs) and a continuation ``Leg``'s.
    * ``continuations``: each try at continuing a broken stream, in order
      (:class:`Continuation`). The obtain path's ``Continuer``, from the continuation
      stage's returned records.
    * ``cache``, ``cache_key``: the cache's status (``HIT``, ``MISS``, ``STALE``,
      ``COALESCED``, ``BYPASS``, ``REFRESH``) and key. The cache stage, at lookup and
      as it serves a stale answer to the ladder.
    * ``status``: the status sent to the client. The answer's writer (the relay, the
      heartbeats, the cache's replay, the pipeline's own and error answers).
    * ``bytes_out``, ``first_byte_at``, ``response_is_sse``: what the client was sent,
      when its first byte went, whether as SSE. The answer's writer, as it sends.
    * ``usage``: the answer's token counts (a continued stream's summed). The answer's
      writer (the relay, the local model), as it sends.
    * ``error``: why the answer failed or ended early. The pipeline's error answer, or
      the answer's writer when it breaks off.
    * ``finished_at``: when the request ended. The pipeline, on every way out.

    The answer's writer accounts for what it sent: the streaming fields are written as the
    bytes go out, never returned.
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
    # The client's scheme, HTTP version and Host, copied from the request so that work
    # outliving its handler (a background cache refresh) never holds the request.
    scheme: str = "http"
    http_version: str = "1.1"
    host: str = ""
    # client_ip is the client as resolved once, at entry, from [server] trusted_proxies; the
    # connection's own address is `peer`, and `peer_trusted` says whether it is one of those
    # proxies, whose headers about the client (X-Forwarded-For, a CDN's geo) are believed.
    peer: str | None = None
    peer_trusted: bool = False
    tenant: str | None = None
    priority: int = 0
    # The model the client named (the JSON body's "model" of an LLM endpoint), set by the
    # router when a region lists models or aliases; None otherwise.
    model: str | None = None
    client_country: str | None = None
    client_geo: tuple[float, float] | None = None
    # The outcome: filled in from what the stages return (see the docstring).
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
    # Each try at continuing the stream (routes' continue_on_break), in order.
    continuations: tuple[Continuation, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    # Fixed at entry (fix()): what the request is, from then on.
    facts: RequestFacts | None = None
    _json: Any = _UNSET
    # ``path`` and the target it was worked out from: the stages ask for it several times.
    _path: str = field(default="", init=False, repr=False, compare=False)
    _path_of: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def path(self) -> str:
        """``target`` without its query string."""
        target = self.target
        if self._path_of is not target:
            self._path = target.split("?", 1)[0]
            self._path_of = target
        return self._path

    @property
    def json(self) -> Any:
        """The request body parsed as JSON, or None when it is not a buffered JSON body
        (or names a key twice in one object, which parsers read differently)."""
        if self._json is _UNSET:
            self._json = None
            if self.body and "json" in self.headers.get("content-type", ""):
                try:
                    self._json = loads_unique(self.body)
                except (orjson.JSONDecodeError, DuplicateKey):
                    pass
        return self._json

    def fix(self, dialect: str | None) -> RequestFacts:
        """Fix the request's facts, once it has entered; see :class:`RequestFacts`."""
        # Whether it streams is read from a body parsed already (an LLM route's, by
        # admission): a plain HTTP body is not parsed for a fact about LLM answers.
        body = self._json
        facts: RequestFacts = _new_tuple(
            RequestFacts,
            (
                self.client_ip,
                self.route,
                dialect,
                isinstance(body, dict) and body.get("stream") is True,
                self.tenant,
                self.body,
            ),
        )
        self.facts = facts
        return facts

    def with_json(self, value: Any) -> RequestContext:
        """Another request like this one with ``value`` as its JSON body and its facts fixed
        anew (a continuation leg's: the conversation with the partial answer)."""
        other = copy.copy(self)
        other.headers = CIMultiDict(self.headers)
        facts = self.facts
        other.facts = None
        other.set_json(value)
        if facts is not None:
            other.fix(facts.dialect)
        return other

    def set_json(self, value: Any) -> None:
        """Replace the request body with ``value`` serialized as JSON (until the request's
        facts are fixed at entry: then it raises :class:`FixedFact`)."""
        if self.facts is not None:
            raise FixedFact(
                "the request's body is fixed once it has entered: set_json is for "
                "edgeproxy_request_received"
            )
        self.body = orjson.dumps(value)
        self.body_read = True
        self._json = value
        self.headers["content-type"] = "application/json"


_new = object.__new__
# A named tuple's own __new__ is a Python function around this: a call less per request.
_new_tuple = tuple.__new__


def start_context(
    request_id: str,
    trace: TraceContext,
    method: str,
    target: str,
    headers: CIMultiDict[str],
    client_ip: str | None,
    started: float,
    route: RouteConfig,
    scheme: str,
    http_version: str,
    host: str,
    peer: str | None = None,
    peer_trusted: bool = False,
) -> RequestContext:
    """A new request's context, as ``RequestContext(...)`` with these fields would build it.

    Every slot is set here directly: the dataclass's own ``__init__``, with its keyword
    arguments matched against 37 parameters, costs twice as much, once per request. A
    field added to :class:`RequestContext` is added here too (a test compares the two).
    """
    ctx: RequestContext = _new(RequestContext)
    ctx.request_id = request_id
    ctx.trace = trace
    ctx.method = method
    ctx.target = target
    ctx.headers = headers
    ctx.client_ip = client_ip
    ctx.started = started
    ctx.route = route
    ctx.body = None
    ctx.body_read = False
    ctx.scheme = scheme
    ctx.http_version = http_version
    ctx.host = host
    ctx.peer = peer
    ctx.peer_trusted = peer_trusted
    ctx.tenant = None
    ctx.priority = 0
    ctx.model = None
    ctx.client_country = None
    ctx.client_geo = None
    ctx.region = None
    ctx.attempts = 0
    ctx.hedged = False
    ctx.status = 0
    ctx.bytes_out = 0
    ctx.upstream_ttfb = None
    ctx.first_byte_at = None
    ctx.finished_at = None
    ctx.response_is_sse = False
    ctx.cache = None
    ctx.cache_key = None
    ctx.degraded = None
    ctx.usage = None
    ctx.error = None
    ctx.continuations = ()
    ctx.extra = {}
    ctx.facts = None
    ctx._json = _UNSET
    ctx._path = ""
    ctx._path_of = None
    return ctx


@dataclass(slots=True)
class UpstreamReply:
    """Status and headers of a region's response, editable by plugins before they are sent."""

    status: int
    headers: Headers
