"""The degradation ladder end to end: real fake regions, the real cache, real llama.cpp.

Stale cache, local model, then 503 with Retry-After; the triggers (every
attempt failed, the route's deadline, admission overload); the
``edgeproxy_fallback`` hook; and recovery once a region answers again.
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from edgeproxy import Config, EdgeProxy, RequestContext, Response, StreamResponse, hookimpl
from edgeproxy._local.model import LocalAnswer

from .conftest import RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
HELLO = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
DETERMINISTIC = {**HELLO, "temperature": 0}

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None,
        reason="llama-cpp-python is not installed (pip install 'edgeproxy[local]')",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None,
        reason="building the test model needs gguf and numpy (pip install 'edgeproxy[testing]')",
    ),
]

ProxyMaker = Callable[..., Awaitable[EdgeProxy]]


def dead_region(name: str = "dead") -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"name": name, "url": f"http://127.0.0.1:{port}"}


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from edgeproxy.testing import tiny_llama_gguf

    return tiny_llama_gguf("Q4_0")


@pytest.fixture
async def proxy_with(tiny_model: Path) -> AsyncIterator[ProxyMaker]:
    """Start a proxy with the tiny model as its local model (``local_model=None``: none)."""
    started: list[EdgeProxy] = []

    async def factory(
        regions: list[dict[str, Any]],
        *,
        routes: list[dict[str, Any]] | None = None,
        plugins: list[object] | None = None,
        local_model: dict[str, Any] | None = {},  # noqa: B006 - read only
        **sections: dict[str, Any],
    ) -> EdgeProxy:
        if local_model is not None:
            sections["local_model"] = {
                "path": str(tiny_model),
                "n_ctx": 256,
                "max_tokens": 32,
                **local_model,
            }
        data = proxy_config(regions, **sections)
        data["routes"] = routes or []
        proxy = EdgeProxy(Config.from_mapping(data, environ={}), plugins=plugins or [])
        await proxy.start()
        started.append(proxy)
        local = proxy.pipeline.fallback.local
        await eventually(lambda: local.state not in ("idle", "loading"))
        return proxy

    yield factory
    for proxy in started:
        await proxy.stop(grace=2.0)


async def post(proxy: EdgeProxy, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=body) as resp:
            return resp.status, dict(resp.headers), await resp.read()


async def test_all_regions_down_the_local_model_answers(proxy_with: ProxyMaker) -> None:
    proxy = await proxy_with([dead_region("a"), dead_region("b")])
    status, headers, body = await post(proxy, HELLO)
    assert status == 200
    assert headers["X-Edgeproxy-Degraded"] == "local-model"
    answer = orjson.loads(body)
    assert answer["model"].startswith("local/")
    assert answer["usage"]["completion_tokens"] == 4
    stream = {**HELLO, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, body = await post(proxy, stream)
    assert status == 200
    assert headers["X-Edgeproxy-Degraded"] == "local-model"
    events = [e for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(events) >= 4  # role, tokens, finish, usage
    assert orjson.loads(events[-1][6:])["usage"]["completion_tokens"] == 4
    assert proxy.status()["fallback"]["served"] == {"local-model": 2}


async def test_deadline_on_a_stalled_region_cancels_it_and_falls_back(
    make_region: RegionFactory, proxy_with: ProxyMaker
) -> None:
    region = await make_region("ap-1", fault="stall")
    routes = [{"name": "chat", "path": CHAT, "deadline": 0.5, "retries": 0}]
    proxy = await proxy_with([{"name": "ap-1", "url": region.url}], routes=routes)
    status, headers, body = await post(proxy, HELLO)
    assert status == 200
    assert headers["X-Edgeproxy-Degraded"] == "local-model"
    assert orjson.loads(body)["usage"]["completion_tokens"] == 4
    # The stalled upstream request was cancelled, not left hanging.
    await eventually(lambda: region.cancelled_total == 1 and region.in_flight == 0)


async def test_deadline_race_in_the_running_proxy_local_model_wins(
    make_region: RegionFactory, proxy_with: ProxyMaker
) -> None:
    # deadline_action = "race": the stalled attempt is kept past the deadline and raced
    # against the local model; the model answers first and the attempt is cancelled.
    region = await make_region("ap-1", fault="stall")
    routes = [
        {"name": "chat", "path": CHAT, "deadline": 0.3, "retries": 0, "deadline_action": "race"}
    ]
    proxy = await proxy_with([{"name": "ap-1", "url": region.url}], routes=routes)
    status, headers, body = await post(proxy, HELLO)
    assert status == 200
    assert headers["X-Edgeproxy-Degraded"] == "local-model"
    assert orjson.loads(body)["usage"]["completion_tokens"] == 4
    await eventually(lambda: region.cancelled_total == 1 and region.in_flight == 0)
    await eventually(lambda: proxy.regions.by_name["ap-1"].in_flight == 0)


async def test_stale_cache_is_preferred_over_the_model(
    make_region: RegionFactory, proxy_with: ProxyMaker
) -> None:
    region = await make_region("ap-1")
    routes = [{"name": "chat", "path": CHAT, "cache_ttl": 0.3, "stale_if_error": 300}]
    proxy = await proxy_with([{"name": "ap-1", "url": region.url}], routes=routes)
    status, headers, fresh = await post(proxy, DETERMINISTIC)
    assert status == 200 and headers["X-Edgeproxy-Region"] == "ap-1"
    await eventually(lambda: proxy.pipeline.cache.status()["stores"] >= 1)
    await region.kill()
    await asyncio.sleep(0.4)  # past cache_ttl: the entry is stale, no longer fresh
    status, headers, stale = await post(proxy, DETERMINISTIC)
    assert status == 200
    assert headers["X-Edgeproxy-Degraded"] == "stale-cache"
    assert headers["X-Edgeproxy-Cache"] == "STALE"
    assert stale == fresh
    assert proxy.pipeline.fallback.local.requests_total == 0
    # A request the cache has nothing for goes on down the ladder, to the model.
    status, headers, _ = await post(proxy, {**DETERMINISTIC, "seed": 7})
    assert status == 200 and headers["X-Edgeproxy-Degraded"] == "local-model"


async def test_the_ladder_is_ordered_per_route(
    make_region: RegionFactory, proxy_with: ProxyMaker
) -> None:
    region = await make_region("ap-1")
    routes = [
        {
            "name": "chat",
            "path": CHAT,
            "cache_ttl": 0.3,
            "stale_if_error": 300,
            "fallback": ["local", "stale"],
        },
        {"name": "completions", "path": "/v1/completions", "fallback": []},
    ]
    proxy = await proxy_with([{"name": "ap-1", "url": region.url}], routes=routes)
    await post(proxy, DETERMINISTIC)
    await eventually(lambda: proxy.pipeline.cache.status()["stores"] >= 1)
    await region.kill()
    await asyncio.sleep(0.4)
    status, headers, _ = await post(proxy, DETERMINISTIC)
    assert status == 200 and headers["X-Edgeproxy-Degraded"] == "local-model"
    # fallback = []: the route's clients get the upstream error, model or not.
    async with aiohttp.ClientSession() as client:
        async with client.post(
            proxy.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}
        ) as resp:
            assert resp.status == 502
            assert "X-Edgeproxy-Degraded" not in resp.headers


async def test_last_rung_is_a_503_with_retry_after(proxy_with: ProxyMaker) -> None:
    routes = [{"name": "chat", "path": CHAT, "fallback_retry_after": 7}]
    missing = {"path": "/nonexistent/model.gguf"}
    proxy = await proxy_with([dead_region()], routes=routes, local_model=missing)
    status, headers, body = await post(proxy, HELLO)
    assert status == 503
    assert headers["Retry-After"] == "7"
    error = orjson.loads(body)["error"]
    assert error["code"] == "fallback_unavailable"
    assert "dead" in error["message"] and "local model is failed" in error["message"]
    # With no local model configured at all, the upstream error passes through as before.
    plain = await proxy_with([dead_region()], local_model=None)
    status, _, body = await post(plain, HELLO)
    assert status == 502
    assert orjson.loads(body)["error"]["type"] == "upstream_error"


async def test_admission_overload_can_degrade(
    make_region: RegionFactory, proxy_with: ProxyMaker
) -> None:
    region = await make_region("ap-1", fault="stall")
    routes = [
        {
            "name": "chat",
            "path": CHAT,
            "max_in_flight": 1,
            "max_queue_time": 0,
            "on_overload": "degrade",
        }
    ]
    proxy = await proxy_with([{"name": "ap-1", "url": region.url}], routes=routes)
    async with aiohttp.ClientSession() as client:
        stuck = asyncio.ensure_future(client.post(proxy.url + CHAT, json=HELLO))
        await eventually(lambda: region.in_flight == 1)
        async with client.post(proxy.url + CHAT, json=HELLO) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Degraded"] == "local-model"
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
    assert region.requests_total == 1  # the degraded request never went upstream


class Gate:
    """Holds the first local answer in the fallback hook, until released."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.calls: list[tuple[str, str | None]] = []

    @hookimpl
    async def edgeproxy_fallback(self, reason: str, answer: StreamResponse | None) -> None:
        degraded = answer.headers.get("X-Edgeproxy-Degraded") if answer is not None else None
        self.calls.append((reason, degraded))
        if len(self.calls) == 1 and isinstance(answer, LocalAnswer):
            self.held.set()
            await self.release.wait()


