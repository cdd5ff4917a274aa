"""The HTTP/2 pool's first request on a new connection: sent after the preface, not after
the server's SETTINGS (RFC 9113 §3.4), and warm connections reopened as soon as lost.

Nothing here is timed: the server below withholds its SETTINGS until it has read a request,
so a pool that waited for them would never send one, and the frames it read say in what
order the client sent them.
"""

from __future__ import annotations

import asyncio
import contextlib

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from hyperframe.frame import Frame

from edgeproxy._upstream.h2pool import H2Pool, _Backoff
from edgeproxy._upstream.pool import PoolLimits, UpstreamError
from edgeproxy.testing import FakeRegion, WanLink

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class _LateSettingsServer(asyncio.Protocol):
    """Sends its SETTINGS only after a request's HEADERS, as an h2c server that sniffs
    the preface does one round trip later; records the frames it read before that."""

    def __init__(self, log: list[list[str]], max_streams: int) -> None:
        self.log = log
        self.max_streams = max_streams
        self.frames: list[str] = []
        self.buf = b""
        self.started = False
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.log.append(self.frames)

    def data_received(self, data: bytes) -> None:
        self._note_frames(data)
        events = self.h2.receive_data(data)
        requests = [e for e in events if isinstance(e, h2.events.RequestReceived)]
        if requests and not self.started:
            self.started = True
            self.frames.append("server SETTINGS")
            self.h2.update_settings(
                {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams}
            )
        for event in requests:
            self.h2.send_headers(event.stream_id, [(":status", "200")])
            self.h2.send_data(event.stream_id, b"ok", end_stream=True)
        assert self.transport is not None
        self.transport.write(self.h2.data_to_send())

    def _note_frames(self, data: bytes) -> None:
        self.buf += data
        if self.buf.startswith(_PREFACE):
            self.frames.append("preface")
            self.buf = self.buf[len(_PREFACE) :]
        while len(self.buf) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(self.buf[:9]))
            if len(self.buf) < 9 + length:
                break
            self.frames.append(type(frame).__name__.removesuffix("Frame").upper())
            self.buf = self.buf[9 + length :]


@contextlib.asynccontextmanager
async def _late_settings_server(max_streams: int = 100):  # type: ignore[no-untyped-def]
    log: list[list[str]] = []
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _LateSettingsServer(log, max_streams), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], log
    finally:
        server.close()
        await server.wait_closed()


async def test_the_first_request_goes_out_before_the_servers_settings() -> None:
    async with _late_settings_server() as (port, log):
        pool = H2Pool(f"http://127.0.0.1:{port}", PoolLimits(warm_connections=0))
        try:
            response = await pool.request("GET", "/", [])
            assert response.status == 200
            await response.aclose()
        finally:
            await pool.aclose()
    assert len(log) == 1
    frames = log[0]
    # Our preface and SETTINGS, then the request, all before the server said anything.
    assert frames[0] == "preface"
    assert frames.index("HEADERS") < frames.index("server SETTINGS")


async def test_before_the_servers_settings_one_stream_then_its_limit() -> None:
    # The server allows 2 streams; before its SETTINGS the pool sends one, then at most 2
    # at a time on the one connection, and nothing is refused.
    async with _late_settings_server(max_streams=2) as (port, log):
        pool = H2Pool(f"http://127.0.0.1:{port}", PoolLimits(warm_connections=0, max_connections=1))
        try:

            async def one() -> int:
                response = await pool.request("GET", "/", [])
                await response.aclose()
                return response.status

            statuses = await asyncio.gather(*(one() for _ in range(6)))
        finally:
            await pool.aclose()
    assert statuses == [200] * 6
    assert len(log) == 1
    frames = log[0]
    before = frames[: frames.index("server SETTINGS")]
    assert before.count("HEADERS") == 1
    assert frames.count("HEADERS") == 6
    assert "RST_STREAM" not in frames


