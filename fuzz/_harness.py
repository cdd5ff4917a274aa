"""What every harness shares: atheris when present, and the checks of a property.

A harness is importable without atheris: its ``test_one_input`` then runs
plain (the test suite replays the checked-in corpus that way), and only
``python fuzz/fuzz_<target>.py`` needs atheris to fuzz. Harnesses read their
input in a simple format of their own, not through FuzzedDataProvider, so a
file means the same with or without atheris and the seeds stay readable.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

try:
    import atheris
except ImportError:  # the corpus still replays without it
    atheris = None


class PropertyViolation(AssertionError):
    """An invariant of a target did not hold: a finding, like an unexpected exception."""


def check(condition: object, message: str, *context: Any) -> None:
    """``assert`` that survives ``python -O`` and says what it saw."""
    if not condition:
        detail = ", ".join(repr(c)[:200] for c in context)
        raise PropertyViolation(f"{message}: {detail}" if detail else message)


def _functions(module: ModuleType) -> Iterator[Any]:
    """The Python functions a module defines, its classes' methods and properties included."""
    for value in vars(module).values():
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if isinstance(value, types.FunctionType):
            yield value
        elif isinstance(value, type):
            for member in vars(value).values():
                if isinstance(member, staticmethod | classmethod):
                    member = member.__func__
                if isinstance(member, property):
                    yield from (f for f in (member.fget, member.fset, member.fdel) if f)
                elif isinstance(member, types.FunctionType):
                    yield member


def instrument(*prefixes: str) -> int:
    """Add coverage instrumentation to the functions of the loaded modules named by ``prefixes``
    (each a module and its submodules); the number of functions instrumented.

    Only these are instrumented, not whole top-level packages as
    ``atheris.instrument_imports`` does: the coverage the fuzzer steers by is
    the target's own, and start-up stays short.
    """
    assert atheris is not None
    count = 0
    for name, module in list(sys.modules.items()):
        if not any(name == p or name.startswith(p + ".") for p in prefixes):
            continue
        for function in _functions(module):
            atheris.instrument_func(function)
            count += 1
    return count


def fuzz(test_one_input: Callable[[bytes], None], *modules: str) -> None:
    """Run ``test_one_input`` under atheris with the command line's libFuzzer arguments,
    coverage taken from ``modules`` (module names; each with its submodules)."""
    if atheris is None:
        sys.exit("atheris is not installed: pip install atheris")
    count = instrument(*modules)
    print(f"INFO: instrumented {count} functions of {', '.join(modules)}", file=sys.stderr)
    # The project's tests turn warnings into errors; so does fuzzing.
    warnings.simplefilter("error")
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
