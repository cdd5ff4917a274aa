"""The HTTP/2 pool and the proxy against a region that breaks HTTP/2 on purpose.

:class:`~edgeproxy.testing.HostileRegion` answers each request with the
misbehaviour it names. The pool is held to one connection, and healthy SSE
streams are kept open on it (gated: the server sends their first event, then
waits for :meth:`~edgeproxy.testing.HostileRegion.open_gate`) while one bad
request runs, so each test sees what the bad one does to its neighbours:

* a malformed response is a *stream* error (RFC 9113 §8.1.1): that request
  fails with :class:`UpstreamProtocolError`, its stream is reset with
  PROTOCOL_ERROR, and the connection and every healthy stream on it survive;
* floods and flow-control abuse leave the pool usable or fail cleanly: a clear
  :class:`UpstreamError`, no traceback in the log, no hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import h2.errors
import pytest

from edgeproxy._upstream.h2pool import H2Pool, H2Response
from edgeproxy._upstream.http1 import AiohttpPool
from edgeproxy._upstream.pool import PoolLimits, UpstreamProtocolError, UpstreamTimeout
from edgeproxy.testing import HostileRegion

from .conftest import ProxyFactory

HEALTHY = 5  # healthy SSE streams sharing the connection with the bad one
EVENTS = 4  # events in each healthy SSE answer
WAIT = 30.0  # a generous bound on every wait: a hang fails the test, not the run
PROTOCOL_ERROR = int(h2.errors.ErrorCodes.PROTOCOL_ERROR)
CANCEL = int(h2.errors.ErrorCodes.CANCEL)
GATED_SSE = "/hostile/sse?gate=1"
SSE = HostileRegion.sse_body(EVENTS)  # a healthy stream's whole body
# Malformed responses the client can no longer reset: the server had already
# ended the stream (the request ended too), so the stream is closed.
_ENDED_BEFORE_MALFORMED = frozenset({"content-length-short", "pseudo-in-trailers"})


@pytest.fixture(autouse=True)
def no_tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail a test whose run logged an error or a traceback (asyncio's included)."""
    caplog.set_level(logging.WARNING)
    yield
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [f"{r.name}: {r.getMessage()}" for r in bad]


@pytest.fixture
async def region() -> AsyncIterator[HostileRegion]:
    async with HostileRegion(events=EVENTS) as hostile:
        yield hostile


def one_connection(**overrides: Any) -> PoolLimits:
    values: dict[str, Any] = {
        "max_connections": 1,
        "warm_connections": 1,
        "connect_timeout": 5.0,
        "read_timeout": WAIT,
        "write_timeout": WAIT,
        "pool_timeout": WAIT,
        "ping_interval": 60.0,
        "keepalive_expiry": 60.0,
    }
    values.update(overrides)
    return PoolLimits(**values)


@contextlib.asynccontextmanager
async def started_pool(url: str, limits: PoolLimits | None = None) -> AsyncIterator[H2Pool]:
    pool = H2Pool(url, limits or one_connection())
    try:
        await pool.start()
        yield pool
    finally:
        await pool.aclose()


async def fetch(pool: H2Pool, target: str, method: str = "GET", body: Any = None) -> bytes:
    async with asyncio.timeout(WAIT):
        resp = await pool.request(method, target, [], body)
        try:
            return b"".join([chunk async for chunk in resp.aiter_bytes()])
        finally:
            await resp.aclose()


class Healthy:
    """A gated SSE stream whose first event has arrived."""

    def __init__(self, resp: H2Response, body: AsyncIterator[bytes], first: bytes) -> None:
        self.resp = resp
        self.chunks = body  # the one iterator: dropping it would close the stream
        self.body = first

    async def finish(self) -> bytes:
        try:
            async with asyncio.timeout(WAIT):
                async for chunk in self.chunks:
                    self.body += chunk
        finally:
            await self.resp.aclose()
        return self.body


