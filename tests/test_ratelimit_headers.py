"""Rate-limit headers in each API's own names: OpenAI's on chat and Responses, Anthropic's
on Messages, on 200s and 429s, read by the official SDKs; the stricter of a region's and
the proxy's; off by the route's key."""

from __future__ import annotations

import datetime
from typing import Any

import anthropic
import openai
import pytest

from edgeproxy import RequestContext, UpstreamReply, hookimpl
from edgeproxy._protocol.ratelimits import duration
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory

LIMITS = {
    "key_requests_per_second": 0.5,
    "key_burst": 3,
    "key_tokens_per_minute": 6000,
}
USER: Any = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def region(make_region: RegionFactory) -> FakeRegion:
    return await make_region("r1", tokens=4)


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-a", max_retries=0)


def test_openais_duration_format() -> None:
    assert duration(0.02) == "20ms"
    assert duration(1) == "1s"
    assert duration(1.5) == "1.5s"
    assert duration(360) == "6m0s"
    assert duration(3723) == "1h2m3s"


async def test_openai_headers_on_every_answer_and_the_429(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy([region], admission=LIMITS)
    async with sdk(proxy.url) as client:
        seen = []
        for _ in range(3):
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=USER)
            seen.append(raw.headers)
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model="m", messages=USER)
        with pytest.raises(openai.RateLimitError) as refused_responses:
            await client.responses.create(model="m", input="hi")
    first, last = seen[0], seen[-1]
    assert first["x-ratelimit-limit-requests"] == "3"
    assert [int(h["x-ratelimit-remaining-requests"]) for h in seen] == [2, 1, 0]
    assert first["x-ratelimit-reset-requests"].endswith("s")
    assert first["x-ratelimit-limit-tokens"] == "6000"
    assert int(last["x-ratelimit-remaining-tokens"]) <= 6000
    headers = refused.value.response.headers
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert int(headers["retry-after"]) >= 1
    # The Responses API is OpenAI's too: its 429 carries the same headers.
    assert refused_responses.value.response.headers["x-ratelimit-remaining-requests"] == "0"


async def test_anthropic_headers_on_messages(region: FakeRegion, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy([region], admission=LIMITS)
    async with anthropic.AsyncAnthropic(
        base_url=proxy.url, api_key="sk-ant", max_retries=0
    ) as client:
        raw = await client.messages.with_raw_response.create(model="m", max_tokens=8, messages=USER)
    headers = raw.headers
    assert headers["anthropic-ratelimit-requests-limit"] == "3"
    assert headers["anthropic-ratelimit-requests-remaining"] == "2"
    reset = datetime.datetime.fromisoformat(headers["anthropic-ratelimit-requests-reset"])
    assert reset.tzinfo is not None
    assert headers["anthropic-ratelimit-tokens-limit"] == "6000"
    assert "x-ratelimit-limit-requests" not in headers


class RegionLimits:
    """A region stating its own limits (through the public hook, as a provider would)."""

    def __init__(self, remaining: int) -> None:
        self.remaining = remaining

    @hookimpl
    def edgeproxy_upstream_response(
        self, request: Any, ctx: RequestContext, region: Any, reply: UpstreamReply
    ) -> None:
        reply.headers += [
            ("x-ratelimit-limit-requests", "10000"),
            ("x-ratelimit-remaining-requests", str(self.remaining)),
            ("x-ratelimit-reset-requests", "6ms"),
        ]


@pytest.mark.parametrize(("theirs", "expected"), [(1, "1"), (9000, "2")])
async def test_the_stricter_of_a_regions_limits_and_the_proxys(
    region: FakeRegion, make_proxy: ProxyFactory, theirs: int, expected: str
) -> None:
    proxy = await make_proxy([region], admission=LIMITS, plugins=[RegionLimits(theirs)])
    async with sdk(proxy.url) as client:
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=USER)
    assert raw.headers["x-ratelimit-remaining-requests"] == expected
    limit = "10000" if theirs == 1 else "3"
    assert raw.headers["x-ratelimit-limit-requests"] == limit
    assert len(raw.headers.get_list("x-ratelimit-remaining-requests")) == 1


async def test_a_route_that_keeps_its_limits_to_itself(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        [region],
        admission=LIMITS,
        routes=[{"name": "quiet", "path": "/", "rate_limit_headers": False}],
    )
    async with sdk(proxy.url) as client:
        for _ in range(3):
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=USER)
            assert "x-ratelimit-remaining-requests" not in raw.headers
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model="m", messages=USER)
    assert "x-ratelimit-remaining-requests" not in refused.value.response.headers
    assert "retry-after" in refused.value.response.headers


async def test_no_limit_no_headers(region: FakeRegion, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy([region])
    async with sdk(proxy.url) as client:
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=USER)
    assert not any(name.startswith("x-ratelimit") for name in raw.headers)
