"""What happened to a request: its outcome, a typed record of its own.

Like Envoy's stream info: the request's facts are fixed at entry
(:class:`~edgeproxy._core.context.RequestFacts`); what then happened to it is
written here, and only by these writers (``tests/test_outcome.py`` holds them to it):

* the pipeline and its obtain path (:mod:`edgeproxy._obtain.record`), from the
  values the stages return: the region, the attempts, a hedge, the time to
  headers, a degradation, the continuations; and the cache stage, its status and
  key at lookup;
* the :class:`~edgeproxy._answer.responder.Responder`, the one writer of
  downstream bytes, from what it sent: the status, the bytes, the first byte's
  time, whether as SSE, the usage of the answer (and the stored response, where
  the edge holds its chain) and why it ended early;
* a WebSocket session (:mod:`edgeproxy._realtime`): its handshake, the region and
  status, its usage; its relay, what it sent and how it ended (``session``).

Hooks, metrics and the access log read it when the request is complete
(``ctx.outcome``, or the same names on the context itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["Continuation", "LimitLevel", "Outcome", "SessionTotals"]


class Continuation(NamedTuple):
    """One try at continuing a stream that broke after tokens were sent."""

    source: str
    """The region (or ``local``) whose leg broke."""
    target: str
    """The region (or ``local``) that took the answer on; ``none`` when none did."""
    outcome: str
    """``continued``, or why not: ``failed``, ``limit``, ``impossible``, ``budget``."""


class LimitLevel(NamedTuple):
    """Where a caller stands against one unit's rate limit once its request was charged:
    the most constrained of its buckets of that unit."""

    limit: int
    """The bucket's size (its burst)."""
    remaining: int
    """What is left in it."""
    reset: float
    """Seconds until it is full again."""


@dataclass(slots=True)
class SessionTotals:
    """What a WebSocket session relayed, written as it goes by the session's relay."""

    messages_in: int = 0
    """Messages from the client relayed to the region."""
    messages_out: int = 0
    """Messages from the region relayed to the client."""
    bytes_in: int = 0
    """Bytes of the client's messages relayed (the region's are the outcome's
    ``bytes_out``)."""
    responses: int = 0
    """Realtime responses completed (``response.done``)."""
    refused: int = 0
    """Client events the proxy answered itself instead of relaying (a token limit)."""
    close_code: int | None = None
    """The close code the client was sent, or the one it sent."""
    ended_by: str | None = None
    """Who ended the session: ``client``, ``region``, ``idle``, ``drain``, ``limit``,
    ``proxy``."""


@dataclass(slots=True)
class Outcome:
    """What happened to one request; see the module's docstring for who writes what."""

    # -- from the values the stages return (the pipeline, the obtain path) ---------------
    region: str | None = None
    """The region that answered, or the latest one tried; a continued stream's, the region
    that took it on."""
    attempts: int = 0
    """Upstream attempts sent, a continuation's legs' included."""
    hedged: bool = False
    """A hedge was sent."""
    upstream_ttfb: float | None = None
    """Seconds from sending the answering attempt to its headers."""
    degraded: str | None = None
    """``stale-cache``, ``local-model``, ``lighter-model`` or ``plugin`` when the ladder
    answered (or the local model continued a stream), else None."""
    continuations: tuple[Continuation, ...] = ()
    """Each try at continuing a broken stream, in order."""
    cache: str | None = None
    """The cache's status: ``HIT``, ``MISS``, ``STALE``, ``COALESCED``, ``BYPASS``,
    ``REFRESH``."""
    cache_key: str | None = None
    """The cache key, when the request had one."""
    # -- from what was sent (the Responder) ----------------------------------------------
    status: int = 0
    """The status sent to the client."""
    bytes_out: int = 0
    """Body bytes sent to the client."""
    first_byte_at: float | None = None
    """When the answer's first byte went (``time.monotonic()``)."""
    response_is_sse: bool = False
    """Whether the answer went as Server-Sent Events."""
    usage: dict[str, Any] | None = None
    """The answer's token counts (a continued stream's summed)."""
    error: str | None = None
    """Why the answer failed or ended early."""
    limits: dict[str, LimitLevel] | None = None
    """The rate limits' levels by unit (``requests``, ``tokens``) after the request was
    charged, for the answer's rate-limit headers (None: no limit, or the route sends
    none)."""
    stored: dict[str, Any] | None = None
    """The stored response a region answered with, as it returned it, where the edge holds
    its chain (a route's ``responses_state = "edge"``)."""
    state: str | None = None
    """``edge`` when the request's chain was rescued by the edge (its input expanded)."""
    session: SessionTotals | None = None
    """A WebSocket session's totals (None for any other request)."""
    # -- the pipeline, on every way out --------------------------------------------------
    finished_at: float | None = None
    """When the request ended."""
