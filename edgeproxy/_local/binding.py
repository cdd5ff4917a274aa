"""The llama.cpp binding: its log routed to Python logging, its prints caught, its chat
formatters, loading a model context, and keeping clear of a miscompiled AMX kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import logging
import re
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
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


# ggml's AMX matrix kernels (compiled into llama.cpp built on a CPU with AMX, as
# -march=native does) load their tile configuration from a 64-byte struct on the stack.
# GCC before 13 declares the operand of _tile_loadconfig as 8 bytes, so its optimizer drops
# the stores to the rest of the struct and LDTILECFG reads stack garbage: a general
# protection fault (SIGSEGV, the whole process) on the first batch of more than one token
# through a quantized weight (llama.cpp issue 20824). Weights loaded without llama.cpp's
# extra buffer types never reach those kernels; the plain CPU kernels serve them.
_GCC_VERSION = re.compile(rb"GCC: \((?:[^()\n]|\([^()\n]*\))*\) (\d+)\.\d+")
_FIXED_GCC = 13
_native_lock = threading.Lock()


def _loaded_native_libraries() -> list[Path] | None:
    """The ggml and llama shared libraries mapped into this process, or None when unknown."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    found: dict[str, Path] = {}
    for line in maps.splitlines():
        name = line.rsplit(" ", 1)[-1]
        base = name.rsplit("/", 1)[-1]
        if name.startswith("/") and ".so" in base and ("ggml" in base or "llama" in base):
            found[name] = Path(name)
    return list(found.values()) or None


def _gcc_majors(libraries: Iterable[Path]) -> list[int]:
    """The GCC major versions named in the libraries' .comment notes (none: another compiler)."""
    majors: list[int] = []
    for library in libraries:
        try:
            data = library.read_bytes()
        except OSError:
            continue
        majors += (int(m) for m in _GCC_VERSION.findall(data))
    return majors


def amx_kernels_unsafe(system_info: str, libraries: list[Path] | None) -> bool:
    """Whether llama.cpp's AMX kernels may crash: built with AMX by a GCC before 13.

    Unknown libraries count as unsafe, so the doubt costs speed, never the process.
    """
    if "AMX_INT8 = 1" not in system_info:
        return False
    if libraries is None:
        return True
    majors = _gcc_majors(libraries)
    return bool(majors) and min(majors) < _FIXED_GCC


@functools.cache
def _avoid_extra_buffers(llama_cpp: Any) -> bool:
    info = llama_cpp.llama_print_system_info()
    info = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    if not amx_kernels_unsafe(info, _loaded_native_libraries()):
        return False
    fields = {name for name, *_ in getattr(llama_cpp.llama_model_params, "_fields_", ())}
    if "use_extra_bufts" not in fields:
        return False  # a llama.cpp from before the AMX kernels took a stack config
    llama_logger.info(
        "llama.cpp was built with AMX kernels by a GCC older than %d, which miscompiles "
        "their tile setup (a crash on the first prompt); models load without the extra "
        "buffer types (AMX, repacking) instead. Rebuild llama-cpp-python with GCC %d+ to "
        "use AMX",
        _FIXED_GCC,
        _FIXED_GCC,
    )
    return True


@contextlib.contextmanager
def clear_of_amx(llama_cpp: Any) -> Iterator[None]:
    """While open, every ``llama_cpp.Llama`` loads its model off ggml's AMX kernels where
    they would crash (built with AMX by a GCC before 13); elsewhere it changes nothing.

    ``Llama`` takes no argument for llama.cpp's ``use_extra_bufts``, so the model
    parameters it starts from are adjusted until the block ends, one block at a time in
    the process. Also for a launcher that cannot pass arguments to ``Llama`` (the tests'
    ``edgeproxy.testing._llama_server``).
    """
    if not _avoid_extra_buffers(llama_cpp):
        yield
        return
    module = llama_cpp.llama_cpp  # the module whose defaults Llama reads
    with _native_lock:
        defaults = module.llama_model_default_params

        def without_extra_buffers() -> Any:
            params = defaults()
            params.use_extra_bufts = False
            return params

        module.llama_model_default_params = without_extra_buffers
        try:
            yield
        finally:
            module.llama_model_default_params = defaults


def new_llama(llama_cpp: Any, **kwargs: Any) -> Any:
    """``llama_cpp.Llama(**kwargs)``, kept off ggml's AMX kernels where they would crash
    (see :func:`clear_of_amx`). Every model the proxy loads is loaded here."""
    with clear_of_amx(llama_cpp):
        return llama_cpp.Llama(**kwargs)


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
        llm = new_llama(
            llama_cpp,
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
