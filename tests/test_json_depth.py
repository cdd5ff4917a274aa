"""JSON nesting: one limit, MAX_DEPTH levels, below what every parser on the way reads.

Up to the limit a body is read once (orjson) and checked for duplicate keys by one more
serialization; past it, it is refused with 400 ``json_too_deep`` in the API's error shape,
however deep it goes (orjson's own limit, 1,024, included).
"""

from __future__ import annotations

import json

import aiohttp
import orjson
import pytest

from edgeproxy import ProxyError
from edgeproxy._core.strictjson import (
    MAX_DEPTH,
    DuplicateKey,
    NestedTooDeeply,
    duplicate_key,
    loads_unique,
)
from edgeproxy._protocol.bodies import parse_json_object

from .conftest import ProxyFactory, RegionFactory

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def nested(depth: int, inner: bytes = b"1") -> bytes:
    """An object ``depth`` levels deep: objects and arrays in turn, ``inner`` at the bottom."""
    head = b"".join(b'{"a":' if level % 2 == 0 else b"[" for level in range(depth))
    tail = b"".join(b"}" if level % 2 == 0 else b"]" for level in reversed(range(depth)))
    return head + inner + tail


@pytest.mark.parametrize("depth", [1, 2, MAX_DEPTH - 1, MAX_DEPTH])
def test_up_to_the_limit_a_document_is_read_and_checked(depth: int) -> None:
    raw = nested(depth)
    assert duplicate_key(raw, orjson.loads(raw)) is None
    assert loads_unique(raw) == orjson.loads(raw)
    dup = nested(depth - 1, b'{"b":1,"b":2}') if depth > 1 else b'{"b":1,"b":2}'
    assert duplicate_key(dup, orjson.loads(dup)) == "b"
    with pytest.raises(DuplicateKey):
        loads_unique(dup)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 254, 255, 990, 1023, 1024, 1025, 5000])
def test_past_the_limit_a_document_is_refused_as_too_deep_not_as_a_duplicate(
    depth: int,
) -> None:
    raw = nested(depth)
    with pytest.raises(NestedTooDeeply):
        loads_unique(raw)
    with pytest.raises(ProxyError) as info:
        parse_json_object(raw)
    assert info.value.status == 400 and info.value.code == "json_too_deep"
    assert str(MAX_DEPTH) in info.value.message


def test_a_deep_body_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The exact (slow) parse is for a document whose colon counts differ, never for depth.
    def exact(*args: object, **kwargs: object) -> None:
        raise AssertionError("parsed a second time")

    monkeypatch.setattr(json, "loads", exact)
    wide = b'{"a":[' + b",".join([nested(MAX_DEPTH - 2)] * 200) + b"]}"
    assert duplicate_key(wide, orjson.loads(wide)) is None
    for depth in (MAX_DEPTH + 1, 300, 1000):
        raw = nested(depth)
        with pytest.raises(NestedTooDeeply):
            duplicate_key(raw, orjson.loads(raw))


def test_brackets_in_strings_do_not_count_as_depth() -> None:
    raw = orjson.dumps({"a": "[{" * 1000, "b": [[["x"]]]})
    assert loads_unique(raw) == orjson.loads(raw)


def test_a_too_deep_document_is_a_decode_error_to_plain_readers() -> None:
    # ctx.json reads a body it cannot trust as None, catching decode errors.
    assert issubclass(NestedTooDeeply, orjson.JSONDecodeError)
    assert str(NestedTooDeeply()) == f"depth limit exceeded: more than {MAX_DEPTH} levels"


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
async def test_a_deep_body_gets_a_400_in_the_apis_shape_and_reaches_no_region(
    make_region: RegionFactory, make_proxy: ProxyFactory, path: str
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy([region])
    deep = b'{"model":"m","messages":[{"role":"user","content":' + nested(1000) + b"}]}"
    async with aiohttp.ClientSession() as client:
        async with client.post(
            proxy.url + path, data=deep, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 400
            body = await resp.json()
    if path == MESSAGES:
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert f"more than {MAX_DEPTH} levels" in body["error"]["message"]
    else:
        assert body["error"]["code"] == "json_too_deep"
        assert f"more than {MAX_DEPTH} levels" in body["error"]["message"]
    assert region.requests_total == 0
