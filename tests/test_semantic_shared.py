"""The semantic cache across workers and PoPs, and its other embedders.

* Questions are shared through Redis beside their answers: a proxy that starts later
  warms its index from them, a running one picks them up, a purge takes them, and with
  Redis down each proxy serves from what it knows.
* The GGUF embedder (real llama.cpp on the generated model) and a region's
  ``/v1/embeddings`` (a fake region) embed questions; a failing embedder skips the
  lookup, never the request.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from edgeproxy import EdgeProxy
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory, eventually

pytest.importorskip("wordllama", reason="the semantic extra (wordllama) is not installed")

CHAT = "/v1/chat/completions"
QUESTION = "How do I enable two-factor authentication on my account?"
PARAPHRASE = "How can I turn on two-factor authentication for my account?"
ROUTES = [{"name": "llm", "path": "/v1/", "semantic_cache": True}]


def body(question: str) -> dict[str, Any]:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": question}]}


def semantic(proxy: EdgeProxy) -> dict[str, Any]:
    out = proxy.status()["cache"]["semantic"]
    assert isinstance(out, dict)
    return out


def calls(region: FakeRegion, path: str = CHAT) -> int:
    return region.counters().requests_by_path.get(path, 0)


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def ask(
    client: aiohttp.ClientSession, proxy: EdgeProxy, question: str, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    async with client.post(proxy.url + CHAT, json=body(question), headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def shared_cache(redis_server: str, prefix: str, **extra: Any) -> dict[str, Any]:
    return {
        "backend": "tiered",
        "redis_url": redis_server,
        "key_prefix": prefix,
        "xfetch_beta": 0.0,
        "semantic_sync_interval": 0.05,
        **extra,
    }


async def published(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    client: aiohttp.ClientSession,
    redis_server: str,
    redis_prefix: str,
) -> tuple[FakeRegion, EdgeProxy, bytes]:
    """A region, a proxy sharing through Redis that has stored and shared QUESTION (asked
    once: a miss), and its answer."""
    region = await make_region("r1", tokens=6)
    proxy = await make_proxy(
        [region], cache=shared_cache(redis_server, redis_prefix), routes=ROUTES
    )
    _, headers, answer = await ask(client, proxy, QUESTION)
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    await eventually(lambda: semantic(proxy)["shared"]["published"] == 1)
    return region, proxy, answer


async def test_a_proxy_started_later_warms_its_index_from_redis(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    client: aiohttp.ClientSession,
    redis_server: str,
    redis_prefix: str,
) -> None:
    region, _, answer = await published(make_region, make_proxy, client, redis_server, redis_prefix)
    # Another PoP: its own memory tier, the same Redis. It warms in the background.
    second = await make_proxy(
        [region], cache=shared_cache(redis_server, redis_prefix), routes=ROUTES
    )
    await eventually(lambda: semantic(second)["shared"]["warmed"])
    assert semantic(second)["entries"] == 1
    assert semantic(second)["shared"]["redis_search"] is False  # Redis 7 here: no FT
    _, headers, again = await ask(client, second, PARAPHRASE)
    assert headers["X-Edgeproxy-Cache"] == "SEMANTIC-HIT"
    assert again == answer
    assert calls(region) == 1


async def test_a_running_proxy_picks_up_what_another_stored(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    client: aiohttp.ClientSession,
    redis_server: str,
    redis_prefix: str,
) -> None:
    region = await make_region("r1", tokens=6)
    cache = shared_cache(redis_server, redis_prefix)
    first = await make_proxy([region], cache=cache, routes=ROUTES)
    second = await make_proxy([region], cache=cache, routes=ROUTES)
    await ask(client, first, QUESTION)
    await eventually(lambda: semantic(second)["entries"] == 1)
    _, headers, _ = await ask(client, second, PARAPHRASE)
    assert headers["X-Edgeproxy-Cache"] == "SEMANTIC-HIT"
    assert calls(region) == 1


async def test_another_embedder_s_questions_are_not_taken(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    client: aiohttp.ClientSession,
    redis_server: str,
    redis_prefix: str,
) -> None:
    region, _, _ = await published(make_region, make_proxy, client, redis_server, redis_prefix)
    other = shared_cache(
        redis_server,
        redis_prefix,
        semantic_embedder="region",
        semantic_embedder_region="r1",
        semantic_embedder_model="embed",
    )
    second = await make_proxy([region], cache=other, routes=ROUTES)
    await eventually(lambda: semantic(second)["shared"]["warmed"])
    assert semantic(second)["entries"] == 0


async def test_purges_take_the_shared_questions_too(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    client: aiohttp.ClientSession,
    redis_server: str,
    redis_prefix: str,
) -> None:
    region, proxy, _ = await published(make_region, make_proxy, client, redis_server, redis_prefix)
    raw = aioredis.Redis.from_url(redis_server)
    try:
        records = [k async for k in raw.scan_iter(match=redis_prefix + "*~q")]
        assert len(records) == 1
        key = records[0].decode()[len(redis_prefix) : -len("~q")]
        assert await proxy.purge_cache(key=key) == 1
        assert await raw.exists(records[0]) == 0
        assert semantic(proxy)["entries"] == 0
        # A later proxy finds nothing to warm with.
        later = await make_proxy(
            [region], cache=shared_cache(redis_server, redis_prefix), routes=ROUTES
        )
        await eventually(lambda: semantic(later)["shared"]["warmed"])
        assert semantic(later)["entries"] == 0
        _, headers, _ = await ask(client, later, PARAPHRASE)
        assert headers["X-Edgeproxy-Cache"] == "MISS"
    finally:
        await raw.aclose()


async def test_with_redis_down_each_proxy_serves_from_its_own_index(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    region = await make_region("r1", tokens=6)
    cache = shared_cache(f"redis://127.0.0.1:{port}/0", "down:", redis_timeout=0.2)
    proxy = await make_proxy([region], cache=cache, routes=ROUTES)
    _, headers, _ = await ask(client, proxy, QUESTION)
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    await eventually(lambda: semantic(proxy)["entries"] == 1)
    _, headers, _ = await ask(client, proxy, PARAPHRASE)
    assert headers["X-Edgeproxy-Cache"] == "SEMANTIC-HIT"
    assert semantic(proxy)["shared"]["published"] == 0


# -- other embedders ---------------------------------------------------------------------


async def test_the_gguf_embedder_embeds_with_llama_cpp(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    pytest.importorskip("llama_cpp", reason="the local extra (llama-cpp-python) is not installed")
    from edgeproxy.testing import tiny_llama_gguf

    region = await make_region("r1", tokens=6)
    routes = [{**ROUTES[0], "semantic_threshold": 0.5}]
    cache = {
        "xfetch_beta": 0.0,
        "semantic_embedder": "gguf",
        "semantic_embedder_model": str(tiny_llama_gguf()),
    }
    proxy = await make_proxy([region], cache=cache, routes=routes)
    assert semantic(proxy)["embedder"].startswith("gguf:")
    await ask(client, proxy, "What is the capital of France?")
    await eventually(lambda: semantic(proxy)["entries"] == 1)
    # Near-identical text: the same tokens but one, with a random-weight model.
    _, headers, _ = await ask(client, proxy, "What is the capital of France ?")
    assert headers["X-Edgeproxy-Cache"] == "SEMANTIC-HIT"
    assert semantic(proxy)["lookups"] == 2
    assert calls(region) == 1


async def test_a_region_embeds_and_a_failing_one_skips_the_lookup_only(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1", tokens=6)
    cache = {
        "xfetch_beta": 0.0,
        "semantic_embedder": "region",
        "semantic_embedder_region": "r1",
        "semantic_embedder_model": "embed",
    }
    proxy = await make_proxy([region], cache=cache, routes=ROUTES)
    assert semantic(proxy)["embedder"] == "region:r1:embed"
    status, headers, _ = await ask(client, proxy, QUESTION)
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
    assert calls(region, "/v1/embeddings") == 1
    await eventually(lambda: semantic(proxy)["entries"] == 1)
    region.configure(fault="5xx", fault_status=500, fault_paths=("/v1/embeddings",))
    status, headers, _ = await ask(client, proxy, PARAPHRASE)
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
    assert semantic(proxy)["skipped"].get("embedder_error") == 1
