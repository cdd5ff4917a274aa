"""``edgeproxy serve --workers N``: the supervisor and its workers, run as real processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web

from edgeproxy import Config, ConfigError, EdgeProxy
from edgeproxy._server.supervisor import Supervisor

from .conftest import RegionFactory, proxy_config, spawn_serve, write_pair

CHAT = "/v1/chat/completions"
# The fake regions serve (and list in their /v1/models, from which a proxy learns it) the
# model the requests name.
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
STREAM = {**BODY, "stream": True}

_SERVING = re.compile(r"serving on (https?://\S+); admin on (https?://\S+)")


@dataclass
class Supervised:
    proc: asyncio.subprocess.Process
    url: str = ""
    admin: str = ""
    log: list[str] = field(default_factory=list)

    headers: dict[str, str] = field(default_factory=dict)

    async def status(self) -> dict[str, Any]:
        async with aiohttp.ClientSession(headers=self.headers) as client:
            async with client.get(self.admin + "/status") as resp:
                assert resp.status == 200
                data: dict[str, Any] = await resp.json()
                return data

    async def until(self, predicate: Any, what: str) -> dict[str, Any]:
        for _ in range(600):
            status = await self.status()
            if predicate(status):
                return status
            await asyncio.sleep(0.05)
        raise AssertionError(f"{what}: {status}; log:\n" + "".join(self.log[-40:]))


def write_config(
    path: Path,
    regions: list[tuple[str, str]],
    admin: dict[str, Any] | None = None,
    extra: str = "",
    **server: Any,
) -> None:
    settings = {"host": '"127.0.0.1"', "port": 0, "workers": 2, "grace_period": 20.0}
    settings.update(server)
    lines = ["[server]", *(f"{k} = {v}" for k, v in settings.items())]
    lines += ["[admin]", 'host = "127.0.0.1"', "port = 0"]
    lines += [f"{k} = {v}" for k, v in (admin or {}).items()]
    for name, url in regions:
        lines += ["[[regions]]", f'name = "{name}"', f'url = "{url}"']
    path.write_text("\n".join(lines) + "\n" + extra)


@contextlib.asynccontextmanager
async def supervise(config: Path) -> AsyncIterator[Supervised]:
    proc = await spawn_serve(
        config, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    run = Supervised(proc)
    started = asyncio.get_running_loop().create_future()

    async def read() -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            line = raw.decode(errors="replace")
            run.log.append(line)
            match = _SERVING.search(line)
            if match and not started.done():
                started.set_result(match.groups())
        if not started.done():
            started.set_exception(AssertionError("exited:\n" + "".join(run.log)))

    reader = asyncio.create_task(read())
    try:
        run.url, run.admin = await asyncio.wait_for(started, 120)
        yield run
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await asyncio.wait_for(reader, 30)


async def post_new_connection(url: str) -> int:
    """A request on a connection of its own, so the kernel picks a worker for each."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as client:
        async with client.post(url + CHAT, json=BODY) as resp:
            await resp.read()
            return resp.status


async def test_two_workers_share_the_port_and_the_admin_port_sums_them(
    tmp_path: Path, make_region: RegionFactory
) -> None:
    region = await make_region("ap-1", model="m")
    config = tmp_path / "edge.toml"
    write_config(config, [("ap-1", region.url)])
    async with supervise(config) as run:
        statuses = [await post_new_connection(run.url) for _ in range(40)]
        assert statuses == [200] * 40

        status = await run.until(
            lambda s: sum(w["requests_total"] or 0 for w in s["workers"]) == 40,
            "the workers' counts did not add up",
        )
        workers = status["workers"]
        assert len(workers) == 2
        assert len({w["pid"] for w in workers}) == 2
        assert os.getpid() not in {w["pid"] for w in workers}
        # The kernel spreads 40 connections over both (all on one: a 2 ** -39 chance).
        assert all(w["requests_total"] > 0 for w in workers)
        assert status["regions"][0]["requests_total"] == 40
        status = await run.until(
            lambda s: s["recent"]["requests"] == 40, "the recent windows were not summed"
        )
        assert sum(step["requests"] for step in status["recent"]["series"]) == 40
        assert sum(status["cache"]["bypass_reasons"].values()) == 40
        assert status["supervisor"]["workers"] == 2

        async with aiohttp.ClientSession() as client:
            async with client.get(run.admin + "/healthz") as resp:
                assert resp.status == 200
                # The supervisor's admin listener, not aiohttp with its version.
                assert resp.headers.getall("Server") == ["edgeproxy"]
            async with client.get(run.admin + "/readyz") as resp:
                assert resp.status == 200
                ready = await resp.json()
                assert [w["ready"] for w in ready["workers"]] == [True, True]
                assert [w["detail"] for w in ready["workers"]] == [{"status": "ready"}] * 2
            async with client.get(run.admin + "/metrics") as resp:
                assert resp.status == 200
                text = await resp.text()
        counts = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("edgeproxy_request_duration_seconds_count{")
        ]
        assert sum(counts) == 40

        run.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(run.proc.wait(), 60) == 0


