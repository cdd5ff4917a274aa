"""Prompt-cache affinity: the share of input tokens the regions read from their prompt caches.

    .venv/bin/python bench/prompt_cache.py            # about 50 seconds
    .venv/bin/python bench/prompt_cache.py --quick    # about 15 seconds

Everything runs in this process, on 127.0.0.1: three fake regions (``FakeRegion``, each an
LLM server with an LRU prefix (KV) cache of 16-token blocks, which reports the prompt tokens
it found cached in each API's usage) behind one ``EdgeProxy``. Each config gets fresh
regions and a fresh proxy:

* ``prompt-cache``: ``prefix_affinity = true`` with ``prompt_cache_affinity`` (its default)
  and the default ``rank``: a request stating its cache intent (``prompt_cache_key``,
  ``cache_control``) is keyed by it, any other chat request by its prompt's blocks;
* ``prefix``: ``prefix_affinity = true``, ``prompt_cache_affinity = false``: chat requests by
  their prompt's blocks only; Messages requests have no prompt key;
* ``none``: ``prefix_affinity = false``, ``rank = ["reported_load", "latency"]``.

The workload (the same, seed ``--seed``, for each config): ``--clients`` clients, each with
its own system prompt of ``--system-tokens`` tokens, hold a conversation of ``--turns``
turns, each turn the whole conversation so far, the answers sent back, and a new question
of 20-60 tokens (answers of 16-48 tokens). A third of the clients send chat completions
with a ``prompt_cache_key`` of their own, a third plain chat completions, a third
Anthropic Messages with ``cache_control`` on their system prompt and on their newest
message (the breakpoint moves to the last turn, as Anthropic advises). Half the requests
stream. Clients start at random over ``--ramp`` seconds and think 0.1-0.5 s between turns,
so their requests interleave. The conversations are computed before the run (the fake's
answers depend on the prompt alone), and each answer is checked against them.

Each region's KV cache holds ``--kv-share`` of the workload's working set (every distinct
block of every prompt and answer): the conversations fit when each stays on one region,
not when every region holds them all. Reported per config: the share of the prompt tokens
read from a cache (cached over prompt tokens) from the usage the clients got (each API's
own fields, through the proxy), overall and per kind of client, and its ratio to ``none``;
the same share from the proxy's ``/status`` (each region's ``prompt_cache``) and its
``edgeproxy_tokens_total`` (``cached_prompt`` over ``prompt``), from the regions' own KV
counters, and the best any routing could do here (one region with an unbounded cache);
the clients whose every turn went to one region (per kind in the JSON); the load spread
(max over mean of the regions' request counts); the mean modelled time to first token
(5 ms + 0.05 ms per uncached and 0.005 ms per cached prompt token).

Printed, and written to ``bench/results/prompt_cache.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
if str(REPO) not in sys.path:  # run as a script: import the checkout's edgeproxy
    sys.path.insert(0, str(REPO))

from edgeproxy import Config, EdgeProxy  # noqa: E402
from edgeproxy.testing import Behavior, FakeRegion, answer_text  # noqa: E402
from edgeproxy.testing import _content as content  # noqa: E402
from edgeproxy.testing._kv import read_prompt  # noqa: E402
from edgeproxy.testing._messages import _conversation  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "prompt-cache": {"prefix_affinity": True, "prompt_cache_affinity": True},
    "prefix": {"prefix_affinity": True, "prompt_cache_affinity": False},
    "none": {"prefix_affinity": False, "rank": ["reported_load", "latency"]},
}
KINDS = ("chat+key", "chat", "messages")
REGIONS = ("r1", "r2", "r3")
BLOCK = 16
TOKENS = 64  # the regions' answer length; every request asks for fewer
BEHAVIOR = {
    "ttft": 0.005,
    "ttft_per_uncached_token": 0.00005,
    "ttft_per_cached_token": 0.000005,
    "inter_token_delay": 0.0,
    "tokens": TOKENS,
}
CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"


# -- the workload ----------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> str:
    """``n`` words of 3-4 letters: one token each to the KV model and to the chat usage."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choices(letters, k=rng.choice((3, 4)))) for _ in range(n))


