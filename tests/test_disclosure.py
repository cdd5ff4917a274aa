"""What the proxy tells whoever asks about itself and its regions.

``/readyz`` is open to probes without the admin token: it names states and regions, never
an address, a path or an error's text (``/status``, behind the token, keeps them). Every
answer of every listener carries one ``Server`` header, ``server.server_header``
(``edgeproxy``; empty: none), never a region's nor aiohttp's or hypercorn's, which name
their versions; and one ``Date``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import httpx
import orjson
import pytest
from aiohttp import web

from edgeproxy import Config, ConfigError

from .conftest import CustomRegion, ProxyFactory, RegionFactory, eventually, proxy_config
from .test_server import closed_port

CHAT = "/v1/chat/completions"
# Sampled, so not cached: every request goes to the region.
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
H2C = {"http2": True, "h2c": True}
_JSON = orjson.dumps(BODY)
POST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_JSON), _JSON)
)
TRACE = b"TRACE / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
MALFORMED = b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n"


# -- /readyz ---------------------------------------------------------------------


async def test_readyz_names_an_unreachable_region_but_not_its_address(
    make_proxy: ProxyFactory,
) -> None:
    port = closed_port()
    proxy = await make_proxy([{"name": "late", "url": f"http://127.0.0.1:{port}"}])
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/readyz") as resp:
            assert resp.status == 503
            text = await resp.text()
        async with client.get(proxy.admin_url + "/status") as resp:
            status = await resp.json()
    assert orjson.loads(text) == {
        "status": "not ready",
        "reasons": ["region late unreachable", "no region is reachable"],
    }
    for leak in ("127.0.0.1", str(port), "http://", "Errno", "connect"):
        assert leak not in text
    # The detail is for the operator, behind the admin token.
    assert str(port) in status["regions"][0]["last_error"]


@pytest.mark.parametrize("required", [True, False], ids=["required", "optional"])
async def test_readyz_says_the_local_model_failed_but_not_where_it_looked(
    make_region: RegionFactory, make_proxy: ProxyFactory, tmp_path: Path, required: bool
) -> None:
    region = await make_region("ap-1")
    path = tmp_path / "private-models" / "absent.gguf"
    proxy = await make_proxy(
        [region], local_model={"path": str(path), "ready_requires_model": required}
    )
    local = proxy.pipeline.fallback.local
    await eventually(lambda: local.state in ("failed", "unavailable"))
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/readyz") as resp:
            assert resp.status == (503 if required else 200)
            text = await resp.text()
        async with client.get(proxy.admin_url + "/status") as resp:
            status = await resp.json()
    body = orjson.loads(text)
    said = body["reasons"] if required else body["warnings"]
    assert said == [f"local model {local.state}"]
    assert body["local_model"] == {"state": local.state, "model": local.model_name}
    assert "private-models" not in text and str(tmp_path) not in text
    assert local.error and local.error in status["fallback"]["local_model"]["error"]


# -- the Server header -----------------------------------------------------------


async def nginx_like(custom_region: CustomRegion) -> dict[str, object]:
    """A region that names its software and version, as nginx does by default."""

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "chat.completion", "choices": []},
            headers={"Server": "nginx/1.2", "Date": "Thu, 01 Jan 1970 00:00:00 GMT"},
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    return {"name": "ngx", "url": await custom_region(app), "http2": False}


async def raw_head(port: int, payload: bytes) -> list[tuple[str, str]]:
    """The header lines of the answer to ``payload``, lower-cased names, as sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()
    lines = head.decode("latin-1").split("\r\n")[1:-2]
    pairs = [line.split(":", 1) for line in lines]
    return [(name.strip().lower(), value.strip()) for name, value in pairs]


def named(headers: list[tuple[str, str]], name: str) -> list[str]:
    return [value for key, value in headers if key == name]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_the_aiohttp_listener_names_itself_on_every_answer(
    make_proxy: ProxyFactory, custom_region: CustomRegion
) -> None:
    proxy = await make_proxy([await nginx_like(custom_region)])
    port = port_of(proxy.url)
    relayed = await raw_head(port, POST)
    assert named(relayed, "x-edgeproxy-region") == ["ngx"]
    # The region's Date goes with its Server: the listener's own is the one sent.
    assert len(named(relayed, "date")) == 1
    assert named(relayed, "date") != ["Thu, 01 Jan 1970 00:00:00 GMT"]
    # The head checks' refusal, and the parser's.
    refused = await raw_head(port, TRACE)
    malformed = await raw_head(port, MALFORMED)
    for what, head in {"relayed": relayed, "refused": refused, "malformed": malformed}.items():
        assert named(head, "server") == ["edgeproxy"], what


