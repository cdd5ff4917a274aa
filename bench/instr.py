"""Instructions per request, counted by callgrind: the noise-free cost of each proxy.

Wall-clock throughput on a shared 2-core machine swings by tens of percent between
runs; the number of instructions a process executes for the same requests does not.
Each target runs under ``valgrind --tool=callgrind --instr-atstart=no``: the warm-up
requests go uninstrumented, then instrumentation is switched on (``callgrind_control
-i on``), a fixed number of requests is sent, instrumentation goes off, the counters
are dumped, and the total is divided by the request count. Only the proxy process is
counted; the upstream and the client run outside valgrind. A target whose process
serves a JSON answer and streamed ones is measured for each in turn (one warm-up, then
one counted phase, each), so its rows share a process.

The upstream is nginx with canned answers when nginx is installed (``--skip-nginx``
turns it off), else the fake region of ``edgeproxy.testing``; the output says which.
With nginx, the JSON answer is a ``return 200 '<json>'`` location, and a streamed answer
(selected by an ``X-Bench-SSE`` request header, which every proxy forwards) is a static
file of ``--events`` chat-completion chunks plus the finish, usage and ``[DONE]`` events,
served as ``text/event-stream`` and paced by ``limit_rate`` + ``sendfile_max_chunk`` to
one event per write every ``--pace`` ms (the HTTP/1.1 file starts with an SSE comment
that pads the response head to a whole number of events, so every write after the
first is exactly one event). The fake region writes each token after ``--pace`` ms.
Pacing matters: a proxy under callgrind runs 30 to 100 times slower, and events that
pile up in a socket are read several at a time, which would hide the per-event cost.
``client reads per event`` in the table checks it (about 1 means one event per read).

Two more streams, of the same ``--events`` tokens, are the other APIs' (``_api_streams``):
``POST /v1/responses`` gets a Responses API stream (``response.created``, ``in_progress``,
``output_item.added``, ``content_part.added``, a ``response.output_text.delta`` per token
with its ``sequence_number``, the ``done`` events and ``response.completed`` with usage)
and ``POST /v1/messages`` an Anthropic Messages stream (``message_start``,
``content_block_start``, ``ping``, a ``content_block_delta`` per token,
``content_block_stop``, ``message_delta`` with usage, ``message_stop``); nginx serves
each at its path, paced the same way. To be one write each, a stream's events are padded
(JSON whitespace) to the length of its longest event that does not repeat the whole
answer: 782 bytes for Responses (its ``response.created``), 344 for Messages (its
``message_start``), against 236 and 125 for a bare delta. The Responses API's four events
that repeat the whole answer take a few writes each (about 1.05 reads per event). The
padding costs edgeproxy's stream reading about 3.4 k instructions per Responses event
and 1.5 k per Messages event (measured on its usage reader alone under callgrind).

Targets (``--only``), each one process, and what each is asked:

* ``reference``: ``bench/reference_proxy.py``, a bare aiohttp server + client pool
  (rows ``reference``, ``reference sse``, ``reference responses sse`` and
  ``reference messages sse``);
* ``canned``: ``bench/reference_proxy.py --canned``, the same aiohttp server answering
  every request with one fixed JSON body: the floor of any answer served from memory
  through aiohttp's web layer (row ``canned``; JSON only);
* ``nginx``: nginx as a plain ``proxy_pass`` reverse proxy with an HTTP/1.1 keep-alive
  upstream pool, run as one process (``daemon off; master_process off;``) so callgrind
  sees all of it (rows ``nginx``, ``nginx sse`` and the two others; needs nginx);
* ``h1``: edgeproxy, HTTP/1.1 upstream, cache off (rows ``h1``, ``h1 sse``,
  ``h1 responses sse``, ``h1 messages sse``);
* ``h2c``: edgeproxy, h2c upstream, cache off (rows ``h2c``, ``h2c sse`` and the two
  others);
* ``hit``: edgeproxy, memory cache hit (deterministic body; JSON only);
* ``litellm``: the LiteLLM proxy (``litellm --num_workers 1``) from the venv given by
  ``--litellm-venv`` (``pip install 'litellm[proxy]'`` there), with its defaults
  (rows ``litellm`` and ``litellm sse``); skipped, with the reason, without it.

``--only`` also takes what to ask: ``json`` (the JSON request), ``sse`` (the chat
stream), ``responses`` and ``messages`` (the other APIs' streams); all of them when none
is named, and all targets when no target is named. ``--only h1 responses`` is one
process and one stream; ``--only sse responses messages`` the three streams everywhere.

``x reference`` divides a row by the reference row of the same request (``reference``,
``reference sse``, ``reference responses sse``...). ``per SSE event`` is the streamed
row's instructions over the events the client saw; ``marginal per event`` takes the same
process's JSON request off first, so it is what one more event costs (chat streams only:
the run has no JSON request of the other APIs).

``--tree DIR`` runs edgeproxy from another checkout as well (``before`` rows), so a
change can be measured against the code before it in the same run::

    git worktree add /tmp/before HEAD~5
    python bench/instr.py --tree /tmp/before --count 300

``--tree NAME=DIR`` names the rows, and ``--tree`` may be given more than once: the
compiled build is a checkout whose hot modules were built in place
(``EDGEPROXY_COMPILE=1 python setup.py build_ext --inplace``), measured beside the pure
one and the code before::

    python bench/instr.py --tree before=/tmp/before --tree compiled=/tmp/compiled

A tree whose endpoint table (asked in its own interpreter) does not know ``/v1/responses``
or ``/v1/messages`` would relay that stream as plain bytes, which is another measurement:
its row for that stream says ``skipped`` and why, and nothing is sent there.

``--quick`` (60 requests after 60 warm-up, 12 streamed after 6, about 2.5 minutes with
the three streams) is the CI smoke run.
``--wallclock`` runs ``bench_proxy.py --only throughput`` (with ``--quick`` when given)
right after the count, in the same run: its wall-clock table goes under the instruction
table in ``instr.md``. ``bench/instr_profile.py`` breaks one request down by component.
Needs valgrind (Debian: ``apt-get install valgrind``). Results: the table printed, and
``bench/results/instr.{md,json}``. Everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _util as u  # noqa: E402
from _api_streams import (  # noqa: E402
    MESSAGES_HEADERS,
    ApiStream,
    messages_request,
    messages_stream,
    responses_request,
    responses_stream,
)

ROOT = HERE.parent
RESULTS = HERE / "results"
LOOPBACK = "127.0.0.1"
PATH = "/v1/chat/completions"
BYPASS = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"temperature":1}'
HIT = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"temperature":0}'
SSE_HEADER = "X-Bench-SSE"
TARGETS = ("reference", "canned", "nginx", "h1", "h2c", "hit", "litellm")
# What each target is asked, by --only name: the JSON request and the three streams.
KINDS = ("json", "sse", "responses", "messages")
# The streams of the other APIs: their row suffix and their path.
API_ROWS = {"responses": "responses sse", "messages": "messages sse"}
API_PATHS = {"responses": "/v1/responses", "messages": "/v1/messages"}


def stream_body(events: int, model: str = "m") -> bytes:
    return (
        b'{"model":"%s","messages":[{"role":"user","content":"hello there"}],'
        b'"temperature":1,"stream":true,"max_tokens":%d}' % (model.encode(), events)
    )


def raise_nofile() -> int:
    """Raise this process's open-file limit (inherited by its children) to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# -- the canned SSE answer --------------------------------------------------------

