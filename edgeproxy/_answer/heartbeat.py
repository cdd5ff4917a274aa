"""Early SSE heartbeats: a streaming request with no first token yet gets its first byte.

On a route with ``sse_heartbeat``, a streaming request (``"stream": true``)
that has no first token after that many seconds gets its response headers
(200, ``text/event-stream``) and an SSE comment, ``: waiting``, repeated at
the same interval until the answer starts. Intermediaries and browsers then
see a live response instead of timing out while a saturated region queues.

Only comments were sent, so failover, hedging and the degradation ladder go
on as before. What follows is the answer (from a region or the local model,
written by the Responder into the response already started), or, since the
status is already 200, an ``error`` event in the client's API.

The heartbeats are the Responder's state before the head: the :class:`Heartbeat`
owns its task and the response it started; the pipeline stops it
(:meth:`Heartbeat.stop`) before the Responder writes the answer, and on every
way out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from edgeproxy._core.exchange import Exchange
from edgeproxy._core.response import StreamResponse
from edgeproxy._protocol.endpoints import dialect_for

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext

__all__ = ["Heartbeat", "wants_heartbeats"]


class Heartbeat:
    """The heartbeats of one request, from a task of their own until :meth:`stop`: when to
    beat. What a beat writes, and what it records, is the Responder's (``beat``)."""

    __slots__ = ("request", "ctx", "interval", "response", "sent", "beat", "_write", "_task")

    def __init__(
        self,
        request: Exchange,
        ctx: RequestContext,
        interval: float,
        write: Callable[[Heartbeat], Awaitable[None]],
    ) -> None:
        self.request = request
        self.ctx = ctx
        self.interval = interval
        # The response the first heartbeat started; the Responder writes the rest.
        self.response: StreamResponse | None = None
        self.sent = 0
        # The dialect's own form: Anthropic's ping for its API, else an SSE comment.
        self.beat = dialect_for(ctx.path).heartbeat
        self._write = write
        self._task: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(
            self._beat(), name="edgeproxy-sse-heartbeat"
        )

    async def _beat(self) -> None:
        # The first comes `interval` after the request arrived (admission may have queued it).
        delay = self.interval - (time.monotonic() - self.ctx.started)
        try:
            while True:
                await asyncio.sleep(max(0.0, delay))
                delay = self.interval
                await self._write(self)
        except ConnectionResetError:
            pass  # the client left: what comes next notices it as well

    async def stop(self) -> StreamResponse | None:
        """Stop beating (idempotent): the response the heartbeats started, if they did."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Its cancellation is its result; this task's own still propagates.
            await asyncio.gather(task, return_exceptions=True)
        response = self.response
        if response is not None and not response.prepared:
            # Cancelled while its headers were going out: nothing usable was sent.
            return None
        return response


def wants_heartbeats(request: Exchange | None, ctx: RequestContext) -> float | None:
    """The interval of this request's heartbeats if its route asks for them and it
    streams; else None."""
    interval = ctx.route.sse_heartbeat
    if interval is None or request is None:
        return None
    body = ctx.json
    if not isinstance(body, dict) or body.get("stream") is not True:
        return None
    return interval
