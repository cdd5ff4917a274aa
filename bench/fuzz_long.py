"""The fuzz properties of ``tests/test_fuzz.py``, run long: many more examples each.

    python bench/fuzz_long.py [--examples 2000] [--only "raw requests" "json bodies" ...]

Runs each property (raw requests against a live proxy and fake region,
JSON body validation, config mappings, config files) with hypothesis for
``--examples`` examples, prints a table of examples run, failures and time,
and for raw requests the distribution of the proxy's answers. A failure
prints hypothesis's minimal failing example and the script exits 1.
Results also go to ``bench/results/fuzz_long.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.test_fuzz import PROPERTIES, ProxyThread  # noqa: E402


def run_property(name: str, examples: int, proxy: ProxyThread | None) -> dict[str, Any]:
    check, strategies = PROPERTIES[name]
    outcomes: collections.Counter[str] = collections.Counter()
    runs = 0
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-"))

    def body(**kwargs: Any) -> None:
        nonlocal runs
        runs += 1
        if name == "raw requests":
            assert proxy is not None
            status = check(proxy.port, **kwargs)
            outcomes["closed, no answer" if status is None else str(status)] += 1
        elif name == "config files":
            check(tmp, **kwargs)
        else:
            check(**kwargs)

    test = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )(given(**strategies)(body))
    started = time.monotonic()
    failure = None
    try:
        test()
    except Exception:  # noqa: BLE001 - report the falsifying example, keep going
        failure = traceback.format_exc(limit=3)
    return {
        "property": name,
        "examples": runs,
        "seconds": round(time.monotonic() - started, 1),
        "failure": failure,
        "outcomes": dict(sorted(outcomes.items())),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="examples per property")
    parser.add_argument("--only", nargs="*", choices=sorted(PROPERTIES), help="some properties")
    args = parser.parse_args()
    names = args.only or list(PROPERTIES)
    results = []
    proxy = ProxyThread() if "raw requests" in names else None
    if proxy is not None:
        proxy.__enter__()
    try:
        for name in names:
            print(f"fuzzing {name} ({args.examples} examples)...", flush=True)
            results.append(run_property(name, args.examples, proxy))
        serving = proxy.serves() if proxy is not None else None
    finally:
        if proxy is not None:
            proxy.__exit__(None, None, None)

    print()
    print("| property | examples run | failures | seconds |")
    print("| --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['property']} | {r['examples']} | {1 if r['failure'] else 0} | {r['seconds']} |"
        )
    for r in results:
        if r["outcomes"]:
            answers = ", ".join(f"{k}: {v}" for k, v in r["outcomes"].items())
            print(f"\n{r['property']}: answers by status: {answers}")
        if r["failure"]:
            print(f"\n{r['property']} FAILED:\n{r['failure']}")
    if serving is not None:
        print(f"\nproxy still serving a good request afterwards: {serving}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz_long.json").write_text(
        json.dumps({"results": results, "still_serving": serving}, indent=2)
    )
    ok = not any(r["failure"] for r in results) and serving is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
