"""The public API is complete: plugins and examples import nothing private from edgeproxy."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import orjson
import pytest

import edgeproxy

ROOT = Path(__file__).parent.parent
SCANNED = sorted(
    path.relative_to(ROOT).as_posix()
    for folder in ("plugins", "examples")
    for path in (ROOT / folder).rglob("*.py")
)


def private_imports(source: str) -> list[str]:
    """Each import of a private edgeproxy module or name in ``source``, as ``line: module``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "edgeproxy":
                modules += [
                    f"edgeproxy.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and alias.name != "__version__"
                ]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            modules = [node.args[0].value]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "edgeproxy" and any(p.startswith("_") for p in parts[1:]):
                found.append(f"{node.lineno}: {module}")
    return found


def test_the_scan_finds_plugins_and_examples() -> None:
    assert "plugins/apikey_auth.py" in SCANNED
    assert "examples/tenant_policy.py" in SCANNED
    assert any(path.startswith("examples/multi_pop/") for path in SCANNED)


def test_the_scan_catches_every_form_of_private_import() -> None:
    source = """
import edgeproxy._core.errors
from edgeproxy._core.config import Config
from edgeproxy import _pipeline, __version__, hookimpl
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from edgeproxy._routing.geo import GeoStage
importlib.import_module("edgeproxy._server.app")
from edgeproxy import Config, error_response
from . import sibling
"""
    assert private_imports(source) == [
        "2: edgeproxy._core.errors",
        "3: edgeproxy._core.config",
        "4: edgeproxy._pipeline",
        "7: edgeproxy._routing.geo",
        "8: edgeproxy._server.app",
    ]


@pytest.mark.parametrize("path", SCANNED)
def test_plugins_and_examples_import_only_the_public_api(path: str) -> None:
    found = private_imports((ROOT / path).read_text(encoding="utf-8"))
    assert not found, f"{path} imports private edgeproxy modules: {found}"


def test_all_is_sorted_and_every_name_imports() -> None:
    assert edgeproxy.__all__ == sorted(edgeproxy.__all__)
    assert len(set(edgeproxy.__all__)) == len(edgeproxy.__all__)
    namespace: dict[str, object] = {}
    for name in edgeproxy.__all__:
        exec(f"from edgeproxy import {name}", namespace)
        assert namespace[name] is getattr(importlib.import_module("edgeproxy"), name)
    # Nothing public is left out of __all__ (submodules aside).
    public = {
        name
        for name, value in vars(edgeproxy).items()
        if not name.startswith("_") and not isinstance(value, type(edgeproxy))
    }
    assert public <= set(edgeproxy.__all__), public - set(edgeproxy.__all__)


def test_extenders_get_errors_in_the_openai_shape() -> None:
    from edgeproxy import ProxyError, error_response

    assert {"ProxyError", "error_response", "Config", "AccessLogConfig"} <= set(edgeproxy.__all__)
    resp = error_response(
        403, "invalid_request_error", "no", code="model_not_allowed", headers={"X-A": "1"}
    )
    assert resp.status == 403 and resp.headers["X-A"] == "1"
    assert resp.content_type == "application/json"
    assert isinstance(resp.body, bytes)
    assert orjson.loads(resp.body) == {
        "error": {
            "message": "no",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_allowed",
        }
    }
    error = ProxyError(429, "rate_limit_exceeded", "slow down", headers={"Retry-After": "1"})
    assert (error.status, error.type, error.message) == (429, "rate_limit_exceeded", "slow down")
    assert error.headers == {"Retry-After": "1"}
