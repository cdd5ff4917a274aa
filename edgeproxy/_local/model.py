"""The local model: a llama.cpp GGUF answering when no region can, in the request's own API
(chat and text completions, the stateless Responses API, Anthropic Messages).

llama-cpp-python (the ``local`` extra) loads the model in a worker thread at
startup, so the proxy serves at once and readiness reports the model's
state. Every llama.cpp call runs in worker threads, never on the event loop:
one llama.cpp context per generation slot (``concurrency``), a bounded wait
for a free slot (``max_queue``, ``max_queue_wait``; past either the answer is
503 with Retry-After), and tokens travel to the loop one by one as they are
sampled, so SSE answers stream token by token.

A request goes through three steps, so that the fallback ladder can decide
between them: :meth:`LocalModel.answer` validates it (400 on bad input),
takes a slot (503 when saturated) and tokenizes the prompt in the slot's
thread (400 when it overflows and ``on_overflow = "refuse"``); the
:class:`LocalAnswer` it returns holds the slot until it is sent or
discarded. Sending runs the generation; a client that goes away stops it
at the next token.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from edgeproxy._core.config import LocalModelConfig
from edgeproxy._core.errors import ProxyError
from edgeproxy._local.answer import LocalAnswer
from edgeproxy._local.binding import _log_state, _recent_errors, _Slot, load_context
from edgeproxy._local.prompt import prepare_prompt
from edgeproxy._local.request import GenerationRequest, parse_generation_request
from edgeproxy._local.sampling import _Generation
from edgeproxy._protocol.endpoints import dialect_for, endpoint_has
from edgeproxy._protocol.modelnames import ModelMatcher

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext

__all__ = ["LocalAnswer", "LocalModel", "GenerationRequest", "parse_generation_request"]

logger = logging.getLogger("edgeproxy.local_model")

State = Literal["off", "unavailable", "idle", "loading", "ready", "failed", "closed"]


class LocalModel:
    """A llama.cpp model loaded in the background, answering through a bounded slot queue.

    ``state`` is ``off`` (no path configured), ``unavailable`` (llama-cpp-python
    is not installed), ``idle`` (not started), ``loading``, ``ready``,
    ``failed`` (``error`` says why) or ``closed``.
    """

    def __init__(self, config: LocalModelConfig, *, base_dir: Path | None = None) -> None:
        self.config = config
        self.path: Path | None = None
        if config.path:
            path = Path(config.path).expanduser()
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            self.path = path
        self.state: State = "off" if self.path is None else "idle"
        self.error: str | None = None
        stem = self.path.name.removesuffix(".gguf") if self.path is not None else "none"
        self.model_name = config.model_name or f"local/{stem}"
        # The client model names it answers for: every one, or those `models` matches.
        self.every_model = config.answers_every_model
        self.models = ModelMatcher(config.models)
        self.load_seconds: float | None = None
        self.devices: dict[str, int] = {}
        self.gpu_offload_supported: bool | None = None
        self.requests_total = 0
        self.answered_total = 0
        self.rejected_total = 0
        self.cancelled_total = 0
        self.errors_total = 0
        self.prompt_tokens_total = 0
        self.completion_tokens_total = 0
        self.waiting = 0
        self.busy = 0
        self._slots: asyncio.Queue[_Slot] | None = None
        self._instances: list[_Slot] = []
        self._executor: ThreadPoolExecutor | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._running: set[_Generation] = set()
        self._closing = False

    # -- lifecycle ------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """A model is configured (whether or not it loaded)."""
        return self.state != "off"

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start(self) -> None:
        """Begin loading in a worker thread and return at once; ``state`` follows progress."""
        if self.state != "idle":
            return
        assert self.path is not None
        if not self.path.is_file():
            # Said now, at startup, not whenever the first request needs the model.
            self._fail(f"model file not found: {self.path}")
            return
        try:
            import llama_cpp
        except ImportError as exc:
            self.state = "unavailable"
            self.error = f"llama-cpp-python is not installed ({exc}); install edgeproxy[local]"
            logger.warning("local model %s: %s", self.path, self.error)
            return
        self.state = "loading"
        self._slots = asyncio.Queue()
        self._executor = ThreadPoolExecutor(
            max_workers=self.config.concurrency, thread_name_prefix="edgeproxy-llama"
        )
        self._load_task = asyncio.get_running_loop().create_task(
            self._load(llama_cpp), name="edgeproxy-local-model-load"
        )

    async def _load(self, llama_cpp: Any) -> None:
        assert self._executor is not None and self._slots is not None
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        logger.info("local model: loading %s in the background", self.path)
        try:
            for index in range(self.config.concurrency):
                slot = await loop.run_in_executor(self._executor, self._load_slot, llama_cpp, index)
                if self._closing:
                    self._instances.append(slot)
                    return
                self._instances.append(slot)
                self._slots.put_nowait(slot)
                if index == 0:
                    # Serve with the first context while the others load.
                    self.load_seconds = round(time.monotonic() - started, 3)
                    self.state = "ready"
                    self._log_loaded(llama_cpp, slot)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any load failure degrades to "failed"
            reason = str(exc) or type(exc).__name__
            detail = [line for line in _recent_errors if "magic" in line or "error" in line]
            if detail:
                reason += f" ({detail[-1]})"
            if self._instances:
                # Some contexts loaded: keep serving with those.
                logger.warning(
                    "local model: only %d of %d contexts loaded: %s",
                    len(self._instances),
                    self.config.concurrency,
                    reason,
                )
                return
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        self.state = "failed"
        self.error = reason
        logger.warning(
            "local model %s cannot be used: %s. The proxy keeps proxying; requests that "
            "need the local model skip it in the fallback ladder, and /readyz says so",
            self.path,
            reason,
        )

    def _load_slot(self, llama_cpp: Any, index: int) -> _Slot:
        """Worker thread: load one llama.cpp context."""
        if self.path is None or not self.path.is_file():
            raise ValueError(f"model file not found: {self.path}")
        slot = load_context(llama_cpp, self.path, self.config, index)
        if index == 0:
            self.devices = dict(_log_state.get("devices") or {})
            self.gpu_offload_supported = bool(llama_cpp.llama_supports_gpu_offload())
        return slot

    def _log_loaded(self, llama_cpp: Any, slot: _Slot) -> None:
        n_gpu = self.config.n_gpu_layers
        on = ", ".join(f"{n} on {d}" for d, n in sorted(self.devices.items())) or "unknown"
        logger.info(
            "local model %s ready in %.2fs as %r: n_ctx %d, layers %s",
            self.path,
            self.load_seconds or 0.0,
            self.model_name,
            slot.llm.n_ctx(),
            on,
        )
        if n_gpu != 0 and not self.gpu_offload_supported:
            logger.warning(
                "local model: n_gpu_layers=%d but this llama-cpp-python has no GPU support; "
                'the model runs on the CPU. Rebuild it with CMAKE_ARGS="-DGGML_CUDA=on"',
                n_gpu,
            )

    async def close(self) -> None:
        """Stop generations, wait for the worker threads, and free the model."""
        if self.state in ("off", "unavailable", "closed"):
            return
        self._closing = True
        for generation in list(self._running):
            generation.cancel()
        if self._load_task is not None and not self._load_task.done():
            # The thread finishes its load; _load then frees it.
            await asyncio.gather(self._load_task, return_exceptions=True)
        if self._executor is not None:
            # Threads stop within one token; the model must outlive them.
            await asyncio.to_thread(self._executor.shutdown, True)
        for slot in self._instances:
            slot.llm.close()
        self._instances.clear()
        self.state = "closed"

    def snapshot(self) -> dict[str, Any]:
        """The model's part of /status and /readyz."""
        return {
            "state": self.state,
            "error": self.error,
            "path": str(self.path) if self.path is not None else None,
            "model": self.model_name,
            "n_ctx": self.config.n_ctx,
            "n_gpu_layers": self.config.n_gpu_layers,
            "gpu_offload_supported": self.gpu_offload_supported,
            "layers_on_device": self.devices,
            "load_seconds": self.load_seconds,
            "concurrency": self.config.concurrency,
            "contexts_loaded": len(self._instances),
            "busy": self.busy,
            "waiting": self.waiting,
            "requests_total": self.requests_total,
            "answered_total": self.answered_total,
            "rejected_total": self.rejected_total,
            "cancelled_total": self.cancelled_total,
            "errors_total": self.errors_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "completion_tokens_total": self.completion_tokens_total,
        }

    # -- serving --------------------------------------------------------------

    def serves(self, method: str, path: str) -> bool:
        """Whether the model can answer this kind of request at all: a POST to an endpoint
        the table marks ``local`` (chat and text completions, the Responses API, Messages)."""
        return method == "POST" and endpoint_has(path, "local")

    def stateless(self, path: str, body: object) -> bool:
        """Whether the request can be answered from itself alone: it refers to no stored
        state (a Responses request's ``previous_response_id``, ``conversation``, stored
        prompt, item references, or a background run). The model never answers one that
        does: it would answer another conversation than the client's. Its answers are
        stored nowhere (a response says ``store: false``)."""
        return not isinstance(body, dict) or not dialect_for(path).stateful(body)

    def serves_model(self, model: object) -> bool:
        """Whether it may answer for the model a request names (``[local_model] models``)."""
        if self.every_model:
            return True
        return isinstance(model, str) and self.models.matches(model)

    def _busy(self, why: str) -> ProxyError:
        self.rejected_total += 1
        retry = max(1, math.ceil(self.config.max_queue_wait))
        return ProxyError(
            503,
            "server_error",
            f"the local fallback model is saturated ({why}); retry later",
            code="local_model_busy",
            headers={"Retry-After": str(retry)},
        )

    async def _acquire(self) -> _Slot:
        assert self._slots is not None
        cfg = self.config
        if self._slots.empty() and (self.waiting >= cfg.max_queue or cfg.max_queue_wait == 0):
            raise self._busy(f"{self.busy} generating, {self.waiting} waiting")
        self.waiting += 1
        try:
            async with asyncio.timeout(cfg.max_queue_wait):
                slot = await self._slots.get()
        except TimeoutError:
            raise self._busy(f"no slot free within {cfg.max_queue_wait:g}s") from None
        finally:
            self.waiting -= 1
        self.busy += 1
        return slot

    def _release(self, slot: _Slot) -> None:
        self.busy -= 1
        if self._slots is not None and not self._closing:
            self._slots.put_nowait(slot)

    async def answer(self, ctx: RequestContext, *, prefix: str = "") -> LocalAnswer:
        """Validate, queue for a slot and tokenize: an answer ready to be sent or discarded.

        ``prefix`` is text the answer already begins with (a broken stream's partial
        answer, for a chat request): the model goes on from it.

        Raises :class:`ProxyError`: 400 for bad input or a prompt that does
        not fit (``on_overflow = "refuse"``), 503 with Retry-After when the
        slot queue is saturated.
        """
        if not self.ready:
            raise RuntimeError(f"the local model is {self.state}")
        self.requests_total += 1
        req = parse_generation_request(ctx.path, ctx.json)
        req.prefix = prefix if req.chat else ""
        slot = await self._acquire()
        try:
            loop = asyncio.get_running_loop()
            assert self._executor is not None
            prepared = await loop.run_in_executor(
                self._executor, prepare_prompt, self.config, slot, req
            )
        except BaseException:
            self._release(slot)
            raise
        return LocalAnswer(self, slot, req, prepared)
