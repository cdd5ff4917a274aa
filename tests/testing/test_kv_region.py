"""The fake region's LLM server model: prefix (KV) cache, queue, load reports.

Everything goes through a real :class:`FakeRegion` over HTTP/2 (httpx, h2c)
and HTTP/1.1 (aiohttp). TTFTs are compared as the region models them (the
``x-fake-ttft-ms`` header and its counters), never by the clock.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import h2.config
import h2.connection
import h2.events
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgeproxy.testing import LOAD_METRICS_FAULTS, Behavior, FakeRegion

CHAT = "/v1/chat/completions"
HANG = 10.0
BLOCK = 16

# 40 words of at most 4 characters: with the role marker, 41 tokens (2 whole blocks).
TURN_1 = [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}]
TURN_2 = [
    *TURN_1,
    {"role": "assistant", "content": "all good"},
    {"role": "user", "content": "and then what"},
]
OTHER = [{"role": "user", "content": " ".join(f"o{i}" for i in range(40))}]


def conversation(tag: str, words: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": " ".join(f"{tag}{i}" for i in range(words))}]


# -- clients: one call shape over HTTP/2 and HTTP/1.1 ---------------------------------------

Post = Callable[..., Awaitable[tuple[int, Mapping[str, str], bytes]]]


@pytest.fixture(params=["h2", "http1.1"])
async def post(request: pytest.FixtureRequest) -> AsyncIterator[Post]:
    """``post(region, path, body, headers=...)`` -> (status, headers, body), on either protocol."""
    if request.param == "h2":
        async with httpx.AsyncClient(http1=False, http2=True, timeout=HANG) as client:

            async def call_h2(
                region: FakeRegion, path: str, body: object, headers: dict[str, str] | None = None
            ) -> tuple[int, Mapping[str, str], bytes]:
                response = await client.post(region.url + path, json=body, headers=headers)
                assert response.http_version == "HTTP/2"
                return response.status_code, response.headers, response.content

            yield call_h2
    else:
        timeout = aiohttp.ClientTimeout(total=HANG)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def call_h1(
                region: FakeRegion, path: str, body: object, headers: dict[str, str] | None = None
            ) -> tuple[int, Mapping[str, str], bytes]:
                async with session.post(region.url + path, json=body, headers=headers) as response:
                    assert response.version == aiohttp.HttpVersion11
                    return response.status, response.headers, await response.read()

            yield call_h1


def chat(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, **extra}


def kv(headers: Mapping[str, str]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) as the answer reports them."""
    return int(headers["x-fake-kv-prompt-tokens"]), int(headers["x-fake-kv-cached-tokens"])


def parse_orca(value: str) -> dict[str, float]:
    """The named metrics of an ``endpoint-load-metrics`` value, as documented (strict)."""
    kind, _, payload = value.partition(" ")
    if kind == "TEXT":
        metrics = {}
        for field in payload.split(", "):
            key, sep, number = field.partition("=")
            if not sep or not key.startswith("named_metrics.") or key == "named_metrics.":
                raise ValueError(f"bad field {field!r}")
            metrics[key.removeprefix("named_metrics.")] = float(number)
        return metrics
    if kind == "JSON":
        report = json.loads(payload)
        named = report["named_metrics"]
        if not all(isinstance(v, float) for v in named.values()):
            raise ValueError(f"not all numbers: {named!r}")
        return dict(named)
    raise ValueError(f"unknown format {kind!r}")


async def settled(region: FakeRegion) -> None:
    """Wait until every request has left the region: a client may have its whole
    answer a moment before the region has given back the request's slot."""
    await region.wait_until(lambda c: c.in_flight == 0, timeout=HANG)


