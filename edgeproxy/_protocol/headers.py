"""Header rules for a forwarding proxy: hop-by-hop stripping, forwarding and tracing headers."""

from __future__ import annotations

import functools
import os
import random
import re
from collections.abc import Callable, Iterable, Sequence

from edgeproxy._core.config.routes import PASSABLE_RESPONSE_HEADERS
from edgeproxy._core.types import TraceContext

# RFC 9110 §7.6.1 connection-specific fields, plus the legacy ones that
# proxies in the wild still send. HTTP/2 forbids all of them (RFC 9113 §8.2.2).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)

# Client credentials are not forwarded unless configured: regions get their own.
CLIENT_CREDENTIAL_HEADERS = frozenset({"authorization", "api-key", "x-api-key"})

# Forwarded request headers that select what a region answers (the organization or
# project billed and whose fine-tunes it sees, beta features, the Messages API version):
# part of every POST's cache key. ``[cache] vary_headers`` adds a deployment's own.
ANSWER_HEADERS = frozenset(
    {"openai-organization", "openai-project", "openai-beta", "anthropic-version", "anthropic-beta"}
)

# Set by the proxy alone; a client must not be able to forge them.
REQUEST_OWNED = frozenset({"host", "content-length", "x-forwarded-proto", "via", "traceparent"})

# The proxy's own response-control namespace.
EDGEPROXY_PREFIX = "x-edgeproxy-"

# Ids need to be unique, not secret: a PRNG seeded from the OS at import is
# ~20x cheaper per request than uuid4()/os.urandom (a syscall each).
_random = random.Random()
_bits = _random.getrandbits
# Forked workers must not repeat each other's ids.
os.register_at_fork(after_in_child=_random.seed)

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def connection_tokens(values: Iterable[str]) -> set[str]:
    """Header names listed in ``Connection`` values; they are hop-by-hop too."""
    tokens: set[str] = set()
    for value in values:
        for token in value.split(","):
            token = token.strip().lower()
            if token:
                tokens.add(token)
    return tokens


# Each listener sends its own (as nginx does): a region's Server names its software and
# version, and a second Date or Server beside the listener's would be a duplicate. The
# relay sends its own X-Request-Id (the client's, or one it made).
REGION_OWNED = frozenset({"server", "date", "x-request-id"})

_RESPONSE_DROP = HOP_BY_HOP | CLIENT_CREDENTIAL_HEADERS | REGION_OWNED | PASSABLE_RESPONSE_HEADERS


@functools.lru_cache(maxsize=64)
def _drop_passing(passed: tuple[str, ...]) -> frozenset[str]:
    return _RESPONSE_DROP - frozenset(passed)


def strip_hop_by_hop(
    items: Iterable[tuple[str, str]], *, extra: Iterable[str] = (), passed: Sequence[str] = ()
) -> list[tuple[str, str]]:
    """A region's response headers as the proxy may relay them: the one filter of every
    answer from a region, streamed, stored in the cache or refreshed in the background.

    Hop-by-hop headers go, including those the ``Connection`` header names. So do
    credential headers (no response legitimately carries them, and an upstream echoing its
    own API key must not hand it to the client), ``Server``, ``Date`` and ``X-Request-Id``
    (see :data:`REGION_OWNED`) and every ``X-Edgeproxy-*`` name: those are the proxy's,
    added after this filter. The policy and load-report headers of
    :data:`~edgeproxy._core.config.routes.PASSABLE_RESPONSE_HEADERS` go too, but for the
    names in ``passed`` (a route's ``pass_response_headers``).
    """
    drop = _drop_passing(tuple(passed)) if passed else _RESPONSE_DROP
    prefix = EDGEPROXY_PREFIX
    # One pass for the usual answer; a second only when Connection names more headers.
    out: list[tuple[str, str]] = []
    named: list[str] = []
    for pair in items:
        lname = pair[0].lower()
        if lname in drop or lname.startswith(prefix):
            if lname == "connection":
                named.append(pair[1])
            continue
        out.append(pair)
    # "Connection: keep-alive" (every HTTP/1.1 answer of nginx) names a header already
    # dropped: a second pass only for names not dropped yet.
    more = (connection_tokens(named) - drop if named else set()) | set(extra)
    if more:
        out = [pair for pair in out if pair[0].lower() not in more]
    return out


