"""What plugins cost per request: edgeproxy with 0, 1 and 5 no-op plugins, in one run.

Each no-op plugin implements every per-request hook (request received, cache
key, route, upstream request, upstream response, response complete) as a
plain function that does nothing; a last configuration adds a no-op
``edgeproxy_stream_chunk`` to each of the 5, the one hook called per chunk.
Throughput is measured with wrk against an nginx origin over HTTP/1.1, the
configurations interleaved over several rounds so that drift on the machine
hits them alike; the median round is reported.

    python bench/bench_plugins.py [--duration 4] [--rounds 3]

Target: 5 no-op plugins cost under 5% of throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util as u  # noqa: E402

NOOP_PLUGIN = """
from edgeproxy import hookimpl


@hookimpl
def edgeproxy_request_received(request, ctx):
    return None


@hookimpl
def edgeproxy_cache_key(request, ctx, default_key):
    return None


@hookimpl
def edgeproxy_route(request, ctx, candidates):
    return None


@hookimpl
def edgeproxy_upstream_request(request, ctx, region, headers):
    return None


@hookimpl
def edgeproxy_upstream_response(request, ctx, region, reply):
    return None


@hookimpl
def edgeproxy_response_complete(request, ctx):
    return None
"""

CHUNK_HOOK = """

@hookimpl
def edgeproxy_stream_chunk(request, ctx, chunk):
    return None
