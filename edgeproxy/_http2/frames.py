"""HTTP/2 frames (RFC 9113 §4) as both ends read and write them: the 9-byte frame header,
a header block as HEADERS and CONTINUATION frames, and incoming bytes cut into frames.

Whole frames go on at once (:func:`split_frames`: DATA the fast way, the rest to the
protocol engine). Of a frame not yet whole, :class:`FrameReader` keeps only what arrived,
and only up to the frame's end: its length is known from its 9-byte header, so a frame
declared longer than SETTINGS_MAX_FRAME_SIZE is refused as that header arrives (RFC 9113
§4.2), never buffered; and a frame arriving a byte at a time is appended to, not copied
whole on every read, nor walked again until it is complete.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

__all__ = [
    "ENDED",
    "FRAME_HEADER",
    "TAKEN",
    "TOO_LARGE",
    "FrameReader",
    "header_frames",
    "split_frames",
]

# The 9-byte frame header (RFC 9113 §4.1): length (24 bits), type, flags, stream id.
FRAME_HEADER: Final = struct.Struct(">BHBBL")
_DATA: Final = 0x0
_HEADERS: Final = 0x1
_CONTINUATION: Final = 0x9
_END_STREAM: Final = 0x1
_END_HEADERS: Final = 0x4
_PADDED: Final = 0x8

TAKEN: Final = 1
"""What a fast path returns for a frame it took (0: declined, the engine takes it)."""
ENDED: Final = -1
"""What :meth:`FrameReader.feed` and a fast path return once the connection ended."""
TOO_LARGE: Final = -2
"""What :meth:`FrameReader.feed` returns for a frame declared past the size limit."""
_HEADER_SIZE: Final = FRAME_HEADER.size
_NO_KIND: Final = -1


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


def split_frames(
    buf: bytes,
    fast_data: Callable[[int, bytes, int, int, int], bool],
    receive: Callable[[bytes], bool],
    fast_headers: Callable[[int, bytes, int, int, int, int], int] | None = None,
) -> int:
    """Walk the complete frames of ``buf``: each unpadded DATA frame is offered to
    ``fast_data(stream_id, buf, start, end, end_stream)`` first and, where given, each
    HEADERS and CONTINUATION frame to ``fast_headers(stream_id, buf, start, end, flags,
    kind)`` (:data:`TAKEN`, 0 or :data:`ENDED`; the client's, for a response's head);
    every other frame (and one they decline) goes to ``receive`` in runs, in the order
    received. Returns where the incomplete rest starts, or -1 once the connection ended.
    Both ends of a connection take DATA the same way."""
    size = len(buf)
    pos = 0
    run = -1  # where the run of frames for the engine started; -1: none
    while size - pos >= 9:
        hi, lo, kind, flags, stream_id = FRAME_HEADER.unpack_from(buf, pos)
        end = pos + 9 + (hi << 16 | lo)
        if end > size:
            break
        if (kind == _DATA and not flags & _PADDED) or (
            fast_headers is not None and (kind == _HEADERS or kind == _CONTINUATION)
        ):
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
                assert fast_headers is not None
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


class FrameReader:
    """One connection's incoming bytes, cut into frames for ``fast_data`` and ``receive``
    (as :func:`split_frames` takes them)."""

    __slots__ = ("_fast_data", "_need", "_pending", "_receive", "kind")

    def __init__(
        self,
        fast_data: Callable[[int, bytes, int, int, int], bool],
        receive: Callable[[bytes], bool],
    ) -> None:
        self._fast_data = fast_data
        self._receive = receive
        self._pending = bytearray()  # the start of a frame not yet whole
        self._need = 0  # what _pending must hold before anything in it can go on
        self.kind = _NO_KIND
        """The type of the frame not yet whole; -1 while its header is not in."""

    @property
    def held(self) -> int:
        """Bytes held of a frame not yet whole."""
        return len(self._pending)

    def feed(self, data: bytes, max_size: int) -> int:
        """Take ``data``; the bytes of whole frames it completed and handed on (0: it only
        added to a frame not yet whole), :data:`ENDED` or :data:`TOO_LARGE` (a frame
        declared longer than ``max_size``)."""
        pending = self._pending
        if pending:
            pending += data
            if len(pending) < self._need:
                return 0
            # Copied once a frame is whole: what was pending is at most one frame, and
            # what comes after it is this read's own.
            data = bytes(pending)
            pending.clear()
        pos = split_frames(data, self._fast_data, self._receive)
        if pos < 0:
            return ENDED
        if pos < len(data):
            pending += memoryview(data)[pos:]
            if len(pending) < _HEADER_SIZE:
                self._need = _HEADER_SIZE
                self.kind = _NO_KIND
            else:
                hi, lo, kind, _, _ = FRAME_HEADER.unpack_from(pending)
                length = hi << 16 | lo
                if length > max_size:
                    pending.clear()
                    return TOO_LARGE
                self._need = _HEADER_SIZE + length
                self.kind = kind
        return pos
