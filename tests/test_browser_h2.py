"""Headless Chromium, a page served over HTTPS with HTTP/2 (a test CA), and ten
``EventSource`` streams from it: all ten receive events at once, on one connection. Over
HTTP/1.1 the browser would open six connections per origin and the seventh stream would
wait for one of them to end."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from edgeproxy import RequestContext, Response, hookimpl

from ._browser import launch
from .conftest import ProxyFactory, RegionFactory, write_pair

STREAMS = 10
PAGE = """<!doctype html><meta charset="utf-8"><title>ten chats</title>
<link rel="icon" href="data:,">
<script>
window.firsts = 0; window.events = 0; window.done = 0; window.concurrent = false;
for (let i = 0; i < STREAMS; i++) {
  const source = new EventSource("/sse/" + i);
  let seen = 0;
  source.onmessage = (e) => {
    if (e.data === "[DONE]") { window.done++; source.close(); return; }
    window.events++;
    if (seen++ === 0 && ++window.firsts === STREAMS && window.done === 0) window.concurrent = true;
  };
}
</script>""".replace("STREAMS", str(STREAMS))


class BrowserChats:
    """The page, and ``GET /sse/<n>`` (what an EventSource can send) as a streamed chat
    completion: a plugin adapting a browser's request, through the public API."""

    @hookimpl
    def edgeproxy_request_received(self, request: Any, ctx: RequestContext) -> Response | None:
        if ctx.path == "/page":
            return Response(body=PAGE.encode(), content_type="text/html; charset=utf-8")
        match = re.fullmatch(r"/sse/(\d+)", ctx.path)
        if match and ctx.method == "GET":
            ctx.method, ctx.target = "POST", "/v1/chat/completions"
            ctx.headers["Content-Type"] = "application/json"
            ctx.set_json(
                {
                    "model": "m",
                    "stream": True,
                    "user": f"tab-{match.group(1)}",
                    "messages": [{"role": "user", "content": f"chat {match.group(1)}"}],
                }
            )
        return None


def spki_hash(cert_path: str) -> str:
    """What ``--ignore-certificate-errors-spki-list`` takes: the test certificate's key
    pinned, so that Chromium trusts it and only it."""
    cert = x509.load_pem_x509_certificates(Path(cert_path).read_bytes())[0]
    spki = cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


@pytest.mark.parametrize("http2", [True, False], ids=["h2", "http1.1"])
async def test_ten_event_sources_over_one_h2_connection(
    make_region: RegionFactory, make_proxy: ProxyFactory, tmp_path: Path, http2: bool
) -> None:
    cert_path, key_path = write_pair(trustme.CA(), tmp_path)
    # Each stream lasts about 4 s: the ten overlap only if none waits for another.
    region = await make_region("ap-1", tokens=40, inter_token_delay=0.1)
    proxy = await make_proxy(
        [region],
        plugins=[BrowserChats()],
        server={"http2": http2, "tls_cert": cert_path, "tls_key": key_path},
    )
    async with launch(
        tmp_path, f"--ignore-certificate-errors-spki-list={spki_hash(cert_path)}"
    ) as (browser):
        await browser.send("Page.navigate", url=proxy.url + "/page")
        if not http2:
            # The contrast: six connections, and the other streams wait for one to end.
            assert await browser.wait_for("window.done >= 1", timeout=60)
            assert await browser.evaluate("window.concurrent") is False
            assert await browser.evaluate("window.firsts") <= 6 + await browser.evaluate(
                "window.done"
            )
            assert proxy.guard.snapshot()["connections_open"] == 6
            return
        assert await browser.wait_for(f"window.firsts === {STREAMS}", timeout=60)
        # Every stream had its first event before any ended, on one connection.
        assert await browser.evaluate("window.concurrent") is True
        # One connection carries them (Chromium may hold a spare preconnected socket).
        assert proxy.guard.snapshot()["connections_open"] <= 2
        protocol = await browser.evaluate(
            "performance.getEntriesByType('navigation')[0].nextHopProtocol"
        )
        assert protocol == "h2"
        assert await browser.wait_for(f"window.done === {STREAMS}", timeout=60)
        assert await browser.evaluate("window.events") >= STREAMS * 40
        assert not browser.console_errors()
