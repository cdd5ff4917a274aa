"""Every client API on llama.cpp's C++ ``llama-server`` as two real regions behind the proxy.

llama-server speaks chat completions, Anthropic's Messages (``/v1/messages``, with
``count_tokens``) and a stateless Responses API (``/v1/responses``) itself, over HTTP/1.1:
the proxy finds the HTTP version on its own (``http2`` is left unset) and recognises from
its ``/v1/models`` (one model, ``owned_by: "llamacpp"``) that it answers any model name, so
the clients' usual ``gpt-4o-mini`` reaches it. With one server killed, the next requests of
every API are answered by the other; each answer's usage reaches the access log; and
llama-server's own 400 to a ``previous_response_id`` (it stores nothing) reaches the client
as it was sent, in the Responses error shape.

The binary is built by ``.ci/build-llama-server`` (the ``llama_cpp_server`` fixture in
``conftest.py`` skips, saying why, without one). The servers run the tiny generated GGUF
model: their answers are random words, so the tests read the shape of each answer, not its
text.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest

from edgeproxy import EdgeProxy

from .conftest import LlamaCppServers, ProxyFactory

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None or importlib.util.find_spec("numpy") is None,
        reason="building the test model needs gguf and numpy (pip install 'edgeproxy[testing]')",
    ),
]

MODEL = "gpt-4o-mini"
USER: Any = [{"role": "user", "content": "Say hello."}]
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence"}
NAMES = ("llama0", "llama1")


def regions(*urls: str) -> list[dict[str, Any]]:
    # The first is the nearer: it is tried first while it answers. Each region's model
    # list is learnt, and no http2 is set: the proxy finds both itself.
    places = [(1.35, 103.82), (50.0, 8.0)]
    return [
        {"name": name, "url": url, "lat": lat, "lon": lon, "learn_models": True}
        for name, url, (lat, lon) in zip(NAMES, urls, places, strict=False)
    ]


async def start_proxy(make_proxy: ProxyFactory, urls: list[str], log: Path) -> EdgeProxy:
    return await make_proxy(
        regions(*urls),
        upstream={"read_timeout": 60.0},
        access_log={"enabled": True, "path": str(log)},
    )


def clients(proxy: EdgeProxy) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    return (
        openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0),
        anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0),
    )


# -- one request of each API, each returning the region that answered ----------------------


async def chat(oa: openai.AsyncOpenAI, _: anthropic.AsyncAnthropic) -> str | None:
    raw = await oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=USER, max_tokens=8
    )
    answer = raw.parse()
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and answer.usage.prompt_tokens > 0
    return raw.headers.get("x-edgeproxy-region")


async def chat_stream(oa: openai.AsyncOpenAI, _: anthropic.AsyncAnthropic) -> str | None:
    raw = await oa.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=USER,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    finish = usage = None
    async for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        usage = chunk.usage or usage
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0
    return raw.headers.get("x-edgeproxy-region")


async def messages(_: openai.AsyncOpenAI, an: anthropic.AsyncAnthropic) -> str | None:
    raw = await an.messages.with_raw_response.create(model=MODEL, max_tokens=8, messages=USER)
    message = await raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason in STOP_REASONS
    assert message.content[0].type == "text"
    assert message.usage.input_tokens > 0
    return raw.headers.get("x-edgeproxy-region")


async def messages_stream(_: openai.AsyncOpenAI, an: anthropic.AsyncAnthropic) -> str | None:
    async with an.messages.stream(model=MODEL, max_tokens=8, messages=USER) as stream:
        final = await stream.get_final_message()
        region = stream.response.headers.get("x-edgeproxy-region")
    assert final.stop_reason in STOP_REASONS
    assert final.usage.output_tokens > 0
    return region


async def count_tokens(_: openai.AsyncOpenAI, an: anthropic.AsyncAnthropic) -> str | None:
    raw = await an.messages.with_raw_response.count_tokens(model=MODEL, messages=USER)
    counted = await raw.parse()
    assert counted.input_tokens > 0
    return raw.headers.get("x-edgeproxy-region")


async def responses(oa: openai.AsyncOpenAI, _: anthropic.AsyncAnthropic) -> str | None:
    raw = await oa.responses.with_raw_response.create(
        model=MODEL, input="Say hello.", max_output_tokens=16, store=False
    )
    response = raw.parse()
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output[-1].type == "message"
    assert response.usage is not None and response.usage.input_tokens > 0
    return raw.headers.get("x-edgeproxy-region")


async def responses_stream(oa: openai.AsyncOpenAI, _: anthropic.AsyncAnthropic) -> str | None:
    raw = await oa.responses.with_raw_response.create(
        model=MODEL, input="Say hello.", max_output_tokens=16, store=False, stream=True
    )
    kinds = []
    async for event in raw.parse():
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            assert event.response.usage is not None
            assert event.response.usage.output_tokens > 0
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    return raw.headers.get("x-edgeproxy-region")


Ask = Callable[[openai.AsyncOpenAI, anthropic.AsyncAnthropic], Awaitable[str | None]]
ASKS: dict[str, tuple[str, Ask]] = {
    # name: (the path the access log shows, the request)
    "chat": ("/v1/chat/completions", chat),
    "chat stream": ("/v1/chat/completions", chat_stream),
    "messages": ("/v1/messages", messages),
    "messages stream": ("/v1/messages", messages_stream),
    "count_tokens": ("/v1/messages/count_tokens", count_tokens),
    "responses": ("/v1/responses", responses),
    "responses stream": ("/v1/responses", responses_stream),
}
# The answers that carry the region's token counts (a token count is never usage).
GENERATING = [name for name in ASKS if name != "count_tokens"]


async def access_lines(log: Path, count: int) -> list[dict[str, Any]]:
    """The access log's first ``count`` lines, once its writer thread has written them."""
    for _ in range(250):
        if log.exists():
            lines = [orjson.loads(line) for line in log.read_bytes().splitlines() if line]
            if len(lines) >= count:
                return lines[:count]
        await asyncio.sleep(0.02)
    raise AssertionError(f"the access log has not {count} lines: {log.read_text()!r}")


