"""The HTTP version of each region endpoint, found rather than guessed (``http2 = "auto"``,
the default): ALPN over TLS; in cleartext the h2c preface, and HTTP/1.1 from then on where
the server refuses it, logged once; ``true`` and ``false`` still force it, and a region
refusing the version forced is unreachable with an error that says so; ``/status`` and
the status page show the version in use and how it was found."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web

from edgeproxy import Config, ConfigError, EdgeProxy, PoolLimits
from edgeproxy._upstream.autopool import AutoPool
from edgeproxy._upstream.h2pool import H2Pool
from edgeproxy._upstream.pool import UpstreamConnectError, UpstreamNotHTTP2
from edgeproxy.testing import FakeRegion

from ._browser import launch
from .conftest import (
    CustomRegion,
    LlamaServers,
    ProxyFactory,
    RegionFactory,
    eventually,
    needs_llama_server,
    write_pair,
)

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
ADVICE = "set `http2 = false` or leave it `auto`"


def http1_app(versions: list[str]) -> web.Application:
    """An OpenAI-shaped region on aiohttp's server: HTTP/1.x only, as uvicorn (llama.cpp's
    servers) is; ``versions`` records the version of each request it answered."""

    async def chat(request: web.Request) -> web.Response:
        versions.append(f"{request.version.major}.{request.version.minor}")
        await request.read()
        return web.json_response(
            {
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def anything(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post(CHAT, chat)
    app.router.add_route("*", "/{rest:.*}", anything)
    return app


async def status_of(proxy: EdgeProxy, name: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/status") as resp:
            assert resp.status == 200
            status = await resp.json()
    return next(r for r in status["regions"] if r["name"] == name)


async def post_chat(proxy: EdgeProxy) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            return resp.status, await resp.json()


def regions_said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "edgeproxy.regions"]


# -- cleartext: the h2c preface ------------------------------------------------------------


async def test_auto_speaks_http1_to_a_region_that_refuses_h2c_and_says_so_once(
    custom_region: CustomRegion, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    versions: list[str] = []
    url = await custom_region(http1_app(versions))
    caplog.set_level(logging.INFO, logger="edgeproxy.regions")
    proxy = await make_proxy([{"name": "h1", "url": url}])  # http2 left unset: "auto"
    for _ in range(3):
        status, body = await post_chat(proxy)
        assert status == 200, body
    assert versions == ["1.1"] * 3
    said = [m for m in regions_said(caplog) if "speaks HTTP/1.1 only" in m]
    assert said == [
        f"region h1 ({url}) speaks HTTP/1.1 only (it answered the HTTP/2 preface with "
        "'HTTP/1.0 400 Bad Request'); using HTTP/1.1"
    ], regions_said(caplog)
    region = await status_of(proxy, "h1")
    assert region["state"] == "up" and region["last_error"] is None
    assert region["pool"]["http2"] == "auto"
    assert region["pool"]["http_version"] == "1.1"
    (endpoint,) = region["endpoints"]
    assert endpoint["http_version"] == "1.1"
    assert "answered the HTTP/2 preface with 'HTTP/1.0 400" in endpoint["http_version_detected"]


async def test_auto_stays_on_http2_with_an_h2c_region(
    make_region: RegionFactory, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await make_region("h2")
    caplog.set_level(logging.INFO, logger="edgeproxy.regions")
    proxy = await make_proxy([fake])
    for _ in range(3):
        status, body = await post_chat(proxy)
        assert status == 200, body
    chats = fake.counters().requests_by_http_version
    assert chats.get("2", 0) >= 3 and not chats.get("1.1"), chats
    assert f"region h2 ({fake.url}) speaks HTTP/2 (h2c preface accepted); using HTTP/2" in (
        regions_said(caplog)
    )
    assert not any("HTTP/1.1 only" in m for m in regions_said(caplog))
    region = await status_of(proxy, "h2")
    assert region["pool"]["http2"] == "auto" and region["pool"]["http_version"] == "2"
    assert region["endpoints"][0]["http_version_detected"] == "h2c preface accepted"


async def test_http2_true_against_an_http1_region_is_an_error_that_says_so(
    custom_region: CustomRegion, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    versions: list[str] = []
    url = await custom_region(http1_app(versions))
    caplog.set_level(logging.INFO, logger="edgeproxy.regions")
    proxy = await make_proxy([{"name": "h1", "url": url, "http2": True}])
    status, body = await post_chat(proxy)
    assert status == 502
    # The client's answer stays generic: the region's configuration is the operator's.
    assert "http2" not in str(body) and "HTTP/1.1" not in str(body), body
    assert versions == []
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "edgeproxy.regions" and r.levelno >= logging.WARNING
    ]
    assert any(
        f"region h1 ({url}) is unreachable" in m and "speaks HTTP/1.1 only" in m and ADVICE in m
        for m in warned
    ), warned
    region = await status_of(proxy, "h1")
    assert region["pool"]["http2"] is True and region["pool"]["http_version"] == "2"
    (endpoint,) = region["endpoints"]
    assert endpoint["http_version_detected"] is None
    assert "speaks HTTP/1.1 only" in endpoint["last_error"], endpoint
    assert ADVICE in endpoint["last_error"], endpoint


async def test_http2_false_still_forces_http1(
    custom_region: CustomRegion,
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    versions: list[str] = []
    url = await custom_region(http1_app(versions))
    fake = await make_region("both")  # speaks h2c too, and is not asked to
    caplog.set_level(logging.INFO, logger="edgeproxy.regions")
    proxy = await make_proxy(
        [{"name": "h1", "url": url}, {"name": "both", "url": fake.url, "http2": False}],
        upstream={"http2": False},
    )
    status, body = await post_chat(proxy)
    assert status == 200, body
    for name in ("h1", "both"):
        region = await status_of(proxy, name)
        assert region["pool"]["http2"] is False and region["pool"]["http_version"] == "1.1"
        assert region["endpoints"][0]["http_version_detected"] is None
    assert not any("speaks" in m for m in regions_said(caplog)), regions_said(caplog)


async def test_a_region_overrides_upstream_http2(
    custom_region: CustomRegion, make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    url = await custom_region(http1_app([]))
    fake = await make_region("h2")
    proxy = await make_proxy(
        [{"name": "h1", "url": url, "http2": "auto"}, {"name": "h2", "url": fake.url}],
        upstream={"http2": True},
    )
    h1, h2 = await status_of(proxy, "h1"), await status_of(proxy, "h2")
    assert (h1["pool"]["http2"], h1["pool"]["http_version"], h1["state"]) == ("auto", "1.1", "up")
    assert (h2["pool"]["http2"], h2["pool"]["http_version"], h2["state"]) == (True, "2", "up")


async def test_the_status_page_shows_the_version_and_that_auto_found_it(
    custom_region: CustomRegion,
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    url = await custom_region(http1_app([]))
    fake = await make_region("h2")
    proxy = await make_proxy(
        [{"name": "h1", "url": url}, {"name": "h2", "url": fake.url, "http2": True}]
    )
    async with launch(tmp_path) as chromium:
        await chromium.send("Page.navigate", url=proxy.admin_url + "/?interval=250")
        cells = (
            "JSON.stringify([...document.querySelectorAll('#regions tr[data-region]')]"
            ".map(r => [r.dataset.region, r.querySelector('td.http').textContent,"
            " r.querySelector('td.http').title]))"
        )
        rows = await chromium.wait_for(cells + " !== '[]' && " + cells)
        assert json.loads(rows) == [
            ["h1", "1.1 (auto)", "it answered the HTTP/2 preface with 'HTTP/1.0 400 Bad Request'"],
            ["h2", "2", ""],
        ]
        assert not chromium.console_errors()


@pytest.mark.parametrize(
    ("value", "expected"), [("auto", "auto"), (True, True), (False, False), ("false", False)]
)
def test_http2_is_true_false_or_auto(value: object, expected: object) -> None:
    config = Config.from_mapping(
        {
            "upstream": {"http2": value},
            "regions": [{"name": "r", "url": "http://r", "http2": value}],
        },
        environ={},
    )
    assert config.upstream.http2 == expected and config.regions[0].http2 == expected
    assert type(config.upstream.http2) is type(expected)


def test_another_http2_value_is_an_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"regions\[0\]\.http2.*'auto'"):
        Config.from_mapping(
            {"regions": [{"name": "r", "url": "http://r", "http2": "h2c"}]}, environ={}
        )


# -- the pool itself: requests that come while it looks, servers that say nothing --------


def limits(**changes: Any) -> PoolLimits:
    return PoolLimits(**{"connect_timeout": 2.0, "read_timeout": 5.0, **changes})


async def read(pool: AutoPool, target: str = "/x") -> tuple[int, str]:
    resp = await pool.request("GET", target, [])
    try:
        async for _ in resp.aiter_bytes():
            pass
        return resp.status, resp.http_version
    finally:
        await resp.aclose()


@pytest.mark.parametrize("warm", [0, 1])
async def test_requests_that_come_first_wait_for_the_version_and_none_fails(
    custom_region: CustomRegion, caplog: pytest.LogCaptureFixture, warm: int
) -> None:
    """No start(), no warm connection: the first requests find the version, together."""
    versions: list[str] = []
    url = await custom_region(http1_app(versions))
    caplog.set_level(logging.INFO, logger="edgeproxy.regions")
    pool = AutoPool(url, limits(warm_connections=warm), label="region h1")
    try:
        assert pool.stats().http_version == "unknown" and pool.stats().detected == "pending"
        # One waiter gives up: the search the others wait for goes on.
        quitter = asyncio.ensure_future(read(pool))
        await asyncio.sleep(0)
        quitter.cancel()
        answers = await asyncio.gather(*(read(pool) for _ in range(8)))
        assert answers == [(200, "1.1")] * 8
        assert quitter.cancelled()
        said = [m for m in regions_said(caplog) if "speaks HTTP/1.1 only" in m]
        assert len(said) == 1, said
        stats = pool.stats()
        assert stats.http_version == "1.1" and stats.requests_total == 8
    finally:
        await pool.aclose()


async def test_a_region_replaced_by_an_http1_server_is_found_again(
    make_region: RegionFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Found HTTP/2, then the server on its port speaks HTTP/1.1 only: trying the down
    endpoint again (start) finds the version again, rather than forcing HTTP/2 on it."""
    fake = await make_region("h2")
    pool = AutoPool(fake.url, limits(), label="region swapped")
    runner = web.AppRunner(http1_app([]), access_log=None, shutdown_timeout=1.0)
    try:
        await pool.start()
        assert pool.stats().http_version == "2"
        await fake.stop()
        await eventually(lambda: pool.stats().connections_open == 0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", fake.port).start()
        caplog.set_level(logging.INFO, logger="edgeproxy.regions")
        await pool.start()
        assert pool.stats().http_version == "1.1"
        assert await read(pool) == (200, "1.1")
        assert any("region swapped speaks HTTP/1.1 only" in m for m in regions_said(caplog))
    finally:
        await pool.aclose()
        await runner.cleanup()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
ServeRaw = Callable[[Handler], Awaitable[str]]


@pytest.fixture
async def serve_raw() -> AsyncIterator[ServeRaw]:
    """A hand-written TCP server on 127.0.0.1 for a connection handler; returns its URL.
    Servers and the connections still open are closed afterwards."""
    servers: list[asyncio.Server] = []
    handlers: set[asyncio.Task[Any]] = set()

    async def start(handler: Handler) -> str:
        async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            handlers.add(task)
            try:
                await handler(reader, writer)
            finally:
                writer.close()

        server = await asyncio.start_server(tracked, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()
    for task in handlers:
        task.cancel()
    await asyncio.gather(*handlers, return_exceptions=True)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


async def test_a_server_that_closes_on_the_preface_is_tried_over_http1(
    serve_raw: ServeRaw, caplog: pytest.LogCaptureFixture
) -> None:
    """It said nothing of what it speaks: HTTP/1.1 answering settles it."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"PRI "):
            await _close(writer)
            return
        while head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
        await _close(writer)

    url = await serve_raw(handler)
    caplog.set_level(logging.INFO, logger="edgeproxy.regions")
    pool = AutoPool(url, limits(), label="region quiet")
    try:
        await pool.start()
        assert await read(pool) == (200, "1.1")
        assert pool.stats().detected == "closed the connection on the HTTP/2 preface"
        assert any("region quiet speaks HTTP/1.1 only" in m for m in regions_said(caplog))
    finally:
        await pool.aclose()


async def test_a_server_that_speaks_neither_is_left_undecided(serve_raw: ServeRaw) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        await _close(writer)

    url = await serve_raw(handler)
    pool = AutoPool(url, limits(connect_timeout=1.0))
    try:
        with pytest.raises(UpstreamConnectError, match="and HTTP/1.1 failed too"):
            await pool.start()
        # Still open: the next try looks again.
        assert pool.stats().detected == "pending"
        with pytest.raises(UpstreamConnectError, match="and HTTP/1.1 failed too"):
            await read(pool)
    finally:
        await pool.aclose()


async def test_an_unreachable_origin_is_left_undecided() -> None:
    with socket_closed_port() as url:
        pool = AutoPool(url, limits(connect_timeout=1.0))
        try:
            with pytest.raises(UpstreamConnectError) as caught:
                await pool.start()
            assert not isinstance(caught.value, UpstreamNotHTTP2)
            assert pool.stats().http_version == "unknown"
        finally:
            await pool.aclose()


class socket_closed_port:  # noqa: N801 - a context manager read as a phrase
    """A URL of 127.0.0.1 on a port that nothing listens on (held bound, not listening)."""

    def __enter__(self) -> str:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def __exit__(self, *_: object) -> None:
        self._sock.close()


async def test_a_status_line_on_a_kept_connection_is_found_at_the_timeout(
    serve_raw: ServeRaw,
) -> None:
    """An HTTP/1.x server that answers the preface and keeps the connection open: HTTP/2
    forced says why at the connect timeout, rather than only that it timed out."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 505 HTTP Version Not Supported\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await reader.read()  # keeps it open until the client leaves
        await _close(writer)

    url = await serve_raw(handler)
    pool = H2Pool(url, limits(connect_timeout=0.3))
    try:
        with pytest.raises(UpstreamNotHTTP2, match="speaks HTTP/1.1 only") as caught:
            await pool.start()
        assert caught.value.http1 and "505 HTTP Version Not Supported" in str(caught.value)
        assert ADVICE in str(caught.value)
    finally:
        await pool.aclose()


# -- TLS: ALPN -----------------------------------------------------------------------------


@pytest.fixture
async def tls_regions(tmp_path: Path) -> AsyncIterator[tuple[str, FakeRegion, FakeRegion]]:
    """Two TLS fake regions under one CA: one offering h2 and http/1.1 by ALPN, one
    http/1.1 only; yields the CA file and both."""
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert, key = write_pair(ca, tmp_path, "region")
    both = FakeRegion("both", certfile=cert, keyfile=key)
    h1 = FakeRegion("h1", certfile=cert, keyfile=key, http1_only=True)
    await both.start()
    await h1.start()
    try:
        yield str(ca_file), both, h1
    finally:
        await both.stop()
        await h1.stop()


async def test_alpn_picks_the_version_over_tls(
    tls_regions: tuple[str, FakeRegion, FakeRegion],
    make_proxy: ProxyFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ca_file, both, h1 = tls_regions
    caplog.set_level(logging.INFO, logger="edgeproxy.regions")
    proxy = await make_proxy(
        [{"name": "both", "url": both.url}, {"name": "h1", "url": h1.url}],
        upstream={"ca_file": ca_file},
    )
    h2_status, h1_status = await status_of(proxy, "both"), await status_of(proxy, "h1")
    assert h2_status["pool"]["http_version"] == "2"
    assert h2_status["endpoints"][0]["http_version_detected"] == "ALPN chose h2"
    assert h1_status["pool"]["http_version"] == "1.1"
    assert h1_status["endpoints"][0]["http_version_detected"] == "ALPN chose 'http/1.1', not h2"
    assert any(f"region h1 ({h1.url}) speaks HTTP/1.1 only" in m for m in regions_said(caplog))
    for fake in (both, h1):
        fake.reset_counters()
    for _ in range(6):
        status, body = await post_chat(proxy)
        assert status == 200, body
    assert set(both.counters().requests_by_http_version) <= {"2"}
    assert set(h1.counters().requests_by_http_version) <= {"1.1"}
    # And forced: HTTP/2 against the http/1.1-only region says what ALPN chose.
    forced = await make_proxy(
        [{"name": "h1", "url": h1.url, "http2": True}], upstream={"ca_file": ca_file}
    )
    (endpoint,) = (await status_of(forced, "h1"))["endpoints"]
    # It offered h2 alone, which the region does not have.
    assert endpoint["last_error"] == (
        f"warm-up failed: {h1.url} speaks HTTP/1.1 only (ALPN agreed on no h2); {ADVICE}"
    )


# -- a real llama.cpp server ---------------------------------------------------------------


class TestRealLlamaCpp:
    pytestmark = needs_llama_server

    async def test_a_llama_cpp_python_server_is_found_to_speak_http1(
        self,
        llama_servers: LlamaServers,
        make_proxy: ProxyFactory,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """llama-cpp-python's server (uvicorn) answers the h2c preface with an HTTP/1.1
        status line (404 for ``PRI *``): left unset, ``http2`` finds HTTP/1.1 and the region
        serves, where HTTP/2 by default left it unreachable."""
        url = await llama_servers()
        caplog.set_level(logging.INFO, logger="edgeproxy.regions")
        proxy = await make_proxy([{"name": "llama", "url": url}])
        region = await status_of(proxy, "llama")
        assert region["state"] == "up", region
        assert region["pool"]["http2"] == "auto" and region["pool"]["http_version"] == "1.1"
        detected = region["endpoints"][0]["http_version_detected"]
        assert "answered the HTTP/2 preface with 'HTTP/1.1 4" in detected, detected
        said = regions_said(caplog)
        assert any(f"region llama ({url}) speaks HTTP/1.1 only" in m for m in said), said
        status, body = await post_chat(proxy)
        assert status == 200, body
        assert body["choices"][0]["message"]["role"] == "assistant"
