"""The build backend: setuptools', asking for mypyc as well when a compiled build is wanted.

``EDGEPROXY_COMPILE=1 pip install .`` (or ``-e .``) compiles the hot modules that
``edgeproxy/_core/build.py`` lists; without it the build is pure Python and needs no
compiler and no mypy. mypyc is pinned: the compiled build is tested with this version only,
and a new one can change what compiles and how.
"""

from __future__ import annotations

import configparser
import os
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - this backend is setuptools' plus one want

MYPYC = "mypy==2.4.1"


def _wanted() -> list[str]:
    if os.environ.get("EDGEPROXY_COMPILE") != "1":
        return []
    # mypyc compiles what mypy infers: it needs the libraries the package is typed against
    # (and pydantic's mypy plugin), or it would compile Any where strict mypy saw types.
    config = configparser.ConfigParser()
    config.read("setup.cfg", encoding="utf-8")
    requires = config["options"]["install_requires"].splitlines()
    return [MYPYC, *(line for line in requires if line and not line.startswith("#"))]


def _asking(ask: Any, config_settings: dict[str, Any] | None) -> list[str]:
    # setuptools runs setup.py to collect what it wants, before mypyc is there: setup.py
    # leaves the extensions out while this variable says only that is asked.
    os.environ["EDGEPROXY_BUILD_REQUIRES"] = "1"
    try:
        wanted: list[str] = ask(config_settings)
    finally:
        del os.environ["EDGEPROXY_BUILD_REQUIRES"]
    return wanted + _wanted()


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    return _asking(_setuptools.get_requires_for_build_wheel, config_settings)


def get_requires_for_build_editable(config_settings: dict[str, Any] | None = None) -> list[str]:
    return _asking(_setuptools.get_requires_for_build_editable, config_settings)
