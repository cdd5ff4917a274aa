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
from ._pool import (
    PoolLimits,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from ._server import EdgeProxy

__version__ = "0.1.0"

__all__ = [
    "AdminConfig",
    "Config",
    "ConfigError",
    "EdgeProxy",
    "PluginsConfig",
    "PoolLimits",
    "PopConfig",
    "RegionConfig",
    "ServerConfig",
    "UpstreamConfig",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamTimeout",
    "__version__",
    "load_config",
]
