"""The operator's commands (status, top, reload, purge, bench-client) against running proxies:
in process for most, ``serve --workers 2`` for the supervisor's workers and reload, and
``top`` drawn in a pseudo-terminal."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import pty
import re
import select
import signal
import socket
import ssl
import struct
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import aiohttp
import pytest
import trustme
from aiohttp import web

from edgeproxy import EdgeProxy
from edgeproxy._cli import main
from edgeproxy._opscli import MAX_CONCURRENCY, MAX_REQUESTS, TOKEN_ENV

from .conftest import ProxyFactory, RegionFactory, spawn_serve

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
CACHED = {**BODY, "temperature": 0}
_ANSI = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][A-Z0-9]|[=>])")


async def run_cli(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``edgeproxy argv`` in a thread (it is blocking; the proxy runs on this loop)."""
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def send(url: str, body: dict[str, object], n: int = 1) -> list[dict[str, str]]:
    heads = []
    async with aiohttp.ClientSession() as client:
        for _ in range(n):
            async with client.post(url + CHAT, json=body) as resp:
                assert resp.status == 200
                await resp.read()
                heads.append(dict(resp.headers))
    return heads


async def two_regions(make_region: RegionFactory, make_proxy: ProxyFactory) -> EdgeProxy:
    ap = await make_region("ap-1")
    eu = await make_region("eu-1")
    return await make_proxy([ap, eu])


async def counted(proxy: EdgeProxy, requests: int) -> None:
    """Until the recent window holds ``requests`` (a request is counted once it completes,
    which may be just after its client has read the answer)."""
    for _ in range(500):
        if proxy.status()["recent"]["requests"] == requests:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the recent window never held {requests} requests")


async def stored(proxy: EdgeProxy) -> None:
    """Until the one cacheable answer sent is stored, and no lookup waits on its flight."""
    for _ in range(500):
        cache = proxy.pipeline.cache
        if proxy.status()["cache"]["stores"] == 1 and not cache.coalescer.flights:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the answer was never stored")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_status_prints_regions_cache_and_local_model(
    make_region: RegionFactory, make_proxy: ProxyFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = await two_regions(make_region, make_proxy)
    await send(proxy.url, BODY, 6)
    await send(proxy.url, CACHED)  # a miss, stored
    await stored(proxy)
    await send(proxy.url, CACHED)  # a hit
    await counted(proxy, 8)

    code, out, err = await run_cli(["status", "--admin", proxy.admin_url], capsys)
    assert code == 0, err
    assert "PoP edge-test" in out and "ready" in out
    for name in ("ap-1", "eu-1"):
        row = next(line for line in out.splitlines() if name in line)
        assert "up" in row and "ok" in row
    for column in ("EWMA", "TTFB", "flight", "share", "requests", "errors"):
        assert column in out
    assert "last 300s: 8 requests, 0 errors" in out
    assert "hit ratio 50.0%" in out
    assert "local model: off" in out
    assert "workers" not in out  # a single process has none

    code, out, _ = await run_cli(["status", "--json", "--admin", proxy.admin_url], capsys)
    assert code == 0 and '"regions"' in out


async def test_unreachable_admin_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    admin = f"http://127.0.0.1:{closed_port()}"
    for argv in (["status"], ["top", "--once"], ["reload"], ["purge", "--prefix", ""]):
        code, out, err = await run_cli([*argv, "--admin", admin], capsys)
        assert code == 1
        assert err.startswith(f"edgeproxy: cannot reach the admin listener at {admin}")
        assert err.count("\n") == 1 and "Traceback" not in err

    code, _, err = await run_cli(["status", "--admin", "ftp://x"], capsys)
    assert code == 1 and "http:// or https://" in err
    code, _, err = await run_cli(["status", "--cacert", "/nonexistent/ca.pem"], capsys)
    assert code == 1 and "--cacert /nonexistent/ca.pem" in err and "Traceback" not in err


