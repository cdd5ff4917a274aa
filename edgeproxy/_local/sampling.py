"""One generation in a worker thread: llama.cpp sampling token by token, each piece of
text handed to the event loop as it is decoded.
"""

from __future__ import annotations

import asyncio
import codecs
import threading
from collections.abc import AsyncIterator
from typing import Any

from edgeproxy._local.binding import _Slot
from edgeproxy._local.prompt import _Prepared
from edgeproxy._local.request import GenerationRequest


class _Generation:
    """One generation running in a worker thread, feeding tokens to the event loop."""

    def __init__(self, slot: _Slot, req: GenerationRequest, plan: _Prepared):
        self.slot = slot
        self.req = req
        self.plan = plan
        self.stop_event = threading.Event()
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.completion_tokens = 0
        self.finish_reason = "length"
        # The stop string that ended the answer, if one did.
        self.stop_sequence: str | None = None
        self._peeked: list[tuple[str, Any]] = []

    def cancel(self) -> None:
        self.stop_event.set()

    def _emit(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop closed under us: nobody is listening
            self.stop_event.set()

    def run(self) -> None:
        """Worker thread: sample token by token until EOS, a stop string, the budget or cancel."""
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - reported to the loop, which answers
            self._emit("error", exc)
        finally:
            self._emit("end", None)

    def _run(self) -> None:
        llm = self.slot.llm
        req, plan = self.req, self.plan
        import llama_cpp

        llm.set_seed(req.seed if req.seed is not None else llama_cpp.LLAMA_DEFAULT_SEED)
        kwargs: dict[str, Any] = dict(req.sampling)
        if req.logit_bias:
            bias = {t: b for t, b in req.logit_bias.items() if 0 <= t < llm.n_vocab()}

            def add_bias(input_ids: Any, scores: Any) -> Any:
                for token, value in bias.items():
                    scores[token] += value
                return scores

            kwargs["logits_processor"] = llama_cpp.LogitsProcessorList([add_bias])
        vocab = llm._model.vocab
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = plan.stop
        longest_stop = max((len(s) for s in stops), default=0)
        pending = ""  # decoded text held back while it could start a stop string
        generator = llm.generate(plan.tokens, **kwargs)
        try:
            for token in generator:
                if self.stop_event.is_set():
                    self.finish_reason = "cancelled"
                    return
                if llama_cpp.llama_vocab_is_eog(vocab, token):
                    self.finish_reason = "stop"
                    break
                self.completion_tokens += 1
                pending += decoder.decode(llm.detokenize([token]))
                if stops:
                    found = [(i, s) for s in stops if (i := pending.find(s)) >= 0]
                    if found:
                        hit, self.stop_sequence = min(found)
                        if hit:
                            self._emit("text", pending[:hit])
                        pending = ""
                        self.finish_reason = "stop"
                        break
                    # Release all but a tail that could still become a stop string.
                    keep = min(len(pending), longest_stop - 1)
                    while keep and not any(s.startswith(pending[-keep:]) for s in stops):
                        keep -= 1
                    ready, pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
                else:
                    ready, pending = pending, ""
                if ready:
                    self._emit("text", ready)
                if self.completion_tokens >= plan.budget:
                    self.finish_reason = "length"
                    break
            pending += decoder.decode(b"", final=True)
            if pending:
                self._emit("text", pending)
        finally:
            generator.close()

    async def first_token(self) -> None:
        """Wait until the first piece of text is out (or the generation ended)."""
        if not self._peeked:
            self._peeked.append(await self.events.get())

    async def texts(self) -> AsyncIterator[str]:
        """Yield the answer's text pieces as the thread produces them."""
        while True:
            kind, value = self._peeked.pop(0) if self._peeked else await self.events.get()
            if kind == "text":
                yield value
            elif kind == "error":
                raise value
            else:
                return
