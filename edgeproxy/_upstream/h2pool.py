"""HTTP/2 upstream pool built directly on ``h2`` and asyncio protocols.

Why not httpx/httpcore: on a small box their per-request overhead (anyio
cancel scopes, a failed ``import sniffio`` per lock, an O(requests x
connections) pool scan) caps throughput far below aiohttp, and their HTTP/2
connection dies on the first GOAWAY instead of draining. See
``bench/pool_compare.py``.

Design in brief:

* One :class:`~edgeproxy._upstream.h2conn.Connection` per TCP connection (see
  :mod:`edgeproxy._upstream.h2conn` for frames, flow control and draining).
* Streams are multiplexed up to the peer's ``SETTINGS_MAX_CONCURRENT_STREAMS``;
  the pool opens more connections (up to ``max_connections``) only when every
  live one is full, and otherwise queues requests for up to ``pool_timeout``.
* GOAWAY drains a connection: streams the peer accepted finish, the others are
  failed as *refused* and, when the body can be replayed, retried once on
  another connection. A fixed per-connection request limit (nginx's
  ``keepalive_requests``) is learnt from GOAWAY, and connections are then
  retired just before it, so steady traffic sees no refused streams.
* One maintenance task per pool PINGs quiet connections, closes dead or
  long-idle ones and keeps ``warm_connections`` open.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections import deque
from collections.abc import Callable
from typing import Final
from urllib.parse import urlsplit

from edgeproxy._core.types import Body, Headers
from edgeproxy._http2.staticpack import NeverIndexed
from edgeproxy._upstream.h2conn import (
    Connection,
    H2Response,
    RefusedStream,
    timeout_waiter,
)
from edgeproxy._upstream.pool import (
    PoolLimits,
    PoolStats,
    UpstreamConnectError,
    UpstreamError,
    UpstreamNotHTTP2,
    UpstreamProtocolError,
    UpstreamTimeout,
    copy_error,
)

__all__ = ["H2Pool", "H2Response"]

_log = logging.getLogger(__name__)

# A refused stream was never seen by the application, so a retry is safe; one
# retry absorbs the usual GOAWAY race without hiding a peer that refuses all.
_REFUSED_RETRIES: Final = 1
# How long a per-connection stream limit learnt from GOAWAY is trusted.
_BUDGET_TTL: Final = 600.0
# Reconnecting: the first retry after a failure waits about _BACKOFF_BASE, each one after
# up to twice the one before, at most _BACKOFF_CAP (see _Backoff).
_BACKOFF_BASE: Final = 0.1
_BACKOFF_CAP: Final = 5.0
# Headers that describe the HTTP/1.1 connection and are illegal in HTTP/2.
_CONNECTION_SPECIFIC: Final = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "host", "te"}
)
# Kept out of the HPACK dynamic table: per-request values would only churn it
# (and cost an insert and an eviction each), and credentials must not be
# indexed where a compression side channel could probe them (RFC 7541 §7.1.3).
_NEVER_INDEXED: Final = frozenset(
    {"x-request-id", "traceparent", "tracestate", "authorization", "proxy-authorization"}
)


# How _header_block takes a request's field, by its name as given (kept with the name in
# lower case; bounded, since clients choose names: emptied when full).
_PLAIN: Final = 0
_NEVER: Final = 1
_LENGTH: Final = 2
_CONNECTION: Final = 3
_PSEUDO: Final = 4
_NAME_KINDS: dict[str, tuple[str, int]] = {}
_NAME_KINDS_MAX: Final = 512


def _name_kind(name: str) -> tuple[str, int]:
    lname = name.lower()
    if lname in _CONNECTION_SPECIFIC:
        kind = _CONNECTION
    elif lname[:1] == ":":
        kind = _PSEUDO
    elif lname == "content-length":
        kind = _LENGTH
    elif lname in _NEVER_INDEXED:
        kind = _NEVER
    else:
        kind = _PLAIN
    if len(_NAME_KINDS) >= _NAME_KINDS_MAX:
        _NAME_KINDS.clear()
    known = _NAME_KINDS[name] = (lname, kind)
    return known


def _stream_limit(conn: Connection) -> int:
    # Before the server's SETTINGS its limit is unknown (h2 assumes none): one
    # stream, so a server with a small limit never refuses what we sent early.
    return conn.max_streams if conn.ready.done() else 1


class _Backoff:
    """Delays between attempts that keep failing: exponential, capped, jittered.

    The n-th delay in a row is drawn uniformly between ``base`` and
    ``min(cap, base * 2**n)`` (full jitter above a floor): the pools of every worker at
    every PoP that lost a region at the same moment spread their retries out instead of
    coming back in step, and none retries sooner than ``base``, whatever the draw.
    """

    __slots__ = ("attempts", "base", "cap")

    def __init__(self, base: float = _BACKOFF_BASE, cap: float = _BACKOFF_CAP) -> None:
        self.base = base
        self.cap = cap
        self.attempts = 0

    def next(self, draw: float) -> float:
        """The next delay, for ``draw`` in [0, 1)."""
        # Bounded so that a region down for days cannot overflow the float.
        ceiling = min(self.cap, self.base * 2.0 ** min(self.attempts, 32))
        self.attempts += 1
        return self.base + (ceiling - self.base) * draw

    def reset(self) -> None:
        self.attempts = 0


class H2Pool:
    """HTTP/2 :class:`~edgeproxy._upstream.pool.UpstreamPool` for one origin, built on ``h2``.

    ``http://`` origins use h2c with prior knowledge; ``https://`` origins use
    TLS and require the server to pick ``h2`` by ALPN. A caller-supplied
    ``ssl_context`` is used as is (it is not modified, since it may be shared
    with HTTP/1.1 pools) and must therefore offer ``h2`` itself.

    Pool sizing: at most ``limits.max_connections`` non-draining connections;
    a draining connection (GOAWAY received) does not count, so a replacement
    can open while it finishes its last streams. Idle connections are closed
    after ``keepalive_expiry`` except for ``warm_connections`` of them, which
    are kept (and PINGed, and reopened if they die) so the first request after
    a quiet spell does not pay for a handshake.
    """

    def __init__(
        self,
        origin: str,
        limits: PoolLimits,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"H2Pool needs an http:// or https:// origin, got {origin!r}")
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.limits = limits
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._authority = parts.netloc
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            if ssl_context is None:
                ssl_context = ssl.create_default_context()
                ssl_context.set_alpn_protocols(["h2"])
            self._ssl = ssl_context
        self._conns: list[Connection] = []
        self._connecting = 0
        self._connect_tasks: set[asyncio.Task[None]] = set()
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self._fresh_waiters: deque[asyncio.Future[bool]] = deque()
        # Waiters handed a slot that have not run yet: until they do, a new
        # request must not take the slot from under them (FIFO fairness).
        self._handoffs = 0
        self._connect_epoch = 0
        self._connect_error: UpstreamError | None = None
        self._connect_backoff_until = 0.0
        # Two sequences: connects that fail (reset by one that succeeds), and reopens of
        # warm connections lost (reset by a loss after a long life: a server that accepts,
        # sends its SETTINGS and closes succeeds at every connect).
        self._connect_backoff = _Backoff()
        self._reopen_backoff = _Backoff()
        self._reopen_due = float("-inf")
        # The jitter's draws (tests set their own).
        self._random: Callable[[], float] = random.random
        self._expected_streams = 100
        # Per-connection stream limits inferred from GOAWAY; 0 means unknown.
        self._budget_candidate = 0  # seen once: only steers retries
        self._stream_budget = 0  # seen twice in a row: retires connections
        self._budget_until = 0.0
        self._requests = 0
        self._closed = False
        self._started = False
        self._maintenance: asyncio.Task[None] | None = None
        self._ping_timeout = max(0.05, min(limits.ping_interval, limits.connect_timeout))

    # -- public API ------------------------------------------------------

    async def start(self, *, at_least: int = 0) -> None:
        """Open ``warm_connections`` connections, or ``at_least`` (whoever must know the
        origin speaks HTTP/2 asks for one), each once the server's SETTINGS came."""
        if self._closed:
            raise UpstreamProtocolError(f"pool for {self.origin} is closed")
        self._started = True
        self._ensure_maintenance()
        warm = max(at_least, min(self.limits.warm_connections, self.limits.max_connections))
        missing = warm - sum(1 for c in self._conns if not c.draining)
        if missing <= 0:
            return
        # Prewarming waits for the server's SETTINGS: nobody waits on it, and
        # a server that accepts TCP but does not speak HTTP/2 must fail it.
        results = await asyncio.gather(
            *(self._open_connection(settle=True) for _ in range(missing)),
            return_exceptions=True,
        )
        errors: list[BaseException] = []
        for result in results:
            if isinstance(result, Connection):
                self._add_connection(result)
            else:
                errors.append(result)
        if len(errors) == len(results):
            err = errors[0]
            error = (
                err
                if isinstance(err, UpstreamError)
                else UpstreamConnectError(f"cannot connect to {self.origin}: {err}")
            )
            # Maintenance must not retry at once what just failed.
            self._connect_failed(copy_error(error), asyncio.get_running_loop().time())
            if error is err:
                raise error
            raise error from err

    async def request(
        self,
        method: str,
        target: str,
        headers: Headers,
        body: Body = None,
        *,
        authority: str | None = None,
    ) -> H2Response:
        if self._closed:
            raise UpstreamProtocolError(f"pool for {self.origin} is closed")
        self._requests += 1
        limits = self.limits
        if isinstance(body, bytes | bytearray | memoryview) and not len(body):
            body = None
        header_block = self._header_block(method, target, headers, body, authority)
        replayable = body is None or isinstance(body, bytes | bytearray | memoryview)
        retries = 0
        must_wait = False
        while True:
            fresh = retries > 0
            # Queue behind earlier waiters rather than jump ahead of them.
            queued = self._handoffs or (self._fresh_waiters if fresh else self._waiters)
            conn = None if must_wait or queued else self._pick(fresh)
            if conn is None:
                conn = await self._acquire(fresh)
            stream = conn.open_stream(header_block, body is None)
            if stream is None:
                # The peer's view of its stream limit was tighter than ours:
                # wait for a slot rather than spin on the same connection.
                must_wait = True
                continue
            must_wait = False
            try:
                await stream.send_body(body, limits.write_timeout)
                await stream.wait_headers(limits.read_timeout)
            except RefusedStream:
                stream.close()
                if replayable and retries < _REFUSED_RETRIES:
                    retries += 1
                    continue
                raise
            except BaseException:
                # Timeouts, cancellation, a failing body iterator: the stream
                # must not stay open on the connection.
                stream.close()
                raise
            return H2Response(stream, limits.stream_idle_timeout)

    def stats(self) -> PoolStats:
        return PoolStats(
            connections_open=len(self._conns),
            streams_in_use=sum(len(c.streams) for c in self._conns),
            requests_total=self._requests,
            http_version="2",
        )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks: list[asyncio.Task[None]] = list(self._connect_tasks)
        if self._maintenance is not None:
            tasks.append(self._maintenance)
            self._maintenance = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._wake_all()
        conns = list(self._conns)
        error = UpstreamProtocolError(f"pool for {self.origin} closed")
        for conn in conns:
            conn.close(error)
        pending = [conn.closed for conn in conns if not conn.closed.done()]
        if pending:
            # Wait for connection_lost so no transport outlives the pool (an
            # unclosed transport warns when collected).
            _, not_done = await asyncio.wait(pending, timeout=1.0)
            if not_done:
                for conn in conns:
                    if conn.transport is not None:
                        conn.transport.abort()
                await asyncio.wait(not_done, timeout=1.0)
        self._conns.clear()

    # -- request helpers -------------------------------------------------

    def _header_block(
        self,
        method: str,
        target: str,
        headers: Headers,
        body: Body,
        authority: str | None,
    ) -> list[tuple[str, str]]:
        block = [
            (":method", method),
            (":scheme", self._scheme),
            (":authority", authority or self._authority),
            (":path", target or "/"),
        ]
        has_length = False
        kinds = _NAME_KINDS
        for name, value in headers:
            known = kinds.get(name)
            if known is None:
                known = _name_kind(name)
            lname, kind = known
            if kind == _PLAIN:
                block.append((lname, value))
            elif kind == _NEVER:
                block.append(NeverIndexed((lname, value)))
            elif kind == _LENGTH:
                has_length = True
                block.append((lname, value))
            elif kind == _CONNECTION:
                if lname == "host" and authority is None:
                    block[2] = (":authority", value)
                elif lname == "te" and value.strip().lower() == "trailers":
                    block.append(("te", "trailers"))
            # _PSEUDO: dropped
        if not has_length and isinstance(body, bytes | bytearray | memoryview):
            # Not required by HTTP/2, but lets servers size buffers and reject
            # oversized bodies before reading them.
            block.append(("content-length", str(len(body))))
        return block

    # -- connection selection --------------------------------------------

    def _pick(self, fresh: bool = False) -> Connection | None:
        """The least-loaded usable connection with a free stream slot.

        ``fresh`` is for retrying a refused stream: it prefers the connection
        that has opened the fewest streams and is still below the
        per-connection limit suggested by the last GOAWAY, so the retry is not
        refused again by a connection as old as the one that refused it. When
        no such connection exists and no new one can be opened, it settles for
        the least-used one rather than wait for a limit that may be wrong.
        """
        best: Connection | None = None
        best_key = 1 << 62
        fallback: Connection | None = None
        cap = self._retry_cap() if fresh else 0
        for conn in self._conns:
            if conn.draining or conn.lost:
                continue
            load = len(conn.streams)
            if load >= _stream_limit(conn):
                continue
            if not fresh:
                if load < best_key:
                    best, best_key = conn, load
                continue
            key = conn.streams_opened
            if cap and key >= cap:
                if fallback is None or key < fallback.streams_opened:
                    fallback = conn
            elif key < best_key:
                best, best_key = conn, key
        if best is None and fallback is not None and not self._can_grow():
            return fallback
        return best

    def _can_grow(self) -> bool:
        """Whether a connection is on its way or another may be opened."""
        if self._connecting:
            return True
        live = sum(1 for c in self._conns if not c.draining and not c.lost)
        return live < self.limits.max_connections

    async def _acquire(self, fresh: bool = False) -> Connection:
        """Wait up to ``pool_timeout`` for a stream slot, opening connections as needed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.pool_timeout
        epoch = self._connect_epoch
        # Retries wait apart: they cannot use every freed slot, and a wake-up
        # they cannot use must not be lost to a plain request.
        queue = self._fresh_waiters if fresh else self._waiters
        first = True
        while True:
            if self._closed:
                raise UpstreamProtocolError(f"pool for {self.origin} is closed")
            self._maybe_connect(len(self._waiters) + len(self._fresh_waiters) + 1)
            fut: asyncio.Future[bool] = loop.create_future()
            if first:
                queue.append(fut)
                first = False
            else:
                # Woken but beaten to the slot: keep our place at the front.
                queue.appendleft(fut)
            handle = loop.call_at(deadline, timeout_waiter, fut)
            try:
                woken = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.result():
                    # We were handed a free slot but will not use it.
                    self._handoffs -= 1
                    if not self._wake_one(self._waiters):
                        self._wake_one(self._fresh_waiters)
                raise
            finally:
                handle.cancel()
                if not fut.done() or fut.cancelled() or not fut.result():
                    # Woken futures were already taken off the queue.
                    try:
                        queue.remove(fut)
                    except ValueError:
                        pass
            if woken:
                self._handoffs -= 1
            conn = self._pick(fresh)
            if conn is not None:
                return conn
            if self._closed:
                raise UpstreamProtocolError(f"pool for {self.origin} is closed")
            if not woken:
                raise UpstreamTimeout(
                    f"no HTTP/2 stream to {self.origin} became free in time", phase="pool"
                )
            if (
                self._connect_epoch != epoch
                and self._connect_error is not None
                and self._connecting == 0
                and not any(not c.draining and not c.lost for c in self._conns)
            ):
                # Nothing live can free a slot and the connect we waited for
                # failed: report it now rather than at pool_timeout.
                raise copy_error(self._connect_error)

    def _maybe_connect(self, demand: int) -> None:
        live = [c for c in self._conns if not c.draining and not c.lost]
        if len(live) + self._connecting >= self.limits.max_connections:
            return
        # A connection whose SETTINGS are still on their way takes one stream
        # now and more once they arrive: it counts as one on its way.
        coming = self._connecting + sum(1 for c in live if not c.ready.done())
        if coming and demand <= coming * self._expected_streams:
            return  # connections on their way will absorb the queue
        loop = asyncio.get_running_loop()
        if loop.time() < self._connect_backoff_until and self._conns:
            return
        self._connecting += 1
        task = loop.create_task(self._connect_in_background())
        self._connect_tasks.add(task)
        task.add_done_callback(self._connect_tasks.discard)

    async def _connect_in_background(self) -> None:
        try:
            conn = await self._open_connection()
        except Exception as exc:
            if not isinstance(exc, UpstreamError):
                exc = UpstreamConnectError(f"cannot connect to {self.origin}: {exc!r}")
            self._connect_failed(exc, asyncio.get_running_loop().time())
        else:
            self._add_connection(conn)
        finally:
            self._connecting -= 1
            self._wake_all()

    async def _open_connection(self, *, settle: bool = False) -> Connection:
        """A connection with the preface and our SETTINGS written.

        Without ``settle`` it is handed out without waiting for the server's
        SETTINGS (RFC 9113 §3.4 lets a client send requests right after its
        preface): h2c servers that sniff the preface send theirs only after
        reading it, a round trip the first request would otherwise wait.
        Until they arrive the connection takes one stream (``_stream_limit``).
        """
        loop = asyncio.get_running_loop()
        conn = Connection(self, loop)
        try:
            async with asyncio.timeout(self.limits.connect_timeout):
                await loop.create_connection(
                    lambda: conn,
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                )
                if settle or conn.ready.done():
                    error = await conn.ready
                else:
                    error = None
                if error is not None:
                    raise error
        except TimeoutError as exc:
            conn.abort(UpstreamConnectError("connect timed out"))
            if conn.unparsed.startswith(b"HTTP/"):
                # An HTTP/1.x server that answered the preface and kept the connection.
                raise UpstreamNotHTTP2.from_reply(self.origin, conn.unparsed) from exc
            raise UpstreamTimeout(
                f"timed out connecting to {self.origin}", phase="connect"
            ) from exc
        except OSError as exc:
            conn.abort(UpstreamConnectError(str(exc)))
            raise UpstreamConnectError(f"cannot connect to {self.origin}: {exc}") from exc
        except BaseException as exc:
            conn.abort(UpstreamConnectError(str(exc)))
            raise
        return conn

    def _add_connection(self, conn: Connection) -> None:
        if conn.lost:
            return
        if self._closed:
            conn.close()
            return
        self._conns.append(conn)
        if conn.ready.done():
            self._settings_known(conn)
        self._ensure_maintenance()

    def _settings_known(self, conn: Connection) -> None:
        # A connect that succeeded: the next failure backs off from the start.
        self._connect_backoff.reset()
        self._expected_streams = max(1, min(conn.max_streams, self.stream_budget() or 1000))

    def stream_budget(self, now: float | None = None) -> int:
        """Streams after which a connection is retired; 0 when no limit is known."""
        if now is None:
            now = asyncio.get_running_loop().time()
        if self._stream_budget and self._budget_until <= now:
            self._stream_budget = 0
        return self._stream_budget

    def _retry_cap(self) -> int:
        return self.stream_budget() or self._budget_candidate

    def _learn_stream_budget(self, accepted: int) -> None:
        """Infer a per-connection stream limit from a GOAWAY that refused streams.

        Servers such as nginx (``keepalive_requests``) and hypercorn
        (``keep_alive_max_requests``) send GOAWAY after a fixed number of
        streams and refuse whatever else is in flight. One such GOAWAY makes
        the count a candidate, which only keeps retried streams off
        connections that have already opened that many. The same count seen
        on the next GOAWAY confirms it: from then on connections are retired
        just before it, so steady traffic sees no refused streams at all.

        Requiring two matching counts keeps a GOAWAY from a reload or a
        shutdown (at an arbitrary count) from shrinking every connection's
        life; a smaller count contradicts and drops the budget, and the
        budget expires after ``_BUDGET_TTL`` in case the server's limit grew.
        """
        if accepted <= 0:
            return
        now = asyncio.get_running_loop().time()
        if accepted == self._budget_candidate:
            self._stream_budget = accepted
            self._budget_until = now + _BUDGET_TTL
            self._expected_streams = max(1, min(self._expected_streams, accepted))
            for conn in self._conns:
                if conn.streams_opened >= accepted:
                    conn.start_draining()
        elif self._stream_budget and accepted < self._stream_budget:
            self._stream_budget = 0
        self._budget_candidate = accepted

    # -- waking ----------------------------------------------------------

    def _wake_one(self, waiters: deque[asyncio.Future[bool]]) -> bool:
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(True)
                self._handoffs += 1
                return True
        return False

    def _wake_all(self) -> None:
        for waiters in (self._waiters, self._fresh_waiters):
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(True)
                    self._handoffs += 1

    def _slot_freed(self, conn: Connection) -> None:
        if self._waiters:
            self._wake_one(self._waiters)
        elif self._fresh_waiters and self._pick(fresh=True) is not None:
            self._wake_one(self._fresh_waiters)

    def _capacity_changed(self, conn: Connection) -> None:
        if conn.ready.done() and not conn.draining and not conn.lost:
            self._settings_known(conn)  # their SETTINGS may have just arrived
        if self._waiters or self._fresh_waiters:
            self._wake_all()

    def _connection_gone(self, conn: Connection) -> None:
        try:
            self._conns.remove(conn)
        except ValueError:
            return  # never handed out: its opener reports the failure
        if self._closed:
            return
        now = asyncio.get_running_loop().time()
        setup_error = conn.ready.result()
        if setup_error is not None:
            # Lost before the server's SETTINGS: a failed connect, with its backoff.
            self._connect_failed(setup_error, now)
        elif now - conn.opened_at >= self._reopen_backoff.cap:
            # It lasted: the region was serving, and reopens back off from the start again.
            self._reopen_backoff.reset()
        if self._waiters or self._fresh_waiters:
            self._wake_all()
        self._reopen_warm(now)

    def _connect_failed(self, error: UpstreamError, now: float) -> None:
        self._connect_error = error
        self._connect_epoch += 1
        self._connect_backoff_until = now + self._connect_backoff.next(self._random())

    def _reopen_warm(self, now: float) -> None:
        """Open connections up to ``warm_connections``, unless a connect failed lately.

        Called as soon as a connection is lost, not only from maintenance, so
        the next request finds one on its way. Never within the backoff after
        a failed connect, and each reopen after the first waits out a backoff
        of its own even when each connects: a server that accepts and then
        closes at once (GOAWAY after its SETTINGS) must not be reconnected to
        at the round trip's pace. That backoff starts over once a connection
        lost had lasted its cap.
        """
        if not self._started or self._closed or self._waiters or self._fresh_waiters:
            return
        warm = max(0, min(self.limits.warm_connections, self.limits.max_connections))
        alive = sum(1 for c in self._conns if not c.draining and not c.lost)
        if alive + self._connecting >= warm or now < self._connect_backoff_until:
            return
        if now < self._reopen_due:
            return
        self._reopen_due = now + self._reopen_backoff.next(self._random())
        self._maybe_connect(1)

    # -- maintenance -----------------------------------------------------

    def _ensure_maintenance(self) -> None:
        if self._maintenance is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._maintenance = loop.create_task(self._maintain())

    async def _maintain(self) -> None:
        limits = self.limits
        tick = max(0.02, min(limits.ping_interval, limits.keepalive_expiry, self._ping_timeout) / 2)
        loop = asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(tick)
            try:
                self._maintain_once(loop.time())
            except Exception:  # pragma: no cover - a bug must not stop keepalive
                _log.exception("H2Pool maintenance failed for %s", self.origin)

    def _maintain_once(self, now: float) -> None:
        limits = self.limits
        warm = max(0, min(limits.warm_connections, limits.max_connections))
        live = [c for c in self._conns if not c.draining and not c.lost]
        # Most recently used first, so the warm ones kept are the freshest.
        idle = sorted(
            (c for c in live if c.idle_since is not None),
            key=lambda c: c.idle_since or 0.0,
            reverse=True,
        )
        keep = max(0, warm - (len(live) - len(idle)))
        for index, conn in enumerate(idle):
            assert conn.idle_since is not None
            if index >= keep and now - conn.idle_since >= limits.keepalive_expiry:
                conn.close()
        for conn in self._conns:
            if conn.lost or conn.closing:
                continue
            if conn.ping_sent_at is not None:
                if now - conn.ping_sent_at >= self._ping_timeout:
                    conn.abort(UpstreamProtocolError("upstream did not answer PING"))
            elif now - conn.last_recv >= limits.ping_interval:
                conn.ping()
        self._reopen_warm(now)