def request_id(incoming: str | None) -> str:
    """The client's request id when well-formed, else a fresh one."""
    if incoming and _REQUEST_ID_RE.match(incoming):
        return incoming
    return _bits(128).to_bytes(16, "big").hex()


# Trace contexts are built slot by slot: the frozen dataclass's own __init__ goes through
# object.__setattr__ once a field, about half the cost of a trace context.
_new_trace = object.__new__


def _slot_setter(name: str) -> Callable[[TraceContext, object], None]:
    setter: Callable[[TraceContext, object], None] = TraceContext.__dict__[name].__set__
    return setter


_set_trace_id = _slot_setter("trace_id")
_set_span_id = _slot_setter("span_id")
_set_parent_id = _slot_setter("parent_id")
_set_flags = _slot_setter("flags")


def _trace(trace_id: str, span_id: str, parent_id: str | None, flags: str) -> TraceContext:
    trace = _new_trace(TraceContext)
    _set_trace_id(trace, trace_id)
    _set_span_id(trace, span_id)
    _set_parent_id(trace, parent_id)
    _set_flags(trace, flags)
    return trace


def _fresh_ids(ids: str | None = None) -> tuple[str, str]:
    """A new trace id (32 hex digits) and span id (16), neither all zeros (W3C), from
    ``ids`` (48 random hex digits) when given."""
    if ids is None:
        ids = _bits(192).to_bytes(24, "big").hex()
    trace_id, span_id = ids[:32], ids[32:]
    if trace_id == _ZERO_TRACE:
        trace_id = trace_id[:-1] + "1"
    if span_id == _ZERO_SPAN:
        span_id = span_id[:-1] + "1"
    return trace_id, span_id


_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


def request_ids(incoming_id: str | None, incoming_trace: str | None) -> tuple[str, TraceContext]:
    """:func:`request_id` and :func:`trace_context` of a request, from one draw of
    randomness (once a request, at entry)."""
    ids = _bits(320).to_bytes(40, "big").hex()
    if not (incoming_id and _REQUEST_ID_RE.match(incoming_id)):
        incoming_id = ids[:32]
    return incoming_id, trace_context(incoming_trace, ids[32:])


def trace_context(incoming: str | None, ids: str | None = None) -> TraceContext:
    """Continue the caller's trace (W3C Trace Context level 1) or start a new one.

    The proxy is a participant: it keeps the trace id and sends a new parent
    id (its own span), so upstream spans hang under the proxy's hop. ``ids``: 48 random
    hex digits to take the new ids from (drawn here by default).
    """
    trace_id, span_id = _fresh_ids(ids)
    if incoming:
        m = _TRACEPARENT_RE.match(incoming.strip())
        if m:
            version, caller_trace, parent_id, flags, rest = m.groups()
            valid = (
                version != "ff"
                and not (version == "00" and rest)
                and caller_trace != _ZERO_TRACE
                and parent_id != _ZERO_SPAN
            )
            if valid:
                return _trace(caller_trace, span_id, parent_id, flags)
    return _trace(trace_id, span_id, None, "01")


def append_forwarded_for(existing: str | None, client_ip: str | None) -> str | None:
    """Append the peer address to ``X-Forwarded-For`` (trust decisions belong to admission)."""
    if not client_ip:
        return existing
    return f"{existing}, {client_ip}" if existing else client_ip


def append_via(existing: str | None, http_version: str, pseudonym: str) -> str:
    """Append this hop to ``Via`` (RFC 9110 §7.6.3): ``1.1 edge-sin``."""
    hop = f"{http_version} {pseudonym}"
    return f"{existing}, {hop}" if existing else hop
