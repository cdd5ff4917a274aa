"""The bytes an HTTP/2 client sends, as frames, for the listener's connection.

Whole frames go on at once (:func:`~edgeproxy._upstream.h2fields.split_frames`: DATA the
fast way, the rest to the protocol engine). Of a frame not yet whole only what arrived is
kept, and only up to the frame's end: its length is known from its 9-byte header, so a
frame declared longer than SETTINGS_MAX_FRAME_SIZE is refused as that header arrives
(RFC 9113 §4.2), never buffered; and a frame arriving a byte at a time is appended to, not
copied whole on every read, nor walked again until it is complete.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from edgeproxy._upstream.h2fields import FRAME_HEADER, split_frames

__all__ = ["ENDED", "TOO_LARGE", "FrameReader"]

ENDED: Final = -1
"""What :meth:`FrameReader.feed` returns once the engine ended the connection."""
TOO_LARGE: Final = -2
"""What :meth:`FrameReader.feed` returns for a frame declared past the size limit."""
_HEADER_SIZE: Final = FRAME_HEADER.size
_NO_KIND: Final = -1


class FrameReader:
    """One connection's incoming bytes, cut into frames for ``fast_data`` and ``receive``
    (as :func:`~edgeproxy._upstream.h2fields.split_frames` takes them)."""

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
