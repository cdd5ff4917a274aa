"""One WebSocket session relayed between its client and its region.

Two pumps, one each way, each reading a whole message and sending it on before it reads
the next: a side that stops reading stops the other side's pump, whose reads stop, and
TCP pushes back on the sender. What the session holds is bounded by one message each way
plus the sockets' own send buffers (``[websocket] buffer``). A watch beside them pings
both sides, ends an idle session and carries out a drain.

The session ends at the first of: the client closing (the region is closed too), the
region closing or failing (the client gets its close code, or 1011 with an ``error``
event saying the region failed), the idle timeout (1001), a drain (1001 at shutdown, 1012
at a reload, once the response under way is done), or its task cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from edgeproxy._core.config import WebSocketConfig
from edgeproxy._core.outcome import Outcome, SessionTotals
from edgeproxy._core.websocket import (
    GOING_AWAY,
    INTERNAL_ERROR,
    MESSAGE_TOO_BIG,
    NORMAL,
    Closed,
    WebSocket,
)
from edgeproxy._protocol.realtime import error_event
from edgeproxy._realtime.meter import Meter

__all__ = ["Drain", "Relay"]

# Close codes a peer may send in a close frame (RFC 6455 §7.4): the region's own, when it
# closes with one of these, go to the client as they are.
_SENDABLE: Final = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013})


def _sendable(code: int) -> bool:
    return code in _SENDABLE or 3000 <= code <= 4999


# Sessions whose sides are being closed (see Relay.run), held until they are.
_ENDING: set[asyncio.Task[None]] = set()


@dataclass(frozen=True, slots=True)
class Drain:
    """Why open sessions are being closed: the close code and the error event's words."""

    code: int
    reason: str
    message: str


@dataclass(slots=True)
class _End:
    by: str
    code: int
    reason: str
    event: str | None = None  # an error event for the client, before its close


