"""The ``edgeproxy`` command, run as a real process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from edgeproxy._cli import main

from .conftest import RegionFactory, eventually, spawn_serve, wait_ready


async def local_model_state(client: aiohttp.ClientSession, admin: str) -> str:
    """The demo's local model's state once it has stopped loading (loaded in the background
    at start; up to two minutes on a loaded machine), as the admin /status gives it."""
    for _ in range(1200):
        async with client.get(admin + "/status") as resp:
            state: str = (await resp.json())["fallback"]["local_model"]["state"]
        if state not in ("idle", "loading"):
            break
        await asyncio.sleep(0.1)
    return state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_check_config_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "edge.toml"
    path.write_text('[[regions]]\nname = "a"\nurl = "http://127.0.0.1:9101"\n')
    assert main(["check-config", str(path)]) == 0
    assert "OK (1 region: a)" in capsys.readouterr().out


def test_check_config_lists_every_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "edge.toml"
    path.write_text('[server]\nport = 70000\n[[regions]]\nname = "a"\nurl = "gopher://x"\n')
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "server.port:" in err
    assert "regions[0].url: must be an http:// or https:// URL" in err


def test_serve_with_bad_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "edge.toml"
    path.write_text("[server]\nport = 1\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "at least one [[regions]]" in capsys.readouterr().err


def test_config_docs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config-docs"]) == 0
    assert "`server.port`" in capsys.readouterr().out


def test_the_command_starts_without_httpx() -> None:
    # A process of its own: this one has imported httpx already (the test kit uses it).
    # Only the operator's commands need it; serve and check-config must not pay for it.
    probe = "import sys, edgeproxy._cli; print('httpx' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"


async def test_sigterm_drains_in_flight_stream(tmp_path: Path, make_region: RegionFactory) -> None:
    # Serving the model asked for: a serve learns the region's from its /v1/models.
    region = await make_region("ap-1", model="m", inter_token_delay=0.1, tokens=15)
    port, admin_port = free_port(), free_port()
    config = tmp_path / "edge.toml"
    config.write_text(
        f"""
[server]
port = {port}
grace_period = 20.0

[admin]
port = {admin_port}

[[regions]]
name = "ap-1"
url = "{region.url}"
"""
    )
    proc = await spawn_serve(
        config, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        await wait_ready(f"http://127.0.0.1:{admin_port}")
        async with aiohttp.ClientSession() as client:
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
            async with client.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", json=body
            ) as resp:
                first = await resp.content.readuntil(b"\n\n")
                proc.send_signal(signal.SIGTERM)
                rest = await resp.content.read()
            raw = first + rest
            assert raw.rstrip().endswith(b"data: [DONE]")

            # The listener is closed: new connections are refused once draining began.
            with pytest.raises(aiohttp.ClientConnectionError):
                async with aiohttp.ClientSession() as fresh:
                    async with fresh.get(f"http://127.0.0.1:{port}/healthz") as r:
                        await r.read()
        code = await asyncio.wait_for(proc.wait(), 30)
        assert code == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    await eventually(lambda: region.in_flight == 0)


async def start_demo(*, stderr: int = asyncio.subprocess.PIPE) -> asyncio.subprocess.Process:
    """``edgeproxy demo`` on free ports, fast regions, stopped after two minutes at most."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "edgeproxy",
        "demo",
        "--port",
        "0",
        "--admin-port",
        "0",
        "--ttft",
        "0.01",
        "--inter-token-delay",
        "0.001",
        "--duration",
        "120",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=stderr,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def test_demo_serves_on_embedded_defaults() -> None:
    proc = await start_demo()
    try:
        assert proc.stdout is not None
        url = admin = page = None
        while url is None or admin is None or page is None:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert line, "demo exited before printing its URLs"
            if line.strip().startswith("proxy "):
                url = line.split()[1]
                assert "--port" in line  # the banner says how to move it
            if line.strip().startswith("admin "):
                admin = line.split()[1]
                assert "--admin-port" in line
            if line.strip().startswith("status "):
                page = line.split()[1]
        body = {"model": "demo", "messages": [{"role": "user", "content": "hello"}]}
        async with aiohttp.ClientSession() as client:
            async with client.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["X-Edgeproxy-Region"] == "ap-southeast-1"
            async with client.get(admin + "/status") as resp:
                status = await resp.json()
            async with client.get(page) as resp:
                assert resp.content_type == "text/html"  # the status page itself
        assert len(status["regions"]) == 3
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert proc.stderr is not None
        log = (await proc.stderr.read()).decode()
        # serve's log names the admin listener and the status page too...
        assert f"status page at {page}" in log
        # ...and llama.cpp's warnings about the test model stay out of it.
        assert "special_eos_id" not in log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_an_environment_override_is_named_as_the_source_with_a_suggestion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "good.toml"
    path.write_text('[[regions]]\nname = "a"\nurl = "http://127.0.0.1:9101"\n')
    monkeypatch.setenv("EDGEPROXY_SERVER__PROT", "1")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        "server.prot (from the environment variable EDGEPROXY_SERVER__PROT): unknown key; "
        "did you mean 'port'?" in err
    )


