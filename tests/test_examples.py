"""Every example in examples/ runs, against real fake regions (and a real Redis)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import aiohttp
import pytest
import uvicorn
from aiohttp import web

from edgeproxy import load_config
from edgeproxy._cli import main as cli_main

from .conftest import ProxyFactory, RegionFactory, eventually

EXAMPLES = Path(__file__).parent.parent / "examples"
CHAT = "/v1/chat/completions"


# The model the examples' requests name, and their fake regions serve (and list in their
# /v1/models, from which the proxy learns it).
def chat(model: str = "small") -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}]}


def env_for(regions: dict[str, str]) -> dict[str, str]:
    """Point the example's regions at the fake ones and its listeners at free ports."""
    env = {"EDGEPROXY_SERVER__PORT": "0", "EDGEPROXY_ADMIN__PORT": "0"}
    for name, url in regions.items():
        env[f"EDGEPROXY_REGIONS__{name.upper().replace('-', '_')}__URL"] = f'"{url}"'
    return env


def import_path(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_example_config_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    for path in [*EXAMPLES.glob("*.toml"), *EXAMPLES.glob("*/*.toml")]:
        assert cli_main(["check-config", str(path)]) == 0, capsys.readouterr().err


async def test_sidecar_three_regions(
    make_region: RegionFactory, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    names = ["ap-southeast-1", "ap-northeast-1", "us-west-2"]
    regions = {name: (await make_region(name, model="small")).url for name in names}
    config = load_config(EXAMPLES / "sidecar.toml", environ=env_for(regions))
    proxy = await make_proxy(config=config)
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=chat()) as resp:
            assert resp.status == 200
            # Nearest to the Singapore PoP.
            assert resp.headers["X-Edgeproxy-Region"] == "ap-southeast-1"
        async with client.get(proxy.admin_url + "/status") as resp:
            status = await resp.json()
    versions = {r["name"]: r["pool"]["http_version"] for r in status["regions"]}
    assert versions == {"ap-southeast-1": "2", "ap-northeast-1": "2", "us-west-2": "1.1"}
    assert all(r["state"] == "up" for r in status["regions"])


async def test_gateway_embedding(
    make_region: RegionFactory,
) -> None:
    region = await make_region("primary", model="small")
    gateway = import_path(EXAMPLES / "gateway.py")
    app, proxy = gateway.build_app(region.url)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}"
    try:
        async with aiohttp.ClientSession() as client:
            async with client.get(url + "/health") as resp:
                assert await resp.json() == {"gateway": "ok", "proxy_ready": True}
            async with client.post(url + "/llm" + CHAT, json=chat()) as resp:
                assert resp.status == 200 and resp.headers["X-Edgeproxy-Region"] == "primary"
            async with client.post(url + CHAT, json=chat()) as resp:
                assert resp.status == 200 and resp.headers["X-Edgeproxy-Region"] == "primary"
            async with client.post(url + "/api/chat" + CHAT, json=chat()) as resp:
                assert resp.status == 401
            headers = {"x-gateway-user": "ann"}
            async with client.post(url + "/api/chat" + CHAT, json=chat(), headers=headers) as resp:
                assert resp.status == 200
    finally:
        await runner.cleanup()
    assert region.requests_by_path.get(CHAT) == 3


async def test_fastapi_gateway(make_region: RegionFactory) -> None:
    region = await make_region("primary", model="small", tokens=5)
    gateway = import_path(EXAMPLES / "fastapi_gateway.py")
    app, proxy = gateway.build_app(region.url)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as client:
            async with client.get(url + "/health") as resp:
                assert await resp.json() == {"gateway": "ok", "proxy_ready": True}
            async with client.post(url + "/llm" + CHAT, json=chat()) as resp:
                assert resp.status == 200 and resp.headers["X-Edgeproxy-Region"] == "primary"
            body = {**chat(), "stream": True}
            async with client.post(url + "/llm" + CHAT, json=body) as resp:
                assert (await resp.read()).rstrip().endswith(b"data: [DONE]")
    finally:
        server.should_exit = True
        await task
    assert not proxy.is_open


async def test_tenant_policy_plugin(make_region: RegionFactory, make_proxy: ProxyFactory) -> None:
    region = await make_region("ap-southeast-1", model="small")
    # The fake region lists one model but answers both the tenants ask for: the catalog is
    # not learnt, the plugin alone decides.
    environ = {
        **env_for({"ap-southeast-1": region.url}),
        "EDGEPROXY_REGIONS__AP_SOUTHEAST_1__LEARN_MODELS": "false",
    }
    config = load_config(EXAMPLES / "tenant_policy.toml", environ=environ)
    proxy = await make_proxy(config=config)
    before = region.requests_total
    async with aiohttp.ClientSession() as client:
        acme = {"X-Tenant-Id": "acme"}
        async with client.post(proxy.url + CHAT, json=chat("large"), headers=acme) as resp:
            assert resp.status == 200
            assert resp.headers["X-Tenant"] == "acme"
        other = {"X-Tenant-Id": "globex"}
        async with client.post(proxy.url + CHAT, json=chat("large"), headers=other) as resp:
            assert resp.status == 403
            error = (await resp.json())["error"]
            assert error["code"] == "model_not_allowed" and "globex" in error["message"]
        async with client.post(proxy.url + CHAT, json=chat("small"), headers=other) as resp:
            assert resp.status == 200
            assert resp.headers["X-Tenant"] == "globex"
    assert region.requests_total == before + 2


@pytest.mark.redis
async def test_multi_pop_shares_usage_through_redis(
    make_region: RegionFactory, make_proxy: ProxyFactory, redis_server: str, redis_prefix: str
) -> None:
    ap = await make_region("ap-southeast-1", model="small")
    eu = await make_region("eu-central-1", model="small")
    env = env_for({"ap-southeast-1": ap.url, "eu-central-1": eu.url})
    pops = []
    for name in ("edge-sin", "edge-fra"):
        config = load_config(EXAMPLES / "multi_pop" / f"{name}.toml", environ=env)
        config.plugins.settings["shared_usage"] = {
            "redis_url": redis_server,
            "prefix": redis_prefix,
        }
        pops.append(await make_proxy(config=config))
    sin, fra = pops
    body = {**chat(), "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as client:
        for proxy, count in ((sin, 2), (fra, 3)):
            for _ in range(count):
                async with client.post(
                    proxy.url + CHAT, json=body, headers={"X-Tenant-Id": "acme"}
                ) as resp:
                    assert resp.status == 200
                    await resp.read()
    usage = next(p for n, p in sin.plugins.pm.list_name_plugin() if n == "shared_usage")
    for _ in range(200):
        totals = await usage.totals("acme")
        if totals.get("requests") == 5:
            break
        import asyncio

        await asyncio.sleep(0.02)
    assert totals["requests"] == 5
    assert totals["requests:edge-sin"] == 2 and totals["requests:edge-fra"] == 3
    assert totals["total_tokens"] > 0
    # Each PoP routed to its own nearest region.
    assert ap.requests_by_path.get(CHAT) == 2 and eu.requests_by_path.get(CHAT) == 3
