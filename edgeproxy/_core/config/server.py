"""The listeners and what a client may send: ``[server]``, ``[admin]``, ``[pop]``, ``[limits]``."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from typing import Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from edgeproxy._core.config.base import Section
from edgeproxy._core.config.checks import Networks
from edgeproxy._core.config.kinds import (
    Count,
    CountOrZero,
    FiniteNonNegative,
    FinitePositive,
    Name,
    NonNegative,
    Port,
)

__all__ = ["AdminConfig", "LimitsConfig", "PopConfig", "ServerConfig"]


# In the order compression_encodings prefers them by default.
Coding = Literal["zstd", "br", "gzip"]
_CODINGS: tuple[Coding, ...] = get_args(Coding)


class ServerConfig(Section):
    """The client-facing listener."""

    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: Port = Field(8080, description="Port the proxy listens on (0 picks one).")
    grace_period: NonNegative = Field(
        30.0,
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
    trusted_proxies: Networks = Field(
        default_factory=list,
        description="Addresses or CIDR networks of the proxies, load balancers and CDNs in "
        "front of this one (like uvicorn's forwarded_allow_ips): from them X-Forwarded-For is "
        "believed (its rightmost address outside them is the client), and so are the geo "
        "headers of [geo] and of plugins; empty believes no peer. The client IP is found "
        "once, at entry, for the rate limits, geo, plugins (ctx.client_ip) and the access log. "
        "Replaces [admission] trusted_proxies and [geo] trusted_peers. Reloaded in place.",
    )
    server_header: str = Field(
        "edgeproxy",
        max_length=256,
        description="The Server header of every answer of the proxy's listeners, the admin "
        "listener's too, in place of the region's and the server library's (which name their "
        "versions); empty sends none.",
    )
    backlog: Count = Field(1024, description="Listen backlog of the server socket.")
    reuse_port: bool = Field(
        False,
        description=(
            "Bind with SO_REUSEPORT, so that several edgeproxy processes (one per core) share "
            "the port and the kernel spreads connections; give each its own admin port."
        ),
    )
    workers: int | Literal["auto"] = Field(
        1,
        description=(
            "Worker processes sharing the port (SO_REUSEPORT) under one supervisor that owns "
            "the admin listener and restarts a worker that dies; 'auto' is one per usable core. "
            "1 serves from this one process."
        ),
    )

    tls_cert: str | None = Field(
        None,
        description="Certificate chain (PEM) of the client listener: it speaks TLS 1.2+ with ALPN "
        "http/1.1 (h2 and http/1.1 with http2). Relative paths are from the config file's "
        "folder. Reloaded on SIGHUP.",
    )
    tls_key: str | None = Field(
        None,
        validate_default=True,
        description="Private key (PEM) of tls_cert; needed with it.",
    )
    tls_client_ca: str | None = Field(
        None,
        description="CA bundle (PEM) that client certificates must chain to: mutual TLS, a client "
        "without a valid certificate is refused in the handshake. Needs tls_cert.",
    )

    http2: bool = Field(
        False,
        description="Serve HTTP/2 beside HTTP/1.1 on the client listener, with the same "
        "limits: over TLS, ALPN offers h2 and http/1.1; in cleartext it needs h2c. A browser "
        "then carries all the SSE streams of a page on one connection. HTTP/1.1 clients on "
        "that port get the default listener itself. Off: HTTP/1.1 only.",
    )
    h2c: bool = Field(
        False,
        description="With http2 and no TLS: accept cleartext HTTP/2 (prior knowledge, or "
        "Upgrade: h2c) beside HTTP/1.1, for clients that know the proxy speaks it (browsers "
        "speak HTTP/2 over TLS only).",
    )
    h2_send_stall_timeout: FinitePositive = Field(
        60.0,
        description="HTTP/2 listener: seconds a stream's answer may wait with its client "
        "taking none of it (a flow-control window kept shut); then the stream is reset "
        "(RST_STREAM CANCEL), its request cancelled, and counted as h2_send_stalls. Until "
        "then the listener holds at most 256 KiB of the answer (1 MiB per connection) and "
        "stops reading the region.",
    )

    compression: bool = Field(
        True,
        description="Compress JSON and text answers for clients that accept it (zstd, br or "
        "gzip, per Accept-Encoding); SSE only on routes with compress_sse.",
    )
    compression_min_size: CountOrZero = Field(
        1024,
        description="Smallest answer, in bytes, worth compressing (an answer of unknown length "
        "is compressed).",
    )
    compression_encodings: list[Coding] = Field(
        default_factory=lambda: list(_CODINGS),
        min_length=1,
        description="Codings offered, in the order preferred when the client accepts several "
        "equally.",
    )

    @field_validator("tls_key")
    @classmethod
    def _check_tls_key(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _check_key(value, info)

    @field_validator("server_header")
    @classmethod
    def _check_server_header(cls, value: str) -> str:
        # Sent as it is on every answer: a control character (CR, LF) would split the head.
        if value != value.strip() or not all(" " <= c <= "~" for c in value):
            raise ValueError(
                "must be printable ASCII without leading or trailing spaces (or empty)"
            )
        return value

    @field_validator("tls_client_ca")
    @classmethod
    def _check_tls_client_ca(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value and not info.data.get("tls_cert"):
            raise ValueError("needs tls_cert: client certificates are checked by a TLS listener")
        return value

    @model_validator(mode="after")
    def _check_http2(self) -> ServerConfig:
        if self.h2c and not self.http2:
            raise ValueError("h2c = true needs http2 = true")
        if self.http2 and not self.tls_cert and not self.h2c:
            raise ValueError(
                "http2 = true needs TLS (tls_cert and tls_key: browsers negotiate h2 by ALPN) "
                "or h2c = true for cleartext HTTP/2"
            )
        return self

    @field_validator("workers", mode="before")
    @classmethod
    def _check_workers(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError("must be a whole number of at least 1, or 'auto'")

    def worker_count(self) -> int:
        """``workers`` as a number: ``auto`` is the cores this process may run on."""
        if self.workers == "auto":
            return max(1, len(os.sched_getaffinity(0)))
        return self.workers


class AdminConfig(Section):
    """The admin listener: health, readiness and status. Keep it off the public network."""

    enabled: bool = Field(True, description="Serve the admin listener.")
    host: str = Field(
        "127.0.0.1", description="Address of the admin listener (loopback by default)."
    )
    port: Port = Field(9901, description="Port of the admin listener (0 picks one).")
    tls_cert: str | None = Field(
        None,
        description="Certificate chain (PEM) of the admin listener, which then speaks TLS 1.2+. "
        "Reloaded on SIGHUP.",
    )
    tls_key: str | None = Field(
        None, validate_default=True, description="Private key (PEM) of tls_cert; needed with it."
    )
    token: str | None = Field(
        None,
        repr=False,
        description="Bearer token every admin request but /healthz and /readyz must carry "
        "(Authorization: Bearer ...). Prefer token_env. Without a token the admin listener "
        "binds to loopback only.",
    )
    token_env: str | None = Field(
        None, description="Name of the environment variable that holds the admin token."
    )

    @field_validator("tls_key")
    @classmethod
    def _check_tls_key(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _check_key(value, info)

    @model_validator(mode="after")
    def _check_exposure(self) -> AdminConfig:
        if self.enabled and not (self.token or self.token_env) and not _is_loopback(self.host):
            raise ValueError(
                f"host = {self.host!r} is not a loopback address: set admin.token or "
                "admin.token_env, or bind admin.host to 127.0.0.1"
            )
        return self

    def client_url(self) -> str:
        """The URL a client on this machine reaches the listener at: a wildcard address
        (every interface) is reached on loopback."""
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        if ":" in host:
            host = f"[{host}]"
        return f"{'https' if self.tls_cert else 'http'}://{host}:{self.port}"

    def resolved_token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The token, ``token_env`` read from ``environ`` (``os.environ`` when None).

        Raises ``ValueError`` when ``token_env`` names a variable that is not set.
        """
        if self.token:
            return self.token
        if self.token_env:
            value = (os.environ if environ is None else environ).get(self.token_env)
            if not value:
                raise ValueError(f"admin.token_env: {self.token_env} is not set or empty")
            return value
        return None


