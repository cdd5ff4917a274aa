"""An HTTP/2 connection's writes, at either end: what the protocol engine queued goes out
at the end of the event loop's turn, so that the frames of every stream and reply made
meanwhile share one ``write()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["QueuedWrites"]


class QueuedWrites(asyncio.Protocol):
    """A base class of a connection (an :class:`asyncio.Protocol`): :meth:`flush_soon`
    and :meth:`flush` are the connection's own."""

    # The connection's, set as it starts; ``queued`` is its protocol engine's
    # ``data_to_send`` (what it queued since the last write), kept bound: one call a flush.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport | None
    queued: Callable[[], bytes]
    _flush_scheduled: bool

    def flush_soon(self) -> None:
        """Write what the engine queued at the end of this loop turn."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        data = self.queued()
        transport = self.transport
        if data and transport is not None and not transport.is_closing():
            transport.write(data)