async def _until(predicate, bound: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(bound):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("delay", [0.0, 0.05])
async def test_a_lost_warm_connection_is_reopened_at_once(delay: float) -> None:
    # Maintenance would come round only after 30 s here: the reopen is the loss's own.
    limits = PoolLimits(warm_connections=1, ping_interval=60.0, connect_timeout=60.0)
    async with FakeRegion(name="far") as region, WanLink(region.port, delay=delay) as link:
        pool = H2Pool(link.url, limits)
        try:
            await pool.start()
            assert link.counters.connections_total == 1
            first = pool._conns[0]
            assert link.drop_all() == 1
            await _until(lambda: first.lost)
            # The loss itself started the replacement.
            assert pool._connecting == 1 or len(pool._conns) == 1
            await _until(lambda: link.counters.connections_total == 2)
            response = await pool.request("POST", "/v1/chat/completions", [], b"{}")
            await response.aclose()
            # The request used the reopened connection: no third one.
            assert link.counters.connections_total == 2
        finally:
            await pool.aclose()


async def test_a_region_that_refuses_connections_is_retried_with_backoff() -> None:
    # A port nothing listens on: each failure sets the backoff, so losing nothing more
    # than a refused connect does not turn into a reconnect loop.
    sock_server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
    port = sock_server.sockets[0].getsockname()[1]
    sock_server.close()
    await sock_server.wait_closed()
    link = WanLink(port)
    await link.start()
    limits = PoolLimits(warm_connections=1, ping_interval=60.0, connect_timeout=60.0)
    pool = H2Pool(link.url, limits)
    try:
        with pytest.raises(UpstreamError):
            await pool.start()
        # Drive maintenance by hand: within one backoff period at most one more connect.
        now = asyncio.get_running_loop().time()
        for _ in range(5):
            pool._maintain_once(now)
        assert pool._connecting == 0
        await asyncio.sleep(0)
        assert link.counters.connections_total == 1
    finally:
        await pool.aclose()
        await link.stop()


class _SettingsThenGoaway(asyncio.Protocol):
    """The first connection stays (until the test closes it); every later one gets the
    server's SETTINGS and a GOAWAY and is closed: a connect that succeeds and a connection
    that is gone at once."""

    def __init__(self, seen: list[asyncio.Transport]) -> None:
        self.seen = seen

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.seen.append(transport)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        if len(self.seen) == 1:
            transport.write(conn.data_to_send())
            return
        conn.close_connection()
        transport.write(conn.data_to_send())
        transport.close()

    def data_received(self, data: bytes) -> None:
        pass


async def test_a_server_that_closes_every_connection_is_not_reconnected_in_a_loop() -> None:
    seen: list[asyncio.Transport] = []
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _SettingsThenGoaway(seen), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limits = PoolLimits(warm_connections=1, ping_interval=60.0, connect_timeout=60.0)
    pool = H2Pool(f"http://127.0.0.1:{port}", limits)
    try:
        await pool.start()
        first = pool._conns[0]
        seen[0].close()
        # Its loss reopens at once; that connection's own loss, a moment later, does not.
        await _until(lambda: first.lost and len(seen) >= 2)
        await _until(lambda: not pool._connecting and not pool._conns)
        for _ in range(50):
            await asyncio.sleep(0.001)
        assert len(seen) == 2
        assert not pool._connecting
    finally:
        await pool.aclose()
        server.close()
        await server.wait_closed()


# -- the backoff's delays, drawn without waiting them out ------------------------------

# The largest draw random.random() can return, and its smallest.
_HIGH, _LOW = 1.0 - 2**-53, 0.0


def test_the_backoff_doubles_to_its_cap_with_jitter_and_resets() -> None:
    backoff = _Backoff(base=0.1, cap=5.0)
    ceilings = [backoff.next(_HIGH) for _ in range(9)]
    assert ceilings == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0])
    backoff.reset()
    # The lowest draw never goes under the base: no retry at the round trip's pace.
    assert [backoff.next(_LOW) for _ in range(8)] == pytest.approx([0.1] * 8)
    backoff.reset()
    halves = [backoff.next(0.5) for _ in range(4)]
    assert halves == pytest.approx([0.1, 0.15, 0.25, 0.45])
    # Days of failures do not overflow.
    backoff.attempts = 10_000
    assert backoff.next(_HIGH) == pytest.approx(5.0)


async def test_failed_connects_back_off_exponentially_until_one_succeeds() -> None:
    draws = iter([_HIGH, _HIGH, _HIGH, 0.5, _HIGH, _HIGH])
    async with FakeRegion(name="ap-1") as region:
        pool = H2Pool(region.url, PoolLimits(warm_connections=1, ping_interval=60.0))
        pool._random = lambda: next(draws)
        try:
            now = 1000.0
            delays = []
            for _ in range(4):
                pool._connect_failed(UpstreamError("refused"), now)
                delays.append(pool._connect_backoff_until - now)
            assert delays == pytest.approx([0.1, 0.2, 0.4, 0.45])
            # A connect that succeeds (the server's SETTINGS came): the next failure is
            # retried after the base again.
            await pool.start()
            pool._connect_failed(UpstreamError("refused"), now)
            assert pool._connect_backoff_until - now == pytest.approx(0.1)
        finally:
            await pool.aclose()


class _Lost:
    """What the pool reads of a connection it has lost."""

    def __init__(self, opened_at: float) -> None:
        self.opened_at = opened_at
        self.ready: asyncio.Future[UpstreamError | None] = asyncio.Future()
        self.ready.set_result(None)  # its SETTINGS had come: a connect that succeeded


async def test_reopens_of_connections_lost_at_once_back_off_until_one_lasts() -> None:
    pool = H2Pool("http://127.0.0.1:9", PoolLimits(warm_connections=1, ping_interval=60.0))
    pool._random = lambda: _HIGH
    pool._started = True  # as after start(), without its connect
    reopened: list[float] = []
    clock = [1000.0]
    pool._maybe_connect = lambda demand: reopened.append(clock[0])  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()

    def lost(at: float, lived: float) -> None:
        clock[0] = at
        conn = _Lost(at - lived)
        pool._conns.append(conn)  # type: ignore[arg-type]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(loop, "time", lambda: at)
            pool._connection_gone(conn)  # type: ignore[arg-type]

    def maintain(at: float) -> None:
        clock[0] = at
        pool._maintain_once(at)

    try:
        # Each connection the server accepts is gone a moment later: the first loss is
        # reopened at once, each later one after twice the wait before it.
        lost(1000.0, lived=60.0)
        assert reopened == [1000.0]
        t = 1000.0
        for wait in (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0):
            lost(t + 0.01, lived=0.01)
            maintain(t + wait - 0.001)
            assert reopened[-1] == t
            maintain(t + wait)
            assert reopened[-1] == t + wait
            t += wait
        # One that lasted the cap: its loss is reopened at once, and the next after the base.
        lost(t + 10.0, lived=10.0)
        assert reopened[-1] == t + 10.0
        lost(t + 10.01, lived=0.01)
        maintain(t + 10.0 + 0.1)
        assert reopened[-1] == t + 10.1
    finally:
        pool._conns.clear()
        await pool.aclose()
