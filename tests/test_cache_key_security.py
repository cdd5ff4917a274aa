"""The cache key and the region see the same request: nothing forwarded that can change
the answer is left out of the key, and nothing forwarded is ambiguous.

Each end-to-end test here failed before its fix: a poisoned or cross-credential HIT.
The property test at the end checks the rule itself over random bodies and headers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from edgeproxy import Config, Exchange, RequestContext, hookimpl
from edgeproxy._cache.keys import NON_SEMANTIC_FIELDS, KeyHeaders, _post_digest, cache_scope
from edgeproxy._core.context import start_context
from edgeproxy._core.strictjson import DuplicateKey, duplicate_key, loads_unique
from edgeproxy._protocol.bodies import parse_json_object
from edgeproxy._protocol.headers import ANSWER_HEADERS, CLIENT_CREDENTIAL_HEADERS, trace_context
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
EVIL = b'{"role":"user","content":"EVIL"}'
CLEAN = b'{"role":"user","content":"what is 2+2"}'


def clean_body() -> bytes:
    return b'{"model":"m","temperature":0,"messages":[' + CLEAN + b"]}"


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def send(
    client: aiohttp.ClientSession,
    url: str,
    raw: bytes,
    headers: dict[str, str] | list[tuple[str, str]] | None = None,
) -> tuple[int, Any, Any]:
    sent = CIMultiDict(headers or {})
    sent.setdefault("Content-Type", "application/json")
    async with client.post(url, data=raw, headers=sent) as resp:
        return resp.status, resp.headers, orjson.loads(await resp.read())


def calls(region: FakeRegion) -> int:
    return region.counters().requests_by_path.get(CHAT, 0)


async def stored(proxy: Any, count: int) -> None:
    await eventually(lambda: proxy.status()["cache"]["stores"] == count)


# -- duplicate JSON keys ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        # The repro: the proxy keyed the last "messages", a region read the first.
        (
            b'{"model":"m","temperature":0,"messages":[' + EVIL + b'],"messages":[' + CLEAN + b"]}",
            "messages",
        ),
        # Nested, inside a message.
        (
            b'{"model":"m","temperature":0,"messages":[{"role":"user","content":"EVIL",'
            b'"content":"what is 2+2"}]}',
            "content",
        ),
        # The same name spelled with an escape is the same key.
        (
            b'{"model":"m","temperature":0,"messages":[' + EVIL + b'],"m\\u0065ssages":['
            b"" + CLEAN + b"]}",
            "messages",
        ),
        # A duplicate whose value hides an escaped colon, to balance the count.
        (
            b'{"model":"m","temperature":0,"messages":[' + CLEAN + b'],"temperature":"\\u003a"}',
            "temperature",
        ),
    ],
    ids=["top-level", "nested", "escaped-name", "escaped-colon"],
)
async def test_a_body_naming_a_key_twice_is_refused_and_never_cached(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    client: aiohttp.ClientSession,
    raw: bytes,
    key: str,
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region], cache={"xfetch_beta": 0.0})
    url = proxy.url + CHAT

    status, _, body = await send(client, url, raw)
    assert status == 400
    assert body["error"]["code"] == "invalid_body"
    assert body["error"]["param"] == key
    assert repr(key) in body["error"]["message"]
    assert calls(region) == 0

    # The clean question is answered by the region, not from anything the attacker sent.
    status, headers, _ = await send(client, url, clean_body())
    assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
    assert calls(region) == 1


async def test_a_duplicate_key_on_an_always_cached_route_bypasses_the_cache(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    # A route that caches any JSON POST but does not require JSON: the body goes through
    # as sent, so the cache must not key what it cannot read one way.
    region = await make_region("r1")
    proxy = await make_proxy(
        [region],
        cache={"xfetch_beta": 0.0},
        routes=[{"name": "any", "path": "/custom", "cache": "always"}],
    )
    raw = b'{"q":"EVIL","q":"what is 2+2"}'
    async with client.post(
        proxy.url + "/custom", data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.headers["X-Edgeproxy-Cache"] == "BYPASS"
    assert proxy.status()["cache"]["bypass_reasons"]["not_json"] == 1


def test_duplicate_key_finds_every_duplicate_and_no_false_one() -> None:
    cases: list[tuple[bytes, str | None]] = [
        (b'{"a":1}', None),
        (b'{"a":1,"b":{"a":2}}', None),
        (b'{"a":1,"a":1}', "a"),
        (b'[{"x":[{"y":1,"y":2}]}]', "y"),
        (b'{"a:b":"c:d","e":"::"}', None),
        (b'{"a":"\\u003a\\u003A"}', None),
        # Text that only looks like an escaped colon: the fast count suspects it, the exact
        # parse clears it.
        (b'{"a":"\\\\u003a"}', None),
        (b'{"a" : 1 ,\n "a" : 2}', "a"),
        (b'{"\\u0061":1,"a":2}', "a"),
        (b"{}", None),
    ]
    for raw, expected in cases:
        assert duplicate_key(raw, orjson.loads(raw)) == expected, raw
    with pytest.raises(DuplicateKey) as info:
        loads_unique(b'{"k":[1],"k":[2]}')
    assert info.value.key == "k"
    assert loads_unique(b"[1, 2]") == [1, 2]
    # Deep documents: tests/test_json_depth.py.


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(':\\"aé\x00 ', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text('ab:\\"', max_size=3), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(_json_values, st.booleans())
def test_duplicate_key_agrees_with_an_exact_parser(value: Any, ascii_only: bool) -> None:
    # Serialized both ways real clients do (Python's json escapes non-ASCII as \\uXXXX).
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert duplicate_key(raw, orjson.loads(raw)) is None
    if isinstance(value, dict) and value:
        first = next(iter(value))
        dup = raw[:-1] + b"," + json.dumps(first).encode() + b":0}"
        assert duplicate_key(dup, orjson.loads(dup)) == first


def test_parse_json_object_names_the_duplicated_key() -> None:
    from edgeproxy import ProxyError

    with pytest.raises(ProxyError) as info:
        parse_json_object(b'{"model":"a","model":"b"}')
    assert info.value.status == 400 and info.value.code == "invalid_body"
    assert info.value.param == "model"


# -- credentials ---------------------------------------------------------------------------


async def test_every_credential_header_is_part_of_the_scope(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region], cache={"xfetch_beta": 0.0})
    url = proxy.url + CHAT
    a = {"Authorization": "Bearer sk-A", "api-key": "shared"}
    b = {"Authorization": "Bearer sk-B", "api-key": "shared"}

    _, headers, _ = await send(client, url, clean_body(), a)
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    await stored(proxy, 1)
    _, headers, _ = await send(client, url, clean_body(), b)
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    await stored(proxy, 2)
    # A repeated header's every value counts, not only the first.
    _, headers, _ = await send(
        client, url, clean_body(), [("api-key", "shared"), ("api-key", "other")]
    )
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    _, headers, _ = await send(client, url, clean_body(), a)
    assert headers["X-Edgeproxy-Cache"] == "HIT"
    assert calls(region) == 3


class _OneTenant:
    @hookimpl
    def edgeproxy_request_received(self, request: Exchange, ctx: RequestContext) -> None:
        ctx.tenant = "acme"


async def test_forwarded_credentials_split_entries_within_a_tenant(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    # The region sees the client's key, so its answer may depend on it (its fine-tunes,
    # its organization): one key's answer is not another's, even in one tenant.
    region = await make_region("r1")
    proxy = await make_proxy(
        [region],
        cache={"xfetch_beta": 0.0},
        server={"forward_client_credentials": True},
        plugins=[_OneTenant()],
    )
    url = proxy.url + CHAT
    _, headers, _ = await send(client, url, clean_body(), {"Authorization": "Bearer sk-A"})
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    await stored(proxy, 1)
    _, headers, _ = await send(client, url, clean_body(), {"Authorization": "Bearer sk-B"})
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    _, headers, _ = await send(client, url, clean_body(), {"Authorization": "Bearer sk-A"})
    assert headers["X-Edgeproxy-Cache"] == "HIT"
    assert calls(region) == 2


async def test_unforwarded_credentials_share_a_tenants_entries(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    # Not forwarded, the key cannot change the answer: the tenant's users share entries.
    region = await make_region("r1")
    proxy = await make_proxy([region], cache={"xfetch_beta": 0.0}, plugins=[_OneTenant()])
    url = proxy.url + CHAT
    await send(client, url, clean_body(), {"Authorization": "Bearer sk-A"})
    await stored(proxy, 1)
    _, headers, _ = await send(client, url, clean_body(), {"Authorization": "Bearer sk-B"})
    assert headers["X-Edgeproxy-Cache"] == "HIT"


# -- the query string and behaviour headers ------------------------------------------------


async def test_the_query_string_is_part_of_a_posts_key(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region], cache={"xfetch_beta": 0.0})
    base = proxy.url + CHAT
    _, headers, _ = await send(client, base + "?api-version=2024-01-01", clean_body())
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    await stored(proxy, 1)
    _, headers, _ = await send(client, base + "?api-version=2025-01-01", clean_body())
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    await stored(proxy, 2)
    _, headers, _ = await send(client, base, clean_body())
    assert headers["X-Edgeproxy-Cache"] == "MISS"
    _, headers, _ = await send(client, base + "?api-version=2024-01-01", clean_body())
    assert headers["X-Edgeproxy-Cache"] == "HIT"
    assert calls(region) == 3


async def test_behaviour_headers_are_part_of_the_key(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region], cache={"xfetch_beta": 0.0, "vary_headers": ["X-LoRA"]})
    url = proxy.url + CHAT
    variants: list[dict[str, str]] = [
        {},
        {"OpenAI-Organization": "org-1"},
        {"OpenAI-Organization": "org-2"},
        {"anthropic-version": "2023-06-01"},
        {"X-LoRA": "legal"},
    ]
    for n, headers_sent in enumerate(variants, start=1):
        _, headers, _ = await send(client, url, clean_body(), headers_sent)
        assert headers["X-Edgeproxy-Cache"] == "MISS", headers_sent
        await stored(proxy, n)
    # A header that does not select behaviour does not split entries.
    _, headers, _ = await send(client, url, clean_body(), {"User-Agent": "another/1.0"})
    assert headers["X-Edgeproxy-Cache"] == "HIT"
    assert calls(region) == len(variants)


@pytest.mark.parametrize("name", ["bad name", "caf\u00e9", " ", "x:y"])
def test_vary_headers_must_be_header_names(name: str) -> None:
    from edgeproxy import ConfigError

    with pytest.raises(ConfigError, match="vary_headers"):
        Config.from_mapping(proxy_config([], cache={"vary_headers": [name]}), environ={})
    region = {"name": "r1", "url": "http://127.0.0.1:9"}
    config = Config.from_mapping(
        proxy_config([region], cache={"vary_headers": [" X-LoRA "]}), environ={}
    )
    assert config.cache.vary_headers == ["x-lora"]


# -- the rule, as a property -----------------------------------------------------------------

_HEADER_NAMES = sorted(
    CLIENT_CREDENTIAL_HEADERS | ANSWER_HEADERS | {"x-lora", "user-agent", "x-request-id"}
)
_VARY = ["x-lora"]
_SEMANTIC_VALUES = st.one_of(st.none(), st.integers(0, 2), st.sampled_from(["a", "b"]))
_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "n"])},
    optional={
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system"]), "content": st.sampled_from("xy")}
            ),
            max_size=2,
        ),
        "temperature": st.sampled_from([0, 0.0, 1]),
        "seed": _SEMANTIC_VALUES,
        "tools": st.lists(st.sampled_from(["t1", "t2"]), max_size=2),
        "user": _SEMANTIC_VALUES,
        "stream": st.booleans(),
        "metadata": _SEMANTIC_VALUES,
    },
)
_requests = st.fixed_dictionaries(
    {
        "query": st.sampled_from(["", "?api-version=1", "?api-version=2", "?a=1&a=2"]),
        "body": _bodies,
        "headers": st.lists(
            st.tuples(st.sampled_from(_HEADER_NAMES), st.sampled_from(["v1", "v2"])), max_size=4
        ),
        "tenant": st.sampled_from([None, "acme", "globex"]),
    }
)


def _keyed_config(forwarded: bool) -> Config:
    return Config.from_mapping(
        proxy_config(
            [{"name": "r1", "url": "http://127.0.0.1:9"}],
            cache={"vary_headers": _VARY},
            server={"forward_client_credentials": forwarded},
        ),
        environ={},
    )


def _context(
    request: dict[str, Any], config: Config, extra: tuple[tuple[str, str], ...] = ()
) -> RequestContext:
    """A chat request of ``request``'s fields at entry, its body read; ``extra``: headers
    before the request's own."""
    ctx = start_context(
        "id",
        trace_context(None),
        "POST",
        CHAT + request["query"],
        CIMultiDict([*extra, *request["headers"]]),
        "192.0.2.1",
        0.0,
        config.route_for("POST", CHAT),
        "http",
        "1.1",
        "proxy",
    )
    ctx.tenant = request["tenant"]
    ctx.body = orjson.dumps(request["body"])
    ctx.body_read = True
    ctx._json = request["body"]
    return ctx


