"""The hot-answer cache stage: what is cacheable, its key, and serving or storing answers.

Cacheable: POSTs to the OpenAI completion and embedding routes whose JSON
body is deterministic (``temperature`` 0 or a ``seed``; embeddings always),
any JSON POST on a route configured ``cache = "always"``, and GETs whose
upstream answer is marked cacheable (``max-age``/``s-maxage``, not private).
Never: a request with ``Cache-Control: no-store``, a body that is not a JSON
object, a route configured ``cache = "off"``, an answer other than a
complete 200 (a stream must end with ``[DONE]``), or one bigger than
``[cache] max_entry_bytes``.

A key covers the path, the model, the request body with non-semantic fields
removed and JSON keys in canonical order, and its scope: the tenant, else a
hash of the client's credential, else ``pub``. So one customer's answer
never reaches another, and a request carrying an ``Authorization`` is only
ever answered from entries made with that same credential. Keys are blake2b
digests: raw prompts never appear in a backend's key names.

:class:`CacheStage` is the pipeline's view of it all: :meth:`~CacheStage.lookup`
answers from the cache (HIT, STALE) or from an identical request in flight
(COALESCED), or hands the request a :class:`CacheRecorder` that stores what
the stream stage relays; :meth:`~CacheStage.serve_stale` is the
stale-if-error rung of the fallback ladder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import orjson
from aiohttp import web
from multidict import CIMultiDict

from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext, UpstreamReply
from edgeproxy._protocol.endpoints import endpoint_paths
from edgeproxy._protocol.headers import CLIENT_CREDENTIAL_HEADERS, request_id
from edgeproxy._stages.cache.backends import CacheBackend, make_backend
from edgeproxy._stages.cache.entry import (
    Entry,
    ReplayResponse,
    replay_parts,
    response_headers,
    stream_complete,
)
from edgeproxy._stages.cache.flight import (
    DONE,
    FAILED,
    Coalescer,
    Flight,
    stream_live,
    wait_finished,
    wait_started,
)

if TYPE_CHECKING:
    from edgeproxy._plugins import Plugins

__all__ = ["CachePlan", "CacheRecorder", "CacheStage", "default_cache_key", "hash_key"]

logger = logging.getLogger("edgeproxy.cache")

CACHEABLE_PATHS = endpoint_paths("cacheable")

# Fields that do not change the answer: who asked, how it is delivered, tracing ids.
NON_SEMANTIC_FIELDS = frozenset(
    {"user", "stream", "stream_options", "request_id", "metadata", "store", "service_tier"}
)

# A key's flight is led at most this many times in a row; after that, followers
# stop queueing behind one request at a time and go upstream on their own.
MAX_FLIGHT_ATTEMPTS: Final = 2

Fetch = Callable[["RequestContext", "CacheRecorder"], Awaitable[None]]
"""Routes and sends a background refresh like the pipeline does, and relays the answer
into the recorder, with no client attached."""


def hash_key(material: str | bytes) -> str:
    """A fixed-size, prompt-free key for ``material``."""
    data = material.encode() if isinstance(material, str) else material
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def _short_hash(material: str) -> str:
    return hashlib.blake2b(material.encode(), digest_size=8, person=b"edgeproxy").hexdigest()


# The credential headers in the order cache_scope tries them (sorted once, here).
_CREDENTIAL_ORDER = tuple(sorted(CLIENT_CREDENTIAL_HEADERS))


def tenant_scope(tenant: str) -> str:
    """The scope, and so the key prefix (``<scope>:``), of every entry of ``tenant``."""
    return "t" + _short_hash("tenant:" + tenant)


def cache_scope(ctx: RequestContext) -> str:
    """Who may share an entry: the tenant, else the credential the client sent, else anyone.

    ``t…`` and ``k…`` are hashes, so neither tenant names nor credentials
    appear in key names.
    """
    if ctx.tenant:
        return tenant_scope(ctx.tenant)
    for name in _CREDENTIAL_ORDER:
        value = ctx.headers.get(name)
        if value:
            return "k" + _short_hash(f"credential:{name}:{value}")
    return "pub"


def _deterministic(path: str, body: dict[str, Any]) -> bool:
    if path in endpoint_paths("deterministic"):
        return True
    if body.get("seed") is not None:
        return True
    temperature = body.get("temperature")
    return temperature is not None and temperature == 0


def default_cache_key(ctx: RequestContext, *, always: bool = False) -> str | None:
    """The key digest of a cacheable POST, or None when it must not be cached.

    Cacheable: POSTs to the OpenAI completion and embedding routes whose JSON
    body is deterministic (``temperature`` 0 or a ``seed``), or any such POST
    when ``always``. Never: ``Cache-Control: no-store``.
    """
    if ctx.method != "POST" or ctx.path not in CACHEABLE_PATHS:
        return None
    if "no-store" in ctx.headers.get("cache-control", "").lower():
        return None
    body = ctx.json
    if not isinstance(body, dict):
        return None
    if not always and not _deterministic(ctx.path, body):
        return None
    return _post_digest(ctx, body)


def _post_digest(
    ctx: RequestContext, body: dict[str, Any], scope: str | None = None, path: str | None = None
) -> str:
    semantic = {k: v for k, v in body.items() if k not in NON_SEMANTIC_FIELDS}
    material = orjson.dumps(
        {
            "path": ctx.path if path is None else path,
            "model": body.get("model"),
            "body": semantic,
            "scope": cache_scope(ctx) if scope is None else scope,
        },
        option=orjson.OPT_SORT_KEYS,
    )
    return hash_key(material)


def _get_digest(ctx: RequestContext, scope: str) -> str:
    # The proxy forwards these, and the answer may depend on them.
    material = orjson.dumps(
        {
            "method": "GET",
            "target": ctx.target,
            "accept": ctx.headers.get("accept", ""),
            "accept-encoding": ctx.headers.get("accept-encoding", ""),
            "scope": scope,
        },
        option=orjson.OPT_SORT_KEYS,
    )
    return hash_key(material)


def _directives(values: list[str]) -> dict[str, str | None]:
    """``Cache-Control`` directives, lower-cased: ``{"max-age": "60", "public": None}``."""
    out: dict[str, str | None] = {}
    for value in values:
        for part in value.split(","):
            name, _, arg = part.strip().partition("=")
            if name:
                out[name.lower()] = arg.strip().strip('"') if arg else None
    return out


def _seconds(value: str | None) -> float | None:
    if value is None or not value.isdigit():
        return None
    return float(value)


@dataclasses.dataclass(slots=True)
class CachePlan:
    """What the cache does with one cacheable request."""

    key: str
    """The entry's name in the backends: ``<scope>:<digest>``."""
    method: str
    lookup: bool
    """False when the client asked for a fresh answer (``no-cache``): store, but do not serve."""
    coalesce: bool
    wants_sse: bool
    include_usage: bool
    ttl: float
    swr: float
    sie: float
    credentials: bool