_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{"content":" tok%06d"},'
    b'"finish_reason":null}]}\n\n'
)
_TAIL = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":%d,'
    b'"total_tokens":%d}}\n\n'
    b"data: [DONE]\n\n"
)
EVENT_LEN = len(_CHUNK % 0)


def sse_answer(tokens: int) -> bytes:
    """What the fake region streams: ``tokens`` chunks (all ``EVENT_LEN`` bytes), the
    finish chunk, the usage chunk and ``[DONE]``."""
    return b"".join(_CHUNK % i for i in range(tokens)) + _TAIL % (tokens, tokens + 2)


def sse_pad(head_len: int, body: bytes) -> bytes:
    """An SSE comment that brings an HTTP/1.1 head plus itself to a multiple of
    ``EVENT_LEN``, so that writes of ``EVENT_LEN`` bytes after it are whole events.

    The head carries the file's Content-Length, which the comment lengthens: counted in.
    """
    digits = len(str(len(body)))
    for extra in range(3, 3 + 2 * EVENT_LEN):
        head = head_len + len(str(len(body) + extra)) - digits
        if (head + extra) % EVENT_LEN == 0:
            return b":" + b"p" * (extra - 3) + b"\n\n"
    raise AssertionError("unreachable")


def nginx_origin_conf(
    h1: int,
    h2: int,
    root: Path,
    *,
    pace_ms: float,
    json_body: str,
    max_streams: int = 128,
    apis: tuple[ApiStream, ...] = (),
) -> str:
    """The canned upstream: JSON from ``return 200``, and with the SSE header (or under
    ``/sse/``) ``sse-h1.txt`` / ``sse-h2.txt`` paced to one event per write; each stream
    of ``apis`` (always streamed) at its path, from ``<kind>-h1.txt`` / ``<kind>-h2.txt``
    paced the same way in writes of its own event length."""
    quoted = "'" + json_body.replace("\\", "\\\\").replace("'", "\\'") + "'"

    def paced(location: str, unit: int, file: str) -> str:
        rate = max(1, round(unit * 1000 / pace_ms))
        return f"""
        location {location} {{
            root {root};
            types {{ }}
            default_type text/event-stream;
            etag off;
            limit_rate {rate};
            sendfile off;
            sendfile_max_chunk {unit};
            postpone_output 0;
            try_files /{file} =404;
            error_page 405 =200 {location};
        }}"""

    def server(port: int, listen_opts: str, proto: str) -> str:
        api_locations = "".join(
            f"""
        location = {api.path} {{ rewrite ^ {api.location} last; }}"""
            + paced(api.location, api.unit, f"{api.kind}-{proto}.txt")
            for api in apis
        )
        return f"""
    server {{
        listen {LOOPBACK}:{port}{listen_opts} backlog=4096;
        location / {{
            if ($http_x_bench_sse) {{ rewrite ^ /sse/ last; }}
            default_type application/json;
            return 200 {quoted};
        }}{paced("/sse/", EVENT_LEN, f"sse-{proto}.txt")}{api_locations}
    }}"""

    nofile = raise_nofile()
    return f"""
worker_processes 1;
worker_rlimit_nofile {nofile};
error_log logs/error.log warn;
pid logs/nginx.pid;
events {{ worker_connections {nofile}; }}
http {{
    access_log off;
    server_tokens off;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    send_timeout 300s;
    http2_max_concurrent_streams {max_streams};
    {server(h1, "", "h1")}
    {server(h2, " http2", "h2")}
}}
"""


