"""The pool for one origin: HTTP/2 (h2c, or TLS with ALPN), HTTP/1.1, or either, found."""

from __future__ import annotations

import ssl
from typing import Literal

from edgeproxy._upstream.autopool import AutoPool
from edgeproxy._upstream.h2pool import H2Pool
from edgeproxy._upstream.http1 import AiohttpPool
from edgeproxy._upstream.pool import PoolLimits, UpstreamPool

__all__ = ["make_pool"]


def make_pool(
    origin: str,
    *,
    http2: bool | Literal["auto"],
    limits: PoolLimits,
    ssl_context: ssl.SSLContext | None = None,
    http1_ssl_context: ssl.SSLContext | None = None,
    label: str | None = None,
) -> UpstreamPool:
    """Build the pool for one origin: HTTP/2 (h2c or TLS+ALPN), HTTP/1.1, or, with
    ``"auto"``, the one the origin speaks (see :class:`AutoPool` for the two contexts).
    ``label`` names the endpoint in what ``"auto"`` logs."""
    if http2 == "auto":
        return AutoPool(
            origin,
            limits,
            ssl_context=ssl_context,
            http1_ssl_context=http1_ssl_context,
            label=label,
        )
    if http2:
        return H2Pool(origin, limits, ssl_context=ssl_context)
    return AiohttpPool(origin, limits, ssl_context=ssl_context)
