"""Requests of Anthropic's Messages API get the proxy's own errors in Anthropic's shape, and
a stream cut after it started ends with Anthropic's ``event: error``: the anthropic SDK
raises its own API error, never a decoding error or a silent end."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects import MESSAGES as MESSAGES_DIALECT

from .conftest import ProxyFactory, RegionFactory

MESSAGES = "/v1/messages"
BODY = {"model": "fake-llm", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (429, "rate_limit_error"), (502, "api_error"),
     (503, "overloaded_error"), (504, "api_error"), (404, "not_found_error")],
)  # fmt: skip
def test_the_anthropic_error_types_by_status(status: int, kind: str) -> None:
    body = orjson.loads(MESSAGES_DIALECT.error_body(ProxyError(status, "x", "why")))
    assert body == {"type": "error", "error": {"type": kind, "message": "why"}}


async def test_the_proxys_own_errors_on_messages_have_anthropics_shape(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region], admission={"key_requests_per_second": 0.001})
    async with aiohttp.ClientSession() as client:
        # A body that is not JSON: 400 from admission, before any region.
        async with client.post(
            proxy.url + MESSAGES, data=b"{nope", headers={"content-type": "application/json"}
        ) as resp:
            assert resp.status == 400
            body = await resp.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        # The key's rate limit: the first passes, the second is refused.
        headers = {"x-api-key": "sk-ant-1"}
        async with client.post(proxy.url + MESSAGES, json=BODY, headers=headers) as resp:
            assert resp.status == 200
        async with client.post(proxy.url + MESSAGES, json=BODY, headers=headers) as resp:
            assert resp.status == 429 and "Retry-After" in resp.headers
            assert (await resp.json())["error"]["type"] == "rate_limit_error"
        # Chat keeps OpenAI's shape.
        async with client.post(
            proxy.url + "/v1/chat/completions", data=b"{nope",
            headers={"content-type": "application/json"},
        ) as resp:  # fmt: skip
            assert resp.status == 400 and "code" in (await resp.json())["error"]


async def test_a_cut_messages_stream_ends_in_an_error_the_sdk_raises(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    import anthropic

    region = await make_region("r1", tokens=12, fault="reset", fault_after_tokens=3)
    proxy = await make_proxy([region])
    async with aiohttp.ClientSession() as client:
        raw = b""
        async with client.post(proxy.url + MESSAGES, json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            # The body is then cut (no clean end): what came before it is what counts.
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in resp.content.iter_any():
                    raw += chunk
    events = raw.split(b"\n\n")
    assert b"event: content_block_delta" in raw
    cut = next(e for e in events if e.startswith(b"event: error"))
    error = orjson.loads(cut.split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    sdk = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0)
    try:
        with pytest.raises(anthropic.APIError):
            async with sdk.messages.stream(**BODY) as stream:  # type: ignore[arg-type]
                async for _ in stream:
                    pass
    finally:
        await sdk.close()
