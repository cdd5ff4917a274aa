"""The regions and their connection pools: ``[upstream]`` and ``[[regions]]``."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationInfo, field_validator

from edgeproxy._core.config.base import Section
from edgeproxy._core.config.checks import UrlPath, check_host_port
from edgeproxy._core.config.kinds import Count, CountOrZero, Name, Positive
from edgeproxy._core.config.models import ModelNames, check_model_aliases

__all__ = ["ContinuationMethod", "HTTP2Mode", "RegionConfig", "ServerKind", "UpstreamConfig"]

# [upstream] http2 and a region's: force HTTP/2 or HTTP/1.1, or find which a region speaks.
HTTP2Mode = bool | Literal["auto"]
ServerKind = Literal["generic", "openai", "vllm", "sglang", "llama.cpp"]
ContinuationMethod = Literal["auto", "off", "continue_final_message", "prefill", "reissue"]
# The APIs a region may speak ([[regions]] apis).
ApiName = Literal["chat", "completions", "embeddings", "moderations", "responses", "messages"]
# What continuation = "auto" means for each kind of server.
_AUTO_CONTINUATION: dict[str, str] = {
    "vllm": "continue_final_message",
    "sglang": "continue_final_message",
    "llama.cpp": "prefill",
}


class UpstreamConfig(Section):
    """Pool defaults for every region; a region may override ``http2``."""

    http2: HTTP2Mode = Field(
        "auto",
        description='HTTP version to regions. "auto" finds it per endpoint on its first '
        "connection: over https:// ALPN picks (h2 or http/1.1); over http:// HTTP/2 with prior "
        "knowledge (h2c) is tried, and an endpoint that refuses it (as llama.cpp's and other "
        "uvicorn servers do) is spoken HTTP/1.1 from then on. true forces HTTP/2, false "
        "HTTP/1.1; an endpoint that refuses the version forced is unreachable, and its error "
        "says so.",
    )
    max_connections: Count = Field(
        8,
        description="Most connections per HTTP/2 region (each multiplexes many streams).",
    )
    http1_max_connections: Count = Field(
        256,
        description=(
            "Most connections per HTTP/1.1 region; each carries one request at a time, "
            "so this caps that region's concurrency, SSE streams included."
        ),
    )
    keepalive_expiry: Positive = Field(
        60.0, description="Seconds an idle connection is kept before it is closed."
    )
    connect_timeout: Positive = Field(3.0, description="Seconds to open a connection.")
    read_timeout: Positive = Field(
        60.0,
        description="Seconds to wait for a region's response headers (its queue and prefill).",
    )
    stream_idle_timeout: Positive = Field(
        30.0,
        description="Seconds a response body may go without a byte once its headers came: a "
        "stalled stream breaks then (and is continued where the route says so). Raise it for "
        "models that think in silence between tokens.",
    )
    write_timeout: Positive = Field(10.0, description="Seconds to send a request body chunk.")
    pool_timeout: Positive = Field(
        5.0, description="Seconds to wait for a free connection or stream slot."
    )
    warm_connections: CountOrZero = Field(
        1, description="Connections opened per region at startup, before any request."
    )
    ping_interval: Positive = Field(
        15.0, description="Seconds between HTTP/2 PINGs on idle connections."
    )
    verify_tls: bool = Field(True, description="Verify upstream TLS certificates.")
    ca_file: str | None = Field(
        None, description="CA bundle for upstream TLS; the system's if unset."
    )


# Seconds between two fetches of a learning region's /v1/models, unless it says.
_MODELS_REFRESH = 60.0


class RegionConfig(Section):
    """One regional cluster."""

    name: Name = Field(..., description="Unique region name, sent in X-Edgeproxy-Region.")
    url: str = Field(
        ...,
        description="Base URL of the region: http:// (cleartext: h2c or HTTP/1.1) or https:// "
        "(TLS; the version by ALPN).",
    )
    http2: HTTP2Mode | None = Field(
        None, description='Override [upstream] http2 for this region: true, false or "auto".'
    )
    urls: list[str] = Field(
        default_factory=list,
        description=(
            "More endpoints of the same region (same scheme rules as url); each gets its own "
            "pool and a request goes to the reachable endpoint with the fewest in flight."
        ),
    )
    lat: float = Field(0.0, description="Latitude of the region in degrees (-90..90).")
    lon: float = Field(0.0, description="Longitude of the region in degrees (-180..180).")
    weight: float = Field(
        1.0, description="Relative share of traffic among regions that perform alike (> 0)."
    )
    jurisdiction: str | None = Field(
        None,
        description="Legal jurisdiction of the region, e.g. 'eu' or 'us'; [geo] residency "
        "rules match it.",
    )
    tags: list[str] = Field(
        default_factory=list,
        description="More labels of the region; residency rules may name them like a jurisdiction.",
    )
    priority: CountOrZero = Field(
        0,
        description="Priority tier: tier 0 serves first; a higher tier gets requests only when "
        "no region of a lower tier is available, or as a failover target.",
    )
    models: ModelNames = Field(
        default_factory=list,
        description="The model names the region serves, exact or as fnmatch globs "
        "('llama-3*'); requests for other models go elsewhere. Empty: every model.",
    )
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description='Client model name -> the region\'s own name, e.g. {"gpt-4o-mini" = '
        '"meta-llama/Llama-3.1-8B-Instruct"}: the region is sent its name, the client '
        "sees its own in the answer. A key counts as a model the region serves.",
    )
    learn_models: bool | None = Field(
        None,
        description="Learn the models the region serves from its own GET /v1/models (OpenAI's "
        "list; vLLM's max_model_len kept): asked at start, then every models_refresh "
        "seconds. Until its list is known (or while its fetches fail from the start) the "
        "region serves every model; a model no region serves, once every list is known, gets "
        "404 model_not_found. Unset: true when models is empty; true with models listed is "
        "an error.",
    )
    serves_any_model: bool | None = Field(
        None,
        description="The region answers any model name with a model of its own, as llama.cpp's "
        "servers do: it is a candidate for every model name no region lists (by models, "
        "model_aliases or a learnt list), after those that list the name. Unset: recognised "
        "from the region's GET /v1/models (llama-cpp-python's server, llama-server with one "
        "model); false: never, whatever its list says.",
    )
    models_refresh: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Seconds between two fetches of the region's GET /v1/models, when it "
        "learns its models (learn_models). Unset: 60.",
    )
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
    load_reporting: Literal["auto", "header", "scrape", "off"] = Field(
        "auto",
        description="Load the region reports itself: 'auto' reads an endpoint-load-metrics "
        "header (ORCA, as vLLM writes it) when an answer has one; 'header' also asks for it "
        "on every request (endpoint-load-metrics-format: TEXT); 'scrape' polls metrics_path "
        "every [routing] load_scrape_interval (vLLM/SGLang gauges); 'off' reads nothing.",
    )
    metrics_path: UrlPath = Field(
        "/metrics",
        description="Path of the region's Prometheus endpoint, polled with load_reporting = "
        "'scrape'.",
    )
    server: ServerKind = Field(
        "generic",
        description="What the region runs: 'generic', 'openai', 'vllm', 'sglang' or "
        "'llama.cpp'; it decides how the region continues a broken stream (continuation).",
    )
    stores_responses: bool | None = Field(
        None,
        description="Whether the region keeps the Responses API's stored responses, so that "
        "previous_response_id works there. Unset: yes, except for server = 'llama.cpp' "
        "(llama-server refuses previous_response_id). A region that does not is sent a "
        "chain's whole input instead, on routes with responses_state = 'edge'.",
    )
    continuation: ContinuationMethod = Field(
        "auto",
        description="How this region continues a chat stream another region broke (routes' "
        "continue_on_break): 'continue_final_message' (the partial answer as a final assistant "
        "message with vLLM's switches), 'prefill' (the same without them, as llama.cpp "
        "continues), 'reissue' (deterministic requests only: the original request again, the "
        "text already sent skipped), 'off'; 'auto' picks from server (vllm and sglang: "
        "continue_final_message, llama.cpp: prefill, others: off). Messages and Responses "
        "streams go on by their API's own method on any region not set to 'off' (a "
        "Messages stream translated for the region: by its chat method).",
    )

    apis: list[ApiName] | None = Field(
        None,
        description="The APIs the region speaks: 'chat', 'completions', 'embeddings', "
        "'moderations', 'responses', 'messages' (with its count_tokens). A Messages or "
        "stateless Responses request to a region that speaks 'chat' but not its API is "
        "translated to chat completions, and regions speaking the API are preferred. Unset: "
        "unknown, learnt per API from a 404 or 405 on its first use (the request is then "
        "translated at once) and shown on /status.",
    )

    @field_validator("apis")
    @classmethod
    def _check_apis(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("names an API twice")
        return value

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https"):
            raise ValueError("must be an http:// or https:// URL")
        check_host_port(parts)
        if parts.query or parts.fragment:
            raise ValueError("must not have a query or fragment")
        if parts.username is not None or parts.password is not None:
            # URLs end up in errors, logs and /status: credentials belong in
            # api_key_env or headers, which are never shown.
            raise ValueError("must not contain credentials; use api_key_env or headers")
        return value

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, value: list[str]) -> list[str]:
        for index, url in enumerate(value):
            try:
                cls._check_url(url)
            except ValueError as exc:
                # By position, not by value: the URL itself may hold a secret.
                raise ValueError(f"entry {index} {exc}") from None
        return value

    @field_validator("model_aliases")
    @classmethod
    def _check_model_aliases(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        # `models` is validated first (it is declared first); absent if it was invalid.
        return check_model_aliases(value, info.data.get("models"))

    @field_validator("learn_models")
    @classmethod
    def _check_learn_models(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        # `models` is validated first (it is declared first); absent if it was invalid.
        if value is True and info.data.get("models"):
            raise ValueError(
                "is true while models lists names: a region lists its models or learns them"
            )
        return value

    @field_validator("models_refresh")
    @classmethod
    def _check_models_refresh(cls, value: float | None, info: ValidationInfo) -> float | None:
        # Set for a region that does not learn, it would do nothing.
        if value is not None and (
            info.data.get("learn_models") is False or info.data.get("models")
        ):
            raise ValueError(
                "is set but the region does not learn its models "
                "(learn_models = false, or models listed)"
            )
        return value

    @property
    def models_refresh_interval(self) -> float:
        """Seconds between two fetches of the region's models: ``models_refresh``, 60 when
        unset."""
        return _MODELS_REFRESH if self.models_refresh is None else self.models_refresh

    @property
    def keeps_responses(self) -> bool:
        """Whether the region keeps stored responses: ``stores_responses``, unset meaning
        yes unless it runs llama.cpp."""
        if self.stores_responses is not None:
            return self.stores_responses
        return self.server != "llama.cpp"

    @property
    def learns_models(self) -> bool:
        """Whether the region's models are learnt from its /v1/models: ``learn_models``,
        unset meaning yes when it lists none."""
        return not self.models if self.learn_models is None else self.learn_models

    @field_validator("continuation")
    @classmethod
    def _check_continuation(cls, value: str, info: ValidationInfo) -> str:
        # `server` is validated first (it is declared first); absent if it was invalid.
        if info.data.get("server") == "openai" and value in ("continue_final_message", "prefill"):
            raise ValueError(
                f"{value!r} needs a server that continues a final assistant message; "
                "OpenAI's API does not (use 'reissue' or 'off')"
            )
        return value

    @property
    def continuation_method(self) -> str:
        """The continuation method in effect: ``continuation`` with ``auto`` resolved."""
        if self.continuation == "auto":
            return _AUTO_CONTINUATION.get(self.server, "off")
        return self.continuation

    @field_validator("lat", "lon")
    @classmethod
    def _check_position(cls, value: float, info: ValidationInfo) -> float:
        kind, bound = ("latitude", 90.0) if info.field_name == "lat" else ("longitude", 180.0)
        if not (math.isfinite(value) and -bound <= value <= bound):
            raise ValueError(
                f"must be a {kind} in degrees between -{bound:g} and {bound:g}, not {value}"
            )
        return value

    @field_validator("weight")
    @classmethod
    def _check_weight(cls, value: float) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"must be a positive finite number, not {value}")
        return value

    def resolved_api_key(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The credential for this region: ``api_key``, else the variable ``api_key_env`` names."""
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            return (os.environ if environ is None else environ).get(self.api_key_env) or None
        return None
