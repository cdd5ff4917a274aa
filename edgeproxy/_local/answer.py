"""The local model's answer: a response holding its generation slot, made into an
:class:`~edgeproxy._core.answer.Answer` (one JSON body, or server-sent events as the model
generates them) in the request's own API (its dialect's writers), which the Responder sends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import orjson

from edgeproxy._core.answer import Answer, AnswerBroken
from edgeproxy._core.errors import ProxyError
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.response import StreamResponse
from edgeproxy._local.binding import _Slot
from edgeproxy._local.prompt import _Prepared
from edgeproxy._local.request import GenerationRequest
from edgeproxy._local.sampling import _Generation
from edgeproxy._protocol.dialects import AnswerText, StreamWriter
from edgeproxy._protocol.openai import usage

__all__ = ["AnsweringModel", "LocalAnswer"]

logger = logging.getLogger("edgeproxy.local_model")

DEGRADED = "local-model"
WARNING_HEADER = "X-Edgeproxy-Warning"
TRUNCATED_HEADER = "X-Edgeproxy-Prompt-Truncated"


class AnsweringModel(Protocol):
    """What an answer uses of its :class:`~edgeproxy._local.model.LocalModel`: its name,
    worker threads and slots, and the counters it adds to. A Protocol, as the model's
    module imports this one to hand answers out."""

    model_name: str
    prompt_tokens_total: int
    completion_tokens_total: int
    answered_total: int
    cancelled_total: int
    errors_total: int
    _executor: ThreadPoolExecutor | None
    _running: set[_Generation]

    def _release(self, slot: _Slot) -> None: ...


class LocalAnswer(StreamResponse):
    """A local-model answer about to be sent, holding its generation slot.

    It is a response object so that the ``edgeproxy_fallback`` hook can look
    at it (status, headers) before it is used. :meth:`answer` makes it the
    Answer the Responder sends; :meth:`discard` gives the slot back unused.
    """

    def __init__(
        self, model: AnsweringModel, slot: _Slot, req: GenerationRequest, plan: _Prepared
    ) -> None:
        super().__init__(status=200)
        self.model = model
        self.req = req
        self.plan = plan
        self._slot: _Slot | None = slot
        self._generation: _Generation | None = None
        self._sent = False
        self._settled = False
        self.content_type = "text/event-stream" if req.stream else "application/json"
        if req.stream:
            self.headers["Cache-Control"] = "no-cache"
        self.headers["X-Edgeproxy-Degraded"] = DEGRADED
        self.headers["X-Edgeproxy-Region"] = "local"
        if req.ignored:
            self.headers[WARNING_HEADER] = (
                "ignored parameters the local model does not support: " + ", ".join(req.ignored)
            )
        if plan.truncated:
            self.headers[TRUNCATED_HEADER] = str(plan.truncated)

    def discard(self) -> None:
        """Give the slot back without generating (vetoed or replaced answer)."""
        if self._slot is not None:
            slot, self._slot = self._slot, None
            self.model._release(slot)

    def start(self) -> None:
        """Start generating, before anything is written (:meth:`send` writes it)."""
        if self._generation is not None:
            return
        slot = self._slot
        if slot is None:
            raise RuntimeError("this answer was already discarded")
        self._slot = None
        model = self.model
        generation = self._generation = _Generation(slot, self.req, self.plan)
        model._running.add(generation)
        assert model._executor is not None
        future = asyncio.get_running_loop().run_in_executor(model._executor, generation.run)

        def finished(_: Any) -> None:
            # The slot comes back only once the thread is done with the context.
            model._running.discard(generation)
            model._release(slot)

        future.add_done_callback(finished)

    async def first_token(self) -> None:
        """Start generating and wait for the first token: what a race is won by."""
        self.start()
        assert self._generation is not None
        await self._generation.first_token()

    def abandon(self) -> None:
        """Give up on this answer, started or not, if it was not sent; nothing is written.

        An answer streamed through :meth:`events` stops at the next token."""
        if self._sent:
            if self._generation is not None and not self.prepared:
                self._generation.cancel()
            return
        if self._generation is not None:
            # The thread stops at its next token and then gives the slot back.
            self._generation.cancel()
        self.discard()

    def _begin(self) -> tuple[_Generation, AnswerText]:
        """Start generating this answer, once: its generation and its head, the prompt's
        tokens counted."""
        if self._sent or (self._generation is None and self._slot is None):
            raise RuntimeError("this answer was already sent or discarded")
        self._sent = True
        self.start()
        generation = self._generation
        assert generation is not None
        self.model.prompt_tokens_total += len(self.plan.tokens)
        return generation, self._head()

    def answer(self, request: Exchange) -> Answer:
        """This answer as the Responder sends it: its head now, its body as the model
        generates it (streamed, or one JSON body made before the head goes)."""
        generation, head = self._begin()
        headers = list(self.headers.items())

        def counted() -> dict[str, Any]:
            return self._counted(generation)

        if self.req.stream:
            return Answer(
                200,
                headers,
                source="local",
                chunks=self._streamed(generation, head),
                sse=True,
                usage=counted,
                release=self._settle,
            )

        async def make() -> bytes:
            return await self._whole(request, generation, head)

        return Answer(200, headers, source="local", make=make, usage=counted, release=self._settle)

    def _settle(self) -> None:
        """On every way out of a sent answer, once: the generation stops and its tokens are
        counted."""
        generation = self._generation
        if generation is None or self._settled:
            return
        self._settled = True
        generation.cancel()
        self.model.completion_tokens_total += generation.completion_tokens

    async def _streamed(self, generation: _Generation, head: AnswerText) -> AsyncIterator[bytes]:
        model = self.model
        try:
            async for data in self._events(generation, head):
                yield data
        except GeneratorExit:
            model.cancelled_total += 1  # the client left (or the answer was cut)
            raise
        except Exception as exc:
            model.errors_total += 1
            logger.exception("local model generation failed")
            raise AnswerBroken(
                ProxyError(500, "server_error", "the local model failed", code="local_model_error"),
                reason=f"local model failed mid-answer: {exc}",
            ) from exc
        model.answered_total += 1

    async def _whole(self, request: Exchange, generation: _Generation, head: AnswerText) -> bytes:
        model = self.model
        parts: list[str] = []
        try:
            async for text in generation.texts():
                parts.append(text)
                if request.client_gone():
                    # Without handler cancellation nobody else notices before the write.
                    raise ConnectionResetError("client disconnected")
        except (asyncio.CancelledError, ConnectionResetError):
            model.cancelled_total += 1
            raise
        except Exception as exc:
            model.errors_total += 1
            logger.exception("local model generation failed")
            raise ProxyError(
                500, "server_error", f"the local model failed: {exc}", code="local_model_error"
            ) from exc
        head.text = "".join(parts)
        head.finish = generation.finish_reason
        head.usage = self._usage(generation)
        head.stop_sequence = self._stop_sequence(generation)
        model.answered_total += 1
        return orjson.dumps(self.req.dialect.answer(head))

    def _head(self) -> AnswerText:
        """The answer's id, model and creation time, and the prompt's tokens as its usage so
        far (what a stream's opening events say)."""
        return AnswerText(
            self.req.dialect.answer_id(),
            self.model.model_name,
            int(time.time()),
            usage=usage(len(self.plan.tokens), 0),
        )

    def _usage(self, generation: _Generation) -> dict[str, int]:
        """The answer's usage in chat's fields, which each dialect writes in its own."""
        return usage(len(self.plan.tokens), generation.completion_tokens)

    def _counted(self, generation: _Generation) -> dict[str, Any]:
        """The request's usage as a region's answer in its API is counted (its own fields,
        chat's beside them), for the access log, the metrics and the token limits."""
        dialect = self.req.dialect
        return dialect.counted(dialect.own_usage(self._usage(generation)))

    async def _events(self, generation: _Generation, head: AnswerText) -> AsyncIterator[bytes]:
        """The answer as the API's SSE events, one per piece of text as the model produces
        it, between the stream's opening and closing events."""
        writer: StreamWriter = self.req.dialect.writer(head, include_usage=self.req.include_usage)
        opening = writer.open()
        if opening:
            yield opening
        async for text in generation.texts():
            yield writer.piece(text)
        head.stop_sequence = self._stop_sequence(generation)
        yield writer.close(generation.finish_reason, self._usage(generation))

    def _stop_sequence(self, generation: _Generation) -> str | None:
        """The client's stop string that ended the answer (not the chat template's own)."""
        sequence = generation.stop_sequence
        return sequence if sequence is not None and sequence in self.req.stop else None

    async def events(self) -> AsyncIterator[bytes]:
        """Generate the streamed answer as SSE event bytes, for a continued stream to splice
        into its own; :meth:`abandon` stops it."""
        generation, head = self._begin()
        model = self.model
        try:
            async for data in self._events(generation, head):
                yield data
        except Exception:
            model.errors_total += 1
            raise
        else:
            model.answered_total += 1
        finally:
            self._settle()
