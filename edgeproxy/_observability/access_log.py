"""JSON access logs: one line per request, through orjson.

Built in: ``[access_log] enabled = true`` (with ``path`` and ``queue_size``)
registers it without listing it under ``[plugins]``. As a plugin, its
settings (``[plugins.settings.access_log]``) are the same:

``path``
    File to append to. The file is opened at startup (a failure aborts
    startup, naming the plugin) and written by a background thread, so the
    event loop never waits on the disk; a file moved away (log rotation) is
    reopened within a second. ``-`` (the default) sends each line instead to
    the ``edgeproxy.access`` logger at INFO level, through whatever handlers
    the application configured.
``queue_size``
    Lines waiting for the writer thread at most, default 10000. When the disk
    cannot keep up, further lines are dropped (and counted, with a warning)
    rather than slow requests down.

Each line is one JSON object with: ``ts`` (Unix time at completion),
``request_id``, ``trace_id``, ``method``, ``path`` (without the query
string, which may carry secrets), ``route`` (the ``[[routes]]`` name),
``status``, ``region``, ``attempts``,
``tenant``, ``client_ip``, ``country``, ``priority``, ``sse``, ``bytes``
(body bytes sent), ``ttfb_ms`` (client-perceived, to the response headers),
``upstream_ttfb_ms``, ``duration_ms``, ``cache``, ``degraded``, ``error``
and ``usage`` (the region's token counts, for LLM answers). A WebSocket session
(status 101) is one line when it ends, ``usage`` its responses' sum, with
``websocket``: messages and bytes each way, Realtime responses, events refused,
the close code and who ended it. Timings are milliseconds or null. Prompts and
answers are never logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from typing import IO, Any

import orjson

from edgeproxy._core.config import AccessLogConfig
from edgeproxy._core.context import Continuation, RequestContext
from edgeproxy._core.exchange import Exchange
from edgeproxy.hookspecs import hookimpl

__all__ = ["AccessLog", "LineWriter", "record"]

logger = logging.getLogger("edgeproxy.access")

_ERROR_LIMIT = 500
_DEFAULT_QUEUE_SIZE = 10_000
_BATCH = 1024
_REOPEN_CHECK_INTERVAL = 1.0
# The writer lets lines gather this long before writing them. Woken for every
# line instead, it would take the GIL from the event loop once per request.
_LINGER = 0.05


def _ms(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1000.0, 3)


def record(request: Exchange, ctx: RequestContext) -> dict[str, Any]:
    """The access-log record of a finished request."""
    outcome = ctx.outcome
    error = outcome.error
    if error is not None and len(error) > _ERROR_LIMIT:
        error = error[:_ERROR_LIMIT] + "..."
    out = {
        "ts": round(time.time(), 6),
        "request_id": ctx.request_id,
        "trace_id": ctx.trace.trace_id,
        "method": ctx.method,
        "path": ctx.path,
        "route": ctx.route.name,
        "status": outcome.status,
        "region": outcome.region,
        "attempts": outcome.attempts,
        "tenant": ctx.tenant,
        "client_ip": ctx.client_ip,
        "country": ctx.client_country,
        "priority": ctx.priority,
        "sse": outcome.response_is_sse,
        "bytes": outcome.bytes_out,
        "ttfb_ms": _ms(ctx.started, outcome.first_byte_at),
        "upstream_ttfb_ms": (
            None if outcome.upstream_ttfb is None else round(outcome.upstream_ttfb * 1000.0, 3)
        ),
        "duration_ms": _ms(ctx.started, outcome.finished_at),
        "cache": outcome.cache,
        "degraded": outcome.degraded,
        "model": ctx.model,
        "error": error,
        "usage": outcome.usage,
    }
    if outcome.continuations:
        _continued(out, outcome.continuations)
    session = outcome.session
    if session is not None:
        # A WebSocket session: one line when it ends, with its totals.
        out["websocket"] = {
            "messages_in": session.messages_in,
            "messages_out": session.messages_out,
            "bytes_in": session.bytes_in,
            "responses": session.responses,
            "refused": session.refused,
            "close_code": session.close_code,
            "ended_by": session.ended_by,
        }
    return out


def _continued(out: dict[str, Any], continuations: tuple[Continuation, ...]) -> None:
    """A continued stream's fields: from the first region that broke to the last that went on."""
    done = [(source, target) for source, target, outcome in continuations if outcome == "continued"]
    out["continued"] = 1 if done else 0
    out["continued_from"] = continuations[0][0]
    out["continued_to"] = done[-1][1] if done else None


