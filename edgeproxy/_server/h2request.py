"""What the HTTP/2 listener checks of a request before it becomes a stream to serve: its
header block (RFC 9113 §8.2, §8.3.1), its size against ``[limits]`` (431, as over
HTTP/1.1), and an HTTP/1.1 head asking to upgrade to h2c (RFC 7540 §3.2), whose
``HTTP2-Settings`` is checked before any 101 goes out. Plain bytes in, no protocol engine.
"""

from __future__ import annotations

import base64
import binascii
import struct
from typing import Final

from multidict import CIMultiDict, CIMultiDictProxy

from edgeproxy._core.config import LimitsConfig
from edgeproxy._core.errors import ProxyError
from edgeproxy._http2.fields import Malformed, field_name, field_value

__all__ = [
    "BadUpgrade",
    "head_refusal",
    "header_list_size",
    "request_fields",
    "upgrade_request",
]

_PSEUDO: Final = frozenset({b":method", b":scheme", b":authority", b":path", b":protocol"})
_UPGRADE_DROPPED: Final = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"upgrade", b"http2-settings", b"host"}
)
# What RFC 9113 §4.3.1 counts of each field beside its name and value.
_FIELD_OVERHEAD: Final = 32
_SETTING: Final = struct.Struct(">HL")
# SETTINGS values a peer may not send (RFC 9113 §6.5.2): code -> (least, most).
_SETTING_RANGES: Final = {
    0x2: (0, 1),  # ENABLE_PUSH
    0x4: (0, 2**31 - 1),  # INITIAL_WINDOW_SIZE
    0x5: (2**14, 2**24 - 1),  # MAX_FRAME_SIZE
    0x8: (0, 1),  # ENABLE_CONNECT_PROTOCOL (RFC 8441 §3)
}


def header_list_size(limits: LimitsConfig) -> int:
    """SETTINGS_MAX_HEADER_LIST_SIZE: what HTTP/1.1 takes at most, ``max_headers``
    fields of ``max_header_size`` bytes, capped to what the setting can say."""
    return min(limits.max_headers * limits.max_header_size, 2**32 - 1)


def head_refusal(raw: list[tuple[bytes, bytes]], limits: LimitsConfig) -> ProxyError | None:
    """A 431 for a header block past ``[limits]`` (the fields' count, one's name or value,
    the list's size as SETTINGS_MAX_HEADER_LIST_SIZE counts it); None when it is within."""
    field_max = limits.max_header_size
    fields = 0
    size = 0
    too_long = False
    for name, value in raw:
        size += len(name) + len(value) + _FIELD_OVERHEAD
        if name[:1] != b":":
            fields += 1
            too_long = too_long or len(name) > field_max or len(value) > field_max
    if fields > limits.max_headers:
        message = "Too many header fields."
    elif too_long or size > header_list_size(limits):
        message = "Request header fields too large."
    else:
        return None
    return ProxyError(431, "invalid_request_error", message, code="headers_too_large")


