"""The one typed configuration, loaded from TOML and ``EDGEPROXY_*`` variables.

Every key is a field here with a description; ``edgeproxy config-docs``
renders them and a test keeps the README's table in step. Keys mirror the
CLI flags (``[server] port`` is ``--port``). Validation collects every
problem at once and names each key with the reason, so ``check-config``
can list them all.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "AdminConfig",
    "Config",
    "ConfigError",
    "PluginsConfig",
    "PopConfig",
    "RegionConfig",
    "ServerConfig",
    "UpstreamConfig",
    "load_config",
]

ENV_PREFIX = "EDGEPROXY_"


class ConfigError(ValueError):
    """The configuration is invalid. ``errors`` holds one ``key: reason`` line per problem."""

    def __init__(self, errors: list[str], *, source: str | None = None) -> None:
        self.errors = errors
        self.source = source
        where = f" in {source}" if source else ""
        super().__init__(f"invalid configuration{where}:\n  " + "\n  ".join(errors))


class _Section(BaseModel):
    # Unknown keys are errors: a typo like `prot = 8080` must not be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class ServerConfig(_Section):
    """The client-facing listener."""

    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(8080, ge=0, le=65535, description="Port the proxy listens on (0 picks one).")
    grace_period: float = Field(
        30.0,
        ge=0,
        description="Seconds that in-flight requests, streams included, get to finish on SIGTERM.",
    )
    preserve_host: bool = Field(
        False,
        description="Forward the client's Host header instead of rewriting it to the upstream's.",
    )
    forward_client_credentials: bool = Field(
        False,
        description=(
            "Forward the client's Authorization and api-key headers upstream. Off by default: "
            "regions get their own credentials from [[regions]]."
        ),
    )
    via_name: str = Field(
        "",
        description="Pseudonym used in the Via header; empty means the PoP name.",
    )
    backlog: int = Field(1024, ge=1, description="Listen backlog of the server socket.")


class AdminConfig(_Section):
    """The admin listener: health, readiness and status. Keep it off the public network."""

    enabled: bool = Field(True, description="Serve the admin listener.")
    host: str = Field(
        "127.0.0.1", description="Address of the admin listener (loopback by default)."
    )
    port: int = Field(9901, ge=0, le=65535, description="Port of the admin listener (0 picks one).")


class PopConfig(_Section):
    """Where this edge runs."""

    name: str = Field(
        "edge", min_length=1, description="Name of this PoP, shown in Via and /status."
    )
    lat: float = Field(0.0, ge=-90, le=90, description="Latitude of the PoP in degrees.")
    lon: float = Field(0.0, ge=-180, le=180, description="Longitude of the PoP in degrees.")


class UpstreamConfig(_Section):
    """Pool defaults for every region; a region may override ``http2``."""

    http2: bool = Field(
        True, description="Talk HTTP/2 to regions (h2c for http://, ALPN for https://)."
    )
    max_connections: int = Field(
        8, ge=1, description="Most connections per region (HTTP/2 multiplexes streams over them)."
    )
    keepalive_expiry: float = Field(
        60.0, gt=0, description="Seconds an idle connection is kept before it is closed."
    )
    connect_timeout: float = Field(3.0, gt=0, description="Seconds to open a connection.")
    read_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds to wait for response headers and between body chunks.",
    )
    write_timeout: float = Field(10.0, gt=0, description="Seconds to send a request body chunk.")
    pool_timeout: float = Field(
        5.0, gt=0, description="Seconds to wait for a free connection or stream slot."
    )
    warm_connections: int = Field(
        1, ge=0, description="Connections opened per region at startup, before any request."
    )
    ping_interval: float = Field(
        15.0, gt=0, description="Seconds between HTTP/2 PINGs on idle connections."
    )
    verify_tls: bool = Field(True, description="Verify upstream TLS certificates.")
    ca_file: str | None = Field(
        None, description="CA bundle for upstream TLS; the system's if unset."
    )


class RegionConfig(_Section):
    """One regional cluster."""

    name: str = Field(
        ..., min_length=1, description="Unique region name, sent in X-Edgeproxy-Region."
    )
    url: str = Field(..., description="Base URL of the region: http:// (h2c) or https:// (ALPN).")
    http2: bool | None = Field(None, description="Override [upstream] http2 for this region.")
    lat: float = Field(0.0, ge=-90, le=90, description="Latitude of the region in degrees.")
    lon: float = Field(0.0, ge=-180, le=180, description="Longitude of the region in degrees.")
    weight: float = Field(1.0, gt=0, description="Relative share of traffic among equals.")
    api_key: str | None = Field(
        None,
        description="Credential sent as 'Authorization: Bearer …'. Prefer api_key_env.",
        repr=False,
    )
    api_key_env: str | None = Field(
        None, description="Name of the environment variable that holds the region's API key."
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="Extra headers injected into every upstream request to this region.",
        repr=False,
    )
    host_header: str | None = Field(
        None, description="Host (or :authority) to send; defaults to the URL's host."
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https"):
            raise ValueError("must be an http:// or https:// URL")
        if not parts.hostname:
            raise ValueError("has no host")
        try:
            parts.port  # noqa: B018 - raises on an invalid port
        except ValueError as exc:
            raise ValueError(f"has an invalid port ({exc})") from None
        if parts.query or parts.fragment:
            raise ValueError("must not have a query or fragment")
        return value

    @field_validator("lat", "lon", "weight")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    def resolved_api_key(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The credential for this region: ``api_key``, else the variable ``api_key_env`` names."""
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            return (os.environ if environ is None else environ).get(self.api_key_env) or None
        return None


