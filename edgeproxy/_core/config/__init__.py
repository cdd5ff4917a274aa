"""The one typed configuration, loaded from TOML and ``EDGEPROXY_*`` variables.

Every key is a field with a description; ``edgeproxy config-docs`` renders
them and a test keeps the README's table in step. Keys mirror the CLI flags
(``[server] port`` is ``--port``). Validation collects every problem at once
and names each key with the reason, so ``check-config`` can list them all.

One module per concern: ``server`` (``[server]``, ``[admin]``, ``[pop]``,
``[limits]``), ``upstream`` (``[upstream]``, ``[[regions]]``), ``routes``,
``routing`` (``[routing]``, ``[health]``), ``geo``, ``admission``, ``cache``,
``observability`` (``[metrics]``, ``[tracing]``, ``[access_log]``),
``local_model``, ``plugins``, ``sharedload`` (``[shared_load]``), ``stateful``; ``redis``
holds ``[redis]``, its named connections and the base of every Redis-using section; ``root``
holds :class:`Config` and ``Config.from_mapping``; ``loader`` reads TOML files,
``env`` applies environment overrides, ``errors`` formats problems, ``docs``
renders the key reference and ``checks`` holds the field checks several
sections share.
"""

from edgeproxy._core.config.admission import AdmissionConfig
from edgeproxy._core.config.base import Section
from edgeproxy._core.config.cache import CacheConfig
from edgeproxy._core.config.checks import REDIS_SCHEMES, check_header_name, check_redis_url
from edgeproxy._core.config.docs import config_docs_markdown, iter_config_keys
from edgeproxy._core.config.env import ENV_PREFIX
from edgeproxy._core.config.errors import ConfigError
from edgeproxy._core.config.geo import BUILTIN_GROUPS, GeoConfig
from edgeproxy._core.config.loader import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    ConfigPath,
    config_from_mapping,
    find_config,
    load_config,
    load_found,
)
from edgeproxy._core.config.local_model import LocalModelConfig
from edgeproxy._core.config.observability import (
    DEFAULT_LATENCY_BUCKETS,
    AccessLogConfig,
    MetricsConfig,
    TracingConfig,
)
from edgeproxy._core.config.plugins import PluginsConfig
from edgeproxy._core.config.redis import (
    RedisConfig,
    RedisConnection,
    RedisSection,
    RedisSettings,
    redis_settings,
)
from edgeproxy._core.config.root import Config
from edgeproxy._core.config.routes import DEFAULT_FALLBACK, FallbackRung, RouteConfig
from edgeproxy._core.config.routing import HealthConfig, RoutingConfig
from edgeproxy._core.config.server import AdminConfig, LimitsConfig, PopConfig, ServerConfig
from edgeproxy._core.config.sharedload import SharedLoadConfig
from edgeproxy._core.config.stateful import StatefulConfig
from edgeproxy._core.config.upstream import RegionConfig, UpstreamConfig
from edgeproxy._core.config.websocket import WebSocketConfig

__all__ = [
    "BUILTIN_GROUPS",
    "CONFIG_ENV",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_FALLBACK",
    "DEFAULT_LATENCY_BUCKETS",
    "ENV_PREFIX",
    "REDIS_SCHEMES",
    "AccessLogConfig",
    "AdminConfig",
    "AdmissionConfig",
    "CacheConfig",
    "Config",
    "ConfigError",
    "ConfigPath",
    "FallbackRung",
    "GeoConfig",
    "HealthConfig",
    "LimitsConfig",
    "LocalModelConfig",
    "MetricsConfig",
    "PluginsConfig",
    "PopConfig",
    "RedisConfig",
    "RedisConnection",
    "RedisSection",
    "RedisSettings",
    "RegionConfig",
    "RouteConfig",
    "RoutingConfig",
    "Section",
    "ServerConfig",
    "SharedLoadConfig",
    "StatefulConfig",
    "WebSocketConfig",
    "TracingConfig",
    "UpstreamConfig",
    "check_header_name",
    "check_redis_url",
    "config_docs_markdown",
    "config_from_mapping",
    "find_config",
    "iter_config_keys",
    "load_config",
    "load_found",
    "redis_settings",
]