def request_fields(
    raw: list[tuple[bytes, bytes]],
) -> tuple[str, str, str, CIMultiDictProxy[str], int | None, str | None]:
    """A request header block checked as RFC 9113 §8.2 and §8.3.1 ask: its method, scheme,
    target, fields (``:authority`` as ``Host``, cookies joined), content-length, and the
    ``:protocol`` of an extended CONNECT (RFC 8441 §4; None for any other request).
    Raises :class:`Malformed`."""
    pseudo: dict[bytes, bytes] = {}
    fields: CIMultiDict[str] = CIMultiDict()
    cookies: list[str] = []
    length: int | None = None
    regular = False
    for name, value in raw:
        if name[:1] == b":":
            if regular:
                raise Malformed(f"pseudo-header {name!r} after a regular field")
            if name not in _PSEUDO:
                raise Malformed(f"pseudo-header {name[:40]!r} is not a request's")
            if name in pseudo:
                raise Malformed(f"more than one {name.decode()}")
            pseudo[name] = value
            continue
        regular = True
        text = field_name(name)
        field_value(name, value)
        decoded = value.decode("utf-8", "surrogateescape")
        if name == b"content-length":
            if not value.isdigit():
                raise Malformed("invalid content-length")
            if length is not None and int(value) != length:
                raise Malformed("conflicting content-length fields")
            length = int(value)
            if "content-length" in fields:
                continue
        elif name == b"cookie":
            cookies.append(decoded)  # RFC 9113 §8.2.3: one field again, joined
            continue
        fields.add(text, decoded)
    method = pseudo.get(b":method")
    if not method:
        raise Malformed("no :method")
    authority = pseudo.get(b":authority")
    for value in pseudo.values():
        field_value(b":", value)
    protocol = pseudo.get(b":protocol")
    if protocol is not None:
        # The listener advertises SETTINGS_ENABLE_CONNECT_PROTOCOL, so this is an extended
        # CONNECT: a target like any request's, and nothing else may carry it.
        path = pseudo.get(b":path")
        if method != b"CONNECT" or not path or b":scheme" not in pseudo or not authority:
            raise Malformed(":protocol outside an extended CONNECT with :scheme, :path, :authority")
        if not protocol:
            raise Malformed("an empty :protocol")
        target = path.decode("latin-1")
    elif method == b"CONNECT":
        if b":scheme" in pseudo or b":path" in pseudo or not authority:
            raise Malformed("a CONNECT request has :authority alone")
        target = authority.decode("latin-1")
    else:
        path = pseudo.get(b":path")
        if not path or b":scheme" not in pseudo:
            raise Malformed("no :scheme or :path")
        target = path.decode("latin-1")
    if authority is not None:
        host = fields.get("host")
        text = authority.decode("utf-8", "surrogateescape")
        if host is not None and host != text:
            raise Malformed(":authority and host differ")
        if host is None:
            fields["Host"] = text
    if cookies:
        fields["Cookie"] = "; ".join(cookies)
    return (
        method.decode("latin-1"),
        pseudo.get(b":scheme", b"").decode("latin-1"),
        target,
        CIMultiDictProxy(fields),
        length,
        protocol.decode("latin-1") if protocol is not None else None,
    )


# -- the h2c upgrade ------------------------------------------------------------------------


class BadUpgrade(Exception):
    """An upgrade to h2c whose ``HTTP2-Settings`` is not a SETTINGS payload a server may
    take: answered 400, never 101 (the switch could not be undone)."""


def _settings_problem(value: bytes) -> str | None:
    try:
        # Strict: the lenient decoder drops bytes outside the alphabet.
        decoded = base64.b64decode(value + b"=" * (-len(value) % 4), b"-_", validate=True)
    except (binascii.Error, ValueError):
        return "HTTP2-Settings is not base64url"
    if len(decoded) % _SETTING.size:
        return "HTTP2-Settings is not whole SETTINGS entries"
    for code, setting in _SETTING.iter_unpack(decoded):
        least, most = _SETTING_RANGES.get(code, (0, 2**32 - 1))
        if not least <= setting <= most:
            return f"HTTP2-Settings has setting {code:#x} out of its range"
    return None


def upgrade_request(head: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]] | None:
    """An HTTP/1.1 request head that asks, plainly, to upgrade to h2c: its
    ``HTTP2-Settings`` and its header block as HTTP/2 fields. None for any other head, or
    one with anything unusual, which the HTTP/1.1 handler then answers (it ignores
    ``Upgrade``): a body, a folded or odd line, several values where one is allowed.
    Raises :class:`BadUpgrade` for an upgrade whose ``HTTP2-Settings`` is bad."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1" or not parts[1].startswith(b"/"):
        return None
    method, target = parts[0], parts[1]
    if not method.isalpha() or not method.isupper() or method == b"CONNECT":
        return None
    fields: list[tuple[bytes, bytes]] = []
    seen: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or b"\n" in line or b"\r" in line:
            return None
        name = name.lower()
        value = value.strip(b" \t")
        if name in seen and name in (b"upgrade", b"http2-settings", b"host", b"connection"):
            return None
        seen[name] = value
        if name in (b"content-length", b"transfer-encoding") and value != b"0":
            return None
        if name not in _UPGRADE_DROPPED:
            fields.append((name, value))
    upgrade = seen.get(b"upgrade", b"").lower()
    connection = {t.strip() for t in seen.get(b"connection", b"").lower().split(b",")}
    settings = seen.get(b"http2-settings")
    if upgrade != b"h2c" or settings is None or not {b"upgrade", b"http2-settings"} <= connection:
        return None
    host = seen.get(b"host")
    if host is None:
        return None
    problem = _settings_problem(settings)
    if problem is not None:
        raise BadUpgrade(problem)
    pseudo = [(b":method", method), (b":scheme", b"http"), (b":authority", host)]
    return settings, [*pseudo, (b":path", target), *fields]
