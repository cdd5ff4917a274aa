"""What the proxy tells whoever asks about itself and its regions.

``/readyz`` is open to probes without the admin token: it names states and regions, never
an address, a path or an error's text (``/status``, behind the token, keeps them).
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import orjson
import pytest

from .conftest import ProxyFactory, RegionFactory, eventually
from .test_server import closed_port


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
