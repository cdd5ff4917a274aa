"""The WAN model of the test kit: round trips, bandwidth, loss and its refusals."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import AsyncIterator

import aiohttp
import pytest

from edgeproxy.testing import WanLink
from tests.conftest import ProxyFactory, RegionFactory


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    """A TCP echo server on 127.0.0.1."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    yield int(server.sockets[0].getsockname()[1])
    server.close()
    await server.wait_closed()


async def ping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    writer.write(b"ping")
    await writer.drain()
    assert await reader.readexactly(4) == b"ping"
    return loop.time() - start


async def test_round_trip_within_ten_percent_of_the_configured_one(echo_port: int) -> None:
    async with WanLink(echo_port, delay=0.05, seed=1) as link:
        assert link.rtt == pytest.approx(0.1)
        loop = asyncio.get_running_loop()
        start = loop.time()
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        # A new connection pays the handshake's round trip before its first bytes cross.
        await ping(reader, writer)
        assert loop.time() - start >= 2 * link.rtt
        rtts = [await asyncio.wait_for(ping(reader, writer), 5) for _ in range(15)]
        writer.close()
    median = statistics.median(rtts)
    assert median == pytest.approx(0.1, rel=0.10), rtts
    assert min(rtts) >= 0.1  # a delay is a floor: nothing arrives early


async def test_asymmetric_delays_and_jitter_keep_order(echo_port: int) -> None:
    async with WanLink(echo_port, up_delay=0.03, down_delay=0.01, jitter=0.01, seed=7) as link:
        assert link.rtt == pytest.approx(0.04)
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        sent = b"".join(b"%05d" % i for i in range(200))
        for i in range(200):
            writer.write(sent[i * 5 : i * 5 + 5])
            await writer.drain()
            await asyncio.sleep(0)
        assert await asyncio.wait_for(reader.readexactly(len(sent)), 10) == sent
        writer.close()


async def test_bandwidth_paces_and_delay_does_not_cap_throughput(echo_port: int) -> None:
    loop = asyncio.get_running_loop()
    payload = b"x" * 100_000
    async with WanLink(echo_port, bandwidth=200_000) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        start = loop.time()
        writer.write(payload)
        await asyncio.wait_for(reader.readexactly(len(payload)), 20)
        paced = loop.time() - start
        writer.close()
        assert link.counters.bytes_up == link.counters.bytes_down == len(payload)
    # 100 kB at 200 kB/s is half a second at least; the bound above is generous.
    assert 0.4 <= paced < 10
    big = b"y" * 4_000_000
    async with WanLink(echo_port, delay=0.2) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        start = loop.time()
        writer.write(big)
        await asyncio.wait_for(reader.readexactly(len(big)), 30)
        delayed = loop.time() - start
        writer.close()
    # Chunks are queued with their release times, not sent one round trip at a time
    # (that would take 60+ chunks x 0.4 s here).
    assert 0.4 <= delayed < 8


async def test_loss_drops_connections_and_a_client_reconnects(echo_port: int) -> None:
    async with WanLink(echo_port, loss=1.0) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(b"ping")
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(4), 5)
        writer.close()
        assert link.counters.dropped_total == 1
    async with WanLink(echo_port, connection_loss=1.0) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(4), 5)
        writer.close()
        assert link.counters.dropped_total == 1
    async with WanLink(echo_port, connection_loss=0.5, seed=3) as link:
        attempts = 0
        while True:
            attempts += 1
            assert attempts < 50
            reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
            try:
                assert await asyncio.wait_for(ping(reader, writer), 5) >= 0
                break
            except (ConnectionError, asyncio.IncompleteReadError):
                continue
            finally:
                writer.close()
        assert link.counters.dropped_total == attempts - 1
        assert link.counters.connections_total == attempts


async def test_drop_all_resets_open_connections(echo_port: int) -> None:
    async with WanLink(echo_port, delay=0.005) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        await ping(reader, writer)
        assert link.drop_all() == 1
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(ping(reader, writer), 5)
        writer.close()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"delay": -0.1}, "delay"),
        ({"up_delay": -1}, "up_delay"),
        ({"down_delay": float("nan")}, "down_delay"),
        ({"jitter": -0.01}, "jitter"),
        ({"loss": 1.5}, "loss"),
        ({"loss": -0.1}, "loss"),
        ({"connection_loss": 2}, "connection_loss"),
        ({"bandwidth": 0}, "bandwidth"),
        ({"target_port": 0}, "target_port"),
    ],
)
def test_bad_parameters_are_refused_naming_them(kwargs: dict[str, float], name: str) -> None:
    args = {"target_port": 9, **kwargs}
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        WanLink(**args)  # type: ignore[arg-type]


def test_configure_checks_everything_before_changing_anything() -> None:
    link = WanLink(9, delay=0.01, loss=0.1)
    with pytest.raises(ValueError, match="^loss must be a probability between 0 and 1"):
        link.configure(delay=0.5, loss=3)
    assert (link.up_delay, link.down_delay, link.loss) == (0.01, 0.01, 0.1)
    with pytest.raises(TypeError, match="^jitter must be a number"):
        link.configure(jitter="1")  # type: ignore[arg-type]
    link.configure(delay=0.2, bandwidth=1e6)
    assert (link.rtt, link.bandwidth) == (0.4, 1e6)
    link.configure(bandwidth=None)
    assert link.bandwidth is None
    with pytest.raises(RuntimeError, match="not started"):
        _ = link.url


async def test_a_proxy_reaches_a_region_over_h2c_through_the_link(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("far", tokens=5)
    async with WanLink(region.port, delay=0.01, jitter=0.002) as link:
        proxy = await make_proxy([{"name": "far", "url": link.url}])
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-edgeproxy-region"] == "far"
                answer = await resp.json()
            async with client.post(
                proxy.url + "/v1/chat/completions", json={**body, "stream": True}
            ) as resp:
                assert resp.status == 200
                text = await resp.text()
        assert answer["choices"][0]["message"]["content"]
        assert text.rstrip().endswith("data: [DONE]")
        assert link.counters.connections_total >= 1
        # h2c: the client preface crossed the link, and one connection multiplexes both.
        assert link.counters.bytes_up > len(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert region.connections_total == link.counters.connections_total


async def test_stopping_with_connections_open_ends_them_cleanly(
    echo_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    link = WanLink(echo_port, delay=0.01)
    await link.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    await ping(reader, writer)
    await asyncio.wait_for(link.stop(), 5)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(ping(reader, writer), 5)
    writer.close()
    await asyncio.sleep(0.05)  # a handler's done callback would log here
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
