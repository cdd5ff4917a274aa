"""edgeproxy: an asyncio edge-to-region reverse proxy for OpenAI-compatible LLM APIs."""

from ._config import (
    AccessLogConfig,
    AdminConfig,
    AdmissionConfig,
    CacheConfig,
    Config,
    ConfigError,
    GeoConfig,
    HealthConfig,
    LimitsConfig,
    LocalModelConfig,
    MetricsConfig,
    PluginsConfig,
    PopConfig,
    RegionConfig,
    RouteConfig,
    RoutingConfig,
    ServerConfig,
    TracingConfig,
    UpstreamConfig,
    load_config,
)
from ._geo import parse_lat_lon
from ._pipeline import RequestContext, UpstreamReply
from ._plugins import PluginError, PluginLoadError
from ._pool import (
    PoolLimits,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from ._server import EdgeProxy
from .hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "AccessLogConfig",
    "AdminConfig",
    "AdmissionConfig",
    "CacheConfig",
    "Config",
    "ConfigError",
    "EdgeProxy",
    "GeoConfig",
    "HealthConfig",
    "LimitsConfig",
    "LocalModelConfig",
    "MetricsConfig",
    "PluginError",
    "PluginLoadError",
    "PluginsConfig",
    "PoolLimits",
    "PopConfig",
    "RegionConfig",
    "RequestContext",
    "RouteConfig",
    "RoutingConfig",
    "ServerConfig",
    "TracingConfig",
    "UpstreamConfig",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamReply",
    "UpstreamTimeout",
    "__version__",
    "hookimpl",
    "load_config",
    "parse_lat_lon",
]