def _plan_for_ctx(ctx: RequestContext, key: str, *, coalesce: bool) -> CachePlan:
    wants_sse = include_usage = fresh_only = credentials = False
    body = ctx.json if ctx.method == "POST" else None
    if isinstance(body, dict):
        wants_sse = body.get("stream") is True
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
    headers = ctx.headers
    if "cache-control" in headers:
        request_cc = _directives(headers.getall("cache-control"))
        fresh_only = "no-cache" in request_cc or request_cc.get("max-age") == "0"
    for name in CLIENT_CREDENTIAL_HEADERS:
        if headers.get(name):
            credentials = True
    route = ctx.route
    return CachePlan(
        key=key,
        method=ctx.method,
        lookup=not fresh_only,
        coalesce=coalesce and ctx.method == "POST",
        wants_sse=wants_sse,
        include_usage=include_usage,
        ttl=route.cache_ttl,
        swr=route.stale_while_revalidate,
        sie=route.stale_if_error,
        credentials=credentials,
    )


class CacheStats:
    """Counters for ``/status``: outcomes, why answers were not cached, refreshes."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.bypass: Counter[str] = Counter()
        self.not_cached: Counter[str] = Counter()
        self.stores = 0
        self.refreshes = 0
        self.refresh_failures = 0
        self.early_refreshes = 0
        self.purged = 0
        self.stale_if_error = 0

    def hit_ratio(self) -> float | None:
        served = self.outcomes["HIT"] + self.outcomes["STALE"] + self.outcomes["COALESCED"]
        total = served + self.outcomes["MISS"]
        return round(served / total, 4) if total else None


class CacheRecorder:
    """Sees the leader's answer as the stream stage relays it, and stores it once complete.

    The stream stage calls :meth:`start` with the response headers,
    :meth:`feed` with each chunk sent to the client (appending to a list,
    nothing that could delay the client) and :meth:`finish` once the upstream
    body ended cleanly. The pipeline calls :meth:`release` when the request is
    over, whatever happened: an answer that never finished is not stored, and
    the followers waiting on it wake up.
    """

    __slots__ = (
        "stage",
        "ctx",
        "plan",
        "flight",
        "chunks",
        "size",
        "kind",
        "status",
        "headers",
        "region",
        "windows",
        "expected",
        "tail",
        "started",
        "active",
        "too_large",
        "finished",
    )

    def __init__(
        self, stage: CacheStage, ctx: RequestContext, plan: CachePlan, flight: Flight | None
    ) -> None:
        self.stage = stage
        self.ctx = ctx
        self.plan = plan
        self.flight = flight
        self.chunks: list[bytes] = flight.chunks if flight is not None else []
        self.size = 0
        self.kind = "raw"
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.region: str | None = None
        self.windows: tuple[float, float, float] = (0.0, 0.0, 0.0)
        # The body is complete at `expected` bytes (a JSON answer with a Content-Length) or
        # once `tail` holds the [DONE] event: the client may hang up before the upstream's
        # end of body is read, and a complete answer must not be lost to that.
        self.expected: int | None = None
        self.tail = b""
        self.started = False
        self.active = False
        self.too_large = False
        self.finished = False

    def start(self, reply: UpstreamReply, region: str | None = None) -> None:
        """Response headers arrived (after the plugins' edits): is this answer storable?"""
        self.started = True
        self.status = reply.status
        self.region = region
        content_type = ""
        length = ""
        for name, value in reply.headers:
            lname = name.lower()
            if lname == "content-type":
                content_type = value.lower()
            elif lname == "content-length":
                length = value
        # A chunk plugin changes the length: then only the end of the body says it is whole.
        if length.isdigit() and not self.stage.plugins.has("edgeproxy_stream_chunk"):
            self.expected = int(length)
        if content_type.startswith("text/event-stream"):
            self.kind = "sse"
        elif "json" in content_type:
            self.kind = "json"
        windows, reason = self.stage.storable(self.plan, reply.status, reply.headers)
        if windows is None:
            self.stage.stats.not_cached[reason] += 1
            if self.flight is not None:
                self.flight.fail()
            return
        self.active = True
        self.windows = windows
        self.headers = list(reply.headers)
        # Lets the client (and an operator purging) name the entry.
        reply.headers.append(("X-Edgeproxy-Cache-Key", self.plan.key))
        if self.flight is not None:
            self.flight.region = region
            self.flight.started(reply.status, self.headers, self.kind == "sse")

    def feed(self, chunk: bytes) -> None:
        if not self.active or self.finished:
            return
        self.size += len(chunk)
        if self.kind == "sse":
            self.tail = (self.tail + chunk)[-64:]
        flight = self.flight
        if not self.too_large and self.size > self.stage.config.max_entry_bytes:
            self.too_large = True
            if flight is None or not flight.followers:
                # Nobody needs the recording any more: stop holding the bytes.
                if flight is not None:
                    flight.drop_chunks()
                else:
                    self.chunks.clear()
        if flight is not None:
            if flight.shareable:
                flight.add(chunk)
        elif not self.too_large:
            self.chunks.append(chunk)
        if self.too_large:
            return  # not stored: it ends with the upstream body
        if self.expected is not None:
            if self.size >= self.expected:
                self.finish()
        elif self.kind == "sse" and stream_complete(self.tail):
            self.finish()

    def finish(self) -> None:
        """The upstream body ended cleanly: store the answer if it is complete."""
        if self.finished:
            return
        self.finished = True
        if not self.active:
            return
        flight = self.flight
        # A stream that ended without [DONE] was cut: never stored, never replayed.
        complete = self.kind != "sse" or stream_complete(self.tail)
        reason = "too_large" if self.too_large else "" if complete else "incomplete"
        # Too large to store, but kept in full while followers needed it.
        kept = not self.too_large or (flight is not None and flight.shareable)
        entry: Entry | None = None
        if complete and kept:
            ttl, swr, sie = self.windows
            entry = Entry.build(
                status=self.status,
                headers=self.headers,
                body=b"".join(self.chunks),
                kind=self.kind,
                ttl=ttl,
                swr=swr,
                sie=sie,
                delta=time.monotonic() - self.ctx.started,
                region=self.region,
                clock=self.stage.clock,
            )
        if flight is not None:
            # Followers get the answer even when it is too large to store.
            flight.done(entry)
        if reason or entry is None:
            if reason:
                self.stage.stats.not_cached[reason] += 1
            if flight is not None:
                self.stage.coalescer.end(flight)
            return
        self.stage.store(self.plan.key, entry, flight)

    def release(self) -> None:
        """The request is over. An answer that did not finish is dropped; followers wake."""
        if self.finished:
            return
        self.finished = True
        if self.active:
            self.stage.stats.not_cached["incomplete"] += 1
        flight = self.flight
        if flight is not None:
            # The regions failed (the fallback answered): followers may take stale-if-error.
            flight_error = not self.started and (
                self.ctx.status >= 500 or self.ctx.degraded is not None
            )
            flight.error = flight_error
            flight.fail()
            self.stage.coalescer.end(flight)


class CacheStage:
    """The cache as the pipeline sees it: lookup, coalescing, recording, stale-if-error.

    ``fetch`` lets background refreshes (stale-while-revalidate, early
    refresh) go upstream the way the pipeline does; without it they are off.
    Open and close it with the proxy (:meth:`open`, :meth:`close`).
    """

    def __init__(
        self,
        config: Config,
        plugins: Plugins,
        *,
        fetch: Fetch | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config.cache
        # Wall-clock seconds, as entries are shared across hosts: freshness, Age, stale windows.
        self.clock = clock
        self.plugins = plugins
        self.backend: CacheBackend | None = (
            make_backend(self.config) if self.config.enabled else None
        )
        self.coalescer = Coalescer()
        self.stats = CacheStats()
        self.fetch = fetch
        self._tasks: set[asyncio.Task[None]] = set()
        self._refreshing: set[str] = set()
        self._random: Callable[[], float] = random.random
        self._closed = False

    # -- lifespan ----------------------------------------------------------

    async def open(self) -> None:
        """Connect the backend (a Redis that does not answer is a warning, not a failure)."""
        if self.backend is not None:
            await self.backend.open()

    async def close(self) -> None:
        """Cancel refreshes and pending stores, then close the backend."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.backend is not None:
            await self.backend.close()

    # -- keys and plans ----------------------------------------------------

    async def key(self, request: web.Request, ctx: RequestContext) -> str | None:
        """The scoped key of a cacheable request (the hook may replace the digest), or None."""
        plan = await self.plan(request, ctx)
        return plan.key if plan is not None else None

    async def plan(self, request: web.Request, ctx: RequestContext) -> CachePlan | None:
        """Decide what the cache does with ``ctx``; sets ``ctx.cache_key`` and, for a
        request the cache leaves alone, ``ctx.cache = "BYPASS"``."""
        if self.backend is None:
            return None
        key, reason = await self._key(request, ctx)
        if key is None:
            ctx.cache = "BYPASS"
            self.stats.outcomes["BYPASS"] += 1
            self.stats.bypass[reason] += 1
            return None
        ctx.cache_key = key
        return _plan_for_ctx(ctx, key, coalesce=self.config.coalesce)

    async def _key(self, request: web.Request, ctx: RequestContext) -> tuple[str | None, str]:
        reason = self._bypass_reason(ctx)
        if reason:
            return None, reason
        # Only now: the scope hashes the tenant or credential, wasted on a bypass.
        scope = cache_scope(ctx)
        digest = self._digest(ctx, scope)
        if self.plugins.has("edgeproxy_cache_key"):
            custom = await self.plugins.call_first(
                "edgeproxy_cache_key", request=request, ctx=ctx, default_key=digest
            )
            if custom is not None:
                digest = hash_key("custom:" + str(custom))
        # The scope stays in front whatever the hook says: entries never cross tenants.
        return f"{scope}:{digest}", ""

    def _bypass_reason(self, ctx: RequestContext) -> str:
        """Why the cache leaves ``ctx`` alone (a ``bypass`` counter name); "" when cacheable."""
        mode = ctx.route.cache
        if mode == "off":
            return "route_off"
        if "no-store" in ctx.headers.get("cache-control", "").lower():
            return "no_store"
        if ctx.method == "GET":
            return "get_with_body" if ctx.body else ""
        if ctx.method != "POST":
            return "method"
        path = ctx.path
        if path not in CACHEABLE_PATHS and mode != "always":
            return "path"
        body = ctx.json
        if not isinstance(body, dict):
            return "not_json"
        if mode != "always" and not _deterministic(path, body):
            return "not_deterministic"
        return ""

    def _digest(self, ctx: RequestContext, scope: str) -> str:
        """The key digest of a request :meth:`_bypass_reason` let through."""
        if ctx.method == "GET":
            return _get_digest(ctx, scope)
        return _post_digest(ctx, ctx.json, scope, ctx.path)

    def storable(
        self, plan: CachePlan, status: int, headers: list[tuple[str, str]]
    ) -> tuple[tuple[float, float, float] | None, str]:
        """((ttl, stale-while-revalidate, stale-if-error), "") for an answer that may be
        stored, else (None, why not)."""
        if status != 200:
            return None, "status"
        cc_values = [v for k, v in headers if k.lower() == "cache-control"]
        cc = _directives(cc_values)
        if "no-store" in cc or "private" in cc:
            return None, "no_store"
        if plan.method != "GET":
            # The key does not cover Accept-Encoding: only identity bodies may be shared.
            encoding = next((v for k, v in headers if k.lower() == "content-encoding"), "")
            if encoding.strip().lower() not in ("", "identity"):
                return None, "encoded"
            return (plan.ttl, plan.swr, plan.sie), ""
        # A GET is stored only when its upstream says a shared cache may keep it.
        lowered = [(k.lower(), v) for k, v in headers]
        if any(k == "set-cookie" for k, _ in lowered):
            return None, "set_cookie"
        vary = {v.strip().lower() for k, value in lowered if k == "vary" for v in value.split(",")}
        if vary - {"accept", "accept-encoding", ""}:
            return None, "vary"
        if "no-cache" in cc:
            return None, "not_cacheable"
        if plan.credentials and "public" not in cc and "s-maxage" not in cc:
            return None, "not_cacheable"
        # s-maxage is for shared caches like this one, and wins over max-age.
        ttl = _seconds(cc["s-maxage"]) if "s-maxage" in cc else _seconds(cc.get("max-age"))
        age = next((_seconds(v) for k, v in lowered if k == "age"), None) or 0.0
        if ttl is None or ttl - age <= 0:
            return None, "not_cacheable"
        swr = _seconds(cc.get("stale-while-revalidate"))
        sie = _seconds(cc.get("stale-if-error"))
        return (
            ttl - age,
            plan.swr if swr is None else swr,
            plan.sie if sie is None else sie,
        ), ""

    # -- serving -------------------------------------------------------------

    async def lookup(
        self, request: web.Request, ctx: RequestContext
    ) -> tuple[web.StreamResponse | None, CacheRecorder | None]:
        """An answer from the cache or from an identical request in flight; else, for a
        cacheable request, the recorder that stores what the pipeline relays."""
        plan = await self.plan(request, ctx)
        if plan is None or self.backend is None:
            return None, None
        if plan.lookup:
            entry = await self.backend.get(plan.key)
            if entry is not None:
                answer = self._serve(request, ctx, plan, entry)
                if answer is not None:
                    return answer, None
        if plan.coalesce:
            return await self._coalesce(request, ctx, plan)
        return None, self._lead(ctx, plan, None)

    def _serve(
        self, request: web.Request, ctx: RequestContext, plan: CachePlan, entry: Entry
    ) -> web.StreamResponse | None:
        """HIT while fresh (maybe refreshing early), STALE within stale-while-revalidate."""
        now = self.clock()
        if now < entry.fresh_until:
            if entry.should_refresh_early(now, self.config.xfetch_beta, 1.0 - self._random()):
                if self._refresh_later(ctx, plan):
                    self.stats.early_refreshes += 1
            return self._replay(ctx, plan, entry, "HIT", now)
        if now < entry.swr_until:
            self._refresh_later(ctx, plan)
            return self._replay(ctx, plan, entry, "STALE", now)
        return None

    def _replay(
        self,
        ctx: RequestContext,
        plan: CachePlan,
        entry: Entry,
        outcome: str,
        now: float | None = None,
    ) -> web.StreamResponse | None:
        """``entry`` as the client asked for it (stream or JSON), or None if that is impossible."""
        converted = replay_parts(entry, wants_sse=plan.wants_sse, include_usage=plan.include_usage)
        if converted is None:
            return None
        parts, sse = converted
        now = self.clock() if now is None else now
        # Stored headers never carry these names (Entry.build drops them): append, not set.
        # A plain list (response_headers returns a fresh one): the response copies its
        # headers into a CIMultiDict of its own anyway, so one is built, not two.
        headers = response_headers(entry, sse=sse)
        region = entry.region if outcome == "COALESCED" and entry.region else "none"
        headers += (
            ("Age", str(entry.age(now))),
            ("X-Edgeproxy-Cache", outcome),
            ("X-Edgeproxy-Cache-Key", plan.key),
            ("X-Edgeproxy-Region", region),
            ("X-Request-Id", ctx.request_id),
        )
        resp: web.StreamResponse
        if sse:
            resp = ReplayResponse(status=entry.status, parts=parts)
            resp.headers.extend(headers)
        else:
            resp = web.Response(status=entry.status, body=parts[0], headers=headers)
        ctx.cache = outcome
        ctx.status = entry.status
        self.stats.outcomes[outcome] += 1
        return resp

    def _lead(self, ctx: RequestContext, plan: CachePlan, flight: Flight | None) -> CacheRecorder:
        ctx.cache = "MISS"
        self.stats.outcomes["MISS"] += 1
        return CacheRecorder(self, ctx, plan, flight)

    async def _coalesce(
        self, request: web.Request, ctx: RequestContext, plan: CachePlan
    ) -> tuple[web.StreamResponse | None, CacheRecorder | None]:
        attempt = 1
        while True:
            flight, leading = self.coalescer.join(plan.key, attempt)
            if leading:
                return None, self._lead(ctx, plan, flight)
            try:
                answer, action = await self._follow(request, ctx, plan, flight)
            finally:
                flight.followers -= 1
            if answer is not None:
                return answer, None
            if action == "alone":
                return None, self._lead(ctx, plan, None)
            # The leader gave up before anything reached this request.
            if flight.error:
                stale = await self.serve_stale(request, ctx)
                if stale is not None:
                    return stale, None
            if flight.attempt >= MAX_FLIGHT_ATTEMPTS:
                return None, self._lead(ctx, plan, None)
            # The first follower to get here leads the retry; the others follow it.
            attempt = flight.attempt + 1

    async def _follow(
        self, request: web.Request, ctx: RequestContext, plan: CachePlan, flight: Flight
    ) -> tuple[web.StreamResponse | None, str]:
        """Answer a follower from ``flight``: (answer, "") or (None, "retry" | "alone")."""
        await wait_started(flight)
        if flight.state == FAILED:
            return None, "retry"
        if plan.wants_sse and flight.sse and flight.shareable:
            # Same form as the leader's: chunks as the leader receives them.
            resp = web.StreamResponse(status=flight.status)
            for name, value in flight.headers:
                if name.lower() not in ("content-length", "x-request-id", "date", "set-cookie"):
                    resp.headers.add(name, value)
            resp.headers["Age"] = "0"
            resp.headers["X-Edgeproxy-Cache"] = "COALESCED"
            resp.headers["X-Edgeproxy-Cache-Key"] = plan.key
            resp.headers["X-Edgeproxy-Region"] = flight.region or "none"
            resp.headers["X-Request-Id"] = ctx.request_id
            ctx.cache = "COALESCED"
            ctx.status = flight.status
            ctx.response_is_sse = True
            self.stats.outcomes["COALESCED"] += 1
            try:
                if not await stream_live(request, resp, flight, include_usage=plan.include_usage):
                    ctx.error = "the coalesced stream broke upstream"
            except ConnectionResetError:
                ctx.error = "client disconnected"
            return resp, ""
        await wait_finished(flight)
        if flight.state != DONE:
            return None, "retry"
        if flight.entry is None:
            return None, "alone"
        answer = self._replay(ctx, plan, flight.entry, "COALESCED")
        return (answer, "") if answer is not None else (None, "alone")

    async def serve_stale(
        self, request: web.Request, ctx: RequestContext
    ) -> web.StreamResponse | None:
        """The stale-if-error answer: a stored answer within its ``stale_if_error`` window
        (or still fresh), marked ``X-Edgeproxy-Cache: STALE`` and
        ``X-Edgeproxy-Degraded: stale-cache``; None when there is none."""
        if self.backend is None:
            return None
        if ctx.cache_key is None and ctx.cache is None:
            # Shed by admission before the cache stage ran: work the key out now.
            ctx.cache_key, _ = await self._key(request, ctx)
        if ctx.cache_key is None:
            return None
        entry = await self.backend.get(ctx.cache_key)
        now = self.clock()
        if entry is None or now >= max(entry.sie_until, entry.fresh_until):
            return None
        plan = _plan_for_ctx(ctx, ctx.cache_key, coalesce=False)
        resp = self._replay(ctx, plan, entry, "STALE", now)
        if resp is not None:
            resp.headers["X-Edgeproxy-Degraded"] = "stale-cache"
            self.stats.stale_if_error += 1
        return resp

    # -- storing and refreshing -------------------------------------------------

    def store(self, key: str, entry: Entry, flight: Flight | None) -> None:
        """Store ``entry`` in the background; the flight stays joinable until it is stored,
        so a request arriving meanwhile is answered from it rather than going upstream."""

        async def run() -> None:
            try:
                assert self.backend is not None
                if await self.backend.set(key, entry):
                    self.stats.stores += 1
                else:
                    self.stats.not_cached["store_failed"] += 1
            finally:
                if flight is not None:
                    self.coalescer.end(flight)

        self._spawn(run())

    def _spawn(self, coro: Any) -> None:
        if self._closed:
            coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refresh_later(self, ctx: RequestContext, plan: CachePlan) -> bool:
        """Refresh ``plan.key`` in the background, once: not if a refresh or a request for it
        is already in flight.

        The refresh outlives the client's handler: it gets a context of its own, copied
        now, and nothing of the client's request.
        """
        if self.fetch is None or plan.key in self._refreshing or plan.key in self.coalescer.flights:
            return False
        self._refreshing.add(plan.key)
        self._spawn(self._refresh(_refresh_context(ctx), plan))
        return True

    async def _refresh(self, ctx: RequestContext, plan: CachePlan) -> None:
        """Lead the key's flight and record the region's answer, relayed by ``fetch``."""
        assert self.fetch is not None
        flight, leading = self.coalescer.join(plan.key)
        if not leading:
            flight.followers -= 1
            self._refreshing.discard(plan.key)
            return
        recorder = CacheRecorder(self, ctx, plan, flight)
        try:
            await self.fetch(ctx, recorder)
            self.stats.refreshes += 1
        except Exception as exc:  # noqa: BLE001 - a failed refresh keeps the stale entry
            self.stats.refresh_failures += 1
            logger.info("cache: background refresh of %s failed: %s", plan.key, exc)
        finally:
            recorder.release()
            self._refreshing.discard(plan.key)

    # -- admin -------------------------------------------------------------------

    async def purge(
        self, *, key: str | None = None, prefix: str | None = None, tenant: str | None = None
    ) -> int:
        """Delete the entry named ``key``, every entry of ``tenant``, or every entry whose key
        starts with ``prefix`` (``""``: all of them). Returns how many went."""
        if self.backend is None:
            return 0
        if tenant is not None:
            prefix = tenant_scope(tenant) + ":"
        if key is not None:
            count = await self.backend.delete(key)
        else:
            count = await self.backend.purge(prefix or "")
        self.stats.purged += count
        return count

    def status(self) -> dict[str, Any]:
        """The ``cache`` section of ``/status``."""
        stats = self.stats
        out: dict[str, Any] = {
            "enabled": self.backend is not None,
            "backend": self.config.backend,
            "hit_ratio": stats.hit_ratio(),
            "outcomes": dict(stats.outcomes),
            "bypass_reasons": dict(stats.bypass),
            "not_cached": dict(stats.not_cached),
            "stores": stats.stores,
            "refreshes": stats.refreshes,
            "early_refreshes": stats.early_refreshes,
            "refresh_failures": stats.refresh_failures,
            "stale_if_error": stats.stale_if_error,
            "purged": stats.purged,
            "in_flight": len(self.coalescer),
        }
        if self.backend is not None:
            tiers = self.backend.status()
            out["tiers"] = tiers
            out["errors"] = _errors(tiers)
        return out


def _refresh_context(ctx: RequestContext) -> RequestContext:
    """A background refresh's own context: the client's request (its headers copied), as a
    new request with nothing answered yet."""
    return dataclasses.replace(
        ctx,
        request_id=request_id(None),
        headers=CIMultiDict(ctx.headers),
        started=time.monotonic(),
        cache="REFRESH",
        region=None,
        attempts=0,
        hedged=False,
        status=0,
        bytes_out=0,
        upstream_ttfb=None,
        first_byte_at=None,
        finished_at=None,
        response_is_sse=False,
        degraded=None,
        usage=None,
        error=None,
        extra={},
    )


def _errors(tiers: dict[str, Any]) -> dict[str, int]:
    """Backend error counts, summed over the tiers that report them."""
    total: Counter[str] = Counter()
    stack = [tiers]
    while stack:
        node = stack.pop()
        for name, value in node.items():
            if name == "errors" and isinstance(value, dict):
                total.update(value)
            elif isinstance(value, dict):
                stack.append(value)
    return dict(total)
