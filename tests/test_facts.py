"""Request facts: fixed once a request has entered, and never written again."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from edgeproxy import Exchange, RequestContext, hookimpl
from edgeproxy._core.context import FixedFact

from .conftest import ProxyFactory, RegionFactory, eventually

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Seen:
    """Keeps the facts each request had when it went upstream."""

    def __init__(self) -> None:
        self.facts: list[Any] = []

    @hookimpl
    def edgeproxy_request_received(self, request: Exchange, ctx: RequestContext) -> None:
        assert ctx.facts is None  # not yet: entry is still going on
        ctx.tenant = "acme"

    @hookimpl
    def edgeproxy_upstream_request(self, ctx: RequestContext) -> None:
        self.facts.append(ctx.facts)


async def test_the_facts_are_fixed_at_entry(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    seen = Seen()
    proxy = await make_proxy([await make_region("r1")], plugins=[seen])
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            await resp.read()
    [facts] = seen.facts
    assert facts.tenant == "acme"
    assert facts.dialect == "chat.completions"
    assert facts.stream is True
    assert facts.client_ip == "127.0.0.1"
    assert facts.route.name == proxy.config.route_for("POST", CHAT).name
    assert facts.body is not None and b'"stream":true' in facts.body.replace(b" ", b"")
    with pytest.raises(AttributeError):
        facts.tenant = "other"  # type: ignore[misc]


class LateTenant:
    """Changes what the request is after it entered: refused."""

    def __init__(self, how: str) -> None:
        self.how = how

    @hookimpl
    def edgeproxy_upstream_request(self, ctx: RequestContext) -> None:
        if self.how == "tenant":
            ctx.tenant = "someone-else"
        else:
            ctx.set_json({**BODY, "messages": [{"role": "user", "content": "EVIL"}]})


@pytest.mark.parametrize("how", ["tenant", "set_json"])
async def test_a_hook_after_entry_cannot_change_the_facts(
    make_region: RegionFactory, make_proxy: ProxyFactory, how: str
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region], plugins=[LateTenant(how)])
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 500
            assert (await resp.json())["error"]["code"] == "plugin_error"
    assert region.counters().requests_by_path.get(CHAT, 0) == 0


async def test_a_fail_open_hook_that_changes_a_fact_is_skipped_and_the_fact_kept() -> None:
    from edgeproxy._plugins import Plugins

    plugins = Plugins(fail_open=["late"])
    plugins.register(LateTenant("tenant"), "late")
    ctx = entered_context()
    await plugins.call_all("edgeproxy_upstream_request", request=None, ctx=ctx, region=None,
                           headers=[])  # fmt: skip
    assert ctx.tenant == "acme" and ctx.facts is not None and ctx.facts.tenant == "acme"


def entered_context() -> RequestContext:
    from multidict import CIMultiDict

    from edgeproxy._core.config import RouteConfig
    from edgeproxy._core.context import start_context
    from edgeproxy._protocol.headers import trace_context

    ctx = start_context(
        "r", trace_context(None), "POST", CHAT, CIMultiDict(), "192.0.2.1", 0.0,
        RouteConfig(name="default", path="/"), "http", "1.1", "h",
    )  # fmt: skip
    ctx.set_json(BODY)
    ctx.tenant = "acme"
    ctx.fix("chat.completions")
    return ctx


def test_with_json_fixes_a_new_request() -> None:
    ctx = entered_context()
    facts = ctx.facts
    with pytest.raises(FixedFact):
        ctx.set_json({})
    leg = ctx.with_json({**BODY, "stream": True})
    assert leg.facts is not None and leg.facts is not facts
    assert leg.facts.stream is True and leg.facts.dialect == "chat.completions"
    assert ctx.facts is facts and ctx.json == BODY


class Anonymize:
    """Anonymizes the client's address for the observers after it, once answered."""

    @hookimpl(tryfirst=True)
    def edgeproxy_response_complete(self, ctx: RequestContext) -> None:
        ctx.client_ip = "0.0.0.0"


class Observer:
    def __init__(self) -> None:
        self.seen: list[tuple[str | None, str | None]] = []

    @hookimpl(trylast=True)
    def edgeproxy_response_complete(self, ctx: RequestContext) -> None:
        assert ctx.facts is not None
        self.seen.append((ctx.client_ip, ctx.facts.client_ip))


async def test_once_answered_a_hook_may_change_the_context_for_those_after_it(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    observer = Observer()
    proxy = await make_proxy([region], plugins=[Anonymize(), observer])
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200
            await resp.read()
    await eventually(lambda: bool(observer.seen))
    assert observer.seen == [("0.0.0.0", "127.0.0.1")]
