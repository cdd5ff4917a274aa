"""Cached input tokens counted apart: read from each API's usage (chat's
``prompt_tokens_details``, the Responses API's ``input_tokens_details``, Anthropic's
``cache_read_input_tokens`` and ``cache_creation_input_tokens``), in Prometheus, the
access log and each region's prompt-cache hit ratio in ``/status``; and charged against
tokens-per-minute limits at ``cached_token_weight``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from edgeproxy import EdgeProxy
from edgeproxy._protocol.dialects import CHAT, MESSAGES, RESPONSES

from .conftest import ProxyFactory, eventually

CHAT_USAGE = {
    "prompt_tokens": 100,
    "completion_tokens": 5,
    "total_tokens": 105,
    "prompt_tokens_details": {"cached_tokens": 80},
}
RESPONSES_USAGE = {
    "input_tokens": 100,
    "output_tokens": 5,
    "total_tokens": 105,
    "input_tokens_details": {"cached_tokens": 60},
}
MESSAGES_USAGE = {
    "input_tokens": 10,
    "output_tokens": 5,
    "cache_read_input_tokens": 70,
    "cache_creation_input_tokens": 20,
}


def test_each_apis_cached_tokens_are_read() -> None:
    chat = CHAT.counted(CHAT_USAGE)
    assert chat["cached_tokens"] == 80 and chat["prompt_tokens"] == 100
    responses = RESPONSES.counted(RESPONSES_USAGE)
    assert responses["cached_tokens"] == 60 and responses["prompt_tokens"] == 100
    messages = MESSAGES.counted(MESSAGES_USAGE)
    # Anthropic counts reads and writes apart from input_tokens: the prompt is all three.
    assert messages["prompt_tokens"] == 100
    assert messages["cached_tokens"] == 70 and messages["cache_write_tokens"] == 20
    assert "cached_tokens" not in CHAT.counted({"prompt_tokens": 3, "completion_tokens": 1})


@pytest.fixture
async def region() -> AsyncIterator[str]:
    """A region answering each API with a usage that reports cached tokens."""

    async def answer(request: web.Request) -> web.Response:
        path = request.path
        if path.endswith("/chat/completions"):
            body: dict[str, Any] = {
                "id": "c1",
                "object": "chat.completion",
                "created": 1,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": CHAT_USAGE,
            }
        elif path.endswith("/responses"):
            body = {
                "id": "resp_1",
                "object": "response",
                "created_at": 1,
                "status": "completed",
                "model": "m",
                "output": [],
                "usage": RESPONSES_USAGE,
            }
        else:
            body = {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "m",
                "content": [{"type": "text", "text": "ok"}],
                "stop_reason": "end_turn",
                "usage": MESSAGES_USAGE,
            }
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert isinstance(server, asyncio.base_events.Server)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    await runner.cleanup()


REQUESTS = [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "m", "input": "hi", "store": False}),
    (
        "/v1/messages",
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    ),
]


async def send_all(proxy: EdgeProxy) -> None:
    async with aiohttp.ClientSession() as http:
        for path, body in REQUESTS:
            async with http.post(proxy.url + path, json=body) as response:
                assert response.status == 200, await response.text()


async def test_cached_tokens_in_metrics_access_log_and_the_regions_hit_ratio(
    region: str, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    proxy = await make_proxy(
        [{"name": "r1", "url": region, "http2": False, "serves_any_model": True}],
        access_log={"enabled": True, "path": str(log)},
    )
    await send_all(proxy)
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.admin_url + "/metrics") as response:
            metrics = await response.text()
    cached = [
        line
        for line in metrics.splitlines()
        if line.startswith("edgeproxy_tokens_total") and 'kind="cached_prompt"' in line
    ]
    assert cached and float(cached[0].rsplit(" ", 1)[1]) == 80 + 60 + 70
    writes = [line for line in metrics.splitlines() if 'kind="cache_write"' in line]
    assert writes and float(writes[0].rsplit(" ", 1)[1]) == 20
    (r1,) = proxy.status()["regions"]
    assert r1["prompt_cache"] == {
        "prompt_tokens_total": 300,
        "cached_tokens_total": 210,
        "hit_ratio": 0.7,
    }
    await eventually(lambda: log.exists() and len(log.read_text().splitlines()) >= 3)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["usage"]["cached_tokens"] for line in lines] == [80, 60, 70]


@pytest.mark.parametrize(("weight", "charged"), [(1.0, 105), (0.1, 105 - 72)])
def test_tokens_per_minute_charge_cached_tokens_at_their_weight(
    monkeypatch: pytest.MonkeyPatch, weight: float, charged: int
) -> None:
    from edgeproxy._admission import ratelimit
    from edgeproxy._core.config import AdmissionConfig

    # A clock that stands still: no refill between the charge and the settlement.
    monkeypatch.setattr(time, "monotonic", lambda: 1000.0)
    limiter = ratelimit.RateLimiter(
        AdmissionConfig(key_tokens_per_minute=6000, cached_token_weight=weight)
    )
    charges = limiter.charges("tenant", "ip", 10)
    ticket = ratelimit.RateTicket(charges, False, 10)
    limiter.local.take(charges)
    limiter.settle(ticket, CHAT.counted(CHAT_USAGE))
    (bucket,) = [c.bucket for c in charges if c.limit.unit == "tokens"]
    level = limiter.local._buckets[bucket][0]
    # 80 cached tokens at the weight: 105 in all, or 105 - 72 at a tenth.
    assert 6000 - level == pytest.approx(charged)
