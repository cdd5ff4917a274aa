"""Faults as users meet them, each with its conduct checked: how many attempts, how far
apart, and what the client got.

The regions are real fake regions (hypercorn) whose faults come and go on their own
(``fault_count``), or hand-written aiohttp regions for what no fault mode sends. The
proxy's waits go through an injected sleep that records each wait and moves the
injected clock instead of the wall clock, so a ``Retry-After: 2`` costs the suite nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from edgeproxy import EdgeProxy
from edgeproxy._upstream.cooldown import retry_after_seconds

from .conftest import CustomRegion, FakeClock, ProxyFactory, RegionFactory

CHAT = "/v1/chat/completions"
HELLO = {"model": "fake-llm", "messages": [{"role": "user", "content": "hello"}]}
STREAM = {**HELLO, "stream": True, "max_tokens": 60}


class Waits:
    """The proxy's waits: each recorded, the clock moved by it, ``then`` run after it."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.seen: list[float] = []
        self.then: Callable[[], None] | None = None

    async def __call__(self, seconds: float) -> None:
        self.seen.append(round(seconds, 2))
        self.clock.advance(seconds)
        if self.then is not None:
            self.then()
        await asyncio.sleep(0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock.following(time.monotonic)


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


Start = Callable[..., Awaitable[tuple[EdgeProxy, Waits]]]


@pytest.fixture
def start(make_proxy: ProxyFactory, clock: FakeClock) -> Start:
    async def factory(regions: list[Any], **sections: Any) -> tuple[EdgeProxy, Waits]:
        proxy = await make_proxy(regions, clock=clock, **sections)
        waits = Waits(clock)
        failover = proxy.pipeline.failover
        failover.sleep = waits
        failover.random = lambda: 1.0  # the jitter at its top: waits are exact
        return proxy, waits

    return factory


async def post(
    client: aiohttp.ClientSession, proxy: EdgeProxy, body: dict[str, Any] = HELLO
) -> tuple[int, Any, bytes]:
    headers = {"Content-Type": "application/json"}
    async with client.post(proxy.url + CHAT, data=orjson.dumps(body), headers=headers) as resp:
        received = b""
        try:
            async for chunk in resp.content.iter_any():
                received += chunk
        except aiohttp.ClientPayloadError:
            pass  # a stream the proxy ended as broken: what came before its end is kept
        return resp.status, resp.headers, received


def requests_to(*regions: Any) -> list[int]:
    return [r.requests_by_path.get(CHAT, 0) for r in regions]


def route(**extra: Any) -> list[dict[str, Any]]:
    return [{"name": "llm", "path": "/v1/", **extra}]


# -- Retry-After, as a region out of capacity sends it ----------------------------------


def test_retry_after_is_read_in_seconds_and_as_an_http_date() -> None:
    assert retry_after_seconds("2") == 2.0
    assert retry_after_seconds(" 7 ") == 7.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0
    assert retry_after_seconds("999999") == 3600.0  # a region cannot park a model for days
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None


async def test_429_once_with_retry_after_on_a_lone_region_waits_it_then_answers(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    r1 = await make_region(
        "r1", fault="5xx", fault_status=429, fault_retry_after="2", fault_count=1
    )
    proxy, waits = await start([r1])
    status, headers, _ = await post(client, proxy)
    assert status == 200 and headers["X-Edgeproxy-Attempts"] == "2"
    assert waits.seen == [2.0] and requests_to(r1) == [2]


async def test_429_with_retry_after_fails_over_and_holds_the_region_off_until_it_passes(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession, clock: FakeClock
) -> None:
    r1 = await make_region(
        "r1", fault="5xx", fault_status=429, fault_retry_after="2", fault_count=1
    )
    r2 = await make_region("r2")
    proxy, waits = await start(
        [
            {"name": "r1", "url": r1.url, "lat": 1.3, "lon": 103.8, "server": "vllm"},
            {"name": "r2", "url": r2.url, "lat": 40.0, "lon": -3.0, "server": "vllm"},
        ]
    )
    status, headers, _ = await post(client, proxy)
    assert (status, headers["X-Edgeproxy-Region"], headers["X-Edgeproxy-Attempts"]) == (
        200,
        "r2",
        "2",
    )
    assert waits.seen == [] and requests_to(r1, r2) == [1, 1]
    # Held off for the model: the next request goes straight to r2, r1 gets nothing.
    status, headers, _ = await post(client, proxy)
    assert (status, headers["X-Edgeproxy-Region"]) == (200, "r2")
    assert "X-Edgeproxy-Attempts" not in headers and requests_to(r1) == [1]
    cooldowns = next(r for r in proxy.status()["regions"] if r["name"] == "r1")["cooldowns"]
    assert cooldowns["models"]["fake-llm"]["status"] == 429
    # Once the wait has passed, r1 (the nearer) is asked again, and answers.
    clock.advance(2.1)
    status, headers, _ = await post(client, proxy)
    assert (status, headers["X-Edgeproxy-Region"]) == (200, "r1")


async def test_a_persistent_429_without_retry_after_is_backed_off_never_hammered(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    r1 = await make_region("r1", fault="5xx", fault_status=429)
    proxy, waits = await start([r1])
    status, headers, body = await post(client, proxy)
    # Three attempts (the route's 2 retries), each after a doubling backoff.
    assert status == 429 and headers["X-Edgeproxy-Attempts"] == "3"
    assert waits.seen == [1.0, 2.0] and requests_to(r1) == [3]
    # The client's Retry-After is when the proxy itself will ask the region again.
    assert headers["Retry-After"] == "4"
    assert orjson.loads(body)["error"]["message"].startswith("region r1 answered 429")
    # The next request waits for the backoff and the one after; the region still gets
    # no more than one request per wait.
    status, _, _ = await post(client, proxy)
    assert status == 429 and waits.seen[2:] == [4.0, 8.0, 16.0] and requests_to(r1) == [6]


async def test_every_region_held_off_answers_at_once_with_a_retry_after_to_trust(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    r1 = await make_region("r1", fault="5xx", fault_status=503, fault_retry_after="120")
    r2 = await make_region("r2", fault="5xx", fault_status=503, fault_retry_after="90")
    proxy, waits = await start([r1, r2])
    status, headers, _ = await post(client, proxy)
    assert status == 503 and requests_to(r1, r2) == [1, 1]
    assert headers["Retry-After"] == "90" and waits.seen == []
    # Nothing is sent while both hold off (the waits do not fit the 30 s deadline).
    status, headers, body = await post(client, proxy)
    assert status == 503 and requests_to(r1, r2) == [1, 1]
    assert headers["Retry-After"] == "90"
    assert orjson.loads(body)["error"]["code"] == "region_overloaded"


# -- retries of a lone region --------------------------------------------------------


async def test_a_500_once_is_retried_on_the_lone_region_after_a_backoff(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    r1 = await make_region("r1", fault="5xx", fault_status=500, fault_count=1)
    proxy, waits = await start([r1], routing={"retry_statuses": [500, 502, 503, 504]})
    status, headers, _ = await post(client, proxy)
    assert status == 200 and headers["X-Edgeproxy-Attempts"] == "2"
    assert waits.seen == [0.25] and requests_to(r1) == [2]


async def test_a_503_persistent_on_a_lone_region_is_tried_route_retries_times_then_503(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    r1 = await make_region("r1", fault="5xx", fault_status=503)
    proxy, waits = await start([r1])
    status, headers, _ = await post(client, proxy)
    assert status == 503 and headers["X-Edgeproxy-Attempts"] == "3"
    assert waits.seen == [0.25, 0.5] and requests_to(r1) == [3]


async def test_a_reset_before_the_headers_is_retried_on_the_lone_region(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    r1 = await make_region("r1", fault="reset", fault_after_tokens=0, fault_count=1)
    proxy, waits = await start([r1])
    status, headers, _ = await post(client, proxy)
    assert status == 200 and headers["X-Edgeproxy-Attempts"] == "2"
    assert waits.seen == [0.25]


async def test_no_answer_at_all_ends_at_the_deadline_with_504(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    r1 = await make_region("r1", fault="stall")
    proxy, waits = await start([r1], routes=route(deadline=0.3, fallback=[]))
    status, _, body = await post(client, proxy)
    assert status == 504 and orjson.loads(body)["error"]["code"] == "deadline_exceeded"
    assert requests_to(r1) == [1]


# -- streams: a slow first token, stalls, cuts --------------------------------------------


async def test_a_slow_first_token_is_no_stall(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    # The wait for the headers (the queue, the prefill) is read_timeout's, not the
    # stream idle timeout's: a first token later than the idle timeout is no stall.
    r1 = await make_region("r1", ttft=0.4)
    proxy, _ = await start([r1], upstream={"stream_idle_timeout": 0.1, "read_timeout": 5.0})
    status, headers, body = await post(client, proxy, STREAM)
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
    assert "X-Edgeproxy-Attempts" not in headers


async def test_a_stream_stalled_with_the_connection_open_breaks_at_the_idle_timeout(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    r1 = await make_region("r1", fault="stall_body")
    r2 = await make_region("r2")
    proxy, _ = await start(
        [
            {"name": "r1", "url": r1.url, "lat": 1.3, "lon": 103.8, "server": "vllm"},
            {"name": "r2", "url": r2.url, "lat": 40.0, "lon": -3.0, "server": "vllm"},
        ],
        upstream={"stream_idle_timeout": 0.2, "read_timeout": 10.0},
        routes=route(continue_on_break=True),
    )
    status, _, body = await post(client, proxy, {**STREAM, "max_tokens": 8})
    assert status == 200
    # The first leg's first token, then r2 went on; the client saw one whole answer.
    assert body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body
    assert requests_to(r1, r2) == [1, 1]
    assert proxy.pipeline.continuation.snapshot().get("continued") == 1


async def test_a_stream_cut_after_40_of_60_tokens_is_continued_whole(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    r1 = await make_region("r1", fault="reset", fault_after_tokens=40)
    r2 = await make_region("r2")
    proxy, _ = await start(
        [
            {"name": "r1", "url": r1.url, "lat": 1.3, "lon": 103.8, "server": "vllm"},
            {"name": "r2", "url": r2.url, "lat": 40.0, "lon": -3.0, "server": "vllm"},
        ],
        routes=route(continue_on_break=True),
    )
    status, _, body = await post(client, proxy, STREAM)
    _, _, whole = await post(client, proxy, {**STREAM, "model": "fake-llm"})
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
    text = _text(body)
    assert len(text.split()) >= 60 - 1 and text == _text(whole)


async def test_a_continued_answer_is_bounded_by_one_deadline_not_one_per_leg(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    # Each leg stalls after its first token: the first stall is continued, but the
    # route's deadline runs from that first break, so no leg starts after it.
    r1 = await make_region("r1", fault="stall_body")
    r2 = await make_region("r2", fault="stall_body")
    r3 = await make_region("r3")
    proxy, _ = await start(
        [
            {"name": "r1", "url": r1.url, "lat": 1.3, "lon": 103.8, "server": "vllm"},
            {"name": "r2", "url": r2.url, "lat": 40.0, "lon": -3.0, "server": "vllm"},
            {"name": "r3", "url": r3.url, "lat": 40.0, "lon": -3.0, "server": "vllm"},
        ],
        upstream={"stream_idle_timeout": 0.3, "read_timeout": 10.0},
        routes=route(
            continue_on_break=True, max_continuations=5, deadline=0.2, race_continuations=False
        ),
    )
    status, _, body = await post(client, proxy, {**STREAM, "max_tokens": 8})
    assert status == 200
    # r2 continued after r1's stall (within the deadline of 0.2 s from the break)...
    assert requests_to(r1, r2) == [1, 1]
    # ...but r2's own stall (0.3 s later) came past that deadline: no third leg.
    assert requests_to(r3) == [0]
    assert b"upstream_stream_broken" in body
    assert proxy.pipeline.continuation.snapshot().get("deadline") == 1


async def test_a_stream_ending_without_done_and_a_malformed_chunk_are_relayed_as_sent(
    custom_region: CustomRegion, start: Start, client: aiohttp.ClientSession
) -> None:
    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in ("one", "two"):
            chunk = {"choices": [{"index": 0, "delta": {"content": word + " "}}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: {not json\n\n")
        await resp.write_eof()  # no [DONE]
        return resp

    app = web.Application()
    app.router.add_post(CHAT, chat)
    url = await custom_region(app)
    proxy, _ = await start([{"name": "r1", "url": url, "http2": False}])
    status, _, body = await post(client, proxy, STREAM)
    # The region ended its stream cleanly: the client gets what it sent, nothing added,
    # nothing lost, and the malformed event is not the proxy's to repair.
    assert status == 200 and b"data: {not json" in body and b"[DONE]" not in body
    assert _text(body) == "one two "


# -- refusals: context windows, content filters ------------------------------------------


def _context_region(window: int, wording: dict[str, Any], status: int = 400) -> web.Application:
    """A region serving ``small``, which refuses any prompt longer than ``window``
    characters in ``wording``, and ``large``, which takes any."""

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        asked[body["model"]] = asked.get(body["model"], 0) + 1
        if body["model"] == "small" and len(orjson.dumps(body["messages"])) > window:
            return web.json_response(wording, status=status)
        answer = {
            "id": "c",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
        return web.json_response(answer)

    asked: dict[str, int] = {}
    app = web.Application()
    app[ASKED] = asked
    app.router.add_post(CHAT, chat)
    return app


ASKED = web.AppKey("asked", dict[str, int])
LONG = {"model": "small", "messages": [{"role": "user", "content": "x " * 200}]}
OPENAI_TOO_LONG = {
    "error": {
        "message": "This model's maximum context length is 64 tokens. However, your messages "
        "resulted in 210 tokens.",
        "type": "invalid_request_error",
        "code": "context_length_exceeded",
    }
}


@pytest.mark.parametrize(
    "wording",
    [
        OPENAI_TOO_LONG,
        {
            "error": {
                "code": 400,
                "message": "the request exceeds the available context size, try increasing it",
                "type": "exceed_context_size_error",
            }
        },
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "prompt is too long: 210 tokens > 64 maximum",
            },
        },
        {
            "object": "error",
            "message": "The input (210 tokens) is longer than the model's "
            "context length (64 tokens).",
            "type": "BadRequestError",
            "code": 400,
        },
        {"detail": "Requested tokens (210) exceed context window of 64"},
    ],
    ids=["openai-vllm", "llama-server", "anthropic", "sglang", "llama-cpp-python"],
)
async def test_a_request_too_long_for_its_model_goes_to_its_larger_model(
    custom_region: CustomRegion,
    start: Start,
    client: aiohttp.ClientSession,
    wording: dict[str, Any],
) -> None:
    app = _context_region(100, wording)
    url = await custom_region(app)
    proxy, _ = await start(
        [{"name": "r1", "url": url, "http2": False}],
        routes=route(larger_models={"small": ["large"]}),
    )
    status, headers, body = await post(client, proxy, LONG)
    assert status == 200, body
    assert headers["X-Edgeproxy-Model"] == "large"
    assert orjson.loads(body)["model"] == "large"
    # Never retried on the same model: once there, once on the larger one.
    assert app[ASKED] == {"small": 1, "large": 1}
    assert proxy.status()["fallback"]["larger"] == [{"name": "small>large", "answers_total": 1}]


async def test_a_request_known_too_long_goes_straight_to_the_larger_model(
    custom_region: CustomRegion, start: Start, client: aiohttp.ClientSession
) -> None:
    app = _context_region(100, OPENAI_TOO_LONG)
    url = await custom_region(app)
    proxy, _ = await start(
        [{"name": "r1", "url": url, "http2": False}],
        routes=route(larger_models={"small": ["large"]}, context_windows={"small": 64}),
    )
    status, headers, _ = await post(client, proxy, LONG)
    assert status == 200 and headers["X-Edgeproxy-Model"] == "large"
    assert app[ASKED] == {"large": 1}


async def test_too_long_with_no_larger_model_and_a_content_filter_pass_through_once(
    custom_region: CustomRegion, start: Start, client: aiohttp.ClientSession
) -> None:
    app = _context_region(100, OPENAI_TOO_LONG)
    url = await custom_region(app)
    proxy, _ = await start(
        [{"name": "r1", "url": url, "http2": False}], routing={"retry_budget_min": 100}
    )
    status, headers, body = await post(client, proxy, LONG)
    assert status == 400 and orjson.loads(body) == OPENAI_TOO_LONG
    assert "X-Edgeproxy-Model" not in headers and app[ASKED] == {"small": 1}
    # A content filter's refusal: the region's own 400, once, its reason intact.
    flagged = {
        "error": {
            "message": "The response was filtered due to the prompt triggering the content "
            "management policy.",
            "type": "invalid_request_error",
            "code": "content_filter",
        }
    }
    app2 = _context_region(0, flagged)
    proxy2, _ = await start(
        [{"name": "r2", "url": await custom_region(app2), "http2": False}],
        routes=route(larger_models={"small": ["large"]}),
    )
    status, _, body = await post(client, proxy2, LONG)
    assert status == 400 and orjson.loads(body) == flagged and app2[ASKED] == {"small": 1}


async def test_a_cut_stream_whose_next_region_refuses_the_prefill_ends_with_its_reason(
    make_region: RegionFactory,
    custom_region: CustomRegion,
    start: Start,
    client: aiohttp.ClientSession,
) -> None:
    refusal = {
        "error": {
            "message": "assistant message prefill is not supported",
            "type": "invalid_request_error",
        }
    }
    asked: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.Response:
        asked.append(await request.json())
        return web.json_response(refusal, status=400)

    app = web.Application()
    app.router.add_post(CHAT, chat)
    r1 = await make_region("r1", fault="reset", fault_after_tokens=3)
    proxy, _ = await start(
        [
            {"name": "r1", "url": r1.url, "lat": 1.3, "lon": 103.8, "server": "vllm"},
            {
                "name": "r2",
                "url": await custom_region(app),
                "lat": 40.0,
                "lon": -3.0,
                "http2": False,
                "server": "llama.cpp",
            },
        ],
        routes=route(continue_on_break=True),
    )
    status, _, body = await post(client, proxy, {**STREAM, "max_tokens": 8})
    assert status == 200 and len(asked) == 1  # asked once, never again
    assert asked[0]["messages"][-1]["role"] == "assistant"
    assert b"continuation_refused" in body and b"prefill is not supported" in body
    assert proxy.pipeline.continuation.snapshot().get("refused") == 1


def _text(body: bytes) -> str:
    """The content of a chat stream's events."""
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue
            for choice in event.get("choices") or []:
                out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


# -- a region down for a minute, the lighter rung meanwhile ---------------------------------

BIG, SMALL = "llama-70b", "llama-8b"


async def big_and_small(make_region: RegionFactory, **big: Any) -> tuple[Any, Any, list[Any]]:
    """A region serving the big model alone (its chat path faulty as ``big`` says) and one
    serving the small model, each learnt from its /v1/models."""
    big_region = await make_region("big", model=BIG, fault_paths=[CHAT], **big)
    small_region = await make_region("small", model=SMALL)
    tables = [
        {"name": r.name, "url": r.url, "learn_models": True, "server": "vllm"}
        for r in (big_region, small_region)
    ]
    return big_region, small_region, tables


async def test_a_region_down_for_a_minute_then_healthy_under_twenty_requests(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession, clock: FakeClock
) -> None:
    big, small, tables = await big_and_small(make_region, fault="5xx", fault_status=503)
    proxy, _ = await start(
        tables, routes=route(fallback=["lighter"], fallback_models={BIG: [SMALL]})
    )
    lighter_tokens = 0
    served: list[str] = []
    for i in range(20):
        if i == 10:
            big.behavior.fault = None  # a minute later, the region is back
        status, headers, body = await post(client, proxy, {**HELLO, "model": BIG})
        assert status == 200
        answer = orjson.loads(body)
        if headers.get("X-Edgeproxy-Degraded") == "lighter-model":
            # The fallback's model and usage, not the failed attempts'.
            assert headers["X-Edgeproxy-Model"] == SMALL and answer["model"] == SMALL
            assert headers["X-Edgeproxy-Region"] == "small"
            usage = answer["usage"]
            lighter_tokens += usage["prompt_tokens"] + usage["completion_tokens"]
            served.append("lighter")
        else:
            assert headers["X-Edgeproxy-Region"] == "big" and answer["model"] == BIG
            assert "X-Edgeproxy-Model" not in headers
            served.append("big")
        clock.advance(6.0)
    # Down for the first ten, back for the last (once its ejection, if any, ended).
    assert served[:10] == ["lighter"] * 10 and served[-3:] == ["big"] * 3
    fallback = proxy.status()["fallback"]
    assert fallback["lighter_usage"] == [{"name": SMALL, "tokens_total": lighter_tokens}]


async def test_a_stream_no_region_of_its_model_can_continue_goes_on_on_a_lighter_model(
    make_region: RegionFactory, start: Start, client: aiohttp.ClientSession
) -> None:
    big, small, tables = await big_and_small(make_region, fault="reset", fault_after_tokens=3)
    proxy, _ = await start(
        tables,
        routes=route(continue_on_break=True, fallback=["lighter"], fallback_models={BIG: [SMALL]}),
    )
    status, _, body = await post(client, proxy, {**STREAM, "model": BIG, "max_tokens": 8})
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body
    assert small.requests_by_path.get(CHAT, 0) == 1
    assert proxy.pipeline.continuation.snapshot() == {"continued": 1}
    assert proxy.status()["fallback"]["served"].get("lighter-model") == 1