class Relay:
    """One session's pumps and watch (see the module's docstring)."""

    def __init__(
        self,
        client: WebSocket,
        region: WebSocket,
        outcome: Outcome,
        config: WebSocketConfig,
        meter: Meter | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.region = region
        self.outcome = outcome
        self.totals = outcome.session = outcome.session or SessionTotals()
        self.config = config
        self.meter = meter
        self._clock = clock
        self.active_at = clock()
        self._end: _End | None = None
        self._ended = asyncio.Event()
        self._drain: Drain | None = None
        self._wake = asyncio.Event()

    # -- control -----------------------------------------------------------------

    def drain(self, drain: Drain) -> None:
        """End the session once the response under way is done (at once when none is)."""
        if self._drain is None:
            self._drain = drain
            self._wake.set()
            self._drain_if_idle()

    def _drain_if_idle(self) -> None:
        drain = self._drain
        if drain is not None and (self.meter is None or not self.meter.busy):
            self._finish(
                _End(
                    "drain", drain.code, drain.reason, self._event(drain.message, "session_closing")
                )
            )

    def _event(self, message: str, code: str) -> str | None:
        return error_event(message, code=code) if self.meter is not None else None

    def _finish(self, end: _End) -> None:
        if self._end is None:
            self._end = end
            self._ended.set()

    # -- the session ---------------------------------------------------------------

    async def run(self) -> None:
        """Relay until the session ends, then close both sides."""
        tasks = [
            asyncio.create_task(self._upward()),
            asyncio.create_task(self._downward()),
            asyncio.create_task(self._watch()),
        ]
        try:
            await self._ended.wait()
        except asyncio.CancelledError:
            # Cut (a drain's grace is over, the proxy stops, the client's connection went):
            # the client hears why, where it still can.
            drain = self._drain
            message = drain.message if drain is not None else "the proxy is shutting down"
            self._finish(
                _End(
                    "drain" if drain is not None else "proxy",
                    drain.code if drain is not None else GOING_AWAY,
                    drain.reason if drain is not None else "the proxy is shutting down",
                    self._event(message, "session_closing"),
                )
            )
            raise
        finally:
            # The sides are closed in a task of their own, which a second cancellation
            # cannot cut short: a side left open would hold its connection (and a region's
            # session) until the peer gave up. Each close is bounded.
            ending = asyncio.get_running_loop().create_task(self._end_sides(tasks))
            _ENDING.add(ending)
            ending.add_done_callback(_ENDING.discard)
            await asyncio.shield(ending)

    async def _end_sides(self, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.meter is not None:
            self.meter.abandon()
        await self._close()

    async def _close(self) -> None:
        end = self._end
        assert end is not None
        totals = self.totals
        totals.close_code = end.code
        totals.ended_by = end.by
        if self.outcome.error is None and end.by not in ("client",):
            self.outcome.error = end.reason or None
        client, region = self.client, self.region
        if end.by != "client" and end.event is not None:
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                async with asyncio.timeout(1.0):
                    await client.send(end.event)
        await asyncio.gather(
            client.close(end.code, end.reason),
            region.close(NORMAL if end.by != "region" else end.code, ""),
            return_exceptions=True,
        )

    async def _upward(self) -> None:
        """Client to region."""
        client, region, totals, meter = self.client, self.region, self.totals, self.meter
        while True:
            message = await client.receive()
            if type(message) is Closed:
                code = message.code
                self._finish(_End("client", code if _sendable(code) else NORMAL, message.reason))
                return
            assert not isinstance(message, Closed)
            self.active_at = self._clock()
            if meter is not None:
                check = meter.from_client(message)
                if check is not None:
                    refusal = await check
                    if refusal is not None:
                        totals.refused += 1
                        await self._to_client(refusal)
                        continue
            try:
                await region.send(message)
            except ConnectionError:
                self._finish(self._region_failed("the region's connection was lost"))
                return
            totals.messages_in += 1
            totals.bytes_in += len(message)

    async def _downward(self) -> None:
        """Region to client."""
        region, meter = self.region, self.meter
        while True:
            message = await region.receive()
            if type(message) is Closed:
                code = message.code
                if code == MESSAGE_TOO_BIG:
                    self._finish(
                        self._region_failed("the region sent a message over max_message_size")
                    )
                elif code == NORMAL or 3000 <= code <= 4999:
                    # The region's own end (an application's code): passed on as it is.
                    self._finish(_End("region", code, message.reason))
                elif _sendable(code):
                    # The region went away or failed, saying so: its code, and the event.
                    end = self._region_failed(f"the region closed the session ({code})")
                    end.code, end.reason = code, message.reason or end.reason
                    self._finish(end)
                else:
                    self._finish(self._region_failed(f"the region's connection was lost ({code})"))
                return
            assert not isinstance(message, Closed)
            self.active_at = self._clock()
            if meter is not None:
                meter.from_region(message)
            if not await self._to_client(message):
                return
            if meter is not None and self._drain is not None and not meter.busy:
                self._drain_if_idle()

    async def _to_client(self, message: str | bytes) -> bool:
        try:
            await self.client.send(message)
        except ConnectionError:
            self._finish(_End("client", NORMAL, "the client's connection was lost"))
            return False
        self.totals.messages_out += 1
        self.outcome.bytes_out += len(message)
        if self.outcome.first_byte_at is None:
            self.outcome.first_byte_at = self._clock()
        return True

    def _region_failed(self, why: str) -> _End:
        return _End(
            "region",
            INTERNAL_ERROR,
            "region failed",
            self._event(f"{why}; the session cannot go on", "region_failed"),
        )

    async def _watch(self) -> None:
        """Pings, the idle timeout and a drain's end."""
        config = self.config
        idle = config.idle_timeout
        interval = config.ping_interval
        tick = min(idle, interval)
        clock = self._clock
        next_ping = clock() + interval
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(tick):
                    await self._wake.wait()
            self._wake.clear()
            now = clock()
            if now - self.active_at >= idle:
                self._finish(
                    _End(
                        "idle",
                        GOING_AWAY,
                        "idle",
                        self._event(f"the session was idle for {idle:g}s", "session_idle"),
                    )
                )
                return
            if now >= next_ping:
                next_ping = now + interval
                await asyncio.gather(self.client.ping(), self.region.ping())
