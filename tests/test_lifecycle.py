"""EdgeProxy's resources open and close through one exit stack: a failed start and a
normal close undo the same steps in the same (reverse) order."""

from __future__ import annotations

from typing import Any

import pytest

from edgeproxy import Config, EdgeProxy, PluginError, hookimpl
from edgeproxy._admission.ratelimit import RateLimiter
from edgeproxy._cache.stage import CacheStage
from edgeproxy._obtain.fallback import FallbackStage
from edgeproxy._routing.router import Router
from edgeproxy._upstream.regions import RegionSet
from tests.conftest import RegionFactory, proxy_config

# What closing looks like, last opened first: the plugins' shutdown hook, then the cache
# (its background refreshes use the pools), the regions, the router's geo database, the
# rate-limit backend, and the local model.
CLOSE_ORDER = ["shutdown", "cache", "regions", "router", "admission", "fallback"]


@pytest.fixture
def closed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the resources closed, in order."""
    order: list[str] = []

    def record(cls: type, name: str, label: str, *, is_async: bool = True) -> None:
        original = getattr(cls, name)
        if is_async:

            async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
                order.append(label)
                return await original(self, *args, **kwargs)

        else:

            def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
                order.append(label)
                return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapped)

    record(CacheStage, "close", "cache")
    record(RegionSet, "close", "regions")
    record(Router, "close", "router", is_async=False)
    # Admission closes its rate limiter, and nothing else (the stage itself may be compiled,
    # and a compiled class cannot be patched).
    record(RateLimiter, "close", "admission")
    record(FallbackStage, "close", "fallback")
    return order


class Lifecycle:
    def __init__(self, order: list[str], *, fail: bool = False) -> None:
        self.order = order
        self.fail = fail

    @hookimpl
    async def edgeproxy_startup(self, proxy: EdgeProxy) -> None:
        if self.fail:
            raise RuntimeError("startup refused")

    @hookimpl
    async def edgeproxy_shutdown(self, proxy: EdgeProxy) -> None:
        # The shutdown hook still sees open regions: it runs first.
        assert proxy.regions is not None
        if not self.fail:
            self.order.append("shutdown")


async def test_close_undoes_open_in_reverse_order(
    make_region: RegionFactory, closed: list[str]
) -> None:
    region = await make_region("r1")
    config = Config.from_mapping(proxy_config([{"name": "r1", "url": region.url}]), environ={})
    proxy = EdgeProxy(config, plugins=[Lifecycle(closed)])
    await proxy.open()
    assert proxy.regions is not None
    assert closed == []
    await proxy.close()
    assert closed == CLOSE_ORDER
    with pytest.raises(RuntimeError, match="not open"):
        proxy.regions  # noqa: B018 - the property raises once closed


async def test_a_failed_start_closes_what_opened_in_the_same_order(
    make_region: RegionFactory, closed: list[str]
) -> None:
    region = await make_region("r1")
    config = Config.from_mapping(proxy_config([{"name": "r1", "url": region.url}]), environ={})
    proxy = EdgeProxy(config, plugins=[Lifecycle(closed), Lifecycle(closed, fail=True)])
    with pytest.raises(PluginError):
        await proxy.open()
    assert closed == CLOSE_ORDER
    with pytest.raises(RuntimeError, match="not open"):
        proxy.regions  # noqa: B018
    # Nothing is left half-open: the proxy can be opened again once the plugin allows it.
    closed.clear()
    for plugin in proxy.plugins.pm.get_plugins():
        if isinstance(plugin, Lifecycle):
            plugin.fail = False
    await proxy.open()
    await proxy.close()
    # Both plugins started this time, so both shut down.
    assert closed == ["shutdown", *CLOSE_ORDER]


async def test_open_is_counted_per_user(make_region: RegionFactory, closed: list[str]) -> None:
    region = await make_region("r1")
    config = Config.from_mapping(proxy_config([{"name": "r1", "url": region.url}]), environ={})
    proxy = EdgeProxy(config)
    await proxy.open()
    await proxy.open()
    await proxy.close()
    assert closed == []
    assert proxy.regions is not None
    await proxy.close()
    assert closed == CLOSE_ORDER[1:]
