"""The hot-answer cache end to end: a real client, the real proxy, real fake regions.

Memory backend here; Redis in test_cache_redis.py. No timing assertions:
upstream counters, cache headers and /status counters say what happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from edgeproxy import Config, EdgeProxy, Exchange, RequestContext, UpstreamReply, hookimpl
from edgeproxy.testing import FakeRegion

from .conftest import FakeClock, ProxyFactory, RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def sse_data(raw: bytes) -> list[bytes]:
    return [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]


def streamed_text(raw: bytes) -> str:
    text = ""
    for data in sse_data(raw):
        if data == b"[DONE]":
            continue
        for choice in orjson.loads(data)["choices"]:
            text += choice.get("delta", {}).get("content") or choice.get("text") or ""
    return text


StartProxy = Callable[..., Awaitable[EdgeProxy]]


@pytest.fixture
def wall_clock() -> FakeClock:
    """The cache's wall clock: entries age only when the test advances it.

    It starts at the current whole second, not at 0, because the memory
    backend turns an entry's deadlines into a TTL against the real time; a
    whole second keeps the ``Age`` of an entry exactly what was advanced.
    """
    return FakeClock(start=float(int(time.time())))


@pytest.fixture
def start_proxy(make_proxy: ProxyFactory, wall_clock: FakeClock) -> StartProxy:
    """``make_proxy`` in front of fake regions, with a [cache] section and ``wall_clock``."""

    async def factory(
        regions: list[FakeRegion], *, cache: dict[str, Any] | None = None, **kwargs: Any
    ) -> EdgeProxy:
        # Early refresh is random by design; tests that want it turn it on.
        cache = {"xfetch_beta": 0.0, **(cache or {})}
        return await make_proxy(regions, cache=cache, cache_clock=wall_clock, **kwargs)

    return factory


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    client: aiohttp.ClientSession, url: str, body: Any, **kwargs: Any
) -> tuple[int, Any, bytes]:
    async with client.post(url, json=body, **kwargs) as resp:
        return resp.status, resp.headers, await resp.read()


def upstream_calls(region: FakeRegion, path: str = CHAT) -> int:
    return region.counters().requests_by_path.get(path, 0)


def cache_status(proxy: EdgeProxy) -> dict[str, Any]:
    status = proxy.status()["cache"]
    assert isinstance(status, dict)
    return status


# -- what is cacheable ----------------------------------------------------------------


async def test_deterministic_request_hits_and_random_one_bypasses(
    make_region: RegionFactory,
    start_proxy: StartProxy,
    client: aiohttp.ClientSession,
    wall_clock: FakeClock,
) -> None:
    region = await make_region("r1")
    proxy = await start_proxy([region])
    url = proxy.url + CHAT

    status, headers, first = await post(client, url, chat())
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
    assert headers["X-Edgeproxy-Region"] == "r1"
    key = headers["X-Edgeproxy-Cache-Key"]
    await eventually(lambda: cache_status(proxy)["stores"] == 1)
    wall_clock.advance(7.0)  # within the default cache_ttl
    status, headers, second = await post(client, url, chat())
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "HIT"
    assert headers["X-Edgeproxy-Cache-Key"] == key
    assert headers["Age"] == "7"
    assert headers["X-Edgeproxy-Region"] == "none"
    assert headers["Content-Type"].startswith("application/json")
    assert second == first
    # Key order, `user` and `stream_options` do not change the key; `seed` alone makes it
    # deterministic.
    reordered = {"messages": chat()["messages"], "temperature": 0, "model": "m", "user": "u2"}
    _, headers, _ = await post(client, url, reordered)
    assert headers["X-Edgeproxy-Cache"] == "HIT"
    assert upstream_calls(region) == 1

    for _ in range(2):
        _, headers, _ = await post(client, url, chat(temperature=0.7))
        assert headers["X-Edgeproxy-Cache"] == "BYPASS"
    _, headers, _ = await post(client, url, {**chat(), "temperature": 0.7, "seed": 7})
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    assert upstream_calls(region) == 4
    status_json = cache_status(proxy)
    assert status_json["bypass_reasons"]["not_deterministic"] == 2
    assert status_json["outcomes"]["HIT"] == 2
    assert 0 < status_json["hit_ratio"] < 1


async def test_other_paths_and_embeddings(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1")
    proxy = await start_proxy([region])
    for _ in range(2):
        _, headers, _ = await post(client, proxy.url + "/echo/x", {"temperature": 0})
        assert headers["X-Edgeproxy-Cache"] == "BYPASS"
    outcomes = []
    for _ in range(2):
        status, headers, body = await post(
            client, proxy.url + EMBEDDINGS, {"model": "e", "input": "abc"}
        )
        assert status == 200 and orjson.loads(body)["data"][0]["embedding"]
        outcomes.append(headers["X-Edgeproxy-Cache"])
        await eventually(lambda: cache_status(proxy)["stores"] == 1)
    assert outcomes == ["MISS", "HIT"]
    assert upstream_calls(region, EMBEDDINGS) == 1


async def test_tenants_and_api_keys_never_share_an_entry(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    class Tenants:
        @hookimpl
        def edgeproxy_request_received(self, request: Exchange, ctx: RequestContext) -> None:
            ctx.tenant = ctx.headers.get("x-tenant")

    region = await make_region("r1")
    proxy = await start_proxy([region], plugins=(Tenants(),))
    url = proxy.url + CHAT

    async def outcome(headers: dict[str, str]) -> str:
        _, resp_headers, _ = await post(client, url, chat("shared prompt"), headers=headers)
        await eventually(lambda: not proxy.pipeline.cache.coalescer.flights)
        return str(resp_headers["X-Edgeproxy-Cache"])

    assert await outcome({"Authorization": "Bearer key-a"}) == "MISS"
    assert await outcome({"Authorization": "Bearer key-a"}) == "HIT"
    assert await outcome({"Authorization": "Bearer key-b"}) == "MISS"
    assert await outcome({"x-api-key": "key-a"}) == "MISS"
    assert await outcome({}) == "MISS"
    assert await outcome({"x-tenant": "acme"}) == "MISS"
    assert await outcome({"x-tenant": "globex"}) == "MISS"
    # The tenant scopes the key, whatever credential carried it.
    assert await outcome({"x-tenant": "acme", "Authorization": "Bearer other"}) == "HIT"
    assert upstream_calls(region) == 6


async def test_no_store_no_cache_and_route_policies(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1")
    routes = [
        {"name": "off", "path": COMPLETIONS, "cache": "off"},
        {"name": "always", "path": "/v1/chat", "cache": "always"},
    ]
    proxy = await start_proxy([region], routes=routes)
    url = proxy.url + CHAT
    random_body = chat(temperature=1.0)

    _, headers, _ = await post(client, url, random_body)
    assert headers["X-Edgeproxy-Cache"] == "MISS"  # cache = "always" on this route
    await eventually(lambda: cache_status(proxy)["stores"] == 1)
    _, headers, _ = await post(client, url, random_body)
    assert headers["X-Edgeproxy-Cache"] == "HIT"
    _, headers, _ = await post(client, url, random_body, headers={"Cache-Control": "no-store"})
    assert headers["X-Edgeproxy-Cache"] == "BYPASS"
    # no-cache: a fresh answer is fetched, and it replaces the stored one.
    _, headers, _ = await post(client, url, random_body, headers={"Cache-Control": "no-cache"})
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    assert upstream_calls(region) == 3

    prompt = {"model": "m", "prompt": "p", "temperature": 0}
    for _ in range(2):
        _, headers, _ = await post(client, proxy.url + COMPLETIONS, prompt)
        assert headers["X-Edgeproxy-Cache"] == "BYPASS"
    assert cache_status(proxy)["bypass_reasons"] == {"no_store": 1, "route_off": 2}


async def test_invalid_json_bypasses_the_cache_and_reaches_the_upstream_untouched(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1")
    routes = [{"name": "lenient", "path": "/v1/chat", "require_json": False}]
    proxy = await start_proxy([region], routes=routes)
    raw = b'{"model": "m", "temperature": 0, "messages": [ '
    json_type = {"Content-Type": "application/json"}
    for _ in range(2):
        async with client.post(proxy.url + CHAT, data=raw, headers=json_type) as resp:
            body = await resp.read()
            # The region's own 400, not the proxy's: the bytes went through as they were.
            assert resp.status == 400
            assert resp.headers["X-Edgeproxy-Region"] == "r1"
            assert resp.headers["X-Edgeproxy-Cache"] == "BYPASS"
            assert b"not valid JSON" in body
    assert upstream_calls(region) == 2
    assert cache_status(proxy)["bypass_reasons"] == {"not_json": 2}
    # Where the route requires JSON (the default for LLM endpoints), the proxy answers 400.
    async with client.post(proxy.url + COMPLETIONS, data=raw, headers=json_type) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
    assert upstream_calls(region, COMPLETIONS) == 0


async def test_error_answers_are_not_cached(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    # A region's own error answer (a 500, relayed as it came), never stored.
    region = await make_region("r1", fault="5xx", fault_status=500)
    proxy = await start_proxy([region], routes=[{"name": "all", "path": "/", "retries": 0}])
    for _ in range(2):
        status, headers, _ = await post(client, proxy.url + CHAT, chat())
        assert status == 500 and headers["X-Edgeproxy-Cache"] == "MISS"
    assert upstream_calls(region) == 2
    assert cache_status(proxy)["not_cached"]["status"] == 2


async def test_oversized_answers_are_not_cached_and_metrics_say_why(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1", tokens=200)
    proxy = await start_proxy([region], cache={"max_entry_bytes": 512})
    for stream in (False, False, True, True):
        status, headers, body = await post(client, proxy.url + CHAT, chat(stream=stream))
        assert status == 200 and len(body) > 512
        assert headers["X-Edgeproxy-Cache"] == "MISS"
    assert upstream_calls(region) == 4
    status_json = cache_status(proxy)
    assert status_json["not_cached"] == {"too_large": 4}
    assert status_json["tiers"]["entries"] == 0


# -- streaming --------------------------------------------------------------------------


async def test_streamed_answer_is_replayed_as_several_sse_chunks(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1", tokens=6)
    proxy = await start_proxy([region])
    body = chat("stream me", stream=True)
    status, headers, first = await post(client, proxy.url + CHAT, body)
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
    await eventually(lambda: cache_status(proxy)["stores"] == 1)

    async with client.post(proxy.url + CHAT, json=body) as resp:
        assert resp.headers["X-Edgeproxy-Cache"] == "HIT"
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert "Content-Length" not in resp.headers
        http_chunks = []
        async for data, _end in resp.content.iter_chunks():
            http_chunks.append(data)
    replay = b"".join(http_chunks)
    assert replay == first
    events = sse_data(replay)
    assert len(events) == 6 + 2 and events[-1] == b"[DONE]"
    # One HTTP chunk per event, not one blob (the client may merge reads, never split events).
    assert len(http_chunks) > 1
    assert upstream_calls(region) == 1


async def test_stream_and_json_answers_convert_both_ways(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1", tokens=5)
    proxy = await start_proxy([region])
    url = proxy.url + CHAT

    # Streamed first, then asked as JSON: the assembled completion.
    streamed = chat("first streamed", stream=True, stream_options={"include_usage": True})
    _, _, raw = await post(client, url, streamed)
    await eventually(lambda: cache_status(proxy)["stores"] == 1)
    _, headers, body = await post(client, url, chat("first streamed"))
    assert headers["X-Edgeproxy-Cache"] == "HIT"
    assert headers["Content-Type"].startswith("application/json")
    answer = orjson.loads(body)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {
        "role": "assistant",
        "content": streamed_text(raw),
    }
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 5

    # JSON first, then asked as a stream: chunks that join back into the same text.
    _, _, body = await post(client, url, chat("first json"))
    await eventually(lambda: cache_status(proxy)["stores"] == 2)
    text = orjson.loads(body)["choices"][0]["message"]["content"]
    _, headers, raw = await post(client, url, chat("first json", stream=True))
    assert headers["X-Edgeproxy-Cache"] == "HIT"
    assert headers["Content-Type"].startswith("text/event-stream")
    events = sse_data(raw)
    assert events[-1] == b"[DONE]" and len(events) > 3
    assert streamed_text(raw) == text
    assert orjson.loads(events[-2])["choices"][0]["finish_reason"] == "stop"

    # A stream asked with usage gets the usage chunk; without, it does not.
    _, _, raw = await post(client, url, chat("first streamed", stream=True))
    assert not any(b'"usage"' in e for e in sse_data(raw))
    _, _, raw = await post(
        client, url, chat("first json", stream=True, stream_options={"include_usage": True})
    )
    assert orjson.loads(sse_data(raw)[-2])["usage"]["completion_tokens"] == 5

    # Text completions convert too.
    prompt = {"model": "m", "prompt": "p", "temperature": 0}
    _, _, raw = await post(client, proxy.url + COMPLETIONS, {**prompt, "stream": True})
    await eventually(lambda: cache_status(proxy)["stores"] == 3)
    _, headers, body = await post(client, proxy.url + COMPLETIONS, prompt)
    assert headers["X-Edgeproxy-Cache"] == "HIT"
    assert orjson.loads(body)["choices"][0]["text"] == streamed_text(raw)
    assert upstream_calls(region) == 2


async def test_answer_is_stored_even_when_the_client_hangs_up_at_once(
    make_region: RegionFactory, start_proxy: StartProxy
) -> None:
    # The client has the whole body before the proxy reads the upstream's end of it; a
    # client that closes its connection right then must not cost the cache the answer.
    region = await make_region("r1", tokens=4)
    proxy = await start_proxy([region])
    for i in range(6):
        async with aiohttp.ClientSession() as own:
            status, _, _ = await post(
                own, proxy.url + CHAT, chat(f"hang up {i}", stream=i % 2 == 1)
            )
            assert status == 200
    await eventually(lambda: cache_status(proxy)["stores"] == 6)
    assert cache_status(proxy)["not_cached"] == {}


async def test_cut_stream_is_not_stored(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1", tokens=8, fault="reset", fault_after_tokens=3)
    proxy = await start_proxy([region])
    with pytest.raises(aiohttp.ClientPayloadError):
        await post(client, proxy.url + CHAT, chat(stream=True))
    region.configure(fault=None)
    _, headers, _ = await post(client, proxy.url + CHAT, chat(stream=True))
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    assert cache_status(proxy)["not_cached"] == {"incomplete": 1}


# -- coalescing ------------------------------------------------------------------------


async def test_fifty_identical_requests_reach_the_upstream_once(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1", ttft=0.3, tokens=4)
    proxy = await start_proxy([region])
    results = await asyncio.gather(*(post(client, proxy.url + CHAT, chat()) for _ in range(50)))
    assert all(status == 200 for status, _, _ in results)
    assert len({body for _, _, body in results}) == 1
    outcomes = sorted(headers["X-Edgeproxy-Cache"] for _, headers, _ in results)
    assert outcomes.count("MISS") == 1
    assert set(outcomes) <= {"MISS", "COALESCED", "HIT"}
    assert upstream_calls(region) == 1


async def test_streaming_followers_get_chunks_as_the_leader_receives_them(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1", ttft=0.05, inter_token_delay=0.05, tokens=20)
    proxy = await start_proxy([region])
    body = chat("live", stream=True)
    first_chunk_while_upstream_busy: list[bool] = []

    async def stream() -> tuple[str, bytes]:
        async with client.post(proxy.url + CHAT, json=body) as resp:
            data = b""
            async for chunk in resp.content.iter_any():
                if not data:
                    # The upstream is still sending: this follower is not waiting for the end.
                    first_chunk_while_upstream_busy.append(region.counters().in_flight == 1)
                data += chunk
            return resp.headers["X-Edgeproxy-Cache"], data

    results = await asyncio.gather(*(stream() for _ in range(10)))
    assert sorted(o for o, _ in results).count("MISS") == 1
    assert {o for o, _ in results} == {"MISS", "COALESCED"}
    assert len({data for _, data in results}) == 1
    assert sse_data(results[0][1])[-1] == b"[DONE]"
    assert all(first_chunk_while_upstream_busy)
    assert upstream_calls(region) == 1


async def test_followers_of_a_failed_leader_retry_once_instead_of_failing(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1", tokens=3)
    followers = 5

    class FailFirst:
        """Holds the leader until everyone follows it, then makes its attempt fail."""

        calls = 0

        @hookimpl
        async def edgeproxy_upstream_request(self, ctx: RequestContext) -> None:
            FailFirst.calls += 1
            if FailFirst.calls == 1:
                flights = proxy.pipeline.cache.coalescer.flights
                await eventually(lambda: flights[ctx.cache_key or ""].followers == followers)
                region.configure(fault="5xx", fault_status=500)
            else:
                region.configure(fault=None)

    proxy = await start_proxy(
        [region], plugins=(FailFirst(),), routes=[{"name": "all", "path": "/", "retries": 0}]
    )
    results = await asyncio.gather(
        *(post(client, proxy.url + CHAT, chat("retry me")) for _ in range(followers + 1))
    )
    statuses = sorted(status for status, _, _ in results)
    # The leader's client gets its 500; the followers are not failed with it.
    assert statuses == [200] * followers + [500]
    outcomes = sorted(h["X-Edgeproxy-Cache"] for s, h, _ in results if s == 200)
    assert outcomes == ["COALESCED"] * (followers - 1) + ["MISS"]
    assert upstream_calls(region) == 2


@pytest.mark.parametrize("half_close", ["abort", "answer"])
async def test_leader_client_leaving_early_does_not_fail_followers(
    make_region: RegionFactory,
    start_proxy: StartProxy,
    client: aiohttp.ClientSession,
    half_close: str,
) -> None:
    region = await make_region("r1", ttft=0.5, tokens=3)
    proxy = await start_proxy([region], limits={"half_close": half_close})
    key_flights = proxy.pipeline.cache.coalescer.flights
    leader = asyncio.ensure_future(post(client, proxy.url + CHAT, chat("leader leaves")))
    await eventually(lambda: len(key_flights) == 1)
    followers = [
        asyncio.ensure_future(post(client, proxy.url + CHAT, chat("leader leaves")))
        for _ in range(3)
    ]
    await eventually(lambda: next(iter(key_flights.values())).followers == 3)
    leader.cancel()
    results = await asyncio.gather(*followers)
    assert [status for status, _, _ in results] == [200, 200, 200]
    cache = sorted(h["X-Edgeproxy-Cache"] for _, h, _ in results)
    # The leader's client closing (a FIN) cancels it: a follower takes the flight over.
    # With half_close = "answer" the FIN might be a half-close, but the listener's probe
    # (an interim 100, answered by a reset) finds the client gone all the same.
    assert cache == ["COALESCED", "COALESCED", "MISS"]
    await eventually(lambda: region.counters().cancelled_total == 1)
    assert upstream_calls(region) == 2


# -- freshness ---------------------------------------------------------------------------


async def make_stale(proxy: EdgeProxy, key: str, clock: FakeClock) -> None:
    """Advance ``clock`` to the instant the stored entry of ``key`` stops being fresh."""
    backend = proxy.pipeline.cache.backend
    assert backend is not None
    entry = await backend.get(key)
    assert entry is not None
    assert clock() < entry.fresh_until
    clock.advance(entry.fresh_until - clock())


async def test_stale_while_revalidate_serves_stale_and_refreshes_once(
    make_region: RegionFactory,
    start_proxy: StartProxy,
    client: aiohttp.ClientSession,
    wall_clock: FakeClock,
) -> None:
    region = await make_region("r1", ttft=0.2)
    routes = [{"name": "llm", "path": "/v1", "cache_ttl": 30, "stale_while_revalidate": 60}]
    proxy = await start_proxy([region], routes=routes)
    url = proxy.url + CHAT
    _, headers, first = await post(client, url, chat())
    await eventually(lambda: cache_status(proxy)["stores"] == 1)
    await make_stale(proxy, headers["X-Edgeproxy-Cache-Key"], wall_clock)

    results = await asyncio.gather(*(post(client, url, chat()) for _ in range(5)))
    # Served at once from the stale entry, while one refresh runs in the background.
    assert [h["X-Edgeproxy-Cache"] for _, h, _ in results] == ["STALE"] * 5
    assert all(body == first for _, _, body in results)
    await eventually(lambda: cache_status(proxy)["refreshes"] == 1)
    await eventually(lambda: cache_status(proxy)["stores"] == 2)
    assert upstream_calls(region) == 2
    _, headers, body = await post(client, url, chat())
    assert headers["X-Edgeproxy-Cache"] == "HIT" and headers["Age"] == "0"
    assert orjson.loads(body)["id"] != orjson.loads(first)["id"]  # the refreshed answer
    # Past the refreshed answer's freshness and stale-while-revalidate windows: a miss.
    region.configure(ttft=0.0)
    wall_clock.advance(30 + 60)
    _, headers, _ = await post(client, url, chat())
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    assert upstream_calls(region) == 3


async def test_stale_if_error_serves_the_stale_answer_marked(
    make_region: RegionFactory,
    start_proxy: StartProxy,
    client: aiohttp.ClientSession,
    wall_clock: FakeClock,
) -> None:
    region = await make_region("r1", tokens=4)
    routes = [{"name": "llm", "path": "/v1", "cache_ttl": 30, "stale_if_error": 60}]
    proxy = await start_proxy([region], routes=routes)
    url = proxy.url + CHAT
    _, headers, first = await post(client, url, chat(stream=True))
    await eventually(lambda: cache_status(proxy)["stores"] == 1)
    await make_stale(proxy, headers["X-Edgeproxy-Cache-Key"], wall_clock)

    await region.kill()
    status, headers, body = await post(client, url, chat(stream=True))
    assert status == 200
    assert headers["X-Edgeproxy-Cache"] == "STALE"
    assert headers["X-Edgeproxy-Degraded"] == "stale-cache"
    assert body == first
    status, headers, body = await post(client, url, chat())
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "STALE"
    assert orjson.loads(body)["choices"][0]["message"]["content"] == streamed_text(first)
    # A request that was never cached still gets the error.
    status, headers, _ = await post(client, url, chat("never seen"))
    assert status >= 500
    assert cache_status(proxy)["stale_if_error"] == 2


async def test_stale_if_error_when_the_deadline_passes(
    make_region: RegionFactory,
    start_proxy: StartProxy,
    client: aiohttp.ClientSession,
    wall_clock: FakeClock,
) -> None:
    region = await make_region("r1")
    routes = [
        {"name": "llm", "path": "/v1", "cache_ttl": 30, "stale_if_error": 60, "deadline": 0.5}
    ]
    proxy = await start_proxy([region], routes=routes)
    _, headers, first = await post(client, proxy.url + CHAT, chat())
    await eventually(lambda: cache_status(proxy)["stores"] == 1)
    await make_stale(proxy, headers["X-Edgeproxy-Cache-Key"], wall_clock)
    region.configure(ttft=5.0)  # no first byte before the route's deadline
    status, headers, body = await post(client, proxy.url + CHAT, chat())
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "STALE"
    assert headers["X-Edgeproxy-Degraded"] == "stale-cache"
    assert body == first


async def test_followers_of_a_leader_the_regions_failed_get_the_stale_answer(
    make_region: RegionFactory,
    start_proxy: StartProxy,
    client: aiohttp.ClientSession,
    wall_clock: FakeClock,
) -> None:
    region = await make_region("r1")
    followers = 4

    class HoldLeader:
        hold = False

        @hookimpl
        async def edgeproxy_upstream_request(self, ctx: RequestContext) -> None:
            flight = proxy.pipeline.cache.coalescer.flights.get(ctx.cache_key or "")
            if HoldLeader.hold and flight is not None:
                await eventually(lambda: flight.followers == followers)

    routes = [{"name": "llm", "path": "/v1", "cache_ttl": 30, "stale_if_error": 60, "retries": 0}]
    proxy = await start_proxy([region], routes=routes, plugins=(HoldLeader(),))
    _, headers, first = await post(client, proxy.url + CHAT, chat())
    await eventually(lambda: cache_status(proxy)["stores"] == 1)
    await make_stale(proxy, headers["X-Edgeproxy-Cache-Key"], wall_clock)
    region.configure(fault="5xx", fault_status=503)
    HoldLeader.hold = True
    results = await asyncio.gather(
        *(post(client, proxy.url + CHAT, chat()) for _ in range(followers + 1))
    )
    assert [(status, h["X-Edgeproxy-Cache"]) for status, h, _ in results] == [(200, "STALE")] * (
        followers + 1
    )
    assert all(body == first for _, _, body in results)
    # One failed attempt for all of them: the followers did not each retry.
    assert upstream_calls(region) == 2


async def test_early_refresh_renews_hot_entries_before_expiry(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1", ttft=0.05)
    # A huge beta makes every fresh hit an early refresh: XFetch at its most eager.
    proxy = await start_proxy([region], cache={"xfetch_beta": 1e9})
    url = proxy.url + CHAT
    await post(client, url, chat())
    await eventually(lambda: cache_status(proxy)["stores"] == 1)
    _, headers, _ = await post(client, url, chat())
    assert headers["X-Edgeproxy-Cache"] == "HIT"
    await eventually(lambda: cache_status(proxy)["refreshes"] == 1)
    assert cache_status(proxy)["early_refreshes"] == 1
    assert upstream_calls(region) == 2


# -- GET ------------------------------------------------------------------------------------


async def test_get_is_cached_only_when_the_upstream_allows_it(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    class CacheableModels:
        @hookimpl
        def edgeproxy_upstream_response(self, ctx: RequestContext, reply: UpstreamReply) -> None:
            if ctx.path == "/v1/models":
                reply.headers.append(("cache-control", "public, max-age=60"))

    region = await make_region("r1")
    proxy = await start_proxy([region], plugins=(CacheableModels(),))
    outcomes = []
    for _ in range(2):
        async with client.get(proxy.url + "/v1/models") as resp:
            assert resp.status == 200 and (await resp.json())["object"] == "list"
            outcomes.append(resp.headers["X-Edgeproxy-Cache"])
        await eventually(lambda: cache_status(proxy)["stores"] == 1)
    assert outcomes == ["MISS", "HIT"]
    for _ in range(2):
        async with client.get(proxy.url + "/healthz") as resp:
            assert resp.headers["X-Edgeproxy-Cache"] == "MISS"
    assert region.counters().requests_by_path == {"/v1/models": 1, "/healthz": 2}
    assert cache_status(proxy)["not_cached"] == {"not_cacheable": 2}


# -- plugins and admin ---------------------------------------------------------------------


async def test_cache_key_hook_overrides_the_key(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    class OneAnswer:
        @hookimpl
        def edgeproxy_cache_key(self, default_key: str) -> str:
            assert len(default_key) == 40
            return "everything"

    region = await make_region("r1")
    proxy = await start_proxy([region], plugins=(OneAnswer(),))
    _, first, _ = await post(client, proxy.url + CHAT, chat("one"))
    await eventually(lambda: cache_status(proxy)["stores"] == 1)
    _, second, _ = await post(client, proxy.url + CHAT, chat("two"))
    assert second["X-Edgeproxy-Cache"] == "HIT"
    assert first["X-Edgeproxy-Cache-Key"] == second["X-Edgeproxy-Cache-Key"]


async def test_admin_purges_by_key_prefix_and_tenant(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    class Tenants:
        @hookimpl
        def edgeproxy_request_received(self, ctx: RequestContext) -> None:
            ctx.tenant = ctx.headers.get("x-tenant")

    region = await make_region("r1")
    proxy = await start_proxy([region], plugins=(Tenants(),))
    purge = proxy.admin_url + "/cache/purge"

    async def ask(prompt: str, tenant: str) -> tuple[str, str]:
        _, headers, _ = await post(
            client, proxy.url + CHAT, chat(prompt), headers={"x-tenant": tenant}
        )
        await eventually(lambda: not proxy.pipeline.cache.coalescer.flights)
        return headers["X-Edgeproxy-Cache"], headers["X-Edgeproxy-Cache-Key"]

    _, key_a = await ask("a", "acme")
    await ask("b", "acme")
    await ask("c", "globex")
    async with client.post(purge, json={"key": key_a}) as resp:
        assert resp.status == 200 and (await resp.json())["purged"] == 1
    assert (await ask("a", "acme"))[0] == "MISS"
    assert (await ask("b", "acme"))[0] == "HIT"
    async with client.post(purge, json={"tenant": "acme"}) as resp:
        assert (await resp.json())["purged"] == 2
    assert (await ask("b", "acme"))[0] == "MISS"
    assert (await ask("c", "globex"))[0] == "HIT"
    async with client.post(purge, params={"prefix": ""}) as resp:
        assert (await resp.json())["purged"] == 2  # b (acme, again) and c (globex)
    assert (await ask("c", "globex"))[0] == "MISS"

    for bad in ({}, {"key": "a", "prefix": "b"}, {"key": ""}, {"tenant": 3}):
        async with client.post(purge, json=bad) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
    async with client.post(purge, data=b"{nope") as resp:
        assert resp.status == 400
    async with client.get(proxy.admin_url + "/status") as resp:
        status = await resp.json()
    assert status["cache"]["purged"] == 5
    assert status["cache"]["hit_ratio"] is not None


async def test_disabled_cache_adds_nothing(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1")
    proxy = await start_proxy([region], cache={"enabled": False})
    for _ in range(2):
        _, headers, _ = await post(client, proxy.url + CHAT, chat())
        assert "X-Edgeproxy-Cache" not in headers
    assert upstream_calls(region) == 2
    assert cache_status(proxy)["enabled"] is False


def test_which_answers_may_be_stored() -> None:
    from edgeproxy._cache.stage import CachePlan, CacheStage
    from edgeproxy._plugins import Plugins

    config = Config.from_mapping(
        proxy_config([{"name": "r", "url": "http://127.0.0.1:1"}]), environ={}
    )
    stage = CacheStage(config, Plugins())

    def plan(method: str = "GET", credentials: bool = False) -> CachePlan:
        return CachePlan("k", method, True, False, False, False, 300.0, 5.0, 7.0, credentials)

    def windows(headers: list[tuple[str, str]], **kw: Any) -> Any:
        return stage.storable(plan(**kw), 200, headers)

    assert stage.storable(plan("POST"), 500, []) == (None, "status")
    assert windows([], method="POST") == ((300.0, 5.0, 7.0), "")
    assert windows([("Cache-Control", "no-store")], method="POST") == (None, "no_store")
    assert windows([("content-encoding", "gzip")], method="POST") == (None, "encoded")
    assert windows([]) == (None, "not_cacheable")
    assert windows([("cache-control", "max-age=60")]) == ((60.0, 5.0, 7.0), "")
    assert windows([("cache-control", "max-age=60"), ("age", "50")]) == ((10.0, 5.0, 7.0), "")
    assert windows([("cache-control", "max-age=60"), ("age", "60")]) == (None, "not_cacheable")
    assert windows([("cache-control", "s-maxage=0, max-age=60")]) == (None, "not_cacheable")
    assert windows([("cache-control", "public, max-age=60, stale-while-revalidate=30")]) == (
        (60.0, 30.0, 7.0),
        "",
    )
    assert windows([("cache-control", "private, max-age=60")]) == (None, "no_store")
    assert windows([("cache-control", "no-cache, max-age=60")]) == (None, "not_cacheable")
    assert windows([("cache-control", "max-age=60"), ("set-cookie", "a=b")]) == (
        None,
        "set_cookie",
    )
    assert windows([("cache-control", "max-age=60"), ("vary", "Cookie")]) == (None, "vary")
    assert windows([("cache-control", "max-age=60"), ("vary", "Accept-Encoding")])[0]
    # A request with credentials: only what the upstream explicitly calls shareable.
    assert windows([("cache-control", "max-age=60")], credentials=True) == (
        None,
        "not_cacheable",
    )
    assert windows([("cache-control", "public, max-age=60")], credentials=True)[0]


async def test_followers_of_a_stream_that_breaks_get_an_error_event_with_a_code(
    make_region: RegionFactory, start_proxy: StartProxy, client: aiohttp.ClientSession
) -> None:
    region = await make_region(
        "r1", ttft=0.2, inter_token_delay=0.01, tokens=10, fault="reset", fault_after_tokens=3
    )
    proxy = await start_proxy([region])
    body = chat("breaks", stream=True)

    async def stream() -> tuple[str, bytes]:
        async with client.post(proxy.url + CHAT, json=body) as resp:
            data = b""
            try:
                async for chunk in resp.content.iter_any():
                    data += chunk
            except aiohttp.ClientPayloadError:
                pass  # the truncated end every client sees
            return resp.headers["X-Edgeproxy-Cache"], data

    results = await asyncio.gather(*(stream() for _ in range(4)))
    followers = [data for outcome, data in results if outcome == "COALESCED"]
    assert followers, [outcome for outcome, _ in results]
    for data in followers:
        assert b"event: error\n" in data
        error = orjson.loads(data.split(b"event: error\ndata: ", 1)[1].split(b"\n", 1)[0])
        assert error["error"]["code"] == "upstream_stream_broken"
        assert b"[DONE]" not in data
