"""The semantic cache's model verifier: a model's ``yes`` keeps a hit the rule verifier
passed; its ``no``, an unclear reply, a failure or no verdict in time make it a miss, never
a failed request; off (the default) it is never asked.

The model is a judge region (a small server answering ``/v1/chat/completions`` with the
verdict a test sets), reached by model name through the catalog, or the generated tiny
local model for the wiring (it answers gibberish, so only its being asked is checked)."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from edgeproxy import EdgeProxy
from edgeproxy._cache.semantic_model import (
    ModelVerifier,
    parse_verdict,
    verifier_messages,
)
from edgeproxy._core.config import Config, config_from_mapping

from .conftest import ProxyFactory, RegionFactory, eventually, proxy_config

pytest.importorskip("wordllama", reason="the semantic extra (wordllama) is not installed")

CHAT = "/v1/chat/completions"
QUESTION = "How do I enable two-factor authentication on my account?"
PARAPHRASE = "How can I turn on two-factor authentication for my account?"
NEAR_MISS = "How do I disable two-factor authentication on my account?"


@dataclass
class Judge:
    """A region serving the model ``judge``: its reply, status and delay are the test's."""

    reply: str = "yes"
    status: int = 200
    delay: float = 0.0
    asked: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.asked.append(body)
        if self.delay:
            await asyncio.sleep(self.delay)
        answer = {
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": self.reply}}],
        }
        return web.json_response(answer, status=self.status)


