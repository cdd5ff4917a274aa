"""What the cache made of the requests it saw, remembered by every input it read.

A cache hit repeats a request exactly: the same target, body bytes and credentials. What
the cache decides for one (its bypass reason, and once a lookup made them its key and
plan) is a function of those inputs alone, so it is made once and found again by them,
instead of hashing a canonical body and the credentials on every hit. A request's name
here holds every input that the bypass, the key and the plan read: the target (path and
query string), the body as sent, the API its facts name, the tenant, the route, and every
value of each header the key or the plan reads (the credential headers, those that select
behaviour, ``[cache] vary_headers``, Cache-Control, Content-Type). Only a hook could make
the answer depend on anything else (one rewriting the request before the cache, its JSON
in place too, or naming its key): with one of those, nothing is remembered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

from edgeproxy._cache.plan import CachePlan
from edgeproxy._core.context import RequestContext
from edgeproxy._protocol.headers import CLIENT_CREDENTIAL_HEADERS

__all__ = ["Known", "KnownRequests"]

# Bodies up to this size, this many requests, this many body bytes in all (the oldest
# forgotten first).
_KNOWN_BODY: Final = 256 * 1024
_KNOWN_COUNT: Final = 4096
_KNOWN_BYTES: Final = 16 * 1024 * 1024
# Hooks that may make the cache's decision depend on more than a request's name.
_HOOKS: Final = ("edgeproxy_request_received", "edgeproxy_cache_key")


class Known:
    """What the cache made of one exact request: why it bypasses ("" when cacheable) and,
    once a lookup made it, its plan (key included). Valid for its route only."""

    __slots__ = ("plan", "reason", "route")

    def __init__(self, route: object, reason: str) -> None:
        self.route = route
        self.reason = reason
        self.plan: CachePlan | None = None


class KnownRequests:
    """The requests the cache saw, by name (see the module's docstring); ``headers``: the
    names of the headers the key and the plan read, besides the credentials, Cache-Control
    and Content-Type."""

    __slots__ = ("_bytes", "_headers", "_known")

    def __init__(self, headers: Iterable[str]) -> None:
        self._known: dict[tuple[object, ...], Known] = {}
        self._bytes = 0
        self._headers = tuple(
            sorted(set(headers) | CLIENT_CREDENTIAL_HEADERS | {"cache-control", "content-type"})
        )

    def __len__(self) -> int:
        return len(self._known)

    def recognise(
        self,
        ctx: RequestContext,
        active: frozenset[str] | set[str],
        bypass_reason: Callable[[RequestContext], str],
    ) -> Known | None:
        """What the cache made of a request with ``ctx``'s name, or of ``ctx`` itself
        (``bypass_reason`` asked now), remembered; None when it is not remembered: not a
        POST, a body over ``_KNOWN_BODY``, or one of the hooks ``active`` that could make the
        decision depend on more."""
        body = ctx.body
        if ctx.method != "POST" or body is None or len(body) > _KNOWN_BODY:
            return None
        if _HOOKS[0] in active or _HOOKS[1] in active:
            return None
        headers = ctx.headers
        facts = ctx.facts
        route = ctx.route
        name = (
            ctx.target,
            body,
            facts.dialect if facts is not None else None,
            ctx.tenant,
            id(route),
            tuple([(h, tuple(headers.getall(h))) for h in self._headers if h in headers]),
        )
        known = self._known.get(name)
        if known is None or known.route is not route:
            known = Known(route, bypass_reason(ctx))
            self._remember(name, known, len(body))
        return known

    def _remember(self, name: tuple[object, ...], known: Known, size: int) -> None:
        remembered = self._known
        if name in remembered:
            self._bytes -= size
        remembered[name] = known
        self._bytes += size
        while len(remembered) > _KNOWN_COUNT or self._bytes > _KNOWN_BYTES:
            oldest = next(iter(remembered))
            del remembered[oldest]
            body = oldest[1]
            self._bytes -= len(body) if isinstance(body, bytes) else 0

    def plans(self) -> list[CachePlan]:
        """The plans made so far, oldest first (for tests and the curious)."""
        return [known.plan for known in self._known.values() if known.plan is not None]

    def clear(self) -> None:
        self._known.clear()
        self._bytes = 0