def prometheus(text: str) -> dict[str, tuple[str, dict[str, str], float]]:
    """Sample name -> (family type, labels, value), through prometheus_client's parser."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = (family.type, dict(sample.labels), sample.value)
    return samples


# -- the prefix cache -----------------------------------------------------------------------


async def test_second_turn_reuses_first_turn_blocks(post: Post) -> None:
    async with FakeRegion(name="kv", kv_capacity_blocks=64) as region:
        status, headers, body = await post(region, CHAT, chat(TURN_1))
        assert status == 200
        assert kv(headers) == (41, 0)
        assert json.loads(body)["object"] == "chat.completion"

        status, headers, _ = await post(region, CHAT, chat(TURN_2))
        assert status == 200
        prompt, cached = kv(headers)
        assert prompt == 41 + 1 + 2 + 1 + 3  # two more messages: a role token each, then words
        assert cached == (41 // BLOCK) * BLOCK == 32  # every whole block of the first turn

        # A different conversation shares nothing with it.
        status, headers, _ = await post(region, CHAT, chat(OTHER))
        assert kv(headers) == (41, 0)

        # A stream is modelled the same way.
        status, headers, body = await post(region, CHAT, chat(OTHER, stream=True))
        assert headers["content-type"] == "text/event-stream"
        assert kv(headers) == (41, 32)
        assert body.endswith(b"data: [DONE]\n\n")

        await settled(region)
        counters = region.counters()
        assert counters.prompt_tokens_total == 41 + 48 + 41 + 41
        assert counters.cached_tokens_total == 64
        assert counters.kv_hit_rate == pytest.approx(64 / 171)
        assert counters.generation_tokens_total == 4 * 8
        assert counters.kv_cache_blocks == 2 + 1 + 2  # TURN_2 added its third block
        assert counters.requests_running == counters.requests_waiting == 0
        assert region.counters().to_dict()["kv_hit_rate"] == pytest.approx(64 / 171)


async def test_last_prompt_token_is_always_computed(post: Post) -> None:
    # 31 words + the role token: exactly two blocks. As in vLLM, the last token
    # is recomputed, so the same prompt again finds only its first block.
    messages = conversation("x", 31)
    async with FakeRegion(kv_capacity_blocks=8) as region:
        _, headers, _ = await post(region, CHAT, chat(messages))
        assert kv(headers) == (32, 0)
        _, headers, _ = await post(region, CHAT, chat(messages))
        assert kv(headers) == (32, 16)


async def test_no_cache_by_default(post: Post) -> None:
    async with FakeRegion() as region:
        for _ in range(2):
            status, headers, _ = await post(region, CHAT, chat(TURN_1))
            assert status == 200
            assert kv(headers) == (41, 0)
            assert headers["x-fake-ttft-ms"] == "0.000"
            assert "endpoint-load-metrics" not in headers
        counters = region.counters()
        assert counters.prompt_tokens_total == 82
        assert counters.cached_tokens_total == 0
        assert counters.kv_cache_blocks == 0
        assert counters.modelled_ttft_seconds_total == 0.0


async def test_capacity_evicts_least_recently_used_blocks(post: Post) -> None:
    # 48 words + the role token: three whole blocks each, all looked up.
    a, b = conversation("a", 48), conversation("b", 48)
    async with FakeRegion(kv_capacity_blocks=4) as region:
        _, headers, _ = await post(region, CHAT, chat(a))
        assert kv(headers) == (49, 0)
        _, headers, _ = await post(region, CHAT, chat(a))
        assert kv(headers) == (49, 48)
        assert region.counters().kv_evicted_blocks_total == 0

        # B's three blocks push out the two least recently used: A's last two
        # (a prompt's blocks are refreshed from its end to its start).
        _, headers, _ = await post(region, CHAT, chat(b))
        assert kv(headers) == (49, 0)
        counters = region.counters()
        assert counters.kv_cache_blocks == 4
        assert counters.kv_evicted_blocks_total == 2

        _, headers, _ = await post(region, CHAT, chat(a))
        assert kv(headers) == (49, 16)  # only A's first block survived
        _, headers, _ = await post(region, CHAT, chat(b))
        assert kv(headers) == (49, 16)  # and A, back, pushed out B's last two
        assert region.counters().kv_evicted_blocks_total == 6

        region.clear_kv_cache()
        assert region.counters().kv_cache_blocks == 0
        _, headers, _ = await post(region, CHAT, chat(b))
        assert kv(headers) == (49, 0)


async def test_cache_hit_lowers_the_modelled_ttft(post: Post) -> None:
    behavior = Behavior(ttft=0.001, ttft_per_uncached_token=0.0002, ttft_per_cached_token=0.00002)
    async with FakeRegion(behavior=behavior, kv_capacity_blocks=64) as region:
        _, cold, _ = await post(region, CHAT, chat(TURN_1))
        _, warm, _ = await post(region, CHAT, chat(TURN_2))
        _, other, _ = await post(region, CHAT, chat(OTHER))

    def modelled(headers: Mapping[str, str]) -> float:
        return float(headers["x-fake-ttft-ms"])

    assert modelled(cold) == pytest.approx(1 + 41 * 0.2, abs=0.001)
    assert modelled(warm) == pytest.approx(1 + 16 * 0.2 + 32 * 0.02, abs=0.001)
    assert modelled(other) == modelled(cold)
    assert modelled(warm) < modelled(cold)  # longer prompt, yet sooner: the cache
    total = region.counters().modelled_ttft_seconds_total
    assert total * 1000 == pytest.approx(sum(modelled(h) for h in (cold, warm, other)), abs=0.01)


async def test_completions_prompts_are_modelled(post: Post) -> None:
    async with FakeRegion(kv_capacity_blocks=16) as region:
        ids = list(range(40))
        _, headers, _ = await post(region, "/v1/completions", {"prompt": ids})
        assert kv(headers) == (40, 0)
        _, headers, _ = await post(region, "/v1/completions", {"prompt": [*ids, 1, 2]})
        assert kv(headers) == (42, 32)
        # Words longer than four characters are cut into four-character pieces.
        _, headers, _ = await post(region, "/v1/completions", {"prompt": "abcdefghij klm"})
        assert kv(headers) == (4, 0)
        # Odd shapes are answered, not crashed on.
        odd = [
            1,
            "loose",
            {"role": 5, "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "user", "content": [{"type": "text", "text": "hi you"}, {"type": "x"}]},
            {"role": "user", "content": {"weird": True}},
        ]
        status, headers, _ = await post(region, CHAT, chat(odd))  # type: ignore[arg-type]
        assert status == 200
        assert kv(headers)[0] == 1 + 1 + (1 + 1) + (1 + 2 + 1) + (1 + 1)
        # Embeddings are outside the model.
        status, headers, _ = await post(region, "/v1/embeddings", {"input": "abc"})
        assert status == 200
        assert "x-fake-kv-prompt-tokens" not in headers


# -- the queue ----------------------------------------------------------------------------


async def hold_one(region: FakeRegion, fmt: str = "TEXT") -> tuple[httpx.AsyncClient, str]:
    """Start a request that takes a slot and keeps it: its client must close to free it.

    Returns the client (closing it drops the connection) and the request's own
    ``endpoint-load-metrics`` header.
    """
    region.behavior.fault = "stall_body"
    client = httpx.AsyncClient(http1=False, http2=True, base_url=region.url, timeout=HANG)
    request = client.build_request(
        "POST",
        CHAT,
        json=chat(TURN_1, stream=True),
        headers={"endpoint-load-metrics-format": fmt},
    )
    response = await client.send(request, stream=True)
    assert response.status_code == 200
    region.behavior.fault = None
    return client, response.headers["endpoint-load-metrics"]


async def test_queue_beyond_max_running_is_reported() -> None:
    async with (
        FakeRegion(name="q", kv_capacity_blocks=10, max_running=1) as region,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as h1,
        httpx.AsyncClient(http1=False, http2=True, base_url=region.url, timeout=HANG) as h2c,
    ):
        holder, own = await hold_one(region)
        # It holds the blocks of 41 prompt + 8 completion tokens: 4 of 10.
        assert parse_orca(own) == {
            "kv_cache_usage_perc": 0.4,
            "num_requests_waiting": 0.0,
            "num_requests_running": 1.0,
        }

        async def over_h1(messages: list[dict[str, str]]) -> tuple[int, Mapping[str, str]]:
            async with h1.post(
                region.url + CHAT,
                json=chat(messages),
                headers={"endpoint-load-metrics-format": "TEXT"},
            ) as response:
                await response.read()
                return response.status, response.headers

        async def over_h2(messages: list[dict[str, str]]) -> tuple[int, Mapping[str, str]]:
            response = await h2c.post(
                CHAT, json=chat(messages), headers={"endpoint-load-metrics-format": "json"}
            )
            return response.status_code, response.headers

        second = asyncio.create_task(over_h1(OTHER))
        await region.wait_until(lambda c: c.requests_waiting == 1, timeout=HANG)
        third = asyncio.create_task(over_h2(conversation("t", 20)))
        counters = await region.wait_until(lambda c: c.requests_waiting == 2, timeout=HANG)
        assert counters.requests_running == 1
        assert counters.peak_requests_waiting == 2

        metrics = (await h2c.get("/metrics")).text
        samples = prometheus(metrics)
        assert samples["vllm:num_requests_waiting"] == (
            "gauge",
            {"engine": "0", "model_name": "fake-llm"},
            2.0,
        )
        assert samples["vllm:num_requests_running"][2] == 1.0
        assert samples["vllm:kv_cache_usage_perc"][2] == 0.4

        await holder.aclose()  # the slot passes to the second request, then the third
        (status2, headers2), (status3, headers3) = await asyncio.gather(second, third)
        assert status2 == status3 == 200
        assert headers2["endpoint-load-metrics"] == (
            "TEXT named_metrics.kv_cache_usage_perc=0.4, "
            "named_metrics.num_requests_waiting=1.0, named_metrics.num_requests_running=1.0"
        )
        # 21 prompt + 8 completion tokens: 2 blocks.
        assert headers3["endpoint-load-metrics"] == (
            'JSON {"named_metrics": {"kv_cache_usage_perc": 0.2, '
            '"num_requests_waiting": 0.0, "num_requests_running": 1.0}}'
        )
        assert float(headers2["x-fake-queue-ms"]) >= 0.0
        assert float(headers3["x-fake-queue-ms"]) >= 0.0

        counters = await region.wait_until(lambda c: c.in_flight == 0, timeout=HANG)
        assert counters.requests_running == counters.requests_waiting == 0
        assert counters.kv_blocks_in_use == 0
        assert counters.kv_cache_usage == 0.0
        assert counters.cancelled_total == 1
        samples = prometheus((await h2c.get("/metrics")).text)
        assert samples["vllm:num_requests_waiting"][2] == 0.0
        assert samples["vllm:num_requests_running"][2] == 0.0


@pytest.mark.parametrize("status", [429, 503])
async def test_full_queue_is_refused(status: int) -> None:
    async with (
        FakeRegion(max_running=1, max_queue=1, queue_full_status=status) as region,
        httpx.AsyncClient(http1=False, http2=True, base_url=region.url, timeout=HANG) as h2c,
    ):
        holder, _ = await hold_one(region)
        queued = asyncio.create_task(h2c.post(CHAT, json=chat(OTHER)))
        await region.wait_until(lambda c: c.requests_waiting == 1, timeout=HANG)

        refused = await h2c.post(
            CHAT, json=chat(OTHER), headers={"endpoint-load-metrics-format": "TEXT"}
        )
        assert refused.status_code == status
        assert "already waiting" in refused.json()["error"]["message"]
        assert parse_orca(refused.headers["endpoint-load-metrics"])["num_requests_waiting"] == 1.0
        assert "x-fake-kv-prompt-tokens" not in refused.headers
        assert region.counters().queue_rejected_total == 1

        await holder.aclose()
        assert (await queued).status_code == 200
        counters = await region.wait_until(lambda c: c.in_flight == 0, timeout=HANG)
        assert counters.requests_running == 0
        # The refused request never got a slot, so its prompt was not counted.
        assert counters.prompt_tokens_total == 41 + 41


async def test_queued_request_whose_client_leaves_gives_up_its_place() -> None:
    async with (
        FakeRegion(max_running=1) as region,
        httpx.AsyncClient(http1=False, http2=True, base_url=region.url, timeout=HANG) as h2c,
    ):
        holder, _ = await hold_one(region)
        leaving = httpx.AsyncClient(http1=False, http2=True, base_url=region.url, timeout=HANG)
        gone = asyncio.create_task(leaving.post(CHAT, json=chat(OTHER)))
        await region.wait_until(lambda c: c.requests_waiting == 1, timeout=HANG)
        staying = asyncio.create_task(h2c.post(CHAT, json=chat(TURN_1)))
        await region.wait_until(lambda c: c.requests_waiting == 2, timeout=HANG)

        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        await leaving.aclose()
        counters = await region.wait_until(lambda c: c.requests_waiting == 1, timeout=HANG)
        assert counters.requests_running == 1

        await holder.aclose()
        assert (await staying).status_code == 200
        counters = await region.wait_until(lambda c: c.in_flight == 0, timeout=HANG)
        assert counters.requests_running == counters.requests_waiting == 0
        assert counters.cancelled_total == 2


# -- load reports ---------------------------------------------------------------------------


async def test_load_header_formats(post: Post) -> None:
    async with FakeRegion(kv_capacity_blocks=100) as region:
        # 41 + 8 tokens: 4 blocks of 100.
        await settled(region)
        _, headers, _ = await post(
            region, CHAT, chat(TURN_1), headers={"endpoint-load-metrics-format": "TEXT"}
        )
        assert headers["endpoint-load-metrics"] == (
            "TEXT named_metrics.kv_cache_usage_perc=0.04, "
            "named_metrics.num_requests_waiting=0.0, named_metrics.num_requests_running=1.0"
        )
        await settled(region)
        _, headers, _ = await post(
            region, CHAT, chat(TURN_1), headers={"endpoint-load-metrics-format": "json"}
        )
        value = headers["endpoint-load-metrics"]
        assert value.startswith("JSON ")
        assert json.loads(value.removeprefix("JSON ")) == {
            "named_metrics": {
                "kv_cache_usage_perc": 0.04,
                "num_requests_waiting": 0.0,
                "num_requests_running": 1.0,
            }
        }
        # As in vLLM: no header unless asked, and none for a format it does not know.
        await settled(region)
        _, headers, _ = await post(region, CHAT, chat(TURN_1))
        assert "endpoint-load-metrics" not in headers
        await settled(region)
        _, headers, _ = await post(
            region, CHAT, chat(TURN_1), headers={"endpoint-load-metrics-format": "BINARY"}
        )
        assert "endpoint-load-metrics" not in headers
        # Streams carry it too, and other endpoints never do.
        await settled(region)
        _, headers, _ = await post(
            region,
            "/v1/completions",
            {"prompt": "hello", "stream": True},
            headers={"endpoint-load-metrics-format": "TEXT"},
        )
        assert parse_orca(headers["endpoint-load-metrics"])["num_requests_running"] == 1.0
        await settled(region)
        _, headers, _ = await post(
            region,
            "/v1/embeddings",
            {"input": "x"},
            headers={"endpoint-load-metrics-format": "TEXT"},
        )
        assert "endpoint-load-metrics" not in headers


async def test_load_metrics_always(post: Post) -> None:
    async with FakeRegion(load_metrics_always="JSON") as region:
        _, headers, _ = await post(region, CHAT, chat(TURN_1))
        assert parse_orca(headers["endpoint-load-metrics"]) == {
            "kv_cache_usage_perc": 0.0,
            "num_requests_waiting": 0.0,
            "num_requests_running": 1.0,
        }
        assert headers["endpoint-load-metrics"].startswith("JSON {")
        await settled(region)
        _, headers, _ = await post(
            region, CHAT, chat(TURN_1), headers={"endpoint-load-metrics-format": "TEXT"}
        )
        assert headers["endpoint-load-metrics"].startswith("TEXT named_metrics.")


@pytest.mark.parametrize("fmt", ["TEXT", "JSON"])
@pytest.mark.parametrize("fault", sorted(LOAD_METRICS_FAULTS - {"many"}))
async def test_spoiled_load_header(post: Post, fault: str, fmt: str) -> None:
    behavior = Behavior(load_metrics_fault=fault)  # type: ignore[arg-type]
    async with FakeRegion(behavior=behavior) as region:
        _, headers, _ = await post(
            region, CHAT, chat(TURN_1), headers={"endpoint-load-metrics-format": fmt}
        )
    value = headers["endpoint-load-metrics"]
    if fault in ("garbage", "empty", "no_prefix", "wrong_type"):
        with pytest.raises((ValueError, KeyError)):
            parse_orca(value)
        if fault == "empty":
            assert value == fmt
        elif fault == "no_prefix":
            assert not value.startswith(("TEXT", "JSON"))
        else:
            assert value.startswith(fmt + " ")
        return
    metrics = parse_orca(value)
    assert set(metrics) == {"kv_cache_usage_perc", "num_requests_waiting", "num_requests_running"}
    if fault == "huge":
        assert all(v == 1e308 for v in metrics.values())
    elif fault == "nan":
        assert all(math.isnan(v) for v in metrics.values())
    elif fault == "inf":
        assert all(v == math.inf for v in metrics.values())
    else:
        assert fault == "negative"
        assert all(v < 0 for v in metrics.values())


async def test_spoiled_load_header_sent_unasked_and_with_many_fields() -> None:
    behavior = Behavior(load_metrics_fault="many")
    async with (
        FakeRegion(behavior=behavior) as region,
        # The default limit of a header line (8 kB) would refuse this one.
        aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=HANG), max_field_size=2**20
        ) as h1,
    ):
        async with h1.post(region.url + CHAT, json=chat(TURN_1)) as response:
            assert response.status == 200
            value = response.headers["endpoint-load-metrics"]
        metrics = parse_orca(value)  # TEXT when the request asks for nothing
        assert len(metrics) == 10_000
        assert metrics["num_requests_running"] == 1.0

        # Over HTTP/2 too, to a client whose header list limit (64 kB by default) is raised.
        value = await h2_header(
            region, "endpoint-load-metrics", {"endpoint-load-metrics-format": "JSON"}
        )
        assert len(parse_orca(value)) == 10_000

        region.behavior.load_metrics_fault = None
        async with h1.post(region.url + CHAT, json=chat(TURN_1)) as response:
            assert "endpoint-load-metrics" not in response.headers


async def h2_header(region: FakeRegion, name: str, headers: dict[str, str]) -> str:
    """One chat request over a bare h2 connection that accepts any header size."""
    reader, writer = await asyncio.open_connection(region.host, region.port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.decoder.max_header_list_size = 2**24
    conn.initiate_connection()
    request = [(":method", "POST"), (":path", CHAT), (":scheme", "http"), (":authority", "x")]
    conn.send_headers(1, request + list(headers.items()))
    conn.send_data(1, json.dumps(chat(TURN_1)).encode(), end_stream=True)
    writer.write(conn.data_to_send())
    try:
        while True:
            data = await asyncio.wait_for(reader.read(2**16), HANG)
            assert data, "the region closed the connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    received = {bytes(k): bytes(v) for k, v in event.headers or []}
                    return received[name.encode()].decode("latin-1")
            writer.write(conn.data_to_send())
    finally:
        writer.close()
        await writer.wait_closed()


async def test_metrics_endpoint_vllm_and_sglang() -> None:
    async with (
        FakeRegion(model="llama-x", kv_capacity_blocks=8) as vllm,
        FakeRegion(model="llama-y", kv_capacity_blocks=8, metrics_flavor="sglang") as sglang,
        httpx.AsyncClient(http1=False, http2=True, timeout=HANG) as h2c,
    ):
        for region in (vllm, sglang):
            await h2c.post(region.url + CHAT, json=chat(TURN_1))
            await h2c.post(region.url + CHAT, json=chat(TURN_2))
            await settled(region)

        response = await h2c.get(vllm.url + "/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        samples = prometheus(response.text)
        labels = {"engine": "0", "model_name": "llama-x"}
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
            assert samples[name] == ("gauge", labels, 0.0)
        assert samples["vllm:kv_cache_usage_perc"] == ("gauge", labels, 0.0)
        assert samples["vllm:prompt_tokens_total"] == ("counter", labels, 41.0 + 48.0)
        assert samples["vllm:prefix_cache_queries_total"][2] == 89.0
        assert samples["vllm:prefix_cache_hits_total"][2] == 32.0
        assert samples["vllm:generation_tokens_total"][2] == 16.0
        assert not any(name.startswith("sglang:") for name in samples)

        response = await h2c.get(sglang.url + "/metrics")
        samples = prometheus(response.text)
        labels = {"model_name": "llama-y"}
        assert samples["sglang:num_queue_reqs"] == ("gauge", labels, 0.0)
        assert samples["sglang:num_running_reqs"] == ("gauge", labels, 0.0)
        assert samples["sglang:token_usage"] == ("gauge", labels, 0.0)
        assert samples["sglang:cache_hit_rate"][2] == pytest.approx(32 / 89)
        assert not any(name.startswith("vllm:") for name in samples)

        assert (await h2c.post(vllm.url + "/metrics")).status_code == 405
        assert vllm.requests_by_path == {CHAT: 2, "/metrics": 2}


# -- configuration ---------------------------------------------------------------------------


def test_configuration_is_validated() -> None:
    for bad in (
        {"kv_capacity_blocks": -1},
        {"kv_block_size": 0},
        {"max_running": -1},
        {"max_queue": -1},
        {"queue_full_status": 200},
        {"load_metrics_always": "XML"},
        {"metrics_flavor": "tgi"},
    ):
        with pytest.raises(ValueError):
            FakeRegion(**bad)
    with pytest.raises(ValueError):
        Behavior(load_metrics_fault="boom")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Behavior(ttft_per_cached_token=-1.0)
    assert Behavior().copy(ttft_per_uncached_token=0.0002).ttft_per_uncached_token == 0.0002


async def test_control_reports_and_changes_the_model() -> None:
    async with (
        FakeRegion(kv_capacity_blocks=8, max_running=2, max_queue=3) as region,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as h1,
    ):
        async with h1.post(
            region.url + "/_control", json={"ttft_per_uncached_token": 0.0001}
        ) as response:
            state = await response.json()
        assert state["llm"] == {
            "kv_capacity_blocks": 8,
            "kv_block_size": 16,
            "max_running": 2,
            "max_queue": 3,
            "queue_full_status": 503,
            "load_metrics_always": None,
            "metrics_flavor": "vllm",
        }
        assert state["behavior"]["ttft_per_uncached_token"] == 0.0001
        async with h1.post(region.url + CHAT, json=chat(TURN_1)) as response:
            assert response.headers["x-fake-ttft-ms"] == "4.100"
        async with h1.get(region.url + "/_control") as response:
            counters = (await response.json())["counters"]
        assert counters["kv_cache_blocks"] == 2
        assert counters["prompt_tokens_total"] == 41
        async with h1.post(region.url + "/_control/clear-kv-cache") as response:
            assert (await response.json())["counters"]["kv_cache_blocks"] == 0
        async with h1.post(region.url + "/_control", json={"load_metrics_fault": "x"}) as response:
            assert response.status == 400


def test_command_line_model() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgeproxy.testing", "--port", str(port)]
        + ["--kv-capacity-blocks", "8", "--max-running", "2", "--max-queue", "4"]
        + ["--ttft-per-uncached-token", "0.0002", "--load-metrics-always", "TEXT"]
        + ["--metrics-flavor", "sglang", "--model", "cli-llm"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == f"listening on http://127.0.0.1:{port}\n", line
        url = line.split()[-1]
        request = urllib.request.Request(
            url + CHAT, data=json.dumps(chat(TURN_1)).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=HANG) as response:
            assert response.headers["x-fake-ttft-ms"] == "8.200"
            load = parse_orca(response.headers["endpoint-load-metrics"])
            assert load["kv_cache_usage_perc"] == 0.5  # 4 blocks of 8
        with urllib.request.urlopen(url + "/metrics", timeout=HANG) as response:
            samples = prometheus(response.read().decode())
        assert samples["sglang:num_queue_reqs"] == ("gauge", {"model_name": "cli-llm"}, 0.0)
        with urllib.request.urlopen(url + "/_control", timeout=HANG) as response:
            state = json.load(response)
        assert state["llm"]["max_queue"] == 4
        assert state["counters"]["prompt_tokens_total"] == 41
    finally:
        proc.terminate()
        proc.wait(timeout=HANG)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