def test_unknown_keys_get_the_closest_key_and_bad_values_are_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "edge.toml"
    path.write_text(
        '[server]\nport = "abc"\n[cache]\nredis_password = 5\n'
        '[[regions]]\nname = "a"\nurl = "http://127.0.0.1:9101"\nweigth = 2\n'
        '[[routes]]\nname = "r"\npath = "/"\nsemantic_treshold = 0.5\n'
    )
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "server.port: Input should be a valid integer" in err and "(got 'abc')" in err
    assert "regions[0].weigth: unknown key; did you mean 'weight'?" in err
    assert "routes[0].semantic_treshold: unknown key; did you mean 'semantic_threshold'?" in err
    # A secret's value is never echoed.
    line = next(x for x in err.splitlines() if "cache.redis_password" in x)
    assert "got" not in line


@pytest.mark.parametrize("command", ["serve", "check-config", "demo"])
def test_a_bad_configuration_exits_2_from_every_command(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "edge.toml"
    path.write_text("[server]\nport = 70000\n")
    argv = {
        "serve": ["serve", "--config", str(path)],
        "check-config": ["check-config", str(path)],
        "demo": ["demo", "--port", "70000"],
    }[command]
    assert main(argv) == 2
    assert "server.port" in capsys.readouterr().err


@pytest.mark.model
async def test_the_demo_banner_steps_give_the_local_model_then_the_regions_again() -> None:
    """Exactly the banner's steps, from one caller: every region made to fail, then a few
    requests (each answered by the local model, never 502 or 429), then the regions
    repaired and the next request answered by a region."""
    import importlib.util
    import json
    import re

    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the demo's local model needs llama-cpp-python, gguf and numpy")
    proc = await start_demo(stderr=asyncio.subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        banner = ""
        while "Ctrl-C stops it." not in banner:
            line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
            assert line, "demo exited before its banner ended"
            banner += line
        url = re.search(r"^\s*proxy\s+(\S+)", banner, re.M)
        loops = re.findall(
            r"for r in (.+?); do\n\s*curl -s -X POST \$r/_control -d '(.+?)'", banner
        )
        chat = re.search(r"curl -si (\S+) .*\n\s*-d '(.+?)'", banner)
        assert url and chat and len(loops) == 2, banner
        fail, repair = loops
        body = json.loads(chat.group(2))
        admin = re.search(r"^\s*admin\s+(\S+)", banner, re.M)
        assert admin
        async with aiohttp.ClientSession() as client:
            # The local model loads in the background: the steps start once it is ready.
            assert await local_model_state(client, admin.group(1)) == "ready"
            for region in fail[0].split():
                async with client.post(region + "/_control", data=fail[1]) as resp:
                    assert resp.status == 200
            for _ in range(6):
                async with client.post(chat.group(1), json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["X-Edgeproxy-Degraded"] == "local-model"
                    # Every region tried (those ejected after failing often, skipped).
                    assert resp.headers["X-Edgeproxy-Attempts"] in ("2", "3")
            for region in repair[0].split():
                async with client.post(region + "/_control", data=repair[1]) as resp:
                    assert resp.status == 200
            async with client.post(chat.group(1), json=body) as resp:
                assert resp.status == 200
                assert "X-Edgeproxy-Degraded" not in resp.headers
                assert resp.headers["X-Edgeproxy-Region"] != "local"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
