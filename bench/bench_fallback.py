"""The fallback ladder's cost: local-model answers next to a healthy region, and how fast
an outage turns into degraded answers.

    .venv/bin/python bench/bench_fallback.py                 # about a minute
    .venv/bin/python bench/bench_fallback.py --model qwen2.5-0.5b-instruct-q4_k_m.gguf

Everything runs on 127.0.0.1: a fake region (``python -m edgeproxy.testing``,
its own process, with an emulated time to first token and inter-token delay),
``edgeproxy serve`` with a local model (its own process, pinned to a core of
its own where there are two), and the client here.

1. speed    Sequential streaming chat completions with the same prompt and
            max_tokens, first from the healthy region through the proxy, then
            from the local model (every region answering 503, so each request
            walks failover and the ladder first). Time to first token (the
            first SSE event with content) and decode speed (completion tokens
            over the time from the first to the last token).
2. outage   A request every ``--interval`` seconds, each on its own; the
            region is then taken out, and the time from the outage to the
            first byte of the first degraded answer is measured. Two outages:
            ``refused`` (the region process is killed: connections are
            refused) and ``stalled`` (the region accepts but never answers,
            so the route's deadline ends each attempt). Then the region comes
            back and the time to the first answer from it again is measured.

Without ``--model`` the local model is the tiny random-weight GGUF of
``edgeproxy.testing``: it shows the proxy's own overhead, not what a real
0.5-3B model costs (run with ``--model`` for that).

Results: bench/results/fallback.{md,json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script: make the helpers importable
    sys.path.insert(0, str(HERE))

import _util as u  # noqa: E402

PYTHON = sys.executable
CHAT = "/v1/chat/completions"


@dataclass
class Stream:
    """One streamed answer, timed on the client."""

    status: int
    degraded: str | None
    region: str | None
    ttft: float | None = None  # to the first content token
    total: float = 0.0
    tokens: int = 0
    decode_tps: float | None = None
    error: str | None = None


@dataclass
class Outage:
    kind: str
    first_degraded_s: float | None = None
    failed_between: int = 0
    sent_between: int = 0
    recovered_s: float | None = None
    degraded_after_back: int = 0
    notes: list[str] = field(default_factory=list)


def proxy_toml(
    port: int, admin: int, region_url: str, model: Path, args: argparse.Namespace
) -> str:
    threads = f"n_threads = {args.n_threads}\n" if args.n_threads else ""
    return f"""
[server]
host = "{u.LOOPBACK}"
port = {port}
grace_period = 2.0

[admin]
host = "{u.LOOPBACK}"
port = {admin}

[upstream]
connect_timeout = 1.0

[[regions]]
name = "ap-1"
url = "{region_url}"

[[routes]]
name = "chat"
path = "{CHAT}"
deadline = {args.deadline}
cache = "off"

