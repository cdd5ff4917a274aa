"""Run one fake region in the foreground: ``python -m edgeproxy.testing --help``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType

from edgeproxy.testing._behavior import FAULTS, Behavior
from edgeproxy.testing._load import LOAD_METRICS_FAULTS, LOAD_METRICS_FORMATS, METRICS_FLAVORS
from edgeproxy.testing._upstream import FakeRegion


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m edgeproxy.testing",
        description="Serve one fake OpenAI-compatible region until SIGINT or SIGTERM.",
    )
    parser.add_argument("--name", default="region", help="region name (x-fake-region header)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--model", default="fake-llm")
    parser.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token")
    parser.add_argument("--inter-token-delay", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per completion")
    parser.add_argument("--fault", choices=sorted(FAULTS), default=None)
    parser.add_argument("--fault-rate", type=float, default=1.0)
    parser.add_argument("--fault-status", type=int, default=503)
    parser.add_argument(
        "--fault-after-tokens", type=int, default=2, help="tokens sent before a reset"
    )
    parser.add_argument(
        "--fault-after-tokens-random",
        action="store_true",
        help="reset after a seeded random 1..tokens-1 tokens instead",
    )
    parser.add_argument(
        "--continuation-overlap",
        type=int,
        default=0,
        help="tokens of the partial answer a continuation repeats first",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for --fault-rate draws")
    parser.add_argument("--http1-only", action="store_true", help="refuse HTTP/2")
    parser.add_argument("--certfile", help="PEM certificate; serve TLS with --keyfile")
    parser.add_argument("--keyfile", help="PEM private key")
    parser.add_argument("--max-concurrent-streams", type=int, default=100)
    llm = parser.add_argument_group(
        "LLM server model (chat and completions)",
        "A FIFO queue in front of --max-running slots and an LRU prefix (KV) cache of "
        "--kv-capacity-blocks blocks; TTFT = --ttft + uncached prompt tokens * "
        "--ttft-per-uncached-token + cached ones * --ttft-per-cached-token. Answers carry "
        "x-fake-kv-prompt-tokens, x-fake-kv-cached-tokens, x-fake-ttft-ms and x-fake-queue-ms, "
        "and the ORCA endpoint-load-metrics header when the request sends "
        "endpoint-load-metrics-format: TEXT or JSON. GET /metrics has the load gauges.",
    )
    llm.add_argument(
        "--kv-capacity-blocks", type=int, default=0, help="prefix cache size; 0: no cache"
    )
    llm.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV block")
    llm.add_argument(
        "--ttft-per-uncached-token",
        type=float,
        default=0.0,
        help="seconds of prefill per uncached prompt token (e.g. 0.0002)",
    )
    llm.add_argument(
        "--ttft-per-cached-token",
        type=float,
        default=0.0,
        help="seconds of prefill per cached prompt token (e.g. 0.00002)",
    )
    llm.add_argument(
        "--max-running", type=int, default=0, help="requests generating at once; 0: no limit"
    )
    llm.add_argument(
        "--max-queue", type=int, default=None, help="requests that may wait; default no limit"
    )
    llm.add_argument(
        "--queue-full-status", type=int, default=503, help="status past --max-queue (503, 429)"
    )
    llm.add_argument(
        "--load-metrics-always",
        choices=sorted(LOAD_METRICS_FORMATS),
        default=None,
        help="send endpoint-load-metrics in this format when a request asks for none",
    )
    llm.add_argument(
        "--load-metrics-fault",
        choices=sorted(LOAD_METRICS_FAULTS),
        default=None,
        help="spoil the endpoint-load-metrics header this way (always sent while set)",
    )
    llm.add_argument(
        "--metrics-flavor",
        choices=sorted(METRICS_FLAVORS),
        default="vllm",
        help="metric names of GET /metrics",
    )
    parser.add_argument("--log-level", default="WARNING")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    try:
        behavior = Behavior(
            ttft=args.ttft,
            inter_token_delay=args.inter_token_delay,
            tokens=args.tokens,
            fault=args.fault,
            fault_rate=args.fault_rate,
            fault_status=args.fault_status,
            fault_after_tokens=args.fault_after_tokens,
            fault_after_tokens_random=args.fault_after_tokens_random,
            continuation_overlap=args.continuation_overlap,
            ttft_per_uncached_token=args.ttft_per_uncached_token,
            ttft_per_cached_token=args.ttft_per_cached_token,
            load_metrics_fault=args.load_metrics_fault,
        )
        region = FakeRegion(
            args.name,
            args.host,
            args.port,
            behavior,
            model=args.model,
            certfile=args.certfile,
            keyfile=args.keyfile,
            http1_only=args.http1_only,
            seed=args.seed,
            max_concurrent_streams=args.max_concurrent_streams,
            kv_capacity_blocks=args.kv_capacity_blocks,
            kv_block_size=args.kv_block_size,
            max_running=args.max_running,
            max_queue=args.max_queue,
            queue_full_status=args.queue_full_status,
            load_metrics_always=args.load_metrics_always,
            metrics_flavor=args.metrics_flavor,
        )
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signals = {signal.SIGINT, signal.SIGTERM}
    for signum in signals:
        signal.signal(signum, on_signal)
    # The server thread inherits the signal mask at creation. With the
    # signals blocked there, the kernel delivers them to this thread, whose
    # wait they interrupt at once; otherwise the wait could outlast them.
    block = getattr(signal, "pthread_sigmask", None)
    if block is not None:
        block(signal.SIG_BLOCK, signals)
    try:
        region.start_sync()
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    finally:
        if block is not None:
            block(signal.SIG_UNBLOCK, signals)
    # Supervisors (benchmarks, the demo) wait for this exact line.
    print(f"listening on {region.url}", flush=True)
    try:
        stop.wait()
    finally:
        region.stop_sync()
    return 0


if __name__ == "__main__":
    sys.exit(main())
