"""The status page: one self-contained HTML file served at the admin ``/``.

No build step and no external assets: ``static/status.html`` holds its
styles and script inline and draws its charts as SVG. It reads the JSON
``/status`` next to it every two seconds (``?interval=ms`` to change that),
so it shows whatever the components report there: the PoP, each region's
health, EWMA latency, in-flight count and traffic share, the cache hit ratio
and the p50/p95/p99 of the last minutes (the ``recent`` section).
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from aiohttp import web

__all__ = ["StatusPage"]

_SCRIPT_RE = re.compile(rb"<script>(.*?)</script>", re.S)


class StatusPage:
    """The ``GET /`` handler of the admin app; the page is read once, when it is built."""

    def __init__(self) -> None:
        self.body = resources.files("edgeproxy").joinpath("static/status.html").read_bytes()
        # The page may run its own inline script and talk to this listener, and
        # nothing else: a stray external reference would simply not load.
        hashes = " ".join(
            "'sha256-" + base64.b64encode(hashlib.sha256(m.group(1)).digest()).decode() + "'"
            for m in _SCRIPT_RE.finditer(self.body)
        )
        self.csp = (
            "default-src 'none'; "
            f"script-src {hashes}; "
            "style-src 'unsafe-inline'; "
            "connect-src 'self'; "
            "img-src 'self' data:; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        )

    async def handle(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.body,
            content_type="text/html",
            charset="utf-8",
            headers={
                "Content-Security-Policy": self.csp,
                "Cache-Control": "no-cache",
                "X-Content-Type-Options": "nosniff",
            },
        )
