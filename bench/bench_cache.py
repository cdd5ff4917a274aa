"""What the hot-answer cache buys: hits against misses and the direct upstream, a stampede
with and without coalescing, and hit latency of the memory and Redis tiers, in one run.

1. Throughput and latency (wrk, HTTP/1.1 keep-alive, deterministic chat completions):
   * *direct*: wrk straight to the upstream, the floor;
   * *bypass*: through edgeproxy with a non-deterministic body (the cache stays out);
   * *miss*: every request has a prompt never seen before: looked up, sent upstream,
     recorded and stored (memory, or Redis);
   * *hit*: the same request over and over, answered from the memory or the Redis tier.
   Each row runs closed-loop at ``--conns`` connections (req/s, p50/p99) and at one
   connection (the unloaded latency), the rows interleaved over ``--rounds`` rounds; the
   median round is reported. The upstream is nginx answering a fixed chat completion (a
   zero-delay upstream; without nginx, the fake region with ``--ttft 0``).
2. Stampede: ``--stampede`` identical requests at once against a fake region that takes
   0.2 s to answer, JSON and SSE, coalescing on and off; the region counts its requests.
3. Tier latency: ``backend.get`` of a stored entry, memory against Redis, in process.

    python bench/bench_cache.py [--duration 3] [--rounds 2] [--conns 16] [--stampede 100]

Targets: a memory hit is served at least 3x faster than a miss, a Redis hit at least 2x.
Needs wrk and a Redis at 127.0.0.1:6379 (``--redis-url``); keys go under a prefix of
their own and are deleted at the end. Results: ``bench/results/cache.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util as u  # noqa: E402

HIT_BODY = (
    '{"model":"fake-llm","temperature":0,"messages":[{"role":"system","content":"You are terse."},'
    '{"role":"user","content":"Say hello."}],"max_tokens":16}'
)
BYPASS_BODY = HIT_BODY.replace('"temperature":0', '"temperature":0.7')

# Appended to _util's wrk script: a prompt never seen before on every request.
_MISS_LUA = """
counter = 0
request = function()
  counter = counter + 1
  local body = string.format(
    '{"model":"fake-llm","temperature":0,"messages":[{"role":"user","content":"%s %d"}],'
    .. '"max_tokens":16}', "{nonce}", counter)
  return wrk.format("POST", nil, nil, body)
