"""The checks across [[regions]], [[routes]] and [local_model] that read names and
lists only: they run on the parsed data as well as on the validated config, so that
``check-config`` reports them beside the errors of the fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edgeproxy._core.config.routes import DEFAULT_FALLBACK

__all__ = ["structure_problems"]


def structure_problems(data: Mapping[str, Any]) -> list[str]:
    """One ``key: reason`` line per problem of ``data`` (the config's shape, parsed or
    dumped). Entries that are not tables, and values of the wrong type, are skipped:
    the fields' own errors name them."""
    problems: list[str] = []
    raw_regions = data.get("regions")
    regions = _tables(raw_regions)
    if raw_regions is None or raw_regions == []:
        problems.append("regions: at least one [[regions]] entry is required")
    problems += _duplicates("region", regions)
    routes = _tables(data.get("routes"))
    problems += _duplicates("route", routes)
    local = data.get("local_model")
    if not (isinstance(local, Mapping) and local.get("path")):
        for index, route in routes:
            rungs = route.get("fallback")
            # The default ladder lists 'local' for whoever configures the model; a ladder
            # written out otherwise means it.
            if isinstance(rungs, list) and "local" in rungs and tuple(rungs) != DEFAULT_FALLBACK:
                problems.append(
                    f"routes[{index}].fallback: lists 'local' but [local_model] path is not "
                    "set, so that rung would never answer: set [local_model] path (or "
                    "EDGEPROXY_LOCAL_MODEL__PATH) or drop 'local'"
                )
    return problems


def _tables(value: Any) -> list[tuple[int, Mapping[str, Any]]]:
    if not isinstance(value, list):
        return []
    return [(i, entry) for i, entry in enumerate(value) if isinstance(entry, Mapping)]


def _duplicates(kind: str, tables: list[tuple[int, Mapping[str, Any]]]) -> list[str]:
    seen: set[str] = set()
    reported: set[str] = set()
    problems = []
    for _, table in tables:
        name = table.get("name")
        if not isinstance(name, str):
            continue
        if name in seen and name not in reported:
            problems.append(f"{kind}s: duplicate {kind} name {name!r}")
            reported.add(name)
        seen.add(name)
    return problems
