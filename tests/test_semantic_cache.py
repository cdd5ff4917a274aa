"""The semantic cache end to end: a paraphrase of a cached question is answered from the
cache (SEMANTIC-HIT, its similarity in a header), a near miss never is, and nothing
crosses a tenant, a system prompt, an earlier turn, a model or a sampling parameter.
The embedder is the real static one (wordllama, offline); upstream counters, cache headers
and ``/status`` say what happened."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from edgeproxy import EdgeProxy
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory, eventually

pytest.importorskip("wordllama", reason="the semantic extra (wordllama) is not installed")

CHAT = "/v1/chat/completions"
QUESTION = "How do I enable two-factor authentication on my account?"
PARAPHRASE = "How can I turn on two-factor authentication for my account?"
NEAR_MISS = "How do I disable two-factor authentication on my account?"


def calls(region: FakeRegion) -> int:
    return region.counters().requests_by_path.get(CHAT, 0)


def semantic_status(proxy: EdgeProxy) -> dict[str, Any]:
    status = proxy.status()["cache"]
    assert isinstance(status, dict)
    semantic = status["semantic"]
    assert isinstance(semantic, dict)
    return semantic


def body(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [*extra.pop("history", []), {"role": "user", "content": question}],
        **extra,
    }


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def start(
    make_region: RegionFactory, make_proxy: ProxyFactory, **cache: Any
) -> tuple[EdgeProxy, FakeRegion]:
    region = await make_region("r1", tokens=6)
    proxy = await make_proxy(
        [region],
        cache={"xfetch_beta": 0.0, **cache},
        routes=[{"name": "llm", "path": "/v1/", "semantic_cache": True}],
    )
    return proxy, region


async def ask(
    client: aiohttp.ClientSession, proxy: EdgeProxy, payload: dict[str, Any], **headers: str
) -> tuple[int, dict[str, str], bytes]:
    async with client.post(proxy.url + CHAT, json=payload, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def stored(proxy: EdgeProxy, count: int) -> None:
    await eventually(lambda: semantic_status(proxy)["entries"] == count)


async def test_a_paraphrase_is_a_semantic_hit_and_a_near_miss_goes_upstream(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    proxy, region = await start(make_region, make_proxy)
    status, headers, first = await ask(client, proxy, body(QUESTION))
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
    await stored(proxy, 1)
    status, headers, again = await ask(client, proxy, body(PARAPHRASE))
    assert status == 200
    assert headers["X-Edgeproxy-Cache"] == "SEMANTIC-HIT"
    assert float(headers["X-Edgeproxy-Semantic-Similarity"]) >= 0.85
    assert again == first
    assert calls(region) == 1
    # A semantic hit is never stored as an entry of its own.
    assert semantic_status(proxy)["entries"] == 1
    status, headers, _ = await ask(client, proxy, body(NEAR_MISS))
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    assert calls(region) == 2
    semantic = semantic_status(proxy)
    assert semantic["hits"] == 1 and semantic["rejected"].get("word", 0) >= 1


@pytest.mark.parametrize(
    ("name", "changed"),
    [
        ("model", {"model": "other"}),
        ("sampling", {"max_tokens": 7}),
        ("system prompt", {"history": [{"role": "system", "content": "Answer in French."}]}),
        (
            "earlier turn",
            {
                "history": [
                    {"role": "user", "content": "I use the mobile app."},
                    {"role": "assistant", "content": "Noted."},
                ]
            },
        ),
        ("tools", {"response_format": {"type": "json_object"}}),
    ],
)
async def test_nothing_else_may_differ(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    client: aiohttp.ClientSession,
    name: str,
    changed: dict[str, Any],
) -> None:
    proxy, region = await start(make_region, make_proxy)
    await ask(client, proxy, body(QUESTION))
    await stored(proxy, 1)
    # The same words: an exact miss (something else differs), and no semantic hit either.
    _, headers, _ = await ask(client, proxy, body(PARAPHRASE, **changed))
    assert headers["X-Edgeproxy-Cache"] == "MISS", name
    assert calls(region) == 2


async def test_no_hit_across_tenants(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    proxy, region = await start(make_region, make_proxy)
    await ask(client, proxy, body(QUESTION), Authorization="Bearer sk-tenant-a")
    await stored(proxy, 1)
    _, headers, _ = await ask(client, proxy, body(PARAPHRASE), Authorization="Bearer sk-tenant-b")
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    _, headers, _ = await ask(client, proxy, body(PARAPHRASE), Authorization="Bearer sk-tenant-a")
    assert headers["X-Edgeproxy-Cache"] == "SEMANTIC-HIT"
    assert calls(region) == 2


async def test_no_cache_and_purges_are_respected(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    proxy, region = await start(make_region, make_proxy)
    await ask(client, proxy, body(QUESTION))
    await stored(proxy, 1)
    _, headers, _ = await ask(client, proxy, body(PARAPHRASE), **{"Cache-Control": "no-cache"})
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    await eventually(lambda: proxy.status()["cache"]["stores"] == 2)
    assert await proxy.purge_cache(prefix="") >= 1
    _, headers, _ = await ask(client, proxy, body("How can I switch on two-factor authentication?"))
    assert headers["X-Edgeproxy-Cache"] == "MISS"


async def test_shadow_mode_counts_but_does_not_serve(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    proxy, region = await start(make_region, make_proxy, semantic_shadow=True)
    await ask(client, proxy, body(QUESTION))
    await stored(proxy, 1)
    _, headers, _ = await ask(client, proxy, body(PARAPHRASE))
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    assert semantic_status(proxy)["shadow_hits"] == 1
    assert calls(region) == 2


async def test_metrics_count_hits_misses_rejections_and_lookup_time(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    proxy, _ = await start(make_region, make_proxy)
    await ask(client, proxy, body(QUESTION))
    await stored(proxy, 1)
    await ask(client, proxy, body(PARAPHRASE))
    await ask(client, proxy, body(NEAR_MISS))
    async with client.get(proxy.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert "edgeproxy_semantic_cache_hits_total 1.0" in text
    assert "edgeproxy_semantic_cache_lookups_total 3.0" in text
    assert 'edgeproxy_semantic_cache_rejected_total{reason="word"}' in text
    assert 'edgeproxy_semantic_cache_lookup_seconds_bucket{le="+Inf"} 3.0' in text
    assert "edgeproxy_semantic_cache_lookup_seconds_count 3.0" in text
