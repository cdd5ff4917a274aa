"""One request followed through the package: the layers it crosses, and how often a call
climbs back up a layer.

A streamed chat request goes through a real proxy to a fake region (h2c, the test kit's),
after a warm-up request; every Python call made on the proxy's thread while it is answered
is traced (``sys.setprofile``, first entries only: a coroutine resumed is not a new call).
Each call from one of the package's modules into another is placed on the layers that
``.importlinter`` orders, and counted as

* a *crossing* when caller and callee are on different layers;
* a *climb* when the callee is on a layer above the caller's (a lower layer calling back
  up, through a callback or a Protocol: what the one-way imports do not see).

``--tree`` measures another checkout the same way (its own ``.importlinter``), side by side::

    .venv/bin/python bench/request_path.py --tree /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import configparser
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def _layers(tree: Path) -> list[str]:
    parser = configparser.ConfigParser()
    parser.read(tree / ".importlinter")
    raw = parser["importlinter:contract:layers"]["layers"]
    return [line.strip() for line in raw.splitlines() if line.strip()]


def _measure(tree: Path) -> dict[str, Any]:
    """Run this script's ``--child`` in ``tree``'s package, and read its counts."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(tree)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


async def _child(tree: Path) -> dict[str, Any]:
    import aiohttp

    from edgeproxy import Config, EdgeProxy
    from edgeproxy.testing import Behavior, FakeRegion

    layers = _layers(tree)  # top first
    package = str(tree / "edgeproxy") + os.sep
    region = FakeRegion(name="r1", model="m", behavior=Behavior(tokens=4))
    await region.start()
    config = Config.from_mapping(
        {
            "server": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
            "regions": [{"name": "r1", "url": region.url, "learn_models": False}],
        },
        environ={},
    )
    proxy = EdgeProxy(config)
    await proxy.start()
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    url = proxy.url + "/v1/chat/completions"

    def layer_of(filename: str) -> tuple[int, str] | None:
        if not filename.startswith(package):
            return None
        module = "edgeproxy." + filename[len(package) :].removesuffix(".py").replace(os.sep, ".")
        module = module.removesuffix(".__init__")
        best = None
        for index, name in enumerate(layers):
            if (module == name or module.startswith(name + ".")) and (
                best is None or len(name) > len(layers[best])
            ):
                best = index
        return None if best is None else (best, module)

    seen: set[FrameType] = set()
    calls: list[tuple[str, str]] = []  # (caller module, callee module) for package calls
    modules: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame in seen:
            return
        seen.add(frame)
        callee = layer_of(frame.f_code.co_filename)
        if callee is None:
            return
        modules.add(callee[1])
        back = frame.f_back
        caller = layer_of(back.f_code.co_filename) if back is not None else None
        if caller is not None:
            calls.append((caller[1], callee[1]))

    async with aiohttp.ClientSession() as client:
        for traced in (False, True):
            if traced:
                sys.setprofile(profile)
            try:
                async with client.post(url, json=body) as resp:
                    assert resp.status == 200, resp.status
                    await resp.read()
            finally:
                sys.setprofile(None)
    await proxy.stop(grace=1.0)
    await region.stop()

    def layer(module: str) -> str:
        found = layer_of(str(tree) + "/" + module.replace(".", "/") + ".py")
        if found is None:
            found = layer_of(str(tree) + "/" + module.replace(".", "/") + "/__init__.py")
        assert found is not None, module
        return layers[found[0]]

    crossings: Counter[str] = Counter()
    climbs: Counter[str] = Counter()
    entered: Counter[str] = Counter()
    for caller, callee in calls:
        a, b = layer(caller), layer(callee)
        if a == b:
            continue
        crossings[f"{a} -> {b}"] += 1
        entered[b] += 1
        if layers.index(b) < layers.index(a):  # smaller index: a higher layer
            climbs[f"{caller} -> {callee}"] += 1
    return {
        "calls": len(calls),
        "modules": len(modules),
        "crossings": sum(crossings.values()),
        "climbs": sum(climbs.values()),
        "entered": dict(entered.most_common()),
        "climbs_by_pair": dict(climbs.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, help="another checkout to measure as 'before'")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(asyncio.run(_child(args.child.resolve()))))
        return
    runs = {}
    if args.tree is not None:
        runs["before"] = _measure(args.tree.resolve())
    runs["after" if args.tree is not None else "this tree"] = _measure(HERE)
    names = list(runs)
    print(f"| one streamed chat request | {' | '.join(names)} |")
    print(f"| --- | {' | '.join('---:' for _ in names)} |")
    for key in ("calls", "modules", "crossings", "climbs"):
        print(f"| {key} | {' | '.join(str(runs[n][key]) for n in names)} |")
    for name in names:
        print(f"\n{name}: layers entered {runs[name]['entered']}")
        print(f"{name}: climbs {runs[name]['climbs_by_pair']}")


if __name__ == "__main__":
    main()
