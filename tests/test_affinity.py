"""Prefix (KV-cache) affinity: prompt keys, the per-region index, the score and its guard,
and, through the real proxy and fake regions with a KV cache, conversations and sessions
that come back to the region holding their prefix, unless it is unhealthy or overloaded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from edgeproxy import Config, EdgeProxy
from edgeproxy._core.context import RequestContext
from edgeproxy._protocol.headers import trace_context
from edgeproxy._protocol.prefix import PromptKey, prompt_key
from edgeproxy._routing.affinity import Affinity
from edgeproxy._routing.router import Router
from edgeproxy._upstream.prefixindex import PrefixIndex
from edgeproxy._upstream.regions import RegionSet
from edgeproxy.testing import Behavior, FakeRegion

from .conftest import FakeClock, ProxyFactory, proxy_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def system_prompt(topic: str) -> str:
    """About 1.3 kB: five blocks of 256 characters, distinct from the first character on."""
    return f"[{topic}] You are a careful assistant for {topic}. " + "Answer briefly. " * 80


def turn(topic: str, n: int) -> dict[str, Any]:
    """Turn ``n`` (1, 2...) of conversation ``topic``: everything said so far, then a question."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt(topic)}]
    for i in range(1, n):
        messages.append({"role": "user", "content": f"question {i} about {topic}"})
        messages.append({"role": "assistant", "content": f"answer {i}: " + "words " * 60})
    messages.append({"role": "user", "content": f"question {n} about {topic}"})
    return {"model": "fake-llm", "messages": messages, "max_tokens": 2}


# -- prompt keys ---------------------------------------------------------------------------


def test_next_turn_extends_the_blocks_of_the_turn_before() -> None:
    one = prompt_key(turn("a", 1), chat=True)
    two = prompt_key(turn("a", 2), chat=True)
    three = prompt_key(turn("a", 3), chat=True)
    assert one is not None and two is not None and three is not None
    assert len(one.blocks) == 5 < len(two.blocks) < len(three.blocks) <= 64
    assert two.blocks[: len(one.blocks)] == one.blocks
    assert three.blocks[: len(two.blocks)] == two.blocks
    other = prompt_key(turn("b", 2), chat=True)
    assert other is not None and not set(other.blocks) & set(two.blocks)


def test_blocks_are_chained_and_cut_by_characters() -> None:
    text = "x" * 1000
    key = prompt_key({"prompt": text}, chat=False, block_chars=100)
    assert key is not None and len(key.blocks) == 10 and len(set(key.blocks)) == 10
    # Block 1 is the same text as block 0, but its hash covers block 0 too.
    changed = prompt_key({"prompt": "y" + text[1:]}, chat=False, block_chars=100)
    assert changed is not None and not set(changed.blocks) & set(key.blocks)
    # Only whole blocks count; a prompt shorter than one block has no key.
    assert prompt_key({"prompt": text[:150]}, chat=False, block_chars=100) == PromptKey(
        key.blocks[:1]
    )
    assert prompt_key({"prompt": text[:99]}, chat=False, block_chars=100) is None
    # At most max_blocks, from the start.
    capped = prompt_key({"prompt": text}, chat=False, block_chars=100, max_blocks=3)
    assert capped is not None and capped.blocks == key.blocks[:3]


def test_canonical_text_role_content_parts_and_model() -> None:
    long = "z" * 600

    def key(**body: Any) -> PromptKey:
        found = prompt_key({"model": "m", **body}, chat=True)
        assert found is not None
        return found

    plain = key(messages=[{"role": "user", "content": long}])
    # Text parts are the same text; other members of a message are left out.
    parts = key(messages=[{"role": "user", "content": [{"type": "text", "text": long}]}])
    named = key(messages=[{"role": "user", "content": long, "name": "bob"}])
    assert plain == parts == named
    # The role and the model count.
    assert key(messages=[{"role": "system", "content": long}]) != plain
    other_model = prompt_key(
        {"model": "n", "messages": [{"role": "user", "content": long}]}, chat=True
    )
    assert other_model is not None and other_model != plain
    # An image part stands as a digest of itself: same image, same key.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 400}}
    with_image = key(
        messages=[{"role": "user", "content": [image, {"type": "text", "text": long}]}]
    )
    assert with_image == key(
        messages=[{"role": "user", "content": [dict(image), {"type": "text", "text": long}]}]
    )
    assert with_image != plain
    # Completions: a string, strings, token ids.
    assert prompt_key({"prompt": long}, chat=False) is not None
    assert prompt_key({"prompt": [long, "more"]}, chat=False) is not None
    assert prompt_key({"prompt": list(range(200))}, chat=False) is not None
    # Nothing to key on.
    for body in ({}, {"messages": "no"}, {"prompt": 3}, [1, 2], "text", None):
        assert prompt_key(body, chat=True) is None
        assert prompt_key(body, chat=False) is None


