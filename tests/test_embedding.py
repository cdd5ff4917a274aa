"""edgeproxy embedded in a host aiohttp application, and plugin loading."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from edgeproxy import (
    AdminConfig,
    Config,
    EdgeProxy,
    PluginLoadError,
    PluginsConfig,
    RegionConfig,
    ServerConfig,
)

from .conftest import RegionFactory, eventually, proxy_config

CHAT = "/v1/chat/completions"
# The fake regions serve (and list in their /v1/models, from which a proxy learns it) the
# model the requests name.
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


async def run_host(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


@pytest.fixture
async def host_runners() -> AsyncIterator[list[web.AppRunner]]:
    runners: list[web.AppRunner] = []
    yield runners
    for runner in runners:
        await runner.cleanup()


def code_config(region_url: str) -> Config:
    """A config built in code, without a file."""
    return Config(
        server=ServerConfig(port=0),
        admin=AdminConfig(port=0),
        regions=[RegionConfig(name="ap-1", url=region_url)],
    )


async def hello(request: web.Request) -> web.Response:
    return web.json_response({"host": "own route"})


async def test_mounted_as_sub_app(
    make_region: RegionFactory, host_runners: list[web.AppRunner]
) -> None:
    region = await make_region("ap-1", model="m")
    proxy = EdgeProxy(code_config(region.url))
    parent = web.Application()
    parent.router.add_get("/hello", hello)
    parent.add_subapp("/llm", proxy.app)
    runner, url = await run_host(parent)
    host_runners.append(runner)
    # The host's startup opened the proxy's pools.
    assert proxy.regions.by_name["ap-1"].up
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/llm" + CHAT, json=BODY) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Region"] == "ap-1"
            assert (await resp.json())["object"] == "chat.completion"
        async with client.get(url + "/llm/echo/a?b=1") as resp:
            echo = await resp.json()
        assert echo["path"] == "/echo/a" and echo["query_string"] == "b=1"
        async with client.get(url + "/hello") as resp:
            assert await resp.json() == {"host": "own route"}
    pool = proxy.regions.by_name["ap-1"].pool
    await runner.cleanup()
    host_runners.remove(runner)
    # ... and the host's cleanup closed them.
    assert pool.stats().connections_open == 0
    with pytest.raises(RuntimeError, match="not open"):
        _ = proxy.regions


async def test_middleware_forwards_matching_routes(
    make_region: RegionFactory, host_runners: list[web.AppRunner]
) -> None:
    region = await make_region("ap-1", model="m")
    proxy = EdgeProxy(code_config(region.url))
    app = web.Application(middlewares=[proxy.middleware("/v1/", "/ai/", strip_prefix=False)])
    app.router.add_get("/hello", hello)
    proxy.setup(app)
    runner, url = await run_host(app)
    host_runners.append(runner)
    async with aiohttp.ClientSession() as client:
        async with client.post(url + CHAT, json=BODY) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Region"] == "ap-1"
        async with client.get(url + "/hello") as resp:
            assert await resp.json() == {"host": "own route"}
    assert region.requests_by_path.get(CHAT) == 1
    with pytest.raises(ValueError):
        proxy.middleware()


async def test_forward_from_a_handler(
    make_region: RegionFactory, host_runners: list[web.AppRunner]
) -> None:
    region = await make_region("ap-1", model="m")
    proxy = EdgeProxy(code_config(region.url))

    async def gateway(request: web.Request) -> web.StreamResponse:
        # A gateway's own logic first, then the proxy.
        if request.headers.get("x-gateway-token") != "ok":
            return web.json_response({"error": "gateway says no"}, status=403)
        return await proxy.forward(request, strip_prefix="/api")

    app = web.Application()
    app.router.add_route("*", "/api/{tail:.*}", gateway)
    proxy.setup(app)
    runner, url = await run_host(app)
    host_runners.append(runner)
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/api" + CHAT, json=BODY) as resp:
            assert resp.status == 403
        async with client.post(
            url + "/api" + CHAT, json=BODY, headers={"x-gateway-token": "ok"}
        ) as resp:
            assert resp.status == 200
            assert resp.headers["x-fake-region"] == "ap-1"


async def test_start_and_stop_from_python(make_region: RegionFactory) -> None:
    region = await make_region("ap-1", model="m")
    proxy = EdgeProxy(code_config(region.url))
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as client:
            async with client.get(proxy.admin_url + "/readyz") as resp:
                assert resp.status == 200
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.status == 200
    finally:
        assert await proxy.stop(grace=2.0)
    await eventually(lambda: region.in_flight == 0)


PLUGIN_SOURCE = """
from aiohttp import web
from edgeproxy import hookimpl

