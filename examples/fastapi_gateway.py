"""edgeproxy mounted in a FastAPI gateway: ``/llm/...`` goes through the proxy, the
gateway's own routes stay its own. The proxy's pools open and close with the gateway
(``lifespan=proxy.lifespan``).

    uvicorn --factory examples.fastapi_gateway:create_app --port 8000
    # with EDGEPROXY_REGION=http://127.0.0.1:9101 (the default)
"""

from __future__ import annotations

import os

from fastapi import FastAPI

from edgeproxy import AdminConfig, Config, EdgeProxy, RegionConfig, ServerConfig


def build_app(region_url: str) -> tuple[FastAPI, EdgeProxy]:
    config = Config(
        server=ServerConfig(port=0),
        admin=AdminConfig(enabled=False),
        regions=[RegionConfig(name="primary", url=region_url)],
    )
    proxy = EdgeProxy(config)
    app = FastAPI(lifespan=proxy.lifespan)

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"gateway": "ok", "proxy_ready": proxy.ready}

    app.mount("/llm", proxy.asgi)
    return app, proxy


def create_app() -> FastAPI:
    return build_app(os.environ.get("EDGEPROXY_REGION", "http://127.0.0.1:9101"))[0]