async def healthy(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def judge() -> AsyncIterator[Judge]:
    state = Judge()
    app = web.Application()
    app.router.add_post(CHAT, state.chat)
    app.router.add_get("/healthz", healthy)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    state.url = f"http://127.0.0.1:{port}"
    yield state
    await runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def body(question: str) -> dict[str, Any]:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": question}]}


async def start(
    make_region: RegionFactory, make_proxy: ProxyFactory, judge: Judge, **cache: Any
) -> tuple[EdgeProxy, Any]:
    region = await make_region("r1", tokens=6)
    proxy = await make_proxy(
        [
            {"name": "r1", "url": region.url, "models": ["m"]},
            # HTTP/1.1: the judge is an aiohttp server, without h2c.
            {"name": "judge", "url": judge.url, "models": ["judge"], "http2": False},
        ],
        cache={"xfetch_beta": 0.0, **cache},
        routes=[{"name": "llm", "path": "/v1/", "semantic_cache": True}],
    )
    return proxy, region


async def ask(
    client: aiohttp.ClientSession, proxy: EdgeProxy, question: str
) -> tuple[int, str, bytes]:
    async with client.post(proxy.url + CHAT, json=body(question)) as resp:
        return resp.status, resp.headers["X-Edgeproxy-Cache"], await resp.read()


def semantic(proxy: EdgeProxy) -> dict[str, Any]:
    found = proxy.status()["cache"]["semantic"]
    assert isinstance(found, dict)
    return found


async def cached_then_paraphrase(
    client: aiohttp.ClientSession, proxy: EdgeProxy
) -> tuple[int, str]:
    await ask(client, proxy, QUESTION)
    await eventually(lambda: semantic(proxy)["entries"] == 1)
    status, outcome, _ = await ask(client, proxy, PARAPHRASE)
    return status, outcome


def region_calls(region: Any) -> int:
    return int(region.counters().requests_by_path.get(CHAT, 0))


VERIFIER = {"semantic_model_verifier": "region", "semantic_verifier_model": "judge"}


async def test_off_by_default_the_model_is_never_asked(
    make_region: RegionFactory, make_proxy: ProxyFactory, judge: Judge, client: Any
) -> None:
    bare = {"regions": [{"name": "r", "url": "http://127.0.0.1:1"}]}
    assert Config.from_mapping(bare, environ={}).cache.semantic_model_verifier == "off"
    proxy, region = await start(make_region, make_proxy, judge)
    status, outcome = await cached_then_paraphrase(client, proxy)
    assert (status, outcome) == (200, "SEMANTIC-HIT")
    assert judge.asked == []
    assert "model_verifier" not in semantic(proxy)


async def test_a_yes_keeps_the_hit(
    make_region: RegionFactory, make_proxy: ProxyFactory, judge: Judge, client: Any
) -> None:
    judge.reply = "Yes."
    proxy, region = await start(make_region, make_proxy, judge, **VERIFIER)
    status, outcome = await cached_then_paraphrase(client, proxy)
    assert (status, outcome) == (200, "SEMANTIC-HIT")
    assert region_calls(region) == 1
    [asked] = judge.asked
    assert asked["model"] == "judge" and asked["temperature"] == 0
    assert asked["max_tokens"] <= 8 and asked["stream"] is False
    prompt = asked["messages"][-1]["content"]
    assert QUESTION in prompt and PARAPHRASE in prompt
    assert semantic(proxy)["model_verifier"]["verdicts"]["yes"] == 1


async def test_a_no_turns_the_would_be_hit_into_a_miss(
    make_region: RegionFactory, make_proxy: ProxyFactory, judge: Judge, client: Any
) -> None:
    judge.reply = "No"
    proxy, region = await start(make_region, make_proxy, judge, **VERIFIER)
    status, outcome = await cached_then_paraphrase(client, proxy)
    assert (status, outcome) == (200, "MISS")
    assert region_calls(region) == 2 and len(judge.asked) == 1
    found = semantic(proxy)
    assert found["model_verifier"]["verdicts"]["no"] == 1
    assert found["hits"] == 0 and found["misses"] >= 1


async def test_a_candidate_the_rules_reject_is_not_put_to_the_model(
    make_region: RegionFactory, make_proxy: ProxyFactory, judge: Judge, client: Any
) -> None:
    proxy, _ = await start(make_region, make_proxy, judge, **VERIFIER)
    await ask(client, proxy, QUESTION)
    await eventually(lambda: semantic(proxy)["entries"] == 1)
    _, outcome, _ = await ask(client, proxy, NEAR_MISS)
    assert outcome == "MISS" and judge.asked == []


@pytest.mark.parametrize(
    ("change", "verdict"),
    [
        ({"delay": 5.0}, "timeout"),
        ({"status": 500}, "error"),
        ({"reply": "Both questions ask about the same thing."}, "unclear"),
    ],
)
async def test_no_verdict_is_a_miss_never_a_failed_request(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    judge: Judge,
    client: Any,
    change: dict[str, Any],
    verdict: str,
) -> None:
    for name, value in change.items():
        setattr(judge, name, value)
    proxy, region = await start(
        make_region, make_proxy, judge, **VERIFIER, semantic_verifier_timeout=0.2
    )
    status, outcome = await cached_then_paraphrase(client, proxy)
    assert (status, outcome) == (200, "MISS")
    assert region_calls(region) == 2
    assert semantic(proxy)["model_verifier"]["verdicts"][verdict] == 1


async def test_verdicts_are_in_the_metrics(
    make_region: RegionFactory, make_proxy: ProxyFactory, judge: Judge, client: Any
) -> None:
    judge.reply = "no"
    proxy, _ = await start(make_region, make_proxy, judge, **VERIFIER)
    await cached_then_paraphrase(client, proxy)
    async with client.get(proxy.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert 'edgeproxy_semantic_cache_model_verdicts_total{verdict="no"} 1.0' in text
    assert 'edgeproxy_semantic_cache_model_verdicts_total{verdict="yes"} 0.0' in text
    assert "edgeproxy_semantic_cache_model_verifier_seconds_count 1.0" in text


async def test_a_model_no_region_serves_is_an_error_verdict(
    make_region: RegionFactory, make_proxy: ProxyFactory, judge: Judge, client: Any
) -> None:
    proxy, _ = await start(
        make_region,
        make_proxy,
        judge,
        semantic_model_verifier="region",
        semantic_verifier_model="nobody-serves-this",
    )
    status, outcome = await cached_then_paraphrase(client, proxy)
    assert (status, outcome) == (200, "MISS") and judge.asked == []
    assert semantic(proxy)["model_verifier"]["verdicts"]["error"] == 1


# -- the parts -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [
        ("yes", "yes"),
        ("Yes.", "yes"),
        (" **YES**", "yes"),
        ('"yes", both ask the same', "yes"),
        ("\nNo", "no"),
        ("no.", "no"),
        ("Nope", "unclear"),
        ("I think yes", "unclear"),
        ("yesterday", "unclear"),
        ("", "unclear"),
        ("...", "unclear"),
    ],
)
def test_replies_are_read_by_their_first_word(reply: str, verdict: str) -> None:
    assert parse_verdict(reply) == verdict


