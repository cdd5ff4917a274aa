"""Where each stored object lives, shared by every PoP and worker through Redis:
``[stateful]``."""

from __future__ import annotations

from pydantic import Field

from edgeproxy._core.config.kinds import Count, FinitePositive
from edgeproxy._core.config.redis import RedisSection, redis_url_field

__all__ = ["StatefulConfig"]


class StatefulConfig(RedisSection):
    """Stateful requests go to the region that holds their state.

    A region that answers a request creating a stored object (a Responses API response
    with ``store`` not false, a conversation, a file, a batch, a vector store) is
    remembered as its owner: in this process, and in Redis when one is set, so that every
    PoP and worker sends the requests that refer to the object (``previous_response_id``,
    ``conversation``, ``/v1/files/{id}/content``, a batch's ``input_file_id``...) to that
    region. Each object answers only the scope (tenant, else credentials) that made it.
    """

    enabled: bool = Field(
        True,
        description="Send requests that refer to a stored object to the region that made it "
        "(off: they are routed like any other).",
    )
    redis_url: str = redis_url_field(
        "Share the owners of stored objects through this Redis", off="keeps them in this process"
    )
    redis_prefix: str = Field(
        "edgeproxy:owner:", description="Prefix of the owner keys: <prefix><object id>."
    )
    redis_timeout: FinitePositive = Field(
        0.25,
        description="Seconds a Redis read or write of owners may take. A lookup past it "
        "gets 503 with Retry-After (never a 404: the object may exist); a write past it is "
        "retried.",
    )
    redis_max_connections: int = Field(
        32,
        ge=2,
        description="Most connections in the owners' Redis pool of each proxy process (one "
        "kept for the writes). A call past it waits for a free one.",
    )
    redis_pool_timeout: FinitePositive = Field(
        1.0,
        description="Seconds a lookup waits for a free Redis connection; past it the request "
        "gets 503 with Retry-After.",
    )
    write_queue: Count = Field(
        100_000,
        description="Owners made in this process waiting to be written to Redis (while it is "
        "down or slow: each is retried until Redis takes it); past it the oldest is dropped "
        "and known to this process only.",
    )
    max_refs: Count = Field(
        1000,
        description="Most stored objects one request may refer to (distinct ids, looked up in "
        "batches of 100); a request naming more gets 400 too_many_references.",
    )
    tenant_binding: bool = Field(
        True,
        description="Bind each stored object to the scope that made it: the tenant, else a "
        "hash of the client's credential headers, else anonymous clients (the cache's "
        "scope). A request of another scope gets the API's own 404, as the provider would "
        "answer a stranger. Off: anyone holding an id reaches the object through the proxy "
        "(only where the regions check each client's own credentials, with [server] "
        "forward_client_credentials).",
    )
    ttl: FinitePositive = Field(
        30 * 24 * 3600.0,
        description="Seconds an owner is remembered after the object was made.",
    )
    memory_entries: Count = Field(
        100_000,
        description="Owners kept in each process's memory (the oldest forgotten first).",
    )
    retry_after: Count = Field(
        5,
        description="Retry-After seconds of the 503 a request gets while the region holding "
        "its state is unavailable.",
    )
    edge_prefix: str = Field(
        "edgeproxy:chain:",
        description="Prefix of the Responses chains the edge holds (routes with "
        "responses_state = 'edge'): <prefix><response id>.",
    )
    edge_retention: FinitePositive = Field(
        30 * 24 * 3600.0,
        description="Seconds the edge holds each stored response of a chain (OpenAI keeps "
        "stored responses 30 days).",
    )
    edge_max_chain_bytes: Count = Field(
        4 * 1024 * 1024,
        description="Most bytes of one chain the edge holds (every turn's input and output "
        "items, as JSON); a turn past it is not held, and the chain goes on at its owner only.",
    )
    edge_max_turns: Count = Field(
        256,
        description="Most turns of one chain the edge holds; a turn past it is not held.",
    )
    edge_memory_bytes: Count = Field(
        64 * 1024 * 1024,
        description="Bytes of chains each process keeps in memory when no Redis is set (the "
        "oldest turns forgotten first); with Redis, chains live there.",
    )