@dataclass
class Turn:
    path: str
    body: dict[str, Any]
    answer: str
    kv_tokens: int  # the prompt's tokens to the KV model
    blocks: tuple[bytes, ...]  # its blocks, then the answer's (as the region caches them)
    stream: bool = False


@dataclass
class Client:
    index: int
    kind: str
    start: float
    turns: list[Turn]
    thinks: list[float]


def _messages_turn(system: str, history: list[dict[str, Any]], question: str, limit: int) -> Turn:
    mark = {"type": "ephemeral"}
    newest = {
        "role": "user",
        "content": [{"type": "text", "text": question, "cache_control": mark}],
    }
    body = {
        "model": "claude-bench",
        "max_tokens": limit,
        "system": [{"type": "text", "text": system, "cache_control": mark}],
        "messages": [*history, newest],
    }
    convo = _conversation(body)
    answer = "".join(list(content.tokens(content.digest(convo), TOKENS))[:limit])
    seen = read_prompt(
        {"messages": convo, "max_tokens": limit}, chat=True, block_size=BLOCK, hashed=True
    )
    return Turn(MESSAGES, body, answer, seen.tokens, seen.blocks)


def _chat_turn(messages: list[dict[str, Any]], limit: int, key: str | None) -> Turn:
    body: dict[str, Any] = {"model": "bench-llm", "max_tokens": limit, "messages": messages}
    if key is not None:
        body["prompt_cache_key"] = key
    seen = read_prompt(body, chat=True, block_size=BLOCK, hashed=True)
    return Turn(CHAT, body, answer_text(messages, limit), seen.tokens, seen.blocks)


def make_clients(args: argparse.Namespace) -> list[Client]:
    rng = random.Random(args.seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(args.clients)]
    rng.shuffle(kinds)
    clients = []
    for index, kind in enumerate(kinds):
        system = f"You are the assistant of client {index}. " + _words(rng, args.system_tokens)
        history: list[dict[str, Any]] = []
        turns = []
        for _ in range(args.turns):
            question = _words(rng, rng.randint(20, 60))
            limit = rng.randint(16, 48)
            if kind == "messages":
                turn = _messages_turn(system, history, question, limit)
            else:
                messages = [{"role": "system", "content": system}, *history]
                messages.append({"role": "user", "content": question})
                key = f"client-{index}" if kind == "chat+key" else None
                turn = _chat_turn(messages, limit, key)
            turn.stream = rng.random() < 0.5
            turns.append(turn)
            history += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": turn.answer},
            ]
        thinks = [rng.uniform(0.1, 0.5) for _ in turns]
        clients.append(Client(index, kind, rng.uniform(0.0, args.ramp), turns, thinks))
    return clients


@dataclass
class WorkingSet:
    blocks: int  # distinct KV blocks of every prompt and answer
    prompt_tokens: int
    best_cached_tokens: int  # one region, an unbounded cache: every block built before

    @property
    def best_share(self) -> float:
        return self.best_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def working_set(clients: list[Client]) -> WorkingSet:
    seen: set[bytes] = set()
    prompt = best = 0
    for client in clients:  # no two clients share a block: their order does not matter
        for turn in client.turns:
            eligible = (turn.kv_tokens - 1) // BLOCK
            hit = 0
            for block in turn.blocks[:eligible]:
                if block not in seen:
                    break
                hit += 1
            seen.update(turn.blocks)
            prompt += turn.kv_tokens
            best += hit * BLOCK
    return WorkingSet(len(seen), prompt, best)


# -- one config ------------------------------------------------------------------------


@dataclass
class Sent:
    kind: str
    client: int
    stream: bool
    status: int
    region: str
    prompt: int = 0  # from the usage the client got
    cached: int = 0
    written: int = 0
    right: bool = False  # the answer the conversation expects


