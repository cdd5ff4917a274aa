"""Header rules for a forwarding proxy: hop-by-hop stripping, forwarding and tracing headers."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable, Mapping

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


def strip_hop_by_hop(
    items: Iterable[tuple[str, str]], *, extra: Iterable[str] = ()
) -> list[tuple[str, str]]:
    """Drop hop-by-hop headers, including those the ``Connection`` header names.

    Used on upstream responses, so credential headers go too: no response
    legitimately carries them, and an upstream echoing its own API key must
    not hand it to the client.
    """
    pairs = list(items)
    named = connection_tokens(v for k, v in pairs if k.lower() == "connection")
    drop = HOP_BY_HOP | CLIENT_CREDENTIAL_HEADERS | named | set(extra)
    return [(k, v) for k, v in pairs if k.lower() not in drop]


def request_id(incoming: str | None) -> str:
    """The client's request id when well-formed, else a fresh one."""
    if incoming and _REQUEST_ID_RE.match(incoming):
        return incoming
    return f"{_bits(128):032x}"


def trace_context(incoming: str | None) -> TraceContext:
    """Continue the caller's trace (W3C Trace Context level 1) or start a new one.

    The proxy is a participant: it keeps the trace id and sends a new parent
    id (its own span), so upstream spans hang under the proxy's hop.
    """
    span_id = f"{_bits(64) or 1:016x}"
    if incoming:
        m = _TRACEPARENT_RE.match(incoming.strip())
        if m:
            version, trace_id, parent_id, flags, rest = m.groups()
            valid = (
                version != "ff"
                and not (version == "00" and rest)
                and trace_id != "0" * 32
                and parent_id != "0" * 16
            )
            if valid:
                return TraceContext(trace_id, span_id, parent_id, flags)
    return TraceContext(f"{_bits(128) or 1:032x}", span_id, None, "01")


def append_forwarded_for(existing: str | None, client_ip: str | None) -> str | None:
    """Append the peer address to ``X-Forwarded-For`` (trust decisions belong to admission)."""
    if not client_ip:
        return existing
    return f"{existing}, {client_ip}" if existing else client_ip


def append_via(existing: str | None, http_version: str, pseudonym: str) -> str:
    """Append this hop to ``Via`` (RFC 9110 §7.6.3): ``1.1 edge-sin``."""
    hop = f"{http_version} {pseudonym}"
    return f"{existing}, {hop}" if existing else hop


def header_get(headers: Mapping[str, str] | Iterable[tuple[str, str]], name: str) -> str | None:
    """First value of ``name`` (case-insensitive) in a header list or mapping."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    lname = name.lower()
    for k, v in items:
        if k.lower() == lname:
            return v
    return None
