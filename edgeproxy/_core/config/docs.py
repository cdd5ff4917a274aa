"""The reference of every config key, generated from the field descriptions."""

from __future__ import annotations

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
        for name, field in model.model_fields.items():
            annotation = field.annotation
            type_name = getattr(annotation, "__name__", None) or str(annotation)
            type_name = (
                str(annotation).replace("typing.", "") if "[" in str(annotation) else type_name
            )
            if field.is_required():
                default = "required"
            elif field.default_factory is not None:
                default = repr(field.default_factory())  # type: ignore[call-arg]
            else:
                default = repr(field.default)
            yield f"{section}.{name}", type_name, default, field.description or ""


def config_docs_markdown() -> str:
    """A markdown table of every config key, for the README."""
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key, type_name, default, desc in iter_config_keys():
        rows.append(f"| `{key}` | `{type_name}` | `{default}` | {desc} |")
    return "\n".join(rows)
