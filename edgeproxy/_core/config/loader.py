"""Loading a TOML config file into a :class:`Config`."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from edgeproxy._core.config.errors import ConfigError
from edgeproxy._core.config.root import Config

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG_PATH",
    "ConfigPath",
    "config_from_mapping",
    "find_config",
    "load_config",
    "load_found",
]

CONFIG_ENV: Final = "EDGEPROXY_CONFIG"
"""The variable that names the config file when ``--config`` is not given."""

DEFAULT_CONFIG_PATH: Final = "/etc/edgeproxy/edge.toml"
"""The config file read when neither ``--config`` nor ``EDGEPROXY_CONFIG`` names one:
where the container image and the systemd unit keep it."""


@dataclass(frozen=True, slots=True)
class ConfigPath:
    """The config file a command reads, and what named it."""

    path: str
    origin: str
    """``--config``, ``EDGEPROXY_CONFIG`` or ``the default path``."""

    @property
    def named(self) -> bool:
        """Whether the operator named the file (a flag or the variable), not the default."""
        return self.origin != "the default path"

    def describe(self) -> str:
        """The file as errors name it: its path, and what named it unless a flag did."""
        if self.origin == "--config":
            return self.path
        return f"{self.path} ({'from ' if self.named else ''}{self.origin})"


def find_config(flag: str | None, environ: Mapping[str, str] | None = None) -> ConfigPath:
    """The config file of a command: ``--config`` (``flag``), else ``EDGEPROXY_CONFIG``
    of ``environ`` (``os.environ`` when None), else :data:`DEFAULT_CONFIG_PATH`. The one
    rule for ``serve``, ``check-config`` and the operator's commands."""
    if flag:
        return ConfigPath(flag, "--config")
    named = (os.environ if environ is None else environ).get(CONFIG_ENV)
    if named:
        return ConfigPath(named, CONFIG_ENV)
    return ConfigPath(DEFAULT_CONFIG_PATH, "the default path")


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


def load_found(found: ConfigPath, *, environ: Mapping[str, str] | None = None) -> Config:
    """:func:`load_config` of the file :func:`find_config` found; its errors name what
    named the file, and a missing default says how to name one."""
    try:
        return load_config(found.path, environ=environ)
    except ConfigError as exc:
        errors = exc.errors
        if not found.named and not Path(found.path).exists():
            errors = [f"no such file: give --config PATH or set {CONFIG_ENV}"]
        raise ConfigError(errors, source=found.describe()) from None
