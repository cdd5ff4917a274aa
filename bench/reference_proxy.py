"""The reference: the least a streaming aiohttp reverse proxy on uvloop has to do.

One aiohttp server, one ``ClientSession`` keep-alive pool, any method and path
forwarded to one upstream, the response streamed back chunk by chunk (as an
SSE-capable proxy must). Hop-by-hop headers are dropped because forwarding
them would be wrong, not to add features; there is no routing, tracing,
header rewriting or error shaping. edgeproxy's throughput divided by this
one's is the price of its features on the same stack.

    python bench/reference_proxy.py --port 8001 --upstream http://127.0.0.1:9101

With ``--canned``, it forwards nothing: every request is read and answered with one fixed
JSON body. That is the least any answer served from memory through aiohttp's web layer
costs (the floor of a cache hit), with no key, lookup or headers of its own.

    python bench/reference_proxy.py --port 8001 --canned
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import aiohttp
import uvloop
from aiohttp import web

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# aiohttp's client sets these itself from the URL and the body.
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length"}

SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def forward(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSION]
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _REQUEST_DROP]
    body = await request.read() if request.body_exists else None
    async with session.request(
        request.method,
        request.app[UPSTREAM] + request.raw_path,
        headers=headers,
        data=body,
        allow_redirects=False,
    ) as upstream:
        resp = web.StreamResponse(status=upstream.status)
        for name, value in upstream.headers.items():
            if name.lower() not in _HOP_BY_HOP:
                resp.headers.add(name, value)
        await resp.prepare(request)
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


CANNED = (
    b'{"id":"chatcmpl-canned","object":"chat.completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"canned"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
    b'"total_tokens":2}}'
)


async def canned(request: web.Request) -> web.Response:
    if request.body_exists:
        await request.read()
    return web.Response(body=CANNED, content_type="application/json")


async def serve(host: str, port: int, upstream: str | None, limit: int) -> None:
    app = web.Application()
    app[UPSTREAM] = (upstream or "").rstrip("/")
    app.router.add_route("*", "/{tail:.*}", forward if upstream else canned)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=60),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=60),
    )
    app[SESSION] = session
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=4096).start()
    print(
        f"reference proxy listening on http://{host}:{port} -> {upstream or 'canned'}", flush=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await session.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--upstream", help="http://host:port of the origin")
    what.add_argument("--canned", action="store_true", help="answer one fixed JSON body")
    parser.add_argument("--limit", type=int, default=100, help="TCPConnector limit")
    args = parser.parse_args(argv)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args.host, args.port, args.upstream, args.limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
