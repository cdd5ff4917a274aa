"""The one config error, and pydantic's errors as ``key: reason`` lines."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

__all__ = ["ConfigError", "format_errors"]

# Values of keys whose names say they are secrets are never echoed in an error.
_SECRET_PARTS = ("password", "token", "secret", "api_key", "key_file", "credential")
# The errors that show the value they got: a wrong type or a number out of range. Not the
# checks of our own validators (value_error): they say what is wrong in words, and their
# values are URLs and paths that may carry credentials.
_ECHOED_SUFFIXES = ("_type", "_parsing", "greater_than", "less_than", "_equal", "literal_error")


class ConfigError(ValueError):
    """The configuration is invalid. ``errors`` holds one ``key: reason`` line per problem."""

    def __init__(self, errors: list[str], *, source: str | None = None) -> None:
        self.errors = errors
        self.source = source
        where = f" in {source}" if source else ""
        super().__init__(f"invalid configuration{where}:\n  " + "\n  ".join(errors))


def format_errors(
    exc: ValidationError,
    *,
    model: type[BaseModel] | None = None,
    origins: Mapping[tuple[Any, ...], str] | None = None,
) -> list[str]:
    """One ``key: reason`` line per problem, keys written as TOML writes them.

    With ``model`` (the config's class), an unknown key gets the closest known key of its
    table as a suggestion; with ``origins`` (where environment variables set keys, as
    :func:`~edgeproxy._core.config.env.apply_env` returns them), a key an environment
    variable set names that variable as its source. A type or range error shows the value
    it got, unless the key looks like a secret."""
    lines = []
    for err in exc.errors():
        loc = ""
        for part in err["loc"]:
            if isinstance(part, int):
                loc += f"[{part}]"
            else:
                # A key that is empty or not a bare TOML key is shown quoted, as TOML writes it.
                name = str(part)
                if not name or not name.replace("_", "").replace("-", "").isalnum():
                    name = '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
                loc += f".{name}" if loc else name
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        path = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            known = _known_keys(model, path[:-1]) if model is not None else []
            close = difflib.get_close_matches(str(path[-1]), known, n=1, cutoff=0.6)
            if close:
                msg += f"; did you mean '{close[0]}'?"
        elif _echoes(err["type"]) and "input" in err and not _secret(path, err["input"]):
            msg += f" (got {_shown(err['input'])})"
        if origins:
            variable = _origin(origins, path)
            if variable is not None:
                loc = f"{loc} (from the environment variable {variable})"
            elif not loc:
                msg = _named_origin(origins, msg)
        if loc:
            lines.append(f"{loc}: {msg}")
        else:
            lines.append(msg)
    return lines


def _origin(origins: Mapping[tuple[Any, ...], str], path: tuple[Any, ...]) -> str | None:
    """The variable that set ``path``, or a table above it."""
    for end in range(len(path), 0, -1):
        found = origins.get(path[:end])
        if found is not None:
            return found
    return None


def _named_origin(origins: Mapping[tuple[Any, ...], str], msg: str) -> str:
    """A check of the whole config names its key first (``cache.redis: ...``): the variable
    that set that key, if one did, goes beside it as beside a field's."""
    key, sep, reason = msg.partition(": ")
    variable = origins.get(tuple(key.split("."))) if sep and " " not in key else None
    if variable is None:
        return msg
    return f"{key} (from the environment variable {variable}): {reason}"


def _echoes(kind: str) -> bool:
    return kind.endswith(_ECHOED_SUFFIXES) or kind in ("literal_error", "enum")


def _secret(path: tuple[Any, ...], value: Any) -> bool:
    """A key named like a secret, or a value that may hold one (a URL's credentials)."""
    if any(part in str(name).lower() for name in path for part in _SECRET_PARTS):
        return True
    return isinstance(value, str) and ("@" in value or "://" in value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _known_keys(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    """The keys of the table at ``path`` of ``model`` (list indexes and dict keys walked
    through their item types); none when the path leads elsewhere."""
    current: Any = model
    for part in path:
        if isinstance(part, int):
            current = _item_type(current, list)
        elif isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            if field is None:
                return []
            current = _model_in(field.annotation)
        else:
            current = _item_type(current, dict)
        if current is None:
            return []
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _model_in(annotation: Any) -> Any:
    """The model class, or the list or dict of them, that ``annotation`` holds."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
        return None
    if origin in (list, dict):
        return annotation
    return None


def _item_type(container: Any, kind: type) -> Any:
    if typing.get_origin(container) is not kind:
        return None
    args = typing.get_args(container)
    return _model_in(args[-1]) if args else None
