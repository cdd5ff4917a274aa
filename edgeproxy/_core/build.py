"""Which build of the package runs: pure Python, or with its hot modules compiled by mypyc.

``COMPILED`` is the one list of the modules a compiled build compiles: ``setup.py`` reads
it (as a literal, without importing the package) when ``EDGEPROXY_COMPILE=1``, and
:func:`build` looks at how each of them was loaded. The list holds the modules that
``bench/instr_profile.py --by-module`` finds costliest per request or per streamed event
and that compile as they are; the rest stay Python either way (``docs/performance.md``
has the figures, and what kept the others out).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from functools import cache
from typing import Final

__all__ = ["COMPILED", "build", "compiled_modules"]

COMPILED: Final = (
    "edgeproxy._admission.admission",
    "edgeproxy._admission.poison",
    "edgeproxy._answer.body",
    "edgeproxy._answer.responder",
    "edgeproxy._cache.keys",
    "edgeproxy._cache.known",
    "edgeproxy._core.answer",
    "edgeproxy._core.response",
    "edgeproxy._http2.fields",
    "edgeproxy._http2.frames",
    "edgeproxy._http2.staticpack",
    "edgeproxy._http2.windows",
    "edgeproxy._observability.recent",
    "edgeproxy._observability.requestmetrics",
    "edgeproxy._obtain.attempt",
    "edgeproxy._obtain.budget",
    "edgeproxy._obtain.deadlines",
    "edgeproxy._obtain.failover",
    "edgeproxy._obtain.forward",
    "edgeproxy._obtain.record",
    "edgeproxy._protocol.clientip",
    "edgeproxy._protocol.endpoints",
    "edgeproxy._protocol.headers",
    "edgeproxy._protocol.sse",
    "edgeproxy._protocol.usage",
    "edgeproxy._upstream.h2conn",
    "edgeproxy._upstream.h2frames",
    "edgeproxy._upstream.h2head",
    "edgeproxy._upstream.h2send",
    "edgeproxy._upstream.h2stream",
    "edgeproxy._upstream.http1",
)


@cache
def compiled_modules() -> tuple[str, ...]:
    """The modules of :data:`COMPILED` that this process loads as compiled extensions."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found = []
    for name in COMPILED:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None and spec.origin.endswith(suffixes):
            found.append(name)
    return tuple(found)


def build() -> str:
    """The build in words, as ``edgeproxy --version`` and ``/status`` give it: ``"pure
    Python"``, ``"compiled (mypyc, 31 modules)"``, or a partial one named as such (a
    compiled module missing means an install that mixes builds, worth knowing)."""
    count = len(compiled_modules())
    if count == 0:
        return "pure Python"
    if count == len(COMPILED):
        return f"compiled (mypyc, {count} modules)"
    return f"partly compiled (mypyc, {count} of {len(COMPILED)} modules)"