async def test_a_killed_worker_is_restarted_and_the_other_one_serves_on(
    tmp_path: Path, make_region: RegionFactory
) -> None:
    region = await make_region("ap-1", model="m")
    config = tmp_path / "edge.toml"
    write_config(config, [("ap-1", region.url)])
    async with supervise(config) as run:
        # One kept-alive connection, and the worker that holds it.
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as client:
            async with client.post(run.url + CHAT, json=BODY) as resp:
                assert resp.status == 200
                await resp.read()
            status = await run.until(
                lambda s: sum(w["requests_total"] or 0 for w in s["workers"]) == 1,
                "the first request was not counted",
            )
            kept = next(w for w in status["workers"] if w["requests_total"] == 1)
            other = next(w for w in status["workers"] if w is not kept)
            os.kill(other["pid"], signal.SIGKILL)

            statuses = []
            for _ in range(20):
                async with client.post(run.url + CHAT, json=BODY) as resp:
                    await resp.read()
                    statuses.append(resp.status)
            assert statuses == [200] * 20

        status = await run.until(
            lambda s: any(
                w["index"] == other["index"] and w["restarts"] == 1 and w["answering"]
                for w in s["workers"]
            ),
            "the killed worker was not restarted",
        )
        restarted = next(w for w in status["workers"] if w["index"] == other["index"])
        assert restarted["pid"] != other["pid"]
        assert restarted["last_exit"] == "was killed by SIGKILL"
        assert any("restarting it in" in line for line in run.log)
        # Both serve again.
        assert [await post_new_connection(run.url) for _ in range(5)] == [200] * 5


async def test_sigterm_drains_every_worker_with_a_stream_in_flight(
    tmp_path: Path, make_region: RegionFactory
) -> None:
    region = await make_region("ap-1", model="m", inter_token_delay=0.1, tokens=15)
    config = tmp_path / "edge.toml"
    write_config(config, [("ap-1", region.url)])
    async with supervise(config) as run:
        async with aiohttp.ClientSession() as client:
            async with client.post(run.url + CHAT, json=STREAM) as resp:
                first = await resp.content.readuntil(b"\n\n")
                run.proc.send_signal(signal.SIGTERM)
                rest = await resp.content.read()
        assert (first + rest).rstrip().endswith(b"data: [DONE]")
        assert (first + rest).count(b"data: {") >= 15
        assert await asyncio.wait_for(run.proc.wait(), 60) == 0
        assert any("all drained" in line for line in run.log)


