"""edgeproxy: an asyncio edge-to-region reverse proxy for OpenAI-compatible LLM APIs."""

from ._config import (
    AdminConfig,
    Config,
    ConfigError,
    PluginsConfig,
    PopConfig,
    RegionConfig,
    ServerConfig,
    UpstreamConfig,
    load_config,
)
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
    "AdminConfig",
    "Config",
    "ConfigError",
    "EdgeProxy",
    "PluginError",
    "PluginLoadError",
    "PluginsConfig",
    "PoolLimits",
    "PopConfig",
    "RegionConfig",
    "RequestContext",
    "ServerConfig",
    "UpstreamConfig",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamReply",
    "UpstreamTimeout",
    "__version__",
    "hookimpl",
    "load_config",
]