async def open_healthy(pool: H2Pool, count: int = HEALTHY) -> list[Healthy]:
    async def one() -> Healthy:
        async with asyncio.timeout(WAIT):
            resp = await pool.request("GET", GATED_SSE, [])
            assert resp.status == 200
            body = resp.aiter_bytes()
            first = await anext(body)
        return Healthy(resp, body, first)

    streams = list(await asyncio.gather(*(one() for _ in range(count))))
    assert pool.stats().streams_in_use == count
    return streams


async def finish_all(region: HostileRegion, streams: list[Healthy]) -> list[bytes]:
    region.open_gate()
    return list(await asyncio.gather(*(s.finish() for s in streams)))


# -- malformed responses: a stream error each ----------------------------------------


@pytest.mark.parametrize("behavior", sorted(HostileRegion.MALFORMED))
async def test_malformed_response_fails_only_its_own_stream(
    region: HostileRegion, behavior: str
) -> None:
    async with started_pool(region.url) as pool:
        healthy = await open_healthy(pool)

        with pytest.raises(UpstreamProtocolError, match="malformed") as info:
            await fetch(pool, f"/hostile/{behavior}")
        assert not info.value.retryable  # the region saw the request

        bodies = await finish_all(region, healthy)
        complete = sum(body == SSE for body in bodies)
        assert complete == HEALTHY
        # The same connection carried everything and still does.
        assert await fetch(pool, "/hostile/json")
        assert region.counters.connections == 1
        assert pool.stats().connections_open == 1
        assert pool.stats().streams_in_use == 0
        if behavior not in _ENDED_BEFORE_MALFORMED:
            await region.wait_until(lambda c: c.reset_codes[PROTOCOL_ERROR] == 1, WAIT)
        assert region.counters.goaways_received == 0


async def test_healthy_neighbours_survive_every_malformed_response_in_turn(
    region: HostileRegion,
) -> None:
    # One connection, all the malformed answers one after another, while the
    # same healthy streams stay open across all of them.
    async with started_pool(region.url) as pool:
        healthy = await open_healthy(pool)
        for behavior in sorted(HostileRegion.MALFORMED):
            with pytest.raises(UpstreamProtocolError, match="malformed"):
                await fetch(pool, f"/hostile/{behavior}")
        bodies = await finish_all(region, healthy)
        assert [body == SSE for body in bodies] == [True] * HEALTHY
        assert region.counters.connections == 1
        assert region.counters.goaways_received == 0


# -- abuse: usable, or a clean failure -----------------------------------------------

# What the bad request gets, and whether its healthy neighbours survive:
# "ok" (it succeeds), "stream" (it alone fails), "connection" (the connection
# fails cleanly and the pool opens a new one).
ABUSE = {
    "settings-flood": "ok",
    "ping-flood": "ok",
    "window-update-overflow": "stream",
    "rst-after": "stream",
    "window-update-zero": "connection",
    "window-update-zero-connection": "connection",
    "window-update-overflow-connection": "connection",
    "oversized-headers": "connection",
}


@pytest.mark.parametrize(("behavior", "outcome"), sorted(ABUSE.items()))
async def test_abuse_leaves_the_pool_usable_or_fails_cleanly(
    region: HostileRegion, behavior: str, outcome: str
) -> None:
    async with started_pool(region.url) as pool:
        healthy = await open_healthy(pool)
        target = f"/hostile/{behavior}?count=5000"
        if outcome == "ok":
            assert b"chat.completion" in await fetch(pool, target)
        else:
            with pytest.raises(UpstreamProtocolError):
                await fetch(pool, target)

        region.open_gate()
        results = await asyncio.gather(*(s.finish() for s in healthy), return_exceptions=True)
        if outcome == "connection":
            # Every neighbour failed with a clear error, none hung.
            assert all(isinstance(r, UpstreamProtocolError) for r in results), results
        else:
            assert results == [SSE] * HEALTHY
        # Usable afterwards, on the same connection unless it had to go.
        assert b"chat.completion" in await fetch(pool, "/hostile/json")
        assert region.counters.connections == (2 if outcome == "connection" else 1)
        assert pool.stats().streams_in_use == 0


