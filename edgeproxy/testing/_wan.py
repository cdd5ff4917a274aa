"""A user-space WAN link: an asyncio TCP relay that delays, paces and drops traffic.

Machines without ``netem`` still need a far region to be far. :class:`WanLink`
listens on 127.0.0.1 and relays every connection to a target host and port,
holding each chunk for a one-way delay (with jitter) in each direction and
pacing it through a per-direction bandwidth, so that everything a protocol does
in round trips (the TCP handshake, TLS, the HTTP/2 preface, each request) costs
what it would across an ocean.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import socket
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Final

from edgeproxy.testing._behavior import probability, seconds
from edgeproxy.testing._served import Served

_CHUNK: Final = 65536
# Bytes a direction may hold in flight before the relay stops reading from the sender;
# TCP's window does the same, and without it a fast sender would fill memory.
_MAX_QUEUED: Final = 4 * 1024 * 1024


def _bandwidth(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"bandwidth must be bytes per second (a number) or None, not {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"bandwidth must be a finite number of bytes per second > 0, not {value!r}"
        )
    return float(value)


@dataclass
class WanCounters:
    """What a :class:`WanLink` carried: connections, drops and bytes each way."""

    connections_total: int = 0
    """Client connections accepted."""
    dropped_total: int = 0
    """Connections the link dropped: ``loss``, ``connection_loss`` or :meth:`WanLink.drop_all`."""
    bytes_up: int = 0
    """Bytes relayed from the clients to the target."""
    bytes_down: int = 0
    """Bytes relayed from the target to the clients."""


class _Direction:
    """One way across the link: its propagation delay and its serialised bandwidth."""

    def __init__(self) -> None:
        self.free_at = 0.0  # when the (shared) line finishes sending what it already has


class _Conn:
    """One relayed connection: the client's side and, once connected, the target's."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.target: asyncio.StreamWriter | None = None
        self.dropped = False

    def drop(self) -> None:
        """Reset both sides (a no-op once done): the peers see the connection fail."""
        self.dropped = True
        for writer in (self.client, self.target):
            if writer is not None and not writer.transport.is_closing():
                writer.transport.abort()

    def close(self) -> None:
        """Close both sides once what was written has been sent (the normal end)."""
        for writer in (self.client, self.target):
            if writer is not None and not writer.transport.is_closing():
                writer.transport.close()


class _Pipe:
    """One connection's one direction: a timestamped queue of chunks, released in order."""

    def __init__(self) -> None:
        self.queue: deque[tuple[float, bytes | None]] = deque()
        self.ready = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()
        self.queued = 0
        self.last_release = 0.0

    def put(self, release: float, data: bytes | None) -> None:
        # Jitter must not reorder a TCP stream: a chunk never overtakes the one before.
        release = max(release, self.last_release)
        self.last_release = release
        self.queue.append((release, data))
        if data is not None:
            self.queued += len(data)
            if self.queued >= _MAX_QUEUED:
                self.room.clear()
        self.ready.set()

    def taken(self, size: int) -> None:
        self.queued -= size
        if self.queued < _MAX_QUEUED:
            self.room.set()


