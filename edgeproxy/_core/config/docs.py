"""The reference of every config key, generated from the field descriptions."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel

from edgeproxy._core.config.admission import AdmissionConfig
from edgeproxy._core.config.cache import CacheConfig
from edgeproxy._core.config.geo import GeoConfig
from edgeproxy._core.config.local_model import LocalModelConfig
from edgeproxy._core.config.observability import AccessLogConfig, MetricsConfig, TracingConfig
from edgeproxy._core.config.plugins import PluginsConfig
from edgeproxy._core.config.redis import RedisConfig
from edgeproxy._core.config.routes import RouteConfig
from edgeproxy._core.config.routing import HealthConfig, RoutingConfig
from edgeproxy._core.config.server import AdminConfig, LimitsConfig, PopConfig, ServerConfig
from edgeproxy._core.config.sharedload import SharedLoadConfig
from edgeproxy._core.config.upstream import RegionConfig, UpstreamConfig

__all__ = ["config_docs_markdown", "iter_config_keys"]


def iter_config_keys() -> Iterator[tuple[str, str, str, str]]:
    """Yield ``(key, type, default, description)`` for every documented key."""
    sections: list[tuple[str, type[BaseModel]]] = [
        ("server", ServerConfig),
        ("admin", AdminConfig),
        ("pop", PopConfig),
        ("upstream", UpstreamConfig),
        ("regions", RegionConfig),
        ("routes", RouteConfig),
        ("plugins", PluginsConfig),
        ("redis", RedisConfig),
        ("cache", CacheConfig),
        ("metrics", MetricsConfig),
        ("tracing", TracingConfig),
        ("access_log", AccessLogConfig),
        ("local_model", LocalModelConfig),
        ("routing", RoutingConfig),
        ("health", HealthConfig),
        ("shared_load", SharedLoadConfig),
        ("geo", GeoConfig),
        ("admission", AdmissionConfig),
        ("limits", LimitsConfig),
    ]
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
