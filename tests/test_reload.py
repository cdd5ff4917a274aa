"""In-process hot reload of a single process: ``EdgeProxy.reload``, SIGHUP and ``POST /reload``."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from edgeproxy import Config, ConfigError, EdgeProxy, PluginLoadError

from .conftest import ProxyFactory, RegionFactory, eventually, proxy_config, spawn_serve

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
STREAM = {**BODY, "stream": True}

# A plugin that appends each startup and shutdown call, with its tag, to a file: its
# module is imported again by each load, so the count cannot live in it.
COUNTER = """
from pathlib import Path

from edgeproxy import hookimpl


class Counter:
    def __init__(self, settings):
        self.log = Path(settings["log"])
        self.tag = settings.get("tag", "")

    @hookimpl
    def edgeproxy_startup(self, proxy):
        self._write("startup")

    @hookimpl
    def edgeproxy_shutdown(self, proxy):
        self._write("shutdown")

    def _write(self, what):
        with self.log.open("a") as f:
            f.write(f"{what} {self.tag}\\n")


def edgeproxy_plugin(settings):
    return Counter(settings)
"""


def config_of(
    regions: list[tuple[str, str]], deadline: float = 30.0, **sections: dict[str, Any]
) -> Config:
    # A grace period well past the streams' length, unless the test sets its own.
    sections["server"] = {"grace_period": 20.0, **sections.get("server", {})}
    data = proxy_config([{"name": n, "url": u} for n, u in regions], **sections)
    data["routes"] = [{"name": "completions", "path": "/v1/completions", "deadline": deadline}]
    return Config.from_mapping(data, environ={})


async def post(client: aiohttp.ClientSession, url: str) -> int:
    async with client.post(url + CHAT, json=BODY) as resp:
        await resp.read()
        return resp.status


async def test_reload_under_load_swaps_regions_and_the_route_deadline(
    make_region: RegionFactory, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stream of about 6 s, so that it is still running when the reload swaps even on a
    # loaded machine (well within the grace period the old generation drains in).
    old = await make_region("old", inter_token_delay=0.05, tokens=120)
    new = await make_region("new", ttft=0.2)
    proxy = await make_proxy(config=config_of([("old", old.url)]))
    old_pool, old_pipeline = next(iter(proxy.regions)).pool, proxy.pipeline
    pool_closed = asyncio.Event()
    in_flight_at_close: list[int] = []
    close_pool = old_pool.aclose

    async def spy() -> None:
        in_flight_at_close.append(old_pipeline.in_flight)
        pool_closed.set()
        await close_pool()

    monkeypatch.setattr(old_pool, "aclose", spy)
    statuses: list[int] = []
    stop = asyncio.Event()

    async def steady_load() -> None:
        async with aiohttp.ClientSession() as load_client:
            while not stop.is_set():
                statuses.append(await post(load_client, proxy.url))

    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=STREAM) as stream:
            first = await stream.content.readuntil(b"\n\n")
            load = asyncio.create_task(steady_load())
            await eventually(lambda: len(statuses) >= 3)
            # A region added, one removed, a route's deadline cut below the new one's TTFT.
            assert await proxy.reload(config_of([("new", new.url)], deadline=0.05)) == 2
            assert [r.name for r in proxy.regions] == ["new"]
            # The stream on the removed region holds its pool open, and its generation.
            assert not pool_closed.is_set()
            status = proxy.status()
            assert status["generation"] == 2 and status["retiring_generations"] == 1
            assert status["in_flight"] >= 1
            count = len(statuses)
            await eventually(lambda: len(statuses) >= count + 3)
            rest = await stream.content.read()
        assert (first + rest).rstrip().endswith(b"data: [DONE]")
        stop.set()
        await load
        assert statuses and set(statuses) == {200}
        # Once its last stream is done, the removed region's pool closes.
        await asyncio.wait_for(pool_closed.wait(), 30)
        assert in_flight_at_close == [0]
        completion = {"model": "m", "prompt": "hello"}
        async with client.post(proxy.url + "/v1/completions", json=completion) as resp:
            assert resp.status == 504
        async with client.get(proxy.admin_url + "/status") as resp:
            reload = (await resp.json())["reload"]
        assert reload["ok"] is True and reload["errors"] == []


async def test_a_stream_outlasting_the_old_generations_drain_is_cut_with_an_error_event(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    # A stream that stalls after its first event, past the grace period of the drain.
    old = await make_region("old", fault="stall_body", fault_paths=("/v1/",))
    new = await make_region("new")
    short = {"grace_period": 0.2}
    proxy = await make_proxy(config=config_of([("old", old.url)], server=short))
    raw = b""
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=STREAM) as stream:
            raw = await stream.content.readuntil(b"\n\n")
            await proxy.reload(config_of([("new", new.url)], server=short))
            # Cut, the stream ends without its last chunk: read what came until then.
            with contextlib.suppress(aiohttp.ClientPayloadError):
                async for chunk in stream.content.iter_any():
                    raw += chunk
        assert b"data: [DONE]" not in raw
        assert b"event: error" in raw and b"shutting_down" in raw
        assert await post(client, proxy.url) == 200


async def test_a_listener_change_or_a_plugin_that_fails_is_refused_and_the_old_config_serves(
    make_region: RegionFactory, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy(config=config_of([("ap-1", region.url)]))
    moved = config_of([("ap-1", region.url)], server={"port": 1}, limits={"max_connections": 7})
    with pytest.raises(ConfigError) as refused:
        await proxy.reload(moved)
    assert "server.port: listener changes need a restart" in refused.value.errors
    assert any(e.startswith("limits.max_connections: ") for e in refused.value.errors)
    broken = config_of([("ap-1", region.url)], plugins={"enabled": [str(tmp_path / "missing.py")]})
    with pytest.raises(PluginLoadError):
        await proxy.reload(broken)
    assert proxy.config.plugins.enabled == []
    async with aiohttp.ClientSession() as client:
        assert await post(client, proxy.url) == 200
        async with client.get(proxy.admin_url + "/status") as resp:
            reload = (await resp.json())["reload"]
        assert reload["ok"] is False and "missing.py" in reload["errors"][0]
        # Without a loader there is no config to read again.
        async with client.post(proxy.admin_url + "/reload") as resp:
            assert resp.status == 409
            assert (await resp.json())["error"]["code"] == "reload_unsupported"


async def test_plugins_restart_only_when_their_settings_change(
    make_region: RegionFactory, tmp_path: Path
) -> None:
    region = await make_region("ap-1")
    plugin = tmp_path / "counter.py"
    plugin.write_text(COUNTER)
    log = tmp_path / "calls.log"

    def config(tag: str, regions: list[tuple[str, str]]) -> Config:
        settings = {"counter": {"log": str(log), "tag": tag}}
        return config_of(regions, plugins={"enabled": [str(plugin)], "settings": settings})

    proxy = EdgeProxy(config("a", [("ap-1", region.url)]))
    await proxy.start()
    try:
        assert log.read_text() == "startup a\n"
        # Regions change, [plugins] does not: the plugin keeps running.
        other = await make_region("ap-2")
        await proxy.reload(config("a", [("ap-1", region.url), ("ap-2", other.url)]))
        async with aiohttp.ClientSession() as client:
            assert await post(client, proxy.url) == 200
        await eventually(lambda: proxy.status()["retiring_generations"] == 0)
        assert log.read_text() == "startup a\n"
        # Its settings change: the new one starts before the swap, the old one stops
        # once its generation drained.
        await proxy.reload(config("b", [("ap-1", region.url)]))
        await eventually(lambda: proxy.status()["retiring_generations"] == 0)
        assert proxy.status()["generation"] == 3
        assert log.read_text() == "startup a\nstartup b\nshutdown a\n"
    finally:
        await proxy.stop(grace=2.0)
    assert log.read_text() == "startup a\nstartup b\nshutdown a\nshutdown b\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def write_config(path: Path, port: int, admin_port: int, region: tuple[str, str]) -> None:
    path.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {port}\ngrace_period = 20.0\n'
        f'[admin]\nhost = "127.0.0.1"\nport = {admin_port}\n'
        f'[[regions]]\nname = "{region[0]}"\nurl = "{region[1]}"\n'
    )


async def test_sighup_and_post_reload_reload_a_running_serve(
    tmp_path: Path, make_region: RegionFactory
) -> None:
    # Serving the model asked for: a serve learns each region's from its /v1/models.
    first, second = await make_region("ap-1", model="m"), await make_region("ap-2", model="m")
    port, admin_port = free_port(), free_port()
    config = tmp_path / "edge.toml"
    write_config(config, port, admin_port, ("ap-1", first.url))
    proc = await spawn_serve(config, stderr=asyncio.subprocess.PIPE)
    url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"

    async def regions(client: aiohttp.ClientSession) -> list[str]:
        async with client.get(admin + "/status") as resp:
            return [r["name"] for r in (await resp.json())["regions"]]

    try:
        async with aiohttp.ClientSession() as client:
            for _ in range(600):
                try:
                    assert await post(client, url) == 200
                    break
                except aiohttp.ClientConnectorError:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("the proxy did not listen")
            write_config(config, port, admin_port, ("ap-2", second.url))
            proc.send_signal(signal.SIGHUP)
            for _ in range(600):
                if await regions(client) == ["ap-2"]:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("SIGHUP did not reload the config")
            assert await post(client, url) == 200
            # A config that does not load: refused, the running one serves.
            config.write_text(config.read_text() + "bogus = 1\n")
            async with client.post(admin + "/reload") as resp:
                assert resp.status == 409
                error = (await resp.json())["error"]
            assert error["code"] == "reload_refused"
            assert "regions[0].bogus" in error["message"]
            # A listener that moves needs a restart.
            write_config(config, free_port(), admin_port, ("ap-1", first.url))
            async with client.post(admin + "/reload") as resp:
                assert resp.status == 409
                assert (
                    "server.port: listener changes need a restart"
                    in ((await resp.json())["error"]["message"])
                )
            write_config(config, port, admin_port, ("ap-1", first.url))
            async with client.post(admin + "/reload") as resp:
                assert resp.status == 200
                assert (await resp.json())["reloaded"] is True
            # The operator's command says the same.
            reload = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "edgeproxy",
                "reload",
                "--admin",
                admin,
                stdout=asyncio.subprocess.PIPE,
            )
            out, _ = await asyncio.wait_for(reload.communicate(), 60)
            assert reload.returncode == 0
            assert out == b"reloaded: generation 4 serving, the old generation draining\n"
            assert await regions(client) == ["ap-1"]
            assert await post(client, url) == 200
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert b"config reloaded: generation 2 serving" in err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
