"""The reference of every config key, generated from the field descriptions."""

from __future__ import annotations

import re
import typing
from collections.abc import Iterator

from pydantic import BaseModel

from edgeproxy._core.config.root import Config

__all__ = ["config_docs_markdown", "iter_config_keys"]


def iter_config_keys() -> Iterator[tuple[str, str, str, str]]:
    """Yield ``(key, type, default, description)`` for every documented key."""
    # Every section of the config, in its order: [[regions]] and [[routes]] by their entry.
    sections: list[tuple[str, type[BaseModel]]] = []
    for section, field in Config.model_fields.items():
        model = field.annotation
        if typing.get_origin(model) is list:
            model = typing.get_args(model)[0]
        assert isinstance(model, type) and issubclass(model, BaseModel), section
        sections.append((section, model))
    for section, model in sections:
        yield from _model_keys(section, model)


def _model_keys(prefix: str, model: type[BaseModel]) -> Iterator[tuple[str, str, str, str]]:
    """The keys of one table; a table of named tables (``[redis.connections.<name>]``) has
    its entries' keys listed under ``<name>``."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        type_name = getattr(annotation, "__name__", None) or str(annotation)
        if "[" in str(annotation):
            type_name = re.sub(r"\b(typing|edgeproxy\._core\.config\.\w+)\.", "", str(annotation))
        if field.is_required():
            default = "required"
        elif field.default_factory is not None:
            default = repr(field.default_factory())  # type: ignore[call-arg]
        else:
            default = repr(field.default)
        yield f"{prefix}.{name}", type_name, default, field.description or ""
        entry = typing.get_args(annotation)[-1] if typing.get_origin(annotation) is dict else None
        if isinstance(entry, type) and issubclass(entry, BaseModel):
            yield from _model_keys(f"{prefix}.{name}.<name>", entry)


def config_docs_markdown() -> str:
    """A markdown table of every config key, for the README."""
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key, type_name, default, desc in iter_config_keys():
        rows.append(f"| `{key}` | `{type_name}` | `{default}` | {desc} |")
    return "\n".join(rows)
