"""Overload: offered load at 2x the upstream's capacity, with and without admission control.

    python bench/bench_admission.py [--duration 20] [--slots 8] [--service-ms 40]

The upstream is a small aiohttp server (its own process) that serves
``--slots`` requests at a time, each taking ``--service-ms``: a fixed
capacity of slots / service time requests a second, with a FIFO queue in
front like an inference server's. edgeproxy (``edgeproxy serve``, its own
process, on its own core when there are two) forwards to it over HTTP/1.1.
The load is open-loop: Poisson arrivals at a fixed rate from this process,
each request on its own task, so a slow server is charged for its backlog.

Runs, each with a warm-up:

1. 50% of capacity, admission on (it does not engage at this load): the reference p99;
2. 2x capacity, no admission: everything is forwarded and queues upstream;
3. 2x capacity, admission on: ``max_in_flight`` = the upstream's slots, a short
   priority queue, everything else shed at once with 503 + Retry-After.

For each: goodput (2xx answers a second, and as a share of capacity), p50 and
p99 of the accepted (2xx) requests, the share shed (503), and other failures
(timeouts, 504s). Targets at 2x with admission: p99 of accepted within 2x the
p99 at 50% load, goodput at least 90% of capacity.

Writes ``bench/results/admission.md`` and ``admission.json`` and, with
matplotlib, ``admission.png``. Everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report as report  # noqa: E402
import _util as u  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


# -- the upstream with a fixed capacity ------------------------------------------------


def serve_upstream(port: int, slots: int, service: float) -> None:
    """Run the fixed-capacity upstream until killed (``--serve-upstream``)."""
    from aiohttp import web

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    body = u.UPSTREAM_JSON.encode()
    slots_key = web.AppKey("slots", asyncio.Semaphore)

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        async with request.app[slots_key]:
            await asyncio.sleep(service)
        return web.Response(body=body, content_type="application/json")

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def on_startup(app: web.Application) -> None:
        app[slots_key] = asyncio.Semaphore(slots)

    app = web.Application()
    app.on_startup.append(on_startup)
    app.router.add_get("/healthz", healthz)
    app.router.add_route("*", "/{tail:.*}", handler)
    web.run_app(app, host=u.LOOPBACK, port=port, access_log=None, print=None, backlog=4096)


# -- the open-loop load ------------------------------------------------------------


async def open_loop(
    url: str, rate: float, duration: float, warmup: float, timeout: float, seed: int
) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` for warmup + duration; results of the measured part."""
    import aiohttp

    rng = random.Random(seed)
    body = u.REQUEST_JSON.encode()
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    # Every request: (due, status or 0 for a failure, finished), loop time.
    done: list[tuple[float, int, float]] = []
    failures: Counter[str] = Counter()
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()

    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as client:

        async def one(due: float, counted: bool) -> None:
            try:
                async with client.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    status = resp.status
            except TimeoutError:
                status, reason = 0, "client timeout"
            except aiohttp.ClientError as exc:
                status, reason = 0, type(exc).__name__
            # Timed from when it was due: a late send is the generator's backlog, charged too.
            done.append((due, status, loop.time()))
            if counted and status == 0:
                failures[reason] += 1

        start = loop.time() + 0.05
        end_warmup = start + warmup
        end = end_warmup + duration
        due = start
        sent = 0
        while due < end:
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(one(due, due >= end_warmup))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if due >= end_warmup:
                sent += 1
            due += rng.expovariate(rate)
        if tasks:
            await asyncio.wait(set(tasks), timeout=timeout + 5)
    # Latencies and shares: the requests sent in the measured window.
    measured = [(status, fin - due) for due, status, fin in done if end_warmup <= due < end]
    statuses = Counter(str(s) for s, _ in measured if s)
    accepted = sorted(lat for s, lat in measured if 200 <= s < 300)
    shed = statuses.get("503", 0)
    total = len(measured)
    # Goodput: successful answers completed within the window, whenever sent.
    good = sum(1 for _, s, fin in done if 200 <= s < 300 and end_warmup <= fin < end)
    return {
        "offered_rps": rate,
        "sent": sent,
        "answered": total,
        "statuses": dict(statuses),
        "failures": dict(failures),
        "goodput_rps": good / duration,
        "p50_ms": u.percentile(accepted, 50) * 1000 if accepted else None,
        "p99_ms": u.percentile(accepted, 99) * 1000 if accepted else None,
        "max_ms": accepted[-1] * 1000 if accepted else None,
        "shed_share": shed / total if total else 0.0,
        "other_failure_share": (total - len(accepted) - shed) / total if total else 0.0,
    }