end
"""


def wrk_script(directory: Path, name: str, body: str, *, unique: bool = False) -> Path:
    path = directory / f"{name}.lua"
    text = u._WRK_LUA.format(body="[[" + body + "]]")
    if unique:
        text += _MISS_LUA.replace("{nonce}", secrets.token_hex(8))
    path.write_text(text)
    return path


def proxy_toml(port: int, admin: int, origin: str, cache: dict[str, Any]) -> str:
    cache_lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in cache.items())
    return u.edgeproxy_toml(port, admin, origin, f"\n[cache]\n{cache_lines}\n")


# -- 1. throughput and latency ------------------------------------------------------


def run_rows(args: argparse.Namespace, work: Path, pin: u.Pinning) -> dict[str, Any]:
    nginx = None if args.no_nginx else u.nginx_binary()
    services: list[u.Service] = []
    if nginx is not None:
        h1, h2 = u.free_port(), u.free_port()
        origin = u.nginx_service(
            "nginx-origin", nginx, work / "nginx", u.nginx_origin_conf(h1, h2), pin.origin_prefix()
        ).start()
        origin_url = f"http://{u.LOOPBACK}:{h1}"
        upstream = "nginx (fixed 280-byte chat completion)"
    else:
        port = u.free_port()
        origin = u.Service(
            "fake-region",
            [*pin.origin_prefix(), sys.executable, "-m", "edgeproxy.testing", "--port", str(port),
             "--ttft", "0", "--tokens", "8", "--log-level", "warning"],
            work / "fake-region.log",
        ).start()  # fmt: skip
        origin_url = f"http://{u.LOOPBACK}:{port}"
        upstream = "fake region (python -m edgeproxy.testing, ttft 0)"
    services.append(origin)
    prefix = f"edgeproxy-bench:{secrets.token_hex(6)}:"
    urls: dict[str, str] = {}
    try:
        origin.wait_http(origin_url + "/v1/models" if nginx is None else origin_url + "/")
        for name, cache in {
            "memory": {"backend": "memory", "xfetch_beta": 0.0},
            "redis": {
                "backend": "redis",
                "redis_url": args.redis_url,
                "key_prefix": prefix,
                "xfetch_beta": 0.0,
            },
        }.items():
            port, admin = u.free_port(), u.free_port()
            toml = work / f"{name}.toml"
            toml.write_text(proxy_toml(port, admin, origin_url, cache))
            service = u.Service(
                f"edgeproxy-{name}",
                [*pin.sut_prefix(), sys.executable, "-m", "edgeproxy", "serve", "--config",
                 str(toml), "--log-level", "warning"],
                work / f"{name}.log",
            ).start()  # fmt: skip
            services.append(service)
            service.wait_http(f"http://{u.LOOPBACK}:{admin}/readyz")
            urls[name] = f"http://{u.LOOPBACK}:{port}/v1/chat/completions"
            urls[name + "-admin"] = f"http://{u.LOOPBACK}:{admin}/status"

        hit = wrk_script(work, "hit", HIT_BODY)
        bypass = wrk_script(work, "bypass", BYPASS_BODY)
        rows: dict[str, tuple[str, str]] = {
            "direct (upstream)": (origin_url + "/v1/chat/completions", "hit"),
            "edgeproxy, bypass": (urls["memory"], "bypass"),
            "edgeproxy, miss (memory)": (urls["memory"], "miss"),
            "edgeproxy, hit (memory)": (urls["memory"], "hit"),
            "edgeproxy, miss (redis)": (urls["redis"], "miss"),
            "edgeproxy, hit (redis)": (urls["redis"], "hit"),
        }
        results: dict[str, dict[str, list[u.WrkResult]]] = {
            name: {"loaded": [], "single": []} for name in rows
        }
        harness = pin.harness_prefix()

        def script_for(kind: str) -> Path:
            if kind == "miss":
                return wrk_script(work, "miss", HIT_BODY, unique=True)
            return hit if kind == "hit" else bypass

        for url, kind in rows.values():  # warm-up: fills the entries the hit rows read
            u.run_wrk(url, conns=args.conns, duration=1, script=script_for(kind), pin=harness)
        for _ in range(args.rounds):
            for name, (url, kind) in rows.items():
                loaded = u.run_wrk(
                    url, conns=args.conns, duration=args.duration, script=script_for(kind),
                    pin=harness,
                )  # fmt: skip
                single = u.run_wrk(
                    url, conns=1, duration=args.single_duration, script=script_for(kind),
                    pin=harness,
                )  # fmt: skip
                results[name]["loaded"].append(loaded)
                results[name]["single"].append(single)
        status = {name: u.http_json(urls[name + "-admin"])["cache"] for name in ("memory", "redis")}
    finally:
        for service in reversed(services):
            service.stop()
        asyncio.run(_delete_prefix(args.redis_url, prefix))

    out: dict[str, Any] = {"upstream": upstream, "rows": {}, "proxy_cache_status": status}
    for name, runs in results.items():
        loaded, single = runs["loaded"], runs["single"]
        out["rows"][name] = {
            "rps": statistics.median(r.rps for r in loaded),
            "rps_rounds": [round(r.rps) for r in loaded],
            "p50_ms": statistics.median(r.p50_ms for r in loaded),
            "p99_ms": statistics.median(r.p99_ms for r in loaded),
            "single_rps": statistics.median(r.rps for r in single),
            "single_p50_ms": statistics.median(r.p50_ms for r in single),
            "single_p99_ms": statistics.median(r.p99_ms for r in single),
            "errors": sum(r.errors for r in loaded + single),
        }
    return out


async def _delete_prefix(url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        batch = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
        for i in range(0, len(batch), 1000):
            await client.unlink(*batch[i : i + 1000])
    except Exception as exc:  # noqa: BLE001 - cleanup is best effort
        print(f"bench_cache: could not delete {prefix}*: {exc}", file=sys.stderr)
    finally:
        await client.aclose()


# -- 2. stampede -----------------------------------------------------------------------


async def _burst(url: str, body: dict[str, Any], n: int) -> tuple[list[int], list[float]]:
    """``n`` identical requests at once: their statuses and latencies (seconds)."""
    import aiohttp

    statuses: list[int] = []
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:

        async def one() -> None:
            started = time.perf_counter()
            async with client.post(url, json=body) as resp:
                await resp.read()
                statuses.append(resp.status)
            latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(one() for _ in range(n)))
    return statuses, sorted(latencies)


async def stampede(n: int) -> list[dict[str, Any]]:
    from edgeproxy import Config, EdgeProxy
    from edgeproxy.testing import Behavior, FakeRegion

    rows = []
    behavior = Behavior(ttft=0.2, inter_token_delay=0.005)
    async with FakeRegion(name="r1", behavior=behavior) as region:
        for coalesce in (True, False):
            for stream in (False, True):
                data = {
                    "server": {"host": u.LOOPBACK, "port": 0},
                    "admin": {"enabled": False},
                    "regions": [{"name": "r1", "url": region.url}],
                    "cache": {"coalesce": coalesce, "xfetch_beta": 0.0},
                }
                proxy = EdgeProxy(Config.from_mapping(data, environ={}))
                await proxy.start()
                region.reset_counters()
                body = {
                    "model": "fake-llm",
                    "temperature": 0,
                    "stream": stream,
                    "messages": [{"role": "user", "content": f"stampede {coalesce} {stream}"}],
                }
                try:
                    statuses, latencies = await _burst(proxy.url + "/v1/chat/completions", body, n)
                finally:
                    await proxy.stop(grace=2.0)
                calls = region.counters().requests_by_path.get("/v1/chat/completions", 0)
                rows.append(
                    {
                        "coalescing": "on" if coalesce else "off",
                        "mode": "SSE" if stream else "JSON",
                        "requests": n,
                        "ok": statuses.count(200),
                        "upstream_calls": calls,
                        "p50_ms": latencies[len(latencies) // 2] * 1000,
                        "max_ms": latencies[-1] * 1000,
                    }
                )
    return rows


# -- 3. tier latency --------------------------------------------------------------------


async def tier_latency(redis_url: str, n: int) -> dict[str, dict[str, float]]:
    from edgeproxy._cache.backends import make_backend
    from edgeproxy._cache.entry import Entry
    from edgeproxy._core.config import CacheConfig

    entry = Entry.build(
        status=200,
        headers=[("content-type", "application/json")],
        body=u.UPSTREAM_JSON.encode(),
        kind="json",
        ttl=300,
        swr=0,
        sie=0,
        delta=0.01,
        region="r1",
    )
    out = {}
    prefix = f"edgeproxy-bench:{secrets.token_hex(6)}:"
    for backend_name in ("memory", "redis"):
        backend = make_backend(
            CacheConfig(backend=backend_name, redis_url=redis_url, key_prefix=prefix)
        )
        await backend.open()
        try:
            await backend.set("k", entry)
            samples = []
            for _ in range(n):
                started = time.perf_counter()
                got = await backend.get("k")
                samples.append(time.perf_counter() - started)
                assert got is not None
        finally:
            await backend.purge("")
            await backend.close()
        samples.sort()
        out[backend_name] = {
            "p50_us": samples[len(samples) // 2] * 1e6,
            "p99_us": samples[int(len(samples) * 0.99)] * 1e6,
        }
    return out


# -- report -------------------------------------------------------------------------------


def report(data: dict[str, Any]) -> str:
    rows = data["throughput"]["rows"]
    meta = data["meta"]
    lines = [
        "# Hot-answer cache benchmark",
        "",
        f"{meta['when']}; {meta['pinning']}; upstream: {data['throughput']['upstream']}. "
        f"wrk, {meta['rounds']} interleaved rounds of {meta['duration']:g} s at "
        f"{meta['conns']} connections plus {meta['single_duration']:g} s at 1 connection; "
        "median round. The run took "
        f"{meta['elapsed_s']:.0f} s.",
        "",
        "## Throughput and latency",
        "",
        f"| path | req/s @{meta['conns']} | rounds | p50 ms | p99 ms | 1 conn: p50 ms | "
        "1 conn: p99 ms | x miss (req/s) | x miss (1-conn p50) | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        tier = "redis" if "redis" in name else "memory"
        miss = rows.get(f"edgeproxy, miss ({tier})")
        x_rps = r["rps"] / miss["rps"] if miss and "edgeproxy" in name else None
        x_lat = miss["single_p50_ms"] / r["single_p50_ms"] if miss and "edgeproxy" in name else None
        lines.append(
            f"| {name} | {r['rps']:,.0f} | {', '.join(f'{v:,}' for v in r['rps_rounds'])} "
            f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['single_p50_ms']:.3f} "
            f"| {r['single_p99_ms']:.3f} | {_x(x_rps)} | {_x(x_lat)} | {r['errors']} |"
        )
    lines += ["", "## Targets", "", "| metric | measured | target | result |"]
    lines.append("| --- | --- | --- | --- |")
    for target in data["targets"]:
        verdict = "pass" if target["pass"] else "**MISS**"
        value, goal = target["value"], target["target"]
        lines.append(f"| {target['metric']} | {value:.2f}x | >= {goal:g}x | {verdict} |")
    lines += [
        "",
        "## Stampede",
        "",
        "Identical requests sent at once; the fake region takes 0.2 s to the first token.",
        "",
        "| coalescing | answer | requests | 200s | upstream calls | p50 ms | slowest ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in data["stampede"]:
        lines.append(
            f"| {s['coalescing']} | {s['mode']} | {s['requests']} | {s['ok']} "
            f"| {s['upstream_calls']} | {s['p50_ms']:.0f} | {s['max_ms']:.0f} |"
        )
    tiers = data["tiers"]
    lines += [
        "",
        "## Tier latency (in process, backend.get of a 280-byte entry)",
        "",
        "| tier | p50 us | p99 us |",
        "| --- | --- | --- |",
    ]
    for name, t in tiers.items():
        lines.append(f"| {name} | {t['p50_us']:.1f} | {t['p99_us']:.1f} |")
    return "\n".join(lines)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def chart(data: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = data["throughput"]["rows"]
    names = [n.replace("edgeproxy, ", "").replace(" (", "\n(") for n in rows]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    bars = axes[0].bar(names, [r["rps"] for r in rows.values()], color="tab:blue")
    axes[0].bar_label(bars, fmt="%.0f", fontsize=7)
    axes[0].set_yscale("log")  # the direct row would flatten the others
    axes[0].set_title(f"req/s at {data['meta']['conns']} connections (median round, log)")
    bars = axes[1].bar(names, [r["single_p50_ms"] for r in rows.values()], color="tab:green")
    axes[1].bar_label(bars, fmt="%.2f", fontsize=7)
    axes[1].set_title("latency at 1 connection, p50 ms")
    for ax in axes[:2]:
        ax.tick_params(axis="x", labelsize=7)
    labels = [f"{s['coalescing']}\n{s['mode']}" for s in data["stampede"]]
    bars = axes[2].bar(labels, [s["upstream_calls"] for s in data["stampede"]], color="tab:red")
    axes[2].bar_label(bars, fmt="%d", fontsize=8)
    axes[2].set_title(f"stampede of {data['stampede'][0]['requests']}: upstream calls")
    fig.suptitle(f"edgeproxy cache benchmark, {data['meta']['when']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per loaded run")
    parser.add_argument("--single-duration", type=float, default=2.0, help="seconds at 1 conn")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--conns", type=int, default=16)
    parser.add_argument("--stampede", type=int, default=100, help="identical requests at once")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--no-nginx", action="store_true", help="use the fake region upstream")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)

    started = time.monotonic()
    pin = u.plan_pinning(None, None)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="edgeproxy-bench-cache-"))
    data: dict[str, Any] = {}
    data["throughput"] = run_rows(args, work, pin)
    data["stampede"] = asyncio.run(stampede(args.stampede))
    data["tiers"] = asyncio.run(tier_latency(args.redis_url, 2000))
    rows = data["throughput"]["rows"]
    data["targets"] = []
    for tier, target in (("memory", 3.0), ("redis", 2.0)):
        hit, miss = rows[f"edgeproxy, hit ({tier})"], rows[f"edgeproxy, miss ({tier})"]
        for metric, value in (
            (f"{tier} hit vs miss, req/s at {args.conns} conns", hit["rps"] / miss["rps"]),
            (f"{tier} hit vs miss, p50 at 1 conn", miss["single_p50_ms"] / hit["single_p50_ms"]),
        ):
            data["targets"].append(
                {"metric": metric, "value": value, "target": target, "pass": value >= target}
            )
    data["meta"] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "pinning": pin.describe(),
        "rounds": args.rounds,
        "duration": args.duration,
        "single_duration": args.single_duration,
        "conns": args.conns,
        "elapsed_s": time.monotonic() - started,
    }
    text = report(data)
    print(text)
    (args.out / "cache.md").write_text(text + "\n")
    (args.out / "cache.json").write_text(json.dumps(data, indent=2))
    png = chart(data, args.out / "cache.png")
    if png is not None:
        print(f"\nchart: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
