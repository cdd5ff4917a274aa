"""The model catalog: routing by model, globs, aliases, 404 model_not_found, /v1/models.

Through the real proxy in front of fake regions (real hypercorn), which answer
with the model the request names. To see what a region was sent, and what it
answered before the proxy renamed it, an aliased region is a second proxy in
front of a fake region, with a plugin that records its requests and chunks.
"""

from __future__ import annotations

import importlib.util
import itertools
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from edgeproxy import Config, EdgeProxy, RequestContext, hookimpl
from edgeproxy._core.config import ConfigError
from edgeproxy._protocol.modelnames import ModelMatcher, ModelRewriter
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
NO_CACHE = {"name": "all", "path": "/", "cache": "off"}

StartRegion = Callable[..., Awaitable[FakeRegion]]


def chat(model: Any, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], **extra}


def table(region: FakeRegion | str, url: str | None = None, **keys: Any) -> dict[str, Any]:
    if isinstance(region, FakeRegion):
        return {"name": region.name, "url": region.url, **keys}
    assert url is not None
    return {"name": region, "url": url, **keys}


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def chats(region: FakeRegion) -> int:
    return region.counters().requests_by_path.get(CHAT, 0)


def lists(region: FakeRegion) -> int:
    return region.counters().requests_by_path.get(MODELS, 0)