def _check_key(value: str | None, info: ValidationInfo) -> str | None:
    """``tls_key`` against ``tls_cert``: both or neither."""
    cert = info.data.get("tls_cert")
    if cert and not value:
        raise ValueError("needed with tls_cert")
    if value and not cert:
        raise ValueError("given without tls_cert")
    return value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PopConfig(Section):
    """Where this edge runs."""

    name: Name = Field("edge", description="Name of this PoP, shown in Via and /status.")
    lat: float = Field(0.0, ge=-90, le=90, description="Latitude of the PoP in degrees.")
    lon: float = Field(0.0, ge=-180, le=180, description="Longitude of the PoP in degrees.")


class LimitsConfig(Section):
    """What a client may send, and how slowly; enforced by the proxy's own listener."""

    max_request_line: int = Field(
        8190,
        ge=256,
        le=1_048_576,
        description="Longest request line (method, target, version) in bytes; longer gets 414.",
    )
    max_header_size: int = Field(
        8190,
        ge=256,
        le=1_048_576,
        description="Longest header field in bytes; longer gets 431.",
    )
    max_headers: int = Field(
        100, ge=8, le=10_000, description="Most header fields in a request; more gets 431."
    )
    max_body_size: CountOrZero = Field(
        10 * 1024 * 1024,
        description="Largest request body in bytes; larger gets 413, before it is read when "
        "Content-Length says so. 0 means no limit.",
    )
    header_timeout: FinitePositive = Field(
        10.0,
        description="Seconds a client has to send a whole request head, from its first byte "
        "(or from connecting); then 408 and the connection closes.",
    )
    body_timeout: FinitePositive = Field(
        30.0,
        description="Seconds the request body may stall between two reads (slowloris); then "
        "408 and the connection closes.",
    )
    min_body_rate: CountOrZero = Field(
        1024,
        description="Lowest average rate, in bytes per second, at which a request body must "
        "arrive once it has been arriving for body_rate_grace seconds (a client trickling a "
        "byte now and then never stalls long enough for body_timeout); then 408 and the "
        "connection closes. Time the proxy itself stopped reading does not count. 0 turns "
        "the check off.",
    )
    body_rate_grace: FiniteNonNegative = Field(
        10.0,
        description="Seconds a request body may arrive at any rate before min_body_rate "
        "applies; while the proxy drains on SIGTERM, at most 1 second.",
    )
    body_deadline: FiniteNonNegative = Field(
        300.0,
        description="Seconds a whole request body may take to arrive, from the end of its "
        "head (time the proxy itself stopped reading does not count); then 408 and the "
        "connection closes. 0 means no deadline.",
    )
    h2_max_concurrent_streams: int = Field(
        100,
        ge=1,
        le=10_000,
        description="HTTP/2 listener: most streams one connection may have open at once "
        "(SETTINGS_MAX_CONCURRENT_STREAMS); a stream past it is refused alone "
        "(RST_STREAM REFUSED_STREAM, safe to retry) and counts toward h2_max_premature_resets.",
    )
    h2_max_control_frames: int = Field(
        200,
        ge=10,
        description="HTTP/2 listener: most PING, SETTINGS, PRIORITY, unknown-type and empty "
        "DATA frames one connection may send in 10 seconds, and WINDOW_UPDATE frames beyond "
        "four per DATA frame the proxy sent or stream the client opened; more (a flood) gets "
        "GOAWAY ENHANCE_YOUR_CALM and the connection closes.",
    )
    h2_max_premature_resets: Count = Field(
        100,
        description="HTTP/2 listener: streams one connection may cancel (RST_STREAM) before "
        "their answer ended, or have refused for their own fault before any region saw them "
        "(malformed, past the stream cap), the count halving every 30 seconds; past it, "
        "GOAWAY ENHANCE_YOUR_CALM and the connection closes (rapid reset, CVE-2023-44487), "
        "whatever else the connection sends. The proxy's own refusals (its rate limits, "
        "shedding) never count: they cost no region anything.",
    )
    keepalive_timeout: FinitePositive = Field(
        75.0,
        description="Seconds an idle keep-alive connection is kept open.",
    )
    half_close: Literal["answer", "abort"] = Field(
        "answer",
        description="A client that ends its side of an HTTP/1.1 connection (a FIN: "
        "shutdown(SHUT_WR), or a close, which looks the same) after sending a request whole: "
        "'answer' still answers it, then closes, unless the request is waiting in the admission "
        "queue, whose place is given up (a client that closed would hold it for nothing); "
        "'abort' takes every FIN for the client gone, cancelling its request and its upstream "
        "work at once (nginx, Envoy).",
    )
    max_connections: Count = Field(
        10_000,
        description="Most client connections open at once; more get 503 and are closed.",
    )
    max_connections_per_ip: int | None = Field(
        None,
        ge=0,
        description="Most client connections open at once from one address, so that one "
        "address cannot take the whole listener; more get 503 and are closed. Unset: half of "
        "max_connections, but at least 64. Behind a load balancer or sidecar that connects "
        "from one address, raise it to max_connections, or set 0 for no cap.",
    )
