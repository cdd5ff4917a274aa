"""What a region's response headers may set on the client's answer.

Every ``X-Edgeproxy-*`` name is the proxy's: a region's are dropped, and the proxy adds its
own after the filter. Headers a browser keeps as policy for the proxy's whole origin
(``Set-Cookie``, HSTS, ``Alt-Svc``...) and the region's load reports pass only on a route
that lists them in ``pass_response_headers``. One filter covers every way an answer leaves:
the aiohttp listener, the HTTP/2 listener, the ASGI application and the cache.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from edgeproxy import Config, ConfigError, EdgeProxy
from edgeproxy._core.config.routes import PASSABLE_RESPONSE_HEADERS
from edgeproxy._protocol.headers import strip_hop_by_hop
from edgeproxy._upstream.reported import LOAD_HEADER

from .conftest import CustomRegion, ProxyFactory, eventually, proxy_config
from .test_asgi import served

CHAT = "/v1/chat/completions"
# Deterministic, so cacheable.
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "temperature": 0}
H2C = {"http2": True, "h2c": True}

# What a hostile or careless region sends: the proxy's own names, and origin policy.
SPOOFED = {
    "X-Edgeproxy-Region": "elsewhere",
    "X-Edgeproxy-Cache": "STALE-FROM-REGION",
    "X-Edgeproxy-Cache-Key": "someone-elses-entry",
    "X-Edgeproxy-Semantic-Similarity": "1.0000",
    "X-Edgeproxy-Warning": "the proxy is compromised",
    "X-Edgeproxy-Attempts": "7",
    "X-Edgeproxy-Prompt-Truncated": "true",
    "X-Edgeproxy-Degraded": "local-model",
    "X-Edgeproxy-Model": "gpt-9",
    "X-Request-Id": "the-regions-own-id",
}
POLICY = {
    "Set-Cookie": "session=stolen; Path=/; HttpOnly",
    "Strict-Transport-Security": "max-age=0",
    "Alt-Svc": 'h3=":443"; ma=86400',
    "Clear-Site-Data": '"cookies", "storage"',
    "NEL": '{"report_to": "region", "max_age": 31536000}',
    "Report-To": '{"group": "region", "endpoints": [{"url": "https://region.example/r"}]}',
    "endpoint-load-metrics": "TEXT named_metrics.kv_cache_usage_perc=0.9",
    "endpoint-load-metrics-bin": "AAAA",
}
# An ordinary header of the region's, which every answer keeps.
KEPT = {"X-Region-Note": "kept", "openai-processing-ms": "12"}


async def hostile_region(custom_region: CustomRegion) -> dict[str, object]:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        headers = {**SPOOFED, **POLICY, **KEPT}
        return web.json_response({"object": "chat.completion", "choices": []}, headers=headers)

    app = web.Application()
    app.router.add_post(CHAT, answer)
    return {"name": "r", "url": await custom_region(app), "http2": False}


def assert_filtered(
    headers: Any, *, passed: frozenset[str] = frozenset(), region: str = "r"
) -> None:
    """``headers`` (a case-insensitive mapping of the client's answer) carry none of what the
    region may not set, the region's ordinary headers, and the proxy's own names."""
    for name in SPOOFED:
        values = headers.getall(name, []) if hasattr(headers, "getall") else headers.get_list(name)
        assert SPOOFED[name] not in values, name
    for name, value in POLICY.items():
        if name.lower() in passed:
            assert headers[name] == value, name
        else:
            assert name not in headers, name
    for name, value in KEPT.items():
        assert headers[name] == value, name
    assert headers["X-Edgeproxy-Region"] == region
    assert "X-Edgeproxy-Attempts" not in headers and "X-Edgeproxy-Warning" not in headers
    assert len(headers["X-Request-Id"]) == 32  # the proxy's id, not the region's


async def test_a_region_sets_none_of_the_proxys_headers_nor_origin_policy(
    custom_region: CustomRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy([await hostile_region(custom_region)], cache={"xfetch_beta": 0.0})
    async with aiohttp.ClientSession() as client:
        for expected in ("MISS", "HIT"):
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.status == 200
                assert_filtered(resp.headers, region="r" if expected == "MISS" else "none")
                # The cache's own names are the cache's: its key, never the region's.
                assert resp.headers.getall("X-Edgeproxy-Cache") == [expected]
                assert resp.headers["X-Edgeproxy-Cache-Key"] != "someone-elses-entry"
            # The HIT is the stored entry's headers: what the cache keeps was filtered.
            await eventually(lambda: proxy.status()["cache"]["stores"] == 1)


async def test_the_http2_listener_gets_the_filtered_headers(
    custom_region: CustomRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy([await hostile_region(custom_region)], server=H2C)
    for http2 in (True, False):
        async with httpx.AsyncClient(http1=not http2, http2=http2) as client:
            resp = await client.post(proxy.url + CHAT, json={**BODY, "temperature": 1})
        assert resp.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        assert_filtered(resp.headers)


async def test_the_asgi_application_gets_the_filtered_headers(
    custom_region: CustomRegion,
) -> None:
    region = await hostile_region(custom_region)
    proxy = EdgeProxy(Config.from_mapping(proxy_config([region]), environ={}))
    async with served(proxy.asgi) as url, aiohttp.ClientSession() as client:
        async with client.post(url + CHAT, json={**BODY, "temperature": 1}) as resp:
            assert resp.status == 200
            assert_filtered(resp.headers)


async def test_a_route_passes_the_policy_headers_it_lists_and_no_more(
    custom_region: CustomRegion, make_proxy: ProxyFactory
) -> None:
    passed = frozenset({"set-cookie", "alt-svc", "endpoint-load-metrics"})
    proxy = await make_proxy(
        [await hostile_region(custom_region)],
        cache={"xfetch_beta": 0.0},
        routes=[{"name": "chat", "path": CHAT, "pass_response_headers": ["Set-Cookie", *passed]}],
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json={**BODY, "temperature": 1}) as resp:
            assert_filtered(resp.headers, passed=passed)
        # A cookie is one client's: the cache stores the answer, never the cookie.
        for expected in ("MISS", "HIT"):
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.headers["X-Edgeproxy-Cache"] == expected
                assert ("Set-Cookie" in resp.headers) is (expected == "MISS")
            await eventually(lambda: proxy.status()["cache"]["stores"] == 1)


def test_the_filter_in_one_pass_keeps_only_what_may_pass() -> None:
    sent = [*SPOOFED.items(), *POLICY.items(), *KEPT.items(), ("Connection", "X-Region-Note")]
    assert strip_hop_by_hop(sent) == [("openai-processing-ms", "12")]
    kept = strip_hop_by_hop(sent, passed=["nel", "set-cookie"])
    assert kept == [
        ("Set-Cookie", POLICY["Set-Cookie"]),
        ("NEL", POLICY["NEL"]),
        ("openai-processing-ms", "12"),
    ]


@pytest.mark.parametrize(
    "name", ["x-edgeproxy-region", "connection", "authorization", "server", "set-cookies"]
)
def test_a_route_cannot_pass_a_header_that_never_passes(name: str) -> None:
    data = proxy_config([{"name": "r", "url": "http://127.0.0.1:1"}])
    data["routes"] = [{"name": "chat", "path": CHAT, "pass_response_headers": [name]}]
    with pytest.raises(ConfigError, match="pass_response_headers"):
        Config.from_mapping(data, environ={})


def test_the_load_report_the_regions_send_is_a_passable_header() -> None:
    assert LOAD_HEADER in PASSABLE_RESPONSE_HEADERS
