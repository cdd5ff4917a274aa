"""A Responses or Messages stream commits to its region at its first content event, not at
its first byte: a region that breaks after ``response.created`` or ``message_start`` and
before any token has sent the client nothing, and the next region answers the request.
The client, through its own SDK, sees one stream."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import ProxyFactory, RegionFactory

NEAR = {"lat": 1.29, "lon": 103.85}
FAR = {"lat": 35.68, "lon": 139.69}


async def two_regions(make_region: RegionFactory, make_proxy: ProxyFactory) -> Any:
    # near breaks every stream right after its opening events, before the first delta.
    near = await make_region("near", tokens=6, fault="reset", fault_after_tokens=0)
    far = await make_region("far", tokens=6)
    proxy = await make_proxy(
        [{"name": "near", "url": near.url, **NEAR}, {"name": "far", "url": far.url, **FAR}],
        routing={"retry_budget_min": 100},
    )
    return proxy, near, far


async def test_a_responses_stream_broken_before_its_first_delta_is_finished_elsewhere(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    import openai

    proxy, near, far = await two_regions(make_region, make_proxy)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-x", max_retries=0)
    try:
        async with client.responses.stream(model="fake-llm", input="hello there") as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
    finally:
        await client.close()
    assert kinds.count("response.created") == 1 and kinds.count("response.completed") == 1
    assert final.status == "completed" and final.output_text
    assert near.requests_total >= 1 and far.requests_total == 1


async def test_a_messages_stream_broken_after_message_start_is_finished_elsewhere(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    import anthropic

    proxy, near, far = await two_regions(make_region, make_proxy)
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0)
    try:
        async with client.messages.stream(
            model="fake-llm", max_tokens=16, messages=[{"role": "user", "content": "hello"}]
        ) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
    finally:
        await client.close()
    assert kinds.count("message_start") == 1 and kinds.count("message_stop") == 1
    assert final.content and final.stop_reason == "end_turn"
    assert near.requests_total >= 1 and far.requests_total == 1


@pytest.mark.parametrize("after", [2])
async def test_a_stream_broken_after_content_is_not_sent_twice(
    make_region: RegionFactory, make_proxy: ProxyFactory, after: int
) -> None:
    import openai

    near = await make_region("near", tokens=6, fault="reset", fault_after_tokens=after)
    far = await make_region("far", tokens=6)
    proxy = await make_proxy(
        [{"name": "near", "url": near.url, **NEAR}, {"name": "far", "url": far.url, **FAR}],
    )
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-x", max_retries=0)
    try:
        with pytest.raises(openai.APIError):
            async with client.responses.stream(model="fake-llm", input="hello") as stream:
                async for _ in stream:
                    pass
    finally:
        await client.close()
    # Tokens went out: committed to near, never repeated at far.
    assert far.requests_total == 0