def test_session_is_a_leading_block_chained_into_the_others() -> None:
    short = {"model": "fake-llm", "messages": [{"role": "user", "content": "hi"}]}
    assert prompt_key(short, chat=True) is None
    s1 = prompt_key(short, chat=True, session="s1")
    s1_again = prompt_key(
        {"model": "fake-llm", "messages": [{"role": "user", "content": "bye"}]},
        chat=True,
        session="s1",
    )
    s2 = prompt_key(short, chat=True, session="s2")
    assert s1 is not None and s1.session and len(s1.blocks) == 1
    assert s1 == s1_again  # whatever the prompt
    assert s2 is not None and s2.blocks != s1.blocks
    long = prompt_key(turn("a", 1), chat=True, session="s1")
    plain = prompt_key(turn("a", 1), chat=True)
    assert long is not None and plain is not None
    assert long.blocks[0] == s1.blocks[0] and len(long.blocks) == len(plain.blocks) + 1
    assert not set(long.blocks[1:]) & set(plain.blocks)  # a session's blocks are its own


# -- the index -------------------------------------------------------------------------------


def test_index_matches_the_longest_recorded_prefix() -> None:
    index = PrefixIndex(capacity=100, ttl=60.0)
    assert index.match([1, 2, 3], now=0.0) == 0
    index.record([1, 2, 3], now=0.0)
    assert len(index) == 3
    assert index.match([1, 2, 3, 4], now=1.0) == 3
    assert index.match([1, 2, 9, 3], now=1.0) == 2
    assert index.match([9, 1, 2], now=1.0) == 0  # a prefix, from the first block


def test_index_is_an_lru_bounded_by_its_capacity() -> None:
    index = PrefixIndex(capacity=4, ttl=60.0)
    index.record([1, 2, 3], now=0.0)
    index.record([10, 11], now=1.0)
    # Oldest out first, and of one prompt its end before its start.
    assert len(index) == 4 and 3 not in index and 1 in index and 2 in index
    assert index.evicted_total == 1
    index.record([1], now=2.0)  # refreshed: now the most recent
    index.record([20, 21], now=3.0)
    # Out: 2 (the oldest), then 11 before 10 (the end of a prompt before its start).
    assert 1 in index and 10 in index and 2 not in index and 11 not in index
    assert len(index) == 4
    for i in range(1000):
        index.record([1000 + i, 2000 + i], now=4.0 + i)
    assert len(index) == 4


def test_index_forgets_after_its_ttl() -> None:
    clock = FakeClock(100.0)
    index = PrefixIndex(capacity=100, ttl=30.0)
    index.record([1, 2], now=clock())
    clock.advance(20)
    index.record([3], now=clock())
    assert index.match([1, 2], clock()) == 2
    clock.advance(15)  # [1, 2] is 35 s old, [3] 15 s
    assert index.match([1, 2], clock()) == 0
    assert index.match([3], clock()) == 1
    index.record([4], now=clock())  # expired blocks leave from the cold end
    assert 1 not in index and 2 not in index and len(index) == 2
    assert index.expired_total == 2
    clock.advance(31)
    index.expire(clock())
    assert len(index) == 0


def test_index_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0, ttl=1.0)
    with pytest.raises(ValueError):
        PrefixIndex(capacity=1, ttl=0.0)


# -- the score and the balance guard, on a router without traffic -------------------------


def _router(
    regions: list[dict[str, Any]],
    clock: FakeClock,
    sections: dict[str, dict[str, Any]] | None = None,
    **routing: Any,
) -> tuple[Router, RegionSet]:
    config = Config.from_mapping(
        proxy_config(regions, routing={"prefix_affinity": True, **routing}, **(sections or {})),
        environ={},
    )
    region_set = RegionSet(config, clock=clock)
    for region in region_set:
        region.endpoints[0].mark_up()
        for i in range(5):
            region.latency.observe(0.05, now=float(i))
    return Router(config, region_set, seed=1, clock=clock), region_set


