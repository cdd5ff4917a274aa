"""The operator's commands on a running proxy, over its admin listener (httpx):
``status``, ``top``, ``reload``, ``purge``, and ``bench-client`` (a bounded load generator
for smoke tests, against the client listener).

Without ``--admin``, the admin listener's address is the ``[admin]`` section of the
config ``serve`` reads (``--config``, ``EDGEPROXY_CONFIG`` or the default path), else
:data:`DEFAULT_ADMIN` where there is no config at the default path.

Every failure to reach or use the admin listener is one line on stderr and exit code 1,
never a traceback; bad flags, and a config that does not load, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import signal
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson
from rich.console import Console
from rich.live import Live

from edgeproxy._core.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    ConfigError,
    find_config,
    load_found,
)
from edgeproxy._opsview import status_view, top_view

if TYPE_CHECKING:
    # Imported where a command runs: httpx (with what it pulls in) is most of the
    # command's start-up, and serve, check-config and config-docs never use it.
    import httpx

__all__ = ["DEFAULT_ADMIN", "MAX_CONCURRENCY", "MAX_REQUESTS", "TOKEN_ENV", "add_commands"]

DEFAULT_ADMIN = "http://127.0.0.1:9901"
TOKEN_ENV = "EDGEPROXY_ADMIN_TOKEN"
# bench-client is for smoke tests, not a load test: these bounds keep a typo harmless.
MAX_REQUESTS = 100_000
MAX_CONCURRENCY = 256
MIN_INTERVAL = 0.1


# What a failure to reach the listener suggests, wherever its address came from.
_WHERE_HINT = "set --admin URL or --config PATH"


class OpsError(Exception):
    """A failure the command reports on stderr, exiting ``code``: 1, or 2 for a config
    that does not load (as ``serve`` exits for it)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _fail(message: str, code: int = 1) -> int:
    print(f"edgeproxy: {message}", file=sys.stderr)
    return code


def _verify(cacert: str | None) -> ssl.SSLContext | bool:
    if cacert is None:
        return True
    try:
        return ssl.create_default_context(cafile=cacert)
    except (OSError, ssl.SSLError) as exc:
        raise OpsError(f"--cacert {cacert}: cannot load it: {exc}") from None


