"""Everything about the package is in setup.cfg; this file only adds the compiled build.

With ``EDGEPROXY_COMPILE=1`` the modules that ``edgeproxy/_core/build.py`` lists are
compiled by mypyc (a C compiler and the Python headers needed); with anything else, or
unset, the package is pure Python. ``edgeproxy --version`` and the admin ``/status`` say
which build runs.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

from setuptools import setup


def _compiled_modules() -> list[str]:
    # Read as a literal: the package's dependencies need not be installed to build it.
    tree = ast.parse(Path("edgeproxy/_core/build.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "COMPILED" for t in targets):
                assert node.value is not None
                return list(ast.literal_eval(node.value))
    raise RuntimeError("edgeproxy/_core/build.py has no COMPILED list")


if os.environ.get("EDGEPROXY_COMPILE") == "1" and not os.environ.get("EDGEPROXY_BUILD_REQUIRES"):
    # Past the backend's question of what the build needs: mypyc must be there now (a
    # missing one is an error, never a pure build passed off as the compiled one).
    from mypyc.build import mypycify

    paths = [name.replace(".", "/") + ".py" for name in _compiled_modules()]
    # The optional extras' libraries (numpy, OpenTelemetry...) are not in the build's
    # environment; no compiled module uses them, and the modules that do are type-checked
    # against them by the lint gate, not here.
    options = ["--ignore-missing-imports"]
    setup(ext_modules=mypycify([*options, *paths], opt_level="3", debug_level="0"))
else:
    setup()
