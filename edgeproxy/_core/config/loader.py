"""Loading a TOML config file into a :class:`Config`."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgeproxy._core.config.errors import ConfigError
from edgeproxy._core.config.root import Config

__all__ = ["config_from_mapping", "load_config"]


def config_from_mapping(
    data: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    source: str | None = None,
) -> Config:
    """The same as :meth:`Config.from_mapping`, kept for existing callers."""
    return Config.from_mapping(data, environ=environ, source=source)


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> Config:
    """Load and validate a TOML config file. Raises :class:`ConfigError` naming every bad key."""
    source = os.fspath(path)
    try:
        raw = Path(source).read_bytes()
    except OSError as exc:
        raise ConfigError(
            [f"cannot read config file: {exc.strerror or exc}"], source=source
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config file is not UTF-8: {exc}"], source=source) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"TOML syntax error: {exc}"], source=source) from None
    except (ValueError, RecursionError) as exc:
        # tomllib's limits: an integer over 4300 digits, arrays or tables nested too deep.
        raise ConfigError([f"TOML not readable: {exc}"], source=source) from None
    return Config.from_mapping(
        data, environ=environ, base_dir=Path(source).resolve().parent, source=source
    )