@pytest.fixture
async def start_region() -> AsyncIterator[StartRegion]:
    """Fake regions with a model of their own (listed by their /v1/models); stopped after."""
    started: list[FakeRegion] = []

    async def factory(name: str, model: str = "fake-llm") -> FakeRegion:
        region = FakeRegion(name=name, model=model)
        await region.start()
        started.append(region)
        return region

    yield factory
    for region in started:
        await region.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    client: aiohttp.ClientSession, url: str, body: Any
) -> tuple[int, dict[str, str], bytes]:
    async with client.post(url + CHAT, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def get(client: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with client.get(url) as resp:
        return resp.status, orjson.loads(await resp.read())


def events(body: bytes) -> list[dict[str, Any]]:
    """The JSON data events of an SSE body (not [DONE])."""
    found = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {"):
            found.append(orjson.loads(event[len(b"data: ") :]))
    return found


# -- matching and renaming, alone --------------------------------------------------------


def test_matcher_takes_exact_names_and_globs() -> None:
    matcher = ModelMatcher(["m1", "llama-3*", "qwen2.5-?b", "gpt-[45]o"])
    assert matcher.exact == {"m1"}
    for name in ("m1", "llama-3", "llama-3.1-8b", "qwen2.5-7b", "gpt-4o", "gpt-5o"):
        assert matcher.matches(name), name
    for name in ("m2", "M1", "llama-2", "xllama-3", "qwen2.5-14b", "gpt-6o", ""):
        assert not matcher.matches(name), name


def test_rewriter_renames_across_every_chunk_boundary() -> None:
    region = 'org/"odd"\\name'  # quotes and a backslash: matched as JSON encodes them
    sse = b"".join(
        b"data: " + orjson.dumps({"id": "c", "model": region, "n": i}) + b"\n\n" for i in range(3)
    )
    spaced = b'{"id": "c", "model": ' + orjson.dumps(region) + b', "n": 1}'
    untouched = b'{"model":"org/other","content":"\\"model\\":' + orjson.dumps(region)[1:-1] + b'"}'
    for body in (sse + b"data: [DONE]\n\n", spaced, untouched):
        expected = body.replace(
            b'"model":' + orjson.dumps(region), b'"model":"gpt-4o-mini"'
        ).replace(b'"model": ' + orjson.dumps(region), b'"model": "gpt-4o-mini"')
        assert (expected == body) == (body is untouched)
        for cuts in itertools.combinations(range(1, len(body)), 2):
            rewriter = ModelRewriter(region, "gpt-4o-mini")
            parts = [body[: cuts[0]], body[cuts[0] : cuts[1]], body[cuts[1] :]]
            out = b"".join(rewriter.feed(part) for part in parts) + rewriter.flush()
            assert out == expected, cuts


# -- config errors name the key ----------------------------------------------------------


def config_errors(**changes: Any) -> list[str]:
    regions = changes.pop("regions", [{"name": "r1", "url": "http://127.0.0.1:1"}])
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(proxy_config(regions, **changes), environ={})
    return info.value.errors


def region_errors(**keys: Any) -> list[str]:
    return config_errors(regions=[{"name": "r1", "url": "http://127.0.0.1:1", **keys}])


def test_config_errors_name_the_key() -> None:
    assert region_errors(models=["m1", ""]) == ["regions[0].models: entry 1 is empty"]
    assert region_errors(models=[" m1"]) == [
        "regions[0].models: entry 0 ' m1' has leading or trailing whitespace"
    ]
    assert region_errors(models=["m1", "m2", "m1"]) == ["regions[0].models: 'm1' is listed twice"]
    assert region_errors(models=["m1"], model_aliases={"gpt": "m2"}) == [
        "regions[0].model_aliases: alias 'gpt' targets 'm2', which is not among this "
        "region's models"
    ]
    assert region_errors(models=["m1", "gpt"], model_aliases={"gpt": "m1"}) == [
        "regions[0].model_aliases: alias 'gpt' is also listed in models: a name is either "
        "served as it is or aliased"
    ]
    assert region_errors(model_aliases={"": "m1"}) == [
        "regions[0].model_aliases: an alias name is empty"
    ]
    assert region_errors(model_aliases={"gpt": ""}) == [
        "regions[0].model_aliases: the target of alias 'gpt' is empty"
    ]
    assert region_errors(model_aliases={"gpt-*": "m1"}) == [
        "regions[0].model_aliases: alias 'gpt-*' is a glob: an alias names one model"
    ]
    assert region_errors(model_aliases={"gpt": "m*"})[0].startswith(
        "regions[0].model_aliases: alias 'gpt' targets the glob 'm*'"
    )
    assert region_errors(model_aliases={"m1": "m1"}) == [
        "regions[0].model_aliases: alias 'm1' names itself"
    ]
    assert region_errors(models="m1")[0].startswith("regions[0].models:")
    local = {"path": "model.gguf"}
    assert config_errors(local_model={**local, "models": ["a", "a"]}) == [
        "local_model.models: 'a' is listed twice"
    ]
    assert config_errors(local_model={**local, "models": ["a"], "serve_all_models": True}) == [
        "local_model.serve_all_models: is true while models lists names: keep one of the two"
    ]
    assert config_errors(local_model={**local, "serve_all_models": False}) == [
        "local_model.serve_all_models: is false and models lists none: the local model "
        "would answer nothing"
    ]
    assert config_errors(routing={"models_fetch_timeout": 0})[0].startswith(
        "routing.models_fetch_timeout:"
    )


def test_config_accepts_a_model_in_several_regions_and_tiers() -> None:
    regions = [
        {"name": "a", "url": "http://127.0.0.1:1", "models": ["m1", "llama-3*"]},
        {"name": "b", "url": "http://127.0.0.1:2", "models": ["m1"], "priority": 1},
        {
            "name": "c",
            "url": "http://127.0.0.1:3",
            "models": ["llama-3*"],
            "model_aliases": {"gpt-4o-mini": "llama-3.1-8b"},  # a target matched by a glob
        },
    ]
    config = Config.from_mapping(proxy_config(regions), environ={})
    assert config.regions[2].model_aliases == {"gpt-4o-mini": "llama-3.1-8b"}
    assert config.local_model.answers_every_model
    listed = Config.from_mapping(proxy_config(regions, local_model={"models": ["x"]}), environ={})
    assert not listed.local_model.answers_every_model


# -- routing by model --------------------------------------------------------------------


async def test_a_model_goes_only_to_the_regions_serving_it(
    start_region: StartRegion, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    r1, r2, r3 = await start_region("r1"), await start_region("r2"), await start_region("r3")
    proxy = await make_proxy([table(r1, models=["m1"]), table(r2, models=["m2"]), table(r3)])
    for model, allowed in (("m1", {"r1", "r3"}), ("m2", {"r2", "r3"}), ("m9", {"r3"})):
        for _ in range(4):
            status, headers, body = await post(client, proxy.url, chat(model))
            assert status == 200, body
            assert headers["X-Edgeproxy-Region"] in allowed
            assert orjson.loads(body)["model"] == model
    # r3 serves every model; r1 and r2 only their own.
    assert chats(r1) + chats(r2) + chats(r3) == 12
    assert chats(r3) >= 4


async def test_a_region_that_is_down_is_not_replaced_by_one_not_serving_the_model(
    start_region: StartRegion, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    r1, r2 = await start_region("r1"), await start_region("r2")
    proxy = await make_proxy([table(r1, models=["m1"]), table(r2, models=["m2"])])
    await r1.kill()
    for _ in range(3):
        status, headers, body = await post(client, proxy.url, chat("m1"))
        assert status == 502, body
        assert orjson.loads(body)["error"]["message"].startswith("region r1 failed")
    assert chats(r2) == 0


async def test_globs_match_model_names(
    start_region: StartRegion, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    r1, r2 = await start_region("r1"), await start_region("r2")
    proxy = await make_proxy(
        [table(r1, models=["llama-3*"]), table(r2, models=["qwen2.5-*", "mistral-7b"])]
    )
    for model, region in (
        ("llama-3", "r1"),
        ("llama-3.1-8b", "r1"),
        ("qwen2.5-7b-instruct", "r2"),
        ("mistral-7b", "r2"),
    ):
        status, headers, body = await post(client, proxy.url, chat(model))
        assert (status, headers["X-Edgeproxy-Region"]) == (200, region), body
    for model in ("llama-2", "mistral-7b-v2", "Llama-3"):
        status, _, body = await post(client, proxy.url, chat(model))
        assert status == 404, model
    assert (chats(r1), chats(r2)) == (2, 2)


async def test_an_unknown_model_is_a_404_before_any_upstream_work(
    start_region: StartRegion, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    r1, r2 = await start_region("r1"), await start_region("r2")
    proxy = await make_proxy([table(r1, models=["m1"]), table(r2, models=["m2*"])])
    for body in (chat("gpt-5"), chat("gpt-5", stream=True), chat("gpt-5", temperature=0)):
        status, headers, answer = await post(client, proxy.url, body)
        assert status == 404
        assert headers["Content-Type"].startswith("application/json")
        assert headers["X-Edgeproxy-Region"] == "none"
        assert orjson.loads(answer) == {
            "error": {
                "message": "The model `gpt-5` does not exist or you do not have access to it. "
                "The models served here are `m1` and `m2*`; an operator can map another name "
                "to one of them with the region's model_aliases.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
    status, _, answer = await post(client, proxy.url, chat(["m1"]))
    assert status == 400
    assert orjson.loads(answer)["error"] == {
        "message": "Invalid type for 'model': expected a string, but got an array.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "invalid_type",
    }
    # A request naming no model is refused at the edge, as every OpenAI server refuses it.
    status, _, answer = await post(client, proxy.url, {"messages": chat("x")["messages"]})
    assert status == 400
    assert orjson.loads(answer)["error"]["code"] == "missing_required_parameter"
    assert chats(r1) + chats(r2) == 0


# -- aliases -----------------------------------------------------------------------------


class Recorder:
    """On the inner proxy: the model of each request it got, and the chunks it relayed."""

    def __init__(self) -> None:
        self.models: list[Any] = []
        self.chunks: list[bytes] = []

    @hookimpl
    def edgeproxy_request_received(self, request: Any, ctx: RequestContext) -> None:
        if ctx.path == CHAT:
            self.models.append(ctx.json["model"])

    @hookimpl
    def edgeproxy_stream_chunk(self, request: Any, ctx: RequestContext, chunk: bytes) -> None:
        if ctx.path == CHAT:
            self.chunks.append(chunk)


async def aliased_pair(
    start_region: StartRegion, make_proxy: ProxyFactory, **sections: Any
) -> tuple[EdgeProxy, Recorder]:
    """The outer proxy, whose one region (an inner proxy in front of a fake region) serves
    LLAMA and calls it gpt-4o-mini for clients; and the inner proxy's recorder."""
    fake = await start_region("fake")
    recorder = Recorder()
    # The inner proxy caches nothing: its cache headers would be relayed too.
    inner = await make_proxy([fake], plugins=[recorder], routes=[NO_CACHE])
    region = table(
        "inner",
        inner.url,
        http2=False,
        models=[LLAMA],
        model_aliases={"gpt-4o-mini": LLAMA},
    )
    outer = await make_proxy([region], **sections)
    return outer, recorder


async def test_an_alias_sends_the_regions_name_and_answers_with_the_clients(
    start_region: StartRegion, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    proxy, recorder = await aliased_pair(start_region, make_proxy)
    status, headers, body = await post(client, proxy.url, chat("gpt-4o-mini", max_tokens=4))
    assert status == 200, body
    assert recorder.models == [LLAMA]
    assert LLAMA.encode() in b"".join(recorder.chunks)
    answer = orjson.loads(body)
    assert answer["model"] == "gpt-4o-mini"
    assert answer["choices"][0]["message"]["content"]
    assert int(headers.get("Content-Length", len(body))) == len(body)
    # The region's own name is served too, and answered as it is.
    status, _, body = await post(client, proxy.url, chat(LLAMA))
    assert status == 200 and orjson.loads(body)["model"] == LLAMA
    assert recorder.models == [LLAMA, LLAMA]


async def test_an_alias_renames_every_streamed_chunk(
    start_region: StartRegion, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    proxy, recorder = await aliased_pair(start_region, make_proxy)
    stream = chat("gpt-4o-mini", stream=True, max_tokens=6, stream_options={"include_usage": True})
    status, headers, body = await post(client, proxy.url, stream)
    assert status == 200, body
    assert headers["Content-Type"].startswith("text/event-stream")
    assert recorder.models == [LLAMA]
    relayed = events(b"".join(recorder.chunks))
    received = events(body)
    assert len(received) == len(relayed) == 8  # 6 tokens, the finish, the usage
    assert {e["model"] for e in relayed} == {LLAMA}
    assert {e["model"] for e in received} == {"gpt-4o-mini"}
    assert body.endswith(b"data: [DONE]\n\n")
    # Nothing else changed: the events are the region's, renamed.
    for ours, theirs in zip(received, relayed, strict=True):
        assert ours == {**theirs, "model": "gpt-4o-mini"}
    assert received[-1]["usage"]["completion_tokens"] == 6


async def test_the_cache_key_uses_the_clients_model_name(
    start_region: StartRegion, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    cache = {"xfetch_beta": 0.0}
    proxy, recorder = await aliased_pair(start_region, make_proxy, cache=cache)
    body = chat("gpt-4o-mini", temperature=0, max_tokens=3)
    status, headers, first = await post(client, proxy.url, body)
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
    key = headers["X-Edgeproxy-Cache-Key"]
    await eventually(lambda: proxy.status()["cache"]["stores"] == 1)
    status, headers, second = await post(client, proxy.url, body)
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "HIT"
    assert second == first and orjson.loads(second)["model"] == "gpt-4o-mini"
    assert recorder.models == [LLAMA]
    # The key is the one a proxy with no alias makes of the same client request.
    plain = await make_proxy([await start_region("plain")], cache=cache)
    _, headers, _ = await post(client, plain.url, body)
    assert headers["X-Edgeproxy-Cache-Key"] == key
    # The region's own name is another request, with another key.
    _, headers, _ = await post(client, proxy.url, {**body, "model": LLAMA})
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    assert headers["X-Edgeproxy-Cache-Key"] != key


# -- GET /v1/models ----------------------------------------------------------------------


async def test_models_list_from_config_makes_no_upstream_call(
    start_region: StartRegion, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    r1, r2 = await start_region("r1"), await start_region("r2")
    proxy = await make_proxy(
        [
            table(r1, models=["m1", "llama-3*"], model_aliases={"gpt-4o-mini": "llama-3.1-8b"}),
            table(r2, models=["m2", "m1"]),
        ]
    )
    status, answer = await get(client, proxy.url + MODELS)
    assert status == 200
    assert answer["object"] == "list"
    assert [m["id"] for m in answer["data"]] == ["gpt-4o-mini", "m1", "m2"]  # no globs
    by_id = {m["id"]: m for m in answer["data"]}
    assert by_id["m1"]["edgeproxy"] == {"regions": ["r1", "r2"]}
    assert by_id["gpt-4o-mini"]["edgeproxy"] == {"regions": ["r1"]}
    for model in answer["data"]:
        assert model["object"] == "model"
        assert isinstance(model["created"], int) and model["owned_by"] == "edgeproxy"
    status, model = await get(client, proxy.url + MODELS + "/m2")
    assert status == 200 and model["id"] == "m2" and model["edgeproxy"] == {"regions": ["r2"]}
    status, error = await get(client, proxy.url + MODELS + "/nope")
    assert status == 404 and error["error"]["code"] == "model_not_found"
    assert lists(r1) == lists(r2) == 0
    # A region that is down drops out of the list while another is up.
    await r2.kill()
    await post(client, proxy.url, chat("m2"))  # fails, and r2 is known to be down
    status, answer = await get(client, proxy.url + MODELS)
    assert [m["id"] for m in answer["data"]] == ["gpt-4o-mini", "m1"]


async def test_models_list_merges_unlisted_regions_and_survives_every_region_down(
    start_region: StartRegion, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    r1 = await start_region("r1")
    r2 = await start_region("r2", model="r2-model")
    r3 = await start_region("r3", model="shared")
    tables = [
        table(r1, models=["shared", "m1"]),
        table(r2),
        table(r3, model_aliases={"a": "shared"}),
    ]
    cached = await make_proxy(tables, routing={"models_cache_ttl": 60.0})
    status, answer = await get(client, cached.url + MODELS)
    assert status == 200
    expected = {"a": ["r3"], "m1": ["r1"], "r2-model": ["r2"], "shared": ["r1", "r3"]}
    assert {m["id"]: m["edgeproxy"]["regions"] for m in answer["data"]} == expected
    assert (lists(r1), lists(r2), lists(r3)) == (0, 1, 1)
    # Within models_cache_ttl the regions are not asked again.
    status, again = await get(client, cached.url + MODELS)
    assert again == answer
    assert (lists(r1), lists(r2), lists(r3)) == (0, 1, 1)
    # Asking every time, then every region down: the configured models and the last lists
    # fetched, never an error.
    proxy = await make_proxy(tables, routing={"models_cache_ttl": 0.0})
    status, answer = await get(client, proxy.url + MODELS)
    assert {m["id"]: m["edgeproxy"]["regions"] for m in answer["data"]} == expected
    assert (lists(r2), lists(r3)) == (2, 2)
    for region in (r1, r2, r3):
        await region.kill()
    # The fetches fail (and so r2 and r3 are known down); then r1 is found down too.
    status, down = await get(client, proxy.url + MODELS)
    assert status == 200 and down == answer
    status, _, _ = await post(client, proxy.url, chat("m1"))
    assert status == 502
    assert not any(proxy.regions.health.available(r, proxy.regions.clock()) for r in proxy.regions)
    status, down = await get(client, proxy.url + MODELS)
    assert status == 200 and down == answer


async def test_without_any_catalog_models_are_forwarded_as_before(
    start_region: StartRegion, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    r1 = await start_region("r1", model="own")
    proxy = await make_proxy([r1])
    status, answer = await get(client, proxy.url + MODELS)
    assert status == 200 and [m["id"] for m in answer["data"]] == ["own"]
    assert "edgeproxy" not in answer["data"][0]
    assert lists(r1) == 1
    status, _, body = await post(client, proxy.url, chat("anything"))
    assert status == 200 and orjson.loads(body)["model"] == "anything"


# -- the local model ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from edgeproxy.testing import tiny_llama_gguf

    return tiny_llama_gguf("Q4_0")


@pytest.mark.model
@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llama-cpp-python, gguf and numpy (the local and testing extras)",
)
async def test_the_local_model_answers_only_the_models_it_lists(
    start_region: StartRegion,
    make_proxy: ProxyFactory,
    client: aiohttp.ClientSession,
    tiny_model: Path,
) -> None:
    r1 = await start_region("r1")
    local = {
        "path": str(tiny_model),
        "n_ctx": 256,
        "max_tokens": 8,
        "models": ["small-*", "tiny"],
    }
    proxy = await make_proxy(
        [table(r1, models=["m1"]), table("dead", dead_url(), models=["small-2", "big"])],
        local_model=local,
    )
    model = proxy.pipeline.fallback.local
    await eventually(lambda: model.state not in ("idle", "loading"))
    assert model.ready
    # No region serves it, the local model does: the ladder answers rather than a 404.
    status, headers, body = await post(client, proxy.url, chat("small-1", max_tokens=2))
    assert status == 200, body
    assert headers["X-Edgeproxy-Degraded"] == "local-model"
    # A region serves it but is down: the local model answers, as it lists it.
    status, headers, body = await post(client, proxy.url, chat("small-2", max_tokens=2))
    assert status == 200, body
    assert headers["X-Edgeproxy-Degraded"] == "local-model"
    # A region serves it but is down, and the local model does not list it: the failure.
    status, headers, body = await post(client, proxy.url, chat("big", max_tokens=2))
    assert status == 502, body
    assert "X-Edgeproxy-Degraded" not in headers
    # Nobody serves it.
    status, _, body = await post(client, proxy.url, chat("other"))
    assert status == 404 and orjson.loads(body)["error"]["code"] == "model_not_found"
    # m1 is the region's.
    status, headers, _ = await post(client, proxy.url, chat("m1"))
    assert status == 200 and headers["X-Edgeproxy-Region"] == "r1"
    status, answer = await get(client, proxy.url + MODELS)
    by_id = {m["id"]: m["edgeproxy"] for m in answer["data"]}
    assert by_id["tiny"] == {"regions": [], "local_model": True}
    assert by_id["m1"] == {"regions": ["r1"]}