async def test_floods_are_answered(region: HostileRegion) -> None:
    async with started_pool(region.url) as pool:
        await fetch(pool, "/hostile/ping-flood?count=3000")
        await fetch(pool, "/hostile/settings-flood?count=1000")
        counters = await region.wait_until(
            lambda c: c.pings_acked == 3000 and c.settings_acked >= 1001, WAIT
        )
        assert counters.connections == 1


async def test_stream_window_overflow_names_the_flow_control_error(region: HostileRegion) -> None:
    async with started_pool(region.url) as pool:
        with pytest.raises(UpstreamProtocolError, match="FLOW_CONTROL_ERROR"):
            await fetch(pool, "/hostile/window-update-overflow")


async def test_reset_after_some_bytes_fails_that_stream(region: HostileRegion) -> None:
    async with started_pool(region.url) as pool:
        resp = await pool.request("GET", "/hostile/rst-after?bytes=300", [])
        received = b""
        with pytest.raises(UpstreamProtocolError, match="INTERNAL_ERROR"):
            async with asyncio.timeout(WAIT):
                async for chunk in resp.aiter_bytes():
                    received += chunk
        assert received == b"r" * 300
        assert b"tok0" in await fetch(pool, "/hostile/sse")
        assert region.counters.connections == 1


async def test_stalled_upload_window_times_out_the_write_only(region: HostileRegion) -> None:
    async with started_pool(region.url, one_connection(write_timeout=0.3)) as pool:
        healthy = await open_healthy(pool)
        with pytest.raises(UpstreamTimeout) as info:
            async with asyncio.timeout(WAIT):
                await pool.request("POST", "/hostile/stall-window", [], b"u" * (256 * 1024))
        assert info.value.phase == "write"
        bodies = await finish_all(region, healthy)
        assert bodies == [SSE] * HEALTHY
        assert b"chat.completion" in await fetch(pool, "/hostile/json")
        assert region.counters.connections == 1


async def test_endless_body_is_cancelled_by_the_reader(region: HostileRegion) -> None:
    async with started_pool(region.url) as pool:
        healthy = await open_healthy(pool)
        async with asyncio.timeout(WAIT):
            resp = await pool.request("GET", "/hostile/endless?bytes=4096", [])
            body = resp.aiter_bytes()
            total = 0
            while total < 1024 * 1024:
                total += len(await anext(body))
            await resp.aclose()
            await body.aclose()
        await region.wait_until(lambda c: c.reset_codes[CANCEL] == 1, WAIT)
        bodies = await finish_all(region, healthy)
        assert bodies == [SSE] * HEALTHY
        assert region.counters.connections == 1


async def test_silent_stream_times_out_and_is_reset(region: HostileRegion) -> None:
    async with started_pool(region.url, one_connection(read_timeout=0.3)) as pool:
        with pytest.raises(UpstreamTimeout) as info:
            await fetch(pool, "/hostile/hang")
        assert info.value.phase == "read"
        await region.wait_until(lambda c: c.reset_codes[CANCEL] == 1, WAIT)
        assert b"chat.completion" in await fetch(pool, "/hostile/json")
        assert region.counters.connections == 1


async def test_goaway_drains_the_streams_it_accepted(region: HostileRegion) -> None:
    async with started_pool(region.url) as pool:
        healthy = await open_healthy(pool)
        # GOAWAY names this stream as the last one: it and the older ones finish.
        assert await fetch(pool, "/hostile/goaway") == SSE
        bodies = await finish_all(region, healthy)
        assert bodies == [SSE] * HEALTHY
        assert b"chat.completion" in await fetch(pool, "/hostile/json")
        assert region.counters.connections == 2