def _ctx(config: Config, body: dict[str, Any], **headers: str) -> RequestContext:
    import orjson

    ctx = RequestContext(
        request_id="r",
        trace=trace_context(None),
        method="POST",
        target=CHAT,
        headers=CIMultiDict({"content-type": "application/json", **headers}),
        client_ip="127.0.0.1",
        started=time.monotonic(),
        route=config.route_for("POST", CHAT),
    )
    ctx.body = orjson.dumps(body)
    ctx.body_read = True
    return ctx


THREE = [
    {"name": "a", "url": "http://127.0.0.1:9"},
    {"name": "b", "url": "http://127.0.0.1:9"},
    {"name": "c", "url": "http://127.0.0.1:9"},
]


async def test_the_region_holding_the_prefix_ranks_first() -> None:
    clock = FakeClock(10.0)
    router, regions = _router(THREE, clock)
    try:
        ctx = _ctx(router.config, turn("x", 2))
        plan = router.plan(ctx)
        assert plan is not None and len(plan.key.blocks) > 5
        # Nothing recorded yet: the router's own choice, and no one chosen by affinity.
        router.candidates(ctx, plan)
        assert plan.chosen is None
        first = prompt_key(turn("x", 1), chat=True)
        assert first is not None
        regions.by_name["b"].prefix_index.record(first.blocks, clock())
        for _ in range(50):
            plan = router.plan(ctx)
            assert plan is not None
            ranked = router.candidates(ctx, plan)
            assert ranked[0].name == "b" and plan.chosen is ranked[0]
            assert {r.name for r in ranked} == {"a", "b", "c"}
        # A longer match wins over a shorter one.
        regions.by_name["c"].prefix_index.record(plan.key.blocks, clock())
        again = router.plan(ctx)
        assert again is not None
        assert router.candidates(ctx, again)[0].name == "c"
        # Recorded where it was answered, and counted there.
        router.routed(plan, regions.by_name["b"])
        b = regions.by_name["b"].snapshot()["affinity"]
        assert b["requests_total"] == 1 and b["hits_total"] == 1 and b["hit_share"] == 1.0
        assert b["index_size"] == len(plan.key.blocks)
    finally:
        await regions.close()


