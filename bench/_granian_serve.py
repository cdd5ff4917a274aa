"""edgeproxy's ASGI front end under granian's embeddable server (its Rust HTTP/1.1 and
HTTP/2 stack), for bench/frontends.py: ``--config FILE --port N``."""

from __future__ import annotations

import argparse
import asyncio
import signal

from granian.constants import HTTPModes, Interfaces
from granian.server.embed import Server

from edgeproxy import EdgeProxy, load_config


async def serve(config: str, port: int) -> None:
    proxy = EdgeProxy(load_config(config))
    server = Server(
        proxy.asgi,
        address="127.0.0.1",
        port=port,
        interface=Interfaces.ASGI,
        http=HTTPModes.auto,
        log_enabled=False,
        backlog=1024,
    )
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, server.stop)
    await server.serve()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(serve(args.config, args.port))
    except ImportError:
        asyncio.run(serve(args.config, args.port))


if __name__ == "__main__":
    main()
