"""The package ships whole: every package folder of the tree is listed in setup.cfg, so a
wheel (not only an editable install) holds every module."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def listed() -> set[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return {line.strip() for line in config["options"]["packages"].splitlines() if line.strip()}


def test_every_package_of_the_tree_is_listed() -> None:
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "edgeproxy").rglob("__init__.py")
    }
    assert found <= listed(), sorted(found - listed())
    # Besides them: the status page's folder, and plugins/ installed as edgeproxy.plugins.
    assert listed() - found == {"edgeproxy.static", "edgeproxy.plugins"}
