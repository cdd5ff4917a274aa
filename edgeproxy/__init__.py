"""edgeproxy: an asyncio edge-to-region reverse proxy for OpenAI-compatible LLM APIs."""

from edgeproxy._core.config import (
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
    RedisConfig,
    RegionConfig,
    RouteConfig,
    RoutingConfig,
    ServerConfig,
    SharedLoadConfig,
    StatefulConfig,
    TracingConfig,
    UpstreamConfig,
    WebSocketConfig,
    load_config,
)
from edgeproxy._core.context import RequestContext, UpstreamReply
from edgeproxy._core.errors import ProxyError, error_response
from edgeproxy._core.exchange import Exchange, TlsInfo
from edgeproxy._core.outcome import SessionTotals
from edgeproxy._core.response import Response, StreamResponse
from edgeproxy._core.version import __version__
from edgeproxy._core.websocket import Accept as WebSocketAccept
from edgeproxy._core.websocket import Closed as WebSocketClosed
from edgeproxy._core.websocket import WebSocket
from edgeproxy._observability.access_log import AccessLog
from edgeproxy._plugins import PluginError, PluginLoadError
from edgeproxy._protocol.clientip import ClientIPResolver
from edgeproxy._protocol.sse import SSEEvent, SSEEventTooLarge, SSEReader
from edgeproxy._routing.geo import parse_lat_lon
from edgeproxy._server.app import EdgeProxy
from edgeproxy._upstream.pool import (
    PoolLimits,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from edgeproxy.hookspecs import hookimpl

__all__ = [
    "AccessLog",
    "AccessLogConfig",
    "AdminConfig",
    "AdmissionConfig",
    "CacheConfig",
    "ClientIPResolver",
    "Config",
    "ConfigError",
    "EdgeProxy",
    "Exchange",
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
    "ProxyError",
    "RedisConfig",
    "RegionConfig",
    "RequestContext",
    "Response",
    "RouteConfig",
    "RoutingConfig",
    "SSEEvent",
    "SSEEventTooLarge",
    "SSEReader",
    "ServerConfig",
    "SessionTotals",
    "SharedLoadConfig",
    "StatefulConfig",
    "StreamResponse",
    "TlsInfo",
    "TracingConfig",
    "UpstreamConfig",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamReply",
    "UpstreamTimeout",
    "WebSocket",
    "WebSocketAccept",
    "WebSocketClosed",
    "WebSocketConfig",
    "__version__",
    "error_response",
    "hookimpl",
    "load_config",
    "parse_lat_lon",
]
