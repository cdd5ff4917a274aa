"""The ASGI front end: edgeproxy mounted in FastAPI and Starlette hosts, and served alone by
an ASGI server (uvicorn), with the same pipeline, plugins and limits as the aiohttp
listener."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import uvicorn
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from edgeproxy import Config, EdgeProxy, Response, hookimpl

from .conftest import RegionFactory, check_disconnect_cancels_upstream, eventually, proxy_config

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


@contextlib.asynccontextmanager
async def served(app: Any, ws: str = "auto", scheme: str = "http") -> AsyncIterator[str]:
    """``app`` under uvicorn on an ephemeral port, with the WebSocket implementation
    ``ws``; its base URL."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", ws=ws)
    )
    task = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started or task.done())
        if task.done():
            task.result()
            raise AssertionError("uvicorn did not start")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def make_proxy(region_url: str, *, plugins: list[object] = (), **sections: Any) -> EdgeProxy:
    config = Config.from_mapping(
        proxy_config([{"name": "ap-1", "url": region_url}], **sections), environ={}
    )
    return EdgeProxy(config, plugins=list(plugins))


async def hello(request: Request) -> JSONResponse:
    return JSONResponse({"host": "own route"})


def fastapi_host(proxy: EdgeProxy) -> FastAPI:
    app = FastAPI(lifespan=proxy.lifespan)
    app.add_api_route("/hello", hello)
    app.mount("/llm", proxy.asgi)
    return app


def starlette_host(proxy: EdgeProxy) -> Starlette:
    return Starlette(
        routes=[Route("/hello", hello), Mount("/llm", app=proxy.asgi)], lifespan=proxy.lifespan
    )


async def read_events(resp: aiohttp.ClientResponse) -> list[bytes]:
    raw = b""
    async for chunk in resp.content.iter_any():
        raw += chunk
    return [e for e in raw.split(b"\n\n") if e.strip()]


