"""Learnt catalogs: a region that lists no models in its config is asked for its own
``GET /v1/models`` at start and in the background, and the router sends each model only
to the regions whose list names it; a model no region serves, once every list is known,
is a 404 at the edge.

Real proxies in front of real fake regions (hypercorn), each serving one model of its own
(``FakeRegion(model=...)``, listed by its /v1/models with vLLM's ``max_model_len``).
Refreshes are called directly, except where the background task itself is tested.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from edgeproxy import Config, EdgeProxy
from edgeproxy._core.config import ConfigError
from edgeproxy._protocol.modelnames import ModelListError, parse_model_list
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
MODELS = "/v1/models"

StartRegion = Callable[..., Awaitable[FakeRegion]]


@pytest.fixture
async def start_region() -> AsyncIterator[StartRegion]:
    """Fake regions serving a model of their own; stopped after."""
    started: list[FakeRegion] = []

    async def factory(name: str, model: str, **keys: Any) -> FakeRegion:
        region = FakeRegion(name=name, model=model, **keys)
        await region.start()
        started.append(region)
        return region

    yield factory
    for region in started:
        await region.stop()


def learning(region: FakeRegion, **keys: Any) -> dict[str, Any]:
    return {"name": region.name, "url": region.url, "learn_models": True, **keys}


async def chat(proxy: EdgeProxy, model: str) -> tuple[int, str, dict[str, Any]]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=body) as resp:
            return resp.status, resp.headers["X-Edgeproxy-Region"], await resp.json()


def asked(region: FakeRegion, path: str = CHAT) -> int:
    return region.requests_by_path.get(path, 0)


def models_status(proxy: EdgeProxy, name: str) -> dict[str, Any]:
    region = next(r for r in proxy.status()["regions"] if r["name"] == name)
    models: dict[str, Any] = region["models"]
    return models


async def test_a_learnt_catalog_sends_each_model_to_the_region_serving_it(
    start_region: StartRegion, make_proxy: ProxyFactory
) -> None:
    a = await start_region("a", "alpha", max_model_len=8192)
    b = await start_region("b", "beta")
    proxy = await make_proxy([learning(a), learning(b)])
    # Asked once each at start, before the first request.
    assert asked(a, MODELS) == asked(b, MODELS) == 1
    assert models_status(proxy, "a") | {"age_s": None} == {
        "learns": True,
        "known": True,
        "count": 1,
        "age_s": None,
        "fetches_total": 1,
        "failures_total": 0,
        "changes_total": 1,
        "last_error": None,
    }
    learned = proxy.regions.by_name["a"].learned
    assert learned.context_window("alpha") == 8192 and learned.context_window("beta") is None
    assert proxy.regions.by_name["b"].learned.context_window("beta") == 4096
    for _ in range(6):
        status, region, body = await chat(proxy, "alpha")
        assert (status, region, body["model"]) == (200, "a", "alpha")
        status, region, body = await chat(proxy, "beta")
        assert (status, region, body["model"]) == (200, "b", "beta")
    assert asked(a) == asked(b) == 6


async def test_an_unknown_model_is_a_404_in_the_apis_shape_without_asking_a_region(
    start_region: StartRegion, make_proxy: ProxyFactory
) -> None:
    a = await start_region("a", "alpha")
    b = await start_region("b", "beta")
    proxy = await make_proxy([learning(a), learning(b)])
    status, region, body = await chat(proxy, "gamma")
    assert (status, region) == (404, "none")
    assert body == {
        "error": {
            "message": "The model `gamma` does not exist or you do not have access to it. "
            "The models served here are `alpha` and `beta`; an operator can map another name "
            "to one of them with the region's model_aliases.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    message = {"model": "gamma", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + MESSAGES, json=message) as resp:
            assert resp.status == 404
            error = await resp.json()
    assert error["type"] == "error" and error["error"]["type"] == "not_found_error"
    assert "gamma" in error["error"]["message"]
    # The regions were asked for their lists, and for nothing else.
    for fake in (a, b):
        assert fake.requests_by_path == {MODELS: 1}
    assert all(r["requests_total"] == 0 for r in proxy.status()["regions"])


async def test_a_region_whose_list_fails_serves_every_model_until_it_comes(
    start_region: StartRegion, make_proxy: ProxyFactory
) -> None:
    a = await start_region("a", "alpha")
    b = await start_region("b", "beta")
    b.configure(fault="5xx", fault_status=503, fault_paths=[MODELS])
    proxy = await make_proxy([learning(a), learning(b)])
    status = models_status(proxy, "b")
    assert not status["known"] and status["count"] is None
    assert status["failures_total"] == 1 and status["last_error"] == "it answered 503"
    # Not known: b may serve anything, so no model is unknown; a still serves only alpha.
    status_code, region, _ = await chat(proxy, "gamma")
    assert (status_code, region) == (200, "b")
    status_code, region, _ = await chat(proxy, "beta")
    assert (status_code, region) == (200, "b")
    assert asked(a) == 0
    # Its list comes: now gamma is served by no region.
    b.configure(fault=None)
    learner = proxy.regions.learner
    assert await learner.refresh(proxy.regions.by_name["b"])
    status_code, region, body = await chat(proxy, "gamma")
    assert (status_code, region, body["error"]["code"]) == (404, "none", "model_not_found")
    assert asked(b) == 2


async def test_a_refresh_picks_up_a_change_and_a_failed_one_keeps_the_last_list(
    start_region: StartRegion, make_proxy: ProxyFactory
) -> None:
    a = await start_region("a", "alpha")
    b = await start_region("b", "beta")
    proxy = await make_proxy([learning(a), learning(b)])
    learner, region_a = proxy.regions.learner, proxy.regions.by_name["a"]
    version = learner.version
    a.model = "delta"
    # Not asked again yet: what it said at start stands.
    assert (await chat(proxy, "delta"))[0] == 404
    assert await learner.refresh(region_a)
    assert learner.version == version + 1
    status, region, _ = await chat(proxy, "delta")
    assert (status, region) == (200, "a")
    assert (await chat(proxy, "alpha"))[0] == 404
    # The same list again changes nothing; a failed fetch keeps the last list.
    assert await learner.refresh(region_a) and learner.version == version + 1
    a.configure(fault="5xx", fault_status=500, fault_paths=[MODELS])
    assert not await learner.refresh(region_a)
    assert region_a.learned.known and region_a.learned.serves("delta")
    status, region, _ = await chat(proxy, "delta")
    assert (status, region) == (200, "a")
    snap = models_status(proxy, "a")
    assert snap["fetches_total"] == 4 and snap["failures_total"] == 1
    assert snap["changes_total"] == 2 and snap["last_error"] == "it answered 500"


async def test_the_background_refresh_runs_and_stops_with_the_proxy(
    start_region: StartRegion, make_proxy: ProxyFactory
) -> None:
    a = await start_region("a", "alpha")
    proxy = await make_proxy([learning(a, models_refresh=0.05)])
    tasks = [t for t in asyncio.all_tasks() if t.get_name() == "learn-models:a"]
    assert len(tasks) == 1
    a.model = "delta"
    await eventually(lambda: proxy.regions.by_name["a"].learned.serves("delta"))
    assert not proxy.regions.by_name["a"].learned.serves("alpha")
    await proxy.stop(grace=1.0)
    assert tasks[0].done()


async def test_a_configured_list_and_learning_off_are_never_asked(
    start_region: StartRegion, make_proxy: ProxyFactory
) -> None:
    listed = await start_region("listed", "alpha")
    off = await start_region("off", "beta")
    learns = await start_region("learns", "gamma")
    proxy = await make_proxy(
        [
            {"name": "listed", "url": listed.url, "models": ["alpha"]},
            {"name": "off", "url": off.url, "learn_models": False},
            learning(learns),
        ]
    )
    assert asked(listed, MODELS) == asked(off, MODELS) == 0 and asked(learns, MODELS) == 1
    assert not models_status(proxy, "off")["learns"]
    # off serves every model: nothing is unknown; gamma goes to its region or to off.
    for model, where in (("alpha", {"listed", "off"}), ("gamma", {"learns", "off"})):
        for _ in range(4):
            status, region, _ = await chat(proxy, model)
            assert status == 200 and region in where, (model, region)
    assert (await chat(proxy, "zeta"))[1] == "off"
    # The proxy's own /v1/models (a region lists models) takes the learnt list as it is.
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + MODELS) as resp:
            listing = await resp.json()
    regions = {entry["id"]: entry["edgeproxy"]["regions"] for entry in listing["data"]}
    assert regions["alpha"] == ["listed"] and regions["gamma"] == ["learns"]
    assert asked(learns, MODELS) == 1


def test_parse_model_list_reads_openai_and_vllm_lists() -> None:
    vllm = {
        "object": "list",
        "data": [
            {"id": "m", "object": "model", "created": 1, "owned_by": "vllm", "root": "m",
             "max_model_len": 32768},
            {"id": "", "max_model_len": 4},
            {"id": "n", "max_model_len": "big", "created": True},
            "not a model",
        ],
    }  # fmt: skip
    assert parse_model_list(orjson.dumps(vllm)) == [
        {"id": "m", "created": 1, "owned_by": "vllm", "max_model_len": 32768},
        {"id": "n"},
    ]
    assert parse_model_list(b'{"data": []}') == []
    for bad in (b"nope", b"[]", b'{"data": {}}', b'{"object": "list"}'):
        with pytest.raises(ModelListError):
            parse_model_list(bad)


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        ({"models": ["m"], "learn_models": True}, "regions[0].learn_models: is true while"),
        ({"learn_models": False, "models_refresh": 5}, "regions[0].models_refresh: is set"),
        ({"models": ["m"], "models_refresh": 5}, "regions[0].models_refresh: is set"),
        ({"models_refresh": 0}, "regions[0].models_refresh: "),
        ({"models_refresh": float("inf")}, "regions[0].models_refresh: "),
        ({"learn_models": "sometimes"}, "regions[0].learn_models: "),
    ],
)
def test_the_learning_keys_are_validated(keys: dict[str, Any], error: str) -> None:
    region = {"name": "r", "url": "http://127.0.0.1:9", **keys}
    with pytest.raises(ConfigError) as caught:
        Config.from_mapping(proxy_config([region]), environ={})
    assert any(line.startswith(error) for line in caught.value.errors), caught.value.errors


def test_learning_is_on_for_a_region_listing_no_models() -> None:
    regions = [
        {"name": "a", "url": "http://127.0.0.1:9"},
        {"name": "b", "url": "http://127.0.0.1:9", "models": ["m"]},
        {"name": "c", "url": "http://127.0.0.1:9", "models_refresh": 5},
    ]
    config = Config.from_mapping({"regions": regions}, environ={})
    assert [r.learns_models for r in config.regions] == [True, False, True]
    assert [r.models_refresh_interval for r in config.regions] == [60.0, 60.0, 5.0]
    # What it dumps, it loads again (as a serve hands its config to its workers).
    again = Config.from_mapping(config.model_dump(mode="json"), environ={})
    assert [r.learns_models for r in again.regions] == [True, False, True]
