"""The local model: a llama.cpp GGUF answering OpenAI-style when no region can.

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
import codecs
import contextlib
import ctypes
import io
import logging
import math
import re
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

import orjson
from aiohttp import web

from edgeproxy._core.config import LocalModelConfig
from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.endpoints import CHAT_COMPLETIONS, endpoint_has, openai_endpoint
from edgeproxy._protocol.openai import (
    SSE_DONE,
    AnswerHead,
    chat_choice,
    chat_chunk_choice,
    chunk,
    completion,
    completion_id,
    sse_event,
    text_choice,
    usage,
    usage_chunk,
)

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext

__all__ = ["LocalAnswer", "LocalModel", "GenerationRequest", "parse_generation_request"]

logger = logging.getLogger("edgeproxy.local_model")
llama_logger = logging.getLogger("edgeproxy.local_model.llama")

DEGRADED = "local-model"
WARNING_HEADER = "X-Edgeproxy-Warning"
TRUNCATED_HEADER = "X-Edgeproxy-Prompt-Truncated"

State = Literal["off", "unavailable", "idle", "loading", "ready", "failed", "closed"]

# Request fields that shape the answer and are mapped onto llama.cpp sampling.
# top_k, min_p, typical_p and repeat_penalty are llama.cpp extensions, as
# llama-cpp-python's own server accepts them.
_MAPPED = frozenset(
    {
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "seed",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "top_k",
        "min_p",
        "typical_p",
        "repeat_penalty",
    }
)
# Fields with no bearing on a single local answer: accepted without a warning.
_NEUTRAL = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "stream",
        "stream_options",
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
    }
)
# Unsupported fields that are harmless at these values (the OpenAI defaults).
_HARMLESS: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v == 1,
    "best_of": lambda v: v == 1,
    "logprobs": lambda v: v is False or v == 0,
    "top_logprobs": lambda v: v == 0,
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
    "tools": lambda v: v == [],
    "functions": lambda v: v == [],
    "tool_choice": lambda v: v in ("none", "auto"),
    "function_call": lambda v: v in ("none", "auto"),
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
}
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _bad(message: str, *, code: str | None = None) -> ProxyError:
    return ProxyError(400, "invalid_request_error", message, code=code)


# -- the request -------------------------------------------------------------------------


@dataclass(slots=True)
class GenerationRequest:
    """A validated chat or text completion request, ready for the model."""

    chat: bool
    stream: bool
    include_usage: bool
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str | list[int] = ""
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def _number(
    body: dict[str, Any], key: str, low: float, high: float, *, low_open: bool = False
) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{key} must be a number")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _bad(f"{key} must be in {bracket}{low:g}, {high:g}], not {value!r}")
    return float(value)


def _integer(body: dict[str, Any], key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer")
    if value < low:
        raise _bad(f"{key} must be >= {low}, not {value}")
    return value


def _content(index: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(
                    f"messages[{index}].content: the local model reads text only, "
                    f"not {kind!r} parts"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"messages[{index}].content: a text part needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)
    raise _bad(f"messages[{index}].content must be a string or a list of text parts")


def parse_generation_request(path: str, body: Any) -> GenerationRequest:
    """Validate an OpenAI chat or text completion body for the local model.

    Raises :class:`ProxyError` 400 (``invalid_request_error``) naming the bad
    field. Sampling fields llama.cpp supports are mapped; other fields that
    would change the answer are collected in ``ignored`` for the warning
    header.
    """
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    chat = openai_endpoint(path) is CHAT_COMPLETIONS
    stream_options = body.get("stream_options")
    req = GenerationRequest(
        chat=chat,
        stream=body.get("stream") is True,
        include_usage=isinstance(stream_options, dict)
        and stream_options.get("include_usage") is True,
    )
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise _bad("messages must be a list of messages")
        if not messages:
            raise _bad("messages must not be empty", code="empty_messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise _bad(f"messages[{i}] must be an object")
            role = message.get("role")
            if role not in _ROLES:
                raise _bad(f"messages[{i}].role must be one of {', '.join(sorted(_ROLES))}")
            # Chat templates know "system"; "developer" is OpenAI's new name for it.
            req.messages.append(
                {
                    "role": "system" if role == "developer" else str(role),
                    "content": _content(i, message.get("content")),
                }
            )
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            req.prompt = prompt
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            req.prompt = list(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise _bad("prompt: the local model answers one prompt per request")
        else:
            raise _bad("prompt must be a string or a list of token ids")

    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    req.max_tokens = max_tokens
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop = [stop] if stop else []
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        req.stop = [s for s in stop if s]
    elif stop is not None:
        raise _bad("stop must be a string or a list of up to 4 strings")
    req.seed = _integer(body, "seed", -(2**63))
    sampling: dict[str, Any] = {}
    for key, target, low, high, low_open in (
        ("temperature", "temp", 0.0, 2.0, False),
        ("top_p", "top_p", 0.0, 1.0, True),
        ("frequency_penalty", "frequency_penalty", -2.0, 2.0, False),
        ("presence_penalty", "presence_penalty", -2.0, 2.0, False),
        ("min_p", "min_p", 0.0, 1.0, False),
        ("typical_p", "typical_p", 0.0, 1.0, True),
        ("repeat_penalty", "repeat_penalty", 0.0, 10.0, True),
    ):
        value = _number(body, key, low, high, low_open=low_open)
        if value is not None:
            sampling[target] = value
    top_k = _integer(body, "top_k", 0)
    if top_k is not None:
        sampling["top_k"] = top_k
    req.sampling = sampling
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _bad("logit_bias must map token ids to numbers")
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise _bad(f"logit_bias: {key!r} is not a token id") from None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _bad(f"logit_bias[{key}] must be a number")
            if not -100 <= value <= 100:
                raise _bad(f"logit_bias[{key}] must be in [-100, 100]")
            req.logit_bias[token] = float(value)

    for key, value in body.items():
        if key in _MAPPED or key in _NEUTRAL or value is None:
            continue
        harmless = _HARMLESS.get(key)
        if harmless is not None and harmless(value):
            continue
        req.ignored.append(key)
    req.ignored.sort()
    return req


# -- llama.cpp plumbing -------------------------------------------------------------------

_LOG_LEVELS = {2: logging.WARNING, 3: logging.ERROR}
_recent_errors: deque[str] = deque(maxlen=8)
_device_re = re.compile(r"layer\s+\d+ assigned to device (\S+?),")
_log_state: dict[str, Any] = {}


def _install_llama_logging(llama_cpp: Any) -> None:
    """Send llama.cpp's own log lines to Python logging instead of stderr.

    Error lines are also kept, so a failed load can say why ("failed to read
    magic"), and layer placement lines are counted for /status.
    """
    if "callback" in _log_state:
        return

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        try:
            line = text.decode("utf-8", "replace").rstrip()
        except Exception:  # noqa: BLE001 - never raise into C
            return
        if not line:
            return
        if level == 3:
            _recent_errors.append(line)
        match = _device_re.search(line)
        if match is not None:
            devices = _log_state.setdefault("devices", Counter())
            devices[match.group(1)] += 1
        # llama.cpp warns about things that are fine for a proxy; keep them at debug.
        llama_logger.log(logging.WARNING if level == 3 else logging.DEBUG, "%s", line)

    # Keep a reference: llama.cpp calls it for as long as the process lives.
    _log_state["callback"] = _callback
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))


class _ThreadStderr(io.TextIOBase):
    """sys.stderr for one thread's prints only; every other thread writes through.

    llama-cpp-python prints model metadata to stderr while loading when
    ``verbose=True``, and with ``verbose=False`` it silences the whole
    process's file descriptors 1 and 2 instead, which would swallow the
    proxy's own startup logs. So the loader runs verbose, with its thread's
    prints caught here and logged at debug.
    """

    def __init__(self, real: TextIO) -> None:
        self.real = real
        self.owner = threading.get_ident()
        self.buffer_text = io.StringIO()

    def write(self, text: str) -> int:
        if threading.get_ident() == self.owner:
            return self.buffer_text.write(text)
        return self.real.write(text)

    def flush(self) -> None:
        if threading.get_ident() != self.owner:
            self.real.flush()


@contextlib.contextmanager
def _capture_thread_stderr() -> Iterator[None]:
    """Catch this thread's writes to sys.stderr (see :class:`_ThreadStderr`), log them."""
    router = _ThreadStderr(sys.stderr)
    sys.stderr = router
    try:
        yield
    finally:
        if sys.stderr is router:
            sys.stderr = router.real
        text = router.buffer_text.getvalue().strip()
        if text:
            llama_logger.debug("%s", text)


def _chat_formatter(llama_cpp: Any, llm: Any, name: str) -> Callable[..., Any]:
    """The prompt formatter of ``name``, or of the model's own template when empty."""
    chat_format = llama_cpp.llama_chat_format
    if not name:
        template = llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise ValueError(
                "the model has no chat template (tokenizer.chat_template); set "
                "local_model.chat_format, e.g. 'chatml'"
            )
        eos = llm.token_eos()
        bos = llm.token_bos()
        return chat_format.Jinja2ChatFormatter(  # type: ignore[no-any-return]
            template=template,
            eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
            bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
        )
    # llama-cpp-python registers chat *handlers* by name; the prompt
    # formatters behind them are its format_* functions, named alike.
    wanted = name.replace("-", "").replace("_", "").lower()
    for attr in dir(chat_format):
        if attr.startswith("format_") and attr[7:].replace("_", "").lower() == wanted:
            return getattr(chat_format, attr)  # type: ignore[no-any-return]
    known = sorted(a[7:].replace("_", "-") for a in dir(chat_format) if a.startswith("format_"))
    raise ValueError(f"unknown chat_format {name!r}; known: {', '.join(known)}")


@dataclass(slots=True)
class _Slot:
    """One generation slot: a llama.cpp model context, used by one thread at a time."""

    index: int
    llm: Any
    formatter: Callable[..., Any]


@dataclass(slots=True)
class _Prepared:
    """A tokenized prompt and the generation plan for it."""

    tokens: list[int]
    budget: int
    stop: list[str]
    truncated: int


# -- the model ---------------------------------------------------------------------------


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
        _install_llama_logging(llama_cpp)
        _recent_errors.clear()
        _log_state["devices"] = Counter()
        cfg = self.config
        with _capture_thread_stderr():
            llm = llama_cpp.Llama(
                model_path=str(self.path),
                n_gpu_layers=cfg.n_gpu_layers,
                n_ctx=cfg.n_ctx,
                n_batch=cfg.n_batch,
                n_threads=cfg.n_threads,
                # verbose=False would silence the whole process's stderr while loading;
                # the prints are routed above, and per-request prints are off below.
                verbose=True,
            )
        llm.verbose = False
        try:
            formatter = _chat_formatter(llama_cpp, llm, cfg.chat_format)
        except Exception:
            llm.close()
            raise
        if index == 0:
            self.devices = dict(_log_state.get("devices") or {})
            self.gpu_offload_supported = bool(llama_cpp.llama_supports_gpu_offload())
        return _Slot(index, llm, formatter)

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
        """Whether the model can answer this kind of request at all."""
        return method == "POST" and endpoint_has(path, "local")

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

    async def answer(self, ctx: RequestContext) -> LocalAnswer:
        """Validate, queue for a slot and tokenize: an answer ready to be sent or discarded.

        Raises :class:`ProxyError`: 400 for bad input or a prompt that does
        not fit (``on_overflow = "refuse"``), 503 with Retry-After when the
        slot queue is saturated.
        """
        if not self.ready:
            raise RuntimeError(f"the local model is {self.state}")
        self.requests_total += 1
        req = parse_generation_request(ctx.path, ctx.json)
        slot = await self._acquire()
        try:
            loop = asyncio.get_running_loop()
            assert self._executor is not None
            prepared = await loop.run_in_executor(self._executor, self._prepare, slot, req)
        except BaseException:
            self._release(slot)
            raise
        return LocalAnswer(self, slot, req, prepared)

    def _prepare(self, slot: _Slot, req: GenerationRequest) -> _Prepared:
        """Worker thread: render the chat template, tokenize, fit the context."""
        llm = slot.llm
        n_ctx: int = llm.n_ctx()
        cap = self.config.max_tokens
        # The answer's room: what was asked (capped), else what is left, up to the cap.
        reserve = min(req.max_tokens, cap) if req.max_tokens is not None else min(cap, n_ctx // 4)
        limit = n_ctx - reserve
        stop = list(req.stop)
        truncated = 0
        if req.chat:
            messages = list(req.messages)
            tokens, format_stop = self._render(slot, messages)
            original = len(tokens)
            if len(tokens) > limit and self.config.on_overflow == "truncate":
                # Drop the oldest turns first, keeping system prompts and the last message.
                while len(tokens) > limit:
                    drop = next(
                        (i for i, m in enumerate(messages[:-1]) if m["role"] != "system"), None
                    )
                    if drop is None:
                        break
                    del messages[drop]
                    tokens, format_stop = self._render(slot, messages)
            stop += [s for s in format_stop if s and s not in stop]
        else:
            if isinstance(req.prompt, list):
                n_vocab = llm.n_vocab()
                bad = next((t for t in req.prompt if not 0 <= t < n_vocab), None)
                if bad is not None:
                    raise _bad(
                        f"prompt: token id {bad} is outside the vocabulary (0..{n_vocab - 1})"
                    )
                tokens = list(req.prompt)
            else:
                tokens = llm.tokenize(req.prompt.encode("utf-8"), add_bos=True, special=False)
            original = len(tokens)
        if len(tokens) > limit:
            if self.config.on_overflow == "refuse":
                raise _bad(
                    f"This model's maximum context length is {n_ctx} tokens. However, you "
                    f"requested {original + reserve} tokens ({original} in the prompt, "
                    f"{reserve} for the completion). Please reduce the prompt or max_tokens.",
                    code="context_length_exceeded",
                )
            # Keep the end of the prompt (the question), and BOS if it had one.
            bos = llm.token_bos()
            head = [bos] if tokens and tokens[0] == bos and bos != -1 else []
            tokens = head + tokens[len(tokens) - (limit - len(head)) :]
        truncated = original - len(tokens)
        budget = min(reserve if req.max_tokens is not None else cap, n_ctx - len(tokens))
        return _Prepared(tokens=tokens, budget=max(1, budget), stop=stop, truncated=truncated)

    def _render(self, slot: _Slot, messages: list[dict[str, str]]) -> tuple[list[int], list[str]]:
        try:
            result = slot.formatter(messages=messages)
        except Exception as exc:  # noqa: BLE001 - template errors are about the messages
            raise _bad(f"messages: the model's chat template refused them: {exc}") from None
        stop = result.stop
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        tokens = slot.llm.tokenize(
            result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True
        )
        return tokens, stops


# -- generation --------------------------------------------------------------------------


class _Generation:
    """One generation running in a worker thread, feeding tokens to the event loop."""

    def __init__(self, model: LocalModel, slot: _Slot, req: GenerationRequest, plan: _Prepared):
        self.model = model
        self.slot = slot
        self.req = req
        self.plan = plan
        self.stop_event = threading.Event()
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.completion_tokens = 0
        self.finish_reason = "length"
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
                    hit = min((i for s in stops if (i := pending.find(s)) >= 0), default=-1)
                    if hit >= 0:
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


class LocalAnswer(web.StreamResponse):
    """A local-model answer about to be sent, holding its generation slot.

    It is a response object so that the ``edgeproxy_fallback`` hook can look
    at it (status, headers) before it is used. :meth:`send` generates and
    writes it; :meth:`discard` gives the slot back unused.
    """

    def __init__(
        self, model: LocalModel, slot: _Slot, req: GenerationRequest, plan: _Prepared
    ) -> None:
        super().__init__(status=200)
        self.model = model
        self.req = req
        self.plan = plan
        self._slot: _Slot | None = slot
        self._generation: _Generation | None = None
        self._sent = False
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
        generation = self._generation = _Generation(model, slot, self.req, self.plan)
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
        """Give up on this answer, started or not, if it was not sent; nothing is written."""
        if self._sent:
            return
        if self._generation is not None:
            # The thread stops at its next token and then gives the slot back.
            self._generation.cancel()
        self.discard()

    async def send(self, request: web.Request, ctx: RequestContext) -> LocalAnswer:
        """Generate the answer and write it to the client, streamed or as one JSON body."""
        if self._sent or (self._generation is None and self._slot is None):
            raise RuntimeError("this answer was already sent or discarded")
        self._sent = True
        self.start()
        generation = self._generation
        assert generation is not None
        model = self.model
        req = self.req
        head = AnswerHead(
            completion_id(chat=req.chat), int(time.time()), model.model_name, req.chat
        )
        prompt_tokens = len(self.plan.tokens)
        model.prompt_tokens_total += prompt_tokens
        try:
            if req.stream:
                await self._stream(request, ctx, generation, head)
            else:
                await self._json(request, ctx, generation, head)
        except asyncio.CancelledError:
            model.cancelled_total += 1
            ctx.error = "client disconnected"
            raise
        except ConnectionResetError:
            model.cancelled_total += 1
            ctx.error = "client disconnected"
        except ProxyError:
            raise
        except Exception as exc:
            model.errors_total += 1
            logger.exception("local model generation failed")
            if not self.prepared:
                raise ProxyError(
                    500, "server_error", f"the local model failed: {exc}", code="local_model_error"
                ) from exc
            ctx.error = f"local model failed mid-answer: {exc}"
            self.force_close()
        else:
            model.answered_total += 1
        finally:
            generation.cancel()
            model.completion_tokens_total += generation.completion_tokens
            ctx.usage = self._usage(generation)
        return self

    def _usage(self, generation: _Generation) -> dict[str, int]:
        return usage(len(self.plan.tokens), generation.completion_tokens)

    def _client_gone(self, request: web.Request) -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    async def _json(
        self, request: web.Request, ctx: RequestContext, generation: _Generation, head: AnswerHead
    ) -> None:
        parts: list[str] = []
        async for text in generation.texts():
            parts.append(text)
            if self._client_gone(request):
                # Without handler cancellation nobody else notices before the write.
                raise ConnectionResetError("client disconnected")
        text = "".join(parts)
        finish = generation.finish_reason
        if head.chat:
            choice = chat_choice(0, text, finish)
        else:
            choice = text_choice(0, text, finish)
        body = orjson.dumps(completion(head, [choice], self._usage(generation)))
        self.content_length = len(body)
        await self.prepare(request)
        ctx.first_byte_at = time.monotonic()
        await self.write(body)
        ctx.bytes_out += len(body)
        await self.write_eof()

    async def _stream(
        self, request: web.Request, ctx: RequestContext, generation: _Generation, head: AnswerHead
    ) -> None:
        async def event(data: bytes) -> None:
            await self.write(data)
            ctx.bytes_out += len(data)

        def piece(text: str | None, finish: str | None) -> bytes:
            if head.chat:
                delta: dict[str, Any] = {} if text is None else {"content": text}
                choice = chat_chunk_choice(0, delta, finish)
            else:
                choice = text_choice(0, text or "", finish)
            return sse_event(chunk(head, [choice]))

        ctx.response_is_sse = True
        await self.prepare(request)
        ctx.first_byte_at = time.monotonic()
        if head.chat:
            await event(
                sse_event(chunk(head, [chat_chunk_choice(0, {"role": "assistant", "content": ""})]))
            )
        async for text in generation.texts():
            await event(piece(text, None))
            if self._client_gone(request):
                raise ConnectionResetError("client disconnected")
        await event(piece(None, generation.finish_reason))
        if self.req.include_usage:
            await event(sse_event(usage_chunk(head, self._usage(generation))))
        await event(SSE_DONE)
        await self.write_eof()