def response_head_len(port: int, headers: dict[str, str], path: str = PATH) -> int:
    """Bytes of the head nginx sends before a streamed answer on ``port`` (HTTP/1.1)."""
    lines = [f"POST {path} HTTP/1.1", "Host: bench", "Content-Length: 2"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    raw = ("\r\n".join(lines) + "\r\n\r\n{}").encode()
    with socket.create_connection((LOOPBACK, port), 5) as s:
        s.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    if not data.startswith(b"HTTP/1.1 200 "):
        raise RuntimeError(f"the nginx upstream answered {data[:200]!r}")
    return data.index(b"\r\n\r\n") + 4


@dataclass
class Origin:
    kind: str  # "nginx" or "fake region"
    h1: str  # base URL, HTTP/1.1
    h2c: str  # base URL, h2c (prior knowledge)
    sse_h1: str  # base URL whose /v1/chat/completions always streams (for LiteLLM)
    describe: str


def api_streams(tokens: int) -> tuple[ApiStream, ...]:
    """The Responses and Messages streams nginx serves, ``tokens`` deltas each."""
    return (responses_stream(tokens), messages_stream(tokens))


@contextlib.contextmanager
def nginx_origin(
    nginx: str, tokens: int, pace_ms: float, *, max_streams: int = 128, keep: bool = False
) -> Iterator[Origin]:
    """nginx serving the canned answers on an HTTP/1.1 port and an h2c port."""
    work = Path(tempfile.mkdtemp(prefix="instr-origin-"))
    work.chmod(0o755)  # nginx's worker runs as another user when started as root
    body = sse_answer(tokens)
    apis = api_streams(tokens)
    html = work / "html"
    html.mkdir()
    (html / "sse-h1.txt").write_bytes(body)
    (html / "sse-h2.txt").write_bytes(body)
    for api in apis:
        (html / f"{api.kind}-h1.txt").write_bytes(api.body())
        (html / f"{api.kind}-h2.txt").write_bytes(api.body())
    h1, h2 = free_port(), free_port()
    conf = nginx_origin_conf(
        h1,
        h2,
        html,
        pace_ms=pace_ms,
        json_body=u.UPSTREAM_JSON,
        max_streams=max_streams,
        apis=apis,
    )
    svc = u.nginx_service("nginx-origin", nginx, work, conf, []).start()
    try:
        if not wait_port(h1, 10) or not wait_port(h2, 10):
            raise RuntimeError(f"the nginx upstream did not start:\n{svc.log_tail()}")
        pad = sse_pad(response_head_len(h1, {SSE_HEADER: "1"}), body)
        (html / "sse-h1.txt").write_bytes(pad + body)
        for api in apis:
            # Over HTTP/1.1 the head shares the first write: the first event evens it up.
            plain = api.body()
            head = response_head_len(h1, {}, api.path)
            (html / f"{api.kind}-h1.txt").write_bytes(api.body_h1(head, len(plain)))
        version = u.tool_version([nginx, "-v"]).replace("nginx version: ", "")
        streams = "; ".join(
            f"{api.path}: {api.count} events padded to {api.unit} bytes" for api in apis
        )
        yield Origin(
            "nginx",
            f"http://{LOOPBACK}:{h1}",
            f"http://{LOOPBACK}:{h2}",
            f"http://{LOOPBACK}:{h1}/sse",
            f"{version} with canned answers (JSON: `return 200`; SSE: a static file of "
            f"{tokens} chunks + finish, usage and [DONE], one event per write every "
            f"{pace_ms:g} ms; {streams}, one per write, those repeating the whole answer "
            f"in several)",
        )
    finally:
        svc.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def fake_origin(tokens: int, pace_ms: float, reason: str) -> Iterator[Origin]:
    """The fake region (h2c and HTTP/1.1 on one port), ``tokens`` tokens a stream."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgeproxy.testing",
            "--port",
            str(port),
            "--tokens",
            str(tokens),
            "--inter-token-delay",
            str(pace_ms / 1000),
        ],
        stdout=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        if not wait_port(port, 30):
            raise RuntimeError("the fake region did not start")
        url = f"http://{LOOPBACK}:{port}"
        yield Origin(
            "fake region",
            url,
            url,
            url,
            f"the fake region (python -m edgeproxy.testing, {pace_ms:g} ms between tokens), "
            f"because {reason}; its JSON answers vary in length, and its Responses and "
            f"Messages streams write their opening and closing events together",
        )
    finally:
        proc.terminate()
        proc.wait(10)


# -- measuring ------------------------------------------------------------------


@dataclass
class Phase:
    row: str
    body: bytes
    sse: bool
    headers: dict[str, str] = field(default_factory=dict)
    kind: str = ""  # the --only name: json, sse, responses, messages
    path: str = PATH
    skip: str = ""  # why this phase is not run (its row says so)


@dataclass
class Target:
    name: str
    tree: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    phases: list[Phase]
    wait: float
    auth: str | None = None


@dataclass
class Row:
    name: str
    process: str
    tree: str
    instructions: float
    requests: int
    failed: int
    events: int = 0
    reads: int = 0
    seconds: float = 0.0
    kind: str = ""  # json, sse, responses, messages ("" where the caller does not say)
    skipped: str = ""  # not measured, and why

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests if self.requests else float("nan")

    @property
    def per_event(self) -> float:
        return self.instructions / self.events if self.events else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            socket.create_connection((LOOPBACK, port), 0.5).close()
            return True
        except OSError:
            time.sleep(0.3)
    return False


async def drive(
    port: int, count: int, body: bytes, conc: int, headers: dict[str, str], path: str = PATH
) -> tuple[int, int, int]:
    """Send ``count`` POSTs, ``conc`` at a time; returns (failed, SSE events, body reads)."""
    headers = {"content-type": "application/json", **headers}
    failed = events = reads = 0
    sem = asyncio.Semaphore(conc)
    url = f"http://{LOOPBACK}:{port}{path}"
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> None:
            nonlocal failed, events, reads
            async with sem, session.post(url, data=body, headers=headers) as resp:
                data = bytearray()
                async for chunk in resp.content.iter_any():
                    data += chunk
                    reads += 1
                failed += resp.status != 200
                events += data.count(b"\ndata: ") + data.startswith(b"data: ")

        await asyncio.gather(*(one() for _ in range(count)))
    return failed, events, reads


def callgrind(cmd: list[str], env: dict[str, str], work: Path) -> subprocess.Popen[bytes]:
    out = work / "cg.out"
    log = open(work / "valgrind.log", "w")  # closed with the process
    return subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p"]
        + cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=work,
        start_new_session=True,
    )


def control(pid: int, *args: str) -> None:
    subprocess.run(
        ["callgrind_control", *args, str(pid)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=120,
    )


def dump_instructions(pid: int, work: Path) -> int:
    """Dump the counters (which zeroes them) and return the dump's total."""
    before = set(glob.glob(str(work / "cg.out*")))
    control(pid, "-d")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for name in set(glob.glob(str(work / "cg.out*"))) - before:
            # "summary:" is in the head (0 while the file is written), "totals:" closes it.
            text = Path(name).read_text(errors="replace")
            found = [int(m.group(1)) for m in re.finditer(r"^totals:\s+(\d+)", text, re.M)]
            if found:
                return max(found)
        time.sleep(0.2)
    raise RuntimeError(f"callgrind wrote no dump into {work}")


def skipped_row(target: Target, phase: Phase) -> Row:
    return Row(phase.row, target.name, target.tree, 0, 0, 0, kind=phase.kind, skipped=phase.skip)


def measure(target: Target, args: argparse.Namespace) -> list[Row]:
    if all(phase.skip for phase in target.phases):
        skipped = [skipped_row(target, phase) for phase in target.phases]
        for row in skipped:
            print(_line(row), flush=True)
        return skipped
    work = Path(tempfile.mkdtemp(prefix=f"instr-{target.name}-"))
    proc = callgrind(target.cmd, target.env, work)
    rows: list[Row] = []
    try:
        if not wait_port(target.port, target.wait, proc):
            tail = (work / "valgrind.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{target.name}: port {target.port} never opened:\n{tail}")
        for phase in target.phases:
            if phase.skip:
                rows.append(skipped_row(target, phase))
                print(_line(rows[-1]), flush=True)
                continue
            headers = dict(phase.headers)
            if target.auth:
                headers["Authorization"] = f"Bearer {target.auth}"
            if phase.sse:
                count, warmup, conc = args.sse_count, args.sse_warmup, args.sse_concurrency
            else:
                count, warmup, conc = args.count, args.warmup, args.concurrency
            asyncio.run(drive(target.port, warmup, phase.body, conc, headers, phase.path))
            control(proc.pid, "-i", "on")
            start = time.monotonic()
            failed, events, reads = asyncio.run(
                drive(target.port, count, phase.body, conc, headers, phase.path)
            )
            seconds = time.monotonic() - start
            control(proc.pid, "-i", "off")
            total = dump_instructions(proc.pid, work)
            row = Row(
                phase.row,
                target.name,
                target.tree,
                total,
                count,
                failed,
                events if phase.sse else 0,
                reads if phase.sse else 0,
                round(seconds, 2),
                kind=phase.kind,
            )
            rows.append(row)
            print(_line(row), flush=True)
        return rows
    finally:
        u.stop_process(proc)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def proxy_toml(port: int, origin: str, *, http2: bool, cache: bool) -> str:
    text = f"""
[server]
host = "{LOOPBACK}"
port = {port}
grace_period = 1.0

[admin]
enabled = false

[upstream]
http2 = {str(http2).lower()}
max_connections = 8
http1_max_connections = 100

[[regions]]
name = "origin"
url = "{origin}"

[plugins]
entry_points = false
"""
    if cache:
        text += '\n[cache]\nbackend = "memory"\nxfetch_beta = 0.0\n'
    return text


def litellm_yaml(origin: Origin, key: str) -> str:
    return f"""
model_list:
  - model_name: m
    litellm_params:
      model: openai/m
      api_base: {origin.h1}/v1
      api_key: sk-bench
  - model_name: s
    litellm_params:
      model: openai/s
      api_base: {origin.sse_h1}/v1
      api_key: sk-bench
general_settings:
  master_key: {key}
  disable_spend_logs: true
litellm_settings:
  telemetry: false
"""


def litellm_target(
    venv: Path, origin: Origin, args: argparse.Namespace, work: Path
) -> Target | str:
    """The LiteLLM proxy from ``venv``, or why it cannot be measured."""
    python, script = venv / "bin" / "python", venv / "bin" / "litellm"
    if not (python.exists() and script.exists()):
        return f"{venv} has no bin/litellm (pip install 'litellm[proxy]' there)"
    key = "sk-" + secrets.token_hex(32)
    cfg = work / "litellm.yaml"
    cfg.write_text(litellm_yaml(origin, key))
    port = free_port()
    cmd = [str(python), str(script), "--config", str(cfg), "--host", LOOPBACK]
    cmd += ["--port", str(port), "--num_workers", "1"]
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
    env.pop("PYTHONPATH", None)
    phases = [
        Phase("litellm", BYPASS, False, kind="json"),
        Phase("litellm sse", stream_body(args.events, "s"), True, kind="sse"),
    ]
    phases = [p for p in phases if p.kind in args.kinds]
    return Target("litellm", "-", cmd, env, port, phases, args.litellm_wait, auth=key)


# Asked in a tree's own interpreter: which API paths its endpoint table knows.
_PROBE = """
import json, sys
try:
    from edgeproxy._protocol.endpoints import openai_endpoint
except ImportError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    print(json.dumps({p: openai_endpoint(p) is not None for p in sys.argv[1:]}))
"""


def missing_apis(tree: Path, kinds: list[str]) -> dict[str, str]:
    """The API streams among ``kinds`` that ``tree``'s edgeproxy has no endpoint for, each
    with the reason its rows give: such a tree would relay them as plain bytes, which is
    not the same measurement, so they are skipped there."""
    paths = [API_PATHS[k] for k in kinds if k in API_PATHS]
    if not paths:
        return {}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *paths],
        env=dict(os.environ, PYTHONPATH=str(tree)),
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        known = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        why = f"skipped: edgeproxy there does not import ({last})"
        return {k: why for k in kinds if k in API_PATHS}
    if "error" in known:
        # Older than the endpoint table: nothing there to say it knows these APIs.
        return {
            k: f"skipped: no endpoint table there to know {API_PATHS[k]} ({known['error']})"
            for k in kinds
            if k in API_PATHS
        }
    return {
        kind: f"skipped: the endpoint table there has no {path}"
        for kind, path in API_PATHS.items()
        if path in paths and not known.get(path)
    }


