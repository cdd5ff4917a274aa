"""Does the local model run on an NVIDIA GPU? One short check, for a machine with one.

    .venv/bin/python bench/gpu_check.py                  # with the llama-cpp-python installed
    .venv/bin/python bench/gpu_check.py --build          # first build it with CUDA, then check
    .venv/bin/python bench/gpu_check.py --build --sdist dist/llama_cpp_python-0.3.36.tar.gz

What it does, in order, and what it prints:

1. **The machine.** ``nvidia-smi`` (the GPU, its driver and memory) and ``nvcc --version``
   (the CUDA toolkit a build needs); either missing is said plainly, and the check stops
   where it cannot go on.
2. **The build** (``--build``). ``pip install --force-reinstall --no-deps`` of
   llama-cpp-python with ``CMAKE_ARGS="-DGGML_CUDA=on"``, from ``--sdist`` when given (a
   machine that reaches no package index gets the source archive with the working tree),
   else from the index at the version ``--version`` names, without build isolation (the
   build backend, scikit-build-core and cmake, must be installed). It takes minutes: llama.cpp's
   CUDA kernels compile for the GPU's architecture (``CMAKE_CUDA_ARCHITECTURES=native``).
3. **The offload.** A generated GGUF (random weights, the test kit's generator, a size that
   makes a GPU worth it: ``--layers`` x ``--width``) is loaded twice, through edgeproxy's own
   loader (:mod:`edgeproxy._local.binding`), which reads llama.cpp's log: once with
   ``n_gpu_layers = -1`` and once with ``n_gpu_layers = 0``. llama.cpp's own report says
   where each layer went (``layer N assigned to device CUDA0``, and ``offloaded N/M layers
   to GPU``); the check fails unless every layer is on the GPU in the first load.
4. **The speed.** The same prompt, ``--tokens`` tokens generated greedily, three times on
   each; the best run's tokens per second, GPU against CPU.

It ends with one table::

    | device | layers on GPU | load s | prompt tok/s | generation tok/s |

and exits 0 when the GPU run offloaded every layer, 1 otherwise, 2 when there is no GPU
or no CUDA build to check. No timing is asserted: the ratio is for the record.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)


def machine() -> bool:
    """Print the GPU and the CUDA toolkit; False when there is no GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        print("no nvidia-smi: no NVIDIA GPU (or no driver) on this machine")
        return False
    query = "--query-gpu=name,driver_version,memory.total,compute_cap"
    out = run([smi, query, "--format=csv,noheader"])
    print(f"GPU: {out.stdout.strip() or out.stderr.strip()}")
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    version = run([nvcc, "--version"]) if Path(nvcc).exists() else None
    if version is None or version.returncode:
        print("no nvcc: the CUDA toolkit is missing, a CUDA build cannot be made here")
    else:
        print(f"CUDA toolkit: {version.stdout.strip().splitlines()[-1]}")
    return True