async def test_goaway_below_a_stream_refuses_it(region: HostileRegion) -> None:
    async with started_pool(region.url) as pool:
        healthy = await open_healthy(pool)
        # Refused on the first connection, retried once, refused again.
        with pytest.raises(UpstreamProtocolError, match="GOAWAY") as info:
            await fetch(pool, "/hostile/goaway-refuse")
        assert info.value.retryable
        bodies = await finish_all(region, healthy)
        assert bodies == [SSE] * HEALTHY
        assert b"chat.completion" in await fetch(pool, "/hostile/json")


# -- through the proxy ----------------------------------------------------------------

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.mark.parametrize("behavior", ["status-nonnumeric", "cr-in-value", "status-101"])
async def test_proxy_answers_502_for_a_malformed_stream_while_its_neighbour_streams_on(
    region: HostileRegion, make_proxy: ProxyFactory, behavior: str
) -> None:
    proxy = await make_proxy(
        [{"name": "hostile", "url": region.url}],
        upstream={"http2": True, "max_connections": 1, "read_timeout": WAIT},
        health={"outlier_detection": False},
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as client:
        headers = {"x-hostile": "sse", "x-hostile-gate": "1"}
        async with client.post(proxy.url + CHAT, json=BODY, headers=headers) as good:
            assert good.status == 200
            first = await good.content.readuntil(b"\n\n")
            assert b"tok0" in first

            async with client.post(
                proxy.url + CHAT, json=BODY, headers={"x-hostile": behavior}
            ) as bad:
                assert bad.status == 502
                error = (await bad.json())["error"]
                assert error["type"] == "upstream_error"
                assert error["code"] == "bad_gateway"

            region.open_gate()
            rest = await good.read()
        assert first + rest == SSE
    assert region.counters.connections == 1
    assert region.counters.behaviors["sse"] == 1


# -- HTTP/1.1 regions -----------------------------------------------------------------


@contextlib.asynccontextmanager
async def http1_server(status_line: bytes) -> AsyncIterator[str]:
    """A server answering every HTTP/1.1 request with ``status_line`` and a short body."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(status_line + b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "status_line",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket",
        b"HTTP/1.1 600 Beyond",
        b"HTTP/1.1 999 Beyond",
    ],
)
async def test_http1_pool_never_relays_101_or_a_status_out_of_range(status_line: bytes) -> None:
    async with http1_server(status_line) as origin:
        pool = AiohttpPool(origin, one_connection(warm_connections=0))
        try:
            with pytest.raises(UpstreamProtocolError, match="status"):
                async with asyncio.timeout(WAIT):
                    resp = await pool.request("GET", "/", [])
                    await resp.aclose()
            assert pool.stats().streams_in_use == 0
        finally:
            await pool.aclose()


async def test_http1_pool_still_relays_ordinary_statuses() -> None:
    async with http1_server(b"HTTP/1.1 599 Custom") as origin:
        pool = AiohttpPool(origin, one_connection(warm_connections=0))
        try:
            resp = await pool.request("GET", "/", [])
            assert resp.status == 599
            await resp.aclose()
        finally:
            await pool.aclose()


def test_every_behaviour_is_exercised_here() -> None:
    covered = (
        set(HostileRegion.MALFORMED)
        | set(ABUSE)
        | {"sse", "json", "stall-window", "endless", "hang", "goaway", "goaway-refuse"}
    )
    assert covered == set(HostileRegion.BEHAVIORS)


async def test_unknown_behaviour_is_a_404(region: HostileRegion) -> None:
    async with started_pool(region.url) as pool:
        resp = await pool.request("GET", "/hostile/nonsense", [])
        assert resp.status == 404
        await resp.aclose()
        with pytest.raises(ValueError):
            HostileRegion(default="nonsense")