def _dumps(data: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(data)
    except TypeError:  # orjson.JSONEncodeError: e.g. a usage count beyond 64 bits
        return orjson.dumps({**data, "usage": None})


class LineWriter:
    """Appends lines to a file from its own thread; :meth:`write` never blocks.

    The thread writes what has queued up in one go, then flushes, and reopens
    the file when it was moved or removed (log rotation).
    """

    def __init__(self, path: str, *, queue_size: int = _DEFAULT_QUEUE_SIZE) -> None:
        self.path = path
        self.dropped = 0
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=queue_size)
        self._file: IO[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._warned_drops = 0
        self._checked_at = 0.0

    def open(self) -> None:
        """Open the file and start the thread; blocking, so call it off the event loop."""
        self._file = open(self.path, "ab")  # noqa: SIM115 - owned by the writer thread
        self._thread = threading.Thread(
            target=self._run, name=f"edgeproxy-access-log:{self.path}", daemon=True
        )
        self._thread.start()

    def write(self, line: bytes) -> None:
        """Queue one line (with its newline); drops it when the queue is full."""
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Write what is queued, stop the thread, close the file; blocking."""
        if self._thread is not None:
            if self._thread.is_alive():
                self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            stop = first is None
            if not stop:
                time.sleep(_LINGER)
            lines = [] if first is None else [first]
            # Everything that queued up meanwhile, written _BATCH lines at a time.
            while not stop:
                try:
                    line = self._queue.get_nowait()
                except queue.Empty:
                    break
                if line is None:
                    stop = True
                else:
                    lines.append(line)
                    if len(lines) >= _BATCH:
                        self._write(b"".join(lines))
                        lines = []
            if lines:
                self._write(b"".join(lines))
            if self.dropped > self._warned_drops:
                logger.warning(
                    "access log %s: %d lines dropped, the disk is not keeping up",
                    self.path,
                    self.dropped - self._warned_drops,
                )
                self._warned_drops = self.dropped
            if stop:
                return

    def _write(self, data: bytes) -> None:
        try:
            self._reopen_if_moved()
            assert self._file is not None
            self._file.write(data)
            self._file.flush()
        except Exception as exc:  # noqa: BLE001 - the thread must outlive a bad disk
            logger.error("access log %s: write failed: %s", self.path, exc)

    def _reopen_if_moved(self) -> None:
        now = time.monotonic()
        if self._file is not None and now - self._checked_at < _REOPEN_CHECK_INTERVAL:
            return
        self._checked_at = now
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            on_disk = None
        if self._file is not None and on_disk is not None:
            opened = os.fstat(self._file.fileno())
            if (opened.st_dev, opened.st_ino) == (on_disk.st_dev, on_disk.st_ino):
                return
        if self._file is not None:
            self._file.close()
            self._file = None
        self._file = open(self.path, "ab")  # noqa: SIM115


class AccessLog:
    """The JSON access log, a plugin on the ``edgeproxy_*`` hooks.

    ``[access_log] enabled = true`` registers one built from the config; as a
    plugin (``edgeproxy.plugins.access_log``) it is built from its settings.
    """

    def __init__(self, path: str = "-", *, queue_size: int = _DEFAULT_QUEUE_SIZE) -> None:
        self.path = path
        self.queue_size = queue_size
        self.writer: LineWriter | None = None

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> AccessLog:
        """Build it from ``[plugins.settings.access_log]``: ``path`` and ``queue_size``."""
        unknown = set(settings) - {"path", "queue_size"}
        if unknown:
            raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
        path = settings.get("path", "-")
        if not isinstance(path, str) or not path:
            raise ValueError("path must be a file path, or '-' for the edgeproxy.access logger")
        queue_size = settings.get("queue_size", _DEFAULT_QUEUE_SIZE)
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError("queue_size must be a positive integer")
        return cls(path=os.path.expanduser(path), queue_size=queue_size)

    @classmethod
    def from_config(cls, config: AccessLogConfig) -> AccessLog:
        """The built-in access log that ``[access_log] enabled = true`` registers."""
        return cls(path=os.path.expanduser(config.path), queue_size=config.queue_size)

    @hookimpl
    async def edgeproxy_startup(self) -> None:
        if self.path != "-" and self.writer is None:
            writer = LineWriter(self.path, queue_size=self.queue_size)
            await asyncio.to_thread(writer.open)
            self.writer = writer

    @hookimpl
    async def edgeproxy_shutdown(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            await asyncio.to_thread(writer.close)

    @hookimpl
    def edgeproxy_response_complete(self, request: Exchange, ctx: RequestContext) -> None:
        line = _dumps(record(request, ctx))
        if self.writer is not None:
            self.writer.write(line + b"\n")
        elif self.path == "-":
            logger.info("%s", line.decode())
        # A file log between shutdown and the next startup: nothing to write to.