"""


def hook_cost_us(files: list[Path], requests: int = 20000) -> float:
    """CPU microseconds per request of the per-request hook calls, measured in process.

    Calls the hooks the pipeline calls for a plain proxied request, with the
    same keyword arguments, through the same :class:`~edgeproxy._plugins.Plugins`
    caller; the ``has()`` checks are included, so 0 plugins measures what a
    hook nobody implements costs.
    """
    import asyncio
    import importlib.util

    from edgeproxy._plugins import Plugins

    plugins = Plugins()
    for index, path in enumerate(files):
        spec = importlib.util.spec_from_file_location(f"noop_bench_{index}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        plugins.register(module, name=f"noop_{index}")
    request, ctx, region, reply = object(), object(), object(), object()

    async def one() -> None:
        if plugins.has("edgeproxy_request_received"):
            await plugins.call_first("edgeproxy_request_received", request=request, ctx=ctx)
        if plugins.has("edgeproxy_cache_key"):
            await plugins.call_first(
                "edgeproxy_cache_key", request=request, ctx=ctx, default_key="k"
            )
        if plugins.has("edgeproxy_route"):
            await plugins.call_first("edgeproxy_route", request=request, ctx=ctx, candidates=[])
        if plugins.has("edgeproxy_upstream_request"):
            await plugins.call_all(
                "edgeproxy_upstream_request", request=request, ctx=ctx, region=region, headers=[]
            )
        if plugins.has("edgeproxy_upstream_response"):
            await plugins.call_all(
                "edgeproxy_upstream_response", request=request, ctx=ctx, region=region, reply=reply
            )
        if plugins.has("edgeproxy_stream_chunk"):
            await plugins.call_chain(
                "edgeproxy_stream_chunk", "chunk", request=request, ctx=ctx, chunk=b"x"
            )
        if plugins.has("edgeproxy_response_complete"):
            await plugins.call_all_logged("edgeproxy_response_complete", request=request, ctx=ctx)

    async def run() -> float:
        for _ in range(1000):
            await one()
        best = float("inf")
        for _ in range(5):
            start = time.process_time()
            for _ in range(requests // 5):
                await one()
            best = min(best, (time.process_time() - start) / (requests // 5))
        return best * 1e6

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--conns", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)

    nginx = u.nginx_binary()
    if nginx is None:
        print("bench_plugins: needs nginx as the origin; it is not installed", file=sys.stderr)
        return 2
    pin = u.plan_pinning(None, None)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="edgeproxy-bench-plugins-"))
    script = u.write_wrk_script(work)

    h1, h2 = u.free_port(), u.free_port()
    origin = u.nginx_service(
        "nginx-origin", nginx, work / "nginx", u.nginx_origin_conf(h1, h2), pin.origin_prefix()
    ).start()
    origin_url = f"http://{u.LOOPBACK}:{h1}"

    plugin_files: list[Path] = []
    chunk_files: list[Path] = []
    for i in range(5):
        path = work / f"noop_{i}.py"
        path.write_text(NOOP_PLUGIN)
        plugin_files.append(path)
        chunked = work / f"noop_chunk_{i}.py"
        chunked.write_text(NOOP_PLUGIN + CHUNK_HOOK)
        chunk_files.append(chunked)
    configs = {
        "0 plugins": [],
        "1 no-op plugin": plugin_files[:1],
        "5 no-op plugins": plugin_files,
        "5 no-op plugins + stream_chunk": chunk_files,
    }

    services: dict[str, tuple[u.Service, str]] = {}
    results: dict[str, list[u.WrkResult]] = {name: [] for name in configs}
    try:
        origin.wait_http(origin_url + "/", method="POST")
        for name, files in configs.items():
            port, admin = u.free_port(), u.free_port()
            toml = work / f"{len(services)}.toml"
            enabled = ", ".join(f'"{p}"' for p in files)
            toml.write_text(u.edgeproxy_toml(port, admin, origin_url, f"enabled = [{enabled}]\n"))
            service = u.Service(
                name,
                [
                    *pin.sut_prefix(),
                    sys.executable,
                    "-m",
                    "edgeproxy",
                    "serve",
                    "--config",
                    str(toml),
                    "--log-level",
                    "warning",
                ],
                work / f"{len(services)}.log",
            ).start()
            service.wait_http(f"http://{u.LOOPBACK}:{admin}/readyz")
            services[name] = (service, f"http://{u.LOOPBACK}:{port}/v1/chat/completions")
        for _, url in services.values():  # warm-up
            u.run_wrk(url, conns=args.conns, duration=1, script=script, pin=pin.harness_prefix())
        for _ in range(args.rounds):
            for name, (_, url) in services.items():
                results[name].append(
                    u.run_wrk(
                        url,
                        conns=args.conns,
                        duration=args.duration,
                        script=script,
                        pin=pin.harness_prefix(),
                    )
                )
    finally:
        for service, _ in services.values():
            service.stop()
        origin.stop()

    base = statistics.median(r.rps for r in results["0 plugins"])
    in_process = {name: hook_cost_us(files) for name, files in configs.items()}
    lines = [
        "# Plugin cost",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; {pin.describe()}; "
        f"wrk -c{args.conns}, {args.rounds} interleaved rounds of {args.duration:g} s, median.",
        "",
        "The throughput cost is the median over rounds of each round's ratio to the 0-plugin",
        "server in the same round (drift on a shared machine hits the servers of a round alike).",
        "Hook CPU is measured in process: the pipeline's per-request hook calls through the same",
        "caller, best of 5; its share is of the 0-plugin server's time per request (1 / req/s",
        "at saturation, the proxy having a core to itself).",
        "",
        "| configuration | req/s (median) | rounds | x 0 plugins | cost | hook CPU us/req "
        "| hook share | p99 ms | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    summary = {}
    for name, runs in results.items():
        rps = statistics.median(r.rps for r in runs)
        p99 = statistics.median(r.p99_ms for r in runs)
        errors = sum(r.errors for r in runs)
        zero = results["0 plugins"]
        ratio = statistics.median(r.rps / z.rps for r, z in zip(runs, zero, strict=True))
        rounds = ", ".join(f"{r.rps:,.0f}" for r in runs)
        hook_us = in_process[name] - in_process["0 plugins"]
        share = hook_us / (1e6 / base) if base else 0.0
        lines.append(
            f"| {name} | {rps:,.0f} | {rounds} | {ratio:.3f} | {100 * (1 - ratio):+.1f}% "
            f"| {hook_us:.1f} | {100 * share:.1f}% | {p99:.2f} | {errors} |"
        )
        summary[name] = {
            "rps": rps,
            "ratio": ratio,
            "hook_cpu_us": hook_us,
            "hook_share": share,
            "p99_ms": p99,
            "errors": errors,
            "runs": [r.as_dict() for r in runs],
        }
    five = summary["5 no-op plugins"]["ratio"]
    verdict = "pass" if five >= 0.95 else "MISS"
    cost = 100 * (1 - five)
    hook_share = 100 * summary["5 no-op plugins"]["hook_share"]
    verdict_cpu = "pass" if hook_share < 5 else "MISS"
    lines += [
        "",
        f"Target: 5 no-op plugins cost under 5% -> throughput {cost:.1f}%: **{verdict}**; "
        f"hook CPU {hook_share:.1f}% of a request: **{verdict_cpu}**",
    ]
    report = "\n".join(lines)
    print(report)
    (args.out / "plugins.md").write_text(report + "\n")
    (args.out / "plugins.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
