"""The local llama.cpp model: real llama.cpp on the generated tiny GGUF, behind the real proxy.

Every region in these tests is dead (a closed port), so each request falls to
the local model. Request validation is also tested on its own, without a model.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from edgeproxy import Config, EdgeProxy, hookimpl
from edgeproxy._core.config import ConfigError
from edgeproxy._core.errors import ProxyError
from edgeproxy._local.model import LocalAnswer, LocalModel, parse_generation_request

from .conftest import ProxyFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = {"model": "gpt-x", "messages": [{"role": "user", "content": "hello there"}]}

needs_llama = [
    pytest.mark.model,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None,
        reason="llama-cpp-python is not installed (pip install 'edgeproxy[local]')",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None or importlib.util.find_spec("numpy") is None,
        reason="building the test model needs gguf and numpy (pip install 'edgeproxy[testing]')",
    ),
]

LocalProxyFactory = Callable[..., Awaitable[EdgeProxy]]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from edgeproxy.testing import tiny_llama_gguf

    return tiny_llama_gguf("Q8_0")


@pytest.fixture
def local_proxy(tiny_model: Path, make_proxy: ProxyFactory) -> LocalProxyFactory:
    """A proxy whose only region is dead, with the tiny model as its local model."""

    async def factory(
        *, plugins: list[object] | None = None, wait: bool = True, **local: Any
    ) -> EdgeProxy:
        settings = {"path": str(tiny_model), "n_ctx": 512, "max_tokens": 64, **local}
        proxy = await make_proxy(
            [{"name": "dead", "url": f"http://127.0.0.1:{closed_port()}"}],
            plugins=plugins or [],
            local_model=settings,
        )
        if wait:
            local_model = proxy.pipeline.fallback.local
            await eventually(lambda: local_model.state not in ("idle", "loading"))
        return proxy

    return factory


def sse_events(raw: bytes) -> list[Any]:
    events = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            events.append(payload.decode() if payload == b"[DONE]" else orjson.loads(payload))
    return events


# -- request validation (no model needed) ----------------------------------------------


def test_empty_messages_are_a_400() -> None:
    with pytest.raises(ProxyError) as info:
        parse_generation_request(CHAT, {"messages": []})
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    assert "messages must not be empty" in info.value.message


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ([], "JSON object"),
        ({"messages": "hi"}, "messages must be a list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": 3}]}, "content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "text only",
        ),
        ({**HELLO, "temperature": 3}, "temperature"),
        ({**HELLO, "temperature": "hot"}, "temperature must be a number"),
        ({**HELLO, "top_p": 0}, "top_p"),
        ({**HELLO, "max_tokens": 0}, "max_tokens"),
        ({**HELLO, "max_tokens": True}, "max_tokens"),
        ({**HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**HELLO, "logit_bias": {"x": 1}}, "logit_bias"),
        ({**HELLO, "logit_bias": {"5": 500}}, "logit_bias"),
    ],
)
def test_bad_chat_input_names_the_field(body: Any, needle: str) -> None:
    with pytest.raises(ProxyError) as info:
        parse_generation_request(CHAT, body)
    assert info.value.status == 400
    assert needle in info.value.message


def test_completion_prompts() -> None:
    assert parse_generation_request(COMPLETIONS, {"prompt": "hi"}).prompt == "hi"
    assert parse_generation_request(COMPLETIONS, {"prompt": ["hi"]}).prompt == "hi"
    assert parse_generation_request(COMPLETIONS, {"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    for bad in ({}, {"prompt": ["a", "b"]}, {"prompt": 5}, {"prompt": []}):
        with pytest.raises(ProxyError) as info:
            parse_generation_request(COMPLETIONS, bad)
        assert info.value.status == 400 and "prompt" in info.value.message


def test_sampling_is_mapped_and_unsupported_fields_are_listed() -> None:
    req = parse_generation_request(
        CHAT,
        {
            **HELLO,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 7,
            "seed": 42,
            "max_completion_tokens": 12,
            "max_tokens": 99,
            "stop": "END",
            "presence_penalty": 0.5,
            "logit_bias": {"17": -100},
            # No effect on one local answer: accepted quietly.
            "n": 1,
            "user": "u1",
            "stream_options": {"include_usage": True},
            "response_format": {"type": "text"},
            # Would change the answer, and llama.cpp cannot: ignored, with a warning.
            "logprobs": True,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "n_extra": 3,
        },
    )
    assert req.sampling == {"temp": 0.0, "top_p": 0.5, "top_k": 7, "presence_penalty": 0.5}
    assert req.seed == 42
    assert req.max_tokens == 12  # max_completion_tokens wins, as with OpenAI
    assert req.stop == ["END"]
    assert req.logit_bias == {17: -100.0}
    assert req.ignored == ["logprobs", "n_extra", "tools"]


def test_messages_are_normalized_for_chat_templates() -> None:
    req = parse_generation_request(
        CHAT,
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None, "tool_calls": []},
            ]
        },
    )
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


def test_config_errors_name_the_key() -> None:
    regions = [{"name": "r", "url": "http://127.0.0.1:1"}]
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(
            {"regions": regions, "local_model": {"n_ctx": 256, "max_tokens": 256}}, environ={}
        )
    assert any(e.startswith("local_model:") and "n_ctx" in e for e in info.value.errors)
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(
            {"regions": regions, "local_model": {"on_overflow": "drop", "n_gpu_layers": -2}},
            environ={},
        )
    keys = {e.split(":")[0] for e in info.value.errors}
    assert {"local_model.on_overflow", "local_model.n_gpu_layers"} <= keys
    env = {"EDGEPROXY_LOCAL_MODEL__N_GPU_LAYERS": "-1", "EDGEPROXY_LOCAL_MODEL__PATH": "m.gguf"}
    config = Config.from_mapping({"regions": regions}, environ=env)
    assert config.local_model.n_gpu_layers == -1 and config.local_model.path == "m.gguf"


def test_no_model_configured_is_off() -> None:
    config = Config.from_mapping({"regions": [{"name": "r", "url": "http://h:1"}]}, environ={})
    model = LocalModel(config.local_model)
    assert model.state == "off" and not model.enabled
    assert model.snapshot()["state"] == "off"


# -- answers from the real model -------------------------------------------------------


class TestAnswers:
    pytestmark = needs_llama

    async def test_chat_json_is_marked_with_usage(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy(model_name="edge-fallback-mini")
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json={**HELLO, "max_tokens": 8}) as resp:
                assert resp.status == 200
                assert resp.headers["X-Edgeproxy-Degraded"] == "local-model"
                assert resp.headers["X-Edgeproxy-Region"] == "local"
                assert "X-Request-Id" in resp.headers
                assert "X-Edgeproxy-Warning" not in resp.headers
                body = await resp.json()
        assert body["object"] == "chat.completion"
        assert body["model"] == "edge-fallback-mini"
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"]
        # The tiny model never emits EOS (see edgeproxy.testing._gguf): it runs to max_tokens.
        assert choice["finish_reason"] == "length"
        usage = body["usage"]
        assert usage["completion_tokens"] == 8
        assert usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + 8

    async def test_chat_streams_token_by_token(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy()
        request = {
            **HELLO,
            "stream": True,
            "max_tokens": 6,
            "stream_options": {"include_usage": True},
        }
        reads = 0
        raw = b""
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json=request) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                assert resp.headers["X-Edgeproxy-Degraded"] == "local-model"
                async for chunk in resp.content.iter_any():
                    raw += chunk
                    reads += 1
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        # One event per sampled token (a piece that decodes to nothing is not sent).
        assert 1 < len(tokens) <= 6
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert all(c["model"].startswith("local/tiny-llama") for c in chunks)
        finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finish[0]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 6
        assert reads >= 2  # streamed, not written in one piece

    async def test_text_completion_with_stop_string(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy()
        async with aiohttp.ClientSession() as client:
            async with client.post(
                proxy.url + COMPLETIONS, json={"model": "m", "prompt": "the edge", "max_tokens": 10}
            ) as resp:
                assert resp.status == 200
                body = await resp.json()
            text = body["choices"][0]["text"]
            assert body["object"] == "text_completion"
            assert body["usage"]["completion_tokens"] == 10
            # Stop at a piece of the answer it gives unconstrained (seeded, greedy: the same).
            seeded = {
                "model": "m",
                "prompt": "the edge",
                "max_tokens": 10,
                "temperature": 0,
                "seed": 1,
            }
            async with client.post(proxy.url + COMPLETIONS, json=seeded) as resp:
                full = (await resp.json())["choices"][0]["text"]
            stop = full.strip()[-3:]
            async with client.post(
                proxy.url + COMPLETIONS, json={**seeded, "stop": [stop]}
            ) as resp:
                stopped = (await resp.json())["choices"][0]
        assert text
        assert stop not in stopped["text"]
        assert full.startswith(stopped["text"])
        assert stopped["finish_reason"] == "stop"

    async def test_streamed_completion(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy()
        async with aiohttp.ClientSession() as client:
            async with client.post(
                proxy.url + COMPLETIONS,
                json={"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True},
            ) as resp:
                events = sse_events(await resp.read())
        assert events[-1] == "[DONE]"
        assert all(e["object"] == "text_completion" for e in events[:-1])
        assert events[-2]["choices"][0]["finish_reason"] == "length"

    async def test_unsupported_parameters_get_a_warning_header(
        self, local_proxy: LocalProxyFactory
    ) -> None:
        proxy = await local_proxy()
        request = {**HELLO, "max_tokens": 2, "logprobs": True, "n": 3, "temperature": 0.2}
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json=request) as resp:
                assert resp.status == 200
                warning = resp.headers["X-Edgeproxy-Warning"]
                body = await resp.json()
        assert "logprobs" in warning and "n" in warning and "temperature" not in warning
        assert len(body["choices"]) == 1

    async def test_empty_messages_get_a_400(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy()
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json={"model": "m", "messages": []}) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
        # Refused at the edge, as every server refuses it (the local model's own check of
        # it is test_empty_messages_are_a_400).
        assert error["type"] == "invalid_request_error" and error["param"] == "messages"
        assert "'messages' must not be empty" in error["message"]
        assert proxy.pipeline.fallback.local.busy == 0

    async def test_overlong_prompt_is_truncated(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy(on_overflow="truncate")
        old = [{"role": "user", "content": "edge " * 600}, {"role": "assistant", "content": "ok"}]
        request = {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                *old,
                {"role": "user", "content": "the question"},
            ],
            "max_tokens": 16,
        }
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json=request) as resp:
                assert resp.status == 200
                dropped = int(resp.headers["X-Edgeproxy-Prompt-Truncated"])
                usage = (await resp.json())["usage"]
            # One message bigger than the whole context: cut to its end, token by token.
            huge = {
                **HELLO,
                "messages": [{"role": "user", "content": "proxy " * 1000}],
                "max_tokens": 16,
            }
            async with client.post(proxy.url + CHAT, json=huge) as resp:
                assert resp.status == 200
                huge_usage = (await resp.json())["usage"]
        assert dropped > 500
        assert usage["prompt_tokens"] + 16 <= 512
        assert huge_usage["prompt_tokens"] == 512 - 16

    async def test_overlong_prompt_is_refused(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy(on_overflow="refuse", max_tokens=500)
        request = {
            **HELLO,
            "messages": [{"role": "user", "content": "edge " * 600}],
            "max_tokens": 16,
        }
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json=request) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
            # A short prompt with a max_tokens that leaves it no room is refused too ...
            async with client.post(proxy.url + CHAT, json={**HELLO, "max_tokens": 500}) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["code"] == "context_length_exceeded"
            # ... while without max_tokens the answer gets what the context has left.
            async with client.post(proxy.url + CHAT, json=HELLO) as resp:
                assert resp.status == 200
                usage = (await resp.json())["usage"]
        assert error["code"] == "context_length_exceeded"
        assert "maximum context length is 512 tokens" in error["message"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 512
        local = proxy.pipeline.fallback.local
        # The slot comes back once the worker thread is done, just after the answer.
        await eventually(lambda: local.busy == 0)

    async def test_max_tokens_is_capped(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy(max_tokens=5)
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json={**HELLO, "max_tokens": 400}) as resp:
                body = await resp.json()
        assert body["usage"]["completion_tokens"] == 5

    async def test_named_chat_format_and_gpu_layers(
        self, local_proxy: LocalProxyFactory, caplog: pytest.LogCaptureFixture
    ) -> None:
        # n_gpu_layers=-1 (all) must work on a CPU-only build too: a warning, then the CPU.
        caplog.set_level(logging.WARNING, logger="edgeproxy.local_model")
        proxy = await local_proxy(chat_format="chatml", n_gpu_layers=-1)
        local = proxy.pipeline.fallback.local
        assert local.state == "ready"
        snapshot = local.snapshot()
        assert snapshot["n_gpu_layers"] == -1
        if not snapshot["gpu_offload_supported"]:
            assert any("no GPU support" in r.getMessage() for r in caplog.records)
            assert set(snapshot["layers_on_device"]) == {"CPU"}
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json={**HELLO, "max_tokens": 3}) as resp:
                assert resp.status == 200

    async def test_unknown_chat_format_fails_clearly(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy(chat_format="no-such-format")
        local = proxy.pipeline.fallback.local
        assert local.state == "failed"
        assert "unknown chat_format 'no-such-format'" in (local.error or "")

    async def test_generations_run_off_the_event_loop(self, local_proxy: LocalProxyFactory) -> None:
        proxy = await local_proxy(concurrency=2, max_tokens=200)
        local = proxy.pipeline.fallback.local
        await eventually(lambda: local.snapshot()["contexts_loaded"] == 2)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1

        tick_task = asyncio.ensure_future(ticker())
        async with aiohttp.ClientSession() as client:

            async def ask() -> dict[str, Any]:
                request = {**HELLO, "max_tokens": 200}
                async with client.post(proxy.url + CHAT, json=request) as resp:
                    return dict(await resp.json())

            answers = await asyncio.gather(ask(), ask())
        tick_task.cancel()
        assert [a["usage"]["completion_tokens"] for a in answers] == [200, 200]
        # The loop kept turning while 400 tokens were sampled: far more than once per token.
        assert ticks > 400
        assert local.answered_total == 2
        await eventually(lambda: local.busy == 0)

    async def test_client_leaving_cancels_the_generation(
        self, local_proxy: LocalProxyFactory
    ) -> None:
        from edgeproxy.testing import tiny_llama_gguf

        # A wider model, so 3000 tokens take seconds and cancellation is what ends them.
        wide = tiny_llama_gguf("Q4_0", n_embd=512, n_layer=8, n_ff=1024)
        proxy = await local_proxy(path=str(wide), n_ctx=4096, max_tokens=3500)
        local = proxy.pipeline.fallback.local
        async with aiohttp.ClientSession() as client:
            resp = await client.post(
                proxy.url + CHAT, json={**HELLO, "stream": True, "max_tokens": 3000}
            )
            await resp.content.readuntil(b"\n\n")
            await resp.content.readuntil(b"\n\n")
            assert local.busy == 1
            resp.close()  # drop the connection mid-answer
        await eventually(lambda: local.cancelled_total == 1 and local.busy == 0)
        assert local.completion_tokens_total < 3000
        await eventually(lambda: proxy.pipeline.in_flight == 0)
        # The slot is good for the next request.
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json={**HELLO, "max_tokens": 2}) as again:
                assert again.status == 200

    async def test_shutdown_stops_a_running_generation(
        self, local_proxy: LocalProxyFactory
    ) -> None:
        from edgeproxy.testing import tiny_llama_gguf

        wide = tiny_llama_gguf("Q4_0", n_embd=512, n_layer=8, n_ff=1024)
        proxy = await local_proxy(path=str(wide), n_ctx=4096, max_tokens=3500)
        local = proxy.pipeline.fallback.local
        async with aiohttp.ClientSession() as client:
            resp = await client.post(
                proxy.url + CHAT, json={**HELLO, "stream": True, "max_tokens": 3000}
            )
            await resp.content.readuntil(b"\n\n")
            # The grace period ends mid-answer: the thread is stopped, then the model freed.
            assert not await proxy.stop(grace=0.2)
            resp.close()
        assert local.state == "closed"
        assert local.completion_tokens_total < 3000


class HoldFirstAnswer:
    """Holds the first local answer in the fallback hook: its generation slot stays taken."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.calls = 0

    @hookimpl
    async def edgeproxy_fallback(self, answer: Any) -> None:
        self.calls += 1
        if self.calls == 1 and isinstance(answer, LocalAnswer):
            self.held.set()
            await self.release.wait()