def _usage_of(turn: Turn, raw: bytes, stream: bool) -> tuple[dict[str, Any] | None, str]:
    """The answer's usage and text, in its API's shape."""
    if not stream:
        data = json.loads(raw)
        if turn.path == CHAT:
            return data.get("usage"), data["choices"][0]["message"]["content"]
        return data.get("usage"), "".join(b.get("text", "") for b in data["content"])
    usage: dict[str, Any] | None = None
    text: list[str] = []
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if turn.path == CHAT:
            usage = event.get("usage") or usage
            for choice in event.get("choices") or ():
                text.append(choice.get("delta", {}).get("content") or "")
        elif event.get("type") == "message_start":
            usage = event["message"]["usage"]
        elif event.get("type") == "content_block_delta":
            text.append(event["delta"].get("text", ""))
    return usage, "".join(text)


async def send(session: aiohttp.ClientSession, url: str, client: Client, turn: Turn) -> Sent:
    stream = turn.stream
    body = dict(turn.body)
    if stream:
        body["stream"] = True
        if turn.path == CHAT:
            body["stream_options"] = {"include_usage": True}
    sent = Sent(client.kind, client.index, stream, 0, "")
    try:
        async with session.post(url + turn.path, json=body) as resp:
            sent.status = resp.status
            sent.region = resp.headers.get("x-fake-region", "")
            raw = await resp.read()
        if sent.status != 200:
            return sent
        usage, text = _usage_of(turn, raw, stream)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError):
        return sent
    sent.right = text == turn.answer
    if usage is None:
        return sent
    if turn.path == CHAT:
        sent.prompt = usage.get("prompt_tokens", 0)
        sent.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    else:
        sent.cached = usage.get("cache_read_input_tokens") or 0
        sent.written = usage.get("cache_creation_input_tokens") or 0
        sent.prompt = usage.get("input_tokens", 0) + sent.cached + sent.written
    return sent


async def converse(
    session: aiohttp.ClientSession, url: str, client: Client, out: list[Sent]
) -> None:
    await asyncio.sleep(client.start)
    for turn, think in zip(client.turns, client.thinks, strict=True):
        out.append(await send(session, url, client, turn))
        await asyncio.sleep(think)


def proxy_config(regions: list[FakeRegion], routing: dict[str, Any]) -> Config:
    data = {
        "server": {"host": "127.0.0.1", "port": 0, "grace_period": 2.0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "pop": {"name": "bench", "lat": 0.0, "lon": 0.0},
        "upstream": {"read_timeout": 30.0, "connect_timeout": 2.0},
        "cache": {"enabled": False},
        "plugins": {"entry_points": False},
        "routing": routing,
        "regions": [
            {"name": r.name, "url": r.url, "lat": 0.0, "lon": 0.0, "learn_models": False}
            for r in regions
        ],
    }
    return Config.from_mapping(data, environ={})


_TOKENS_LINE = re.compile(r"^edgeproxy_tokens_total\{([^}]*)\} (\S+)$", re.M)


def _metric_tokens(text: str) -> dict[str, float]:
    """``edgeproxy_tokens_total`` summed by kind."""
    out: dict[str, float] = defaultdict(float)
    for labels, value in _TOKENS_LINE.findall(text):
        kind = re.search(r'kind="([^"]*)"', labels)
        if kind is not None:
            out[kind.group(1)] += float(value)
    return dict(out)


def _share(cached: float, prompt: float) -> float | None:
    return cached / prompt if prompt else None


async def run_config(name: str, clients: list[Client], capacity: int, seed: int) -> dict[str, Any]:
    regions = [
        FakeRegion(
            name=r,
            behavior=Behavior(**BEHAVIOR),
            kv_capacity_blocks=capacity,
            kv_block_size=BLOCK,
            seed=seed,
        )
        for r in REGIONS
    ]
    for region in regions:
        await region.start()
    proxy = EdgeProxy(proxy_config(regions, CONFIGS[name]))
    await proxy.start()
    out: list[Sent] = []
    started = time.monotonic()
    try:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(converse(session, proxy.url, c, out) for c in clients))
            async with session.get(proxy.admin_url + "/status") as resp:
                status = await resp.json()
            async with session.get(proxy.admin_url + "/metrics") as resp:
                tokens = _metric_tokens(await resp.text())
        seconds = time.monotonic() - started
        counters = {region.name: region.counters() for region in regions}
    finally:
        await proxy.stop(grace=2.0)
        for region in regions:
            await region.stop()
    return summarize(name, out, status, tokens, counters, seconds)