async def test_recovery_sends_new_traffic_upstream(
    make_region: RegionFactory, proxy_with: ProxyMaker
) -> None:
    region = await make_region("ap-1")
    gate = Gate()
    proxy = await proxy_with([{"name": "ap-1", "url": region.url}], plugins=[gate])
    await region.kill()
    async with aiohttp.ClientSession() as client:
        # Started on the local model while the region is down, and held there.
        started = asyncio.ensure_future(client.post(proxy.url + CHAT, json=HELLO))
        await gate.held.wait()
        await region.restart()

        async def upstream_answers() -> bool:
            async with client.post(proxy.url + CHAT, json=HELLO) as resp:
                return resp.status == 200 and resp.headers["X-Edgeproxy-Region"] == "ap-1"

        for _ in range(100):
            if await upstream_answers():
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the recovered region never got traffic again")
        before = region.requests_total
        for _ in range(3):
            async with client.post(proxy.url + CHAT, json=HELLO) as resp:
                assert resp.status == 200
                assert "X-Edgeproxy-Degraded" not in resp.headers
        assert region.requests_total == before + 3
        # What the local model already started, it finishes.
        gate.release.set()
        async with await started as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Degraded"] == "local-model"
            assert (await resp.json())["usage"]["completion_tokens"] == 4