class TestQueue:
    pytestmark = needs_llama

    async def test_saturated_queue_is_a_503_with_retry_after(
        self, local_proxy: LocalProxyFactory
    ) -> None:
        gate = HoldFirstAnswer()
        proxy = await local_proxy(plugins=[gate], concurrency=1, max_queue=1, max_queue_wait=0.2)
        local = proxy.pipeline.fallback.local
        async with aiohttp.ClientSession() as client:
            first = asyncio.ensure_future(client.post(proxy.url + CHAT, json=HELLO))
            await gate.held.wait()
            assert local.busy == 1
            # Waits its max_queue_wait for the one slot, then gives up.
            async with client.post(proxy.url + CHAT, json=HELLO) as resp:
                assert resp.status == 503
                assert int(resp.headers["Retry-After"]) >= 1
                error = (await resp.json())["error"]
            assert error["code"] == "local_model_busy"
            gate.release.set()
            async with await first as resp:
                assert resp.status == 200
                assert resp.headers["X-Edgeproxy-Degraded"] == "local-model"
            async with client.post(proxy.url + CHAT, json={**HELLO, "max_tokens": 2}) as resp:
                assert resp.status == 200
        assert local.rejected_total == 1
        await eventually(lambda: local.busy == 0 and local.waiting == 0)

    async def test_full_queue_rejects_at_once(self, local_proxy: LocalProxyFactory) -> None:
        gate = HoldFirstAnswer()
        proxy = await local_proxy(plugins=[gate], max_queue=0, max_queue_wait=30)
        async with aiohttp.ClientSession() as client:
            first = asyncio.ensure_future(client.post(proxy.url + CHAT, json=HELLO))
            await gate.held.wait()
            # No waiting room: refused now, not after max_queue_wait.
            async with client.post(proxy.url + CHAT, json=HELLO) as resp:
                assert resp.status == 503
                assert "Retry-After" in resp.headers
            gate.release.set()
            async with await first as resp:
                assert resp.status == 200

    async def test_waiting_request_gets_the_slot(self, local_proxy: LocalProxyFactory) -> None:
        gate = HoldFirstAnswer()
        proxy = await local_proxy(plugins=[gate], max_queue=4, max_queue_wait=60)
        local = proxy.pipeline.fallback.local
        async with aiohttp.ClientSession() as client:
            first = asyncio.ensure_future(client.post(proxy.url + CHAT, json=HELLO))
            await gate.held.wait()
            second = asyncio.ensure_future(client.post(proxy.url + CHAT, json=HELLO))
            await eventually(lambda: local.waiting == 1)
            gate.release.set()
            for pending in (first, second):
                async with await pending as resp:
                    assert resp.status == 200
        assert local.answered_total == 2 and local.rejected_total == 0


