"""The routing seam: eligibility filters, then ranking policies, into one RoutePlan.

Router.route is the entry point; Router.plan / candidates / routed are the same seam in
three steps. No network: the regions are built from a config without opening pools.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
from multidict import CIMultiDict

from edgeproxy import Config, ConfigError, ProxyError, RequestContext
from edgeproxy._protocol.headers import trace_context
from edgeproxy._protocol.prefix import prompt_key
from edgeproxy._routing.modelcatalog import ModelError
from edgeproxy._routing.routeplan import RoutePlan
from edgeproxy._routing.router import Router
from edgeproxy._upstream.regions import RegionSet

from .conftest import FakeClock, proxy_config

CHAT = "/v1/chat/completions"
# Near, medium and far from the test PoP (Singapore): the geo prior orders them before
# any traffic, far enough apart that the power of two choices never mixes them.
SIN = {"lat": 1.29, "lon": 103.85}
TOKYO = {"lat": 35.68, "lon": 139.69}
FRANKFURT = {"lat": 50.11, "lon": 8.68}
THREE = [
    {"name": "sin", "url": "http://127.0.0.1:9", "jurisdiction": "sg", **SIN},
    {"name": "tyo", "url": "http://127.0.0.1:9", "jurisdiction": "jp", **TOKYO},
    {
        "name": "fra",
        "url": "http://127.0.0.1:9",
        "jurisdiction": "eu",
        "models": ["m"],
        **FRANKFURT,
    },
]

RouterFactory = Callable[..., tuple[Router, RegionSet]]


@pytest.fixture
async def make_router() -> AsyncIterator[RouterFactory]:
    made: list[RegionSet] = []

    def factory(
        regions: list[dict[str, Any]] = THREE, clock: FakeClock | None = None, **sections: Any
    ) -> tuple[Router, RegionSet]:
        clock = clock or FakeClock(10.0)
        config = Config.from_mapping(proxy_config(regions, **sections), environ={})
        region_set = RegionSet(config, clock=clock)
        made.append(region_set)
        for region in region_set:
            region.endpoints[0].mark_up()
        return Router(config, region_set, seed=1, clock=clock), region_set

    yield factory
    for region_set in made:
        await region_set.close()


def _ctx(config: Config, body: dict[str, Any], country: str | None = None) -> RequestContext:
    ctx = RequestContext(
        request_id="r",
        trace=trace_context(None),
        method="POST",
        target=CHAT,
        headers=CIMultiDict({"content-type": "application/json"}),
        client_ip="127.0.0.1",
        started=time.monotonic(),
        route=config.route_for("POST", CHAT),
    )
    ctx.body = orjson.dumps(body)
    ctx.body_read = True
    ctx.client_country = country
    return ctx


def _names(plan: RoutePlan | list[Any]) -> list[str]:
    return [region.name for region in plan]


async def test_route_is_one_ranked_plan_and_candidates_its_regions(
    make_router: RouterFactory,
) -> None:
    router, regions = make_router()
    plan = router.route()
    assert isinstance(plan, RoutePlan)
    assert _names(plan) == _names(router.candidates()) == ["sin", "tyo", "fra"]
    assert plan.first is regions.by_name["sin"] and len(plan) == 3
    assert plan.affinity is None and not plan.panic
    # Continuation and hedging draw the next candidates from the same ranking.
    assert _names(plan.without(regions.by_name["sin"])) == ["tyo", "fra"]
    assert _names(plan.without("tyo", "fra")) == ["sin"]
    assert _names(plan.after("sin")) == ["tyo", "fra"]
    assert _names(plan.after(regions.by_name["fra"])) == []
    assert plan.after("elsewhere") is plan  # not in it: nothing to skip
    assert _names(plan) == ["sin", "tyo", "fra"]  # a plan never changes
    assert plan.without("sin", "tyo", "fra").first is None


async def test_excluded_regions_are_not_eligible_and_the_panic_keeps_the_rest(
    make_router: RouterFactory,
) -> None:
    router, regions = make_router()
    assert _names(router.route(exclude=["sin"])) == ["tyo", "fra"]
    assert _names(router.route(exclude=[regions.by_name["tyo"], "sin"])) == ["fra"]
    regions.by_name["fra"].mark_down("gone")
    regions.by_name["tyo"].mark_down("gone")
    plan = router.route(exclude=["sin"])
    # Nothing left is available: every region left is tried anyway, none excluded.
    assert plan.panic and _names(plan) == ["tyo", "fra"]
    assert _names(router.route(exclude=["sin", "tyo", "fra"])) == []


async def test_an_owner_alone_is_eligible_and_unavailable_is_a_503(
    make_router: RouterFactory,
) -> None:
    router, regions = make_router()
    assert _names(router.route(owner="fra")) == ["fra"]
    regions.by_name["fra"].mark_down("gone")
    # No other region holds its state (they would answer 404), and trying a region known
    # down is no answer: the request gets 503 owner_unavailable, with Retry-After.
    for exclude in ((), ("fra",)):
        with pytest.raises(ProxyError) as info:
            router.route(owner="fra", exclude=exclude)
        assert info.value.status == 503 and info.value.code == "owner_unavailable"
        assert int(info.value.headers["Retry-After"]) > 0


async def test_the_filters_keep_their_errors(make_router: RouterFactory) -> None:
    router, regions = make_router(geo={"residency": {"DE": ["eu"]}})
    config = router.config
    # The model catalog: only fra lists models, so "m" goes anywhere and "x" only to the
    # others; a model nobody serves is a 404, before residency is looked at.
    assert _names(router.route(_ctx(config, {"model": "x"}))) == ["sin", "tyo"]
    listing, _ = make_router([{**r, "models": ["m"]} for r in THREE], geo=router.config.geo)
    with pytest.raises(ModelError) as info:
        listing.route(_ctx(config, {"model": "x"}, country="DE"))
    assert info.value.status == 404
    # Residency: a German client only ever sees fra, and gets the rule's 503 when fra is
    # unavailable, never the panic's cross-border guess.
    german = _ctx(config, {"model": "m"}, country="DE")
    assert _names(router.route(german)) == ["fra"]
    regions.by_name["fra"].mark_down("gone")
    with pytest.raises(ProxyError) as refused:
        router.route(german)
    assert refused.value.status == 503 and refused.value.code == "residency"
    # A residency rule bounds an owner too.
    regions.by_name["fra"].mark_up()
    with pytest.raises(ProxyError):
        router.route(german, owner="sin")
    # A request of nobody in particular is under no rule.
    assert _names(router.route(owner="sin")) == ["sin"]


async def test_the_plan_carries_the_affinity_plan_and_records_where_it_was_answered(
    make_router: RouterFactory,
) -> None:
    clock = FakeClock(10.0)
    twins = [{"name": "a", "url": "http://127.0.0.1:9"}, {"name": "b", "url": "http://127.0.0.1:9"}]
    router, regions = make_router(twins, clock, routing={"prefix_affinity": True})
    for region in regions:
        for i in range(5):
            region.latency.observe(0.05, now=float(i))
    body = {"messages": [{"role": "user", "content": "x" * 2000}]}
    ctx = _ctx(router.config, body)
    plan = router.route(ctx)
    assert plan.affinity is not None and plan.affinity.chosen is None
    b = regions.by_name["b"]
    plan.without("a").routed(b)  # the plans drawn from it share its affinity plan
    key = prompt_key(body, chat=True)
    assert key is not None
    assert b.prefix_index.match(key.blocks, clock()) == len(key.blocks)
    assert b.affinity_requests_total == 1
    # The next request with that prompt goes to b, because affinity chose it.
    for _ in range(10):
        again = router.route(ctx)
        assert again.first is b and again.affinity is not None and again.affinity.chosen is b
    # The older three steps: the same seam.
    old = router.plan(ctx)
    assert old is not None and router.candidates(ctx, old)[0] is b and old.chosen is b
    router.routed(old, b)
    router.routed(again, b)
    assert b.affinity_requests_total == 3 and b.affinity_hits_total == 2


async def test_rank_orders_the_policies(make_router: RouterFactory) -> None:
    """With affinity before the load tiers, a prefix match beats a queue; after them (the
    default), the queue wins."""
    twins = [{"name": "a", "url": "http://127.0.0.1:9"}, {"name": "b", "url": "http://127.0.0.1:9"}]
    body = {"messages": [{"role": "user", "content": "x" * 2000}]}
    firsts: dict[str, str] = {}
    for rank in (None, ["affinity", "reported_load", "latency"]):
        clock = FakeClock(10.0)
        routing: dict[str, Any] = {"prefix_affinity": True, "balance_abs_threshold": 1000}
        if rank is not None:
            routing["rank"] = rank
        router, regions = make_router(twins, clock, routing=routing)
        assert router.config.routing.rank == (rank or ["reported_load", "affinity", "latency"])
        a = regions.by_name["a"]
        for region in regions:
            for i in range(5):
                region.latency.observe(0.05, now=float(i))
        key = prompt_key(body, chat=True)
        assert key is not None
        a.prefix_index.record(key.blocks, clock())
        # 8 waiting: two load tiers down, and 3 times slower to the affinity score (3 + 4/3 > 4).
        a.reported.observe_header("TEXT named_metrics.num_requests_waiting=8.0", clock())
        first = router.route(_ctx(router.config, body)).first
        assert first is not None
        firsts[str(rank)] = first.name
    assert firsts == {"None": "b", str(["affinity", "reported_load", "latency"]): "a"}


@pytest.mark.parametrize(
    ("routing", "message"),
    [
        ({"rank": ["latency", "reported_load"]}, "must end with 'latency'"),
        ({"rank": ["affinity", "affinity", "latency"]}, "listed twice"),
        ({"rank": []}, "must end with 'latency'"),
        ({"rank": ["geo", "latency"]}, "rank"),
        ({"prefix_affinity": True, "rank": ["latency"]}, "needs 'affinity' in rank"),
        ({"load_tier_queue": 0}, "load_tier_queue"),
    ],
)
def test_rank_and_load_tier_queue_are_checked(routing: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_mapping(proxy_config(THREE, routing=routing), environ={})
