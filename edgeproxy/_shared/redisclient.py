"""The one way the proxy opens a Redis client: standalone or Redis Cluster, TCP, TLS or a socket.

The cache, the shared rate limits, the shared load view and the owners of
stored objects each build their client here from their section's
:class:`~edgeproxy._core.config.RedisSettings`: those of the Redis connection
the section names (``redis = "<name>"``), or of its own ``redis_*`` keys, as the
config resolved them. So AUTH, TLS and cluster mode mean the same everywhere.
What differs between them (timeouts, pool size, whether a busy pool waits) are
arguments. Sections that name the same connection share its settings, not a
client: each opens and closes its own pool with its own socket timeouts, and a
pool is bound to the event loop that opened it.

On a Redis Cluster (``redis_cluster = true``) the URL names one node; redis-py's
``RedisCluster`` discovers the others and sends each command to the master of
its key's hash slot. Commands over several keys (a Lua script, UNLINK) must
stay within one slot: the callers give such keys a common hash tag (``{...}``)
or split the command by slot. A cluster client keeps a pool per node of at most
``max_connections``; past it a call fails at once (the standalone pool may wait
``pool_timeout`` instead).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import (
    BlockingConnectionPool,
    ConnectionPool,
    Redis,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.cluster import RedisCluster

from edgeproxy._core.config import RedisSettings

__all__ = ["RedisClient", "make_client", "ready", "safe_url"]

RedisClient = Redis | RedisCluster


def _tls_options(settings: RedisSettings) -> dict[str, Any]:
    options: dict[str, Any] = {
        "ssl_cert_reqs": "required" if settings.tls_verify else "none",
        "ssl_check_hostname": settings.tls_verify,
    }
    if settings.tls_ca_file:
        options["ssl_ca_certs"] = settings.tls_ca_file
    if settings.tls_cert_file:
        options["ssl_certfile"] = settings.tls_cert_file
    if settings.tls_key_file:
        options["ssl_keyfile"] = settings.tls_key_file
    return options


def client_options(
    settings: RedisSettings,
    *,
    connect_timeout: float,
    socket_timeout: float | None = None,
    max_connections: int | None = None,
    pool_timeout: float | None = None,
) -> dict[str, Any]:
    """The keyword arguments of the connection pool (standalone) or of ``RedisCluster``.

    Exposed for tests; :func:`make_client` is what callers use.
    """
    url = urlsplit(settings.url)
    username = settings.username or (unquote(url.username) if url.username else None)
    password = settings.password or (unquote(url.password) if url.password else None)
    options: dict[str, Any] = {
        "username": username,
        "password": password,
        "socket_connect_timeout": connect_timeout,
        "socket_timeout": socket_timeout,
    }
    if max_connections is not None:
        options["max_connections"] = max_connections
    tls = url.scheme == "rediss" or settings.tls
    if settings.cluster:
        options["host"] = url.hostname or "127.0.0.1"
        options["port"] = url.port or 6379
        if tls:
            options["ssl"] = True
            options.update(_tls_options(settings))
        return options
    if pool_timeout is not None:
        options["timeout"] = pool_timeout
    if url.scheme == "unix":  # unix:///path/to/redis.sock[?db=N]
        options["connection_class"] = UnixDomainSocketConnection
        options["path"] = url.path
        db = parse_qs(url.query).get("db", [""])[0]
    else:
        options["host"] = url.hostname or "127.0.0.1"
        options["port"] = url.port or 6379
        db = url.path.strip("/")
        if tls:
            options["connection_class"] = SSLConnection
            options.update(_tls_options(settings))
    options["db"] = int(db) if db else 0
    return options


def make_client(
    settings: RedisSettings,
    *,
    connect_timeout: float,
    socket_timeout: float | None = None,
    max_connections: int | None = None,
    pool_timeout: float | None = None,
) -> RedisClient:
    """A client for ``settings``; no connection is opened until the first command.

    ``socket_timeout`` bounds each read (None: the caller bounds whole calls
    itself); ``max_connections`` caps the pool (per node on a cluster). With
    ``pool_timeout`` a standalone call waits that long for a free connection
    of a full pool instead of failing at once.
    """
    options = client_options(
        settings,
        connect_timeout=connect_timeout,
        socket_timeout=socket_timeout,
        max_connections=max_connections,
        pool_timeout=pool_timeout,
    )
    if settings.cluster:
        return RedisCluster(**options)
    pool_class = BlockingConnectionPool if pool_timeout is not None else ConnectionPool
    return Redis.from_pool(pool_class(**options))


async def ready(client: RedisClient) -> None:
    """Before concurrent script calls on a cluster client: learn the topology first.

    Lua scripts (EVALSHA) sent concurrently by a cluster client that has not
    learnt the cluster's topology yet, or must learn it again after a fault,
    can fail with an ``AttributeError`` inside redis-py (seen with redis-py
    8.1); learning it first, once, under its own lock, avoids that. A no-op
    for a standalone client and for a cluster client that knows the topology.
    """
    if isinstance(client, RedisCluster):
        await client.initialize()


def safe_url(url: str) -> str:
    """``url`` without its user name and password, for logs and ``/status``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"
