"""The ``lighter`` rung: a request whose model no region can serve now goes to a lighter
model in the regions, routed like any request for it, marked, counted for the model that
answered, and never cached as the requested model's answer.

Two fake regions: one serving ``llama-70b`` (made saturated or broken), one ``llama-8b``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from edgeproxy import EdgeProxy
from edgeproxy.testing import FakeRegion

from .conftest import CustomRegion, ProxyFactory, RegionFactory, eventually

BIG, SMALL = "llama-70b", "llama-8b"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"


def route(**extra: Any) -> dict[str, Any]:
    return {
        "name": "llm",
        "path": "/v1/",
        "fallback": ["lighter", "stale"],
        "fallback_models": {BIG: [SMALL]},
        **extra,
    }


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def regions(make_region: RegionFactory, **big: Any) -> tuple[FakeRegion, FakeRegion]:
    """The big region's faults are on its LLM endpoints: it still lists its model, so the
    proxy knows the small region does not serve it."""
    if big:
        big.setdefault("fault_paths", ("/v1/chat/", "/v1/responses"))
    return await make_region("big", model=BIG, **big), await make_region("small", model=SMALL)


async def proxy_for(
    make_proxy: ProxyFactory, big: FakeRegion, small: FakeRegion, **extra: Any
) -> EdgeProxy:
    # Each region's models learnt from its /v1/models (and its context window, if given).
    tables = [{"name": r.name, "url": r.url, "learn_models": True} for r in (big, small)]
    return await make_proxy(tables, routes=[route(**extra)])


async def chat(
    client: aiohttp.ClientSession, proxy: EdgeProxy, model: str = BIG, **extra: Any
) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], **extra}
    async with client.post(proxy.url + CHAT, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json()


def calls(region: FakeRegion, path: str = CHAT) -> int:
    return region.counters().requests_by_path.get(path, 0)


def fallback_status(proxy: EdgeProxy) -> dict[str, Any]:
    out = proxy.status()["fallback"]
    assert isinstance(out, dict)
    return out


@pytest.mark.parametrize(
    ("why", "fault"),
    [
        ("saturated", {"fault": "5xx", "fault_status": 503}),
        ("failed", {"fault": "reset", "fault_after_tokens": 0}),
    ],
)
async def test_a_saturated_or_failed_big_model_degrades_to_the_lighter_one(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    client: aiohttp.ClientSession,
    why: str,
    fault: dict[str, Any],
) -> None:
    big, small = await regions(make_region, **fault)
    proxy = await proxy_for(make_proxy, big, small)
    status, headers, answer = await chat(client, proxy)
    assert status == 200, why
    assert headers["X-Edgeproxy-Degraded"] == "lighter-model"
    assert headers["X-Edgeproxy-Model"] == SMALL
    assert headers["X-Edgeproxy-Region"] == "small"
    assert answer["model"] == SMALL  # the answer says what answered
    assert calls(small) == 1
    status_ = fallback_status(proxy)
    assert status_["served"]["lighter-model"] == 1
    assert status_["lighter"] == [{"name": f"{BIG}>{SMALL}", "answers_total": 1}]
    # Its tokens are counted for the model that answered.
    tokens = sum(answer["usage"][k] for k in ("prompt_tokens", "completion_tokens"))
    await eventually(lambda: fallback_status(proxy)["lighter_usage"] != [])
    assert fallback_status(proxy)["lighter_usage"] == [{"name": SMALL, "tokens_total": tokens}]
    async with client.get(proxy.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert f'edgeproxy_fallback_lighter_answers_total{{name="{BIG}>{SMALL}"}} 1.0' in text
    assert f'edgeproxy_fallback_lighter_usage_tokens_total{{name="{SMALL}"}} {tokens}.0' in text


async def test_a_streamed_request_degrades_too(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    big, small = await regions(make_region, fault="5xx", fault_status=503)
    proxy = await proxy_for(make_proxy, big, small)
    body = {"model": BIG, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with client.post(proxy.url + CHAT, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["X-Edgeproxy-Degraded"] == "lighter-model"
        text = await resp.text()
    assert f'"model":"{SMALL}"' in text.replace(" ", "") and "data: [DONE]" in text


async def test_a_request_referring_to_stored_state_is_never_degraded(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    big, small = await regions(make_region)
    proxy = await proxy_for(make_proxy, big, small)
    async with client.post(proxy.url + RESPONSES, json={"model": BIG, "input": "hi"}) as resp:
        assert resp.status == 200
        first = await resp.json()
    big.configure(fault="5xx", fault_status=503, fault_paths=("/v1/responses",))
    body = {"model": BIG, "input": "and then?", "previous_response_id": first["id"]}
    async with client.post(proxy.url + RESPONSES, json=body) as resp:
        assert resp.status == 503
        assert "X-Edgeproxy-Degraded" not in resp.headers
    assert calls(small, RESPONSES) == 0
    assert fallback_status(proxy)["served"].get("lighter-model", 0) == 0


async def test_the_lighter_rung_itself_refuses_stored_state(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    """Even where the ladder runs, a request referring to stored state is not sent on."""
    from multidict import CIMultiDict

    from edgeproxy._core.context import start_context
    from edgeproxy._core.errors import ProxyError
    from edgeproxy._protocol.headers import trace_context

    big, small = await regions(make_region, fault="5xx", fault_status=503)
    proxy = await proxy_for(make_proxy, big, small)
    obtainer = proxy.pipeline.obtainer
    body = {"model": BIG, "input": "and then?", "conversation": "conv_1"}
    route_ = proxy.config.route_for("POST", RESPONSES)
    ctx = start_context(
        "id", trace_context(None), "POST", RESPONSES, CIMultiDict(), None, 0.0, route_,
        "http", "1.1", "proxy",
    )  # fmt: skip
    ctx.set_json(body)
    error = ProxyError(503, "service_unavailable", "saturated")
    assert await obtainer._lighter(None, ctx, error) is None  # type: ignore[arg-type]
    assert fallback_status(proxy)["lighter_skipped"] == {"stateful": 1}


async def test_a_request_too_long_for_the_lighter_model_skips_to_the_next_rung(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    big, small = await regions(make_region, fault="5xx", fault_status=503)
    proxy = await proxy_for(make_proxy, big, small, context_windows={SMALL: 64})
    status, headers, _ = await chat(client, proxy, max_tokens=100)
    # No stale entry either: the region's own error, not degraded.
    assert status == 503 and "X-Edgeproxy-Degraded" not in headers
    assert calls(small) == 0
    assert fallback_status(proxy)["lighter_skipped"] == {"too_long": 1}
    # A short one fits.
    status, headers, _ = await chat(client, proxy, max_tokens=20)
    assert status == 200 and headers["X-Edgeproxy-Model"] == SMALL


async def test_the_window_a_region_reports_is_used(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    big = await make_region(
        "big", model=BIG, fault="5xx", fault_status=503, fault_paths=("/v1/chat/",)
    )
    # Its /v1/models reports a window of 64 tokens, as vLLM's max_model_len.
    async with FakeRegion(name="small", model=SMALL, max_model_len=64) as small:
        proxy = await proxy_for(make_proxy, big, small)
        status, _, _ = await chat(client, proxy, max_tokens=100)
        assert status == 503 and calls(small) == 0
        status, headers, _ = await chat(client, proxy, max_tokens=20)
        assert status == 200 and headers["X-Edgeproxy-Model"] == SMALL


async def test_a_lighter_answer_is_never_a_cache_hit_for_the_requested_model(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    big, small = await regions(make_region, fault="5xx", fault_status=503)
    proxy = await proxy_for(make_proxy, big, small)
    status, headers, _ = await chat(client, proxy, temperature=0)
    assert status == 200 and headers["X-Edgeproxy-Model"] == SMALL
    await eventually(lambda: proxy.status()["cache"]["stores"] == 1)
    # Stored under the lighter model: the same request for it is a hit...
    status, headers, answer = await chat(client, proxy, SMALL, temperature=0)
    assert headers["X-Edgeproxy-Cache"] == "HIT" and answer["model"] == SMALL
    # ...and the big model, back, answers its own request: never the lighter answer.
    big.configure(fault=None)
    status, headers, answer = await chat(client, proxy, temperature=0)
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
    assert answer["model"] == BIG and "X-Edgeproxy-Degraded" not in headers


def test_lighter_without_fallback_models_is_a_config_error() -> None:
    from edgeproxy import ConfigError
    from edgeproxy._core.config import config_from_mapping

    with pytest.raises(ConfigError, match="names no lighter model"):
        config_from_mapping(
            {
                "regions": [{"name": "r", "url": "http://127.0.0.1:1"}],
                "routes": [{"name": "llm", "path": "/v1/", "fallback": ["lighter"]}],
            }
        )


async def test_a_deep_reported_queue_sends_low_priority_requests_to_the_lighter_model_first(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    from edgeproxy._protocol.loadmetrics import LoadReport

    big, small = await regions(make_region)
    proxy = await proxy_for(make_proxy, big, small, lighter_when_waiting=10, lighter_max_priority=0)
    region = proxy.regions.by_name["big"]
    now = proxy.regions.clock()
    region.reported.accept(LoadReport(num_requests_waiting=5.0), now, "test")
    status, headers, _ = await chat(client, proxy)
    assert status == 200 and "X-Edgeproxy-Degraded" not in headers  # not deep enough
    region.reported.accept(LoadReport(num_requests_waiting=40.0), proxy.regions.clock(), "test")
    status, headers, answer = await chat(client, proxy)
    assert headers["X-Edgeproxy-Degraded"] == "lighter-model" and answer["model"] == SMALL
    assert calls(big) == 1  # the big region was not tried
    # An interactive request still waits for the big model.
    body = {"model": BIG, "messages": [{"role": "user", "content": "hello"}]}
    async with client.post(proxy.url + CHAT, json=body, headers={"X-Priority": "10"}) as resp:
        assert resp.status == 200 and "X-Edgeproxy-Degraded" not in resp.headers
    assert calls(big) == 2


async def test_a_deadline_passed_with_no_first_byte_degrades_to_the_lighter_model(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    big, small = await regions(make_region, fault="stall")
    proxy = await proxy_for(make_proxy, big, small, deadline=0.5)
    status, headers, answer = await chat(client, proxy)
    assert status == 200 and headers["X-Edgeproxy-Degraded"] == "lighter-model"
    assert answer["model"] == SMALL


async def test_a_messages_answer_s_tokens_are_counted_once(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    # Its usage says input_tokens and output_tokens, and the relay adds chat's fields.
    big, small = await regions(make_region, fault="5xx", fault_status=503)
    big.configure(fault_paths=("/v1/messages",))
    proxy = await proxy_for(make_proxy, big, small)
    body = {"model": BIG, "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "k"}
    async with client.post(proxy.url + "/v1/messages", json=body, headers=headers) as resp:
        assert resp.status == 200 and resp.headers["X-Edgeproxy-Model"] == SMALL
        usage = (await resp.json())["usage"]
    counted = usage["input_tokens"] + usage["output_tokens"]
    await eventually(lambda: fallback_status(proxy)["lighter_usage"] != [])
    assert fallback_status(proxy)["lighter_usage"] == [{"name": SMALL, "tokens_total": counted}]


async def test_a_region_cannot_claim_a_degraded_answer_or_another_model(
    custom_region: CustomRegion, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    async def chat_answer(request: web.Request) -> web.Response:
        await request.read()
        spoofed = {"X-Edgeproxy-Degraded": "lighter-model", "X-Edgeproxy-Model": "gpt-9"}
        return web.json_response({"object": "chat.completion", "choices": []}, headers=spoofed)

    app = web.Application()
    app.router.add_post(CHAT, chat_answer)
    url = await custom_region(app)
    proxy = await make_proxy([{"name": "r", "url": url, "http2": False}])
    status, headers, _ = await chat(client, proxy)
    assert status == 200 and headers["X-Edgeproxy-Region"] == "r"
    assert "X-Edgeproxy-Degraded" not in headers and "X-Edgeproxy-Model" not in headers
