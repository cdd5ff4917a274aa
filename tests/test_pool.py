"""The HTTP/1.1 pool (aiohttp client) behind the UpstreamPool interface."""

from __future__ import annotations

import asyncio

import pytest

from edgeproxy import PoolLimits, UpstreamConnectError, UpstreamTimeout
from edgeproxy._upstream.factory import make_pool
from edgeproxy._upstream.http1 import AiohttpPool
from edgeproxy._upstream.pool import split_origin

from .conftest import RegionFactory, eventually


def _limits(**overrides: float) -> PoolLimits:
    values = {"connect_timeout": 2.0, "read_timeout": 10.0, "pool_timeout": 0.3}
    values.update(overrides)
    return PoolLimits(**values)  # type: ignore[arg-type]


async def test_waiting_for_a_connection_times_out_as_retryable(
    make_region: RegionFactory,
) -> None:
    region = await make_region("h1", fault="stall_body")
    # aiohttp counts the wait for a free connection in its connect timeout, which the
    # pool sets to pool_timeout + connect_timeout: keep both short.
    pool = AiohttpPool(region.url, _limits(http1_max_connections=1, connect_timeout=0.2))
    try:
        body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "x"}]}'
        held = await pool.request(
            "POST", "/v1/chat/completions", [("content-type", "application/json")], body
        )
        assert pool.stats().streams_in_use == 1
        with pytest.raises(UpstreamTimeout) as info:
            await pool.request("GET", "/v1/models", [])
        # Nothing was sent, so the request may go elsewhere.
        assert info.value.phase == "connect" and info.value.retryable
        await held.aclose()
        assert pool.stats().streams_in_use == 0
        resp = await pool.request("GET", "/v1/models", [])
        assert resp.status == 200
        await resp.aclose()
    finally:
        await pool.aclose()


async def test_connect_refused_is_retryable() -> None:
    pool = AiohttpPool("http://127.0.0.1:9", _limits())
    try:
        with pytest.raises(UpstreamConnectError) as info:
            await pool.request("GET", "/", [])
        assert info.value.retryable
    finally:
        await pool.aclose()


async def test_streams_in_use_counts_open_responses(make_region: RegionFactory) -> None:
    region = await make_region("h1")
    pool = make_pool(split_origin(region.url)[0], http2=False, limits=_limits())
    try:
        await pool.start()
        responses = await asyncio.gather(*(pool.request("GET", "/v1/models", []) for _ in range(3)))
        assert pool.stats().streams_in_use == 3
        for resp in responses:
            assert b"".join([c async for c in resp.aiter_bytes()])
            await resp.aclose()
        await eventually(lambda: pool.stats().streams_in_use == 0)
        assert pool.stats().http_version == "1.1"
    finally:
        await pool.aclose()
