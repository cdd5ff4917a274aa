"""edgeproxy inside an existing aiohttp gateway, three ways.

- ``/llm/...`` is the proxy's own app, mounted as a sub-app;
- ``/v1/...`` goes through the proxy via its middleware;
- ``/api/chat`` is a gateway handler that checks something, then forwards.

The proxy's pools open and close with the gateway's app (``cleanup_ctx``).

    python examples/gateway.py --region http://127.0.0.1:9101
"""

from __future__ import annotations

import argparse

from aiohttp import web

from edgeproxy import AdminConfig, Config, EdgeProxy, RegionConfig, ServerConfig


def build_app(region_url: str) -> tuple[web.Application, EdgeProxy]:
    config = Config(
        server=ServerConfig(port=0),
        admin=AdminConfig(enabled=False),
        regions=[RegionConfig(name="primary", url=region_url)],
    )
    proxy = EdgeProxy(config)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"gateway": "ok", "proxy_ready": proxy.ready})

    async def chat(request: web.Request) -> web.StreamResponse:
        if request.headers.get("x-gateway-user") is None:
            return web.json_response({"error": "who are you?"}, status=401)
        return await proxy.forward(request, strip_prefix="/api/chat")

    app = web.Application(middlewares=[proxy.middleware("/v1/")])
    app.router.add_get("/health", health)
    app.router.add_post("/api/chat/{tail:.*}", chat)
    app.add_subapp("/llm", proxy.app)  # also ties the proxy's resources to this app
    return app, proxy


def main() -> None:
    parser = argparse.ArgumentParser(description="an aiohttp gateway embedding edgeproxy")
    parser.add_argument("--region", default="http://127.0.0.1:9101")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    app, _ = build_app(args.region)
    web.run_app(app, host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
