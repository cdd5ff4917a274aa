"""The plain install (``pip install edgeproxy``, no extra) imports and serves: nothing the
extras bring (numpy, wordllama, usearch, llama-cpp-python, the test kit's hypercorn and gguf)
is imported by the package until a feature that needs it is turned on."""

from __future__ import annotations

import subprocess
import sys
import textwrap

EXTRAS_ONLY = ("numpy", "wordllama", "usearch", "llama_cpp", "hypercorn", "gguf", "fastapi")

SCRIPT = textwrap.dedent(
    f"""
    import asyncio, sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {EXTRAS_ONLY!r}:
                raise ImportError(f"{{name}} comes with an extra, not the plain install")

    sys.meta_path.insert(0, Blocked())
    from edgeproxy import Config, EdgeProxy, load_config

    async def main():
        config = Config.from_mapping(
            {{
                "server": {{"host": "127.0.0.1", "port": 0}},
                "admin": {{"host": "127.0.0.1", "port": 0}},
                "regions": [{{"name": "r", "url": "http://127.0.0.1:9", "learn_models": False}}],
                "health": {{"active": "off"}},
            }},
            environ={{}},
        )
        proxy = EdgeProxy(config)
        await proxy.start()
        await proxy.stop(0.1)
        print("served")

    asyncio.run(main())
    """
)


def test_the_package_imports_and_serves_without_any_extra() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "served" in result.stdout
