"""The whole configuration: every section, and the checks that span sections."""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Self

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from edgeproxy._core.config.admission import AdmissionConfig
from edgeproxy._core.config.base import Section
from edgeproxy._core.config.cache import CacheConfig
from edgeproxy._core.config.env import apply_env, deep_copy
from edgeproxy._core.config.errors import ConfigError, format_errors
from edgeproxy._core.config.geo import GeoConfig
from edgeproxy._core.config.local_model import LocalModelConfig
from edgeproxy._core.config.observability import AccessLogConfig, MetricsConfig, TracingConfig
from edgeproxy._core.config.plugins import PluginsConfig
from edgeproxy._core.config.redis import RedisConfig, RedisSection, resolve_redis
from edgeproxy._core.config.routes import RouteConfig
from edgeproxy._core.config.routing import HealthConfig, RoutingConfig
from edgeproxy._core.config.server import AdminConfig, LimitsConfig, PopConfig, ServerConfig
from edgeproxy._core.config.sharedload import SharedLoadConfig
from edgeproxy._core.config.stateful import StatefulConfig
from edgeproxy._core.config.structure import structure_problems
from edgeproxy._core.config.upstream import RegionConfig, UpstreamConfig
from edgeproxy._core.config.websocket import WebSocketConfig

__all__ = ["Config"]

logger = logging.getLogger("edgeproxy.config")

# Keys that once held trust lists of their own: now they feed server.trusted_proxies.
_TRUST_ALIASES: Final = (("admission", "trusted_proxies"), ("geo", "trusted_peers"))