async def test_load_outweighs_a_partial_match_by_the_weights() -> None:
    clock = FakeClock(10.0)
    router, regions = _router(THREE[:2], clock, balance_abs_threshold=1000.0)
    try:
        ctx = _ctx(router.config, turn("x", 2))
        plan = router.plan(ctx)
        assert plan is not None
        blocks = plan.key.blocks
        a, b = regions.by_name["a"], regions.by_name["b"]
        # "a" holds the whole prompt: 3 x 1 + 4 x (best / a's score) against b's 4 x 1.
        a.prefix_index.record(blocks, clock())
        a.in_flight = 2  # score 3x the best: 3 + 4/3 > 4, a keeps it
        assert router.candidates(ctx, router.plan(ctx))[0] is a
        a.in_flight = 4  # 5x: 3 + 4/5 < 4, b wins
        assert router.candidates(ctx, router.plan(ctx))[0] is b
        # "a" holds half of it: 1.5 + 4/x > 4 only while x < 1.6.
        a.prefix_index.clear()
        a.prefix_index.record(blocks[: len(blocks) // 2], clock())
        half = len(blocks) // 2 / len(blocks)
        a.in_flight = 0
        assert router.candidates(ctx, router.plan(ctx))[0] is a
        a.in_flight = 1  # 2x the best
        assert 3 * half + 4 / 2 < 4
        assert router.candidates(ctx, router.plan(ctx))[0] is b
    finally:
        for region in regions:
            region.in_flight = 0
        await regions.close()


async def test_balance_guard_lets_load_alone_route_when_loads_are_too_uneven() -> None:
    affinity = Affinity(
        Config.from_mapping(
            proxy_config(THREE, routing={"balance_abs_threshold": 4, "balance_rel_threshold": 1.5}),
            environ={},
        ).routing
    )
    assert not affinity.unbalanced([0, 4])  # 4 apart: not more than 4
    assert affinity.unbalanced([0, 5])
    assert not affinity.unbalanced([20, 29])  # 9 apart, but 29 < 20 x 1.5
    assert affinity.unbalanced([20, 31])
    assert not affinity.unbalanced([3, 3, 3])

    clock = FakeClock(10.0)
    # No load term: the prefix alone ranks, until the guard sets it aside.
    router, regions = _router(THREE, clock, balance_abs_threshold=4, load_weight=0)
    try:
        ctx = _ctx(router.config, turn("x", 2))
        plan = router.plan(ctx)
        assert plan is not None
        a = regions.by_name["a"]
        a.prefix_index.record(plan.key.blocks, clock())
        a.in_flight = 4
        assert router.candidates(ctx, plan)[0] is a and not plan.balanced
        a.in_flight = 5  # too uneven: the router's own choice, which avoids the busy one
        assert router.candidates(ctx, router.plan(ctx))[0] is not a
        for _ in range(20):
            plan = router.plan(ctx)
            assert plan is not None
            assert router.candidates(ctx, plan)[0] is not a
            assert plan.balanced and plan.chosen is None
        router.routed(plan, regions.by_name["b"])
        assert regions.by_name["b"].affinity_balanced_total == 1
        # Reported load counts too: a region saying it holds 40 requests is loaded.
        a.in_flight = 0
        a.reported.observe_header(
            "TEXT named_metrics.num_requests_waiting=30.0, named_metrics.num_requests_running=10.0",
            clock(),
        )
        assert router.load(a, clock()) == 40
        plan = router.plan(ctx)
        assert plan is not None
        assert router.candidates(ctx, plan)[0] is not a and plan.balanced
    finally:
        for region in regions:
            region.in_flight = 0
        await regions.close()


async def test_priority_tiers_come_before_affinity() -> None:
    clock = FakeClock(10.0)
    router, regions = _router(
        [{"name": "main", "url": "http://127.0.0.1:9"}, {**THREE[1], "priority": 1}], clock
    )
    try:
        ctx = _ctx(router.config, turn("x", 2))
        plan = router.plan(ctx)
        assert plan is not None
        regions.by_name["b"].prefix_index.record(plan.key.blocks, clock())
        assert [r.name for r in router.candidates(ctx, plan)] == ["main", "b"]
    finally:
        await regions.close()


async def test_residency_and_the_model_catalog_filter_before_affinity() -> None:
    clock = FakeClock(10.0)
    router, regions = _router(
        [
            {"name": "eu", "url": "http://127.0.0.1:9", "jurisdiction": "eu", "models": ["m"]},
            {"name": "us", "url": "http://127.0.0.1:9", "jurisdiction": "us", "models": ["m"]},
            {"name": "other", "url": "http://127.0.0.1:9", "models": ["n"]},
            {"name": "eu2", "url": "http://127.0.0.1:9", "jurisdiction": "eu", "models": ["m"]},
        ],
        clock,
        {"geo": {"residency": {"*": ["eu", "other"]}}},
    )
    try:
        ctx = _ctx(router.config, {**turn("x", 2), "model": "m"})
        plan = router.plan(ctx)
        assert plan is not None
        # "us" (not allowed) and "other" (another model) hold the whole prompt, "eu2" half.
        regions.by_name["us"].prefix_index.record(plan.key.blocks, clock())
        regions.by_name["other"].prefix_index.record(plan.key.blocks, clock())
        regions.by_name["eu2"].prefix_index.record(plan.key.blocks[:3], clock())
        for _ in range(10):
            plan = router.plan(ctx)
            assert plan is not None
            assert [r.name for r in router.candidates(ctx, plan)] == ["eu2", "eu"]
        # Unhealthy: filtered too.
        regions.by_name["eu2"].endpoints[0].mark_down("test")
        assert [r.name for r in router.candidates(ctx, router.plan(ctx))] == ["eu"]
    finally:
        await regions.close()


def test_plans_only_for_chat_and_completions_posts_with_json() -> None:
    config = Config.from_mapping(proxy_config(THREE, routing={"prefix_affinity": True}), environ={})
    affinity = Affinity(config.routing)
    assert affinity.plan(_ctx(config, turn("x", 1))) is not None
    embeddings = _ctx(config, {"input": "x" * 1000})
    embeddings.target = "/v1/embeddings"
    assert affinity.plan(embeddings) is None
    completions = _ctx(config, {"prompt": "x" * 1000})
    completions.target = COMPLETIONS
    assert affinity.plan(completions) is not None
    get = _ctx(config, turn("x", 1))
    get.method = "GET"
    assert affinity.plan(get) is None
    # Sessions: the header first, else the body's user.
    short = {"messages": [{"role": "user", "content": "hi"}], "user": "u1"}
    by_user = affinity.plan(_ctx(config, short))
    by_header = affinity.plan(_ctx(config, short, **{"X-Session-Id": "h1"}))
    assert by_user is not None and by_header is not None
    assert by_user.key.blocks != by_header.key.blocks
    off = Config.from_mapping(
        proxy_config(
            THREE,
            routing={"prefix_affinity": True, "session_header": "", "session_from_user": False},
        ),
        environ={},
    )
    assert Affinity(off.routing).plan(_ctx(off, short, **{"X-Session-Id": "h1"})) is None


async def test_affinity_off_by_default() -> None:
    config = Config.from_mapping(proxy_config(THREE), environ={})
    regions = RegionSet(config)
    try:
        router = Router(config, regions)
        assert router.affinity is None and router.plan(_ctx(config, turn("x", 1))) is None
    finally:
        await regions.close()


# -- through the real proxy ------------------------------------------------------------------


@pytest.fixture
async def kv_regions() -> AsyncIterator[Callable[..., Awaitable[list[FakeRegion]]]]:
    """Fake regions modelling an LLM server with a prefix cache (started, stopped after)."""
    started: list[FakeRegion] = []

    async def factory(*names: str, **behavior: Any) -> list[FakeRegion]:
        out = []
        for name in names:
            region = FakeRegion(
                name=name,
                behavior=Behavior(ttft=0.01, **behavior),
                kv_capacity_blocks=4096,
                kv_block_size=16,
            )
            await region.start()
            started.append(region)
            out.append(region)
        return out

    yield factory
    for region in started:
        await region.stop()


async def post(
    client: aiohttp.ClientSession, proxy: EdgeProxy, body: dict[str, Any], **headers: str
) -> aiohttp.ClientResponse:
    async with client.post(proxy.url + CHAT, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp


async def status(proxy: EdgeProxy) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/status") as resp:
            return {r["name"]: r for r in (await resp.json())["regions"]}


async def test_each_conversation_comes_back_to_its_region(
    kv_regions: Callable[..., Awaitable[list[FakeRegion]]], make_proxy: ProxyFactory
) -> None:
    fakes = await kv_regions("r1", "r2", "r3")
    # The prefix outweighs any load (3 against at most 2): a loaded machine's hiccup in one
    # fake region never sends a conversation elsewhere. The trade-off is tested apart.
    proxy = await make_proxy(fakes, routing={"prefix_affinity": True, "load_weight": 2.0})
    first: dict[str, str] = {}
    async with aiohttp.ClientSession() as client:
        for topic in "abcdefgh":
            resp = await post(client, proxy, turn(topic, 1))
            first[topic] = resp.headers["X-Edgeproxy-Region"]
            assert resp.headers["x-fake-kv-cached-tokens"] == "0"
        for n in (2, 3):
            for topic in "abcdefgh":
                resp = await post(client, proxy, turn(topic, n))
                assert resp.headers["X-Edgeproxy-Region"] == first[topic], (topic, n)
                # The region's KV cache held the turn before: most of the prompt was cached.
                cached = int(resp.headers["x-fake-kv-cached-tokens"])
                assert cached > int(resp.headers["x-fake-kv-prompt-tokens"]) // 2
    regions = await status(proxy)
    assert sum(r["affinity"]["requests_total"] for r in regions.values()) == 24
    assert sum(r["affinity"]["hits_total"] for r in regions.values()) == 16
    for name, region in regions.items():
        if name in first.values():
            assert region["affinity"]["index_size"] > 0
            assert region["affinity"]["hit_share"] == pytest.approx(2 / 3, abs=1e-3)


async def test_an_unhealthy_region_loses_its_conversations(
    kv_regions: Callable[..., Awaitable[list[FakeRegion]]], make_proxy: ProxyFactory
) -> None:
    fakes = await kv_regions("r1", "r2", "r3")
    proxy = await make_proxy(
        fakes,
        routing={"prefix_affinity": True},
        health={"consecutive_failures": 1, "max_ejection_percent": 100},
    )
    by_name = {f.name: f for f in fakes}
    async with aiohttp.ClientSession() as client:
        home = (await post(client, proxy, turn("a", 1))).headers["X-Edgeproxy-Region"]
        # The same prompt again goes home, which fails it: ejected, retried elsewhere.
        by_name[home].configure(fault="5xx", fault_paths=("/v1/",))
        resp = await post(client, proxy, turn("a", 1))
        assert resp.headers["X-Edgeproxy-Region"] != home
        assert resp.headers["X-Edgeproxy-Attempts"] == "2"
        by_name[home].configure(fault=None)
        served = by_name[home].requests_total
        # Turn 2: the ejected region is filtered out before affinity ranks anything.
        resp = await post(client, proxy, turn("a", 2))
        assert resp.headers["X-Edgeproxy-Region"] != home
        assert "X-Edgeproxy-Attempts" not in resp.headers
        assert by_name[home].requests_total == served
    regions = await status(proxy)
    assert not regions[home]["health"]["available"]


async def test_an_overloaded_region_loses_its_conversations_to_the_balance_guard(
    kv_regions: Callable[..., Awaitable[list[FakeRegion]]], make_proxy: ProxyFactory
) -> None:
    fakes = await kv_regions("r1", "r2", "r3")
    # The held streams stall after their first chunk and their clients then close: with
    # half_close = "answer" a FIN after the answer started is found out only at the next
    # write, which a stalled stream never makes; "abort" frees them at once.
    proxy = await make_proxy(
        fakes,
        routing={"prefix_affinity": True, "balance_abs_threshold": 2},
        limits={"half_close": "abort"},
    )
    by_name = {f.name: f for f in fakes}
    held: list[aiohttp.ClientResponse] = []
    async with aiohttp.ClientSession() as client:
        home = (await post(client, proxy, turn("a", 1))).headers["X-Edgeproxy-Region"]
        # Three streams of the same conversation stay open at home (it stalls after the
        # first chunk): affinity sends them there while it is at most 2 ahead of the others.
        by_name[home].configure(fault="stall_body", fault_paths=("/v1/",))
        try:
            for _ in range(3):
                resp = await client.post(proxy.url + CHAT, json={**turn("a", 1), "stream": True})
                assert resp.status == 200
                held.append(resp)
                assert resp.headers["X-Edgeproxy-Region"] == home
            assert proxy.regions.by_name[home].in_flight == 3
            # Turn 2: 3 in flight against 0 is too uneven; load alone routes, elsewhere.
            resp = await post(client, proxy, turn("a", 2))
            other = resp.headers["X-Edgeproxy-Region"]
            assert other != home
        finally:
            for resp in held:
                resp.close()
        regions = await status(proxy)
        assert regions[other]["affinity"]["balanced_total"] == 1
        # Once the load is even again, the conversation is back home (it holds turn 1).
        by_name[home].configure(fault=None)
        deadline = asyncio.get_running_loop().time() + 3
        while (
            proxy.regions.by_name[home].in_flight and asyncio.get_running_loop().time() < deadline
        ):
            await asyncio.sleep(0.02)
        resp = await post(client, proxy, turn("a", 3))
        assert resp.headers["X-Edgeproxy-Region"] in (home, other)


async def test_a_session_sticks_to_its_region(
    kv_regions: Callable[..., Awaitable[list[FakeRegion]]], make_proxy: ProxyFactory
) -> None:
    fakes = await kv_regions("r1", "r2", "r3")
    # A session's match must outweigh the load term whatever the latencies a loaded machine
    # measures (a hiccup of one answer can make a region look several times slower).
    routing = {"prefix_affinity": True, "load_weight": 0.5}
    proxy = await make_proxy(fakes, routing=routing)
    async with aiohttp.ClientSession() as client:
        for session in ("s1", "s2", "s3", "s4", "s5"):
            seen = set()
            for i in range(4):
                body = {"model": "fake-llm", "messages": [{"role": "user", "content": f"q{i}"}]}
                resp = await post(client, proxy, body, **{"X-Session-Id": session})
                seen.add(resp.headers["X-Edgeproxy-Region"])
            assert len(seen) == 1, session
        for user in ("u1", "u2", "u3"):
            seen = set()
            for i in range(4):
                body = {
                    "model": "fake-llm",
                    "messages": [{"role": "user", "content": f"q{i}"}],
                    "user": user,
                }
                seen.add((await post(client, proxy, body)).headers["X-Edgeproxy-Region"])
            assert len(seen) == 1, user
    regions = await status(proxy)
    assert sum(r["affinity"]["requests_total"] for r in regions.values()) == 32
    assert sum(r["affinity"]["hits_total"] for r in regions.values()) == 24
    # Short prompts with no session have no key: nothing recorded, nothing counted.
    async with aiohttp.ClientSession() as client:
        await post(client, proxy, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    again = await status(proxy)
    assert sum(r["affinity"]["requests_total"] for r in again.values()) == 32