def summarize(
    name: str,
    out: list[Sent],
    status: dict[str, Any],
    tokens: dict[str, float],
    counters: dict[str, Any],
    seconds: float,
) -> dict[str, Any]:
    ok = [s for s in out if s.status == 200]
    by_kind = {
        kind: _share(
            sum(s.cached for s in ok if s.kind == kind), sum(s.prompt for s in ok if s.kind == kind)
        )
        for kind in KINDS
    }
    regions_of: dict[int, set[str]] = defaultdict(set)
    kind_of: dict[int, str] = {}
    for s in ok:
        regions_of[s.client].add(s.region)
        kind_of[s.client] = s.kind
    per_region = Counter(s.region for s in ok)
    counts = [per_region.get(r, 0) for r in REGIONS]
    mean = sum(counts) / len(counts)
    prompt_cache = [r.get("prompt_cache") or {} for r in status.get("regions", [])]
    kv_prompt = sum(c.prompt_tokens_total for c in counters.values())
    kv_cached = sum(c.cached_tokens_total for c in counters.values())
    llm_requests = sum(c.requests_total for c in counters.values())
    return {
        "config": name,
        "routing": CONFIGS[name],
        "seconds": round(seconds, 1),
        "requests": len(out),
        "errors": len(out) - len(ok),
        "wrong_answers": sum(not s.right for s in ok),
        "prompt_tokens": sum(s.prompt for s in ok),
        "cached_tokens": sum(s.cached for s in ok),
        "cache_write_tokens": sum(s.written for s in ok),
        "share": _share(sum(s.cached for s in ok), sum(s.prompt for s in ok)),
        "share_by_kind": by_kind,
        "status_share": _share(
            sum(p.get("cached_tokens_total", 0) for p in prompt_cache),
            sum(p.get("prompt_tokens_total", 0) for p in prompt_cache),
        ),
        "metrics_share": _share(tokens.get("cached_prompt", 0.0), tokens.get("prompt", 0.0)),
        "region_share": _share(kv_cached, kv_prompt),
        "sticky_clients": sum(len(v) == 1 for v in regions_of.values()) / len(regions_of)
        if regions_of
        else None,
        "sticky_by_kind": {
            kind: _share(
                sum(len(v) == 1 for c, v in regions_of.items() if kind_of[c] == kind),
                sum(kind_of[c] == kind for c in regions_of),
            )
            for kind in KINDS
        },
        "requests_per_region": dict(zip(REGIONS, counts, strict=True)),
        "load_spread": max(counts) / mean if mean else None,
        "modelled_ttft_ms": sum(c.modelled_ttft_seconds_total for c in counters.values())
        / llm_requests
        * 1000
        if llm_requests
        else None,
        "evicted_blocks": sum(c.kv_evicted_blocks_total for c in counters.values()),
    }