# -- startup and readiness ----------------------------------------------------------------


class TestStartup:
    pytestmark = needs_llama

    # llama-cpp-python 0.3.16's LlamaModel.__del__ raises AttributeError on a model that
    # failed to load (it never set `sampler`); Python reports it as unraisable. That is
    # the library's, not ours: the load failure itself is what this test checks.
    @pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function LlamaModel.__del__"
        ":pytest.PytestUnraisableExceptionWarning"
    )
    @pytest.mark.parametrize("kind", ["missing", "corrupt"])
    async def test_bad_model_file_is_a_warning_and_the_proxy_still_proxies(
        self,
        kind: str,
        tmp_path: Path,
        make_region: Any,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        caplog.set_level(logging.WARNING, logger="edgeproxy.local_model")
        path = tmp_path / "model.gguf"
        if kind == "corrupt":
            path.write_bytes(b"this is not a gguf file" * 100)
        region = await make_region("ap-1")
        config = Config.from_mapping(
            proxy_config([{"name": "ap-1", "url": region.url}], local_model={"path": str(path)}),
            environ={},
        )
        proxy = EdgeProxy(config)
        await proxy.start()
        try:
            local = proxy.pipeline.fallback.local
            await eventually(lambda: local.state == "failed")
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert any(str(path) in w and "cannot be used" in w for w in warnings)
            if kind == "missing":
                assert "not found" in (local.error or "")
            else:
                assert "magic" in (local.error or "") or "Failed to load" in (local.error or "")
            async with aiohttp.ClientSession() as client:
                async with client.get(proxy.admin_url + "/readyz") as resp:
                    assert resp.status == 200  # the regions answer; the model is a fallback
                    ready = await resp.json()
                assert ready["local_model"]["state"] == "failed"
                assert "local model failed" in ready["warnings"][0]
                async with client.get(proxy.admin_url + "/status") as resp:
                    status = await resp.json()
                assert status["fallback"]["local_model"]["state"] == "failed"
                async with client.post(proxy.url + CHAT, json=HELLO) as resp:
                    assert resp.status == 200
                    assert resp.headers["X-Edgeproxy-Region"] == "ap-1"
                    assert "X-Edgeproxy-Degraded" not in resp.headers
        finally:
            await proxy.stop(grace=2.0)

    async def test_readiness_can_wait_for_the_model(
        self, tiny_model: Path, make_region: Any
    ) -> None:
        region = await make_region("ap-1")
        regions = [{"name": "ap-1", "url": region.url}]
        missing = {"path": str(tiny_model) + ".missing", "ready_requires_model": True}
        proxy = EdgeProxy(
            Config.from_mapping(proxy_config(regions, local_model=missing), environ={})
        )
        await proxy.start()
        try:
            async with aiohttp.ClientSession() as client:
                async with client.get(proxy.admin_url + "/readyz") as resp:
                    assert resp.status == 503
                    body = await resp.json()
            assert any(r.startswith("local model failed") for r in body["reasons"])
        finally:
            await proxy.stop(grace=2.0)
        good = {"path": str(tiny_model), "ready_requires_model": True}
        proxy = EdgeProxy(Config.from_mapping(proxy_config(regions, local_model=good), environ={}))
        await proxy.start()
        try:
            local = proxy.pipeline.fallback.local
            await eventually(lambda: local.ready)
            async with aiohttp.ClientSession() as client:
                async with client.get(proxy.admin_url + "/readyz") as resp:
                    assert resp.status == 200
                    assert (await resp.json())["local_model"]["state"] == "ready"
        finally:
            await proxy.stop(grace=2.0)

    async def test_startup_does_not_wait_for_the_model(
        self, local_proxy: LocalProxyFactory
    ) -> None:
        proxy = await local_proxy(wait=False)
        # start() returned: the listener serves while the model may still be loading.
        assert proxy.pipeline.fallback.local.state in ("loading", "ready")
        async with aiohttp.ClientSession() as client:
            async with client.get(proxy.admin_url + "/healthz") as resp:
                assert resp.status == 200
        local = proxy.pipeline.fallback.local
        await eventually(lambda: local.ready)
        assert local.load_seconds is not None