[local_model]
path = "{model}"
n_ctx = 2048
max_tokens = {max(args.max_tokens, 64)}
n_gpu_layers = {args.n_gpu_layers}
{threads}"""


def request_body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "fake-llm",
        "messages": [{"role": "user", "content": "Say hello to the edge."}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_once(client: Any, url: str, max_tokens: int) -> Stream:
    """One streaming chat completion: status, markers, TTFT and decode speed."""
    import orjson

    started = time.perf_counter()
    first = last = None
    usage_tokens = 0
    content_events = 0
    async with client.post(url + CHAT, json=request_body(max_tokens)) as resp:
        result = Stream(
            resp.status,
            resp.headers.get("X-Edgeproxy-Degraded"),
            resp.headers.get("X-Edgeproxy-Region"),
        )
        if resp.status != 200:
            result.error = (await resp.read())[:200].decode(errors="replace")
            result.total = time.perf_counter() - started
            return result
        buffer = b""
        async for chunk in resp.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if not event.startswith(b"data: {"):
                    continue
                data = orjson.loads(event[6:])
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens", 0)
                for choice in data.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        content_events += 1
    result.total = time.perf_counter() - started
    result.tokens = usage_tokens or content_events
    if first is not None:
        result.ttft = first - started
        if last is not None and last > first and result.tokens > 1:
            result.decode_tps = (result.tokens - 1) / (last - first)
    return result


def control(region_url: str, **behavior: Any) -> None:
    import urllib.request

    req = urllib.request.Request(
        region_url + "/_control",
        data=json.dumps(behavior).encode(),
        method="POST",
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        resp.read()


def summarize(runs: list[Stream]) -> dict[str, Any]:
    ok = [r for r in runs if r.status == 200 and r.ttft is not None]
    ttfts = sorted(r.ttft * 1000 for r in ok if r.ttft is not None)
    tps = sorted(r.decode_tps for r in ok if r.decode_tps)
    totals = sorted(r.total * 1000 for r in ok)
    return {
        "n": len(runs),
        "ok": len(ok),
        "degraded": sorted({r.degraded or "-" for r in ok}),
        "ttft_p50_ms": statistics.median(ttfts) if ttfts else None,
        "ttft_p90_ms": u.percentile(ttfts, 90) if ttfts else None,
        "decode_tps_p50": statistics.median(tps) if tps else None,
        "total_p50_ms": statistics.median(totals) if totals else None,
        "tokens": statistics.median([r.tokens for r in ok]) if ok else None,
        "errors": [r.error for r in runs if r.error][:3],
    }


async def speed(proxy_url: str, region_url: str, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as client:
        for _ in range(2):  # warm-up: pools, the model's first context use
            await stream_once(client, proxy_url, args.max_tokens)
        healthy = [await stream_once(client, proxy_url, args.max_tokens) for _ in range(args.n)]
        out["healthy region"] = summarize(healthy)
        control(region_url, fault="5xx", fault_status=503)
        await stream_once(client, proxy_url, args.max_tokens)
        local = [await stream_once(client, proxy_url, args.max_tokens) for _ in range(args.n)]
        out["local model (fallback)"] = summarize(local)
        control(region_url, fault=None)
    return out


async def outage(
    proxy_url: str,
    kind: str,
    take_out: Any,
    bring_back: Any,
    args: argparse.Namespace,
) -> Outage:
    """Fire a request every interval; time the outage to the first degraded first byte."""
    import aiohttp

    result = Outage(kind)
    events: list[tuple[float, float, int, str | None, str | None]] = []
    stop = asyncio.Event()

    async def one(client: aiohttp.ClientSession) -> None:
        sent = time.perf_counter()
        try:
            async with client.post(proxy_url + CHAT, json=request_body(8, stream=False)) as resp:
                headers_at = time.perf_counter()
                await resp.read()
                events.append(
                    (
                        sent,
                        headers_at,
                        resp.status,
                        resp.headers.get("X-Edgeproxy-Degraded"),
                        resp.headers.get("X-Edgeproxy-Region"),
                    )
                )
        except aiohttp.ClientError as exc:
            events.append((sent, time.perf_counter(), 0, None, str(exc)))

    async def driver(client: aiohttp.ClientSession) -> None:
        tasks: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            task = asyncio.ensure_future(one(client))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(args.interval)
        await asyncio.gather(*tasks, return_exceptions=True)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as client:
        drive = asyncio.ensure_future(driver(client))
        await asyncio.sleep(1.0)  # steady state on the healthy region
        t_out = time.perf_counter()
        await asyncio.to_thread(take_out)
        deadline = t_out + args.deadline + 10
        while time.perf_counter() < deadline:
            if any(e[3] and e[1] >= t_out for e in events):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        await asyncio.to_thread(bring_back)
        t_back = time.perf_counter()  # the region answers again from here on
        while time.perf_counter() < t_back + 15:
            if any(e[2] == 200 and not e[3] and e[1] >= t_back for e in events):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        stop.set()
        await drive
    degraded = [e[1] for e in events if e[3] and e[1] >= t_out]
    if degraded:
        first = min(degraded)
        result.first_degraded_s = first - t_out
        between = [e for e in events if e[1] >= t_out and e[1] <= first]
        result.sent_between = len(between)
        result.failed_between = sum(1 for e in between if e[2] != 200)
    back = [e[1] for e in events if e[2] == 200 and not e[3] and e[1] >= t_back]
    if back:
        result.recovered_s = min(back) - t_back
    result.degraded_after_back = sum(1 for e in events if e[0] >= t_back and e[3])
    return result


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def chart(data: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    speed_rows = data["speed"]
    labels = list(speed_rows)
    for ax, key, title in (
        (axes[0], "ttft_p50_ms", "time to first token, p50 (ms)"),
        (axes[1], "decode_tps_p50", "decode speed, p50 (tokens/s)"),
    ):
        values = [speed_rows[k][key] or 0 for k in labels]
        bars = ax.bar(labels, values, color=["tab:blue", "tab:orange"])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    outages = data["outage"]
    ax = axes[2]
    names = [o["kind"] for o in outages]
    values = [(o["first_degraded_s"] or 0) * 1000 for o in outages]
    bars = ax.bar(range(len(names)), values, color="tab:red")
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, fontsize=8, rotation=20)
    ax.set_title("outage to first degraded answer (ms)")
    fig.suptitle(data["meta"]["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", type=Path, help="a GGUF model; default: the tiny test model")
    parser.add_argument("--n", type=int, default=8, help="streamed answers per path")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ttft", type=float, default=0.15, help="fake region time to first token")
    parser.add_argument("--itd", type=float, default=0.02, help="fake region inter-token delay")
    parser.add_argument("--deadline", type=float, default=1.0, help="the route's deadline, s")
    parser.add_argument("--interval", type=float, default=0.05, help="outage: s between requests")
    parser.add_argument("--rounds", type=int, default=2, help="outage rounds per kind")
    parser.add_argument("--n-threads", type=int, default=1, help="local model threads (0: auto)")
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)

    began = time.time()
    pin = u.plan_pinning(None, None)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="edgeproxy-bench-fallback-"))
    if args.model is None:
        sys.path.insert(0, str(HERE.parent))
        from edgeproxy.testing import tiny_llama_gguf

        model = tiny_llama_gguf("Q8_0", directory=work)
        model_label = "tiny random-weight test model (Q8_0, 2 x 64, edgeproxy.testing)"
    else:
        model = args.model.resolve()
        model_label = model.name
    region_port = u.free_port()
    region_url = f"http://{u.LOOPBACK}:{region_port}"

    def region_service(tag: str) -> u.Service:
        return u.Service(
            f"region-{tag}",
            [
                *pin.origin_prefix(),
                PYTHON,
                "-m",
                "edgeproxy.testing",
                "--name",
                "ap-1",
                "--port",
                str(region_port),
                "--ttft",
                f"{args.ttft:g}",
                "--inter-token-delay",
                f"{args.itd:g}",
                "--tokens",
                str(args.max_tokens),
            ],
            work / f"region-{tag}.log",
        ).start()

    regions: list[u.Service] = [region_service("0")]
    regions[-1].wait_line("listening on http://", timeout=30)
    port, admin = u.free_port(), u.free_port()
    config = work / "edge.toml"
    config.write_text(proxy_toml(port, admin, region_url, model, args))
    proxy = u.Service(
        "edgeproxy",
        [
            *pin.sut_prefix(),
            PYTHON,
            "-m",
            "edgeproxy",
            "serve",
            "--config",
            str(config),
            "--log-level",
            "warning",
        ],
        work / "edgeproxy.log",
    ).start()
    proxy_url = f"http://{u.LOOPBACK}:{port}"
    data: dict[str, Any] = {"outage": []}
    try:
        proxy.wait_http(f"http://{u.LOOPBACK}:{admin}/readyz", timeout=60)
        deadline = time.monotonic() + 120
        while True:  # the model loads in the background; wait for it before timing it
            state = u.http_json(f"http://{u.LOOPBACK}:{admin}/status")["fallback"]["local_model"]
            if state["state"] == "ready":
                break
            if state["state"] != "loading" or time.monotonic() > deadline:
                raise u.ServiceError(f"local model is {state['state']}: {state['error']}")
            time.sleep(0.1)
        data["model_status"] = state
        data["speed"] = asyncio.run(speed(proxy_url, region_url, args))

        def kill() -> None:
            regions[-1].stop(sig=9)

        def restart() -> None:
            regions.append(region_service(str(len(regions))))
            regions[-1].wait_line("listening on http://", timeout=30)

        def stall() -> None:
            control(region_url, fault="stall")

        def heal() -> None:
            control(region_url, fault=None)

        for _ in range(args.rounds):
            data["outage"].append(
                asdict_outage(
                    asyncio.run(outage(proxy_url, "refused (region killed)", kill, restart, args))
                )
            )
            data["outage"].append(
                asdict_outage(
                    asyncio.run(
                        outage(
                            proxy_url, f"stalled (deadline {args.deadline:g} s)", stall, heal, args
                        )
                    )
                )
            )
        data["proxy_status"] = u.http_json(f"http://{u.LOOPBACK}:{admin}/status")["fallback"]
    finally:
        proxy.stop()
        for svc in regions:
            svc.stop()

    elapsed = time.time() - began
    title = (
        f"edgeproxy fallback bench, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{model_label}"
    )
    data["meta"] = {
        "title": title,
        "pinning": pin.describe(),
        "elapsed_s": round(elapsed, 1),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    lines = [
        f"# {title}",
        "",
        f"- Pinning: {pin.describe()}.",
        f"- Fake region: ttft {args.ttft:g} s, {args.itd:g} s between tokens "
        f"({1 / args.itd:.0f} tokens/s); {args.max_tokens} tokens per answer; local model "
        f"n_threads {args.n_threads or 'auto'}, n_gpu_layers {args.n_gpu_layers}; "
        f"run took {elapsed:.0f} s.",
        "",
        "## Speed: healthy region vs local model",
        "",
    ]
    rows = []
    for label, s in data["speed"].items():
        rows.append(
            [
                label,
                f"{s['ok']}/{s['n']}",
                ", ".join(s["degraded"]),
                fmt(s["ttft_p50_ms"]),
                fmt(s["ttft_p90_ms"]),
                fmt(s["decode_tps_p50"]),
                fmt(s["total_p50_ms"]),
                fmt(s["tokens"], 0),
            ]
        )
    lines += table(
        [
            "path",
            "ok",
            "degraded",
            "TTFT p50 ms",
            "TTFT p90 ms",
            "decode tok/s p50",
            "total p50 ms",
            "tokens",
        ],
        rows,
    )
    lines += [
        "",
        "## Outage to the first degraded answer",
        "",
        f"A request every {args.interval:g} s (JSON, 8 tokens). 'first degraded' runs from "
        "taking the region out to the first byte of the first degraded answer; 'failed' "
        "counts the requests that ended in an error in that window (those in flight at "
        "the outage); 'recovered' runs from the region answering again to the first "
        "answer from it through the proxy (its headers: the fake region's ttft is in it), "
        "and 'degraded after' counts requests sent after that moment that still got a "
        "degraded answer.",
        "",
    ]
    rows = [
        [
            o["kind"],
            fmt(o["first_degraded_s"] and o["first_degraded_s"] * 1000, 0),
            f"{o['failed_between']}/{o['sent_between']}",
            fmt(o["recovered_s"] and o["recovered_s"] * 1000, 0),
            str(o["degraded_after_back"]),
        ]
        for o in data["outage"]
    ]
    lines += table(
        [
            "outage",
            "first degraded ms",
            "failed / answered in between",
            "recovered ms",
            "degraded after",
        ],
        rows,
    )
    report = "\n".join(lines)
    print(report)
    (args.out / "fallback.md").write_text(report + "\n")
    (args.out / "fallback.json").write_text(json.dumps(data, indent=2, default=str))
    png = chart(data, args.out / "fallback.png")
    if png is not None:
        print(f"\nchart: {png}")
    return 0


def asdict_outage(o: Outage) -> dict[str, Any]:
    return {
        "kind": o.kind,
        "first_degraded_s": o.first_degraded_s,
        "failed_between": o.failed_between,
        "sent_between": o.sent_between,
        "recovered_s": o.recovered_s,
        "degraded_after_back": o.degraded_after_back,
    }


if __name__ == "__main__":
    sys.exit(main())