# -- the runs ----------------------------------------------------------------------


def proxy_config(port: int, upstream_port: int, admission: dict[str, Any] | None) -> str:
    lines = [
        "[server]",
        f'host = "{u.LOOPBACK}"',
        f"port = {port}",
        "[admin]",
        "enabled = false",
        "[upstream]",
        "read_timeout = 60",
        "pool_timeout = 5",
        "[[regions]]",
        'name = "capacity"',
        f'url = "http://{u.LOOPBACK}:{upstream_port}"',
        "http2 = false",
        "[[routes]]",
        'name = "chat"',
        'path = "/v1/chat/completions"',
        "deadline = 60",
        "fallback = []",
    ]
    if admission:
        lines.append("[admission]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in admission.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--slots", type=int, default=8, help="requests the upstream serves at once")
    parser.add_argument("--service-ms", type=float, default=40.0, help="upstream time per request")
    parser.add_argument("--queue", type=int, default=0, help="admission max_queue (0: = slots)")
    parser.add_argument(
        "--queue-time-ms", type=float, default=0.0, help="max_queue_time (0: = service time)"
    )
    parser.add_argument("--timeout", type=float, default=15.0, help="client timeout, seconds")
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    service = args.service_ms / 1000
    if args.serve_upstream:
        serve_upstream(args.serve_upstream, args.slots, service)
        return 0

    capacity = args.slots / service
    admission = {
        "max_in_flight": args.slots,
        "max_queue": args.queue or args.slots,
        "max_queue_time": (args.queue_time_ms / 1000) if args.queue_time_ms else service,
    }
    pinning = u.plan_pinning(None, None)
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    upstream_port = u.free_port()
    upstream = u.Service(
        "upstream",
        [
            *pinning.harness_prefix(),
            sys.executable,
            __file__,
            "--serve-upstream",
            str(upstream_port),
            "--slots",
            str(args.slots),
            "--service-ms",
            str(args.service_ms),
        ],
        tmp / "upstream.log",
    ).start()
    runs: list[dict[str, Any]] = []
    try:
        upstream.wait_http(f"http://{u.LOOPBACK}:{upstream_port}/healthz")
        plan = [
            ("50% load, admission on", 0.5, admission),
            ("2x load, no admission", 2.0, None),
            ("2x load, admission on", 2.0, admission),
        ]
        for index, (label, load, adm) in enumerate(plan):
            port = u.free_port()
            config = tmp / f"edge-{index}.toml"
            config.write_text(proxy_config(port, upstream_port, adm))
            proxy = u.Service(
                "edgeproxy",
                [
                    *pinning.sut_prefix(),
                    sys.executable,
                    "-m",
                    "edgeproxy",
                    "serve",
                    "--config",
                    str(config),
                ],
                tmp / f"proxy-{index}.log",
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            ).start()
            try:
                proxy.wait_line("listening on")
                rate = capacity * load
                print(
                    f"{label}: {rate:.0f} req/s for {args.warmup:g}+{args.duration:g} s", flush=True
                )
                result = asyncio.run(
                    open_loop(
                        f"http://{u.LOOPBACK}:{port}{u.REQUEST_PATH}",
                        rate,
                        args.duration,
                        args.warmup,
                        args.timeout,
                        seed=index,
                    )
                )
            finally:
                proxy.stop()
            result["label"] = label
            result["load"] = load
            result["admission"] = adm
            result["goodput_share"] = result["goodput_rps"] / capacity
            runs.append(result)
    finally:
        upstream.stop()

    base_p99 = runs[0]["p99_ms"]
    with_adm = runs[2]
    targets = {
        "p99_ratio": (with_adm["p99_ms"] / base_p99) if base_p99 and with_adm["p99_ms"] else None,
        "goodput_share": with_adm["goodput_share"],
    }
    data = {
        "capacity_rps": capacity,
        "slots": args.slots,
        "service_ms": args.service_ms,
        "duration_s": args.duration,
        "pinning": pinning.describe(),
        "admission": admission,
        "runs": runs,
        "targets": targets,
    }
    text = render(data)
    print()
    print(text)
    (RESULTS / "admission.md").write_text(text)
    (RESULTS / "admission.json").write_text(json.dumps(data, indent=2))
    chart(data, RESULTS / "admission.png")
    ok = (targets["p99_ratio"] or 99) <= 2.0 and targets["goodput_share"] >= 0.9
    return 0 if ok else 1


