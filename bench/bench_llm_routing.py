"""LLM-aware routing: KV-cache (prefix) affinity and region load on a multi-turn chat.

    .venv/bin/python bench/bench_llm_routing.py            # about 10 minutes
    .venv/bin/python bench/bench_llm_routing.py --quick    # about 3 minutes, a smoke run

Herding across PoPs is ``bench_herding.py``.

Everything runs on 127.0.0.1: three fake regions (``python -m edgeproxy.testing``, each
its own process, modelling an LLM server: a FIFO queue in front of ``--max-running``
slots and an LRU prefix (KV) cache of 16-token blocks whose hits shorten the time to
first token; a request's answer is cached after its prompt, as vLLM and SGLang keep
generated tokens), ``edgeproxy serve`` with a real config file, and one driver process.

The workload: ``--users`` simulated users with 5 to 10 turns each. A conversation
starts with one of 4 shared system prompts of about 400 tokens, then a first user
message of 150-300 tokens and 30-100 tokens per later turn; each answer is streamed,
60-160 words long (about 100-300 tokens as the fake's KV model counts them: its words
are 1-2 tokens), and sent back as the ``assistant`` message of the next turn, so each
prompt is the previous turn's prompt, its answer and a new message. Users start at
random over the first ``--ramp`` seconds and send their next turn a think time (3-9 s)
after the previous answer ended. Regions: TTFT 20 ms + 0.2 ms per uncached prompt
token + 0.02 ms per cached one (plus any wait for a slot), tokens 20 ms apart.

The same workload (same seed) runs through three policies, one after the other, each
against cold caches and zeroed counters:

* ``round-robin``: a 20-line plugin (``edgeproxy_route`` hook) that rotates the
  candidates in config order;
* ``p2c``: today's default, with no routing keys set (geo prior, peak-EWMA, power of
  two choices);
* ``affinity+load``: prefix affinity and the regions' own load reports on (its keys
  are read from docs/configuration.md; when they are not there yet the policy is
  reported as skipped).

Each region's KV cache holds ``--kv-share`` of the workload's KV working set (every
distinct block of every prompt and answer, computed from the fake's deterministic
answers before the run); ``--more-kv-shares`` runs p2c and affinity+load again with
other sizes. Reported per policy: client-side TTFT (request sent to first streamed
byte) p50 / p90 / p99, the KV hit rate (cached / prompt tokens, from the regions'
counters) against the best possible (every block that an earlier request of the
workload built), the load spread (max / mean over the regions of their time-averaged
requests in flight, sampled every 0.25 s, and of their request counts), and, from the
proxy's ``/status``, the share of requests placed by a prefix match and the share on
which the balance guard set affinity aside.

Printed, and written to ``bench/results/llm_routing.{md,json}`` and
``llm_routing_ttft.png`` (TTFT CDF per policy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script: make the helpers importable
    sys.path.insert(0, str(HERE))

import _llmrig as rigmod  # noqa: E402
import _report  # noqa: E402
import _util as u  # noqa: E402
from _llmrig import (  # noqa: E402
    CHAT_PATH,
    KV_BLOCK,
    REPO,
    Features,
    Gauge,
    RegionSpec,
    Result,
    Rig,
    gauge_stats,
    ms,
    ratio,
    sample_regions,
    spread,
    stream_chat,
    toml_value,
)

from edgeproxy.testing import answer_text  # noqa: E402
from edgeproxy.testing._kv import read_prompt  # noqa: E402

POLICIES = ("round-robin", "p2c", "affinity+load")
SYSTEM_PROMPTS = 4
SYSTEM_TOKENS = 400
ANSWER_WORDS = (60, 160)
THINK = (3.0, 9.0)

ROUND_ROBIN_PLUGIN = '''
"""Round-robin over the candidates, in config order (the benchmark's baseline)."""
import itertools

from edgeproxy import hookimpl

_order = {}
_turn = itertools.count()


@hookimpl
def edgeproxy_startup(proxy):
    _order.update((region.name, i) for i, region in enumerate(proxy.regions))


@hookimpl
def edgeproxy_route(candidates):
    ordered = sorted(candidates, key=lambda region: _order.get(region.name, 0))
    if not ordered:
        return None
    i = next(_turn) % len(ordered)
    return ordered[i:] + ordered[:i]
'''


# -- the workload ------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> str:
    """``n`` words of 3-4 letters: one KV token each for the fake region's tokeniser."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choices(letters, k=rng.choice((3, 4)))) for _ in range(n))


@dataclass
class User:
    index: int
    system: int
    start: float
    messages: list[str]
    answers: list[int]  # max_tokens of each turn's answer
    thinks: list[float]


def make_users(n: int, ramp: float, seed: int) -> tuple[list[str], list[User]]:
    rng = random.Random(seed)
    systems = [
        f"You are assistant persona {i}. " + _words(rng, SYSTEM_TOKENS)
        for i in range(SYSTEM_PROMPTS)
    ]
    users = []
    for i in range(n):
        turns = rng.randint(5, 10)
        messages = [_words(rng, rng.randint(150, 300))]
        messages += [_words(rng, rng.randint(30, 100)) for _ in range(turns - 1)]
        users.append(
            User(
                index=i,
                system=rng.randrange(SYSTEM_PROMPTS),
                start=rng.uniform(0.0, ramp),
                messages=messages,
                answers=[rng.randint(*ANSWER_WORDS) for _ in range(turns)],
                thinks=[rng.uniform(*THINK) for _ in range(turns)],
            )
        )
    return systems, users


@dataclass
class WorkingSet:
    """The workload as the regions will see it, computed before the run."""

    blocks: int  # distinct KV blocks of every prompt and answer
    prompt_tokens: int
    best_cached_tokens: int  # tokens in blocks an earlier request built (any order)
    answer_kv_tokens: int  # KV tokens of all answers
    # Modelled TTFTs (no queue, no proxy, caches never full) when every turn of a
    # conversation goes to the region of its first turn, and when each goes to a region
    # drawn at random: the bounds of what routing can change in this model.
    sticky_ttft: list[float] = field(default_factory=list)
    random_ttft: list[float] = field(default_factory=list)

    @property
    def best_hit_rate(self) -> float:
        return self.best_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def working_set(
    systems: list[str], users: list[User], cost: tuple[float, float, float], seed: int
) -> WorkingSet:
    """Every prompt of the workload as the fake region hashes it, with the answers the
    fake will give (they depend on the prompt only). ``cost``: the TTFT model, seconds
    (base, per uncached token, per cached token)."""
    base, per_uncached, per_cached = cost
    rng = random.Random(seed)
    seen: set[bytes] = set()
    ws = WorkingSet(0, 0, 0, 0)
    system_blocks = [
        read_prompt(
            {"messages": [{"role": "system", "content": text}]},
            chat=True,
            block_size=KV_BLOCK,
            hashed=True,
        ).blocks
        for text in systems
    ]
    for user in users:
        history = [{"role": "system", "content": systems[user.system]}]
        # Where each placement has the conversation cached (the system prompt is
        # everywhere once the run is warm).
        sticky = set(system_blocks[user.system])
        scattered = [set(system_blocks[user.system]) for _ in range(3)]
        for message, length in zip(user.messages, user.answers, strict=True):
            history.append({"role": "user", "content": message})
            request = {"messages": history, "max_tokens": length}
            p = read_prompt(request, chat=True, block_size=KV_BLOCK, hashed=True)
            eligible = p.blocks[: (p.tokens - 1) // KV_BLOCK]
            for cached_set, out in (
                (seen, None),
                (sticky, ws.sticky_ttft),
                (scattered[rng.randrange(3)], ws.random_ttft),
            ):
                matched = 0
                for block in eligible:
                    if block not in cached_set:
                        break
                    matched += 1
                cached = matched * KV_BLOCK
                if out is None:
                    ws.best_cached_tokens += cached
                else:
                    out.append(base + (p.tokens - cached) * per_uncached + cached * per_cached)
                cached_set.update(p.blocks)
            ws.prompt_tokens += p.tokens
            ws.answer_kv_tokens += p.answer_tokens
            text = answer_text(history, length)
            history = [*history, {"role": "assistant", "content": text}]
    ws.blocks = len(seen)
    return ws


# -- one run -------------------------------------------------------------------------


async def run_chat(
    rig: Rig, proxy: str, systems: list[str], users: list[User], cap: float
) -> tuple[list[Result], list[Gauge], float]:
    """Every user's conversation through ``proxy``; stops at ``cap`` seconds whatever."""
    port = rig.proxy_ports[proxy][0]
    url = f"http://127.0.0.1:{port}{CHAT_PATH}"
    loop = asyncio.get_running_loop()
    results: list[Result] = []
    gauges: list[Gauge] = []
    stop = asyncio.Event()
    start = loop.time() + 0.2
    deadline = start + cap

    async def converse(session: aiohttp.ClientSession, user: User) -> None:
        history: list[dict[str, str]] = [{"role": "system", "content": systems[user.system]}]
        await asyncio.sleep(max(0.0, start + user.start - loop.time()))
        for message, length, think in zip(user.messages, user.answers, user.thinks, strict=True):
            if loop.time() >= deadline:
                return
            history.append({"role": "user", "content": message})
            body = {
                "model": "fake-llm",
                "messages": history,
                "stream": True,
                "max_tokens": length,
                "temperature": 0.7,
                "user": f"user-{user.index}",
            }
            at = loop.time() - start
            result, answer = await stream_chat(session, url, body, loop)
            result.at = at
            results.append(result)
            history.append({"role": "assistant", "content": answer})
            await asyncio.sleep(think)

    sampler = asyncio.create_task(sample_regions(rig, 0.25, stop, start, gauges))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(converse(session, user)) for user in users]
        done, pending = await asyncio.wait(tasks, timeout=cap + 35)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    stop.set()
    await sampler
    return results, gauges, loop.time() - start


def affinity_stats(status: dict[str, Any]) -> dict[str, Any]:
    """Requests placed by a prefix match, and set aside by the balance guard, from /status."""
    regions = status.get("regions") or []
    requests = hits = balanced = 0
    for region in regions if isinstance(regions, list) else []:
        a = region.get("affinity") or {}
        requests += a.get("requests_total", 0)
        hits += a.get("hits_total", 0)
        balanced += a.get("balanced_total", 0)
    return {
        "requests": requests,
        "by_affinity": hits / requests if requests else None,
        "balanced": balanced / requests if requests else None,
    }


def summarize_chat(
    results: list[Result], gauges: list[Gauge], counters: dict[str, Any], seconds: float
) -> dict[str, Any]:
    ok = [r.ttft for r in results if r.ttft is not None]
    at_region = [r.region_ttft for r in results if r.ttft is not None and r.region_ttft is not None]
    regions = sorted(counters)
    busy = gauge_stats(gauges, regions, 0.0, math.inf)
    prompt = sum(c["prompt_tokens_total"] for c in counters.values())
    cached = sum(c["cached_tokens_total"] for c in counters.values())
    requests = {name: counters[name]["requests_by_path"].get(CHAT_PATH, 0) for name in regions}
    return {
        "requests": len(results),
        "errors": sum(1 for r in results if r.ttft is None),
        "statuses": dict(Counter(str(r.status) for r in results if r.status != 200)),
        "seconds": round(seconds, 1),
        "rate": len(results) / seconds if seconds else None,
        "ttft_p50_ms": ms(ok, 50),
        "ttft_p90_ms": ms(ok, 90),
        "ttft_p99_ms": ms(ok, 99),
        "region_ttft_p50_ms": ms(at_region, 50),
        "region_ttft_p90_ms": ms(at_region, 90),
        "region_ttft_p99_ms": ms(at_region, 99),
        "kv_hit_rate": cached / prompt if prompt else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "region_requests": requests,
        "region_hit_rate": {n: counters[n]["kv_hit_rate"] for n in regions},
        "region_evicted_blocks": {n: counters[n]["kv_evicted_blocks_total"] for n in regions},
        "region_busy": busy,
        "spread_in_flight": spread([busy[n]["mean_in_flight"] for n in regions]),
        "spread_requests": spread([float(v) for v in requests.values()]),
        "mean_waiting": sum(b["mean_waiting"] for b in busy.values()),
        "ttft_ms": sorted(round(t * 1000, 2) for t in ok),
    }


# -- report --------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def markdown(data: dict[str, Any]) -> str:
    num = _report._num
    meta = data["meta"]
    chat = data["chat"]
    w = chat["workload"]
    lines = ["# LLM-aware routing benchmark: multi-turn chat", ""]
    lines.append(
        f"{meta['when']}, commit {meta['commit']}, {meta['cpus']} CPUs; run took "
        f"{meta['elapsed_s']} s. Everything on 127.0.0.1: three fake regions modelling an LLM "
        "server (FIFO queue, LRU prefix cache of prompts and answers), `edgeproxy serve`, one "
        "driver."
    )
    lines += ["", "## Targets", ""]
    rows = [[t["metric"], num(t["value"]), t["target"], _verdict(t)] for t in data["targets"]]
    lines += _report._table(["metric", "measured", "target", "result"], rows) + [""]
    for note in data["skipped"]:
        lines.append(f"- skipped: {note}")
    if data["skipped"]:
        lines.append("")
    lines += [
        "## Workload",
        "",
        f"{w['users']} users, {w['turns']} turns in all (5-10 each), {SYSTEM_PROMPTS} system "
        f"prompts of ~{SYSTEM_TOKENS} tokens, first messages of 150-300 tokens, later ones "
        f"30-100; answers of {ANSWER_WORDS[0]}-{ANSWER_WORDS[1]} words "
        f"({w['answer_kv_tokens_mean']:.0f} KV tokens on average), streamed "
        f"{w['inter_token_ms']:g} ms a word and sent back in the next turn; users start over "
        f"{w['ramp']:g} s and think {THINK[0]:g}-{THINK[1]:g} s between turns. Three identical "
        f"regions: TTFT {w['ttft_ms']:g} ms + {w['per_uncached_ms']:g} ms per uncached prompt "
        f"token + {w['per_cached_ms']:g} ms per cached one, {w['max_running']} running at once "
        f"(FIFO queue behind), KV blocks of {KV_BLOCK} tokens; the workload builds "
        f"{w['working_set_blocks']:,} distinct blocks, and at best (every block an earlier "
        f"request built still cached where it is asked for) {w['best_hit_rate']:.1%} of the "
        "prompt tokens are cached. The TTFT model alone (no queue, no proxy, caches never "
        "full) gives a p50 of "
        f"{w['model_sticky_p50_ms']:.0f} ms (p90 {w['model_sticky_p90_ms']:.0f} ms) when every "
        "turn goes where its conversation started, and "
        f"{w['model_random_p50_ms']:.0f} ms (p90 {w['model_random_p90_ms']:.0f} ms) when each "
        "turn goes to a region drawn at random: a p50 cut of "
        f"{w['model_random_p50_ms'] / w['model_sticky_p50_ms']:.2f}x between the two: what "
        "keeping conversations in place is worth in this model while no cache is full. "
        "Policies run one after the other on the same workload, "
        "each from cold caches. TTFT: request sent to first streamed byte, at the client; at "
        "the region: its queue wait plus its modelled TTFT, as its headers say (free of the "
        "CPU time of the client and the proxy on a shared machine). "
        "Spread: max / mean over the regions (1.0 is even, 3.0 all on one).",
        "",
    ]
    header = [
        "KV cache per region", "policy", "requests", "errors", "TTFT p50 ms", "p90 ms",
        "p99 ms", "at the region p50 / p90 / p99 ms", "KV hit rate", "by affinity / balanced",
        "spread in flight", "spread requests", "requests per region",
    ]  # fmt: skip
    rows = []
    for share, by_policy in chat["runs"].items():
        for name, s in by_policy.items():
            a = s.get("affinity") or {}
            rows.append(
                [
                    f"{float(share):.0%} ({s['kv_blocks']:,} blocks)",
                    name,
                    num(s["requests"]),
                    num(s["errors"]),
                    num(s["ttft_p50_ms"], 1),
                    num(s["ttft_p90_ms"], 1),
                    num(s["ttft_p99_ms"], 1),
                    f"{num(s['region_ttft_p50_ms'], 1)} / {num(s['region_ttft_p90_ms'], 1)} / "
                    f"{num(s['region_ttft_p99_ms'], 1)}",
                    _pct(s["kv_hit_rate"]),
                    f"{_pct(a.get('by_affinity'))} / {_pct(a.get('balanced'))}" if a else "-",
                    num(s["spread_in_flight"], 2),
                    num(s["spread_requests"], 2),
                    " / ".join(str(v) for v in s["region_requests"].values()),
                ]
            )
        p2c, new = by_policy.get("p2c"), by_policy.get("affinity+load")
        cut = ratio(p2c and p2c["ttft_p50_ms"], new and new["ttft_p50_ms"])
        if cut is not None:
            rows[-1][0] += f", p50 cut {cut:.2f}x"
    lines += _report._table(header, rows) + [""]
    used = data["features"]
    keys = [f"`routing.{k} = {toml_value(v)}`" for k, v in used["routing"].items()]
    keys += [f"`regions.{k} = {toml_value(v)}`" for k, v in used["region"].items()]
    lines += [f"affinity+load config: {', '.join(keys)}; p2c: no routing keys set.", ""]
    return "\n".join(lines)


def _verdict(target: dict[str, Any]) -> str:
    if target.get("skipped"):
        return "skipped"
    if target["pass"] is None:
        return "info"
    return "pass" if target["pass"] else "**MISS**"


def plots(data: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    meta = data["meta"]
    runs = data["chat"]["runs"]
    if not runs:
        return []
    fig, ax = plt.subplots(figsize=(9, 5))
    for share, by_policy in runs.items():
        for name, s in by_policy.items():
            values = s.get("ttft_ms") or []
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                label = f"{name}, KV {float(share):.0%} (p50 {s['ttft_p50_ms']:.0f} ms)"
                ax.plot(values, ys, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("client-side TTFT, ms (log)")
    ax.set_ylabel("share of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(
        f"TTFT CDF, multi-turn chat through edgeproxy ({meta['when']}, {meta['commit']})",
        fontsize=10,
    )
    fig.tight_layout()
    path = out / "llm_routing_ttft.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# -- the run -------------------------------------------------------------------------


def chat_part(
    args: argparse.Namespace, rig: Rig, features: Features, skipped: list[str]
) -> dict[str, Any]:
    systems, users = make_users(args.users, args.ramp, args.seed)
    cost = (args.ttft_ms / 1000, args.per_uncached_ms / 1000, args.per_cached_ms / 1000)
    ws = working_set(systems, users, cost, args.seed)
    sticky, scattered = sorted(ws.sticky_ttft), sorted(ws.random_ttft)
    turns = sum(len(x.messages) for x in users)
    workload = {
        "users": len(users),
        "turns": turns,
        "ramp": args.ramp,
        "cap_s": args.cap,
        "seed": args.seed,
        "ttft_ms": args.ttft_ms,
        "per_uncached_ms": args.per_uncached_ms,
        "per_cached_ms": args.per_cached_ms,
        "inter_token_ms": args.inter_token_ms,
        "max_running": args.max_running,
        "working_set_blocks": ws.blocks,
        "best_hit_rate": ws.best_hit_rate,
        "answer_kv_tokens_mean": ws.answer_kv_tokens / turns if turns else 0.0,
        "model_sticky_p50_ms": u.percentile(sticky, 50) * 1000,
        "model_sticky_p90_ms": u.percentile(sticky, 90) * 1000,
        "model_random_p50_ms": u.percentile(scattered, 50) * 1000,
        "model_random_p90_ms": u.percentile(scattered, 90) * 1000,
    }
    print(
        f"chat: {len(users)} users, {turns} turns, working set {ws.blocks} blocks, "
        f"best hit rate {ws.best_hit_rate:.1%}; modelled TTFT p50 sticky "
        f"{workload['model_sticky_p50_ms']:.0f} ms, "
        f"random {workload['model_random_p50_ms']:.0f} ms",
        flush=True,
    )
    plan = [(args.kv_share, list(args.policies))]
    plan += [
        (share, [p for p in args.policies if p != "round-robin"]) for share in args.more_kv_shares
    ]
    runs: dict[str, Any] = {}
    for share, policies in plan:
        kv_blocks = max(64, round(ws.blocks * share))
        print(f"  KV cache: {kv_blocks} blocks per region ({share:.0%} of the working set)")
        for i in range(3):
            rig.start_region(
                RegionSpec(
                    name=f"region-{i + 1}",
                    ttft=args.ttft_ms / 1000,
                    per_uncached=args.per_uncached_ms / 1000,
                    per_cached=args.per_cached_ms / 1000,
                    kv_blocks=kv_blocks,
                    max_running=args.max_running,
                    inter_token=args.inter_token_ms / 1000,
                )
            )
        results = runs.setdefault(f"{share:g}", {})
        for policy in policies:
            options: dict[str, Any] = {}
            if policy == "round-robin":
                options["plugin"] = ROUND_ROBIN_PLUGIN
            elif policy == "affinity+load":
                if features.affinity_missing:
                    note = f"policy affinity+load: {features.affinity_missing}"
                    print(f"  skipped: {note}", flush=True)
                    if note not in skipped:
                        skipped.append(note)
                    continue
                options["routing"] = features.routing
                options["region_keys"] = features.region
            rig.reset_regions()
            rig.start_proxy(policy, **options)
            try:
                began = time.monotonic()
                res, gauges, seconds = asyncio.run(run_chat(rig, policy, systems, users, args.cap))
                counters = rig.counters()
                status = rig.proxy_status(policy)
            finally:
                rig.stop_proxies()
            summary = summarize_chat(res, gauges, counters, seconds)
            summary["kv_share"], summary["kv_blocks"] = share, kv_blocks
            if policy == "affinity+load":
                summary["affinity"] = affinity_stats(status)
            results[policy] = summary
            a = summary.get("affinity") or {}
            print(
                f"  {policy:<14} {summary['requests']} requests, {summary['errors']} errors, "
                f"TTFT p50 {_report._num(summary['ttft_p50_ms'], 1)} ms p99 "
                f"{_report._num(summary['ttft_p99_ms'], 1)} ms (at the region p50 "
                f"{_report._num(summary['region_ttft_p50_ms'], 1)}), KV hit "
                f"{summary['kv_hit_rate'] or 0:.1%}, spread "
                f"{_report._num(summary['spread_in_flight'])}, by affinity "
                f"{_pct(a.get('by_affinity'))}, balanced {_pct(a.get('balanced'))} "
                f"({time.monotonic() - began:.0f} s)",
                flush=True,
            )
        rig.stop_regions()
    return {"workload": workload, "runs": runs}


def targets(data: dict[str, Any], share: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pol = data["chat"]["runs"].get(share, {})
    p2c, new = pol.get("p2c"), pol.get("affinity+load")
    metrics = (
        ("TTFT p50 cut, p2c / affinity+load (x)", ">= 2"),
        ("load spread, affinity+load / p2c (in flight)", "<= 1.5"),
    )
    if p2c and new:
        cut = ratio(p2c["ttft_p50_ms"], new["ttft_p50_ms"])
        worse = ratio(new["spread_in_flight"], p2c["spread_in_flight"])
        out.append({"metric": metrics[0][0], "value": cut, "target": metrics[0][1],
                    "pass": (cut or 0) >= 2})  # fmt: skip
        out.append({"metric": metrics[1][0], "value": worse, "target": metrics[1][1],
                    "pass": worse is not None and worse <= 1.5})  # fmt: skip
        at_region = ratio(p2c["region_ttft_p50_ms"], new["region_ttft_p50_ms"])
        out.append({"metric": "(the same cut, TTFT at the region)", "value": at_region,
                    "target": "-", "pass": None})  # fmt: skip
    else:
        for metric, target in metrics:
            out.append({"metric": metric, "value": None, "target": target, "pass": False,
                        "skipped": True})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller and shorter: a smoke run")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--users", type=int, default=240)
    parser.add_argument("--ramp", type=float, default=20.0, help="seconds over which users start")
    parser.add_argument(
        "--cap", type=float, default=100.0, help="seconds of load per policy, at most"
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--kv-share",
        type=float,
        default=0.33,
        help="each region's KV capacity, as a share of the working set (a third: the three "
        "caches together hold it)",
    )
    parser.add_argument(
        "--more-kv-shares",
        type=float,
        nargs="*",
        default=[0.2],
        help="other KV capacities to run p2c and affinity+load again with",
    )
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--per-uncached-ms", type=float, default=0.2)
    parser.add_argument("--per-cached-ms", type=float, default=0.02)
    parser.add_argument("--inter-token-ms", type=float, default=20.0)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.users, args.ramp, args.cap = 120, 10.0, 45.0
        args.more_kv_shares = []
    args.out.mkdir(parents=True, exist_ok=True)
    features = rigmod.detect_features(rigmod.documented_keys())
    skipped: list[str] = []
    began = time.monotonic()
    data: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-llm-routing-") as tmp:
        rig = Rig(Path(tmp))
        try:
            data["chat"] = chat_part(args, rig, features, skipped)
        finally:
            rig.stop()
    data["features"] = features.describe()
    data["skipped"] = skipped
    data["meta"] = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "commit": u.tool_version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
        "cpus": len(os.sched_getaffinity(0)),
        "elapsed_s": round(time.monotonic() - began, 1),
        "quick": args.quick,
    }
    data["targets"] = targets(data, f"{args.kv_share:g}")
    (args.out / "llm_routing.json").write_text(json.dumps(data, indent=1, default=str))
    report = markdown(data)
    (args.out / "llm_routing.md").write_text(report)
    pngs = plots(data, args.out)
    print()
    print(report)
    print(
        f"written: {args.out / 'llm_routing.md'}, llm_routing.json"
        + "".join(f", {p.name}" for p in pngs)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
