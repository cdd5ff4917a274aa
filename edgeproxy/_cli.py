"""The ``edgeproxy`` command: serve, check-config, demo, config-docs (and the hidden
``_worker`` that ``serve --workers N`` starts), and the operator's commands of
:mod:`edgeproxy._opscli` (status, top, reload, purge, bench-client)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import orjson

from edgeproxy._core.build import build
from edgeproxy._core.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    config_docs_markdown,
    find_config,
    load_found,
)
from edgeproxy._core.version import __version__
from edgeproxy._opscli import add_commands as add_operator_commands

__all__ = ["main"]

# prctl(2): the signal a process gets when its parent dies (Linux).
_PR_SET_PDEATHSIG = 1


# Exit codes, the same for every command: 0 done; 1 a failure while running (workers that
# did not start, a region that did not answer); 2 a bad command line or configuration,
# as argparse exits for a bad command line.
EXIT_CONFIG = 2


def _run(coro_fn: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run on uvloop where available: it roughly halves the event loop's own cost."""
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(coro_fn())


def _setup_logging(level: str, *, process: bool = False) -> None:
    # Under the supervisor several processes share stderr: each line names its process.
    where = "[%(process)d] " if process else ""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {where}%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _apply_flags(config: Config, args: argparse.Namespace) -> Config:
    """Command-line flags override the file; each flag is named after its key."""
    data = config.model_dump()
    overrides = {
        ("server", "host"): args.host,
        ("server", "port"): args.port,
        ("server", "grace_period"): args.grace_period,
        ("server", "workers"): getattr(args, "workers", None),
        ("server", "http2"): getattr(args, "http2", None),
        ("server", "h2c"): getattr(args, "h2c", None),
        ("admin", "host"): args.admin_host,
        ("admin", "port"): args.admin_port,
        ("pop", "name"): args.pop_name,
    }
    for (section, key), value in overrides.items():
        if value is not None:
            data[section][key] = value
    return Config.from_mapping(data, environ={}, base_dir=config.base_dir)


def _add_listener_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="[server] host")
    parser.add_argument("--port", type=int, help="[server] port")
    parser.add_argument("--grace-period", type=float, help="[server] grace_period")
    parser.add_argument(
        "--http2",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="[server] http2: serve HTTP/2 beside HTTP/1.1 (needs TLS, or --h2c)",
    )
    parser.add_argument(
        "--h2c",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="[server] h2c: cleartext HTTP/2 with --http2",
    )
    parser.add_argument("--admin-host", help="[admin] host")
    parser.add_argument("--admin-port", type=int, help="[admin] port")
    parser.add_argument("--pop-name", help="[pop] name")
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error")


def _cmd_serve(args: argparse.Namespace) -> int:
    from edgeproxy._server.app import serve
    from edgeproxy._server.supervisor import Supervisor

    found = find_config(args.config)

    def load() -> Config:
        return _apply_flags(load_found(found), args)

    try:
        config = load()
    except ConfigError as exc:
        print(f"edgeproxy: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if config.server.worker_count() > 1:
        _setup_logging(args.log_level, process=True)
        supervisor = Supervisor(config, load, log_level=args.log_level)
        return _run(supervisor.run)
    _setup_logging(args.log_level)
    try:
        return _run(lambda: serve(config, loader=load))
    except ConfigError as exc:
        # What only shows when the listeners open: TLS files, the admin token's variable.
        print(f"edgeproxy: {exc}", file=sys.stderr)
        return EXIT_CONFIG


def _follow_supervisor(pid: int) -> bool:
    """Have the kernel send SIGTERM (a drain) when the supervisor dies, however it dies,
    so that no worker outlives it; False if it is gone already."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    return os.getppid() == pid


def _cmd_worker(args: argparse.Namespace) -> int:
    from edgeproxy._server.app import serve

    _setup_logging(args.log_level, process=True)
    if not _follow_supervisor(args.supervisor_pid):
        return 1
    path = Path(args.config_json)
    data = orjson.loads(path.read_bytes())
    config = Config.from_mapping(data, environ={}, base_dir=data.pop("base_dir", None))
    return _run(lambda: serve(config, admin_socket=args.admin_socket))


def _cmd_check_config(args: argparse.Namespace) -> int:
    from edgeproxy._server.tls import check_tls_files

    found = find_config(args.file)
    try:
        config = load_found(found)
        check_tls_files(config)
    except ConfigError as exc:
        print(f"edgeproxy: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    names = ", ".join(r.name for r in config.regions)
    count = len(config.regions)
    print(f"{found.describe()}: OK ({count} region{'' if count == 1 else 's'}: {names})")
    return 0


def _cmd_config_docs(args: argparse.Namespace) -> int:
    print(config_docs_markdown())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from edgeproxy._demo import run_demo

    _setup_logging(args.log_level)
    try:
        return _run(lambda: run_demo(args))
    except ConfigError as exc:
        print(f"edgeproxy: {exc}", file=sys.stderr)
        return EXIT_CONFIG


_CONFIG_HELP = f"the TOML config (default: ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgeproxy",
        description="Edge-to-region reverse proxy for OpenAI-compatible LLM APIs and plain HTTP.",
    )
    parser.add_argument(
        "--version", action="version", version=f"edgeproxy {__version__} ({build()})"
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="{serve,check-config,config-docs,demo,status,top,reload,purge,bench-client}",
    )

    serve = sub.add_parser("serve", help="run the proxy from a TOML config file")
    serve.add_argument("--config", help=_CONFIG_HELP)
    _add_listener_flags(serve)
    serve.add_argument("--workers", help="[server] workers: a number, or 'auto' (one per core)")
    serve.set_defaults(func=_cmd_serve)

    # Started by the supervisor of `serve --workers N`; not for people.
    worker = sub.add_parser("_worker")
    worker.add_argument("--config-json", required=True)
    worker.add_argument("--admin-socket", required=True)
    worker.add_argument("--log-level", default="info")
    worker.add_argument("--supervisor-pid", type=int, required=True)
    worker.set_defaults(func=_cmd_worker)

    check = sub.add_parser("check-config", help="validate a config file and list every error")
    check.add_argument("file", nargs="?", help=_CONFIG_HELP)
    check.set_defaults(func=_cmd_check_config)

    docs = sub.add_parser("config-docs", help="print every config key as a markdown table")
    docs.set_defaults(func=_cmd_config_docs)

    demo = sub.add_parser(
        "demo", help="run emulated regions and the proxy in process, needing no external service"
    )
    _add_listener_flags(demo)
    demo.add_argument("--regions", type=int, default=3, help="number of emulated regions (1-3)")
    demo.add_argument("--ttft", type=float, default=0.15, help="emulated time to first token, s")
    demo.add_argument(
        "--inter-token-delay", type=float, default=0.03, help="emulated delay between tokens, s"
    )
    demo.add_argument(
        "--duration", type=float, default=None, help="stop after this many seconds (for scripts)"
    )
    demo.set_defaults(func=_cmd_demo)

    add_operator_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``edgeproxy`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    result: int = args.func(args)
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
