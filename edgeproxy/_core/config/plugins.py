"""Plugins to load and their settings: ``[plugins]``."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from edgeproxy._core.config.base import Section

__all__ = ["PluginsConfig"]


class PluginsConfig(Section):
    """Plugins to load, with their settings under ``[plugins.settings.NAME]``."""

    enabled: list[str] = Field(
        default_factory=list,
        description="Plugins by dotted module path or .py file path, loaded at app creation.",
    )
    entry_points: bool = Field(
        True,
        description="Also load plugins registered in the 'edgeproxy.plugins' entry-point group.",
    )
    fail_open: list[str] = Field(
        default_factory=list,
        description="Plugins whose request-time errors are logged and skipped instead of a 500.",
    )
    settings: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-plugin settings, keyed by the plugin's name."
    )