SETTINGS = {}

def edgeproxy_plugin(settings):
    SETTINGS.update(settings)
    return Plugin(settings["header"])

class Plugin:
    def __init__(self, header):
        self.header = header

    @hookimpl
    def edgeproxy_upstream_response(self, reply):
        reply.headers.append((self.header, "from-plugin"))
"""


async def test_plugin_loaded_from_a_file_path_with_settings(
    make_region: RegionFactory, tmp_path: Path
) -> None:
    region = await make_region("ap-1", model="m")
    path = tmp_path / "hdr_plugin.py"
    path.write_text(PLUGIN_SOURCE)
    config = Config.from_mapping(
        proxy_config(
            [{"name": "ap-1", "url": region.url}],
            plugins={
                "enabled": [str(path)],
                "settings": {"hdr_plugin": {"header": "X-From-File"}},
                "entry_points": False,
            },
        ),
        environ={},
    )
    proxy = EdgeProxy(config)
    assert "hdr_plugin" in proxy.plugins.names()
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.headers["X-From-File"] == "from-plugin"
    finally:
        await proxy.stop(grace=1.0)


def test_plugin_that_fails_to_load_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken_plugin.py"
    broken.write_text("raise ImportError('missing dependency foo')\n")
    base = {"regions": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    cases = {
        str(broken): "missing dependency foo",
        "no.such.module": "No module named",
        str(tmp_path / "absent.py"): "no such file",
    }
    for spec, reason in cases.items():
        config = Config.from_mapping({**base, "plugins": {"enabled": [spec]}}, environ={})
        with pytest.raises(PluginLoadError) as info:
            EdgeProxy(config)
        assert spec in str(info.value)
        assert reason in str(info.value)


def test_plugin_with_a_bad_hook_name_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "typo_plugin.py"
    bad.write_text(
        "from edgeproxy import hookimpl\n"
        "@hookimpl\n"
        "def edgeproxy_request_recieved(ctx):\n"
        "    pass\n"
    )
    config = Config.from_mapping(
        {
            "regions": [{"name": "a", "url": "http://127.0.0.1:1"}],
            "plugins": {"enabled": [str(bad)]},
        },
        environ={},
    )
    with pytest.raises(PluginLoadError, match="typo_plugin"):
        EdgeProxy(config)


async def test_entry_point_plugin_from_an_installed_distribution(
    make_region: RegionFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tiny distribution, built on the fly: a module plus its dist-info with
    # an edgeproxy.plugins entry point, on sys.path like any installed package.
    (tmp_path / "ep_demo_plugin.py").write_text(PLUGIN_SOURCE)
    dist = tmp_path / "ep_demo_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-demo-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent(
            """
            [edgeproxy.plugins]
            ep_demo = ep_demo_plugin
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    region = await make_region("ap-1", model="m")
    config = code_config(region.url).model_copy(
        update={"plugins": PluginsConfig(settings={"ep_demo": {"header": "X-From-Entry-Point"}})}
    )
    proxy = EdgeProxy(config)
    assert "ep_demo" in proxy.plugins.names()
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.headers["X-From-Entry-Point"] == "from-plugin"
    finally:
        await proxy.stop(grace=1.0)
    off = config.model_copy(update={"plugins": PluginsConfig(entry_points=False)})
    assert "ep_demo" not in EdgeProxy(off).plugins.names()
