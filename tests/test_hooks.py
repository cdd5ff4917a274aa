"""Plugin hooks, called through the real server with real fake regions."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from edgeproxy import (
    Config,
    EdgeProxy,
    Exchange,
    RequestContext,
    Response,
    StreamResponse,
    UpstreamReply,
    hookimpl,
)
from edgeproxy._plugins import Plugins
from edgeproxy._upstream.regions import Region
from edgeproxy.hookspecs import hook_names

from .conftest import ProxyFactory, RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
DETERMINISTIC = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


class Recorder:
    """Implements every hook, some sync and some async, recording the arguments."""

    def __init__(self) -> None:
        self.calls: dict[str, list[dict[str, Any]]] = {}

    def _rec(self, hook: str, **kwargs: Any) -> None:
        self.calls.setdefault(hook, []).append(kwargs)

    @hookimpl
    async def edgeproxy_startup(self, proxy: EdgeProxy) -> None:
        self._rec("edgeproxy_startup", proxy=proxy)

    @hookimpl
    def edgeproxy_shutdown(self, proxy: EdgeProxy) -> None:
        self._rec("edgeproxy_shutdown", proxy=proxy)

    @hookimpl
    async def edgeproxy_request_received(self, request: Exchange, ctx: RequestContext) -> None:
        self._rec("edgeproxy_request_received", request=request, ctx=ctx)

    @hookimpl
    def edgeproxy_route(
        self, request: Exchange, ctx: RequestContext, candidates: list[Region]
    ) -> None:
        self._rec("edgeproxy_route", request=request, ctx=ctx, candidates=list(candidates))

    @hookimpl
    async def edgeproxy_cache_key(
        self, request: Exchange, ctx: RequestContext, default_key: str
    ) -> None:
        self._rec("edgeproxy_cache_key", request=request, ctx=ctx, default_key=default_key)

    @hookimpl
    def edgeproxy_upstream_request(
        self,
        request: Exchange,
        ctx: RequestContext,
        region: Region,
        headers: list[tuple[str, str]],
    ) -> None:
        self._rec("edgeproxy_upstream_request", region=region, headers=list(headers))
        headers.append(("x-plugin-added", "yes"))

    @hookimpl
    async def edgeproxy_upstream_response(
        self, request: Exchange, ctx: RequestContext, region: Region, reply: UpstreamReply
    ) -> None:
        self._rec("edgeproxy_upstream_response", region=region, status=reply.status)
        reply.headers.append(("X-Plugin-Seen", reply.status.__str__()))

    @hookimpl
    async def edgeproxy_stream_chunk(
        self, request: Exchange, ctx: RequestContext, chunk: bytes
    ) -> None:
        self._rec("edgeproxy_stream_chunk", chunk=chunk, request_id=ctx.request_id)

    @hookimpl
    def edgeproxy_response_complete(self, request: Exchange, ctx: RequestContext) -> None:
        self._rec(
            "edgeproxy_response_complete",
            request_id=ctx.request_id,
            status=ctx.status,
            region=ctx.region,
            usage=ctx.usage,
            started=ctx.started,
            finished=ctx.finished_at,
            first_byte=ctx.first_byte_at,
            bytes_out=ctx.bytes_out,
        )

    @hookimpl
    def edgeproxy_fallback(
        self,
        request: Exchange,
        ctx: RequestContext,
        reason: str,
        answer: StreamResponse | None,
    ) -> None:
        self._rec("edgeproxy_fallback", reason=reason, answer=answer)


@pytest.fixture
async def started() -> AsyncIterator[list[EdgeProxy]]:
    proxies: list[EdgeProxy] = []
    yield proxies
    for proxy in proxies:
        await proxy.stop(grace=2.0)


async def start_proxy(
    started: list[EdgeProxy], regions: list[dict[str, Any]], *plugins: object, **sections: Any
) -> EdgeProxy:
    config = Config.from_mapping(proxy_config(regions, **sections), environ={})
    proxy = EdgeProxy(config, plugins=plugins)
    await proxy.start()
    started.append(proxy)
    return proxy


async def test_every_hook_is_called_with_its_documented_arguments(
    make_region: RegionFactory, started: list[EdgeProxy]
) -> None:
    # Tokens paced, so that the stream reaches the proxy in several reads (the bytes of
    # one read are relayed as one chunk).
    region = await make_region("ap-1", inter_token_delay=0.005)
    recorder = Recorder()
    proxy = await start_proxy(started, [{"name": "ap-1", "url": region.url}], recorder)
    assert [c["proxy"] for c in recorder.calls["edgeproxy_startup"]] == [proxy]
    async with aiohttp.ClientSession() as client:
        body = {**DETERMINISTIC, "stream": True, "stream_options": {"include_usage": True}}
        async with client.post(proxy.url + CHAT, json=body) as resp:
            assert resp.status == 200
            assert resp.headers["X-Plugin-Seen"] == "200"
            await resp.read()
        async with client.post(proxy.url + "/echo/x", data=b"abc") as resp:
            echo = await resp.json()
    assert ["x-plugin-added", "yes"] in echo["headers"]

    calls = recorder.calls
    received = calls["edgeproxy_request_received"][0]
    assert isinstance(received["request"], Exchange)
    assert received["ctx"].path == CHAT
    assert [r.name for r in calls["edgeproxy_route"][0]["candidates"]] == ["ap-1"]
    assert len(calls["edgeproxy_cache_key"]) == 1  # only the deterministic chat request
    assert len(calls["edgeproxy_cache_key"][0]["default_key"]) == 40
    upstream_request = calls["edgeproxy_upstream_request"][0]
    assert upstream_request["region"].name == "ap-1"
    assert "traceparent" in dict(upstream_request["headers"])
    assert calls["edgeproxy_upstream_response"][0]["status"] == 200
    complete = calls["edgeproxy_response_complete"][0]
    chunks = [
        c["chunk"]
        for c in calls["edgeproxy_stream_chunk"]
        if c["request_id"] == complete["request_id"]
    ]
    assert len(chunks) > 1 and b"[DONE]" in b"".join(chunks)
    assert complete["status"] == 200 and complete["region"] == "ap-1"
    assert complete["usage"]["total_tokens"] > 0
    assert complete["started"] <= complete["first_byte"] <= complete["finished"]
    assert complete["bytes_out"] == sum(len(c) for c in chunks)

    await proxy.stop(grace=2.0)
    started.remove(proxy)
    assert [c["proxy"] for c in calls["edgeproxy_shutdown"]] == [proxy]


async def test_fallback_hook_is_told_why(
    make_region: RegionFactory, started: list[EdgeProxy]
) -> None:
    region = await make_region("ap-1", fault="stall")
    recorder = Recorder()
    proxy = await start_proxy(
        started, [{"name": "ap-1", "url": region.url}], recorder, upstream={"read_timeout": 0.3}
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=DETERMINISTIC) as resp:
            assert resp.status == 504
    assert recorder.calls["edgeproxy_fallback"] == [{"reason": "upstream_timeout", "answer": None}]


class StaticFallback:
    @hookimpl
    def edgeproxy_fallback(self, reason: str) -> Response:
        return Response.json({"answer": "try again later", "reason": reason})


class Veto:
    @hookimpl(tryfirst=True)
    def edgeproxy_fallback(self) -> bool:
        return False


async def test_fallback_hook_replaces_or_vetoes(started: list[EdgeProxy]) -> None:
    dead = [{"name": "dead", "url": "http://127.0.0.1:9"}]
    proxy = await start_proxy(started, dead, StaticFallback())
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=DETERMINISTIC) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Degraded"] == "plugin"
            assert (await resp.json())["reason"] == "upstream_error"
    vetoed = await start_proxy(started, dead, StaticFallback(), Veto())
    async with aiohttp.ClientSession() as client:
        async with client.post(vetoed.url + CHAT, json=DETERMINISTIC) as resp:
            assert resp.status == 502


class AnswerDirectly:
    """An async firstresult implementation that answers: the later ones must not run."""

    @hookimpl(tryfirst=True)
    async def edgeproxy_request_received(self, ctx: RequestContext) -> Response | None:
        if ctx.path == "/static":
            return Response.json({"static": True})
        return None


class RewriteRequest:
    @hookimpl
    async def edgeproxy_request_received(self, ctx: RequestContext) -> None:
        ctx.target = "/echo/rewritten?x=1"
        ctx.headers["x-rewritten"] = "1"
        body = ctx.json
        if isinstance(body, dict):
            body["injected"] = True
            ctx.set_json(body)


class Counting:
    def __init__(self) -> None:
        self.count = 0

    @hookimpl(trylast=True)
    async def edgeproxy_request_received(self) -> None:
        self.count += 1


async def test_first_result_short_circuits_async_implementations(
    make_region: RegionFactory, started: list[EdgeProxy]
) -> None:
    region = await make_region("ap-1")
    counting = Counting()
    proxy = await start_proxy(
        started, [{"name": "ap-1", "url": region.url}], counting, RewriteRequest(), AnswerDirectly()
    )
    before = region.requests_total
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/static") as resp:
            assert resp.status == 200
            assert await resp.json() == {"static": True}
            assert resp.headers["X-Edgeproxy-Region"] == "none"
            assert "X-Request-Id" in resp.headers
        assert counting.count == 0
        assert region.requests_total == before
        async with client.post(proxy.url + "/anything", json={"a": 1}) as resp:
            echo = await resp.json()
    assert counting.count == 1
    assert echo["path"] == "/echo/rewritten" and echo["query_string"] == "x=1"
    assert ["x-rewritten", "1"] in echo["headers"]
    import hashlib

    import orjson

    expected = orjson.dumps({"a": 1, "injected": True})
    assert echo["body_sha256"] == hashlib.sha256(expected).hexdigest()


async def test_plugins_unit_first_result_and_chain() -> None:
    plugins = Plugins()

    class A:
        @hookimpl
        async def edgeproxy_cache_key(self, default_key: str) -> str:
            return "from-a"

        @hookimpl
        def edgeproxy_stream_chunk(self, chunk: bytes) -> bytes:
            return chunk + b"a"

    class B:
        @hookimpl
        async def edgeproxy_cache_key(self) -> None:
            return None

        @hookimpl
        async def edgeproxy_stream_chunk(self, chunk: bytes) -> bytes:
            return chunk.upper()

    plugins.register(A(), "a")
    plugins.register(B(), "b")
    # B registered last runs first; its None does not win.
    assert (
        await plugins.call_first("edgeproxy_cache_key", request=None, ctx=None, default_key="k")
        == "from-a"
    )
    # Chained: B (upper) then A (+a).
    assert (
        await plugins.call_chain(
            "edgeproxy_stream_chunk", "chunk", request=None, ctx=None, chunk=b"x"
        )
        == b"Xa"
    )


class Boom:
    @hookimpl
    def edgeproxy_request_received(self, ctx: RequestContext) -> None:
        if ctx.path.startswith("/boom"):
            raise RuntimeError("kaboom")


async def test_raising_plugin_is_isolated(
    make_region: RegionFactory, started: list[EdgeProxy], caplog: pytest.LogCaptureFixture
) -> None:
    region = await make_region("ap-1")
    proxy = await start_proxy(started, [{"name": "ap-1", "url": region.url}], Boom())
    async with aiohttp.ClientSession() as client:
        with caplog.at_level(logging.ERROR):
            async with client.get(proxy.url + "/boom") as resp:
                assert resp.status == 500
                error = (await resp.json())["error"]
        assert error["type"] == "plugin_error"
        assert "kaboom" not in error["message"]  # internals stay in the log
        assert any("Boom" in r.getMessage() or "kaboom" in r.getMessage() for r in caplog.records)
        async with client.get(proxy.url + "/healthz") as resp:
            assert resp.status == 200  # the next request is unaffected


async def test_fail_open_plugin_is_skipped(
    make_region: RegionFactory, started: list[EdgeProxy]
) -> None:
    region = await make_region("ap-1")
    boom = Boom()
    config = Config.from_mapping(
        proxy_config([{"name": "ap-1", "url": region.url}], plugins={"fail_open": ["boom"]}),
        environ={},
    )
    proxy = EdgeProxy(config)
    proxy.plugins.register(boom, "boom")
    await proxy.start()
    started.append(proxy)
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/boom") as resp:
            assert resp.status == 404  # served upstream as if the plugin were absent


def test_every_hookspec_has_a_docstring_and_keyword_arguments() -> None:
    from edgeproxy import hookspecs

    for name in hook_names():
        spec = getattr(hookspecs, name)
        doc = inspect.getdoc(spec) or ""
        assert doc, f"{name} has no docstring"
        assert any(phrase in doc for phrase in ("*First result wins*", "*All run*", "*Chained*")), (
            f"{name} does not say how its results combine"
        )


class RouteSeen:
    """Records the route each request ended on."""

    def __init__(self) -> None:
        self.routes: list[str] = []

    @hookimpl
    def edgeproxy_response_complete(self, ctx: RequestContext) -> None:
        self.routes.append(ctx.route.name)


class RewriteWhenAsked:
    @hookimpl
    async def edgeproxy_request_received(self, ctx: RequestContext) -> None:
        if ctx.path == "/rewrite-me":
            ctx.target = "/v1/models"


async def test_a_rewritten_request_is_routed_by_its_new_path(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1")
    seen = RouteSeen()
    proxy = await make_proxy(
        [{"name": "ap-1", "url": region.url}],
        routes=[{"name": "models", "path": "/v1/models"}, {"name": "other", "path": "/rewrite-me"}],
        plugins=[RewriteWhenAsked(), seen],
    )
    async with aiohttp.ClientSession() as client:
        for path, status in (("/rewrite-me", 200), ("/v1/models", 200), ("/elsewhere", 404)):
            async with client.get(proxy.url + path) as resp:
                assert resp.status == status, path
    # The hook runs once the response is out, maybe after the client read it.
    await eventually(lambda: len(seen.routes) == 3)
    assert seen.routes == ["models", "models", "default"]
