"""What the client's fast path for a response's HEADERS and CONTINUATION frames reads of
them (:func:`edgeproxy._http2.frames.split_frames` offers them to it, as it offers unpadded
DATA frames): the header block past padding and priority, a block gathered across
CONTINUATION frames, and the connection error jh2 makes of a block its HPACK decoder
cannot decode.
"""

from __future__ import annotations

from typing import Final

import jh2.connection
import jh2.exceptions

__all__ = [
    "CONTINUATIONS_KEPT",
    "GatheredBlock",
    "decode_error",
    "header_block",
]

_CONTINUATION: Final = 0x9
_END_HEADERS: Final = 0x4
CONTINUATIONS_KEPT: Final = 64
"""jh2's bound on the CONTINUATION frames of one header block (its frame buffer's)."""
_PADDED: Final = 0x8
_PRIORITY: Final = 0x20


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
