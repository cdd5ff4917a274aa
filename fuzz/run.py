"""Run every harness for a while and print what each did.

    python fuzz/run.py                 # 60 seconds each
    python fuzz/run.py -t 10 sse json_body
    python fuzz/run.py --runs 2000     # a fixed number of inputs each, instead

Each harness fuzzes from its checked-in seeds (``fuzz/corpus/<target>/``,
only read) and its working corpus (``fuzz/.work/<target>/corpus/``, where
libFuzzer keeps the new inputs it finds, so a later run starts from them).
Crash files land in ``fuzz/.work/<target>/``. The exit status is 1 when any
harness crashed or failed, else 0.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = sorted(p.stem.removeprefix("fuzz_") for p in HERE.glob("fuzz_*.py"))
# libFuzzer's findings: a crash (any unexpected exception), a timeout, memory.
ARTIFACTS = ("crash-*", "timeout-*", "oom-*", "leak-*")
_STATUS = re.compile(r"^#(\d+)\s+(\w+)\s+cov: (\d+) ft: (\d+) corp: (\d+)/", re.MULTILINE)
_DONE = re.compile(r"^Done (\d+) runs in", re.MULTILINE)


@dataclass
class Result:
    target: str
    seconds: float
    runs: int | None
    cov: int | None
    features: int | None
    corpus: int | None
    crashes: list[Path]
    returncode: int


def command(
    target: str,
    corpus: Path,
    artifacts: Path,
    *,
    seconds: float | None,
    runs: int | None,
    seed: int | None = None,
) -> list[str]:
    """The command line that fuzzes ``target``, new inputs going to ``corpus``."""
    args = [
        sys.executable,
        str(HERE / f"fuzz_{target}.py"),
        str(corpus),
        str(HERE / "corpus" / target),
        f"-artifact_prefix={artifacts}/",
        "-timeout=20",  # seconds for one input: longer is a finding too
        "-rss_limit_mb=2048",
        "-max_len=8192",
        "-print_final_stats=1",
    ]
    if seconds is not None:
        args.append(f"-max_total_time={max(1, round(seconds))}")
    if runs is not None:
        args.append(f"-runs={runs}")
    if seed is not None:
        args.append(f"-seed={seed}")  # the same inputs each time
    return args


def run_target(
    target: str,
    work: Path,
    *,
    seconds: float | None,
    runs: int | None,
    seed: int | None = None,
    verbose: bool = False,
) -> Result:
    corpus = work / target / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    artifacts = work / target
    before = {p for pattern in ARTIFACTS for p in artifacts.glob(pattern)}
    started = time.monotonic()
    proc = subprocess.run(
        command(target, corpus, artifacts, seconds=seconds, runs=runs, seed=seed),
        capture_output=True,
        text=True,
        errors="replace",
    )
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    (artifacts / "last.log").write_text(output)
    if verbose:
        print(output)
    after = {p for pattern in ARTIFACTS for p in artifacts.glob(pattern)}
    statuses = _STATUS.findall(output)
    done = _DONE.findall(output)
    last = statuses[-1] if statuses else None
    runs_done = int(done[-1]) if done else int(last[0]) if last else None
    return Result(
        target=target,
        seconds=elapsed,
        runs=runs_done,
        cov=int(last[2]) if last else None,
        features=int(last[3]) if last else None,
        corpus=int(last[4]) if last else None,
        crashes=sorted(after - before),
        returncode=proc.returncode,
    )


def table(results: list[Result]) -> str:
    head = ("target", "seconds", "executions", "exec/s", "cov", "features", "corpus", "crashes")
    rows = [head]
    for r in results:
        rate = f"{r.runs / r.seconds:.0f}" if r.runs and r.seconds else "-"
        rows.append(
            (
                r.target,
                f"{r.seconds:.0f}",
                "-" if r.runs is None else str(r.runs),
                rate,
                "-" if r.cov is None else str(r.cov),
                "-" if r.features is None else str(r.features),
                "-" if r.corpus is None else str(r.corpus),
                str(len(r.crashes)) + ("" if r.returncode == 0 else f" (exit {r.returncode})"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "targets",
        nargs="*",
        metavar="target",
        help=f"harnesses to run (default: all of {', '.join(TARGETS)})",
    )
    parser.add_argument(
        "-t",
        "--seconds",
        type=float,
        default=None,
        help="seconds per harness (default 60, unless --runs)",
    )
    parser.add_argument("--runs", type=int, default=None, help="inputs per harness")
    parser.add_argument("--seed", type=int, default=None, help="libFuzzer's random seed")
    parser.add_argument(
        "--work",
        type=Path,
        default=HERE / ".work",
        help="working corpus and crash files (default fuzz/.work)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print libFuzzer's output")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        parser.error(f"no harness for {', '.join(unknown)} (there are: {', '.join(TARGETS)})")
    seconds = args.seconds if args.seconds is not None or args.runs else 60.0
    results = []
    for target in args.targets or TARGETS:
        print(f"fuzzing {target} ...", flush=True)
        result = run_target(
            target,
            args.work,
            seconds=seconds,
            runs=args.runs,
            seed=args.seed,
            verbose=args.verbose,
        )
        results.append(result)
        for crash in result.crashes:
            print(f"  {crash.name}: reproduce with python fuzz/fuzz_{target}.py {crash}")
        if result.returncode and not result.crashes:
            print(f"  exited {result.returncode}; see {args.work / target / 'last.log'}")
    print()
    print(table(results))
    return 1 if any(r.crashes or r.returncode for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
