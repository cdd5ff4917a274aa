"""The cost of translation per streamed event, counted by callgrind, beside the native
streams in one run.

A client's Anthropic Messages stream (``POST /v1/messages``) reaches it in two ways:

* **native**: the region speaks Messages, and the proxy relays its stream as it came
  (``messages native``);
* **translated**: the region speaks chat completions only (``[[regions]] apis =
  ["chat"]``), and the proxy sends it the request as a chat completion, reads each chat
  chunk once and writes it as the Messages API's events (``messages translated``).

The same for a Responses stream (``responses native``, ``responses translated``, the
request with ``store: false``), and the chat stream relayed as it is (``chat native``):
what the translated region sends, untranslated. Both answers carry the same ``--events``
tokens (`` tok000000``...), so the rows differ only in how the proxy handles them.

Each proxy is one process under ``valgrind --tool=callgrind`` (as in ``bench/instr.py``,
whose machinery this uses: its warm-up uninstrumented, then ``--sse-count`` streamed
requests counted, the total divided by the requests and by the SSE events the client
saw). The upstream is nginx with the canned streams of ``instr.py`` when nginx is
installed (Messages and Responses events padded to one write each, the chat stream
paced to one event per write), else the fake region of ``edgeproxy.testing``.

The table: instructions per request and per event the client saw, ``x native`` (the
translated row over the native row of its API), and ``extra per event`` (the translated
request's instructions less the native one's, over the events of the translated one):
what translating one event costs the proxy. ``--quick`` is a short run (8 counted
streams after 4). Results: the table printed, and ``bench/results/translation.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import instr  # noqa: E402
from _api_streams import MESSAGES_HEADERS, messages_request  # noqa: E402

RESULTS = HERE / "results"


def responses_request(tokens: int) -> bytes:
    """A streamed, stateless Responses request for ``tokens`` tokens."""
    body = {
        "model": "m",
        "input": "hello there",
        "max_output_tokens": tokens,
        "temperature": 1,
        "store": False,
        "stream": True,
    }
    return json.dumps(body, separators=(",", ":")).encode()


def config(port: int, origin: str, *, chat_only: bool) -> str:
    text = instr.proxy_toml(port, origin, http2=False, cache=False)
    if chat_only:
        text = text.replace(f'url = "{origin}"\n', f'url = "{origin}"\napis = ["chat"]\n')
    return text


def targets(origin: instr.Origin, args: argparse.Namespace, work: Path) -> list[instr.Target]:
    # The SSE header selects nginx's chat stream (the translated request's, forwarded);
    # its Messages and Responses streams are served at their paths whatever it says.
    sse = {instr.SSE_HEADER: "1"} if origin.kind == "nginx" else {}
    events = args.events
    messages = messages_request(events)
    responses = responses_request(events)
    headers = {**MESSAGES_HEADERS, **sse}
    native = [
        instr.Phase("chat native", instr.stream_body(events), True, sse, "sse"),
        instr.Phase("messages native", messages, True, headers, "messages", "/v1/messages"),
        instr.Phase("responses native", responses, True, sse, "responses", "/v1/responses"),
    ]
    translated = [
        instr.Phase("messages translated", messages, True, headers, "messages", "/v1/messages"),
        instr.Phase("responses translated", responses, True, sse, "responses", "/v1/responses"),
    ]
    env = dict(os.environ, PYTHONPATH=str(instr.ROOT))
    out = []
    for name, chat_only, phases in (("native", False, native), ("translated", True, translated)):
        port = instr.free_port()
        conf = work / f"edge-{name}.toml"
        conf.write_text(config(port, origin.h1, chat_only=chat_only))
        cmd = [sys.executable, "-m", "edgeproxy", "serve", "--config", str(conf)]
        out.append(instr.Target(name, "now", cmd, env, port, phases, args.wait))
    return out


def _native_of(row: instr.Row, rows: list[instr.Row]) -> instr.Row | None:
    if row.process != "translated":
        return None
    return next((r for r in rows if r.process == "native" and r.kind == row.kind), None)


def table(rows: list[instr.Row]) -> str:
    lines = [
        "| stream | instructions per request | client events per request "
        "| per event | x native | extra per event | client reads per event | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        native = _native_of(r, rows)
        ratio = extra = "-"
        if native is not None:
            ratio = f"{r.per_request / native.per_request:.3f}"
            per_request = r.events / r.requests
            extra = f"{(r.per_request - native.per_request) / per_request / 1000:,.1f} k"
        lines.append(
            f"| {r.name} | {r.per_request / 1000:,.0f} k | {r.events / r.requests:.0f} "
            f"| {r.per_event / 1000:,.1f} k | {ratio} | {extra} | {r.reads / r.events:.2f} "
            f"| {r.failed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--sse-count", type=int, help="counted streams per row (30; quick 8)")
    parser.add_argument("--sse-warmup", type=int, help="uncounted streams first (8; quick 4)")
    parser.add_argument("--sse-concurrency", type=int, default=2)
    parser.add_argument("--events", type=int, default=100, help="tokens per streamed answer")
    parser.add_argument("--pace", type=float, default=10.0, help="ms between streamed events")
    parser.add_argument("--skip-nginx", action="store_true", help="no nginx, even if installed")
    parser.add_argument("--wait", type=float, default=240.0, help="seconds for a port to open")
    parser.add_argument("--keep", action="store_true", help="keep the callgrind files")
    args = parser.parse_args(argv)
    for name, full, short in (("sse_count", 30, 8), ("sse_warmup", 8, 4)):
        if getattr(args, name) is None:
            setattr(args, name, short if args.quick else full)
    if args.sse_count < 1 or args.events < 1:
        parser.error("--sse-count and --events must be at least 1")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench_translation: valgrind is not installed (apt-get install valgrind); skipped")
        return 0
    signal.signal(signal.SIGTERM, instr._exit_on_signal)
    instr.raise_nofile()
    started = time.monotonic()
    rows: list[instr.Row] = []
    work = Path(tempfile.mkdtemp(prefix="bench-translation-"))
    try:
        with instr.origin_for(args) as origin:
            print(f"upstream: {origin.describe}", flush=True)
            for target in targets(origin, args, work):
                rows += instr.measure(target, args)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = table(rows)
    print(text)
    print(f"({time.monotonic() - started:.0f} s)")
    RESULTS.mkdir(exist_ok=True)
    note = f"* upstream: {origin.describe}\n* {args.events} tokens a stream"
    (RESULTS / "translation.md").write_text(text + "\n\n" + note + "\n")
    data = {
        "upstream": origin.kind,
        "settings": {k: v for k, v in vars(args).items() if k != "keep"},
        "rows": [
            asdict(r) | {"per_request": r.per_request, "per_event": r.per_event} for r in rows
        ],
    }
    (RESULTS / "translation.json").write_text(json.dumps(data, indent=2) + "\n")
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
