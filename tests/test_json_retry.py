"""A non-streamed JSON answer cut mid-body is retried whole on the next region.

The region resets after its response headers and half of its body; nothing
reached the client yet, so the proxy reads a non-streamed LLM answer to its
end inside the attempt and fails over, over HTTP/2 (h2c) and HTTP/1.1.
"""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from .conftest import ProxyFactory, RegionFactory

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6}


@pytest.mark.parametrize("http2", [True, False], ids=["h2c", "http1"])
async def test_a_reset_mid_body_is_retried_whole_on_the_next_region(
    make_region: RegionFactory, make_proxy: ProxyFactory, http2: bool
) -> None:
    broken = await make_region("broken", fault="reset", fault_after_tokens=1, fault_paths=[CHAT])
    good = await make_region("good")
    proxy = await make_proxy(
        [
            {"name": "broken", "url": broken.url, "http2": http2, "priority": 0},
            {"name": "good", "url": good.url, "http2": http2, "priority": 1},
        ]
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            raw = await resp.read()
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Region"] == "good"
            assert resp.headers["X-Edgeproxy-Attempts"] == "2"
    answer = orjson.loads(raw)  # whole: it parses
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] == 6
    assert broken.requests_by_path[CHAT] == 1 and good.requests_by_path[CHAT] == 1


async def test_a_reset_mid_body_with_no_other_region_is_an_error_not_a_truncated_200(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken = await make_region("broken", fault="reset", fault_after_tokens=1, fault_paths=[CHAT])
    proxy = await make_proxy([broken], routes=[{"name": "chat", "path": CHAT, "fallback": []}])
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            error = orjson.loads(await resp.read())
            assert resp.status == 502
    assert error["error"]["code"] == "bad_gateway"
