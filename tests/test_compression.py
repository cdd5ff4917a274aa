"""Compression toward the client: negotiated per request, never holding an SSE event back,
and a cached answer compressed once per coding."""

from __future__ import annotations

import gzip
from typing import Any

import aiohttp
import brotli
import pytest
import zstandard

from edgeproxy import Config, ConfigError

from .conftest import ProxyFactory, RegionFactory

CHAT = "/v1/chat/completions"


def chat(tokens: int = 400, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "tell me everything"}],
        **extra,
    }


def decode(body: bytes, encoding: str | None) -> bytes:
    if encoding == "zstd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    if encoding == "br":
        return bytes(brotli.decompress(body))
    if encoding == "gzip":
        return gzip.decompress(body)
    assert encoding is None
    return body


async def post(
    url: str, body: dict[str, Any], accept: str | None
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Accept-Encoding": accept} if accept is not None else {"Accept-Encoding": ""}
    async with aiohttp.ClientSession(auto_decompress=False) as client:
        async with client.post(url + CHAT, json=body, headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.read()


@pytest.mark.parametrize(
    ("accept", "encoding"),
    [("zstd, br, gzip", "zstd"), ("br, gzip", "br"), ("gzip", "gzip"), ("identity", None)],
)
async def test_a_cached_json_answer_is_sent_in_the_clients_coding_made_once(
    make_region: RegionFactory, make_proxy: ProxyFactory, accept: str, encoding: str | None
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy([region])
    _, _, plain = await post(proxy.url, chat(), None)
    assert len(plain) > 1024
    for outcome in ("HIT", "HIT"):
        status, headers, body = await post(proxy.url, chat(), accept)
        assert status == 200 and headers["X-Edgeproxy-Cache"] == outcome
        assert headers.get("Content-Encoding") == encoding
        assert decode(body, encoding) == plain
        if encoding is not None:
            assert headers["Vary"] == "Accept-Encoding"
            assert int(headers["Content-Length"]) == len(body) < len(plain)
    entries = [item[0] for item in proxy.pipeline.cache.backend.cache._lru.values()]  # type: ignore[union-attr]
    made = [form for entry in entries for form in entry.encoded]
    # Two hits, one copy: the second hit was served from the first one's.
    assert made == ([f"{encoding} json False"] if encoding else [])


async def test_small_answers_and_disabled_compression_go_as_they_are(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy([region])
    await post(proxy.url, chat(tokens=3), None)
    _, headers, _ = await post(proxy.url, chat(tokens=3), "gzip")
    assert headers["X-Edgeproxy-Cache"] == "HIT" and "Content-Encoding" not in headers

    off = await make_proxy([region], server={"compression": False})
    await post(off.url, chat(), None)
    _, headers, _ = await post(off.url, chat(), "gzip")
    assert headers["X-Edgeproxy-Cache"] == "HIT" and "Content-Encoding" not in headers


def test_unknown_codings_are_config_errors_naming_the_key() -> None:
    data = {
        "server": {"compression_encodings": ["gzip", "lz4"]},
        "regions": [{"name": "a", "url": "http://x"}],
    }
    with pytest.raises(ConfigError, match=r"server\.compression_encodings\[1\]"):
        Config.from_mapping(data, environ={})
