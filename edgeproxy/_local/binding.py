"""The llama.cpp binding: its log routed to Python logging, its prints caught, its chat
formatters, and loading a model context.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import re
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from edgeproxy._core.config import LocalModelConfig

llama_logger = logging.getLogger("edgeproxy.local_model.llama")

# ggml's log levels since late 2024 (llama-cpp-python 0.3): 1 debug, 2 info, 3 warn, 4 error,
# 5 the continuation of the line before.
_GGML_LOG_ERROR = 4
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
        error = level == _GGML_LOG_ERROR
        if error:
            _recent_errors.append(line)
        match = _device_re.search(line)
        if match is not None:
            devices = _log_state.setdefault("devices", Counter())
            devices[match.group(1)] += 1
        # llama.cpp's warnings are about things that are fine for a proxy (a test model's
        # tokenizer, a context smaller than the model's): at debug, like its other lines,
        # shown with the logger edgeproxy.local_model.llama at DEBUG. Its errors stay up.
        llama_logger.log(logging.WARNING if error else logging.DEBUG, "%s", line)

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


def load_context(llama_cpp: Any, path: Path, cfg: LocalModelConfig, index: int) -> _Slot:
    """Worker thread: load one llama.cpp context, its log and prints routed to logging."""
    _install_llama_logging(llama_cpp)
    _recent_errors.clear()
    _log_state["devices"] = Counter()
    with _capture_thread_stderr():
        llm = llama_cpp.Llama(
            model_path=str(path),
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
    return _Slot(index, llm, formatter)