def test_the_prompt_names_both_questions_and_cuts_long_ones() -> None:
    messages = verifier_messages("a" * 5000, "What is 2+2?")
    assert messages[0]["role"] == "system" and messages[-1]["role"] == "user"
    assert "What is 2+2?" in messages[-1]["content"]
    assert len(messages[-1]["content"]) < 2 * 2000 + 200


class _Asker:
    name = "fake"

    def __init__(self, reply: str | Exception) -> None:
        self.reply = reply

    async def ask(self, messages: list[dict[str, str]]) -> str:
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


@pytest.mark.parametrize(
    ("reply", "verdict", "same"),
    [("Yes", "yes", True), ("no", "no", False), (RuntimeError("down"), "error", False)],
)
async def test_the_verifier_counts_each_verdict(
    reply: str | Exception, verdict: str, same: bool
) -> None:
    verifier = ModelVerifier(_Asker(reply), timeout=1.0)
    assert await verifier.same("a", "b") is same
    snapshot = verifier.snapshot()
    assert snapshot["verdicts"][verdict] == 1 and sum(snapshot["verdicts"].values()) == 1


def test_config_needs_a_model_for_a_region_and_a_local_model_for_local() -> None:
    regions = [{"name": "r", "url": "http://127.0.0.1:1"}]
    with pytest.raises(ValueError, match="semantic_verifier_model"):
        config_from_mapping({"regions": regions, "cache": {"semantic_model_verifier": "region"}})
    with pytest.raises(ValueError, match="local_model"):
        config_from_mapping({"regions": regions, "cache": {"semantic_model_verifier": "local"}})


@pytest.mark.model
@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None,
    reason="the local model needs llama-cpp-python, and building it gguf",
)
async def test_the_local_model_is_asked_and_its_reply_decides(
    make_region: RegionFactory, client: Any
) -> None:
    from edgeproxy.testing import tiny_llama_gguf

    region = await make_region("r1", tokens=6)
    data = proxy_config(
        [{"name": "r1", "url": region.url}],
        cache={"xfetch_beta": 0.0, "semantic_model_verifier": "local"},
        local_model={"path": str(tiny_llama_gguf("Q4_0")), "n_ctx": 512, "max_tokens": 32},
    )
    data["routes"] = [{"name": "llm", "path": "/v1/", "semantic_cache": True}]
    proxy = EdgeProxy(Config.from_mapping(data, environ={}))
    await proxy.start()
    try:
        local = proxy.pipeline.fallback.local
        await eventually(lambda: local.state == "ready")
        status, outcome = await cached_then_paraphrase(client, proxy)
        verdicts = semantic(proxy)["model_verifier"]["verdicts"]
        # Asked once, and answered: the tiny model's reply is gibberish, so its verdict is
        # whatever it read, and the outcome follows it.
        assert sum(verdicts.values()) == 1
        assert verdicts["error"] == verdicts["timeout"] == 0, verdicts
        assert status == 200
        assert outcome == ("SEMANTIC-HIT" if verdicts["yes"] else "MISS")
        # The slot came back once the verdict was in.
        await eventually(lambda: local.busy == 0)
    finally:
        await proxy.stop(grace=2.0)


def test_regions_asked_follow_the_catalog_and_its_aliases() -> None:
    from edgeproxy._cache.semantic_model import RegionAsker

    class Region:
        def __init__(self, name: str, aliases: dict[str, str]) -> None:
            self.name = name
            self.endpoints = [type("E", (), {"state": "up"})()]
            self.credential_headers: list[tuple[str, str]] = []
            self.config = type("C", (), {"model_aliases": aliases})()

    a, b = Region("a", {}), Region("b", {"judge": "judge-v2"})
    asker = RegionAsker([a, b], "judge", serving=lambda model: frozenset({"b"}))
    assert [region.name for _, region in asker._endpoints()] == ["b"]
    asker = RegionAsker([a, b], "judge")
    assert [region.name for _, region in asker._endpoints()] == ["a", "b"]
    assert asker.model_for(a) == "judge" and asker.model_for(b) == "judge-v2"