class Config(Section):
    """The whole edgeproxy configuration."""

    server: ServerConfig = Field(default_factory=ServerConfig, description="Client listener.")
    admin: AdminConfig = Field(default_factory=AdminConfig, description="Admin listener.")
    pop: PopConfig = Field(default_factory=PopConfig, description="This PoP.")
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig, description="Pool defaults.")
    regions: list[RegionConfig] = Field(
        default_factory=list, description="The regional clusters, one [[regions]] table each."
    )
    routes: list[RouteConfig] = Field(
        default_factory=list,
        description="Per-route policy, one [[routes]] table each; longest path prefix wins.",
    )
    redis: RedisConfig = Field(
        default_factory=RedisConfig,
        description="The Redis connections of the cache, the rate limits, the shared load view "
        "and the owners of stored objects: [redis] itself, named 'default', and "
        "[redis.connections.<name>].",
    )
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Hot-answer cache.")
    plugins: PluginsConfig = Field(default_factory=PluginsConfig, description="Plugins.")
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="Prometheus metrics and /status percentiles."
    )
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="Tracing.")
    access_log: AccessLogConfig = Field(
        default_factory=AccessLogConfig, description="The JSON-lines access log."
    )
    local_model: LocalModelConfig = Field(
        default_factory=LocalModelConfig, description="The local fallback model."
    )
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig, description="Region choice, retries and hedging."
    )
    health: HealthConfig = Field(
        default_factory=HealthConfig, description="Health checks, ejection, breakers."
    )
    shared_load: SharedLoadConfig = Field(
        default_factory=SharedLoadConfig,
        description="The load view shared by every PoP and worker through Redis.",
    )
    stateful: StatefulConfig = Field(
        default_factory=StatefulConfig,
        description="Stateful requests sent to the region holding their state.",
    )
    websocket: WebSocketConfig = Field(
        default_factory=WebSocketConfig,
        description="WebSocket sessions (the Realtime API): limits and keep-alive.",
    )
    geo: GeoConfig = Field(default_factory=GeoConfig, description="Client geo and residency.")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="Rate limits, in-flight caps, queueing."
    )
    limits: LimitsConfig = Field(
        default_factory=LimitsConfig, description="Input limits and slow-client timeouts."
    )
    # Relative plugin file paths resolve against the config file's folder.
    _base_dir: Path | None = PrivateAttr(default=None)
    _default_route: RouteConfig = PrivateAttr(
        default_factory=lambda: RouteConfig(name="default", path="/")
    )
    # (prefix without its trailing slash, methods or None, route), longest prefix first:
    # built once, so matching a request is one pass that stops at the first match.
    _route_table: tuple[tuple[str, frozenset[str] | None, RouteConfig], ...] = PrivateAttr(
        default=()
    )

    @classmethod
    def from_mapping(
        cls,
        data: Mapping[str, Any],
        *,
        environ: Mapping[str, str] | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        source: str | None = None,
    ) -> Self:
        """Validate a configuration given as nested mappings, as ``tomllib`` parses a file.

        ``data`` has the shape of the TOML file: ``{"server": {"port": 8080},
        "regions": [{"name": ..., "url": ...}]}``; it is not modified.
        ``EDGEPROXY_SECTION__KEY`` and ``EDGEPROXY_REGIONS__<name|index>__KEY``
        variables of ``environ`` (``os.environ`` when None; pass ``{}`` to
        ignore the environment) override its keys, their values read as TOML
        values. ``base_dir`` is the folder that relative paths (plugin files,
        ``[local_model] path``) resolve against, as :func:`load_config` sets it
        to the file's folder; None leaves them relative to the working
        directory. ``source`` names where ``data`` came from in the error.

        Raises :class:`ConfigError` listing every problem as ``key: reason``.
        """
        merged: dict[str, Any] = deep_copy(data)
        origins = apply_env(merged, os.environ if environ is None else environ)
        try:
            config = cls.model_validate(merged)
        except ValidationError as exc:
            errors = format_errors(exc, model=cls, origins=origins)
            # Pydantic runs the whole config's checks only once every field passed, and
            # stops at the first: these few, read from the parsed data, come in one pass.
            errors += [p for p in structure_problems(merged) if p not in errors]
            raise ConfigError(errors, source=source) from None
        if base_dir is not None:
            config._base_dir = Path(base_dir).resolve()
        return config

    @property
    def base_dir(self) -> Path | None:
        """The folder relative paths resolve against: the config file's, if loaded from one."""
        return self._base_dir

    @model_validator(mode="after")
    def _check_structure(self) -> Config:
        # The same checks that from_mapping runs on the parsed data when a field fails.
        shape = self.model_dump(
            include={
                "regions": {"__all__": {"name"}},
                "routes": {"__all__": {"name", "fallback"}},
                "local_model": {"path"},
            }
        )
        problems = structure_problems(shape)
        if problems:
            # One error per validator: from_mapping adds the others.
            raise ValueError(problems[0])
        return self

    @model_validator(mode="after")
    def _resolve_redis(self) -> Config:
        for name in type(self).model_fields:
            section = getattr(self, name)
            if isinstance(section, RedisSection):
                resolved = resolve_redis(name, section, self.redis)
                if resolved is not section:
                    # Through __dict__: validate_assignment would run this validator again.
                    self.__dict__[name] = resolved
        return self

    @model_validator(mode="after")
    def _one_trust_list(self) -> Config:
        given: list[tuple[str, list[str]]] = []
        if "trusted_proxies" in self.server.model_fields_set:
            given.append(("server.trusted_proxies", self.server.trusted_proxies))
        for section, key in _TRUST_ALIASES:
            if key in getattr(self, section).model_fields_set:
                given.append((f"{section}.{key}", getattr(getattr(self, section), key)))
                logger.warning(
                    "%s.%s is deprecated: it feeds server.trusted_proxies, the one list of "
                    "trusted proxies; set that key instead",
                    section,
                    key,
                )
        if not given:
            return self
        first_key, first = given[0]
        for key, value in given[1:]:
            # A union would trust a proxy for what the operator listed it for nowhere.
            if _networks(value) != _networks(first):
                raise ValueError(
                    f"{key}: differs from {first_key}; both mean server.trusted_proxies, "
                    "the one list of trusted proxies: set that key alone"
                )
        if first_key != "server.trusted_proxies":
            server = self.server.model_copy(update={"trusted_proxies": list(first)})
            self.__dict__["server"] = server
        return self

    @model_validator(mode="after")
    def _check_embedder_region(self) -> Config:
        name = self.cache.semantic_embedder_region
        if name and self.cache.semantic_embedder == "region":
            if name not in {r.name for r in self.regions}:
                raise ValueError(f"cache.semantic_embedder_region: unknown region {name!r}")
        return self

    @model_validator(mode="after")
    def _check_verifier_model(self) -> Config:
        if self.cache.semantic_model_verifier == "local" and not self.local_model.path:
            raise ValueError(
                "cache.semantic_model_verifier 'local' needs the local model ([local_model] path)"
            )
        return self

    @model_validator(mode="after")
    def _check_residency(self) -> Config:
        known = {r.name for r in self.regions}
        for region in self.regions:
            known.update(region.tags)
            if region.jurisdiction:
                known.add(region.jurisdiction)
        for key, allowed in self.geo.residency.items():
            for name in allowed:
                if name not in known:
                    raise ValueError(
                        f"geo.residency.{key}: unknown region or jurisdiction {name!r} "
                        f"(known: {', '.join(sorted(known))})"
                    )
        return self

    def model_post_init(self, context: Any, /) -> None:
        """Build the route table once, longest prefix first (ties keep their config order)."""
        super().model_post_init(context)
        table = [
            (route.path.rstrip("/"), frozenset(route.methods) if route.methods else None, route)
            for route in self.routes
        ]
        table.sort(key=lambda entry: -len(entry[2].path))
        self._route_table = tuple(table)

    def route_for(self, method: str, path: str) -> RouteConfig:
        """The route a request belongs to: the longest matching prefix, else ``default``.

        Prefixes match on segment boundaries, as :meth:`RouteConfig.matches` says.
        """
        # Plain reads of the private dict: pydantic's private attributes go through
        # __getattr__, which is slow on a per-request path.
        private = self.__pydantic_private__
        assert private is not None
        for prefix, methods, route in private["_route_table"]:
            if methods is not None and method not in methods:
                continue
            if not prefix or path == prefix or path.startswith(prefix + "/"):
                return route  # type: ignore[no-any-return]
        return private["_default_route"]  # type: ignore[no-any-return]

    def region(self, name: str) -> RegionConfig:
        """The region called ``name``; ``KeyError`` if there is none."""
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(name)


def _networks(entries: list[str]) -> frozenset[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return frozenset(ipaddress.ip_network(entry.strip(), strict=False) for entry in entries)