async def test_the_admin_listener_names_itself_on_every_answer(
    make_proxy: ProxyFactory, make_region: RegionFactory
) -> None:
    proxy = await make_proxy([await make_region("ap-1")])
    async with aiohttp.ClientSession() as client:
        for path, expected in (("/healthz", 200), ("/status", 200), ("/nowhere", 404)):
            async with client.get(proxy.admin_url + path) as resp:
                assert resp.status == expected
                assert resp.headers.getall("Server") == ["edgeproxy"], path
        async with client.post(proxy.admin_url + "/healthz") as resp:
            assert resp.status == 405
            assert resp.headers.getall("Server") == ["edgeproxy"]
    # aiohttp's own 400 for a request it cannot parse, which no app signal sees.
    port = int(proxy.admin_url.rsplit(":", 1)[1])
    assert named(await raw_head(port, MALFORMED), "server") == ["edgeproxy"]


async def test_a_cached_answer_does_not_carry_the_regions_server(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # The fake region is hypercorn, which names itself (hypercorn-h2).
    proxy = await make_proxy([await make_region("ap-1")], cache={"xfetch_beta": 0.0})
    async with aiohttp.ClientSession() as client:
        for expected in ("MISS", "HIT"):
            async with client.post(proxy.url + CHAT, json={**BODY, "temperature": 0}) as resp:
                assert resp.headers["X-Edgeproxy-Cache"] == expected
                assert resp.headers.getall("Server") == ["edgeproxy"], expected
                assert len(resp.headers.getall("Date")) == 1
            await eventually(lambda: proxy.status()["cache"]["stores"] == 1)


async def test_the_http2_listener_sends_one_date_and_one_server(
    make_proxy: ProxyFactory, custom_region: CustomRegion
) -> None:
    proxy = await make_proxy([await nginx_like(custom_region)], server=H2C)
    for http2 in (True, False):
        async with httpx.AsyncClient(http1=not http2, http2=http2) as client:
            resp = await client.post(proxy.url + CHAT, json=BODY)
        assert resp.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        assert resp.headers["x-edgeproxy-region"] == "ngx"
        assert resp.headers.get_list("server") == ["edgeproxy"]
        assert len(resp.headers.get_list("date")) == 1
    # hypercorn's own answer to a request it cannot parse.
    head = await raw_head(port_of(proxy.url), MALFORMED)
    assert named(head, "server") == ["edgeproxy"]
    assert len(named(head, "date")) == 1


@pytest.mark.parametrize("server", [{}, H2C], ids=["aiohttp", "http2"])
async def test_an_empty_server_header_sends_none(
    make_proxy: ProxyFactory, custom_region: CustomRegion, server: dict[str, object]
) -> None:
    proxy = await make_proxy(
        [await nginx_like(custom_region)], server={**server, "server_header": ""}
    )
    port = port_of(proxy.url)
    relayed = await raw_head(port, POST)
    assert named(relayed, "x-edgeproxy-region") == ["ngx"]
    for head in (relayed, await raw_head(port, TRACE), await raw_head(port, MALFORMED)):
        assert named(head, "server") == []
        assert len(named(head, "date")) == 1
    async with aiohttp.ClientSession() as client:
        for path in ("/healthz", "/nowhere"):
            async with client.get(proxy.admin_url + path) as resp:
                assert "Server" not in resp.headers, path
    if proxy.admin_url.startswith("http://"):
        admin_port = int(proxy.admin_url.rsplit(":", 1)[1])
        assert named(await raw_head(admin_port, MALFORMED), "server") == []


@pytest.mark.parametrize("value", ["edge\r\nX-Injected: 1", " padded", "caf\u00e9"])
def test_a_server_header_that_would_break_the_head_is_refused(value: str) -> None:
    data = proxy_config([{"name": "ap-1", "url": "http://127.0.0.1:9"}])
    data["server"]["server_header"] = value
    with pytest.raises(ConfigError, match=r"server\.server_header"):
        Config.from_mapping(data, environ={})
