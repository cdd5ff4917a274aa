"""Checks of model names, shared by ``[[regions]]`` and ``[local_model]``.

A model name is matched exactly, or as an ``fnmatch``-style glob (``*``, ``?``,
``[...]``) when it holds one of those characters; matching is case-sensitive.
"""

from __future__ import annotations

import fnmatch
from typing import Annotated

from pydantic import AfterValidator

__all__ = [
    "GLOB_CHARS",
    "ModelNames",
    "check_model_aliases",
    "check_model_names",
    "is_model_glob",
]

GLOB_CHARS = frozenset("*?[")
"""The characters that make a model name a glob."""

# Names echoed in error messages are cut to this length.
_SHOWN = 80


def is_model_glob(name: str) -> bool:
    """Whether ``name`` is a glob (``"llama-3*"``) rather than one model's name."""
    return not GLOB_CHARS.isdisjoint(name)


def _shown(name: str) -> str:
    return repr(name if len(name) <= _SHOWN else name[:_SHOWN] + "...")


def _check_name(name: str, where: str) -> None:
    if not name.strip():
        raise ValueError(f"{where} is empty")
    if name != name.strip():
        raise ValueError(f"{where} {_shown(name)} has leading or trailing whitespace")


def check_model_names(names: list[str]) -> list[str]:
    """``names`` if every entry is a non-empty name listed once; else ``ValueError``."""
    seen: set[str] = set()
    for index, name in enumerate(names):
        _check_name(name, f"entry {index}")
        if name in seen:
            raise ValueError(f"{_shown(name)} is listed twice")
        seen.add(name)
    return names


def check_model_aliases(aliases: dict[str, str], models: list[str] | None) -> dict[str, str]:
    """``aliases`` (client name -> the region's name) if each is sound against ``models``.

    Both sides are concrete names (no globs) and differ; a client name is not
    also listed in ``models`` (it would be served under two names); when
    ``models`` lists any, every target is one of them (exactly or by a glob).
    """
    for client, target in aliases.items():
        _check_name(client, "an alias name")
        _check_name(target, f"the target of alias {_shown(client)}")
        if is_model_glob(client):
            raise ValueError(f"alias {_shown(client)} is a glob: an alias names one model")
        if is_model_glob(target):
            raise ValueError(
                f"alias {_shown(client)} targets the glob {_shown(target)}: "
                "a target names the one model the region is sent"
            )
        if client == target:
            raise ValueError(f"alias {_shown(client)} names itself")
        if not models:
            continue
        if client in models:
            raise ValueError(
                f"alias {_shown(client)} is also listed in models: "
                "a name is either served as it is or aliased"
            )
        if target not in models and not any(
            is_model_glob(m) and fnmatch.fnmatchcase(target, m) for m in models
        ):
            raise ValueError(
                f"alias {_shown(client)} targets {_shown(target)}, "
                "which is not among this region's models"
            )
    return aliases


ModelNames = Annotated[list[str], AfterValidator(check_model_names)]
"""A list of model names, each non-empty and listed once."""
