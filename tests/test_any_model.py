"""Regions that answer any model name: llama.cpp's servers (recognised from their own
``GET /v1/models``) and regions with ``serves_any_model = true`` are sent the names no
region lists, after the regions that list a name; a model no region serves is a 404 that
names the models served and the key that maps a name to one; the start-up log names what
each region was learnt to serve.

Hand-written aiohttp regions answer ``/v1/models`` with the exact JSON of llama-cpp-python's
server (``llama_cpp/server/app.py``: ``owned_by: "me"``, the model file's path as its id)
and of llama.cpp's ``llama-server`` (``owned_by: "llamacpp"``; in router mode each entry
with a ``status``); fake regions (vLLM's list, ``owned_by`` not a server's) stand for
servers that route by name; the last tests run the real llama-cpp-python server.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from edgeproxy import EdgeProxy
from edgeproxy._upstream.catalog import answers_any_name, few_names
from edgeproxy.testing import FakeRegion

from .conftest import CustomRegion, LlamaServers, ProxyFactory, RegionFactory, needs_llama_server

CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
GGUF = "/srv/models/qwen2.5-0.5b-instruct-q4_k_m.gguf"
HI = [{"role": "user", "content": "hi"}]

# llama-cpp-python's answer, as its app.py writes it for a server started with --model.
LLAMA_CPP_PYTHON: dict[str, Any] = {
    "object": "list",
    "data": [{"id": GGUF, "object": "model", "owned_by": "me", "permissions": []}],
}
# llama-server holding one model (tools/server: engine_models / handle_models).
LLAMA_SERVER: dict[str, Any] = {
    "models": [{"name": GGUF, "model": GGUF, "modified_at": "", "size": "", "digest": ""}],
    "object": "list",
    "data": [
        {
            "id": GGUF,
            "aliases": [],
            "tags": [],
            "object": "model",
            "created": 1735689600,
            "owned_by": "llamacpp",
            "meta": {"vocab_type": 2, "n_vocab": 151936, "n_ctx_train": 32768},
        }
    ],
}
# llama-server's router mode: several models, each with its status; it routes by name.
LLAMA_ROUTER: dict[str, Any] = {
    "data": [
        {
            "id": name,
            "object": "model",
            "owned_by": "llamacpp",
            "created": 1735689600,
            "status": {"value": "unloaded"},
        }
        for name in ("qwen", "llama")
    ],
    "object": "list",
}
# vLLM's list (and the fake regions'): a server that routes by name.
VLLM: dict[str, Any] = {
    "object": "list",
    "data": [{"id": "alpha", "object": "model", "owned_by": "vllm", "max_model_len": 8192}],
}


def entries(listing: dict[str, Any]) -> tuple[list[dict[str, Any]], bytes]:
    from edgeproxy._protocol.modelnames import parse_model_list

    body = orjson.dumps(listing)
    return parse_model_list(body), body


def test_llama_cpp_servers_are_recognised_by_their_lists() -> None:
    assert answers_any_name(*entries(LLAMA_CPP_PYTHON)) == "llama-cpp-python's server"
    assert answers_any_name(*entries(LLAMA_SERVER)) == "llama.cpp's llama-server"
    # With an alias, llama-cpp-python still answers any name with its model.
    aliased = {"data": [{"id": "qwen", "object": "model", "owned_by": "me", "permissions": []}]}
    assert answers_any_name(*entries(aliased)) == "llama-cpp-python's server"
    routes_by_name: dict[str, Any]
    for routes_by_name in (LLAMA_ROUTER, VLLM, {"data": []}):
        assert answers_any_name(*entries(routes_by_name)) is None
    # One llama-server entry among others' is not llama-server's own list.
    mixed = {"data": [*LLAMA_SERVER["data"], *VLLM["data"]]}
    assert answers_any_name(*entries(mixed)) is None


def test_few_names_shows_five_then_counts() -> None:
    assert few_names([]) == "none"
    assert few_names(["a"]) == "`a`"
    assert few_names(["a", "b", "c"]) == "`a`, `b` and `c`"
    assert few_names([str(i) for i in range(8)]) == "`0`, `1`, `2`, `3`, `4` and 3 more"
    assert few_names(["x" * 300]) == "`" + "x" * 128 + "...`"


def listing_region(listing: dict[str, Any], asked: list[str]) -> web.Application:
    """A region answering ``listing`` at /v1/models and any model name at chat completions
    (as llama.cpp's servers do), recording the names it was asked for."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response(listing)

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        asked.append(body.get("model"))
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": GGUF,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hello"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    app = web.Application()
    app.router.add_get(MODELS, models)
    app.router.add_post(CHAT, chat)
    return app


def learning(name: str, url: str, **keys: Any) -> dict[str, Any]:
    return {"name": name, "url": url, "learn_models": True, "http2": False, **keys}


async def chat(proxy: EdgeProxy, model: str) -> tuple[int, str, dict[str, Any]]:
    body = {"model": model, "messages": HI, "max_tokens": 2}
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=body) as resp:
            return resp.status, resp.headers["X-Edgeproxy-Region"], await resp.json()