def _key(request: dict[str, Any], config: Config) -> str:
    ctx = _context(request, config)
    scope = cache_scope(ctx)
    return f"{scope}:{_post_digest(ctx, request['body'], scope, KeyHeaders(config))}"


def _answer_fields(request: dict[str, Any], forwarded_credentials: bool) -> Any:
    """What a region sees that can change its answer, plus who may share the entry."""
    headers: CIMultiDict[str] = CIMultiDict(request["headers"])
    selecting = sorted(ANSWER_HEADERS | set(_VARY))
    credentials = sorted(CLIENT_CREDENTIAL_HEADERS)
    if forwarded_credentials:
        selecting = sorted(set(selecting) | set(credentials))
    body = {k: v for k, v in request["body"].items() if k not in NON_SEMANTIC_FIELDS}
    owner = (
        ("tenant", request["tenant"])
        if request["tenant"]
        else ("credentials", [(n, headers.getall(n, [])) for n in credentials])
    )
    return (
        request["query"],
        orjson.dumps(body, option=orjson.OPT_SORT_KEYS),
        [(n, headers.getall(n, [])) for n in selecting],
        owner,
    )


@pytest.mark.parametrize("forwarded", [False, True], ids=["own-credentials", "forwarded"])
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=_requests, second=_requests)
def test_two_requests_share_an_entry_only_if_all_that_can_change_the_answer_is_equal(
    forwarded: bool, first: dict[str, Any], second: dict[str, Any]
) -> None:
    config = _keyed_config(forwarded)
    same_key = _key(first, config) == _key(second, config)
    same_fields = _answer_fields(first, forwarded) == _answer_fields(second, forwarded)
    assert same_key == same_fields
