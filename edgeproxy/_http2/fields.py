"""HTTP/2 header fields as RFC 9113 asks both ends to check them (§8.1.1, §8.2, §8.3.2),
per stream, so that a malformed header block is its stream's error and not its
connection's: a field's name and value (requests and responses share the rule) and a
response's whole block. No protocol engine here: plain bytes in, a status, fields and a
Content-Length out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final

from edgeproxy._core.types import Headers

__all__ = [
    "Malformed",
    "field_name",
    "field_value",
    "parse_fields",
    "request_method",
]

# Fields (RFC 9113 §8.2): a name has no upper case, control, non-ASCII
# byte or colon; a value no NUL, CR or LF, nor whitespace at either end.
_BAD_NAME: Final = re.compile(rb"[^\x21-\x39\x3b-\x40\x5b-\x7e]")
_BAD_VALUE: Final = re.compile(rb"[\x00\n\r]|\A[ \t]|[ \t]\Z")
_CONNECTION_SPECIFIC: Final = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)
# Names that passed the check, decoded: a region sends the same few on every answer.
# Bounded, since a peer chooses them: emptied when full.
_GOOD_NAMES: dict[bytes, str] = {}
_GOOD_NAMES_MAX: Final = 512
_BLANK: Final = (32, 9)  # space, tab (as byte values)


def _bad_value(value: bytes) -> bool:
    """``_BAD_VALUE.search(value)`` by byte tests, several times faster than the regex
    (which tries each position): NUL, LF or CR anywhere, space or tab at either end."""
    return bool(
        10 in value
        or 13 in value
        or 0 in value
        or (value and (value[0] in _BLANK or value[-1] in _BLANK))
    )


def request_method(headers: list[tuple[str, str]]) -> str:
    """The ``:method`` of a request's fields as text, "" without one."""
    for name, value in headers:
        if name == ":method":
            return value
        if name[:1] != ":":
            break
    return ""


class Malformed(Exception):
    """A header block that RFC 9113 (§8.1.1, §8.2, §8.3) calls malformed."""


def _show(name: bytes) -> str:
    return repr(name if len(name) <= 40 else name[:40] + b"...")


def field_name(name: bytes) -> str:
    """A regular field's name, decoded; raises :class:`Malformed` for one RFC 9113 §8.2
    forbids (empty, upper case, a control or non-ASCII byte, a colon). Requests and
    responses share the rule."""
    text = _GOOD_NAMES.get(name)
    if text is None:
        if not name or _BAD_NAME.search(name):
            raise Malformed(f"invalid field name {_show(name)}")
        text = name.decode("latin-1")
        if len(_GOOD_NAMES) >= _GOOD_NAMES_MAX:
            _GOOD_NAMES.clear()
        _GOOD_NAMES[name] = text
    return text


def field_value(name: bytes, value: bytes) -> None:
    """Raises :class:`Malformed` for a value RFC 9113 §8.2.1 forbids, or a field that is
    connection-specific (§8.2.2: ``te`` other than ``trailers`` included)."""
    if _bad_value(value):
        raise Malformed(f"invalid value in field {_show(name)}")
    if name in _CONNECTION_SPECIFIC or (name == b"te" and value.lower() != b"trailers"):
        raise Malformed(f"connection-specific field {_show(name)}")


def parse_fields(raw: Iterable[Any], *, trailers: bool) -> tuple[int, Headers, int | None]:
    """Check a response (or trailer) header block; its status, fields and Content-Length.

    Raises :class:`Malformed` for what h2's own inbound validation would
    reject, a ``:status`` that is not three digits in 100..599, 101 (which
    HTTP/2 does not have, RFC 9113 §8.6) and a ``Content-Length`` that is not
    one number.
    """
    status_value: bytes | None = None
    seen_regular = False
    length: int | None = None
    headers: Headers = []
    for name, value in raw:
        if name[:1] == b":":
            if trailers:
                raise Malformed(f"pseudo-header {_show(name)} in trailers")
            if seen_regular:
                raise Malformed(f"pseudo-header {_show(name)} after a regular field")
            if name != b":status":
                raise Malformed(f"pseudo-header {_show(name)} in a response")
            if status_value is not None:
                raise Malformed("more than one :status")
            status_value = value
            continue
        seen_regular = True
        text = field_name(name)
        field_value(name, value)
        if name == b"content-length":
            if not value.isdigit():
                raise Malformed(f"invalid content-length {_show(value)}")
            parsed = int(value)
            if length is not None and parsed != length:
                raise Malformed("conflicting content-length fields")
            length = parsed
        headers.append((text, value.decode("utf-8", "surrogateescape")))
    if trailers:
        return 0, headers, length
    if status_value is None:
        raise Malformed("no :status")
    if len(status_value) != 3 or not status_value.isdigit():
        raise Malformed(f"invalid :status {_show(status_value)}")
    status = int(status_value)
    if not 100 <= status <= 599:
        raise Malformed(f":status {status} is out of range")
    if status == 101:
        raise Malformed("101 (Switching Protocols) does not exist in HTTP/2")
    return status, headers, length
