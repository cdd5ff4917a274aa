"""The two builds: pure Python, and the hot modules compiled by mypyc (``EDGEPROXY_COMPILE=1``).

The list of compiled modules has one home (``edgeproxy/_core/build.py``), which setup.py
reads without importing the package; the process says which build it runs, in
``edgeproxy --version`` and ``/status``. CI runs the whole suite on each build and sets
``EDGEPROXY_EXPECT_BUILD``, so a compiled run that silently imported the Python modules
fails here instead of passing as a second pure run."""

from __future__ import annotations

import ast
import importlib.util
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from edgeproxy._core.build import COMPILED, build, compiled_modules
from edgeproxy._core.version import __version__

from .conftest import ProxyFactory, RegionFactory

ROOT = Path(__file__).resolve().parent.parent


def test_every_listed_module_exists_and_is_sorted() -> None:
    assert list(COMPILED) == sorted(set(COMPILED))
    for name in COMPILED:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name


def test_setup_py_reads_the_same_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("EDGEPROXY_COMPILE", raising=False)
    # run_name other than __main__ with setup() stubbed: only the reader is wanted.
    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    names = runpy.run_path(str(ROOT / "setup.py"))["_compiled_modules"]()
    assert tuple(names) == COMPILED


def test_the_backend_asks_for_mypyc_only_for_the_compiled_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("edgeproxy_backend", ROOT / "_build/backend.py")
    assert spec is not None and spec.loader is not None
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    monkeypatch.delenv("EDGEPROXY_COMPILE", raising=False)
    assert backend._wanted() == []
    monkeypatch.setenv("EDGEPROXY_COMPILE", "1")
    wanted = backend._wanted()
    assert wanted[0] == backend.MYPYC and wanted[0].startswith("mypy==")
    # The libraries the package is typed against, so that mypyc compiles what mypy checks.
    assert any(req.startswith("aiohttp") for req in wanted)
    assert any(req.startswith("pydantic") for req in wanted)


def test_the_build_is_the_one_ci_asked_for() -> None:
    expected = os.environ.get("EDGEPROXY_EXPECT_BUILD")
    if expected == "compiled":
        assert compiled_modules() == COMPILED, sorted(set(COMPILED) - set(compiled_modules()))
        assert build() == f"compiled (mypyc, {len(COMPILED)} modules)"
    elif expected == "pure":
        assert compiled_modules() == () and build() == "pure Python"
    else:
        # Not under CI: whichever it is, it is named, and a mix is called one.
        assert build() in {"pure Python", f"compiled (mypyc, {len(COMPILED)} modules)"}


def test_version_names_the_build() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "edgeproxy", "--version"],
        capture_output=True,
        text=True,
        check=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    ).stdout
    assert out.strip() == f"edgeproxy {__version__} ({build()})"


async def test_status_names_the_build(make_region: RegionFactory, make_proxy: ProxyFactory) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([{"name": "r1", "url": region.url}])
    assert proxy.status()["build"] == build()


def _except_names_bound_to_two_types(tree: ast.AST) -> list[str]:
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        types: dict[str, set[str]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                types.setdefault(node.name, set()).add(ast.unparse(node.type))
        found += [f"{function.name}: {name}" for name, seen in types.items() if len(seen) > 1]
    return found


def test_compiled_modules_never_rebind_an_except_name_to_another_type() -> None:
    # mypyc types an ``except E as name`` variable by the first clause that binds it in the
    # function: a later ``except F as name`` then fails with TypeError in the compiled build
    # (found when these modules were first compiled), while Python runs it fine.
    for name in COMPILED:
        path = ROOT / (name.replace(".", "/") + ".py")
        assert _except_names_bound_to_two_types(ast.parse(path.read_text())) == [], name
