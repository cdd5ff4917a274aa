"""The limits of an HTTP/2 listener connection (:mod:`edgeproxy._server.h2server`) beyond
jh2's: abuse by cost (rapid reset), floods of control frames, the deadlines of a header
block and of a frame not yet whole, and the idle timeout.

:class:`H2Limits` is a part of :class:`~edgeproxy._server.h2connection.H2Connection`, its
base class: the methods are the connection's own, called as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Final

import jh2.errors
import jh2.exceptions

from edgeproxy._http2.frames import FrameReader
from edgeproxy._server.guard import ConnectionGuard
from edgeproxy._server.h2serverengine import ServerEngine

__all__ = ["H2Limits"]

logger = logging.getLogger("edgeproxy")

_CONTROL_WINDOW: Final = 10.0
# The rapid-reset count halves every this many seconds: a long-lived browser connection
# whose user closes chats now and then never reaches the limit; a burst does.
_RESET_HALF_LIFE: Final = 30.0
_WINDOW_UPDATES_PER_EARNED: Final = 4
_CALM: Final = jh2.errors.ErrorCodes.ENHANCE_YOUR_CALM
_FRAME_SIZE_ERROR: Final = jh2.errors.ErrorCodes.FRAME_SIZE_ERROR
_DATA: Final = 0x0


class H2Limits:
    """What a connection's client may cost, and how long it may leave things unfinished."""

    # The connection's, set as it starts (H2Connection.__init__).
    h2: ServerEngine
    guard: ConnectionGuard
    loop: asyncio.AbstractEventLoop
    ip: str
    closing: bool
    last_stream: int
    _reader: FrameReader
    _window_start: float
    _controls: int
    _window_updates: int
    _earned: int
    _cost: float
    _cost_at: float
    _block_since: float | None
    _frame_since: float | None
    _timer: asyncio.TimerHandle | None
    _idle_since: float | None

    if TYPE_CHECKING:

        def close(self) -> None: ...

    # -- abuse ------------------------------------------------------------------------------

    def _spend(self) -> None:
        """One stream the proxy refused, or the client cancelled, before its answer ended."""
        now = self.loop.time()
        self._cost = self._cost * 0.5 ** ((now - self._cost_at) / _RESET_HALF_LIFE) + 1
        self._cost_at = now

    def _check_abuse(self) -> None:
        limits = self.guard.limits
        if self._cost > limits.h2_max_premature_resets:
            self.guard.h2_rapid_resets += 1
            self._abuse("too many streams cancelled or refused before their answer (rapid reset)")
            return
        now = self.loop.time()
        if now - self._window_start >= _CONTROL_WINDOW:
            self._window_start = now
            self._controls = self._window_updates = self._earned = 0
            return
        budget = limits.h2_max_control_frames
        if self._controls > budget or (
            self._window_updates > budget + _WINDOW_UPDATES_PER_EARNED * self._earned
        ):
            self.guard.h2_control_floods += 1
            self._abuse("too many control, WINDOW_UPDATE, empty or unknown frames")

    def _frame_too_large(self) -> None:
        """A frame declared past SETTINGS_MAX_FRAME_SIZE (RFC 9113 §4.2): the connection's
        error, decided on its header, before any of the frame is kept."""
        self.guard.h2_protocol_errors += 1
        logger.info("HTTP/2 client %s sent a frame past the size limit; closing", self.ip)
        with contextlib.suppress(jh2.exceptions.ProtocolError):
            self.h2.close_connection(error_code=_FRAME_SIZE_ERROR, last_stream_id=self.last_stream)
        self.close()

    def _abuse(self, reason: str) -> None:
        logger.warning("HTTP/2 client %s: %s; closing", self.ip, reason)
        with contextlib.suppress(jh2.exceptions.ProtocolError):
            self.h2.close_connection(error_code=_CALM, last_stream_id=self.last_stream)
        self.close()

    # -- deadlines ------------------------------------------------------------------------

    def _partial(self, walked: int) -> None:
        """The deadlines of what is not yet whole: a header block waiting for its
        CONTINUATION frames, from its first frame; a frame (or the preface), from its first
        byte (``walked``: whole frames came in this read, so a new one started in it)."""
        h2 = self.h2
        now: float | None = None
        if h2.incoming_buffer._headers_buffer:
            if self._block_since is None:
                self._block_since = now = self.loop.time()
        else:
            self._block_since = None
        if self._reader.held or h2.incoming_buffer._preamble_len:
            if walked or self._frame_since is None:
                self._frame_since = now if now is not None else self.loop.time()
        else:
            self._frame_since = None

    def _arm(self) -> None:
        self._timer = self.loop.call_later(1.0, self._tick)

    def _tick(self) -> None:
        """Once a second: the deadlines of a header block and a frame, and the idle
        timeout."""
        self._timer = None
        if self.closing:
            return
        limits = self.guard.limits
        now = self.loop.time()
        if self._block_since is not None and now - self._block_since >= limits.header_timeout:
            self.guard.header_timeouts += 1
            self.close()
            return
        since = self._frame_since
        if since is not None:
            # The frames that must come whole quickly are small; a DATA frame is part of a
            # body, whose stall bound it gets.
            data = self._reader.kind == _DATA
            if now - since >= (limits.body_timeout if data else limits.header_timeout):
                if data:
                    self.guard.body_timeouts += 1
                else:
                    self.guard.header_timeouts += 1
                logger.info("HTTP/2 client %s left a frame unfinished; closing", self.ip)
                self.close()
                return
        idle = self._idle_since
        if idle is not None and now - idle >= limits.keepalive_timeout:
            self.close()
            return
        self._arm()
