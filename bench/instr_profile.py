"""Where one edgeproxy request's instructions go: the floor profile behind bench/instr.py.

Three views of the same JSON request (``POST /v1/chat/completions``, nginx canned upstream
when installed, else the fake region), each counted in one run:

1. **Subtract one feature.** edgeproxy runs under callgrind once per configuration, with one
   feature switched off (or, for the access log, on) at a time: the cache lookup
   (``cache.enabled``), metrics (``metrics.enabled``), outlier detection
   (``health.outlier_detection``), everything that can be switched off at once, and the
   access log. The difference to the full configuration is that feature's exact marginal
   cost. h2c against HTTP/1.1 is the HTTP/2 engine against aiohttp's client.
2. **By native code.** Each callgrind dump's self cost is summed per shared object and,
   inside libpython, per source file (libpython has debug info): the event loop (uvloop),
   aiohttp's C parser and writer, multidict/yarl, jh2's compiled HPACK, the interpreter's
   bytecode loop, its allocator, the garbage collector. These figures are exact.
3. **Inside Python.** Under CPython 3.11 callgrind sees C functions only, so the
   interpreter's instructions (libpython and libc's allocator, less the garbage collector)
   are spread over the Python components by their share of cProfile's self time
   over the same requests, run outside valgrind, less the profiler's own cost per call
   (measured in the process on a function that does nothing). A builtin's time
   (a dict method, ``len``) goes to the component that called it; the methods of C
   extensions (uvloop, aiohttp's parser, multidict, jh2, ``_asyncio``) are left out,
   since callgrind counts them by object already, and so are the functions whose self
   time is mostly a socket write (the kernel's time, which callgrind does not count).
   The split is an estimate (a profiler shifts time between functions however it is
   corrected); 1. and 2. are exact.

The table ``component / instructions per request / share`` ends with the sum of what
edgeproxy pays that the reference loop does not (edgeproxy − reference, exact).
Results: printed, and ``bench/results/instr-profile.{md,json}``. About 6 minutes
(``--count 300``); ``--quick`` about 3. Needs valgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pstats
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _util as u  # noqa: E402
import instr  # noqa: E402

RESULTS = HERE / "results"

# -- the configurations ---------------------------------------------------------

ALL_OFF = {
    "cache": {"enabled": "false"},
    "metrics": {"enabled": "false"},
    "health": {"outlier_detection": "false"},
}


@dataclass
class Variant:
    name: str
    what: str  # the feature measured by the difference to ``base``
    kind: str  # "h1", "h2c", "hit" or "reference"
    base: str | None = None
    sections: dict[str, dict[str, str]] = field(default_factory=dict)
    sign: int = 1  # +1: the feature was switched off; -1: switched on


VARIANTS = [
    Variant("reference", "", "reference"),
    Variant("h1", "", "h1"),
    Variant("h1 -cache", "cache lookup (bypass decision)", "h1", "h1", {"cache": ALL_OFF["cache"]}),
    Variant("h1 -metrics", "metrics", "h1", "h1", {"metrics": ALL_OFF["metrics"]}),
    Variant(
        "h1 -outliers",
        "outlier detection",
        "h1",
        "h1",
        {"health": ALL_OFF["health"]},
    ),
    Variant("h1 -all", "cache + metrics + outliers", "h1", "h1", ALL_OFF),
    Variant(
        "h1 +access log",
        "access log (off by default)",
        "h1",
        "h1",
        {"access_log": {"enabled": "true", "path": '"{work}/access.log"'}},
        sign=-1,
    ),
    Variant("h2c", "", "h2c"),
    Variant("h2c -all", "cache + metrics + outliers", "h2c", "h2c", ALL_OFF),
    Variant("hit", "", "hit"),
    Variant("hit -metrics", "metrics", "hit", "hit", {"metrics": ALL_OFF["metrics"]}),
]


def edge_toml(port: int, origin: instr.Origin, variant: Variant, work: Path) -> str:
    http2 = variant.kind == "h2c"
    url = origin.h2c if http2 else origin.h1
    text = instr.proxy_toml(port, url, http2=http2, cache=variant.kind == "hit")
    for section, keys in variant.sections.items():
        if f"[{section}]" in text:
            head, _, tail = text.partition(f"[{section}]\n")
            body = "".join(f"{k} = {v}\n" for k, v in keys.items())
            # A key given twice in a section is a TOML error: later keys win by removal.
            kept = "".join(
                line + "\n"
                for line in tail.split("\n")
                if line and line.split(" = ")[0] not in keys
            )
            text = f"{head}[{section}]\n{body}{kept}"
        else:
            text += f"\n[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
    return text.replace("{work}", str(work))


def command(variant: Variant, origin: instr.Origin, work: Path) -> tuple[list[str], int]:
    port = instr.free_port()
    if variant.kind == "reference":
        cmd = [sys.executable, str(HERE / "reference_proxy.py"), "--port", str(port)]
        return cmd + ["--upstream", origin.h1], port
    conf = work / f"{variant.name.replace(' ', '_')}.toml"
    conf.write_text(edge_toml(port, origin, variant, work))
    return [sys.executable, "-m", "edgeproxy", "serve", "--config", str(conf)], port


def body_for(variant: Variant) -> bytes:
    return instr.HIT if variant.kind == "hit" else instr.BYPASS


# -- callgrind dumps, by object and source file -------------------------------------

_NAMED = re.compile(r"^(ob|fl|fi|fe|fn|cob|cfi|cfl|cfn)=\((\d+)\)(?: (.*))?$")


def self_costs(path: Path) -> dict[tuple[str, str, str], int]:
    """Self cost (Ir) of each (object, source file, function) in a callgrind dump."""
    names: dict[tuple[str, str], str] = {}
    costs: dict[tuple[str, str, str], int] = defaultdict(int)
    ob = fl = fn = ""
    skip_next = False
    with path.open(errors="replace") as fh:
        for line in fh:
            c = line[0] if line else ""
            if c.isdigit() or c in "+-*":
                if skip_next:  # the inclusive cost of a call, not this function's own
                    skip_next = False
                    continue
                parts = line.split()
                if len(parts) > 1:
                    costs[(ob, fl, fn)] += int(parts[1])
                continue
            if line.startswith("calls="):
                skip_next = True
                continue
            m = _NAMED.match(line.rstrip("\n"))
            if not m:
                continue
            kind, ident, name = m.groups()
            space = {"fi": "fl", "fe": "fl", "cfi": "fl", "cfl": "fl", "cob": "ob", "cfn": "fn"}
            key = (space.get(kind, kind), ident)
            if name is not None:
                names[key] = name
            resolved = names.get(key, "?")
            if kind == "ob":
                ob = resolved
            elif kind == "fl":
                fl = resolved
            elif kind in ("fi", "fe"):
                fl = resolved
            elif kind == "fn":
                fn = resolved
    return costs


_ALLOC = ("malloc", "free", "realloc", "calloc", "_int_", "tcache", "arena", "memalign")


def native_component(ob: str, fl: str, fn: str) -> str:
    """The native bucket of one function: exact, from where its code lives."""
    base = os.path.basename(ob)
    if base.startswith("loop.cpython"):
        return "uvloop event loop (C)"
    if base.startswith("_http_parser"):
        return "aiohttp HTTP/1.1 parser (C, llhttp)"
    if base.startswith("_http_writer"):
        return "aiohttp header writer (C)"
    if base.startswith(("_multidict", "_quoting_c", "_helpers_c", "_frozenlist")):
        return "multidict / yarl / propcache (C)"
    if base.startswith("_hazmat"):
        return "jh2 compiled HPACK (C)"
    if base.startswith("_asyncio"):
        return "asyncio futures and tasks (C)"
    if base.startswith("libpython") or base.startswith("python3"):
        src = os.path.basename(fl)
        if src == "gcmodule.c":
            return "CPython garbage collector"
        if src in ("obmalloc.c",):
            return "interpreter (allocator)"
        return "interpreter"
    if base.startswith("libc"):
        if any(a in fn for a in _ALLOC):
            return "interpreter (allocator)"
        return "libc (memcpy, syscalls' user side)"
    if base.startswith("_json"):
        return "json (C)"
    return f"other native code ({base.split('.')[0]})"


# Components of the interpreter's share: by the Python file that runs (or calls a builtin).
_PY_GROUPS = [
    ("/bench/reference_proxy.py", "reference handler"),
    ("/edgeproxy/_upstream/h2", "edgeproxy HTTP/2 connection (h2conn, h2stream, h2pool)"),
    ("/edgeproxy/_http2/", "edgeproxy HTTP/2 connection (h2conn, h2stream, h2pool)"),
    ("/edgeproxy/_upstream/http1.py", "edgeproxy HTTP/1.1 upstream (http1.py)"),
    ("/edgeproxy/_upstream/", "routing: regions, health, load (_upstream)"),
    ("/edgeproxy/_admission/admission", "stage: admission"),
    ("/edgeproxy/_admission/ratelimit", "stage: admission"),
    ("/edgeproxy/_cache/", "stage: cache lookup"),
    ("/edgeproxy/_routing/", "stage: routing"),
    ("/edgeproxy/_routing/modelcatalog", "stage: routing"),
    ("/edgeproxy/_obtain/forward", "stage: upstream request (headers)"),
    ("/edgeproxy/_protocol/headers", "stage: upstream request (headers)"),
    ("/edgeproxy/_obtain/failover", "stage: failover + deadlines"),
    ("/edgeproxy/_obtain/deadlines", "stage: failover + deadlines"),
    ("/edgeproxy/_answer/", "answer: responder"),
    ("/edgeproxy/_observability/tracing", "tracing (trace context)"),
    ("/edgeproxy/_observability/", "metrics + access log"),
    ("/edgeproxy/_pipeline", "pipeline (context, hooks, clean-up)"),
    ("/edgeproxy/_plugins", "pipeline (context, hooks, clean-up)"),
    ("/edgeproxy/_core/", "pipeline (context, hooks, clean-up)"),
    ("/edgeproxy/_protocol/", "protocol helpers (bodies, endpoints, usage)"),
    ("/edgeproxy/_server/", "edgeproxy listener + handler (_server)"),
    ("/jh2/", "jh2 HTTP/2 state machine, framing (Python)"),
    ("/aiohttp/client", "aiohttp client (Python)"),
    ("/aiohttp/connector", "aiohttp client (Python)"),
    ("/aiohttp/tracing", "aiohttp client (Python)"),
    ("/aiohttp/", "aiohttp server + streams (Python)"),
    ("/multidict/", "aiohttp server + streams (Python)"),
    ("/yarl/", "aiohttp client (Python)"),
    ("/asyncio/", "asyncio (Python)"),
]
# Builtins implemented in extensions that callgrind already counts by object.
_NATIVE_BUILTINS = ("uvloop", "aiohttp.", "multidict", "yarl", "jh2", "_asyncio", "Future", "Task")


# Functions whose self time is mostly a socket write (uvloop's transport.write sends at
# once, and cProfile does not see it as a call of its own): kernel time, which callgrind
# does not count, so they are left out of the shares.
_WRITES = (("/aiohttp/http_writer.py", "_write"), ("/aiohttp/http_writer.py", "_writelines"))
_WRITES_H2 = ("/edgeproxy/_http2/writes.py", "flush")


# --by-module: edgeproxy's Python split per module rather than per component, which is
# how the modules of the compiled build (edgeproxy/_core/build.py) were chosen.
_BY_MODULE = False


def python_component(filename: str) -> str:
    if _BY_MODULE and "/edgeproxy/" in filename:
        return "edgeproxy/" + filename.rsplit("/edgeproxy/", 1)[1]
    for mark, name in _PY_GROUPS:
        if mark in filename:
            return name
    return "other Python (stdlib, logging, ...)"


def python_shares(stats_file: Path, overhead: float = 0.0) -> dict[str, float]:
    """Each Python component's share of the interpreter's self time, builtins to callers,
    with ``overhead`` (the profiler's own cost per call) taken off each call."""
    stats = pstats.Stats(str(stats_file)).stats  # type: ignore[attr-defined]
    time_by: dict[str, float] = defaultdict(float)
    for (filename, _line, name), (_cc, nc, tt, _ct, callers) in stats.items():
        tt = max(0.0, tt - nc * overhead)
        if any(filename.endswith(f) and name == n for f, n in (*_WRITES, _WRITES_H2)):
            continue
        if filename == "~":
            if any(n in name for n in _NATIVE_BUILTINS) or "run_forever" in name:
                continue
            spread = sum(c[2] for c in callers.values()) or 1e-12
            for (cfile, _cl, _cn), c in callers.items():
                time_by[python_component(cfile)] += tt * c[2] / spread
            continue
        time_by[python_component(filename)] += tt
    total = sum(time_by.values()) or 1e-12
    return {k: v / total for k, v in time_by.items()}


# -- running ---------------------------------------------------------------------


@dataclass
class Measured:
    variant: Variant
    per_request: float
    native: dict[str, float]  # per request
    failed: int


def measure_callgrind(
    variant: Variant, origin: instr.Origin, args: argparse.Namespace, work: Path
) -> Measured:
    cmd, port = command(variant, origin, work)
    run = work / variant.name.replace(" ", "_")
    run.mkdir()
    proc = instr.callgrind(cmd, dict(os.environ, PYTHONPATH=str(instr.ROOT)), run)
    try:
        if not instr.wait_port(port, args.wait, proc):
            tail = (run / "valgrind.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{variant.name}: port {port} never opened:\n{tail}")
        body = body_for(variant)
        asyncio.run(instr.drive(port, args.warmup, body, args.concurrency, {}))
        instr.control(proc.pid, "-i", "on")
        failed, _, _ = asyncio.run(instr.drive(port, args.count, body, args.concurrency, {}))
        instr.control(proc.pid, "-i", "off")
        before = set(run.glob("cg.out*"))
        total = instr.dump_instructions(proc.pid, run)
        dump = max(set(run.glob("cg.out*")) - before, key=lambda p: p.stat().st_mtime)
        native: dict[str, float] = defaultdict(float)
        for (ob, fl, fn), cost in self_costs(dump).items():
            native[native_component(ob, fl, fn)] += cost / args.count
        m = Measured(variant, total / args.count, dict(native), failed)
        print(
            f"{variant.name:16} {m.per_request / 1000:9,.0f} k/req  ({failed} failed)", flush=True
        )
        return m
    finally:
        u.stop_process(proc)


_CPROFILE_SERVE = """
import cProfile, pstats, signal, sys, time, timeit
# The profiler's own cost per call, charged to the function called: measured here, on
# a function that does nothing, and taken off every function's self time afterwards.
def nothing(): pass
n = 200_000
bare = min(timeit.repeat(nothing, number=n, repeat=5)) / n
probe = cProfile.Profile()
probe.enable()
for _ in range(n): nothing()
probe.disable()
charged = next(v[2] for k, v in pstats.Stats(probe).stats.items() if k[2] == "nothing") / n
prof = cProfile.Profile()
out = sys.argv[1]
open(out + ".overhead", "w").write(repr(max(0.0, charged - bare)))
def on(*_): prof.enable()
def off(*_):
    prof.disable(); prof.dump_stats(out + ".partial")
    import os; os.replace(out + ".partial", out)
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGUSR2, off)
sys.argv = sys.argv[1:]
if sys.argv[1] == "reference":
    sys.argv = sys.argv[2:]
    sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
    import reference_proxy
    sys.exit(reference_proxy.main(sys.argv[1:]))
from edgeproxy._cli import main
sys.exit(main(sys.argv[1:]))
"""


def measure_cprofile(
    variant: Variant, origin: instr.Origin, args: argparse.Namespace, work: Path
) -> dict[str, float]:
    cmd, port = command(variant, origin, work)
    out = work / f"{variant.name.replace(' ', '_')}.pstats"
    script = work / "cprofile_serve.py"
    script.write_text(_CPROFILE_SERVE)
    if variant.kind == "reference":
        argv = [sys.executable, str(script), str(out), "reference", *cmd[1:]]
    else:
        argv = [sys.executable, str(script), str(out), *cmd[3:]]
    env = dict(os.environ, PYTHONPATH=str(instr.ROOT))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not instr.wait_port(port, 60, proc):
            raise RuntimeError(f"{variant.name} (cProfile): port {port} never opened")
        body = body_for(variant)
        asyncio.run(instr.drive(port, args.warmup, body, args.concurrency, {}))
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        asyncio.run(instr.drive(port, args.profile_count, body, args.concurrency, {}))
        proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        overhead = float(Path(str(out) + ".overhead").read_text())
        return python_shares(out, overhead)
    finally:
        proc.terminate()
        proc.wait(30)


# -- the tables ------------------------------------------------------------------

_INTERPRETER = ("interpreter", "interpreter (allocator)")


def breakdown(m: Measured, shares: dict[str, float]) -> list[tuple[str, float]]:
    """Components of one request: native buckets, the interpreter spread by ``shares``."""
    rows = [(k, v) for k, v in m.native.items() if k not in _INTERPRETER]
    interp = sum(m.native.get(k, 0.0) for k in _INTERPRETER)
    rows += [(f"{k} (est.)", interp * s) for k, s in shares.items()]
    return sorted(rows, key=lambda kv: kv[1], reverse=True)


def component_table(
    name: str,
    m: Measured,
    ref: Measured | None,
    shares: dict[str, float],
    ref_shares: dict[str, float],
) -> str:
    ratio = f" ({m.per_request / ref.per_request:.2f}x the reference)" if ref else ""
    lines = [
        f"#### {name}: {m.per_request / 1000:,.0f} k instructions per request{ratio}",
        "",
        "| component | instructions per request | share | the reference's | beyond it |",
        "| --- | --- | --- | --- | --- |",
    ]
    theirs = dict(breakdown(ref, ref_shares)) if ref else {}
    for comp, value in breakdown(m, shares):
        if value < 500 and theirs.get(comp, 0.0) < 500:
            continue
        other = theirs.get(comp, 0.0)
        cells = f"{other / 1000:,.1f} k | {(value - other) / 1000:+,.1f} k" if ref else "- | -"
        lines.append(f"| {comp} | {value / 1000:,.1f} k | {value / m.per_request:.1%} | {cells} |")
    if ref is not None:
        for comp, other in theirs.items():
            if comp not in dict(breakdown(m, shares)) and other >= 500:
                lines.append(
                    f"| {comp} | 0 | 0% | {other / 1000:,.1f} k | {-other / 1000:+,.1f} k |"
                )
        extra = m.per_request - ref.per_request
        lines.append(
            f"| **total** | **{m.per_request / 1000:,.0f} k** | 100% "
            f"| **{ref.per_request / 1000:,.0f} k** | **{extra / 1000:+,.0f} k** |"
        )
    return "\n".join(lines)


def feature_table(measured: dict[str, Measured]) -> str:
    lines = [
        "| configuration | instructions per request | feature | marginal cost |",
        "| --- | --- | --- | --- |",
    ]
    for v in VARIANTS:
        m = measured.get(v.name)
        if m is None:
            continue
        cost = "-"
        if v.base and v.base in measured:
            cost = f"{v.sign * (measured[v.base].per_request - m.per_request) / 1000:+,.1f} k"
        lines.append(f"| {v.name} | {m.per_request / 1000:,.0f} k | {v.what or '-'} | {cost} |")
    h1, h2c, ref = measured.get("h1"), measured.get("h2c"), measured.get("reference")
    if h1 and h2c:
        lines.append(
            f"| h2c vs h1 | | HTTP/2 engine instead of aiohttp's client "
            f"| {(h2c.per_request - h1.per_request) / 1000:+,.1f} k |"
        )
    if h1 and ref:
        lines.append(
            f"| h1 vs reference | | everything edgeproxy adds (HTTP/1.1) "
            f"| {(h1.per_request - ref.per_request) / 1000:+,.1f} k |"
        )
    return "\n".join(lines)


def native_diff_table(a: Measured, b: Measured, label: str) -> str:
    """Native buckets of ``a`` against ``b``: where the difference lies, exactly."""
    keys = sorted(
        set(a.native) | set(b.native), key=lambda k: -(a.native.get(k, 0) - b.native.get(k, 0))
    )
    lines = [f"| native bucket | {label} |", "| --- | --- |"]
    for k in keys:
        d = a.native.get(k, 0.0) - b.native.get(k, 0.0)
        if abs(d) >= 500:
            lines.append(f"| {k} | {d / 1000:+,.1f} k |")
    return "\n".join(lines)


@contextlib.contextmanager
def _workdir(keep: bool) -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="instr-profile-"))
    try:
        yield work
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--count", type=int, help="counted requests per configuration (300)")
    parser.add_argument("--warmup", type=int, help="uncounted requests first (200)")
    parser.add_argument("--profile-count", type=int, default=3000, help="requests under cProfile")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--only", nargs="+", choices=[v.name for v in VARIANTS], help="configurations to run"
    )
    parser.add_argument("--skip-nginx", action="store_true", help="no nginx, even if installed")
    parser.add_argument("--wait", type=float, default=240.0, help="seconds for a port to open")
    parser.add_argument("--keep", action="store_true", help="keep the callgrind files")
    parser.add_argument(
        "--by-module",
        action="store_true",
        help="split edgeproxy's Python per module instead of per component",
    )
    args = parser.parse_args(argv)
    global _BY_MODULE
    _BY_MODULE = args.by_module
    args.count = args.count or (100 if args.quick else 300)
    args.warmup = args.warmup or (60 if args.quick else 200)
    args.events, args.pace = 100, 10.0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instr_profile: valgrind is not installed; skipped")
        return 0
    signal.signal(signal.SIGTERM, instr._exit_on_signal)
    instr.raise_nofile()
    chosen = [v for v in VARIANTS if not args.only or v.name in args.only]
    measured: dict[str, Measured] = {}
    shares: dict[str, dict[str, float]] = {}
    with _workdir(args.keep) as work, instr.origin_for(args) as origin:
        print(f"upstream: {origin.describe}", flush=True)
        for v in chosen:
            measured[v.name] = measure_callgrind(v, origin, args, work)
        for v in chosen:
            if v.base is None:
                shares[v.name] = measure_cprofile(v, origin, args, work)
        describe = origin.describe
    parts = [f"upstream: {describe}; {args.count} requests counted per configuration", ""]
    parts += ["### Subtract one feature", "", feature_table(measured), ""]
    ref = measured.get("reference")
    for name in ("reference", "h1", "h2c", "hit"):
        if name in measured:
            mine = ref if name != "reference" else None
            table = component_table(
                name, measured[name], mine, shares.get(name, {}), shares.get("reference", {})
            )
            parts += [table, ""]
    if ref:
        for name in ("h1", "h2c", "hit"):
            if name in measured:
                parts += [f"### Native code: {name} against the reference", ""]
                parts += [native_diff_table(measured[name], ref, f"{name} − reference"), ""]
    text = "\n".join(parts)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "instr-profile.md").write_text(text)
    data = {
        "upstream": describe,
        "count": args.count,
        "configurations": {
            k: {"per_request": m.per_request, "native": m.native, "failed": m.failed}
            for k, m in measured.items()
        },
        "python_shares": shares,
    }
    (RESULTS / "instr-profile.json").write_text(json.dumps(data, indent=2) + "\n")
    return 1 if any(m.failed for m in measured.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
