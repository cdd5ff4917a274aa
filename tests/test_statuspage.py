"""The status page at the admin ``/``: served self-contained, and alive in headless Chromium.

The browser test drives Debian's ``chromium`` over the Chrome DevTools
Protocol with aiohttp's websocket client (no node tooling needed), and saves
a screenshot under ``test-artifacts/`` (git-ignored) and the test's tmp_path.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from edgeproxy import EdgeProxy

from .conftest import ProxyFactory, RegionFactory, eventually

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
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


class Chromium:
    """Headless Chromium driven over CDP: navigate, evaluate, screenshot."""

    def __init__(self, proc: subprocess.Popen[bytes], ws: aiohttp.ClientWebSocketResponse) -> None:
        self.proc = proc
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self._ids = itertools.count(1)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 30)
            if msg.get("id") == call_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result
            self.events.append(msg)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        """Poll ``expression`` in the page until it is truthy; return its value."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                value = await self.evaluate(expression)
            except RuntimeError:
                value = None  # the page is still loading (no body yet)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"page never satisfied: {expression}")
            await asyncio.sleep(0.1)

    def console_errors(self) -> list[str]:
        errors = []
        for event in self.events:
            if event.get("method") == "Log.entryAdded":
                entry = event["params"]["entry"]
                if entry.get("level") == "error":
                    errors.append(entry.get("text", ""))
            elif event.get("method") == "Runtime.exceptionThrown":
                errors.append(json.dumps(event["params"]["exceptionDetails"])[:300])
        return errors


@pytest.fixture
async def chromium(tmp_path: Path) -> AsyncIterator[Chromium]:
    if CHROMIUM is None:
        pytest.skip("no chromium binary (Debian: apt-get install chromium)")
    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--window-size=1280,900",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    session = aiohttp.ClientSession()
    try:
        # Chromium writes the port it picked into the profile folder.
        port_file = profile / "DevToolsActivePort"
        try:
            await eventually(
                lambda: port_file.exists() and port_file.read_text().count("\n") >= 1, 60
            )
        except AssertionError:
            pytest.skip(f"chromium did not start (exit code {proc.poll()})")
        port = int(port_file.read_text().split()[0])
        pages: list[dict[str, Any]] = []
        for _ in range(100):
            async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                pages = [t for t in await resp.json(content_type=None) if t["type"] == "page"]
            if pages:
                break
            await asyncio.sleep(0.1)
        assert pages, "chromium opened no page"
        ws = await session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        browser = Chromium(proc, ws)
        await browser.send("Page.enable")
        await browser.send("Runtime.enable")
        await browser.send("Log.enable")
        yield browser
        await ws.close()
    finally:
        await session.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
