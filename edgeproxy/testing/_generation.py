"""The fake region's model of an LLM server's generation: a FIFO queue in front of
``max_running`` generation slots and a prefix (KV) cache (:mod:`edgeproxy.testing._kv`)
whose hits make the first token come sooner and are reported in the answers' usage (each
API's own fields; none from a region without a cache).

:class:`GenerationModel` is a part of :class:`~edgeproxy.testing._app.RegionApp`, its base
class: the methods are the region's own, and its counters are written under the region's
lock.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import TYPE_CHECKING

from edgeproxy.testing import _answers as answers
from edgeproxy.testing._behavior import Behavior, Fault
from edgeproxy.testing._exchange import Exchange, Headers, Reply
from edgeproxy.testing._kv import KVCache, blocks_for, read_prompt
from edgeproxy.testing._messages import CacheReport

__all__ = ["GenerationModel"]


class _QueueFull(Exception):
    """``max_queue`` requests are already waiting."""


class GenerationModel:
    """Chat, completions, Responses and Messages requests, queued for a slot and answered
    after the modelled time to first token."""

    # The region's, set as it is built (RegionApp.__init__).
    name: str
    kv_block_size: int
    max_running: int
    max_queue: int | None
    queue_full_status: int
    _lock: threading.Lock
    _kv: KVCache
    _running: int
    _waiting: deque[asyncio.Future[None]]
    _kv_held: int
    _peak_waiting: int
    _queue_rejected: int
    _prompt_tokens: int
    _cached_tokens: int
    _generation_tokens: int
    _tokens_sent: int
    _modelled_ttft: float

    if TYPE_CHECKING:

        def _orca_headers(self, ex: Exchange, behavior: Behavior) -> Headers: ...

    async def _generate(
        self, ex: Exchange, reply: Reply, behavior: Behavior, fault: Fault | None
    ) -> None:
        """Queue for a slot, look the prompt up in the KV cache, answer after the modelled TTFT."""
        generation = reply.generation
        assert generation is not None
        block_size = self.kv_block_size
        caching = self._kv.capacity > 0
        prompt = read_prompt(
            generation.request, chat=generation.chat, block_size=block_size, hashed=caching
        )
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        try:
            await self._admit()
        except _QueueFull:
            status = self.queue_full_status
            message = f"fake region {self.name}: {self.max_queue} requests already waiting"
            kind = "server_error" if status >= 500 else "rate_limit_error"
            rejected = answers.error_for(ex.path, status, message, kind)
            rejected.late_headers = lambda: self._orca_headers(ex, behavior)
            await ex.send_reply(rejected, fault, behavior)
            return
        # From here to the ``try``, nothing awaits: the slot and the blocks are
        # always given back.
        queued = loop.time() - arrived
        held = (
            blocks_for(prompt.tokens + generation.completion_tokens, block_size) if caching else 0
        )
        # vLLM recomputes at least the last prompt token, so a prompt that is
        # all cached blocks still misses its last block.
        eligible = (prompt.tokens - 1) // block_size if prompt.tokens else 0
        # The prompt's whole blocks this request adds to the cache (Anthropic reports them).
        whole = prompt.tokens // block_size
        with self._lock:
            cached = self._kv.lookup(prompt.blocks, eligible) * block_size
            written = sum(block not in self._kv for block in prompt.blocks[:whole]) * block_size
            self._kv.insert(prompt.blocks)
            self._kv_held += held
            uncached = prompt.tokens - cached
            ttft = (
                behavior.ttft
                + uncached * behavior.ttft_per_uncached_token
                + cached * behavior.ttft_per_cached_token
            )
            self._prompt_tokens += prompt.tokens
            self._cached_tokens += cached
            self._generation_tokens += generation.completion_tokens
            self._modelled_ttft += ttft
        try:
            # A server without a prefix cache reports nothing of one.
            report = reply.with_cache if caching else None
            if isinstance(report, CacheReport):
                report.record(cached, written)
            elif report is not None:
                report(cached)
            reply.first_delay = ttft
            reply.headers.extend(
                [
                    (b"x-fake-kv-prompt-tokens", str(prompt.tokens).encode()),
                    (b"x-fake-kv-cached-tokens", str(cached).encode()),
                    (b"x-fake-ttft-ms", f"{ttft * 1000:.3f}".encode()),
                    (b"x-fake-queue-ms", f"{queued * 1000:.3f}".encode()),
                ]
            )
            reply.late_headers = lambda: self._orca_headers(ex, behavior)
            await ex.send_reply(reply, fault, behavior)
        finally:
            with self._lock:
                self._kv_held -= held
                self._tokens_sent += ex.tokens_sent
            self._release()

    async def _admit(self) -> None:
        """Take a generation slot, waiting in FIFO order; ``_QueueFull`` past ``max_queue``."""
        with self._lock:
            if self.max_running <= 0 or (self._running < self.max_running and not self._waiting):
                self._running += 1
                return
            if self.max_queue is not None and len(self._waiting) >= self.max_queue:
                self._queue_rejected += 1
                raise _QueueFull
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            self._peak_waiting = max(self._peak_waiting, len(self._waiting))
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self._release()  # the slot was handed over just as we were cancelled
            else:
                with self._lock:
                    try:
                        self._waiting.remove(turn)
                    except ValueError:
                        pass
            raise

    def _release(self) -> None:
        """Give a slot back: to the first request still waiting, if any."""
        with self._lock:
            while self._waiting:
                turn = self._waiting.popleft()
                if not turn.done():
                    turn.set_result(None)  # the slot passes on; ``_running`` stays
                    return
            self._running -= 1
