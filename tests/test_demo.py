"""``edgeproxy demo`` serves its one model name: the regions and the local model alike.

The demo's local model is a tiny random-weight model that would answer any name with
gibberish and a 200; a mistyped name gets the API's 404 ``model_not_found`` instead, with
the regions up and in an outage alike.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import sys
from typing import Any

import aiohttp
import pytest

from edgeproxy import Config
from edgeproxy._demo import DEMO_MODEL, _demo_local_model

from .test_cli import local_model_state

needs_local_model = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None
    or importlib.util.find_spec("gguf") is None
    or importlib.util.find_spec("numpy") is None,
    reason="the demo's local model needs llama-cpp-python, gguf and numpy",
)


def test_a_configured_local_model_answers_for_the_demos_name_only() -> None:
    settings, line = _demo_local_model({"EDGEPROXY_LOCAL_MODEL__PATH": "/models/m.gguf"})
    assert line == "/models/m.gguf" and settings == {"models": [DEMO_MODEL]}
    # The path comes from the environment, merged into the demo's section.
    config = Config.from_mapping(
        {"regions": [{"name": "a", "url": "http://127.0.0.1:9"}], "local_model": settings},
        environ={"EDGEPROXY_LOCAL_MODEL__PATH": "/models/m.gguf"},
    )
    assert config.local_model.path == "/models/m.gguf"
    assert not config.local_model.answers_every_model


@pytest.mark.parametrize(
    "variable", ["EDGEPROXY_LOCAL_MODEL__MODELS", "EDGEPROXY_LOCAL_MODEL__SERVE_ALL_MODELS"]
)
def test_names_given_in_the_environment_are_left_as_given(variable: str) -> None:
    environ = {"EDGEPROXY_LOCAL_MODEL__PATH": "/models/m.gguf", variable: "x"}
    settings, _ = _demo_local_model(environ)
    assert settings == {}


@needs_local_model
def test_the_built_tiny_model_answers_for_the_demos_name_only() -> None:
    settings, line = _demo_local_model({})
    assert settings is not None and settings["models"] == [DEMO_MODEL]
    assert "gibberish" in line
    config = Config.from_mapping(
        {"regions": [{"name": "a", "url": "http://127.0.0.1:9"}], "local_model": settings},
        environ={},
    )
    assert not config.local_model.answers_every_model


async def _banner(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    banner = ""
    while "Ctrl-C stops it." not in banner:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert line, "demo exited before its banner ended"
        banner += line
    return banner


async def _post(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any], aiohttp.typedefs.LooseHeaders]:
    async with client.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None), resp.headers


def _not_found(status: int, payload: dict[str, Any], model: str) -> None:
    """OpenAI's 404 for an unknown model."""
    assert status == 404, payload
    error = payload["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert f"The model `{model}` does not exist" in error["message"]
    assert f"`{DEMO_MODEL}`" in error["message"]  # the name to use instead


@pytest.mark.model
@needs_local_model
async def test_a_mistyped_model_gets_404_from_the_demo_with_the_regions_up_or_down() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "edgeproxy",
        "demo",
        *("--port", "0", "--admin-port", "0", "--ttft", "0.01", "--inter-token-delay", "0.001"),
        *("--duration", "120"),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if not k.startswith("EDGEPROXY_LOCAL_MODEL__")}
        | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        banner = await _banner(proc)
        # The banner names the one model served, and what another name gets.
        assert re.search(rf"^\s*model\s+{DEMO_MODEL}, ", banner, re.M), banner
        assert "404 model_not_found" in banner
        proxy = re.search(r"^\s*proxy\s+(\S+)", banner, re.M)
        admin = re.search(r"^\s*admin\s+(\S+)", banner, re.M)
        fail = re.search(r"for r in (.+?); do\n\s*curl -s -X POST \$r/_control -d '(.+?)'", banner)
        assert proxy and admin and fail, banner
        chat = proxy.group(1) + "/v1/chat/completions"
        good = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "hello"}]}
        typo = {**good, "model": "dmeo"}
        async with aiohttp.ClientSession() as client:
            # The local model loads in the background: the requests start once it is ready,
            # so that a mistyped name could reach it.
            assert await local_model_state(client, admin.group(1)) == "ready"
            status, payload, _ = await _post(client, chat, good)
            assert status == 200, payload
            status, payload, headers = await _post(client, chat, typo)
            _not_found(status, payload, "dmeo")
            assert "X-Edgeproxy-Degraded" not in headers
            # In Anthropic's shape for a Messages request.
            status, payload, _ = await _post(
                client,
                proxy.group(1) + "/v1/messages",
                {"model": "dmeo", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert status == 404 and payload["type"] == "error", payload
            assert payload["error"]["type"] == "not_found_error"
            assert "`dmeo`" in payload["error"]["message"]
            # Every region fails: the demo's name gets the local model, another name the 404.
            for region in fail.group(1).split():
                async with client.post(region + "/_control", data=fail.group(2)) as resp:
                    assert resp.status == 200
            status, payload, headers = await _post(client, chat, good)
            assert status == 200 and headers["X-Edgeproxy-Degraded"] == "local-model", payload
            status, payload, headers = await _post(client, chat, typo)
            _not_found(status, payload, "dmeo")
            assert "X-Edgeproxy-Degraded" not in headers
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