def build(sdist: str | None, version: str) -> bool:
    """llama-cpp-python rebuilt with CUDA in this interpreter's environment."""
    env = dict(os.environ)
    env["CMAKE_ARGS"] = "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native"
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    if Path("/usr/local/cuda/bin").is_dir():
        env["PATH"] = "/usr/local/cuda/bin:" + env.get("PATH", "")
    try:
        import scikit_build_core  # noqa: F401 - llama-cpp-python's build backend
    except ImportError:
        # No build isolation, so that a machine without a package index can build: the
        # backend must be here already.
        print("the build needs scikit-build-core (and cmake): pip install scikit-build-core cmake")
        return False
    target = sdist or f"llama-cpp-python=={version}"
    argv = [sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps"]
    argv += ["--no-build-isolation", "--no-binary", "llama-cpp-python", target]
    print(f"building {target} with CUDA (CMAKE_ARGS={env['CMAKE_ARGS']!r}) ...", flush=True)
    started = time.monotonic()
    result = run(argv, env=env)
    took = time.monotonic() - started
    if result.returncode:
        print(
            f"the build failed after {took:.0f}s:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
        return False
    print(f"built in {took:.0f}s")
    return True


def cuda_build() -> bool:
    """Whether the installed llama-cpp-python can offload to a GPU."""
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed (pip install -e '.[local]', or --build)")
        return False
    supports = getattr(llama_cpp, "llama_supports_gpu_offload", None)
    able = bool(supports()) if supports is not None else False
    print(f"llama-cpp-python {llama_cpp.__version__}: GPU offload {'yes' if able else 'no'}")
    return able


def measure(path: Path, gpu_layers: int, tokens: int, rounds: int) -> dict[str, Any]:
    """Load ``path`` through edgeproxy's loader with ``gpu_layers``; the layers llama.cpp
    says it put on the GPU, and the best of ``rounds`` runs' speeds."""
    import llama_cpp

    from edgeproxy._core.config import LocalModelConfig
    from edgeproxy._local import binding

    config = LocalModelConfig(path=str(path), n_gpu_layers=gpu_layers, n_ctx=2048)
    lines: list[str] = []

    class Keep:
        def write(self, text: str) -> None:
            lines.append(text)

        def flush(self) -> None:
            pass

    import logging

    handler = logging.StreamHandler(Keep())  # type: ignore[arg-type]
    binding.llama_logger.addHandler(handler)
    binding.llama_logger.setLevel(logging.DEBUG)
    try:
        started = time.monotonic()
        slot = binding.load_context(llama_cpp, path, config, 0)
        load_s = time.monotonic() - started
    finally:
        binding.llama_logger.removeHandler(handler)
    log = "".join(lines)
    devices = binding._log_state.get("devices") or {}
    on_gpu = sum(n for device, n in devices.items() if device.upper().startswith("CUDA"))
    found = _OFFLOADED.search(log)
    reported = f"{found.group(1)}/{found.group(2)}" if found else f"{on_gpu} (by device)"
    prompt = "Write a short story about a lighthouse keeper. " * 8
    prompt_tps = gen_tps = 0.0
    for _ in range(rounds):
        slot.llm.reset()
        t0 = time.perf_counter()
        n_prompt = len(slot.llm.tokenize(prompt.encode()))
        first = None
        produced = 0
        for _chunk in slot.llm.create_completion(
            prompt, max_tokens=tokens, temperature=0.0, stream=True
        ):
            produced += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        if first is None or produced < 2:
            continue
        prompt_tps = max(prompt_tps, n_prompt / (first - t0))
        gen_tps = max(gen_tps, (produced - 1) / (end - first))
    slot.llm.close()
    return {
        "device": "GPU" if gpu_layers else "CPU",
        "layers": reported,
        "all_on_gpu": bool(found and found.group(1) == found.group(2)) or (gpu_layers and on_gpu),
        "load_s": load_s,
        "prompt_tps": prompt_tps,
        "gen_tps": gen_tps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--build", action="store_true", help="rebuild llama-cpp-python with CUDA")
    parser.add_argument("--sdist", help="the llama-cpp-python source archive to build from")
    parser.add_argument("--version", default="0.3.36", help="the release to build (no --sdist)")
    parser.add_argument("--layers", type=int, default=16, help="layers of the generated model")
    parser.add_argument("--width", type=int, default=1024, help="its embedding width")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per device (the best kept)")
    args = parser.parse_args(argv)
    if not machine():
        return 2
    if args.build and not build(args.sdist, args.version):
        return 2
    if not cuda_build():
        print("this llama-cpp-python cannot offload: run with --build")
        return 2
    from edgeproxy.testing import tiny_llama_gguf

    folder = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    width = args.width
    path = tiny_llama_gguf(
        "Q8_0",
        directory=folder,
        n_embd=width,
        n_layer=args.layers,
        n_head=width // 64,
        n_head_kv=width // 64,
        n_ff=4 * width,
    )
    print(f"model: {path.name} ({path.stat().st_size / 2**20:.0f} MiB)", flush=True)
    rows = [measure(path, -1, args.tokens, args.rounds), measure(path, 0, args.tokens, args.rounds)]
    print("\n| device | layers on GPU | load s | prompt tok/s | generation tok/s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['device']} | {r['layers']} | {r['load_s']:.2f} | {r['prompt_tps']:,.0f} "
            f"| {r['gen_tps']:,.0f} |"
        )
    gpu, cpu = rows
    if cpu["gen_tps"]:
        print(f"\ngeneration on the GPU: {gpu['gen_tps'] / cpu['gen_tps']:.1f}x the CPU's")
    shutil.rmtree(folder, ignore_errors=True)
    return 0 if gpu["all_on_gpu"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