async def test_the_token_is_sent_and_a_refusal_says_how_to_give_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def status(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer s3cret":
            return web.json_response({"error": {"message": "a bearer token is needed"}}, status=401)
        return web.json_response({"pop": "tokened", "ready": True, "regions": []})

    app = web.Application()
    app.router.add_get("/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    admin = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        code, _, err = await run_cli(["status", "--admin", admin], capsys)
        assert code == 1 and "refused the request (401: a bearer token is needed)" in err
        assert f"--token or set {TOKEN_ENV}" in err

        code, out, _ = await run_cli(["status", "--admin", admin, "--token", "s3cret"], capsys)
        assert code == 0 and "PoP tokened" in out

        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        code, out, _ = await run_cli(["status", "--admin", admin], capsys)
        assert code == 0 and "PoP tokened" in out
    finally:
        await runner.cleanup()


async def test_an_https_admin_is_verified_with_cacert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_context)
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))

    async def status(request: web.Request) -> web.Response:
        return web.json_response({"pop": "tls", "ready": True, "regions": []})

    app = web.Application()
    app.router.add_get("/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context)
    await site.start()
    admin = f"https://127.0.0.1:{runner.addresses[0][1]}"
    try:
        code, out, err = await run_cli(
            ["status", "--admin", admin, "--cacert", str(ca_path)], capsys
        )
        assert code == 0, err
        assert "PoP tls" in out
        # Without the CA the system's trust store does not know the certificate.
        code, _, err = await run_cli(["status", "--admin", admin], capsys)
        assert code == 1 and "CERTIFICATE_VERIFY_FAILED" in err
        assert err.count("\n") == 1 and "Traceback" not in err
    finally:
        await runner.cleanup()


async def test_reload_of_an_embedded_proxy_exits_non_zero(
    make_region: RegionFactory, make_proxy: ProxyFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = await make_proxy([await make_region("ap-1")])
    code, _, err = await run_cli(["reload", "--admin", proxy.admin_url], capsys)
    assert code == 1
    assert "cannot reload: this proxy has no config file to read again" in err


async def test_purge_by_key_prefix_and_tenant(
    make_region: RegionFactory, make_proxy: ProxyFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = await make_proxy([await make_region("ap-1")])
    (head,) = await send(proxy.url, CACHED)
    key = head["X-Edgeproxy-Cache-Key"]
    await stored(proxy)
    admin = ["--admin", proxy.admin_url]

    code, out, err = await run_cli(["purge", "--key", key, *admin], capsys)
    assert code == 0, err
    assert out.startswith("purged 1 entries (key ")
    code, out, _ = await run_cli(["purge", "--tenant", "nobody", *admin], capsys)
    assert code == 0 and out.startswith("purged 0 entries (tenant 'nobody')")
    code, out, _ = await run_cli(["purge", "--prefix", "", *admin], capsys)
    assert code == 0 and out.startswith("purged 0 entries (prefix '')")

    code, _, err = await run_cli(["purge", "--key", "", *admin], capsys)
    assert code == 1 and "'key' must be a non-empty string" in err
    with pytest.raises(SystemExit) as exit_:
        main(["purge", "--key", "a", "--tenant", "b"])
    assert exit_.value.code == 2


async def test_bench_client_counts_latency_and_ttfb(
    make_region: RegionFactory, make_proxy: ProxyFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = await make_proxy([await make_region("ap-1")])
    for stream in ([], ["--stream"]):
        argv = ["bench-client", proxy.url, "--requests", "12", "--concurrency", "3", *stream]
        code, out, err = await run_cli(argv, capsys)
        assert code == 0, err
        assert out.startswith("requests    12, concurrency 3,")
        assert "errors      0" in out and "statuses    200: 12" in out
        assert re.search(r"latency ms  p50 [\d.]+  p95 [\d.]+  p99 [\d.]+", out)
        assert re.search(r"TTFB ms     p50 [\d.]+  p95 [\d.]+  p99 [\d.]+", out)


async def test_bench_client_failures_and_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    code, out, err = await run_cli(["bench-client", url, "--requests", "3"], capsys)
    assert code == 1
    assert "errors      3" in out and "ConnectError: 3" in out
    assert err == "edgeproxy: 3 of 3 requests failed\n"
    for flag, value in (("--requests", MAX_REQUESTS + 1), ("--concurrency", MAX_CONCURRENCY + 1)):
        with pytest.raises(SystemExit) as exit_:
            main(["bench-client", url, flag, str(value)])
        assert exit_.value.code == 2
        assert "out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench-client", url, "--requests", "0"])


# -- top in a pseudo-terminal -------------------------------------------------------------


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def in_pty(
    argv: Sequence[str], columns: int = 140, rows: int = 60, *, ignore_sigint: bool = False
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "PYTHONUNBUFFERED": "1"}
    for name in ("COLUMNS", "LINES", "NO_COLOR", "TERM_PROGRAM"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgeproxy", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
        # As a backgrounded job of a non-interactive shell starts it: SIGINT ignored, which
        # exec passes on.
        preexec_fn=_ignore_sigint if ignore_sigint else None,
    )
    os.close(slave)
    try:
        yield proc, master
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        os.close(master)


def read_until(
    master: int, proc: subprocess.Popen[bytes], done: Callable[[str], bool], timeout: float
) -> str:
    """What the terminal shows, ANSI codes removed, once ``done(text)`` holds, the process
    exits, or the time is up."""
    raw = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            raw += chunk
            if done(_ANSI.sub("", raw.decode(errors="replace"))):
                break
        elif proc.poll() is not None:
            break
    return _ANSI.sub("", raw.decode(errors="replace"))


def _drawn(text: str) -> bool:
    return all(word in text for word in ("ap-1", "eu-1", "p50", "p95", "p99", "Ctrl-C quits"))


async def test_top_draws_regions_and_sparklines_in_a_pty(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    proxy = await two_regions(make_region, make_proxy)
    await send(proxy.url, BODY, 10)
    await counted(proxy, 10)

    argv = ["top", "--admin", proxy.admin_url, "--interval", "0.2", "--iterations", "3"]
    with in_pty(argv) as (proc, master):
        text = await asyncio.to_thread(read_until, master, proc, lambda _: False, 60)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    assert _drawn(text), text
    assert "edgeproxy top" in text and proxy.admin_url in text
    # The slot with the ten requests has numbers, so its sparklines are bars, not dots.
    for line in (
        next(x for x in text.splitlines() if x.strip(" │┃").startswith(q))
        for q in ("p50", "p95", "p99")
    ):
        assert re.search("[▁▂▃▄▅▆▇█]", line), line
    assert "regions" in text and "last 300s: 10 requests" in text

    # Without --iterations it runs until interrupted, and Ctrl-C ends it cleanly.
    with in_pty(["top", "--admin", proxy.admin_url, "--interval", "0.2"]) as (proc, master):
        text = await asyncio.to_thread(read_until, master, proc, _drawn, 60)
        assert _drawn(text), text
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, 30) == 0


async def test_top_ends_on_ctrl_c_even_when_its_parent_ignored_sigint(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    proxy = await two_regions(make_region, make_proxy)
    argv = ["top", "--admin", proxy.admin_url, "--interval", "0.2"]
    with in_pty(argv, ignore_sigint=True) as (proc, master):
        text = await asyncio.to_thread(read_until, master, proc, _drawn, 60)
        assert _drawn(text), text
        os.killpg(proc.pid, signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, 30) == 0


# -- against serve --workers 2 ------------------------------------------------------------

_SERVING = re.compile(r"serving on (http://\S+); admin on (http://\S+)")


def write_config(path: Path, region_url: str, workers: str = "2") -> None:
    path.write_text(
        "[server]\n"
        f'host = "127.0.0.1"\nport = 0\nworkers = {workers}\ngrace_period = 5.0\n'
        '[admin]\nhost = "127.0.0.1"\nport = 0\n'
        f'[[regions]]\nname = "ap-1"\nurl = "{region_url}"\n'
    )


@contextlib.asynccontextmanager
async def supervisor(config: Path) -> AsyncIterator[tuple[str, str]]:
    proc = await spawn_serve(
        config, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    log: list[str] = []
    started: asyncio.Future[tuple[str, ...]] = asyncio.get_running_loop().create_future()

    async def read() -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            log.append(raw.decode(errors="replace"))
            match = _SERVING.search(log[-1])
            if match and not started.done():
                started.set_result(match.groups())
        if not started.done():
            started.set_exception(AssertionError("exited:\n" + "".join(log)))

    reader = asyncio.create_task(read())
    try:
        url, admin = await asyncio.wait_for(started, 120)
        yield url, admin
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0, "".join(log[-20:])
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await asyncio.wait_for(reader, 30)


async def test_status_shows_workers_and_reload_applies_or_refuses(
    tmp_path: Path, make_region: RegionFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    # Serving the model asked for: a serve learns the region's from its /v1/models.
    region = await make_region("ap-1", model="m")
    config = tmp_path / "edge.toml"
    write_config(config, region.url)
    async with supervisor(config) as (url, admin):
        code, out, err = await run_cli(["status", "--json", "--admin", admin], capsys)
        assert code == 0, err
        pids = [w["pid"] for w in json.loads(out)["workers"]]
        assert len(pids) == 2
        code, out, err = await run_cli(["status", "--admin", admin], capsys)
        assert code == 0, err
        assert "ap-1" in out and "workers (supervisor pid" in out and "generation 1" in out
        for index, pid in enumerate(pids):
            assert re.search(rf"^\s*{index}\s+{pid}\s+1\s+yes\s", out, re.M), out

        code, out, err = await run_cli(["reload", "--admin", admin], capsys)
        assert code == 0, err
        assert out == "reloaded: generation 2 serving, the old workers draining\n"

        config.write_text(config.read_text().replace("workers = 2", "workers = 0"))
        code, out, err = await run_cli(["reload", "--admin", admin], capsys)
        assert code == 1
        assert err.startswith("edgeproxy: reload refused, the running config stays:\n")
        assert "workers" in err

        code, out, _ = await run_cli(["status", "--admin", admin], capsys)
        assert code == 0 and "generation 2" in out and "last reload refused" in out
        await send(url, BODY)
