"""The request model every stage and hook sees: the request context and the upstream reply."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar, overload

import orjson
from multidict import CIMultiDict

from edgeproxy._core.config import RouteConfig
from edgeproxy._core.outcome import Continuation, LimitLevel, Outcome, SessionTotals
from edgeproxy._core.strictjson import DuplicateKey, loads_unique
from edgeproxy._core.types import Headers, TraceContext

__all__ = ["Continuation", "FixedFact", "RequestContext", "RequestFacts", "UpstreamReply"]

_UNSET: Any = object()
T = TypeVar("T")


class FixedFact(RuntimeError):
    """Something tried to change one of a request's facts after they were fixed."""


class RequestFacts(NamedTuple):
    """What a request is, fixed once it has entered (the ``edgeproxy_request_received``
    hooks and admission are behind it) and never written again.

    Every stage after entry (cache, routing, failover, the fallback ladder, the Responder)
    and the hooks they call see these values. The entry hooks edit the request as a draft;
    once fixed, the context itself refuses a change to one of them (:class:`FixedFact`),
    and so does :meth:`RequestContext.set_json`: nothing needs to compare and restore.
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
    model: str | None
    """The model the client named (the JSON body's ``"model"``), or None."""


class _OutcomeName(Generic[T]):
    """One of the outcome's fields under its name on the context (``ctx.status`` is
    ``ctx.outcome.status``): the package writes them on ``outcome``, and plugins and tests
    read, or set, them on the context as they always did."""

    __slots__ = ("name",)

    def __init__(self) -> None:
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _OutcomeName[T]: ...

    @overload
    def __get__(self, obj: _OutcomeNames, owner: type) -> T: ...

    def __get__(self, obj: _OutcomeNames | None, owner: type) -> _OutcomeName[T] | T:
        if obj is None:
            return self
        value: T = getattr(obj.outcome, self.name)
        return value

    def __set__(self, obj: _OutcomeNames, value: T) -> None:
        setattr(obj.outcome, self.name, value)


class _OutcomeNames:
    """The outcome's fields as the context's own names (see :class:`_OutcomeName`)."""

    __slots__ = ()
    outcome: Outcome
    region: _OutcomeName[str | None] = _OutcomeName()
    attempts: _OutcomeName[int] = _OutcomeName()
    hedged: _OutcomeName[bool] = _OutcomeName()
    upstream_ttfb: _OutcomeName[float | None] = _OutcomeName()
    degraded: _OutcomeName[str | None] = _OutcomeName()
    continuations: _OutcomeName[tuple[Continuation, ...]] = _OutcomeName()
    cache: _OutcomeName[str | None] = _OutcomeName()
    cache_key: _OutcomeName[str | None] = _OutcomeName()
    status: _OutcomeName[int] = _OutcomeName()
    bytes_out: _OutcomeName[int] = _OutcomeName()
    first_byte_at: _OutcomeName[float | None] = _OutcomeName()
    response_is_sse: _OutcomeName[bool] = _OutcomeName()
    usage: _OutcomeName[dict[str, Any] | None] = _OutcomeName()
    error: _OutcomeName[str | None] = _OutcomeName()
    finished_at: _OutcomeName[float | None] = _OutcomeName()
    limits: _OutcomeName[dict[str, LimitLevel] | None] = _OutcomeName()
    stored: _OutcomeName[dict[str, Any] | None] = _OutcomeName()
    state: _OutcomeName[str | None] = _OutcomeName()
    session: _OutcomeName[SessionTotals | None] = _OutcomeName()


@dataclass(slots=True)
class RequestContext(_OutcomeNames):
    """What the pipeline knows about one request as it moves through the stages.

    Plugins read and rewrite the request through it: ``target`` (path and
    query), ``headers`` (a mutable copy of the client's), ``json`` and
    :meth:`set_json`, ``tenant`` and ``priority``. Once it has entered, what the
    request is is fixed in ``facts`` (:class:`RequestFacts`).

    What happened to it, its outcome, is its own record, ``outcome``
    (:class:`~edgeproxy._core.outcome.Outcome`): the pipeline fills it from the values the
    stages return, and the answer's one writer from what it sent. Its fields read the same
    on the context (``ctx.status``, ``ctx.region``, ``ctx.usage``...), for the hooks
    (``edgeproxy_response_complete``), the metrics and the access log.
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
    # What happened to it: see Outcome.
    outcome: Outcome = field(default_factory=Outcome)
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

    def fix(
        self, dialect: str | None, *, guard: bool = True, model: str | None = None
    ) -> RequestFacts:
        """Fix the request's facts, once it has entered; see :class:`RequestFacts`.

        ``guard``: from here on the context refuses a change to a fact. Only a hook could
        make one (no stage does), so the pipeline arms the guard when a hook that runs
        after entry is implemented, and spares the rest of its requests its cost.
        ``model``: the model named outside the body (a Realtime session's query)."""
        # Whether it streams is read from a body parsed already (an LLM route's, by
        # admission): a plain HTTP body is not parsed for a fact about LLM answers.
        body = self._json
        stream = False
        if model is None and type(body) is dict:
            stream = body.get("stream") is True
            named = body.get("model")
            if type(named) is str:
                model = named
        facts: RequestFacts = _new_tuple(
            RequestFacts,
            (self.client_ip, self.route, dialect, stream, self.tenant, self.body, model),
        )
        self.facts = facts
        if guard:
            # From here on the context refuses a change to a fact (_Fixed.__setattr__).
            self.__class__ = _Fixed
        return facts

    def with_json(self, value: Any) -> RequestContext:
        """Another request like this one with ``value`` as its JSON body and its facts fixed
        anew (a continuation leg's: the conversation with the partial answer)."""
        other = copy.copy(self)
        guarded = type(self) is _Fixed
        # A draft again until its facts are fixed anew.
        other.__class__ = RequestContext
        other.headers = CIMultiDict(self.headers)
        other.outcome = copy.copy(self.outcome)
        facts = self.facts
        other.facts = None
        other.set_json(value)
        if facts is not None:
            other.fix(facts.dialect, guard=guarded)
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


_FACTS = frozenset({"client_ip", "route", "tenant", "body"})


class _Fixed(RequestContext):
    """A request context whose facts are fixed (:meth:`RequestContext.fix`): the same
    record, refusing a change to one of them. Set after entry only, so the draft's many
    writes at entry cost nothing more."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        # Until the request is answered (its finish time set): then the hooks after the
        # answer may change the context for the observers after them (an address
        # anonymized for the log), and the facts stay in `facts`.
        if (
            name in _FACTS
            and getattr(self, "facts", None) is not None
            and self.outcome.finished_at is None
        ):
            raise FixedFact(
                f"ctx.{name} is fixed once the request has entered: change it in "
                "edgeproxy_request_received"
            )
        object.__setattr__(self, name, value)


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
    # The outcome's slots set here too, as Outcome() would: its __init__ with fifteen
    # keyword defaults costs more than the stores, once per request.
    out: Outcome = _new(Outcome)
    out.region = out.upstream_ttfb = out.degraded = out.cache = out.cache_key = None
    out.first_byte_at = out.usage = out.error = out.finished_at = out.session = None
    out.stored = out.state = out.limits = None
    out.attempts = out.status = out.bytes_out = 0
    out.hedged = out.response_is_sse = False
    out.continuations = ()
    ctx.outcome = out
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
