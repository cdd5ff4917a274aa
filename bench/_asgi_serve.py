"""edgeproxy's ASGI front end under uvicorn, for bench/frontends.py: ``--config FILE --port N``."""

from __future__ import annotations

import argparse

import uvicorn

from edgeproxy import EdgeProxy, load_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    proxy = EdgeProxy(load_config(args.config))
    # The ASGI lifespan opens and closes the proxy's pools.
    uvicorn.run(
        proxy.asgi,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        loop="uvloop",
        http="httptools",
    )


if __name__ == "__main__":
    main()
