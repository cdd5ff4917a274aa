"""Rate limits, in-flight caps, the priority queue and load shedding: ``[admission]``."""

from __future__ import annotations

from pydantic import Field

from edgeproxy._core.config.checks import HeaderName, Networks
from edgeproxy._core.config.kinds import (
    Count,
    CountOrZero,
    FiniteNonNegative,
    FinitePositive,
    Share,
)
from edgeproxy._core.config.redis import RedisSection, redis_url_field

__all__ = ["AdmissionConfig"]


class AdmissionConfig(RedisSection):
    """Admission control: rate limits, in-flight caps, the priority queue and load shedding.

    A request passes, in order: the token buckets of its API key or tenant
    and of its client IP (429 past them), then the global and per-route
    in-flight caps. Beyond a cap it waits in a priority queue, higher
    priority first, for at most ``max_queue_time``; past ``max_queue`` the
    lowest priority is shed with a 503 and Retry-After, or, on a route with
    ``on_overload = "degrade"``, answered by the fallback ladder.
    """

    max_in_flight: CountOrZero = Field(
        0, description="Most requests in flight at once over every route; 0 means no cap."
    )
    max_queue: CountOrZero = Field(
        1000,
        description="Most requests waiting for a slot; when full, the lowest priority is shed "
        "(503). 0 sheds at once.",
    )
    max_queue_time: FiniteNonNegative = Field(
        5.0,
        description="Seconds a request may wait for a slot before a 503; a route's "
        "max_queue_time or deadline may shorten it.",
    )
    priority_header: HeaderName = Field(
        "X-Priority",
        description="Request header with an integer priority (-9999..9999, higher first), used "
        "when no plugin set ctx.priority; '' ignores it.",
    )
    deadline_header: HeaderName = Field(
        "X-Request-Timeout-Ms",
        description="Header sent upstream with the milliseconds left of the route's deadline "
        "when the request leaves the queue (a client's own is replaced); '' sends none.",
    )
    key_header: HeaderName = Field(
        "Authorization",
        description="Header whose value, hashed, keys the per-key rate limits when no plugin "
        "set a tenant (with Authorization, x-api-key when it is absent, as Anthropic's "
        "clients send); '' keys them by tenant only.",
    )
    key_requests_per_second: FiniteNonNegative = Field(
        0.0,
        description="Requests per second per API key or tenant; 0 means no limit.",
    )
    key_burst: FiniteNonNegative = Field(
        0.0,
        description="Requests a key may send at once (bucket size); 0 means one second's worth.",
    )
    key_tokens_per_minute: FiniteNonNegative = Field(
        0.0,
        description="LLM tokens per minute per API key or tenant: the prompt estimate is "
        "charged up front, then settled with the upstream's usage; 0 means no limit.",
    )
    ip_requests_per_second: FiniteNonNegative = Field(
        0.0,
        description="Requests per second per client IP; 0 means no limit.",
    )
    ip_burst: FiniteNonNegative = Field(
        0.0,
        description="Requests an IP may send at once (bucket size); 0 means one second's worth.",
    )
    cached_token_weight: Share = Field(
        1.0,
        description="What a prompt token read from a region's prompt cache counts for "
        "against the tokens-per-minute limits, settled with the answer's usage (0.1: a "
        "tenth, as providers bill them; 1: as any token).",
    )
    ip_tokens_per_minute: FiniteNonNegative = Field(
        0.0,
        description="LLM tokens per minute per client IP, settled like key_tokens_per_minute; "
        "0 means no limit.",
    )
    trusted_proxies: Networks = Field(
        default_factory=list,
        # Out of dumps: what it said is in server.trusted_proxies once loaded, and a dump
        # validated again (a worker's config) must not warn of it again.
        exclude=True,
        description="Deprecated: set server.trusted_proxies, which this feeds (they must "
        "agree when both are set). Networks (CIDR) of proxies in front of this one: "
        "X-Forwarded-For is believed only from them when finding the client IP.",
    )
    redis_url: str = redis_url_field(
        "Share the buckets between workers and PoPs through this Redis",
        off="keeps them in the process",
    )
    redis_prefix: str = Field(
        "edgeproxy:rl:",
        description="Prefix of the bucket keys in Redis. Each key carries its identity as a "
        "hash tag ({...}); a prefix with braces of its own would put every bucket in one slot.",
    )
    redis_timeout: FinitePositive = Field(
        0.25,
        description="Seconds a Redis call may take before the request is limited locally.",
    )
    redis_retry_interval: FinitePositive = Field(
        5.0,
        description="Seconds between attempts to reach Redis again once it failed; buckets are "
        "local meanwhile.",
    )
    max_local_buckets: Count = Field(
        100_000,
        description="Most keys and IPs tracked in the process; the least recently seen go first.",
    )
