"""Headless Chromium driven over the Chrome DevTools Protocol with aiohttp's websocket
client (no node tooling needed), for the tests that need a real browser."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import pytest

from .conftest import eventually, stop_process

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
# The tests that drive it: tests/test_statuspage.py, tests/test_browser_h2.py,
# tests/test_http_version.py and tests/test_realtime.py (one test each, the second with two
# cases). Where the browser is expected (.ci/run sets this), a missing one fails them rather
# than skipping them, so that a CI without it cannot pass unnoticed.
EXPECTED = os.environ.get("EDGEPROXY_EXPECT_CHROMIUM", "") not in ("", "0")
NO_CHROMIUM = "no chromium binary (Debian: apt-get install chromium)"


def no_browser(reason: str) -> NoReturn:
    """Skip the test for ``reason``, or fail it where the browser is expected."""
    if EXPECTED:
        pytest.fail(f"{reason}, and EDGEPROXY_EXPECT_CHROMIUM is set (as .ci/run sets it)")
    pytest.skip(reason)


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


@contextlib.asynccontextmanager
async def launch(tmp_path: Path, *flags: str) -> AsyncIterator[Chromium]:
    """Headless Chromium with a fresh profile under ``tmp_path``; skips when there is none."""
    if CHROMIUM is None:
        no_browser(NO_CHROMIUM)
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
            *flags,
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
            no_browser(f"chromium did not start (exit code {proc.poll()})")
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
        stop_process(proc)
