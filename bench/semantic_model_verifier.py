"""What the semantic cache's model verifier adds to a lookup that reaches a candidate: one
verdict (the prompt, temperature 0, a few tokens, the reply read as yes or no), timed
through :class:`ModelVerifier` as the cache calls it, p50 and p99 of ``--repeat`` verdicts:

* ``local``: the proxy's [local_model] path, with the generated tiny llama
  (``edgeproxy.testing.tiny_llama_gguf``, Q4_0; 2 layers, random weights: its replies are
  gibberish, so only the cost means anything: a floor, not a real model's cost);
* ``region``: ``/v1/chat/completions`` of a fake region (``edgeproxy.testing.FakeRegion``,
  h2c on loopback) over the region's warm pool: the round trip, not a real model's.

Also counted: the verdicts, to show every call was answered (none an error or timeout).

    .venv/bin/python bench/semantic_model_verifier.py       # about 20 seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

RESULTS = HERE / "results"
CACHED = "How do I enable two-factor authentication on my account?"
ASKED = "How can I turn on two-factor authentication for my account?"


async def _time(name: str, verifier: Any, repeat: int) -> dict[str, Any]:
    values = []
    for i in range(repeat + 5):
        t0 = time.perf_counter()
        await verifier.same(CACHED, ASKED)
        if i >= 5:  # the first are a warm-up
            values.append(time.perf_counter() - t0)
    values.sort()
    return {
        "verifier": name,
        "p50_ms": round(1e3 * values[len(values) // 2], 3),
        "p99_ms": round(1e3 * values[int(len(values) * 0.99)], 3),
        "verdicts": {k: v for k, v in verifier.verdicts.items() if v},
    }


async def local(repeat: int) -> dict[str, Any]:
    from edgeproxy._cache.semantic_model import LocalAsker, ModelVerifier
    from edgeproxy._core.config import LocalModelConfig
    from edgeproxy._local.model import LocalModel
    from edgeproxy.testing import tiny_llama_gguf

    config = LocalModelConfig(path=str(tiny_llama_gguf("Q4_0")), n_ctx=512, max_tokens=32)
    model = LocalModel(config)
    model.start()
    while model.state in ("idle", "loading"):
        await asyncio.sleep(0.01)
    try:
        verifier = ModelVerifier(LocalAsker(model), timeout=5.0)
        return await _time("local (tiny llama, Q4_0)", verifier, repeat)
    finally:
        await model.close()


async def region(repeat: int) -> dict[str, Any]:
    from edgeproxy._cache.semantic_model import ModelVerifier, RegionAsker
    from edgeproxy._core.config import config_from_mapping
    from edgeproxy._upstream.regions import RegionSet
    from edgeproxy.testing import FakeRegion

    async with FakeRegion("judge") as fake:
        config = config_from_mapping(
            {"regions": [{"name": "judge", "url": fake.url, "learn_models": False}]}
        )
        regions = RegionSet(config)
        await regions.open()
        try:
            verifier = ModelVerifier(RegionAsker(regions, "judge"), timeout=5.0)
            return await _time("region (fake region, h2c)", verifier, repeat)
        finally:
            await regions.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300, help="verdicts timed per verifier")
    args = parser.parse_args()
    rows = [asyncio.run(local(args.repeat)), asyncio.run(region(args.repeat))]
    text = "| model verifier | per verdict p50 | p99 | verdicts |\n|---|---:|---:|---|\n"
    for r in rows:
        text += f"| {r['verifier']} | {r['p50_ms']} ms | {r['p99_ms']} ms | {r['verdicts']} |\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "semantic_model_verifier.md").write_text(text)
    (RESULTS / "semantic_model_verifier.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