async def test_reload_under_load_swaps_regions_and_refuses_a_bad_config(
    tmp_path: Path, make_region: RegionFactory
) -> None:
    # Its stream lasts about 8 s: still running while new workers start, even on a loaded
    # machine, so that it finishes on a draining worker.
    old_region = await make_region("old", model="m", inter_token_delay=0.05, tokens=160)
    new_region = await make_region("new", model="m", ttft=0.2)
    config = tmp_path / "edge.toml"
    route = '[[routes]]\nname = "completions"\npath = "/v1/completions"\ndeadline = {}\n'
    write_config(config, [("old", old_region.url)], extra=route.format(30.0))
    async with supervise(config) as run:
        statuses: list[int] = []
        stop = asyncio.Event()

        async def steady_load() -> None:
            while not stop.is_set():
                statuses.append(await post_new_connection(run.url))

        async with aiohttp.ClientSession() as client:
            # A stream on the old region, in flight across the reload.
            async with client.post(run.url + CHAT, json=STREAM) as stream:
                first = await stream.content.readuntil(b"\n\n")
                load = asyncio.create_task(steady_load())
                # A region added, one removed, a route's deadline cut below the new one's TTFT.
                write_config(config, [("new", new_region.url)], extra=route.format(0.05))
                run.proc.send_signal(signal.SIGHUP)
                status = await run.until(
                    lambda s: (
                        s["supervisor"]["generation"] == 2
                        and [r["name"] for r in s["regions"]] == ["new"]
                    ),
                    "the reload did not happen",
                )
                rest = await stream.content.read()
            assert (first + rest).rstrip().endswith(b"data: [DONE]")
            for _ in range(5):
                statuses.append(await post_new_connection(run.url))
            stop.set()
            await load
            assert statuses and set(statuses) == {200}
            assert [w["generation"] for w in status["workers"]] == [2, 2]
            completion = {"model": "m", "prompt": "hello"}
            async with client.post(run.url + "/v1/completions", json=completion) as resp:
                assert resp.status == 504

            # A config that does not load: refused, generation 2 keeps serving.
            config.write_text(config.read_text() + "bogus = 1\n")
            async with client.post(run.admin + "/reload") as resp:
                assert resp.status == 409
                error = (await resp.json())["error"]
                assert error["code"] == "reload_refused"
                assert "routes[0].bogus: unknown key" in error["message"]
            # A listener that moves needs a restart.
            write_config(config, [("new", new_region.url)], port=1)
            async with client.post(run.admin + "/reload") as resp:
                assert resp.status == 409
                assert (
                    "server.port: listener address changes need a restart"
                    in (await resp.json())["error"]["message"]
                )
            status = await run.status()
            assert status["supervisor"]["generation"] == 2
            assert status["supervisor"]["last_reload"]["reloaded"] is False
            assert await post_new_connection(run.url) == 200
        run.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(run.proc.wait(), 60) == 0


async def test_a_port_taken_by_another_process_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "edge.toml"
        write_config(config, [("ap-1", "http://127.0.0.1:9")], port=port)
        proc = await spawn_serve(config, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert f"server.port: cannot bind 127.0.0.1:{port}" in err.decode()


@pytest.mark.parametrize("value", [0, -1, "many", True, 1.5])
def test_workers_must_be_a_positive_number_or_auto(value: object) -> None:
    data = {"server": {"workers": value}, "regions": [{"name": "a", "url": "http://x"}]}
    with pytest.raises(ConfigError, match=r"server\.workers: must be a whole number"):
        Config.from_mapping(data, environ={})


def test_auto_is_one_worker_per_usable_core() -> None:
    data = {"server": {"workers": "auto"}, "regions": [{"name": "a", "url": "http://x"}]}
    config = Config.from_mapping(data, environ={})
    assert config.server.worker_count() == len(os.sched_getaffinity(0))


async def test_workers_speak_tls_and_the_supervisors_admin_port_needs_its_token(
    tmp_path: Path, make_region: RegionFactory
) -> None:
    region = await make_region("ap-1", model="m")
    ca = trustme.CA()
    write_pair(ca, tmp_path)
    config = tmp_path / "edge.toml"
    write_config(
        config,
        [("ap-1", region.url)],
        admin={"token": '"s3cret"'},
        tls_cert='"proxy.pem"',
        tls_key='"proxy.key"',
    )
    async with supervise(config) as run:
        assert run.url.startswith("https://")
        context = ssl.create_default_context()
        ca.configure_trust(context)
        connector = aiohttp.TCPConnector(ssl=context, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as client:
            for _ in range(4):
                async with client.post(run.url + CHAT, json=BODY) as resp:
                    assert resp.status == 200
        async with aiohttp.ClientSession() as client:
            async with client.get(run.admin + "/status") as resp:
                assert resp.status == 401
            async with client.get(run.admin + "/healthz") as resp:
                assert resp.status == 200
        run.headers["Authorization"] = "Bearer s3cret"
        status = await run.until(
            lambda s: sum(w["requests_total"] or 0 for w in s["workers"]) == 4,
            "the requests were not counted",
        )
        assert len(status["workers"]) == 2


async def test_the_supervisors_admin_port_has_the_routes_and_token_check_of_a_proxys() -> None:
    config = Config.from_mapping(
        proxy_config([{"name": "r1", "url": "http://127.0.0.1:9"}], admin={"token": "t"}),
        environ={},
    )
    proxy = EdgeProxy(config)
    supervisor = Supervisor(config, lambda: config)

    def routes(app: web.Application) -> list[tuple[str, str]]:
        return sorted((route.method, route.resource.canonical) for route in app.router.routes())

    ours = supervisor._admin_app("t")
    assert routes(ours) == routes(proxy.admin_app)
    assert ("GET", "/metrics") in routes(ours)
    assert len(ours.middlewares) == len(proxy.admin_app.middlewares) == 1
