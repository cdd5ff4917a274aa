"""Helpers for the first-party plugin tests: a proxy that also takes plugin objects."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import pytest

from edgeproxy import Config, EdgeProxy, RequestContext, hookimpl

from ..conftest import ProxyFactory, eventually, proxy_config

PluginProxyFactory = Callable[..., Awaitable[EdgeProxy]]
CHAT = "/v1/chat/completions"


class Recorder:
    """A tiny test plugin: keeps the context of every finished request."""

    def __init__(self) -> None:
        self.contexts: list[RequestContext] = []
        self._taken = 0

    @hookimpl
    def edgeproxy_response_complete(self, ctx: RequestContext) -> None:
        self.contexts.append(ctx)

    async def next(self) -> RequestContext:
        """The context of the next request to finish after the previous ``next()``.

        The hook runs once the response is sent, possibly after the client has
        read it: wait for it rather than race it.
        """
        self._taken += 1
        await eventually(lambda: len(self.contexts) >= self._taken)
        return self.contexts[self._taken - 1]


def build_proxy(
    regions: list[dict[str, Any]], *, extra: Iterable[object] = (), **sections: dict[str, Any]
) -> EdgeProxy:
    """An EdgeProxy as users get it: ``[plugins]`` from config, plus ``extra`` plugin objects."""
    config = Config.from_mapping(proxy_config(regions, **sections), environ={})
    return EdgeProxy(config, plugins=list(extra))


@pytest.fixture
def make_plugin_proxy(make_proxy: ProxyFactory) -> PluginProxyFactory:
    """``make_proxy`` with ``extra=[plugin objects]`` besides the ``[plugins]`` of the config
    (``plugins=plugins_section(...)`` here is that config section)."""

    async def factory(
        regions: list[dict[str, Any]], *, extra: Iterable[object] = (), **sections: dict[str, Any]
    ) -> EdgeProxy:
        config = Config.from_mapping(proxy_config(regions, **sections), environ={})
        return await make_proxy(config=config, plugins=extra)

    return factory


def plugins_section(**settings: dict[str, Any]) -> dict[str, Any]:
    """``[plugins]`` enabling ``edgeproxy.plugins.<name>`` for each named settings table."""
    return {
        "enabled": [f"edgeproxy.plugins.{name}" for name in settings],
        "settings": settings,
        "entry_points": False,
    }