# -- the report ------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _x(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def markdown(data: dict[str, Any]) -> str:
    rows = data["rows"]
    none = next((r for r in rows if r["config"] == "none"), None)
    base = none["share"] if none else None
    ws = data["working_set"]
    settings = data["settings"]
    lines = [
        "# Prompt-cache affinity: the share of input tokens read from a cache",
        "",
        f"{settings['clients']} clients x {settings['turns']} turns (a third each "
        f"{', '.join(KINDS)}), system prompts of {settings['system_tokens']} tokens, 3 "
        f"regions with a KV cache of {data['capacity_blocks']:,} blocks each "
        f"({settings['kv_share']:.0%} of the working set of {ws['blocks']:,} blocks). "
        f"Best possible (one region, an unbounded cache): {_pct(ws['best_share'])}.",
        "",
        "| config | cached share (client usage) | x none | chat+key | chat | messages "
        "| /status | metrics | regions' KV | sticky clients | load spread "
        "| modelled TTFT ms | errors |",
        "|" + " --- |" * 13,
    ]
    for r in rows:
        kinds = r["share_by_kind"]
        ttft = r["modelled_ttft_ms"]
        lines.append(
            f"| {r['config']} | {_pct(r['share'])} | {_x(r['share'], base)} "
            f"| {_pct(kinds['chat+key'])} | {_pct(kinds['chat'])} | {_pct(kinds['messages'])} "
            f"| {_pct(r['status_share'])} | {_pct(r['metrics_share'])} "
            f"| {_pct(r['region_share'])} | {_pct(r['sticky_clients'])} "
            f"| {r['load_spread']:.2f} | {'-' if ttft is None else f'{ttft:.1f}'} "
            f"| {r['errors']} |"
        )
    wrong = sum(r["wrong_answers"] for r in rows)
    lines += [
        "",
        "Cached share: cached over prompt tokens, each API's usage as the clients got it "
        "through the proxy (chat's `prompt_tokens_details.cached_tokens`, Messages' "
        "`cache_read_input_tokens` over input, read and written). `/status`: the regions' "
        "`prompt_cache` totals; metrics: `edgeproxy_tokens_total` cached_prompt over prompt; "
        "regions' KV: the fake regions' own counters (the KV model's tokens). Sticky clients: "
        "those whose every turn went to one region. Load spread: max over mean of the "
        "regions' request counts.",
        "",
        f"Answers checked against the conversations: {wrong} wrong. "
        f"{data['when']}, {data['commit']}, {data['seconds']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def chart(data: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = data["rows"]
    groups = ["all", *KINDS]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        values = [r["share"], *(r["share_by_kind"][k] for k in KINDS)]
        xs = [g + (i - (len(rows) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, [(v or 0) * 100 for v in values], width, label=r["config"])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    best = data["working_set"]["best_share"] * 100
    ax.axhline(best, color="grey", ls="--", lw=0.9, label=f"best possible ({best:.0f}%)")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("prompt tokens read from a cache (%)")
    ax.set_ylim(0, 112)
    ax.legend(fontsize=8, loc="upper center", ncol=4)
    ax.set_title(
        f"Prompt-cache affinity: {data['settings']['clients']} clients, 3 regions "
        f"({data['when']}, {data['commit']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return "?"
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return (out.stdout.strip() or "?") + (" + local changes" if dirty else "")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    clients = make_clients(args)
    ws = working_set(clients)
    capacity = max(1, round(ws.blocks * args.kv_share))
    rows = []
    for name in args.configs:
        row = await run_config(name, clients, capacity, args.seed)
        print(
            f"{name}: {row['requests']} requests in {row['seconds']} s, "
            f"cached share {_pct(row['share'])}",
            flush=True,
        )
        rows.append(row)
    return {
        "settings": {k: v for k, v in vars(args).items()},
        "working_set": asdict(ws) | {"best_share": ws.best_share},
        "capacity_blocks": capacity,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run (about 15 seconds)")
    for flag, kind, default, text in (
        ("--clients", int, None, "clients (240; quick 45)"),
        ("--turns", int, None, "turns per client (10; quick 5)"),
        ("--system-tokens", int, 600, "tokens of each client's system prompt (600)"),
        ("--ramp", float, None, "seconds over which clients start (10; quick 2)"),
        ("--kv-share", float, 0.5, "each region's KV cache, share of the working set (0.5)"),
        ("--seed", int, 7, "the workload's seed (7)"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    args = parser.parse_args(argv)
    for name, full, short in (("clients", 240, 45), ("turns", 10, 5), ("ramp", 10.0, 2.0)):
        if getattr(args, name) is None:
            setattr(args, name, short if args.quick else full)
    if args.clients < 1 or args.turns < 1 or not 0 < args.kv_share:
        parser.error("--clients and --turns must be at least 1, --kv-share above 0")
    started = time.monotonic()
    data = asyncio.run(run(args))
    data["seconds"] = round(time.monotonic() - started, 1)
    data["when"] = time.strftime("%Y-%m-%d %H:%M")
    data["commit"] = _commit()
    text = markdown(data)
    print("\n" + text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prompt_cache.md").write_text(text)
    (RESULTS / "prompt_cache.json").write_text(json.dumps(data, indent=2) + "\n")
    png = chart(data, RESULTS / "prompt_cache.png")
    print(f"written: {RESULTS / 'prompt_cache.md'}, .json" + (", .png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