class Veto:
    @hookimpl(tryfirst=True)
    def edgeproxy_fallback(self) -> bool:
        return False


class Replace:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    @hookimpl
    def edgeproxy_fallback(self, ctx: RequestContext, answer: Any) -> Response:
        self.seen.append(answer)
        return Response.json({"sorry": True, "would_have_been": ctx.degraded})


async def test_hook_vetoes_or_replaces_the_local_answer(proxy_with: ProxyMaker) -> None:
    replace = Replace()
    proxy = await proxy_with([dead_region()], plugins=[replace])
    status, headers, body = await post(proxy, HELLO)
    assert status == 200
    assert headers["X-Edgeproxy-Degraded"] == "plugin"
    assert orjson.loads(body) == {"sorry": True, "would_have_been": "local-model"}
    assert isinstance(replace.seen[0], LocalAnswer)
    local = proxy.pipeline.fallback.local
    assert local.busy == 0 and local.answered_total == 0  # its slot went back unused

    vetoed = await proxy_with([dead_region()], plugins=[replace, Veto()])
    status, headers, body = await post(vetoed, HELLO)
    assert status == 502
    assert "X-Edgeproxy-Degraded" not in headers
    assert orjson.loads(body)["error"]["type"] == "upstream_error"
    assert vetoed.pipeline.fallback.local.busy == 0
    assert vetoed.status()["fallback"]["vetoed_total"] == 1


async def test_hook_is_told_why_and_sees_the_degraded_answer(proxy_with: ProxyMaker) -> None:
    gate = Gate()
    gate.held.set()  # nothing to hold: calls[0] is not awaited on (release set below)
    gate.release.set()
    proxy = await proxy_with([dead_region()], plugins=[gate])
    status, _, _ = await post(proxy, HELLO)
    assert status == 200
    assert gate.calls == [("upstream_error", "local-model")]


# -- deadline races ---------------------------------------------------------------------
#
# With deadline_action = "race", the attempt still running at the deadline is kept and
# raced against the local answer: the first to produce a byte (or token) is sent.


class UpstreamFirst:
    """Holds the fallback until the late attempt has its first byte: the region wins."""

    def __init__(self) -> None:
        self.proxy: EdgeProxy | None = None

    @hookimpl
    async def edgeproxy_fallback(self, answer: StreamResponse | None) -> None:
        assert self.proxy is not None and isinstance(answer, LocalAnswer)
        region = self.proxy.regions.by_name["ap-1"]
        await eventually(lambda: region.pending == 0, timeout=5.0)


async def test_deadline_race_the_region_answers_first(
    make_region: RegionFactory, proxy_with: ProxyMaker
) -> None:
    region = await make_region("ap-1", ttft=0.4)
    routes = [
        {"name": "chat", "path": CHAT, "deadline": 0.1, "retries": 0, "deadline_action": "race"}
    ]
    hold = UpstreamFirst()
    proxy = await proxy_with(
        [{"name": "ap-1", "url": region.url}],
        routes=routes,
        plugins=[hold],
        upstream={"read_timeout": 60.0},
    )
    hold.proxy = proxy
    status, headers, body = await post(proxy, HELLO)
    assert status == 200
    assert headers["X-Edgeproxy-Region"] == "ap-1"
    assert "X-Edgeproxy-Degraded" not in headers
    assert orjson.loads(body)["choices"]  # the region's answer, relayed
    fallback = proxy.pipeline.fallback
    assert fallback.races == {"upstream": 1} and fallback.served == {}
    # The local answer was dropped before it was sent, its slot given back.
    await eventually(lambda: fallback.local.busy == 0)
    assert fallback.local.answered_total == 0
    # The relayed attempt was let go of once its answer was complete.
    ap1 = proxy.regions.by_name["ap-1"]
    await eventually(
        lambda: ap1.in_flight == 0 and ap1.pool.stats().streams_in_use == 0, timeout=5.0
    )
    assert region.cancelled_total == 0 and region.requests_total == 1