class PluginsConfig(_Section):
    """Plugins to load, with their settings under ``[plugins.settings.NAME]``."""

    enabled: list[str] = Field(
        default_factory=list,
        description="Plugins by dotted module path or .py file path, loaded at app creation.",
    )
    entry_points: bool = Field(
        True,
        description="Also load plugins registered in the 'edgeproxy.plugins' entry-point group.",
    )
    fail_open: list[str] = Field(
        default_factory=list,
        description="Plugins whose request-time errors are logged and skipped instead of a 500.",
    )
    settings: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-plugin settings, keyed by the plugin's name."
    )


class Config(_Section):
    """The whole edgeproxy configuration."""

    server: ServerConfig = Field(default_factory=ServerConfig, description="Client listener.")
    admin: AdminConfig = Field(default_factory=AdminConfig, description="Admin listener.")
    pop: PopConfig = Field(default_factory=PopConfig, description="This PoP.")
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig, description="Pool defaults.")
    regions: list[RegionConfig] = Field(
        default_factory=list, description="The regional clusters, one [[regions]] table each."
    )
    plugins: PluginsConfig = Field(default_factory=PluginsConfig, description="Plugins.")
    # Relative plugin file paths resolve against the config file's folder.
    _base_dir: Path | None = PrivateAttr(default=None)

    @property
    def base_dir(self) -> Path | None:
        """The folder of the file this config was loaded from, if any."""
        return self._base_dir

    @model_validator(mode="after")
    def _check_regions(self) -> Config:
        if not self.regions:
            raise ValueError("regions: at least one [[regions]] entry is required")
        seen: set[str] = set()
        for region in self.regions:
            if region.name in seen:
                raise ValueError(f"regions: duplicate region name {region.name!r}")
            seen.add(region.name)
        return self

    def region(self, name: str) -> RegionConfig:
        """The region called ``name``; ``KeyError`` if there is none."""
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(name)


def _format_errors(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = ""
        for part in err["loc"]:
            if isinstance(part, int):
                loc += f"[{part}]"
            else:
                loc += f".{part}" if loc else str(part)
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        if loc:
            lines.append(f"{loc}: {msg}")
        else:
            lines.append(msg)
    return lines


def _coerce_env_value(raw: str) -> Any:
    """Parse an environment value as a TOML value, falling back to a plain string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _apply_env(data: dict[str, Any], environ: Mapping[str, str]) -> None:
    """Apply ``EDGEPROXY_SECTION__KEY`` and ``EDGEPROXY_REGIONS__<name|index>__KEY`` overrides."""
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        value = _coerce_env_value(raw)
        if path[0] == "regions" and len(path) == 3:
            regions = data.setdefault("regions", [])
            target = None
            if path[1].isdigit() and int(path[1]) < len(regions):
                target = regions[int(path[1])]
            else:
                for region in regions:
                    if str(region.get("name", "")).lower().replace("-", "_") == path[1]:
                        target = region
            if target is not None:
                target[path[2]] = value
            continue
        if len(path) == 2:
            section = data.setdefault(path[0], {})
            if isinstance(section, dict):
                section[path[1]] = value


def config_from_mapping(
    data: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    source: str | None = None,
) -> Config:
    """Validate a parsed TOML mapping (plus environment overrides) into a :class:`Config`."""
    merged: dict[str, Any] = _deep_copy(data)
    _apply_env(merged, os.environ if environ is None else environ)
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc), source=source) from None


def _deep_copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> Config:
    """Load and validate a TOML config file. Raises :class:`ConfigError` naming every bad key."""
    source = os.fspath(path)
    try:
        raw = Path(source).read_bytes()
    except OSError as exc:
        raise ConfigError(
            [f"cannot read config file: {exc.strerror or exc}"], source=source
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config file is not UTF-8: {exc}"], source=source) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"TOML syntax error: {exc}"], source=source) from None
    config = config_from_mapping(data, environ=environ, source=source)
    config._base_dir = Path(source).resolve().parent
    return config


def iter_config_keys() -> Iterator[tuple[str, str, str, str]]:
    """Yield ``(key, type, default, description)`` for every documented key."""
    sections: list[tuple[str, type[BaseModel]]] = [
        ("server", ServerConfig),
        ("admin", AdminConfig),
        ("pop", PopConfig),
        ("upstream", UpstreamConfig),
        ("regions", RegionConfig),
        ("plugins", PluginsConfig),
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
