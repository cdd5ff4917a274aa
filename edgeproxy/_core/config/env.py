"""``EDGEPROXY_*`` environment overrides of config keys."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from typing import Any

__all__ = ["ENV_PREFIX", "apply_env", "deep_copy"]

ENV_PREFIX = "EDGEPROXY_"


def _coerce_env_value(raw: str) -> Any:
    """Parse an environment value as a TOML value, falling back to a plain string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except (ValueError, RecursionError):
        # TOMLDecodeError, or tomllib's limits: over 4300 digits, nesting too deep.
        return raw


def apply_env(data: dict[str, Any], environ: Mapping[str, str]) -> dict[tuple[Any, ...], str]:
    """Apply ``EDGEPROXY_SECTION__KEY`` and ``EDGEPROXY_REGIONS__<name|index>__KEY`` overrides.

    Returns where each one went (``("server", "port")``, ``("regions", 0, "url")``) and the
    variable that set it, so that an error about that key names the variable as its source."""
    origins: dict[tuple[Any, ...], str] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        value = _coerce_env_value(raw)
        if path[0] == "regions" and len(path) == 3:
            regions = data.setdefault("regions", [])
            if not isinstance(regions, list):
                continue  # not an array of tables: validation says so
            target = None
            key = path[1]  # ASCII digits: int() also reads "٣" and refuses "²" or 5000 digits
            if key.isascii() and key.isdigit() and len(key) < 10 and int(key) < len(regions):
                target = regions[int(key)]
            else:
                for region in regions:
                    if (
                        isinstance(region, dict)
                        and str(region.get("name", "")).lower().replace("-", "_") == path[1]
                    ):
                        target = region
            if isinstance(target, dict):
                target[path[2]] = value
                origins[("regions", regions.index(target), path[2])] = name
            continue
        if len(path) == 2:
            section = data.setdefault(path[0], {})
            if isinstance(section, dict):
                section[path[1]] = value
                origins[(path[0], path[1])] = name
    return origins


def deep_copy(data: Any) -> Any:
    """A copy of nested mappings and lists, so that overrides never touch the caller's data."""
    if isinstance(data, Mapping):
        return {k: deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [deep_copy(v) for v in data]
    return data