def phases_for(
    name: str,
    kinds: list[str],
    args: argparse.Namespace,
    sse_headers: dict[str, str],
    *,
    json_body: bytes = BYPASS,
    missing: dict[str, str] | None = None,
) -> list[Phase]:
    """A target's phases for the selected ``kinds``, in the table's order."""
    missing = missing or {}
    phases = []
    for kind in KINDS:
        if kind not in kinds:
            continue
        if kind == "json":
            phases.append(Phase(name, json_body, False, kind=kind))
        elif kind == "sse":
            phases.append(Phase(f"{name} sse", stream_body(args.events), True, sse_headers, kind))
        else:
            body, headers = (
                (responses_request(args.events), {})
                if kind == "responses"
                else (messages_request(args.events), dict(MESSAGES_HEADERS))
            )
            row = f"{name} {API_ROWS[kind]}"
            path, skip = API_PATHS[kind], missing.get(kind, "")
            phases.append(Phase(row, body, True, headers, kind, path, skip))
    return phases


def targets(origin: Origin, args: argparse.Namespace, work: Path) -> Iterator[Target | str]:
    """Each target to measure, or a line saying why one is skipped."""
    sse = {SSE_HEADER: "1"} if origin.kind == "nginx" else {}
    kinds: list[str] = args.kinds
    if "reference" in args.targets:
        port = free_port()
        cmd = [sys.executable, str(HERE / "reference_proxy.py"), "--port", str(port)]
        cmd += ["--upstream", origin.h1]
        phases = phases_for("reference", kinds, args, sse)
        yield Target("reference", "-", cmd, dict(os.environ), port, phases, args.wait)
    if "canned" in args.targets and "json" in kinds:
        port = free_port()
        cmd = [sys.executable, str(HERE / "reference_proxy.py"), "--port", str(port), "--canned"]
        phases = phases_for("canned", ["json"], args, sse, json_body=HIT)
        yield Target("canned", "-", cmd, dict(os.environ), port, phases, args.wait)
    if "nginx" in args.targets:
        nginx = None if args.skip_nginx else u.nginx_binary()
        if nginx is None:
            why = "--skip-nginx given" if args.skip_nginx else "nginx is not installed"
            yield f"nginx: skipped ({why})"
        else:
            port = free_port()
            prefix = work / "nginx-proxy"
            (prefix / "logs").mkdir(parents=True)
            conf = prefix / "nginx.conf"
            upstream_port = int(origin.h1.rsplit(":", 1)[1])
            conf.write_text(u.nginx_proxy_conf(port, upstream_port, 100))
            cmd = [nginx, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
            cmd += ["-g", "daemon off; master_process off;"]
            phases = phases_for("nginx", kinds, args, sse)
            yield Target("nginx", "-", cmd, dict(os.environ), port, phases, args.wait)
    trees = [("now", ROOT), *((name, Path(tree).resolve()) for name, tree in args.trees)]
    for tree_name, tree in trees:
        env = dict(os.environ, PYTHONPATH=str(tree))
        missing = missing_apis(tree, kinds) if {"h1", "h2c"} & set(args.targets) else {}
        for kind, why in missing.items():
            print(f"{tree_name} ({tree}): {API_PATHS[kind]} {why}", flush=True)
        for name, http2, cache, phases in (
            ("h1", False, False, phases_for("h1", kinds, args, sse, missing=missing)),
            ("h2c", True, False, phases_for("h2c", kinds, args, sse, missing=missing)),
            (
                "hit",
                False,
                True,
                phases_for("hit", [k for k in kinds if k == "json"], args, sse, json_body=HIT),
            ),
        ):
            if name not in args.targets:
                continue
            if not phases:
                if name in args.only and tree_name == "now":
                    yield f"{name}: skipped (asked JSON requests only; no json in --only)"
                continue
            port = free_port()
            conf = work / f"edge-{tree_name}-{name}.toml"
            url = origin.h2c if http2 else origin.h1
            conf.write_text(proxy_toml(port, url, http2=http2, cache=cache))
            cmd = [sys.executable, "-m", "edgeproxy", "serve", "--config", str(conf)]
            yield Target(name, tree_name, cmd, env, port, phases, args.wait)
    if "litellm" in args.targets and {"json", "sse"} & set(kinds):
        if not args.litellm_venv:
            yield "litellm: skipped (no --litellm-venv PATH given)"
        else:
            yield litellm_target(Path(args.litellm_venv), origin, args, work)


@contextlib.contextmanager
def origin_for(args: argparse.Namespace) -> Iterator[Origin]:
    nginx = None if args.skip_nginx else u.nginx_binary()
    if nginx:
        with nginx_origin(nginx, args.events, args.pace, keep=args.keep) as origin:
            yield origin
    else:
        reason = "--skip-nginx was given" if args.skip_nginx else "nginx is not installed"
        with fake_origin(args.events, args.pace, reason) as origin:
            yield origin


def run(args: argparse.Namespace) -> tuple[list[Row], list[str], Origin]:
    rows: list[Row] = []
    skipped: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="instr-conf-"))
    try:
        with origin_for(args) as origin:
            print(f"upstream: {origin.describe}", flush=True)
            for target in targets(origin, args, work):
                if isinstance(target, str):
                    skipped.append(target)
                    print(target, flush=True)
                    continue
                try:
                    rows += measure(target, args)
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    if target.name != "litellm":
                        raise
                    line = f"litellm: skipped ({exc})".splitlines()[0]
                    skipped.append(line)
                    print(f"{line}\n{exc}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return rows, skipped, origin


def _ref_for(row: Row, rows: list[Row]) -> Row | None:
    """The reference row of the same kind of request (JSON, or the same API's stream)."""
    if row.skipped:
        return None
    if row.kind:
        found = (r for r in rows if r.process == "reference" and r.kind == row.kind)
        return next((r for r in found if not r.skipped), None)
    want = "reference sse" if row.events else "reference"
    return next((r for r in rows if r.name == want), None)


def _json_twin(row: Row, rows: list[Row]) -> Row | None:
    """The same process's JSON request, for a chat stream's marginal cost per event (the
    other APIs' streams have no JSON request of their own API in the run)."""
    if row.kind not in ("sse", ""):
        return None
    return next(
        (
            r
            for r in rows
            if r.process == row.process
            and r.tree == row.tree
            and not r.events
            and not r.skipped
            and r.kind in ("json", "")
        ),
        None,
    )


def _line(row: Row) -> str:
    if row.skipped:
        return f"{row.name:18} {row.tree:8} {row.skipped}"
    text = f"{row.name:18} {row.tree:8} {row.per_request / 1000:10,.0f} k/req"
    if row.events:
        text += f"  {row.per_event / 1000:,.1f} k/event"
    return text + f"  ({row.failed} failed, {row.seconds:g} s)"


def table(rows: list[Row]) -> str:
    lines = [
        "| target | tree | instructions per request | x reference | per SSE event "
        "| marginal per event | client reads per event | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.name} | {r.tree} | {r.skipped} | - | - | - | - | - |")
            continue
        ref = _ref_for(r, rows)
        ratio = f"{r.per_request / ref.per_request:.2f}" if ref else "-"
        per_event = marginal = reads = "-"
        if r.events:
            per_event = f"{r.per_event / 1000:,.1f} k"
            twin = _json_twin(r, rows)
            if twin:
                extra = (r.per_request - twin.per_request) / (r.events / r.requests)
                marginal = f"{extra / 1000:,.1f} k"
            reads = f"{r.reads / r.events:.2f}"
        lines.append(
            f"| {r.name} | {r.tree} | {r.per_request / 1000:,.0f} k | {ratio} | {per_event} "
            f"| {marginal} | {reads} | {r.failed} |"
        )
    return "\n".join(lines)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def named_trees(parser: argparse.ArgumentParser, given: list[str]) -> list[tuple[str, str]]:
    """The ``--tree [NAME=]DIR`` arguments as (name, dir) pairs, 'before' unless named;
    ``parser`` refuses a folder without edgeproxy in it, or two trees of one name."""
    trees = []
    for one in given:
        name, _, tree = one.rpartition("=")
        if not (Path(tree) / "edgeproxy").is_dir():
            parser.error(f"--tree {one}: no edgeproxy package there")
        trees.append((name or "before", tree))
    if len({name for name, _ in trees}) < len(trees):
        parser.error("--tree: each tree needs a name of its own (NAME=DIR)")
    return trees


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run for CI")
    parser.add_argument("--count", type=int, help="counted JSON requests (300; quick 60)")
    parser.add_argument("--warmup", type=int, help="uncounted JSON requests first (200; 60)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sse-count", type=int, help="counted streamed requests (60; quick 12)")
    parser.add_argument("--sse-warmup", type=int, help="uncounted streamed requests (20; 6)")
    parser.add_argument("--sse-concurrency", type=int, default=2)
    parser.add_argument("--events", type=int, default=100, help="tokens per streamed answer")
    parser.add_argument("--pace", type=float, default=10.0, help="ms between streamed events")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="another checkout of edgeproxy to measure beside this one, its rows named NAME "
        "('before' unless named); may be given more than once",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        choices=[*TARGETS, *KINDS],
        metavar="NAME",
        help=f"targets ({', '.join(TARGETS)}; all when none is named) and requests "
        f"({', '.join(KINDS)}: the JSON request, the chat, Responses and Messages streams; "
        "all when none is named)",
    )
    parser.add_argument("--skip-nginx", action="store_true", help="no nginx, even if installed")
    parser.add_argument("--litellm-venv", help="a venv with litellm[proxy]: adds its rows")
    parser.add_argument("--wait", type=float, default=240.0, help="seconds for a port to open")
    parser.add_argument(
        "--litellm-wait", type=float, default=900.0, help="the same for LiteLLM (slow to start)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the callgrind files")
    parser.add_argument(
        "--wallclock",
        action="store_true",
        help="then bench_proxy.py's throughput table (--quick with --quick), in the same run",
    )
    args = parser.parse_args(argv)
    args.trees = named_trees(parser, args.tree)
    args.targets = [t for t in TARGETS if t in args.only] or list(TARGETS)
    args.kinds = [k for k in KINDS if k in args.only] or list(KINDS)
    # A SIGTERM (CI's timeout) unwinds, so that the servers this started are stopped.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    quick = args.quick
    for name, full, short in (
        ("count", 300, 60),
        ("warmup", 200, 60),
        ("sse_count", 60, 12),
        ("sse_warmup", 20, 6),
    ):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    for name in ("count", "sse_count", "concurrency", "sse_concurrency", "events"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instr: valgrind is not installed (Debian: apt-get install valgrind); skipped")
        return 0
    raise_nofile()
    started = time.monotonic()
    rows, skipped, origin = run(args)
    text = table(rows)
    notes = [f"upstream: {origin.describe}"] + skipped
    print(text)
    print(f"({time.monotonic() - started:.0f} s)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "instr.md").write_text(text + "\n\n" + "\n".join(f"* {n}" for n in notes) + "\n")
    data = {
        "upstream": origin.kind,
        "upstream_detail": origin.describe,
        "skipped": skipped,
        "settings": {k: v for k, v in vars(args).items() if k != "keep"},
        "rows": [asdict(r) | {"per_request": None if r.skipped else r.per_request} for r in rows],
    }
    (RESULTS / "instr.json").write_text(json.dumps(data, indent=2) + "\n")
    failed = any(r.failed for r in rows)
    if args.wallclock:
        failed |= wallclock(args, rows) != 0
    return 1 if failed else 0


def wallclock(args: argparse.Namespace, rows: list[Row]) -> int:
    """bench_proxy.py's closed-loop throughput section, run right after the count, with
    its table and the instruction ratios side by side in ``instr.md``."""
    cmd = [sys.executable, str(HERE / "bench_proxy.py"), "--only", "throughput"]
    cmd += ["--results", str(RESULTS)] + (["--quick"] if args.quick else [])
    cmd += ["--skip-nginx"] if args.skip_nginx else []
    print(f"\nwall-clock: {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    proxy_md = RESULTS / "proxy.md"
    if rc != 0 or not proxy_md.exists():
        print(f"wall-clock: bench_proxy.py failed (exit {rc})")
        return rc or 1
    ratios = ["| target | instructions x reference |", "| --- | --- |"]
    ref = next((r for r in rows if r.name == "reference"), None)
    for r in rows:
        if ref and not r.events and not r.skipped and r.tree == "now":
            ratios.append(f"| {r.name} | {r.per_request / ref.per_request:.2f} |")
    text = (
        "\n\n## Wall-clock, same run (bench_proxy.py --only throughput)\n\n"
        + "\n".join(ratios)
        + "\n\n"
        + proxy_md.read_text()
    )
    with (RESULTS / "instr.md").open("a") as fh:
        fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
