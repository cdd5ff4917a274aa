"""The status page at the admin ``/``: served self-contained, and alive in headless Chromium.

The browser test drives Debian's ``chromium`` over the Chrome DevTools
Protocol with aiohttp's websocket client (no node tooling needed), and saves
a screenshot under ``test-artifacts/`` (git-ignored) and the test's tmp_path.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from edgeproxy import EdgeProxy

from ._browser import CHROMIUM, EXPECTED, NO_CHROMIUM, Chromium, launch
from .conftest import ProxyFactory, RegionFactory, eventually

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


async def test_page_is_self_contained(make_region: RegionFactory, make_proxy: ProxyFactory) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}])
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/html; charset=utf-8"
            csp = resp.headers["Content-Security-Policy"]
            html = await resp.text()
    # No build step, no external assets: everything is inline, the CSP allows nothing else.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "<script src" not in html and "stylesheet" not in html and "@import" not in html
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'", csp)
    assert len(html) < 64 * 1024


@pytest.fixture
async def chromium(tmp_path: Path) -> AsyncIterator[Chromium]:
    async with launch(tmp_path) as browser:
        yield browser


REGION_ROWS = """JSON.stringify([...document.querySelectorAll('#regions tr[data-region]')]
  .map(r => [r.dataset.region, r.dataset.state, r.querySelector('.share-value').textContent]))"""


async def test_status_page_in_headless_chromium_shows_regions_and_updates(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    chromium: Chromium,
    tmp_path: Path,
) -> None:
    up = await make_region("ap-southeast-1", ttft=0.01)
    down = await make_region("eu-west-1")
    await down.kill()  # unreachable from the start: the page must show it down
    proxy: EdgeProxy = await make_proxy(
        [
            {"name": "ap-southeast-1", "url": up.url, "lat": 1.29, "lon": 103.85},
            {"name": "eu-west-1", "url": down.url, "lat": 53.3, "lon": -6.3},
        ]
    )

    await chromium.send("Page.navigate", url=proxy.admin_url + "/?interval=250")
    await chromium.wait_for("Number(document.body.dataset.updates) >= 1")
    assert await chromium.evaluate("document.getElementById('pop').textContent") == "edge-test"
    rows = json.loads(await chromium.wait_for(REGION_ROWS + " !== '[]' && " + REGION_ROWS))
    assert [r[0] for r in rows] == ["ap-southeast-1", "eu-west-1"]
    assert [r[1] for r in rows] == ["up", "down"]
    assert await chromium.evaluate("document.getElementById('requests').textContent") == "0"

    # Traffic: the page picks it up on its own, without a reload.
    async with aiohttp.ClientSession() as client:
        for _ in range(12):
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.status == 200
                await resp.read()
    await eventually(lambda: proxy.status()["recent"]["requests"] == 12)
    await chromium.wait_for("document.getElementById('requests').textContent === '12'")
    p50 = await chromium.wait_for(
        "document.getElementById('p50').textContent !== '–' && "
        "document.getElementById('p50').textContent"
    )
    assert p50.endswith("ms") or p50.endswith(" s")
    points = await chromium.wait_for(
        "Number(document.querySelector('#latency-chart path[data-series=p99_ms]')"
        "?.dataset.points || 0)"
    )
    assert points >= 1
    rows = json.loads(await chromium.evaluate(REGION_ROWS))
    shares = {name: share for name, _, share in rows}
    assert shares == {"ap-southeast-1": "100.0%", "eu-west-1": "0.0%"}
    assert await chromium.evaluate("document.getElementById('ready').textContent") == "ready"
    assert not chromium.console_errors()

    shot = await chromium.send("Page.captureScreenshot", format="png")
    png = base64.b64decode(shot["data"])
    assert png.startswith(b"\x89PNG")
    (tmp_path / "status-page.png").write_bytes(png)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "status-page.png").write_bytes(png)


def test_the_browser_is_there_where_it_is_expected() -> None:
    """.ci/run sets EDGEPROXY_EXPECT_CHROMIUM: there, the browser tests run, never skip."""
    if not EXPECTED:
        pytest.skip("EDGEPROXY_EXPECT_CHROMIUM is not set (.ci/run sets it)")
    assert CHROMIUM is not None, NO_CHROMIUM
    found = subprocess.run([CHROMIUM, "--version"], capture_output=True, timeout=60, check=False)
    assert found.returncode == 0, found.stderr.decode(errors="replace")
    assert b"Chromium" in found.stdout or b"Chrome" in found.stdout, found.stdout
