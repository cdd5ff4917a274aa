"""Loading around ggml's miscompiled AMX kernels: when they are avoided, and how.

llama.cpp built with AMX by a GCC before 13 faults on the first multi-token batch through a
quantized weight; :func:`new_llama` then loads the model without llama.cpp's extra buffer
types. These tests use stand-in libraries and a stand-in binding, so they hold on any host.
"""

from __future__ import annotations

import ctypes
import importlib.util
import types
from pathlib import Path
from typing import Any

import pytest

from edgeproxy._local import binding
from edgeproxy._local.binding import amx_kernels_unsafe, new_llama

AMX = "CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | REPACK = 1 | "
NO_AMX = "CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | REPACK = 1 | "


def library(tmp_path: Path, name: str, *comments: bytes) -> Path:
    """A stand-in shared library whose .comment notes name these compilers."""
    path = tmp_path / name
    path.write_bytes(b"\x7fELF\x00junk\x00" + b"\x00".join(comments) + b"\x00tail")
    return path


@pytest.mark.parametrize(
    ("comment", "unsafe"),
    [
        (b"GCC: (Debian 12.2.0-14+deb12u1) 12.2.0", True),
        (b"GCC: (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0", True),
        (b"GCC: (GNU) 11.4.1 20231218 (Red Hat 11.4.1-3)", True),
        (b"GCC: (Ubuntu 13.2.0-23ubuntu4) 13.2.0", False),
        (b"GCC: (GNU) 14.2.1 20240912 (Red Hat 14.2.1-3)", False),
        (b"Ubuntu clang version 18.1.3 (1ubuntu1)", False),
    ],
)
def test_amx_builds_by_an_old_gcc_are_unsafe(tmp_path: Path, comment: bytes, unsafe: bool) -> None:
    lib = library(tmp_path, "libggml-cpu.so.0", comment)
    assert amx_kernels_unsafe(AMX, [lib]) is unsafe
    # Without AMX kernels there is nothing to avoid, whatever the compiler.
    assert amx_kernels_unsafe(NO_AMX, [lib]) is False


def test_the_oldest_gcc_among_the_libraries_decides(tmp_path: Path) -> None:
    new = library(tmp_path, "libllama.so", b"GCC: (GNU) 13.3.0")
    old = library(tmp_path, "libggml-cpu.so", b"GCC: (GNU) 13.3.0", b"GCC: (GNU) 12.2.0")
    assert amx_kernels_unsafe(AMX, [new]) is False
    assert amx_kernels_unsafe(AMX, [new, old]) is True


def test_unknown_libraries_count_as_unsafe(tmp_path: Path) -> None:
    assert amx_kernels_unsafe(AMX, None) is True
    # A library that cannot be read names no compiler: nothing says it is unsafe.
    assert amx_kernels_unsafe(AMX, [tmp_path / "gone.so"]) is False


class _Params(ctypes.Structure):
    _fields_ = [("n_gpu_layers", ctypes.c_int32), ("use_extra_bufts", ctypes.c_bool)]


def fake_binding(info: str, fields: type[ctypes.Structure] = _Params) -> Any:
    """A llama_cpp stand-in whose Llama records the model parameters it starts from."""
    inner = types.SimpleNamespace()

    def defaults() -> Any:
        return fields(n_gpu_layers=0, use_extra_bufts=True)

    inner.llama_model_default_params = defaults

    class Llama:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs
            self.params = inner.llama_model_default_params()

    fake = types.ModuleType("llama_cpp")
    fake.llama_cpp = inner  # type: ignore[attr-defined]
    fake.Llama = Llama  # type: ignore[attr-defined]
    fake.llama_model_params = fields  # type: ignore[attr-defined]
    fake.llama_print_system_info = lambda: info.encode()  # type: ignore[attr-defined]
    return fake


def test_new_llama_loads_without_extra_buffers_where_amx_is_unsafe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = library(tmp_path, "libggml-cpu.so", b"GCC: (Debian 12.2.0-14+deb12u1) 12.2.0")
    monkeypatch.setattr(binding, "_loaded_native_libraries", lambda: [lib])
    fake = fake_binding(AMX)
    defaults = fake.llama_cpp.llama_model_default_params
    llm = new_llama(fake, model_path="m.gguf", n_ctx=64)
    assert llm.kwargs == {"model_path": "m.gguf", "n_ctx": 64}
    assert llm.params.use_extra_bufts is False
    # Only while loading: the binding's defaults are its own again after.
    assert fake.llama_cpp.llama_model_default_params is defaults
    assert defaults().use_extra_bufts is True


def test_new_llama_restores_the_defaults_when_loading_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = library(tmp_path, "libggml-cpu.so", b"GCC: (GNU) 11.5.0")
    monkeypatch.setattr(binding, "_loaded_native_libraries", lambda: [lib])
    fake = fake_binding(AMX)
    defaults = fake.llama_cpp.llama_model_default_params

    def broken(**kwargs: Any) -> Any:
        raise ValueError("failed to load model")

    fake.Llama = broken
    with pytest.raises(ValueError, match="failed to load"):
        new_llama(fake, model_path="m.gguf")
    assert fake.llama_cpp.llama_model_default_params is defaults


@pytest.mark.parametrize("info", [NO_AMX, AMX])
def test_new_llama_leaves_safe_builds_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, info: str
) -> None:
    lib = library(tmp_path, "libggml-cpu.so", b"GCC: (GNU) 13.3.0")
    monkeypatch.setattr(binding, "_loaded_native_libraries", lambda: [lib])
    llm = new_llama(fake_binding(info), model_path="m.gguf")
    assert llm.params.use_extra_bufts is True


def test_a_binding_without_the_setting_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    class Older(ctypes.Structure):
        _fields_ = [("n_gpu_layers", ctypes.c_int32)]

    monkeypatch.setattr(binding, "_loaded_native_libraries", lambda: None)
    fake = fake_binding(AMX, Older)
    fake.llama_cpp.llama_model_default_params = lambda: Older(n_gpu_layers=0)
    assert not hasattr(new_llama(fake, model_path="m.gguf").params, "use_extra_bufts")


@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'edgeproxy[local]')",
)
def test_the_loaded_libraries_are_found() -> None:
    import llama_cpp  # noqa: F401 - maps its libraries into the process

    libraries = binding._loaded_native_libraries()
    assert libraries is not None
    assert any("llama" in lib.name for lib in libraries)
