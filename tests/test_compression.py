"""Compression toward the client: negotiated per request, never holding an SSE event back,
and a cached answer compressed once per coding."""

from __future__ import annotations

import contextlib
import gzip
import json
import zlib
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


def decoder(encoding: str) -> Any:
    if encoding == "zstd":
        return zstandard.ZstdDecompressor().decompressobj().decompress
    if encoding == "br":
        return brotli.Decompressor().process
    return zlib.decompressobj(31).decompress


@pytest.mark.parametrize("encoding", ["zstd", "br", "gzip"])
async def test_an_upstream_json_answer_is_compressed_on_its_way(
    make_region: RegionFactory, make_proxy: ProxyFactory, encoding: str
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy([region])
    body = chat(temperature=0.7)  # not cacheable: straight from the region
    _, plain_headers, plain = await post(proxy.url, body, None)
    status, headers, packed = await post(proxy.url, body, encoding)
    assert status == 200 and plain_headers.get("X-Edgeproxy-Cache") != "HIT"
    assert headers["Content-Encoding"] == encoding and headers["Vary"] == "Accept-Encoding"
    assert "Content-Length" not in headers
    # Two answers of the region: the same text, each with its own id.
    answer = json.loads(decode(packed, encoding))
    assert answer["choices"] == json.loads(plain)["choices"]


@pytest.mark.parametrize("encoding", ["zstd", "br", "gzip"])
async def test_sse_is_compressed_only_where_asked_and_each_event_leaves_at_once(
    make_region: RegionFactory, make_proxy: ProxyFactory, encoding: str
) -> None:
    # The region waits between tokens; the client must decode each one before the next
    # is generated, which a compressor that buffered would not allow.
    region = await make_region("ap-1", tokens=6, inter_token_delay=0.2)
    proxy = await make_proxy(
        [region],
        routes=[
            {"name": "chat", "path": CHAT, "compress_sse": True, "cache": "off"},
            {"name": "completions", "path": "/v1/completions", "cache": "off"},
        ],
    )
    stream = chat(tokens=6, stream=True, temperature=0.7)
    async with aiohttp.ClientSession(auto_decompress=False) as client:
        async with client.post(
            proxy.url + CHAT, json=stream, headers={"Accept-Encoding": encoding}
        ) as resp:
            assert resp.headers["Content-Encoding"] == encoding
            feed = decoder(encoding)
            text = b""
            while b"data: {" not in text:
                chunk = await resp.content.readany()
                assert chunk, "the stream ended before its first event decoded"
                text += bytes(feed(chunk))
            # The first event is readable while the region is still generating the rest.
            assert region.in_flight == 1
            rest = await resp.content.read()
            text += bytes(feed(rest))
        assert text.rstrip().endswith(b"data: [DONE]")
        assert text.count(b"data: {") >= 6
        completion = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 6}
        async with client.post(
            proxy.url + "/v1/completions", json=completion, headers={"Accept-Encoding": encoding}
        ) as resp:
            assert "Content-Encoding" not in resp.headers
            assert (await resp.read()).rstrip().endswith(b"data: [DONE]")


async def test_an_error_event_in_a_compressed_stream_is_compressed_too(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", tokens=6, fault="reset", fault_after_tokens=2)
    proxy = await make_proxy(
        [region], routes=[{"name": "chat", "path": CHAT, "compress_sse": True, "cache": "off"}]
    )
    feed = decoder("gzip")
    text = b""
    async with aiohttp.ClientSession(auto_decompress=False) as client:
        async with client.post(
            proxy.url + CHAT, json=chat(tokens=6, stream=True), headers={"Accept-Encoding": "gzip"}
        ) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            # The body is cut after the event, so that it cannot pass for complete.
            with contextlib.suppress(aiohttp.ClientPayloadError):
                while chunk := await resp.content.readany():
                    text += bytes(feed(chunk))
    assert b"event: error" in text and b"[DONE]" not in text
