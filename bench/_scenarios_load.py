"""The load scenarios of ``bench/scenarios.py``: GPU saturation, a backlog burst with
priority queues, and cold starts with and without prewarmed pools."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from _scenario_rig import (
    Client,
    Mode,
    Outcome,
    Rec,
    World,
    chat_body,
    closed_loop,
    open_loop,
    pct,
    plain_proxy,
    ratio,
)

INTERACTIVE = {"X-Priority": "10"}
BATCH = {"X-Priority": "0"}


def _slug(name: str) -> str:
    return name.replace(", ", "-").replace(" ", "-")


# -- 3. GPU saturation -------------------------------------------------------------------


async def saturation(mode: Mode) -> Outcome:
    """A region with 8 slots and a short queue, offered twice what it can serve."""
    phase, questions = (1.0, 20) if mode.short else (10.0, 100)
    slots, service = 8, 0.2
    rate = 2 * slots / service  # twice the region's capacity
    timeout = 2.0
    world = World(mode.geometry)
    region = await world.region("us-east", ttft=service, tokens=16, max_running=slots)
    plain = plain_proxy()
    variants = [
        ("direct", "direct", None),
        (plain, plain, None),
        ("edgeproxy", "edgeproxy", None),
        ("edgeproxy+shed", "edgeproxy", "saturation_shed"),
        ("edgeproxy+degrade to stale", "edgeproxy", "saturation_degrade"),
    ]
    rows: list[list[object]] = []
    recs_all: list[Rec] = []
    offered = 0
    worst_504 = 0
    best_p99: float | None = None
    worst_p99 = 0.0
    try:
        started = await world.start_all(variants, read_timeout=timeout)
        for name, kind, config in variants:
            proxy = started[name]
            url = world.direct["us-east"].url if kind == "direct" else proxy.url
            async with Client(timeout=timeout if kind == "direct" else 30) as client:
                if config == "saturation_degrade":
                    # Its questions once at a quiet time, so that the cache holds them.
                    warm = [
                        functools.partial(client.call, name, url, chat_body(f"q {q}"), label="warm")
                        for q in range(questions)
                    ]
                    await closed_loop(8, warm)
                    await asyncio.sleep(1.2)  # past cache_ttl: stale
                sent = [0]
                recs = await open_loop(
                    client,
                    name,
                    [url],
                    rate,
                    [("overload", phase, None)],
                    prefix="q" if config == "saturation_degrade" else f"q-{name}",
                    sent=sent,
                    questions=questions if config == "saturation_degrade" else None,
                )
            await world.stop_proxy(proxy)
            offered += sent[0]
            recs_all += recs
            ok = [r.total for r in recs if r.status == 200]
            gw = sum(r.status == 504 or (kind == "direct" and r.status == 0) for r in recs)
            p99 = pct(ok, 99)
            if kind != "edgeproxy":
                worst_504 = max(worst_504, gw)
                worst_p99 = max(worst_p99, p99 or 0.0)
            elif config is not None and p99 is not None:
                best_p99 = p99 if best_p99 is None else min(best_p99, p99)
            rows.append(
                [
                    name,
                    len(recs),
                    len(ok),
                    gw,
                    sum(r.status == 503 for r in recs),
                    sum(r.cache in ("STALE", "HIT") for r in recs),
                    pct(ok, 50),
                    p99,
                ]
            )
            region.reset_counters()
    finally:
        await world.close()
    return Outcome(
        "saturation",
        f"3. GPU saturation: {slots} slots x {service:g} s and a FIFO queue, offered "
        f"{rate:g} req/s (2x capacity) for {phase:g} s over {questions} questions",
        [
            "variant",
            "requests",
            "200",
            "504s (direct: timeouts)",
            "503s (shed)",
            "from the cache",
            "p50 of 200s ms",
            "p99 of 200s ms",
        ],
        rows,
        {
            "metric": "p99 of answered requests",
            "baseline": worst_p99,
            "edgeproxy": best_p99,
            "ratio": ratio(worst_p99, best_p99),
            "target": None,
        },
        {
            "offered": offered,
            "requests": len(recs_all),
            "answered": sum(r.status == 200 for r in recs_all),
        },
        [
            f"the plain proxy's gateway timeout and the direct client's are {timeout:g} s",
            "every request asks a question of its own, but for degrade: it cycles through "
            f"{questions} questions asked once before the overload, gone stale since (cache_ttl "
            "1 s), so that the overflow can be answered from the stale entries (and accepted "
            "requests refresh them: fresh hits count in 'from the cache' too)",
        ],
    )


# -- 3b. GPU saturation, with a lighter model ---------------------------------------------


async def lighter(mode: Mode) -> Outcome:
    """The saturation of scenario 3 with a lighter model in a second region: the overflow
    degrades to the stale cache alone, or first to the lighter model."""
    phase = 1.0 if mode.short else 10.0
    slots, service = 8, 0.2
    rate = 2 * slots / service  # twice the big region's capacity
    # Each question once in the overload (warmed before, stale since): no fresh hits, so
    # every request the big model cannot take goes down the ladder.
    questions = int(rate * phase)
    world = World(mode.geometry)
    await world.region("us-east", ttft=service, tokens=16, max_running=slots)
    # The lighter model: four times the slots, a quarter of the time per request.
    await world.region(
        "us-east-light", model="fake-llm-8b", ttft=service / 4, tokens=16, max_running=4 * slots
    )
    variants = [
        ("edgeproxy+degrade to stale", "edgeproxy", "saturation_degrade"),
        ("edgeproxy+lighter, then stale", "edgeproxy", "saturation_lighter"),
    ]
    rows: list[list[object]] = []
    p99s: dict[str, float | None] = {}
    recs_all: list[Rec] = []
    offered = 0
    try:
        started = await world.start_all(variants, read_timeout=2.0)
        for name, _, config in variants:
            proxy = started[name]
            async with Client(timeout=30) as client:
                # Its questions once at a quiet time, so that the cache holds them (stale).
                warm = [
                    functools.partial(client.call, name, proxy.url, chat_body(f"q {q}"))
                    for q in range(questions)
                ]
                await closed_loop(2 * slots, warm)
                await asyncio.sleep(1.2)  # past cache_ttl: stale
                sent = [0]
                recs = await open_loop(
                    client,
                    name,
                    [proxy.url],
                    rate,
                    [("overload", phase, None)],
                    prefix="q",
                    sent=sent,
                    questions=questions,
                )
            await world.stop_proxy(proxy)
            offered += sent[0]
            recs_all += recs
            ok = [r.total for r in recs if r.status == 200]
            p99s[str(config)] = pct(ok, 99)

            def share(kind: str, recs: list[Rec] = recs) -> float:
                picked = {
                    "region": lambda r: r.status == 200 and not r.degraded and r.cache != "HIT",
                    "fresh cache": lambda r: r.status == 200 and r.cache == "HIT",
                    "lighter": lambda r: r.degraded == "lighter-model",
                    "stale": lambda r: r.degraded == "stale-cache",
                    "failed": lambda r: r.status != 200,
                }[kind]
                return round(100 * sum(picked(r) for r in recs) / max(1, len(recs)), 1)

            rows.append(
                [
                    name,
                    len(recs),
                    len(ok),
                    share("region"),
                    share("fresh cache"),
                    share("lighter"),
                    share("stale"),
                    share("failed"),
                    pct(ok, 50),
                    pct(ok, 99),
                ]
            )
            for region in world.regions.values():
                region.reset_counters()
    finally:
        await world.close()
    without, with_lighter = p99s["saturation_degrade"], p99s["saturation_lighter"]
    return Outcome(
        "lighter",
        f"3b. GPU saturation with a lighter model: {slots} slots x {service:g} s for the model "
        f"asked, {4 * slots} x {service / 4:g} s for the lighter one, offered {rate:g} req/s "
        f"(2x the big model's capacity) for {phase:g} s over {questions} questions",
        [
            "variant",
            "requests",
            "200",
            "% by the model asked",
            "% fresh cache",
            "% lighter model",
            "% stale cache",
            "% not answered",
            "p50 of 200s ms",
            "p99 of 200s ms",
        ],
        rows,
        {
            "metric": "p99 of answered requests",
            "baseline": without,
            "edgeproxy": with_lighter,
            "ratio": ratio(without, with_lighter),
            "target": None,
        },
        {
            "offered": offered,
            "requests": len(recs_all),
            "answered": sum(r.status == 200 for r in recs_all),
        },
        [
            "both variants warm the cache with every question first and let it go stale, so "
            "the stale rung can answer in both: the difference is the lighter rung before it",
            "the share columns are of all requests; a lighter answer is a fresh answer of the "
            "lighter model, a stale one is an old answer of the model asked",
        ],
    )


# -- 7. backlog --------------------------------------------------------------------------


async def backlog(mode: Mode) -> Outcome:
    """Interactive requests through a batch burst at 1.6x capacity, with and without priorities."""
    healthy, burst, recovery = (0.8, 1.0, 1.0) if mode.short else (5.0, 8.0, 10.0)
    slots, service = 8, 0.2
    capacity = slots / service
    interactive_rate, batch_rate = 5.0, 1.5 * capacity
    world = World(mode.geometry)
    await world.region("us-east", ttft=service, tokens=16, max_running=slots)
    plain = plain_proxy()
    variants = [
        ("direct", "direct", None),
        (plain, plain, None),
        ("edgeproxy", "edgeproxy", None),
        ("edgeproxy+priority", "edgeproxy", "backlog"),
    ]
    rows: list[list[object]] = []
    recs_all: list[Rec] = []
    offered = 0
    p99s: dict[str, float | None] = {}
    try:
        started = await world.start_all(variants, read_timeout=120)
        for name, kind, _config in variants:
            proxy = started[name]
            url = world.direct["us-east"].url if kind == "direct" else proxy.url
            sent = [0]
            async with Client(timeout=120) as client:
                phases: list[tuple[str, float, Callable[[], Any] | None]] = [
                    ("healthy", healthy, None),
                    ("burst", burst, None),
                    ("recovery", recovery, None),
                ]
                batch = open_loop(
                    client,
                    name,
                    [url],
                    batch_rate,
                    [("wait", healthy, None), ("batch", burst, None)],
                    prefix=f"b-{name}",
                    sent=sent,
                    headers=lambda _k: BATCH,
                    skip_first=True,
                )
                inter = open_loop(
                    client,
                    name,
                    [url],
                    interactive_rate,
                    phases,
                    prefix=f"i-{name}",
                    sent=sent,
                    headers=lambda _k: INTERACTIVE,
                )
                batch_recs, inter_recs = await asyncio.gather(batch, inter)
            await world.stop_proxy(proxy)
            offered += sent[0]
            recs_all += batch_recs + inter_recs
            base = pct([r.total for r in inter_recs if r.label == "healthy"], 99) or 0.0
            during = [r for r in inter_recs if r.label != "healthy"]
            slow = [r.sent for r in during if r.total * 1000 > 2 * base]
            burst_end = min((r.sent for r in inter_recs if r.label == "recovery"), default=0.0)
            p99s[name] = pct([r.total for r in during], 99)
            rows.append(
                [
                    name,
                    len(inter_recs),
                    base,
                    pct([r.total for r in during], 50),
                    p99s[name],
                    max(0.0, max(slow) - burst_end) if slow else 0.0,
                    len(batch_recs),
                    sum(r.status == 200 for r in batch_recs + inter_recs),
                ]
            )
    finally:
        await world.close()
    worst = max(p99s[variants[0][0]] or 0.0, p99s[variants[1][0]] or 0.0)
    best = p99s["edgeproxy+priority"]
    vs_healthy: dict[str, float | None] = {}
    for row in rows:
        healthy_p99, burst_p99 = row[2], row[4]
        value = (
            burst_p99 / healthy_p99
            if isinstance(burst_p99, float) and isinstance(healthy_p99, float) and healthy_p99
            else None
        )
        vs_healthy[str(row[0])] = value
        row.append(value)
    worst_x = max(vs_healthy[variants[0][0]] or 0.0, vs_healthy[variants[1][0]] or 0.0)
    return Outcome(
        "backlog",
        f"7. Backlog: a batch burst at {batch_rate:g} req/s ({batch_rate / capacity:g}x the "
        f"region's {capacity:g}) for {burst:g} s; interactive requests at {interactive_rate:g} "
        "req/s throughout",
        [
            "variant",
            "interactive requests",
            "interactive p99 healthy ms",
            "interactive p50 burst+recovery ms",
            "interactive p99 burst+recovery ms",
            "s after the burst until under 2x healthy",
            "batch requests",
            "answered",
            "p99 burst / healthy",
        ],
        rows,
        {
            "metric": "interactive p99 in the backlog / healthy p99",
            "baseline": worst_x,
            "edgeproxy": vs_healthy["edgeproxy+priority"],
            "ratio": ratio(worst, best),
            "max": 2.0,
        },
        {
            "offered": offered,
            "requests": len(recs_all),
            "answered": sum(r.status == 200 for r in recs_all),
        },
        [
            "interactive requests carry X-Priority: 10, batch ones X-Priority: 0; only "
            "edgeproxy+priority (bench/scenarios/backlog.toml) queues by it",
        ],
    )


# -- 6. cold start -----------------------------------------------------------------------


async def cold_start(mode: Mode) -> Outcome:
    """The first request after a proxy starts, and after its region connections dropped."""
    n = 1 if mode.short else 3
    world = World(mode.geometry)
    await world.region("us-east", ttft=0.05, tokens=16)
    plain = plain_proxy()
    variants = [
        (plain, plain, None),
        ("edgeproxy, no prewarming", "edgeproxy", "cold_start_off"),
        ("edgeproxy", "edgeproxy", None),
        ("edgeproxy+config", "edgeproxy", "cross_region"),
    ]
    rows: list[list[object]] = []
    recs_all: list[Rec] = []
    offered = 0
    firsts: dict[str, float | None] = {}
    try:
        for name, kind, config in variants:
            first, dropped, steady = [], [], []
            for k in range(n):
                proxy = await world.proxy(_slug(name), kind, config)
                async with Client(timeout=30, keepalive=True) as client:
                    call = functools.partial(client.call, name, proxy.url)
                    first.append(await call(chat_body(f"c {name} {k} a"), label="first"))
                    steady.append(await call(chat_body(f"c {name} {k} b"), label="steady"))
                    world.far["us-east"].drop_all()
                    await asyncio.sleep(0.5)
                    dropped.append(await call(chat_body(f"c {name} {k} c"), label="dropped"))
                offered += 3
                await world.stop_proxy(proxy)
            recs_all += first + dropped + steady
            firsts[name] = pct([r.ttfb for r in first], 50)
            rows.append(
                [
                    name,
                    firsts[name],
                    pct([r.ttfb for r in dropped], 50),
                    pct([r.ttfb for r in steady], 50),
                ]
            )
    finally:
        await world.close()
    worst = firsts[variants[0][0]]
    best = min(v for k, v in firsts.items() if k != variants[1][0] and v is not None)
    for row in rows:
        row.append(ratio(row[1], row[3]))  # type: ignore[arg-type]
    return Outcome(
        "cold_start",
        "6. Cold start: TTFB of the first request after the proxy starts and after its "
        f"region connections drop (median of {n} starts)",
        [
            "variant",
            "first request TTFB ms",
            "after a drop TTFB ms",
            "warm TTFB ms",
            "first / warm",
        ],
        rows,
        {
            "metric": "first request TTFB",
            "baseline": worst,
            "edgeproxy": best,
            "ratio": ratio(worst, best),
            "target": None,
        },
        {
            "offered": offered,
            "requests": len(recs_all),
            "answered": sum(r.status == 200 for r in recs_all),
        },
        [
            "after a drop: every connection through the far link reset, then 0.5 s later a "
            "request; the local model's load time is not measured here (bench/bench_fallback.py)",
        ],
    )
