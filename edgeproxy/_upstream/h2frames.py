"""A client connection's incoming bytes cut into frames, as
:func:`edgeproxy._http2.frames.split_frames` cuts them, except that a response's HEADERS
and CONTINUATION frames are offered to a fast path too, as unpadded DATA frames are: the frames of a
whole response can then pass without the protocol engine; and the connection error jh2
makes of a header block its HPACK decoder cannot decode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import jh2.connection
import jh2.exceptions

from edgeproxy._http2.frames import FRAME_HEADER

__all__ = [
    "CONTINUATIONS_KEPT",
    "ENDED",
    "TAKEN",
    "GatheredBlock",
    "decode_error",
    "header_block",
    "split_response_frames",
]

TAKEN: Final = 1
"""What a fast path returns for a frame it took (0: declined, the engine takes it)."""
ENDED: Final = -1
"""What a fast path returns once it ended the connection."""

_DATA: Final = 0x0
_HEADERS: Final = 0x1
_CONTINUATION: Final = 0x9
_END_HEADERS: Final = 0x4
CONTINUATIONS_KEPT: Final = 64
"""jh2's bound on the CONTINUATION frames of one header block (its frame buffer's)."""
_PADDED: Final = 0x8
_PRIORITY: Final = 0x20


def split_response_frames(
    buf: bytes,
    fast_data: Callable[[int, bytes, int, int, int], bool],
    fast_headers: Callable[[int, bytes, int, int, int, int], int],
    receive: Callable[[bytes], bool],
) -> int:
    """Walk the complete frames of ``buf``: an unpadded DATA frame is offered to
    ``fast_data(stream_id, buf, start, end, end_stream)``, a HEADERS frame to
    ``fast_headers(stream_id, buf, start, end, flags, kind)`` (:data:`TAKEN`, 0 or
    :data:`ENDED`), every other frame (and one they decline) goes to ``receive`` in runs,
    in the order received. Returns where the incomplete rest starts, or -1 once the
    connection ended."""
    size = len(buf)
    pos = 0
    run = -1  # where the run of frames for the engine started; -1: none
    while size - pos >= 9:
        hi, lo, kind, flags, stream_id = FRAME_HEADER.unpack_from(buf, pos)
        end = pos + 9 + (hi << 16 | lo)
        if end > size:
            break
        if kind == _HEADERS or kind == _CONTINUATION or (kind == _DATA and not flags & _PADDED):
            if run >= 0:
                if not receive(buf[run:pos]):
                    return -1
                run = -1
            stream_id &= 0x7FFFFFFF
            if kind == _DATA:
                if fast_data(stream_id, buf, pos + 9, end, flags & 1):
                    pos = end
                    continue
            else:
                taken = fast_headers(stream_id, buf, pos + 9, end, flags, kind)
                if taken == ENDED:
                    return -1
                if taken:
                    pos = end
                    continue
        if run < 0:
            run = pos
        pos = end
    if run >= 0 and not receive(buf[run:pos]):
        return -1
    return pos


def header_block(stream_id: int, buf: bytes, start: int, end: int, flags: int) -> bytes | None:
    """The header block fragment of the HEADERS frame ``buf[start:end]``, its padding and
    priority fields taken off; None where the engine must take the frame: padding
    longer than the frame allows, a truncated priority field, or a stream made to depend
    on itself (each a connection error, RFC 9113 §6.2, §5.3.1)."""
    if flags & _PADDED:
        if start == end:
            return None
        pad = buf[start]
        start += 1
        # The engine's rule: the padding shorter than what follows its length byte.
        if pad >= end - start:
            return None
        end -= pad
    if flags & _PRIORITY:
        if end - start < 5:
            return None
        if int.from_bytes(buf[start : start + 4], "big") & 0x7FFFFFFF == stream_id:
            return None
        start += 5
    return buf[start:end]


def decode_error(exc: Exception) -> jh2.exceptions.ProtocolError:
    """The connection error jh2 makes of what its HPACK decoder raised (its
    ``_decode_headers``); what jh2 would let through is re-raised."""
    if isinstance(exc, jh2.connection.OversizedHeaderListError):
        # A header list past our SETTINGS_MAX_HEADER_LIST_SIZE: an HPACK bomb.
        return jh2.exceptions.DenialOfServiceError(f"Oversized header block: {exc}")
    if isinstance(
        exc, jh2.connection.HPACKError | IndexError | TypeError | UnicodeDecodeError
    ) or "index out of bounds" in str(exc):
        return jh2.exceptions.ProtocolError(f"Error decoding header block: {exc}")
    raise exc


class GatheredBlock:
    """A response's header block arriving in CONTINUATION frames, gathered until the one
    with END_HEADERS (RFC 9113 §6.10): until then no other frame may come, as jh2's frame
    buffer requires too, and no more than its number of CONTINUATION frames."""

    __slots__ = ("end_stream", "parts", "stream_id")

    def __init__(self, stream_id: int, first: bytes, end_stream: int) -> None:
        self.stream_id = stream_id
        self.parts = [first]
        self.end_stream = end_stream  # the HEADERS frame's END_STREAM

    def add(
        self, stream_id: int, kind: int, buf: bytes, start: int, end: int, flags: int, size: int
    ) -> bytes | jh2.exceptions.ProtocolError | None:
        """The whole block once the frame ``buf[start:end]`` ends it, None while more is
        due, or the connection error jh2 makes of a frame that may not come now (``size``:
        the largest frame allowed)."""
        if kind != _CONTINUATION or stream_id != self.stream_id:
            return jh2.exceptions.ProtocolError("Invalid frame during header block.")
        if end - start > size:
            return jh2.exceptions.FrameTooLargeError(
                f"Received overlong frame: length {end - start}"
            )
        parts = self.parts
        parts.append(buf[start:end])
        if len(parts) > CONTINUATIONS_KEPT:
            return jh2.exceptions.ProtocolError("Too many continuation frames received.")
        if not flags & _END_HEADERS:
            return None
        return b"".join(parts)
