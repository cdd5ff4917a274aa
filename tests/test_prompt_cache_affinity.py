"""Prompt-cache affinity: OpenAI's ``prompt_cache_key`` and Anthropic's ``cache_control``
breakpoints as the affinity key, scoped by tenant, held for the provider's cache TTL, and
still under health and load; through the real proxy and fake regions, with an injected
clock where time must pass."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict

from edgeproxy import Config, EdgeProxy, hookimpl
from edgeproxy._core.context import RequestContext
from edgeproxy._protocol.dialects import CHAT, MESSAGES, RESPONSES
from edgeproxy._protocol.headers import trace_context
from edgeproxy._routing.affinity import Affinity
from edgeproxy._routing.cacheintent import IntentKey, IntentTable, intent_key
from edgeproxy._routing.router import Router
from edgeproxy._upstream.regions import Region, RegionSet

from .conftest import FakeClock, ProxyFactory, RegionFactory, proxy_config

CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
# The key outweighs any load term a loaded test machine can measure (a hiccup of one answer
# makes a region look several times slower): 3 against at most 0.5. The trade-off itself is
# tested on a router with no traffic.
STICKY = {"prefix_affinity": True, "load_weight": 0.5}
EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}


def chat(question: str, key: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "fake-llm",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 2,
    }
    if key is not None:
        body["prompt_cache_key"] = key
    return body


def responses(question: str, key: str) -> dict[str, Any]:
    return {
        "model": "fake-llm",
        "input": question,
        "max_output_tokens": 2,
        "store": False,
        "prompt_cache_key": key,
    }


def messages(
    system: str,
    question: str,
    *,
    control: dict[str, Any] | None = None,
    history: Iterable[str] = (),
) -> dict[str, Any]:
    """A Messages request whose system prompt is one block carrying ``control`` (a
    breakpoint), then ``history`` as earlier user turns, then ``question``."""
    block: dict[str, Any] = {"type": "text", "text": system}
    if control is not None:
        block["cache_control"] = control
    turns: list[dict[str, Any]] = []
    for i, said in enumerate(history):
        turns.append({"role": "user", "content": said})
        turns.append({"role": "assistant", "content": f"answer {i}"})
    turns.append({"role": "user", "content": question})
    return {"model": "fake-llm", "max_tokens": 2, "system": [block], "messages": turns}


# -- what each dialect reads -----------------------------------------------------------------


def test_prompt_cache_key_is_read_from_chat_and_responses() -> None:
    assert CHAT.cache_intent(chat("q", "k1")) == [({"prompt_cache_key": "k1"}, False)]
    assert RESPONSES.cache_intent(responses("q", "k1")) == [({"prompt_cache_key": "k1"}, False)]
    for body in (chat("q"), chat("q", ""), {**chat("q"), "prompt_cache_key": 3}):
        assert CHAT.cache_intent(body) is None
    assert MESSAGES.cache_intent({**chat("q"), "prompt_cache_key": "k1"}) is None


def test_breakpoints_in_anthropics_cache_order_up_to_the_last() -> None:
    tool = {"name": "look", "input_schema": {"type": "object"}}
    body = {
        "model": "m",
        "tools": [{**tool, "cache_control": EPHEMERAL}],
        "system": "be brief",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "one", "cache_control": HOUR}]},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"},
        ],
    }
    marked = MESSAGES.cache_intent(body)
    # The tools, the system prompt (a string is one text block), then the messages' blocks,
    # each without its cache_control, up to the last breakpoint; 1h marks the extended TTL.
    assert marked == [
        (["tools", tool], False),
        (["system", {"type": "text", "text": "be brief"}], None),
        (["user", {"type": "text", "text": "one"}], True),
    ]
    assert MESSAGES.cache_intent({**body, "tools": [tool]}) is not None
    unmarked = {**body, "tools": [tool], "messages": [{"role": "user", "content": "one"}]}
    assert MESSAGES.cache_intent(unmarked) is None
    assert MESSAGES.cache_intent({"model": "m"}) is None


def _key(body: dict[str, Any], scope: str = "pub") -> IntentKey:
    marked = MESSAGES.cache_intent(body)
    assert marked is not None
    key = intent_key(marked, scope=scope, model=body.get("model"))
    assert key is not None
    return key


def test_the_key_is_the_prefix_up_to_the_last_breakpoint() -> None:
    base = _key(messages("policy A " * 50, "question 1", control=EPHEMERAL))
    # A change after the last breakpoint: the same key.
    assert _key(messages("policy A " * 50, "question 2", control=EPHEMERAL)).key == base.key
    after = messages("policy A " * 50, "question 1", control=EPHEMERAL)
    after["max_tokens"] = 50
    assert _key(after).key == base.key
    # A change before it, or of the model, or of the scope: another key.
    assert _key(messages("policy B " * 50, "question 1", control=EPHEMERAL)).key != base.key
    assert _key({**messages("policy A " * 50, "q", control=EPHEMERAL), "model": "n"}) != base
    assert _key(messages("policy A " * 50, "q", control=EPHEMERAL), scope="t1").key != base.key
    # The TTL asked is not part of the key, only of how long it is held.
    hour = _key(messages("policy A " * 50, "question 1", control=HOUR))
    assert hour.key == base.key and hour.writes == ((base.key, True),)
    assert base.writes == ((base.key, False),)


def test_a_moved_breakpoint_finds_the_prefix_the_turn_before_cached() -> None:
    def turn(n: int) -> dict[str, Any]:
        # The breakpoint on the newest user turn only, as a chat client moves it.
        body = messages("policy", f"q{n}", history=[f"q{i}" for i in range(n)])
        body["system"] = "policy"
        last = body["messages"][-1]
        last["content"] = [{"type": "text", "text": last["content"], "cache_control": EPHEMERAL}]
        return body

    one, two = _key(turn(1)), _key(turn(2))
    assert one.key != two.key
    # Turn 2 looks up its own prefix first, then every shorter one: turn 1's among them.
    assert two.lookups[0] == two.key and one.key in two.lookups
    table = IntentTable(100, 300.0, 3600.0)
    table.record(one, "r2", now=0.0)
    assert table.holder(two, now=1.0) == ("r2", one.key)


def test_the_table_holds_a_key_for_its_ttl_from_the_last_request() -> None:
    clock = FakeClock(100.0)
    table = IntentTable(capacity=100, ttl=300.0, ttl_extended=3600.0)
    short = _key(messages("short " * 40, "q", control=EPHEMERAL))
    long = _key(messages("long " * 40, "q", control=HOUR))
    assert table.holder(short, clock()) is None
    table.record(short, "a", clock())
    table.record(long, "b", clock())
    clock.advance(240)
    assert table.holder(short, clock()) == ("a", short.key)
    table.record(short, "a", clock())  # a hit refreshes it
    clock.advance(240)  # 480 s after the first, 240 after the last
    assert table.holder(short, clock()) == ("a", short.key)
    clock.advance(61)
    assert table.holder(short, clock()) is None  # past its TTL without a request
    assert table.holder(long, clock()) == ("b", long.key)  # an hour, not 5 minutes
    clock.advance(3600)
    assert table.holder(long, clock()) is None
    # Where the next request is answered, the key follows.
    table.record(short, "c", clock())
    assert table.holder(short, clock()) == ("c", short.key)
    # Bounded: the least recently routed keys leave first.
    small = IntentTable(capacity=2, ttl=300.0, ttl_extended=3600.0)
    keys = [_key(messages(f"prompt {i} " * 40, "q", control=EPHEMERAL)) for i in range(3)]
    for i, key in enumerate(keys):
        small.record(key, "a", now=float(i))
    assert len(small) == 2 and small.evicted_total == 1
    assert small.holder(keys[0], 3.0) is None and small.holder(keys[2], 3.0) == ("a", keys[2].key)
    with pytest.raises(ValueError):
        IntentTable(capacity=0, ttl=1.0, ttl_extended=1.0)
    with pytest.raises(ValueError):
        IntentTable(capacity=1, ttl=10.0, ttl_extended=1.0)


# -- the ranking, on a router with no traffic ---------------------------------------------------

THREE = [
    {"name": "a", "url": "http://127.0.0.1:9"},
    {"name": "b", "url": "http://127.0.0.1:9"},
    {"name": "c", "url": "http://127.0.0.1:9"},
]


def _router(clock: FakeClock, **routing: Any) -> tuple[Router, RegionSet]:
    config = Config.from_mapping(
        proxy_config(THREE, routing={"prefix_affinity": True, **routing}), environ={}
    )
    region_set = RegionSet(config, clock=clock)
    for region in region_set:
        region.endpoints[0].mark_up()
        for i in range(5):
            region.latency.observe(0.05, now=float(i))
    return Router(config, region_set, seed=1, clock=clock), region_set


def _ctx(
    config: Config, body: dict[str, Any], path: str = CHAT_PATH, tenant: str | None = None
) -> RequestContext:
    ctx = RequestContext(
        request_id="r",
        trace=trace_context(None),
        method="POST",
        target=path,
        headers=CIMultiDict({"content-type": "application/json"}),
        client_ip="127.0.0.1",
        started=time.monotonic(),
        route=config.route_for("POST", path),
    )
    ctx.body = orjson.dumps(body)
    ctx.body_read = True
    ctx.tenant = tenant
    return ctx


def _first(router: Router, ctx: RequestContext) -> Region:
    plan = router.route(ctx)
    first = plan.first
    assert first is not None
    return first


async def test_the_keys_region_ranks_first_until_load_or_health_say_otherwise() -> None:
    clock = FakeClock(10.0)
    router, regions = _router(clock, balance_abs_threshold=1000.0)
    try:
        a, b = regions.by_name["a"], regions.by_name["b"]
        ctx = _ctx(router.config, chat("hello", "k1"))
        plan = router.plan(ctx)
        assert plan is not None and plan.key is None and plan.intent is not None
        # Nothing held yet: the router's own choice.
        router.candidates(ctx, plan)
        assert plan.chosen is None
        router.routed(plan, b)
        for _ in range(30):
            plan = router.plan(ctx)
            assert plan is not None
            assert router.candidates(ctx, plan)[0] is b and plan.chosen is b
        assert b.affinity_hits_total == 0  # counted where a request is answered
        # The weights, as for a whole prefix: b keeps it while under 4 times the best score.
        b.in_flight = 2
        assert _first(router, ctx) is b
        b.in_flight = 4
        assert _first(router, ctx) is not b
        b.in_flight = 0
        # Unhealthy: filtered before affinity ranks anything.
        b.mark_down("test")
        for _ in range(10):
            assert _first(router, ctx) is not b
        b.mark_up()
        assert _first(router, ctx) is b
        # Another key, or no key: not held by b.
        other = _ctx(router.config, chat("hello", "k2"))
        other_plan = router.plan(other)
        assert other_plan is not None
        router.candidates(other, other_plan)
        assert other_plan.chosen is None and other_plan.matched == ()
        router.routed(other_plan, a)
        assert _first(router, other) is a and _first(router, ctx) is b
    finally:
        for region in regions:
            region.in_flight = 0
        await regions.close()


async def test_the_balance_guard_sets_the_key_aside() -> None:
    clock = FakeClock(10.0)
    router, regions = _router(clock, balance_abs_threshold=4, load_weight=0)
    try:
        a = regions.by_name["a"]
        ctx = _ctx(router.config, chat("hello", "k1"))
        plan = router.plan(ctx)
        assert plan is not None
        router.routed(plan, a)
        a.in_flight = 4
        plan = router.plan(ctx)
        assert plan is not None
        assert router.candidates(ctx, plan)[0] is a and not plan.balanced
        a.in_flight = 5  # too uneven: load alone routes
        for _ in range(10):
            plan = router.plan(ctx)
            assert plan is not None
            assert router.candidates(ctx, plan)[0] is not a
            assert plan.balanced and plan.chosen is None
    finally:
        for region in regions:
            region.in_flight = 0
        await regions.close()


async def test_tenants_scope_the_key_and_the_switch_turns_it_off() -> None:
    clock = FakeClock(10.0)
    router, regions = _router(clock)
    try:
        config = router.config
        acme = router.plan(_ctx(config, chat("hello", "k1"), tenant="acme"))
        globex = router.plan(_ctx(config, chat("hello", "k1"), tenant="globex"))
        assert acme is not None and acme.intent is not None
        assert globex is not None and globex.intent is not None
        assert acme.intent.key != globex.intent.key
        # Chat and Responses name the same cache with the same key.
        across = router.plan(_ctx(config, responses("hi", "k1"), RESPONSES_PATH, "acme"))
        assert across is not None and across.intent == acme.intent
        # Messages' breakpoints: a key without a prompt key.
        msgs = router.plan(
            _ctx(config, messages("policy " * 50, "q", control=EPHEMERAL), MESSAGES_PATH)
        )
        assert msgs is not None and msgs.intent is not None and msgs.key is None
    finally:
        await regions.close()
    off = Config.from_mapping(
        proxy_config(THREE, routing={"prefix_affinity": True, "prompt_cache_affinity": False}),
        environ={},
    )
    plan = Affinity(off.routing).plan(_ctx(off, chat("hello " * 100, "k1")))
    assert plan is not None and plan.intent is None and plan.key is not None
    with pytest.raises(ValueError):
        Config.from_mapping(
            proxy_config(
                THREE, routing={"prompt_cache_ttl": 600.0, "prompt_cache_ttl_extended": 300.0}
            ),
            environ={},
        )


# -- through the real proxy ------------------------------------------------------------------


async def _post(
    client: aiohttp.ClientSession,
    proxy: EdgeProxy,
    path: str,
    body: dict[str, Any],
    **headers: str,
) -> str:
    """The region that answered."""
    async with client.post(proxy.url + path, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["X-Edgeproxy-Region"]


def _hits(proxy: EdgeProxy) -> int:
    return sum(region.affinity_hits_total for region in proxy.regions)


async def test_requests_naming_one_prompt_cache_key_land_on_one_region(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    fakes = [await make_region(name) for name in ("r1", "r2", "r3")]
    proxy = await make_proxy(fakes, routing=STICKY)
    same: list[str] = []
    others: dict[str | None, set[str]] = {}
    async with aiohttp.ClientSession() as client:
        for i in range(100):
            if i % 2 == 0:
                # The same key, in either OpenAI API, whatever the prompt.
                body = (
                    chat(f"question {i}", "shared")
                    if i % 4 == 0
                    else responses(f"question {i}", "shared")
                )
                same.append(
                    await _post(client, proxy, CHAT_PATH if i % 4 == 0 else RESPONSES_PATH, body)
                )
            else:
                key = None if i % 3 == 0 else f"other-{i % 5}"
                region = await _post(client, proxy, CHAT_PATH, chat(f"question {i}", key))
                others.setdefault(key, set()).add(region)
    assert len(same) == 50 and len(set(same)) == 1
    # Each other key sticks to its region too.
    for key, seen in others.items():
        if key is not None:
            assert len(seen) == 1, key


async def test_cache_control_breakpoints_keep_their_prefix_on_one_region(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    fakes = [await make_region(name) for name in ("r1", "r2", "r3")]
    proxy = await make_proxy(fakes, routing=STICKY)
    policy_a, policy_b = "policy A. " * 60, "policy B. " * 60
    async with aiohttp.ClientSession() as client:
        seen: dict[str, set[str]] = {"a": set(), "b": set()}
        for i in range(25):
            # What follows the breakpoint changes every time: the key does not.
            for name, policy in (("a", policy_a), ("b", policy_b)):
                body = messages(policy, f"question {i}", control=EPHEMERAL)
                seen[name].add(await _post(client, proxy, MESSAGES_PATH, body))
        assert len(seen["a"]) == 1 and len(seen["b"]) == 1
        # 2 x 24 requests found their key held.
        assert _hits(proxy) == 48
        # A later turn, the breakpoint where it was: its key held, an affinity hit.
        later = messages(policy_a, "question 99", control=EPHEMERAL, history=["earlier"])
        assert await _post(client, proxy, MESSAGES_PATH, later) in seen["a"]
        assert _hits(proxy) == 49
        # A change before the breakpoint: another key, held nowhere, so no hit.
        changed = messages("policy A! " * 60, "question 1", control=EPHEMERAL)
        await _post(client, proxy, MESSAGES_PATH, changed)
        assert _hits(proxy) == 49
        # Without a breakpoint, the prompt's blocks key it, as before: the first request
        # finds no region holding them (breakpoints record no blocks), the second does.
        plain = messages(policy_a, "question 1")
        first = await _post(client, proxy, MESSAGES_PATH, plain)
        assert _hits(proxy) == 49
        assert await _post(client, proxy, MESSAGES_PATH, plain) == first
        assert _hits(proxy) == 50


class Tenants:
    """The tenant is the ``x-tenant`` header."""

    @hookimpl
    def edgeproxy_request_received(self, ctx: RequestContext) -> None:
        ctx.tenant = ctx.headers.get("x-tenant")


async def test_two_tenants_naming_one_key_are_not_bound_together(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    fakes = [await make_region(name) for name in ("r1", "r2", "r3")]
    proxy = await make_proxy(fakes, routing=STICKY, plugins=[Tenants()])
    async with aiohttp.ClientSession() as client:
        acme = await _post(client, proxy, CHAT_PATH, chat("q", "shared"), **{"x-tenant": "acme"})
        # Globex's first request finds acme's region unavailable: wherever it goes, its key
        # is its own from then on.
        proxy.regions.by_name[acme].mark_down("test")
        globex = await _post(
            client, proxy, CHAT_PATH, chat("q", "shared"), **{"x-tenant": "globex"}
        )
        assert globex != acme
        proxy.regions.by_name[acme].mark_up()
        hits = _hits(proxy)
        for i in range(10):
            for tenant, home in (("acme", acme), ("globex", globex)):
                body = chat(f"q{i}", "shared")
                assert await _post(client, proxy, CHAT_PATH, body, **{"x-tenant": tenant}) == home
        assert _hits(proxy) == hits + 20
        # Credentials scope a key when no tenant does.
        before = _hits(proxy)
        await _post(client, proxy, CHAT_PATH, chat("q", "shared"), Authorization="Bearer one")
        await _post(client, proxy, CHAT_PATH, chat("q", "shared"), Authorization="Bearer two")
        assert _hits(proxy) == before
        await _post(client, proxy, CHAT_PATH, chat("q", "shared"), Authorization="Bearer two")
        assert _hits(proxy) == before + 1


async def test_a_key_is_released_after_its_ttl_and_an_extended_one_held_an_hour(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    fakes = [await make_region(name) for name in ("r1", "r2", "r3")]
    clock = FakeClock.following(time.monotonic)
    proxy = await make_proxy(fakes, routing=STICKY, clock=clock)
    policy = "policy. " * 60
    short = messages(policy, "q", control=EPHEMERAL)
    extended = messages("long-lived " + policy, "q", control=HOUR)
    async with aiohttp.ClientSession() as client:
        home = await _post(client, proxy, CHAT_PATH, chat("q", "five-minutes"))
        await _post(client, proxy, MESSAGES_PATH, short)
        long_home = await _post(client, proxy, MESSAGES_PATH, extended)
        assert _hits(proxy) == 0
        # Each hit refreshes the key: 4 minutes, a hit, 4 minutes more, still held.
        clock.advance(240)
        assert await _post(client, proxy, CHAT_PATH, chat("q", "five-minutes")) == home
        clock.advance(240)
        assert await _post(client, proxy, CHAT_PATH, chat("q", "five-minutes")) == home
        assert _hits(proxy) == 2
        # Past 5 minutes without a request: the key holds no region (the request is no
        # affinity hit, wherever it goes), and a new home is taken where it was answered.
        clock.advance(301)
        await _post(client, proxy, CHAT_PATH, chat("q", "five-minutes"))
        await _post(client, proxy, MESSAGES_PATH, short)
        assert _hits(proxy) == 2
        # The extended TTL: still held 30 minutes after its one request.
        clock.advance(30 * 60 - 480 - 301)
        assert await _post(client, proxy, MESSAGES_PATH, extended) == long_home
        assert _hits(proxy) == 3
        clock.advance(3601)
        await _post(client, proxy, MESSAGES_PATH, extended)
        assert _hits(proxy) == 3


async def test_a_dead_keys_region_loses_it_to_the_others(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    fakes = [await make_region(name) for name in ("r1", "r2", "r3")]
    proxy = await make_proxy(
        fakes,
        routing=STICKY,
        health={"consecutive_failures": 1, "max_ejection_percent": 100},
    )
    by_name = {fake.name: fake for fake in fakes}
    async with aiohttp.ClientSession() as client:
        home = await _post(client, proxy, CHAT_PATH, chat("q", "k"))
        for i in range(5):
            assert await _post(client, proxy, CHAT_PATH, chat(f"q{i}", "k")) == home
        await by_name[home].kill()
        answered = [await _post(client, proxy, CHAT_PATH, chat(f"r{i}", "k")) for i in range(10)]
    # Every request answered elsewhere; the key now held where the first of them was.
    assert home not in answered and len(set(answered)) == 1
    assert not proxy.regions.by_name[home].up
