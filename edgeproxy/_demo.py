"""``edgeproxy demo``: emulated regions plus the proxy, on embedded defaults."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
from collections.abc import Mapping
from typing import Any

from edgeproxy._core.config import config_from_mapping
from edgeproxy._server.app import EdgeProxy

# Singapore PoP; regions at realistic coordinates so geo routing has something to do.
_DEMO_REGIONS: list[dict[str, Any]] = [
    {"name": "ap-southeast-1", "lat": 1.29, "lon": 103.85, "ttft_factor": 1.0},
    {"name": "ap-northeast-1", "lat": 35.68, "lon": 139.69, "ttft_factor": 1.5},
    {"name": "us-west-2", "lat": 45.52, "lon": -122.68, "ttft_factor": 3.0},
]
# The one model name the demo serves, the regions and the local model alike: the tiny local
# model would answer any name with its gibberish and a 200, so that a mistyped name would
# look as if it worked; it gets the usual 404 model_not_found instead.
DEMO_MODEL = "demo"
# Variables that say which names the local model answers for: the demo then leaves it so.
_NAMES_FROM_ENV = frozenset(
    ("EDGEPROXY_LOCAL_MODEL__MODELS", "EDGEPROXY_LOCAL_MODEL__SERVE_ALL_MODELS")
)


def _demo_local_model(environ: Mapping[str, str]) -> tuple[dict[str, Any] | None, str]:
    """The local model's settings and a line describing it.

    A configured model (``EDGEPROXY_LOCAL_MODEL__PATH``) wins; else the tiny
    random-weight test model is built, so the fallback can be seen with no download.
    Either answers for the demo's model name only, unless the environment says which
    names (``EDGEPROXY_LOCAL_MODEL__MODELS`` or ``__SERVE_ALL_MODELS``).
    """
    names = {} if _NAMES_FROM_ENV.intersection(environ) else {"models": [DEMO_MODEL]}
    configured = environ.get("EDGEPROXY_LOCAL_MODEL__PATH")
    if configured:
        return names, configured
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "off (pip install 'edgeproxy[local]' for llama-cpp-python)"
    try:
        from edgeproxy.testing import tiny_llama_gguf

        path = tiny_llama_gguf("Q8_0")
    except ImportError as exc:
        return None, f"off ({exc})"
    return (
        {"path": str(path), "max_tokens": 64, "model_name": "local/tiny-demo", **names},
        "tiny random-weight test model: gibberish by design "
        "(EDGEPROXY_LOCAL_MODEL__PATH=model.gguf for a real one)",
    )


async def run_demo(args: argparse.Namespace) -> int:
    from edgeproxy.testing import Behavior, FakeRegion

    count = max(1, min(args.regions, len(_DEMO_REGIONS)))
    model = DEMO_MODEL
    fakes = [
        FakeRegion(
            name=spec["name"],
            # The model the requests below name: the proxy learns it from /v1/models.
            model=model,
            behavior=Behavior(
                ttft=args.ttft * float(spec["ttft_factor"]),
                inter_token_delay=args.inter_token_delay,
            ),
        )
        for spec in _DEMO_REGIONS[:count]
    ]
    for fake in fakes:
        await fake.start()
    try:
        data: dict[str, Any] = {
            "server": {
                "host": args.host or "127.0.0.1",
                "port": 8080 if args.port is None else args.port,
            },
            "admin": {
                "host": args.admin_host or "127.0.0.1",
                "port": 9901 if args.admin_port is None else args.admin_port,
            },
            "pop": {"name": args.pop_name or "edge-sin", "lat": 1.35, "lon": 103.82},
            "regions": [
                {"name": spec["name"], "url": fake.url, "lat": spec["lat"], "lon": spec["lon"]}
                for spec, fake in zip(_DEMO_REGIONS, fakes, strict=False)
            ],
        }
        if args.grace_period is not None:
            data["server"]["grace_period"] = args.grace_period
        local_model, local_line = _demo_local_model(os.environ)
        if local_model:
            data["local_model"] = local_model
        config = config_from_mapping(data)
        proxy = EdgeProxy(config)
        await proxy.start()
        url = proxy.url
        print(
            f"""
edgeproxy demo: PoP {config.pop.name}, {count} emulated regions
  proxy   {url}  (--port moves it)
  admin   {proxy.admin_url}  (--admin-port moves it)
  status  {proxy.admin_url}/  (the status page; its JSON at /status)
  local   {local_line}
  model   {model}, the one name the regions and the local model serve: any other
          gets 404 model_not_found, as a real API answers a mistyped name

Try:
  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{model}","messages":[{{"role":"user","content":"hello"}}]}}'
  curl -sN {url}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{model}","stream":true,"messages":[{{"role":"user","content":"hello"}}]}}'
  curl -s {proxy.admin_url}/status

Make every region fail, and the local model answers (X-Edgeproxy-Degraded: local-model):
  for r in {" ".join(f.url for f in fakes)}; do
    curl -s -X POST $r/_control -d '{{"fault":"5xx","fault_status":503}}'; done
  curl -si {url}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{model}","messages":[{{"role":"user","content":"hello"}}]}}'
Each request tries every region once (X-Edgeproxy-Attempts), then the local model answers,
on every request: an outage is never the caller's fault. Repair them, and the next requests
go back to the regions (a region failing often is ejected for 30 s first):
  for r in {" ".join(f.url for f in fakes)}; do
    curl -s -X POST $r/_control -d '{{"fault":null}}'; done

Ctrl-C stops it.""",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            if args.duration is not None:
                try:
                    await asyncio.wait_for(stop.wait(), args.duration)
                except TimeoutError:
                    pass
            else:
                await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        await proxy.stop(grace=config.server.grace_period)
    finally:
        for fake in fakes:
            await fake.stop()
    return 0
