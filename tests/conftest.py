from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from edgeproxy import EdgeProxy
from edgeproxy._config import config_from_mapping
from edgeproxy.testing import Behavior, FakeRegion

ProxyFactory = Callable[..., Awaitable[EdgeProxy]]
RegionFactory = Callable[..., Awaitable[FakeRegion]]


@pytest.fixture
async def make_region() -> AsyncIterator[RegionFactory]:
    """Start fake regional clusters (real hypercorn, h2c + HTTP/1.1); all stopped afterwards."""
    started: list[FakeRegion] = []

    async def factory(name: str = "r1", **behavior: Any) -> FakeRegion:
        region = FakeRegion(name=name, behavior=Behavior(**behavior))
        await region.start()
        started.append(region)
        return region

    yield factory
    for region in started:
        await region.stop()


def proxy_config(regions: list[dict[str, Any]], **sections: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0, "grace_period": 5.0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "pop": {"name": "edge-test", "lat": 1.35, "lon": 103.82},
        "upstream": {"read_timeout": 10.0, "connect_timeout": 2.0},
        "regions": regions,
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


@pytest.fixture
async def make_proxy() -> AsyncIterator[ProxyFactory]:
    """Start an EdgeProxy on ephemeral ports in front of the given regions."""
    started: list[EdgeProxy] = []

    async def factory(regions: list[dict[str, Any]], **sections: dict[str, Any]) -> EdgeProxy:
        proxy = EdgeProxy(config_from_mapping(proxy_config(regions, **sections), environ={}))
        await proxy.start()
        started.append(proxy)
        return proxy

    yield factory
    for proxy in started:
        await proxy.stop(grace=2.0)


async def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll until ``predicate`` holds; fails the test after a generous ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)