@pytest.mark.parametrize("host", [fastapi_host, starlette_host], ids=["fastapi", "starlette"])
async def test_mounted_json_and_sse(make_region: RegionFactory, host: Any) -> None:
    region = await make_region("ap-1", tokens=6)
    proxy = make_proxy(region.url)
    assert not proxy.is_open
    async with served(host(proxy)) as url, aiohttp.ClientSession() as client:
        # The host's lifespan opened the proxy's pools.
        assert proxy.is_open and proxy.regions.by_name["ap-1"].up
        async with client.post(url + "/llm" + CHAT, json=BODY) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Region"] == "ap-1"
            assert (await resp.json())["object"] == "chat.completion"
        async with client.post(url + "/llm" + CHAT, json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = await read_events(resp)
        chunks = [orjson.loads(e[6:]) for e in events if e.startswith(b"data: {")]
        assert len(chunks) >= 6 and events[-1] == b"data: [DONE]"
        # The mount prefix is the host's; the query string goes through as sent.
        async with client.get(url + "/llm/echo/a%20b?b=1&c=2") as resp:
            echo = await resp.json()
        assert echo["path"] == "/echo/a b" and echo["query_string"] == "b=1&c=2"
        async with client.get(url + "/hello") as resp:
            assert await resp.json() == {"host": "own route"}
    # And its shutdown closed them.
    assert not proxy.is_open


async def test_sse_goes_event_by_event(make_region: RegionFactory) -> None:
    """Streamed answers are not buffered by the front end: the first event reaches the
    client while the region has not yet written the last."""
    region = await make_region("ap-1", tokens=50, inter_token_delay=0.1)
    proxy = make_proxy(region.url)
    async with served(starlette_host(proxy)) as url, aiohttp.ClientSession() as client:
        async with client.post(url + "/llm" + CHAT, json={**BODY, "stream": True}) as resp:
            first = await resp.content.readuntil(b"\n\n")
            assert first.startswith(b"data: {")
            assert region.in_flight == 1  # still streaming upstream
            rest = await read_events(resp)
        assert rest[-1] == b"data: [DONE]"


@pytest.mark.parametrize("host", [fastapi_host, starlette_host], ids=["fastapi", "starlette"])
async def test_client_disconnect_cancels_upstream(make_region: RegionFactory, host: Any) -> None:
    region = await make_region("ap-1", inter_token_delay=0.2, tokens=200)
    proxy = make_proxy(region.url)
    async with served(host(proxy)) as url:
        await check_disconnect_cancels_upstream(url + "/llm" + CHAT, BODY, region, proxy)


async def test_disconnect_while_waiting_for_headers(make_region: RegionFactory) -> None:
    region = await make_region("ap-1", fault="stall")
    proxy = make_proxy(region.url)
    async with served(starlette_host(proxy)) as url:
        async with aiohttp.ClientSession() as client:
            task = asyncio.ensure_future(client.post(url + "/llm" + CHAT, json=BODY))
            await eventually(lambda: region.in_flight == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await eventually(lambda: region.in_flight == 0 and region.cancelled_total == 1)
        await eventually(lambda: proxy.pipeline.in_flight == 0)


async def test_served_alone_follows_the_asgi_lifespan(make_region: RegionFactory) -> None:
    region = await make_region("ap-1")
    proxy = make_proxy(region.url)
    async with served(proxy.asgi) as url, aiohttp.ClientSession() as client:
        assert proxy.is_open
        async with client.post(url + CHAT, json=BODY) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Region"] == "ap-1"
    assert not proxy.is_open


async def test_mounted_without_a_lifespan_it_opens_on_its_first_request_with_a_warning(
    make_region: RegionFactory, caplog: pytest.LogCaptureFixture
) -> None:
    region = await make_region("ap-1")
    proxy = make_proxy(region.url)
    # A host that forgot the proxy's lifespan, as a newcomer writes it.
    host = Starlette(routes=[Mount("/llm", app=proxy.asgi)])
    try:
        async with served(host) as url, aiohttp.ClientSession() as client:
            answers = await asyncio.gather(
                *(client.post(url + "/llm" + CHAT, json=BODY) for _ in range(3))
            )
            assert [a.status for a in answers] == [200, 200, 200]
            for answer in answers:
                answer.release()
        warnings = [r for r in caplog.records if "lifespan=proxy.lifespan" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelname == "WARNING"
        assert proxy.is_open
    finally:
        await proxy.close()


async def test_once_closed_it_stays_closed_a_clear_503(make_region: RegionFactory) -> None:
    region = await make_region("ap-1")
    proxy = make_proxy(region.url)
    host = Starlette(routes=[Mount("/llm", app=proxy.asgi)], lifespan=proxy.lifespan)
    async with served(host) as url:
        pass  # opened and closed by the host's lifespan
    assert proxy.ever_opened and not proxy.is_open
    app = Starlette(routes=[Mount("/llm", app=proxy.asgi)])
    async with served(app) as url, aiohttp.ClientSession() as client:
        async with client.post(url + "/llm" + CHAT, json=BODY) as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
    assert error["code"] == "not_open" and "lifespan" in error["message"]


class Answering:
    """A plugin answering one path itself, through the same hook as under aiohttp."""

    @hookimpl
    def edgeproxy_request_received(self, request: Any, ctx: Any) -> Response | None:
        if ctx.path == "/plugin":
            return Response.json({"from": "plugin", "version": request.version}, status=418)
        return None


async def test_plugins_and_limits_apply(make_region: RegionFactory) -> None:
    region = await make_region("ap-1")
    proxy = make_proxy(region.url, plugins=[Answering()], limits={"max_body_size": 1000})
    async with served(starlette_host(proxy)) as url, aiohttp.ClientSession() as client:
        async with client.get(url + "/llm/plugin") as resp:
            assert resp.status == 418
            assert await resp.json() == {"from": "plugin", "version": "1.1"}
        # A declared body over the limit: 413 before it is read.
        async with client.post(url + "/llm" + CHAT, data=b"x" * 2000) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "request_too_large"
        # Counted with the listener's own limits in /status, though refused by the head
        # check before any body.
        assert proxy.guard.snapshot()["bodies_too_large"] == 1

        # A chunked body over the limit: 413 once it passes it.
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(4):
                yield b"y" * 400

        async with client.post(
            url + "/llm" + CHAT, data=chunks(), headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 413
        assert proxy.guard.snapshot()["bodies_too_large"] == 2
        async with client.request("TRACE", url + "/llm/echo") as resp:
            assert resp.status == 405
            assert (await resp.json())["error"]["code"] == "method_not_allowed"
        # Bad JSON is the pipeline's own 400, as under aiohttp.
        async with client.post(
            url + "/llm" + CHAT, data=b"{nope", headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_reset_mid_stream_is_not_a_clean_end(
    make_region: RegionFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer cut upstream ends with an error event and no clean end of the body: the
    application raises to its server, which closes the connection."""
    region = await make_region("ap-1", fault="reset", fault_after_tokens=2, inter_token_delay=0.01)
    proxy = make_proxy(region.url)
    raw = b""
    async with served(starlette_host(proxy)) as url, aiohttp.ClientSession() as client:
        async with client.post(url + "/llm" + CHAT, json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in resp.content.iter_any():
                    raw += chunk
    assert b"event: error" in raw
    assert b"[DONE]" not in raw


async def test_stalled_body_gets_408(make_region: RegionFactory) -> None:
    """The aiohttp listener's body bounds hold on any ASGI server: a body that stalls for
    body_timeout gets 408 in the OpenAI shape."""
    region = await make_region("ap-1")
    proxy = make_proxy(region.url, limits={"body_timeout": 0.5})
    stalled = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b'{"model": "m", '
        await stalled.wait()  # never set: the client stops sending
        yield b"}"

    async with served(starlette_host(proxy)) as url, aiohttp.ClientSession() as client:
        async with client.post(
            url + "/llm" + CHAT, data=slow(), headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 408
            error = (await resp.json())["error"]
    assert error["code"] == "request_timeout"
    assert proxy.guard.snapshot()["body_timeouts"] == 1
    await eventually(lambda: proxy.pipeline.in_flight == 0 if proxy.is_open else True)
