"""llama-cpp-python's OpenAI server, its models loaded as the proxy loads its own.

``python -m edgeproxy.testing._llama_server ARGS`` is ``python -m llama_cpp.server ARGS``
(the same arguments, the same entry point, run unchanged), except that every
``llama_cpp.Llama`` it creates loads inside :func:`edgeproxy._local.binding.clear_of_amx`:
where llama.cpp was built with AMX kernels by a GCC before 13, which miscompiles their tile
setup (a SIGSEGV on the first prompt of more than one token), the model is loaded without
llama.cpp's extra buffer types, the setting the server's command line cannot give. Elsewhere
nothing changes. The tests run real llama.cpp regions with it (``llama_servers`` in
``tests/conftest.py``).
"""

from __future__ import annotations

import functools
import runpy
from typing import Any

__all__ = ["main"]


def _load_clear_of_amx() -> None:
    """Wrap ``llama_cpp.Llama.__init__`` in :func:`~edgeproxy._local.binding.clear_of_amx`."""
    import llama_cpp

    from edgeproxy._local.binding import clear_of_amx

    llama = llama_cpp.Llama
    load = llama.__init__
    if getattr(load, "_edgeproxy_clear_of_amx", False):
        return

    @functools.wraps(load)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        with clear_of_amx(llama_cpp):
            load(self, *args, **kwargs)

    __init__._edgeproxy_clear_of_amx = True  # type: ignore[attr-defined]
    llama.__init__ = __init__  # type: ignore[method-assign]


def main() -> None:
    _load_clear_of_amx()
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