def render(data: dict[str, Any]) -> str:
    num = report._num
    rows = []
    for r in data["runs"]:
        others = ", ".join(
            f"{n} x {k}"
            for k, n in sorted({**r["statuses"], **r["failures"]}.items())
            if not k.startswith("2") and k != "503"
        )
        rows.append(
            [
                r["label"],
                num(r["offered_rps"], 0),
                num(r["sent"]),
                f"{num(r['goodput_rps'], 1)} ({r['goodput_share']:.0%})",
                num(r["p50_ms"], 1),
                num(r["p99_ms"], 1),
                num(r["max_ms"], 1),
                f"{r['shed_share']:.1%}",
                f"{r['other_failure_share']:.1%}" + (f" ({others})" if others else ""),
            ]
        )
    t = data["targets"]
    lines = [
        "# Admission control at 2x overload",
        "",
        f"Upstream capacity {data['capacity_rps']:.0f} req/s ({data['slots']} slots x "
        f"{data['service_ms']:g} ms, FIFO queue in front). Open-loop Poisson load, "
        f"{data['duration_s']:g} s measured per run. Admission: "
        + ", ".join(f"{k} = {v}" for k, v in data["admission"].items())
        + f". Pinning: {data['pinning']}.",
        "",
        *report._table(
            [
                "run",
                "offered req/s",
                "sent",
                "goodput req/s (of capacity)",
                "p50 ms (2xx)",
                "p99 ms (2xx)",
                "max ms (2xx)",
                "shed (503)",
                "other failures",
            ],
            rows,
        ),
        "",
        "| target | measured | result |",
        "| --- | --- | --- |",
        f"| p99 of accepted at 2x <= 2x the p99 at 50% | {num(t['p99_ratio'])}x | "
        + ("pass" if t["p99_ratio"] is not None and t["p99_ratio"] <= 2 else "**MISS**")
        + " |",
        f"| goodput at 2x >= 90% of capacity | {t['goodput_share']:.0%} | "
        + ("pass" if t["goodput_share"] >= 0.9 else "**MISS**")
        + " |",
        "",
    ]
    return "\n".join(lines)


def chart(data: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = data["runs"]
    labels = [r["label"].replace(", ", ",\n") for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    axes[0].bar(labels, [r["goodput_rps"] for r in runs])
    axes[0].axhline(data["capacity_rps"], color="grey", ls="--", lw=0.8)
    axes[0].set_title("goodput (req/s; dashed: capacity)")
    axes[1].bar(labels, [r["p99_ms"] or 0 for r in runs])
    axes[1].set_yscale("log")
    axes[1].set_title("p99 of accepted requests (ms, log)")
    axes[2].bar(labels, [100 * r["shed_share"] for r in runs], label="shed (503)")
    axes[2].bar(
        labels,
        [100 * r["other_failure_share"] for r in runs],
        bottom=[100 * r["shed_share"] for r in runs],
        label="other failures",
    )
    axes[2].set_title("share of requests not served (%)")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