class WanLink(Served):
    """A TCP relay on 127.0.0.1 standing for a wide-area link to ``target_host:target_port``.

    Each chunk read from one side is written to the other after the one-way delay
    of its direction (``up_delay``: client to target, ``down_delay``: target to
    client; ``delay`` sets both), plus a jitter drawn uniformly from
    ``[-jitter, +jitter]`` (never below zero, and never reordering the stream).
    Chunks queue with their release times, so a delay adds latency without capping
    throughput; ``bandwidth`` (bytes per second, per direction, shared by all
    connections, None for unlimited) is the only cap. A new connection pays the
    TCP handshake: the client's first bytes leave no sooner than one round trip
    after it connected, and the target sees the connection one ``up_delay`` later.

    Loss drops whole connections (the client then sees a reset and reconnects):
    ``loss`` is the probability per relayed chunk, ``connection_loss`` per new
    connection. Draws come from a generator seeded with ``seed``.

    ::

        async with FakeRegion(name="far") as region, WanLink(
            region.port, delay=0.15, jitter=0.005
        ) as link:
            ...  # point the proxy at link.url: 300 ms round trips to the region

    The delays, jitter, bandwidth and loss may be changed while it runs with
    :meth:`configure`; :meth:`drop_all` drops every open connection.
    """

    def __init__(
        self,
        target_port: int,
        *,
        target_host: str = "127.0.0.1",
        delay: float = 0.0,
        up_delay: float | None = None,
        down_delay: float | None = None,
        jitter: float = 0.0,
        bandwidth: float | None = None,
        loss: float = 0.0,
        connection_loss: float = 0.0,
        seed: int | None = 0,
        port: int = 0,
    ) -> None:
        if isinstance(target_port, bool) or not isinstance(target_port, int):
            raise TypeError(f"target_port must be an integer, not {target_port!r}")
        if not 0 < target_port < 65536:
            raise ValueError(f"target_port must be between 1 and 65535, not {target_port!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be between 0 and 65535, not {port!r}")
        self.target_host = target_host
        self.target_port = target_port
        base = seconds("delay", delay)
        self.up_delay = base
        self.down_delay = base
        self.jitter = 0.0
        self.bandwidth: float | None = None
        self.loss = 0.0
        self.connection_loss = 0.0
        self.configure(
            up_delay=base if up_delay is None else up_delay,
            down_delay=base if down_delay is None else down_delay,
            jitter=jitter,
            bandwidth=bandwidth,
            loss=loss,
            connection_loss=connection_loss,
        )
        self.counters = WanCounters()
        self._rng = random.Random(seed)
        self._port = port
        self._server: asyncio.Server | None = None
        self._up = _Direction()
        self._down = _Direction()
        self._tasks: set[asyncio.Task[None]] = set()  # the pumps
        self._handlers: set[asyncio.Task[None]] = set()  # one per connection, never cancelled
        self._conns: set[_Conn] = set()

    # -- settings ------------------------------------------------------------------

    def configure(
        self,
        *,
        delay: float | None = None,
        up_delay: float | None = None,
        down_delay: float | None = None,
        jitter: float | None = None,
        bandwidth: float | None | bool = False,
        loss: float | None = None,
        connection_loss: float | None = None,
    ) -> None:
        """Change some settings (all checked before any applies); the next chunks use them.

        ``bandwidth=None`` removes the cap; leaving it out keeps the current one.
        """
        up = self.up_delay if delay is None else seconds("delay", delay)
        down = up if delay is not None else self.down_delay
        up = up if up_delay is None else seconds("up_delay", up_delay)
        down = down if down_delay is None else seconds("down_delay", down_delay)
        new_jitter = self.jitter if jitter is None else seconds("jitter", jitter)
        new_bandwidth = self.bandwidth if bandwidth is False else _bandwidth(bandwidth)
        new_loss = self.loss if loss is None else probability("loss", loss)
        new_conn_loss = (
            self.connection_loss
            if connection_loss is None
            else probability("connection_loss", connection_loss)
        )
        self.up_delay, self.down_delay = up, down
        self.jitter = new_jitter
        self.bandwidth = new_bandwidth
        self.loss = new_loss
        self.connection_loss = new_conn_loss

    @property
    def rtt(self) -> float:
        """The configured round trip in seconds (jitter aside)."""
        return self.up_delay + self.down_delay

    @property
    def port(self) -> int:
        """The port the link listens on (known once started)."""
        if self._server is None:
            raise RuntimeError("the link is not started")
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``: the far end, as a client of the link sees it."""
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Listen on 127.0.0.1 (the given port, or one the kernel picks)."""
        if self._server is not None:
            raise RuntimeError("the link is already started")
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self._port)
        self._port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop listening and drop every connection still open."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for conn in list(self._conns):
            conn.drop()
        for task in list(self._tasks):
            task.cancel()
        # The handlers end on their own once their pumps are gone: asyncio's stream server
        # reports a cancelled handler as an error (Python 3.11), so they are not cancelled.
        pending = [*self._tasks, *self._handlers]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await server.wait_closed()

    def drop_all(self) -> int:
        """Reset every open connection, both sides at once; returns how many there were."""
        conns = list(self._conns)
        for conn in conns:
            conn.drop()
        self.counters.dropped_total += len(conns)
        return len(conns)

    # -- relaying ------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[None, None, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _sample(self, base: float) -> float:
        if self.jitter == 0:
            return base
        return max(0.0, base + self._rng.uniform(-self.jitter, self.jitter))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counters.connections_total += 1
        _nodelay(writer)
        if self.connection_loss and self._rng.random() < self.connection_loss:
            self.counters.dropped_total += 1
            writer.transport.abort()
            return
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        conn = _Conn(writer)
        self._conns.add(conn)
        loop = asyncio.get_running_loop()
        # The target hears of the connection when the SYN would reach it; the client's
        # data may leave once the SYN-ACK is back, one round trip after connecting.
        syn_arrives = self._sample(self.up_delay)
        client_ready = loop.time() + syn_arrives + self._sample(self.down_delay)
        up = _Pipe()
        down = _Pipe()
        pumps = [self._spawn(self._read(conn, reader, up, self._up, True, client_ready))]
        try:
            await asyncio.sleep(syn_arrives)
            try:
                t_reader, t_writer = await asyncio.open_connection(
                    self.target_host, self.target_port
                )
            except OSError:
                conn.drop()  # a refused connection reaches the client as a reset
                return
            _nodelay(t_writer)
            conn.target = t_writer
            if conn.dropped:
                return
            pumps.append(self._spawn(self._write(conn, up, t_writer)))
            pumps.append(self._spawn(self._read(conn, t_reader, down, self._down, False, 0.0)))
            pumps.append(self._spawn(self._write(conn, down, writer)))
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            for pump in pumps:
                pump.cancel()
            if conn.dropped:
                conn.drop()
            else:
                conn.close()
            self._conns.discard(conn)

    async def _read(
        self,
        conn: _Conn,
        reader: asyncio.StreamReader,
        pipe: _Pipe,
        direction: _Direction,
        upward: bool,
        not_before: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await pipe.room.wait()
                data = await reader.read(_CHUNK)
                now = loop.time()
                if not data:
                    pipe.put(max(now, not_before), None)
                    return
                if self.loss and self._rng.random() < self.loss:
                    self.counters.dropped_total += 1
                    conn.drop()
                    return
                start = max(now, not_before)
                if self.bandwidth is not None:
                    direction.free_at = max(direction.free_at, start) + len(data) / self.bandwidth
                    start = direction.free_at
                if upward:
                    self.counters.bytes_up += len(data)
                    pipe.put(start + self._sample(self.up_delay), data)
                else:
                    self.counters.bytes_down += len(data)
                    pipe.put(start + self._sample(self.down_delay), data)
        except (ConnectionError, OSError):
            conn.drop()

    async def _write(self, conn: _Conn, pipe: _Pipe, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                while not pipe.queue:
                    pipe.ready.clear()
                    await pipe.ready.wait()
                release, data = pipe.queue[0]
                wait = release - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                pipe.queue.popleft()
                if data is None:
                    if not writer.transport.is_closing() and writer.can_write_eof():
                        writer.write_eof()
                    return
                pipe.taken(len(data))
                if writer.transport.is_closing():
                    conn.drop()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            conn.drop()

    def __repr__(self) -> str:
        where = f"127.0.0.1:{self._port}" if self._server is not None else "stopped"
        return (
            f"WanLink({where} -> {self.target_host}:{self.target_port}, "
            f"up {self.up_delay * 1000:g} ms, down {self.down_delay * 1000:g} ms)"
        )


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