def chats(region: FakeRegion) -> int:
    return region.requests_by_path.get(CHAT, 0)


async def test_a_llama_cpp_python_region_is_sent_every_name_no_region_lists(
    custom_region: CustomRegion,
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    asked: list[str] = []
    llama_url = await custom_region(listing_region(LLAMA_CPP_PYTHON, asked))
    vllm = await make_region("vllm", model="alpha")
    caplog.set_level(logging.INFO, logger="edgeproxy.regions")
    proxy = await make_proxy([learning("llama", llama_url), learning("vllm", vllm.url)])
    # The start-up log names what was learnt, and says the region answers any name.
    said = [r.getMessage() for r in caplog.records if r.name == "edgeproxy.regions"]
    assert (
        f"region llama serves 1 model (from its /v1/models): `{GGUF}`; it is llama-cpp-python's "
        "server, which answers any model name: it is sent the names no region lists "
        "(serves_any_model = false stops that)"
    ) in said, said
    assert "region vllm serves 1 model (from its /v1/models): `alpha`" in said, said
    # The names a client of llama.cpp uses, none of which the catalog lists but the path.
    for model in ("gpt-4o-mini", GGUF, Path(GGUF).name, Path(GGUF).stem):
        status, region, body = await chat(proxy, model)
        assert (status, region) == (200, "llama"), (model, body)
    assert asked == ["gpt-4o-mini", GGUF, Path(GGUF).name, Path(GGUF).stem]
    # A name a region lists goes to it alone: the any-name region would answer with
    # another model.
    for _ in range(4):
        status, region, _ = await chat(proxy, "alpha")
        assert (status, region) == (200, "vllm")
    assert chats(vllm) == 4 and len(asked) == 4


async def test_a_single_model_llama_server_serves_any_name_and_a_router_does_not(
    custom_region: CustomRegion, make_proxy: ProxyFactory
) -> None:
    single: list[str] = []
    router: list[str] = []
    single_url = await custom_region(listing_region(LLAMA_SERVER, single))
    router_url = await custom_region(listing_region(LLAMA_ROUTER, router))
    proxy = await make_proxy([learning("single", single_url), learning("router", router_url)])
    assert (await chat(proxy, "gpt-4o-mini"))[:2] == (200, "single")
    assert (await chat(proxy, "qwen"))[:2] == (200, "router")
    assert (single, router) == (["gpt-4o-mini"], ["qwen"])


async def test_serves_any_model_false_turns_the_recognition_off_and_the_404_says_what_is_served(
    custom_region: CustomRegion, make_proxy: ProxyFactory
) -> None:
    asked: list[str] = []
    url = await custom_region(listing_region(LLAMA_CPP_PYTHON, asked))
    proxy = await make_proxy([learning("llama", url, serves_any_model=False)])
    status, region, body = await chat(proxy, "gpt-4o-mini")
    assert (status, region) == (404, "none")
    assert body == {
        "error": {
            "message": "The model `gpt-4o-mini` does not exist or you do not have access to "
            f"it. The models served here are `{GGUF}`; an operator can map another name to "
            "one of them with the region's model_aliases.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    # The alias the message points to is the fix.
    aliased = await make_proxy(
        [learning("llama", url, serves_any_model=False, model_aliases={"gpt-4o-mini": GGUF})]
    )
    assert (await chat(aliased, "gpt-4o-mini"))[:2] == (200, "llama")
    assert asked == [GGUF]


async def test_serves_any_model_true_makes_any_region_a_candidate_after_the_listers(
    make_region: RegionFactory, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Fake regions list one model (as vLLM would), but are told to take any name.
    lister = await make_region("lister", model="alpha")
    anyone = await make_region("anyone", model="beta")
    listed = await make_region("listed", model="gamma")
    caplog.set_level(logging.INFO, logger="edgeproxy")
    proxy = await make_proxy(
        [
            {"name": "lister", "url": lister.url, "models": ["alpha", "alpha-*"]},
            {"name": "anyone", "url": anyone.url, "learn_models": True, "serves_any_model": True},
            {"name": "listed", "url": listed.url, "models": ["gamma"], "serves_any_model": True},
        ]
    )
    said = [r.getMessage() for r in caplog.records]
    assert any("region anyone serves any model name (serves_any_model)" in m for m in said)
    served: Counter[tuple[str, str]] = Counter()
    for model in ("alpha", "alpha-7b", "beta", "gamma", "delta", "delta", "delta", "delta"):
        status, region, _ = await chat(proxy, model)
        assert status == 200, model
        served[model, region] += 1
    # Each listed name goes to its listers alone; a name none lists to the any-name regions
    # (a region listing models may take any name too).
    assert served["alpha", "lister"] == served["alpha-7b", "lister"] == 1
    assert served["beta", "anyone"] == served["gamma", "listed"] == 1
    assert served["delta", "anyone"] + served["delta", "listed"] == 4
    assert chats(lister) == 2


async def test_the_404_names_five_models_then_counts_the_rest(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    names = [f"m{i}" for i in range(8)]
    proxy = await make_proxy(
        [{"name": "r1", "url": region.url, "models": names[:6], "model_aliases": {"m6": "m0"}}]
    )
    status, _, body = await chat(proxy, "gpt-5")
    assert status == 404
    assert body["error"]["message"] == (
        "The model `gpt-5` does not exist or you do not have access to it. The models served "
        "here are `m0`, `m1`, `m2`, `m3`, `m4` and 2 more; an operator can map another name "
        "to one of them with the region's model_aliases."
    )
    # /v1/models/{id} names them too.
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + MODELS + "/gpt-5") as resp:
            assert resp.status == 404
            error = (await resp.json())["error"]
    assert error["code"] == "model_not_found" and "`m0`, `m1`" in error["message"]
    assert chats(region) == 0


# -- the real llama-cpp-python server --------------------------------------------------------


class TestLlamaCppPython:
    pytestmark = needs_llama_server

    async def test_two_servers_answer_every_name_a_client_of_llama_cpp_uses(
        self,
        llama_servers: LlamaServers,
        make_proxy: ProxyFactory,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Two llama-cpp-python servers, their catalog learnt: the file's path, its name,
        its name without .gguf and an OpenAI name are each answered, by either server."""
        from edgeproxy.testing import tiny_llama_gguf

        path = str(tiny_llama_gguf("Q8_0"))
        caplog.set_level(logging.INFO, logger="edgeproxy.regions")
        a, b = await llama_servers(), await llama_servers()
        proxy = await make_proxy([learning("a", a), learning("b", b)])
        said = [r.getMessage() for r in caplog.records if r.name == "edgeproxy.regions"]
        assert any(f"serves 1 model (from its /v1/models): `{path}`" in m for m in said), said
        assert any("llama-cpp-python's server, which answers any model name" in m for m in said)
        regions: Counter[str] = Counter()
        for model in ("gpt-4o-mini", path, Path(path).name, Path(path).stem):
            status, region, body = await chat(proxy, model)
            assert status == 200, (model, body)
            assert body["choices"][0]["message"]["role"] == "assistant"
            regions[region] += 1
        assert sum(regions.values()) == 4 and set(regions) <= {"a", "b"}