def _check_url(url: str, flag: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OpsError(f"{flag} {url!r}: give an http:// or https:// URL with a host")
    return url.rstrip("/")


def _error_text(response: httpx.Response) -> str:
    """The message of an answer in the OpenAI error shape, else its body's start."""
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return response.text[:200].strip() or response.reason_phrase


@dataclass(frozen=True, slots=True)
class AdminAddress:
    """Where the admin listener is, what said so, and the config's token if it has one."""

    url: str
    origin: str
    token: str | None = None


def admin_address(admin: str | None, config: str | None) -> AdminAddress:
    """``--admin`` if given; else the ``[admin]`` section of the config ``serve`` would
    read; else :data:`DEFAULT_ADMIN`, when no config names one and there is none at the
    default path. :class:`OpsError` (exit 2) when that config does not load."""
    if admin is not None:
        return AdminAddress(admin, "given by --admin")
    found = find_config(config)
    if not found.named and not Path(found.path).exists():
        return AdminAddress(
            DEFAULT_ADMIN,
            f"the default: no --admin, --config or {CONFIG_ENV}, and no {found.path}",
        )
    try:
        loaded = load_found(found).admin
    except ConfigError as exc:
        raise OpsError(f"{exc}\n(give --admin URL to skip the config)", code=2) from None
    where = f"{found.path}, " + ("named by " if found.named else "") + found.origin
    if not loaded.enabled:
        raise OpsError(f"[admin] of {where}: enabled = false, there is no listener to reach")
    if loaded.port == 0:
        raise OpsError(
            f"[admin] of {where}: port = 0 is picked when the proxy starts (it logs it);"
            " give --admin URL"
        )
    try:
        token = loaded.resolved_token()
    except ValueError:
        token = None  # the variable is the server's, not set here: --token gives it
    return AdminAddress(loaded.client_url(), f"from [admin] of {where}", token)


class Admin:
    """The admin listener at ``url``: requests with the token, errors as :class:`OpsError`.
    ``origin`` says where the URL came from, for the errors."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        cacert: str | None,
        timeout: float,
        origin: str = "given by --admin",
    ) -> None:
        self.url = _check_url(url, "--admin")
        self.origin = origin
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(
            base_url=self.url, headers=headers, verify=_verify(cacert), timeout=timeout
        )

    def close(self) -> None:
        self._client.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The answer, whatever its status, unless the listener cannot be used at all."""
        import httpx

        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise OpsError(
                f"the admin listener at {self.url} ({self.origin}) did not answer in time"
                f" ({_WHERE_HINT})"
            ) from None
        except httpx.HTTPError as exc:
            reason = str(exc) or type(exc).__name__
            raise OpsError(
                f"cannot reach the admin listener at {self.url} ({self.origin}): {reason}"
                f" ({_WHERE_HINT})"
            ) from None
        if response.status_code in (401, 403):
            raise OpsError(
                f"the admin listener at {self.url} refused the request"
                f" ({response.status_code}: {_error_text(response)});"
                f" give --token or set {TOKEN_ENV}"
            )
        return response

    def status(self) -> dict[str, Any]:
        """The decoded ``GET /status``."""
        response = self.request("GET", "/status")
        if response.status_code != 200:
            raise OpsError(
                f"GET {self.url}/status answered {response.status_code}: {_error_text(response)}"
            )
        return _json_object(response, f"GET {self.url}/status")


def _admin(args: argparse.Namespace) -> Admin:
    address = admin_address(args.admin, args.config)
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    return Admin(
        address.url,
        token=token if token is not None else address.token,
        cacert=args.cacert,
        timeout=args.timeout,
        origin=address.origin,
    )


def _with_admin(
    command: Callable[[argparse.Namespace, Admin], int],
) -> Callable[[argparse.Namespace], int]:
    """Run ``command(args, admin)``, turning :class:`OpsError` into its one line."""

    def run(args: argparse.Namespace) -> int:
        try:
            admin = _admin(args)
        except OpsError as exc:
            return _fail(str(exc), exc.code)
        try:
            return command(args, admin)
        except OpsError as exc:
            return _fail(str(exc), exc.code)
        except KeyboardInterrupt:
            return 130
        finally:
            admin.close()

    return run


def _json_object(response: httpx.Response, what: str) -> dict[str, Any]:
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        raise OpsError(f"{what} did not answer JSON") from None
    if not isinstance(body, dict):
        raise OpsError(f"{what} did not answer a JSON object")
    return body


def _console() -> Console:
    # Piped into a file or a script, rich would wrap the tables at 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=160)


def _cmd_status(args: argparse.Namespace, admin: Admin) -> int:
    status = admin.status()
    if args.json:
        sys.stdout.write(orjson.dumps(status, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    _console().print(status_view(status))
    return 0


def _cmd_top(args: argparse.Namespace, admin: Admin) -> int:
    console = _console()
    status = admin.status()  # a wrong URL or token fails here, at once
    error: str | None = None

    def frame() -> Any:
        updated = datetime.datetime.now().strftime("%H:%M:%S")
        return top_view(
            status,
            admin=admin.url,
            updated=updated,
            error=error,
            width=console.width,
            live=not args.once,
        )

    if args.once:
        console.print(frame())
        return 0
    if sys.stdin.isatty() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started from a shell or job that ignores SIGINT (inherited across exec): at a
        # terminal, Ctrl-C must still end the view.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    shown = 0
    try:
        with Live(frame(), console=console, auto_refresh=False, transient=False) as live:
            shown = 1
            while args.iterations is None or shown < args.iterations:
                time.sleep(args.interval)
                try:
                    status, error = admin.status(), None
                except OpsError as exc:
                    # Keep the last numbers on screen and keep trying: a restart is brief.
                    error = str(exc)
                live.update(frame(), refresh=True)
                shown += 1
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_reload(args: argparse.Namespace, admin: Admin) -> int:
    response = admin.request("POST", "/reload")
    if response.status_code == 200:
        body = _json_object(response, f"POST {admin.url}/reload")
        # A single process reloads in place; the supervisor by new workers.
        old = "the old generation" if body.get("in_place") else "the old workers"
        print(f"reloaded: generation {body.get('generation')} serving, {old} draining")
        return 0
    if response.status_code == 409 and "reload_unsupported" in response.text:
        # A proxy embedded in a host application: serve, one process or several, reloads.
        return _fail(f"{admin.url} cannot reload: {_error_text(response)}")
    if response.status_code in (404, 405):
        return _fail(f"{admin.url} has no POST /reload (an older edgeproxy): restart it")
    message = _error_text(response)
    if response.status_code == 409:
        return _fail(f"reload refused, the running config stays:\n{message}")
    return _fail(f"POST {admin.url}/reload answered {response.status_code}: {message}")


def _cmd_purge(args: argparse.Namespace, admin: Admin) -> int:
    name, value = next(
        (name, getattr(args, name))
        for name in ("key", "prefix", "tenant")
        if getattr(args, name) is not None
    )
    response = admin.request("POST", "/cache/purge", json={name: value})
    if response.status_code != 200:
        return _fail(
            f"POST {admin.url}/cache/purge answered {response.status_code}: {_error_text(response)}"
        )
    body = _json_object(response, f"POST {admin.url}/cache/purge")
    where = f" on {body['workers']} workers" if "workers" in body else ""
    print(f"purged {body.get('purged', 0)} entries{where} ({name} {value!r})")
    return 0


# -- bench-client -----------------------------------------------------------------------


@dataclass
class BenchResult:
    """What one bench-client run saw."""

    requests: int
    concurrency: int
    elapsed: float = 0.0
    latencies: list[float] = field(default_factory=list)
    ttfbs: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    first_error: str | None = None

    def count(self, outcome: str, error: str | None = None) -> None:
        self.statuses[outcome] = self.statuses.get(outcome, 0) + 1
        if error is not None:
            self.errors += 1
            self.first_error = self.first_error or error


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` percentile (0-1) of ``values``, None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _bench_url(url: str) -> str:
    url = _check_url(url, "URL")
    return url + "/v1/chat/completions" if urlsplit(url).path in ("", "/") else url


async def _one(client: httpx.AsyncClient, url: str, body: bytes, result: BenchResult) -> None:
    import httpx

    start = time.perf_counter()
    ttfb: float | None = None
    try:
        async with client.stream(
            "POST", url, content=body, headers={"Content-Type": "application/json"}
        ) as response:
            tail = b""
            async for chunk in response.aiter_raw():
                if ttfb is None:
                    ttfb = time.perf_counter() - start
                # An SSE stream that fails after its 200 ends with an error event.
                tail = (tail + chunk)[-4096:]
            end = time.perf_counter()
    except httpx.HTTPError as exc:
        result.count(type(exc).__name__, f"{type(exc).__name__}: {exc}")
        return
    result.latencies.append(end - start)
    if ttfb is not None:
        result.ttfbs.append(ttfb)
    status = response.status_code
    if status >= 400:
        result.count(str(status), f"{status}: {tail[:200].decode(errors='replace')}")
    elif b"event: error" in tail:
        result.count(f"{status} stream error", "an SSE stream ended with an error event")
    else:
        result.count(str(status))


async def run_bench(
    url: str,
    *,
    requests: int,
    concurrency: int,
    stream: bool,
    model: str,
    timeout: float,
    verify: ssl.SSLContext | bool = True,
) -> BenchResult:
    """Send ``requests`` chat completions to ``url``, ``concurrency`` at a time."""
    import httpx

    body = orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 16,
            "stream": stream,
        }
    )
    result = BenchResult(requests, concurrency)
    left = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        for _ in left:
            await _one(client, url, body, result)

    async with httpx.AsyncClient(limits=limits, timeout=timeout, verify=verify) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(min(concurrency, requests))))
        result.elapsed = time.perf_counter() - start
    return result


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def bench_report(result: BenchResult) -> str:
    """The lines bench-client prints."""
    rate = len(result.latencies) / result.elapsed if result.elapsed > 0 else 0.0
    lines = [
        f"requests    {result.requests}, concurrency {result.concurrency},"
        f" {result.elapsed:.2f} s, {rate:.1f} req/s",
        f"errors      {result.errors}",
    ]
    for name, values in (("latency ms", result.latencies), ("TTFB ms", result.ttfbs)):
        lines.append(
            f"{name:<11} p50 {_ms(percentile(values, 0.5))}  p95 {_ms(percentile(values, 0.95))}"
            f"  p99 {_ms(percentile(values, 0.99))}"
        )
    lines.append(
        "statuses    " + ", ".join(f"{k}: {v}" for k, v in sorted(result.statuses.items()))
    )
    if result.first_error:
        lines.append(f"first error {result.first_error}")
    return "\n".join(lines)


def _cmd_bench_client(args: argparse.Namespace) -> int:
    try:
        url = _bench_url(args.url)
        verify = _verify(args.cacert)
    except OpsError as exc:
        return _fail(str(exc))
    result = asyncio.run(
        run_bench(
            url,
            requests=args.requests,
            concurrency=args.concurrency,
            stream=args.stream,
            model=args.model,
            timeout=args.timeout,
            verify=verify,
        )
    )
    print(bench_report(result))
    if result.errors:
        return _fail(f"{result.errors} of {result.requests} requests failed")
    return 0


# -- the parser ---------------------------------------------------------------------------


def _bounded(kind: type[int] | type[float], low: float, high: float) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is out of range [{low:g}, {high:g}]")
        return value

    return parse


def _connection_flags(parser: argparse.ArgumentParser, *, admin: bool) -> None:
    if admin:
        parser.add_argument(
            "--admin",
            default=None,
            help=f"admin listener URL (default: [admin] of the config, else {DEFAULT_ADMIN})",
        )
        parser.add_argument(
            "--config",
            default=None,
            help=f"the config whose [admin] to reach, as serve reads it (default:"
            f" ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH} where it exists)",
        )
        parser.add_argument(
            "--token", default=None, help=f"admin bearer token (default: ${TOKEN_ENV})"
        )
    parser.add_argument("--cacert", help="CA certificate file to verify an https listener")
    parser.add_argument(
        "--timeout",
        type=_bounded(float, 0.1, 3600),
        default=10.0,
        help="seconds per request (default 10)",
    )


def add_commands(sub: Any) -> None:
    """Add status, top, reload, purge and bench-client to the ``edgeproxy`` subparsers."""
    status = sub.add_parser("status", help="the regions, cache, local model and workers, once")
    _connection_flags(status, admin=True)
    status.add_argument("--json", action="store_true", help="print /status as JSON")
    status.set_defaults(func=_with_admin(_cmd_status))

    top = sub.add_parser("top", help="a live view of status with p50/p95/p99 sparklines")
    _connection_flags(top, admin=True)
    top.add_argument(
        "--interval",
        type=_bounded(float, MIN_INTERVAL, 3600),
        default=2.0,
        help="seconds between updates (default 2)",
    )
    runs = top.add_mutually_exclusive_group()
    runs.add_argument("--once", action="store_true", help="print one frame and exit")
    runs.add_argument(
        "--iterations", type=_bounded(int, 1, 10**9), help="exit after this many frames"
    )
    top.set_defaults(func=_with_admin(_cmd_top))

    reload = sub.add_parser(
        "reload",
        help="reload the running proxy's config from its file; non-zero with the errors if refused",
    )
    _connection_flags(reload, admin=True)
    reload.set_defaults(func=_with_admin(_cmd_reload))

    purge = sub.add_parser("purge", help="purge cache entries on every worker")
    _connection_flags(purge, admin=True)
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--key", help="one entry, as X-Edgeproxy-Cache-Key names it")
    which.add_argument("--prefix", help='entries whose key starts with it ("" purges all)')
    which.add_argument("--tenant", help="every entry of this tenant")
    purge.set_defaults(func=_with_admin(_cmd_purge))

    bench = sub.add_parser(
        "bench-client", help="a small bounded load of chat completions, for smoke tests"
    )
    bench.add_argument("url", help="the proxy's URL (its path defaults to /v1/chat/completions)")
    bench.add_argument(
        "--requests",
        type=_bounded(int, 1, MAX_REQUESTS),
        default=100,
        help=f"requests in all (default 100, at most {MAX_REQUESTS})",
    )
    bench.add_argument(
        "--concurrency",
        type=_bounded(int, 1, MAX_CONCURRENCY),
        default=8,
        help=f"requests at a time (default 8, at most {MAX_CONCURRENCY})",
    )
    bench.add_argument("--stream", action="store_true", help="ask for SSE answers")
    bench.add_argument("--model", default="default", help='the model asked for (default "default")')
    _connection_flags(bench, admin=False)
    bench.set_defaults(func=_cmd_bench_client)
