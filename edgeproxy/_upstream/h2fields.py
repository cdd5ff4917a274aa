"""The fields of an HTTP/2 response, checked per stream as RFC 9113 asks (§8.1.1, §8.2,
§8.3.2), so that a malformed response is that stream's error and not its connection's.
No protocol engine here: plain bytes in, a status, fields and a Content-Length out.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterable
from typing import Any, Final

from edgeproxy._core.types import Headers
from edgeproxy._upstream.h2stream import Stream

__all__ = [
    "FRAME_HEADER",
    "Malformed",
    "field_name",
    "field_value",
    "header_frames",
    "split_frames",
    "parse_fields",
    "request_method",
    "set_response_headers",
    "window_update_due",
]

# Response fields (RFC 9113 §8.2): a name has no upper case, control, non-ASCII
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


# The 9-byte frame header (RFC 9113 §4.1): length (24 bits), type, flags, stream id.
FRAME_HEADER: Final = struct.Struct(">BHBBL")
_HEADERS: Final = 0x1
_CONTINUATION: Final = 0x9
_END_STREAM: Final = 0x1
_END_HEADERS: Final = 0x4


def header_frames(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """An encoded header block as a HEADERS frame, and CONTINUATION frames past
    ``max_frame`` bytes (END_STREAM, if set, on the HEADERS frame: RFC 9113 §6.2)."""
    first = block[:max_frame]
    flags = _END_STREAM if end_stream else 0
    if len(first) == len(block):
        flags |= _END_HEADERS
    size = len(first)
    out = [FRAME_HEADER.pack(size >> 16, size & 0xFFFF, _HEADERS, flags, stream_id), first]
    for start in range(max_frame, len(block), max_frame):
        part = block[start : start + max_frame]
        flags = _END_HEADERS if start + max_frame >= len(block) else 0
        size = len(part)
        out.append(FRAME_HEADER.pack(size >> 16, size & 0xFFFF, _CONTINUATION, flags, stream_id))
        out.append(part)
    return b"".join(out)


_PADDED: Final = 0x8


def split_frames(
    buf: bytes,
    fast_data: Callable[[int, bytes, int, int, int], bool],
    receive: Callable[[bytes], bool],
) -> int:
    """Walk the complete frames of ``buf``: each unpadded DATA frame is offered to
    ``fast_data(stream_id, buf, start, end, end_stream)`` first, every other frame (and a
    DATA frame it declines) goes to ``receive`` in runs, in the order received. Returns
    where the incomplete rest starts, or -1 once ``receive`` returned False (the
    connection ended). Both ends of a connection take DATA the same way."""
    size = len(buf)
    pos = 0
    run = -1  # where the run of frames for the engine started; -1: none
    while size - pos >= 9:
        hi, lo, kind, flags, stream_id = FRAME_HEADER.unpack_from(buf, pos)
        end = pos + 9 + (hi << 16 | lo)
        if end > size:
            break
        if kind == 0 and not flags & _PADDED:
            if run >= 0:
                if not receive(buf[run:pos]):
                    return -1
                run = -1
            if fast_data(stream_id & 0x7FFFFFFF, buf, pos + 9, end, flags & 1):
                pos = end
                continue
        if run < 0:
            run = pos
        pos = end
    if run >= 0 and not receive(buf[run:pos]):
        return -1
    return pos


def window_update_due(window: Any, size: int) -> bool:
    """Whether h2's window manager would send a WINDOW_UPDATE once ``size`` more bytes are
    processed (its own rule, ``WindowManager._maybe_update_window``)."""
    processed = window._bytes_processed + size
    if window.current_window_size == 0 and processed > min(1024, window.max_window_size // 4):
        return True
    return bool(processed >= window.max_window_size // 2)


def request_method(headers: list[tuple[str, str]]) -> str:
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


def set_response_headers(stream: Stream, raw: list[Any]) -> None:
    """Take the final response's header block; raises :class:`Malformed`."""
    status, headers, length = parse_fields(raw, trailers=False)
    if status < 200:
        raise Malformed(f"informational :status {status} where the final one was due")
    stream.headers = headers
    stream.status = status
    # A response to HEAD, a 204 and a 304 have no content whatever
    # Content-Length says (RFC 9110 §6.4.1).
    stream.expected_length = 0 if stream.head or status in (204, 304) else length