async def region_status(proxy: EdgeProxy) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/status") as resp:
            assert resp.status == 200
            status = await resp.json()
    return {r["name"]: r for r in status["regions"]}


async def test_every_client_api_on_two_llama_servers(
    llama_cpp_server: LlamaCppServers,
    make_proxy: ProxyFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    urls = list(await asyncio.gather(llama_cpp_server(), llama_cpp_server()))
    caplog.set_level(logging.INFO, logger="edgeproxy.regions")
    log = tmp_path / "access.log"
    proxy = await start_proxy(make_proxy, urls, log)
    said = [r.getMessage() for r in caplog.records if r.name == "edgeproxy.regions"]
    for name in NAMES:
        assert any(
            m.startswith(f"region {name} serves 1 model (from its /v1/models)")
            and "llama.cpp's llama-server, which answers any model name" in m
            for m in said
        ), said
    oa, an = clients(proxy)
    try:
        for name, (_, ask) in ASKS.items():
            assert await ask(oa, an) in NAMES, name
    finally:
        await oa.close()
        await an.close()
    # Each answer is in the access log with the region's token counts.
    lines = await access_lines(log, len(ASKS))
    for (name, (path, _)), line in zip(ASKS.items(), lines, strict=True):
        assert (line["path"], line["status"], line["region"]) in {
            (path, 200, region) for region in NAMES
        }, (name, line)
        usage = line["usage"] or {}
        if name in GENERATING:
            assert usage.get("prompt_tokens", 0) > 0, (name, line)
            assert usage.get("completion_tokens", 0) > 0, (name, line)
    # The proxy found each server's HTTP version itself (llama-server speaks HTTP/1.1).
    said = [r.getMessage() for r in caplog.records if r.name == "edgeproxy.regions"]
    for name in NAMES:
        assert any(m.startswith(f"region {name} (") and "HTTP/1.1 only" in m for m in said), said
    # llama-server speaks every API itself: nothing was learnt lacking, nothing translated.
    for name, region in (await region_status(proxy)).items():
        apis = region.get("apis")
        if apis is not None:
            assert not apis.get("learnt"), (name, apis)
            assert not apis.get("translated_total"), (name, apis)


async def test_every_api_fails_over_when_a_server_is_killed(
    llama_cpp_server: LlamaCppServers, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    doomed, alive = await asyncio.gather(llama_cpp_server(), llama_cpp_server())
    proxy = await start_proxy(make_proxy, [doomed, alive], tmp_path / "access.log")
    oa, an = clients(proxy)
    try:
        # Both up: the nearer answers.
        assert await chat(oa, an) == "llama0"
        llama_cpp_server.kill(doomed)
        for name, (_, ask) in ASKS.items():
            assert await ask(oa, an) == "llama1", name
    finally:
        await oa.close()
        await an.close()
    dead = proxy.regions.by_name["llama0"]
    assert dead.errors_total >= 1


async def test_a_previous_response_id_gets_llama_servers_own_400(
    llama_cpp_server: LlamaCppServers, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """llama-server stores no response and refuses a follow-up of one with its own 400: the
    proxy passes that answer to the client as llama-server sent it, in the Responses API's
    error shape, which the openai SDK reads as a BadRequestError."""
    url = await llama_cpp_server()
    log = tmp_path / "access.log"
    proxy = await start_proxy(make_proxy, [url], log)
    oa, _ = clients(proxy)
    try:
        first = await oa.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8)
        assert first.id.startswith("resp_")
        follow_up = {
            "model": MODEL,
            "input": "And again.",
            "max_output_tokens": 8,
            "previous_response_id": first.id,
        }
        with pytest.raises(openai.BadRequestError) as info:
            await oa.responses.create(**follow_up)
    finally:
        await oa.close()
    err = info.value
    assert err.status_code == 400
    assert err.response.headers.get("x-edgeproxy-region") == "llama0"
    assert err.body == {
        "code": 400,
        "message": "llama.cpp does not support 'previous_response_id'.",
        "type": "invalid_request_error",
    }
    assert err.message.endswith("llama.cpp does not support 'previous_response_id'.")
    # Byte for byte what llama-server answers the same request itself.
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/responses", json=follow_up) as resp:
            assert resp.status == 400
            assert err.response.content == await resp.read()
    lines = await access_lines(log, 2)
    assert (lines[1]["path"], lines[1]["status"], lines[1]["region"]) == (
        "/v1/responses",
        400,
        "llama0",
    )


async def test_a_chain_held_at_the_edge_goes_on_through_llama_server(
    llama_cpp_server: LlamaCppServers, make_proxy: ProxyFactory
) -> None:
    """On a route that holds Responses chains at the edge, llama-server (which stores
    nothing) answers a chain of turns end to end: each follow-up is sent with the whole
    conversation instead of its ``previous_response_id``, streamed or not, and marked."""
    url = await llama_cpp_server()
    proxy = await make_proxy(
        regions(url),
        upstream={"read_timeout": 60.0},
        routes=[{"name": "edge", "path": "/", "responses_state": "edge"}],
    )
    oa, _ = clients(proxy)
    try:
        first = await oa.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8)
        previous, states = first.id, []
        for turn, stream in enumerate((False, True, False)):
            request: dict[str, Any] = {
                "model": MODEL,
                "input": f"And again, {turn}.",
                "max_output_tokens": 8,
                "previous_response_id": previous,
            }
            if stream:
                async with oa.responses.with_streaming_response.create(
                    **request, stream=True
                ) as raw:
                    states.append(raw.headers.get("x-edgeproxy-state"))
                    events = await raw.parse()
                    completed = [
                        event async for event in events if event.type == "response.completed"
                    ]
                previous = completed[-1].response.id
            else:
                raw_json = await oa.responses.with_raw_response.create(**request)
                states.append(raw_json.headers.get("x-edgeproxy-state"))
                previous = raw_json.parse().id
            assert previous.startswith("resp_")
    finally:
        await oa.close()
    assert states == ["edge", "edge", "edge"]
    chains = proxy.status()["chains"]
    assert chains["held_total"] == 4
    # The first follow-up learnt it from llama-server's own 400; the rest were sent whole
    # without asking it first.
    assert chains["rescued"]["owner_cannot_store"] == 3
    assert chains["stateless_regions"] == ["llama0"]
