"""The pool for one origin: HTTP/2 (h2c, or TLS with ALPN) or HTTP/1.1."""

from __future__ import annotations

import ssl

from edgeproxy._upstream.h2pool import H2Pool
from edgeproxy._upstream.http1 import AiohttpPool
from edgeproxy._upstream.pool import PoolLimits, UpstreamPool

__all__ = ["make_pool"]


def make_pool(
    origin: str,
    *,
    http2: bool,
    limits: PoolLimits,
    ssl_context: ssl.SSLContext | None = None,
) -> UpstreamPool:
    """Build the pool for one origin: HTTP/2 (h2c or TLS+ALPN) or HTTP/1.1."""
    if http2:
        return H2Pool(origin, limits, ssl_context=ssl_context)
    return AiohttpPool(origin, limits, ssl_context=ssl_context)
