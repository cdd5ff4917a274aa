"""The HTTP/2 listener against hostile clients (``edgeproxy.testing.H2Attacker``), each
attack counted: windows kept shut, malformed requests, connection churn under the
per-address cap, the cheap-request rapid reset (the proxy's own 429s being none), frame
floods and the stream cap. After each, a good client on another connection is served."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from edgeproxy import EdgeProxy
from edgeproxy.testing import (
    FLOODS,
    MALFORMED,
    H2Attacker,
    HostileRegion,
    flood_frame,
    malformed_frames,
)
from edgeproxy.testing._h2attack import request_fields

from .conftest import CustomRegion, ProxyFactory, RegionFactory, eventually
from .test_h2_hostile_flow import BigRegion, serve_big_region

H2C = {"http2": True, "h2c": True}
CHAT = "/v1/chat/completions"
GOOD = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
CALM = 0xB
PROTOCOL_ERROR = 0x1
REFUSED_STREAM = 0x7


async def good_client_served(proxy: EdgeProxy) -> None:
    async with httpx.AsyncClient(http1=False, http2=True, timeout=20) as client:
        resp = await client.post(
            proxy.url + CHAT, content=GOOD, headers={"content-type": "application/json"}
        )
        assert resp.status_code == 200, resp.text


@pytest.fixture
async def proxy(make_region: RegionFactory, make_proxy: ProxyFactory) -> EdgeProxy:
    # A first token after 0.3 s: healthy streams are still running when an attack lands.
    region = await make_region("ap-1", model="m", ttft=0.3)
    return await make_proxy([region], server=H2C, limits={"h2_max_control_frames": 100})


# -- windows kept shut -------------------------------------------------------------


ANSWER = 20 * 1024 * 1024


@pytest.fixture
async def huge_region(custom_region: CustomRegion) -> BigRegion:
    return await serve_big_region(custom_region, ANSWER)


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def test_a_hundred_zero_window_streams_hold_little_and_push_back(
    huge_region: BigRegion, make_proxy: ProxyFactory
) -> None:
    """100 streams to 20 MB answers (2 GB asked for), window 0 and never a WINDOW_UPDATE:
    the proxy (in this process, with the region) grows by less than 100 MB, and every
    region answer waits on the proxy."""
    proxy = await make_proxy([{"name": "huge", "url": huge_region.url, "http2": False}], server=H2C)
    before = rss_kib()
    client = await H2Attacker.open(proxy.url, window=0, read=False)
    streams = []
    out = b""
    for _ in range(100):
        stream_id, frames = client.request(body=GOOD)
        streams.append(stream_id)
        out += frames
    client.send(out)
    await eventually(lambda: huge_region.started == 100, timeout=30)
    await eventually(lambda: huge_region.waiting() == 100, timeout=30)
    grown_mib = (rss_kib() - before) / 1024
    assert grown_mib < 100, grown_mib
    assert huge_region.finished == 0
    assert proxy.guard.h2_buffered_peak <= 1024 * 1024 + 100 * 32 * 1024
    await eventually(lambda: all(client.answers[s].status == 200 for s in streams))
    await client.close()
    await eventually(lambda: proxy.guard.open == 0)


# -- malformed requests ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MALFORMED))
async def test_a_malformed_request_resets_its_stream_alone(proxy: EdgeProxy, name: str) -> None:
    client = await H2Attacker.open(proxy.url)
    healthy = []
    out = b""
    for _ in range(10):
        stream_id, frames = client.request(body=GOOD)
        healthy.append(stream_id)
        out += frames
    bad, frames = malformed_frames(client, name)
    client.send(out + frames)
    answer = await client.answer(bad)
    assert answer.reset == PROTOCOL_ERROR, answer
    for stream_id in healthy:
        done = await client.answer(stream_id)
        assert done.status == 200 and done.ended, (stream_id, done)
    assert client.goaway is None
    assert proxy.guard.h2_stream_errors == 1
    assert proxy.guard.h2_protocol_errors == 0
    await client.close()
    await good_client_served(proxy)


# -- connection churn --------------------------------------------------------------------


async def test_sequential_connections_under_the_per_address_cap_all_succeed(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", model="m")
    proxy = await make_proxy(
        [region], server=H2C, limits={"max_connections_per_ip": 20, "keepalive_timeout": 75}
    )
    served = 0
    for _ in range(25):
        client = await H2Attacker.open(proxy.url)
        stream_id, frames = client.request(body=GOOD)
        client.send(frames)
        answer = await client.answer(stream_id)
        served += answer.status == 200 and answer.ended
        await client.close()
    assert served == 25
    assert proxy.guard.snapshot()["connections_refused_per_ip"] == 0
    await eventually(lambda: proxy.guard.open == 0)


# -- rapid reset, the cheap way ---------------------------------------------------------


async def test_cheap_requests_do_not_hide_a_rapid_reset(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    """Two bad-JSON requests (answered by the proxy itself) for each region request
    cancelled at once: counted by cost, GOAWAY comes long before 200 cancelled region
    requests."""
    region = await make_region("ap-1", model="m", ttft=0.2)
    proxy = await make_proxy([region], server=H2C)
    client = await H2Attacker.open(proxy.url)
    cancelled = 0
    for _ in range(400):
        if client.goaway is not None or client.closed.is_set():
            break
        out = b""
        for _ in range(2):
            _, frames = client.request(body=b"{not json")
            out += frames
        stream_id, frames = client.request(body=GOOD)
        client.send(out + frames + client.reset(stream_id))
        cancelled += 1
        await client.drain()
        await asyncio.sleep(0)
    goaway = await client.wait_goaway()
    assert goaway is not None and goaway[0] == CALM, goaway
    assert cancelled < 200, cancelled
    assert proxy.guard.h2_rapid_resets == 1
    # The bad-JSON requests are the proxy's to answer: only cancelled ones can reach the region.
    await eventually(lambda: proxy.pipeline.in_flight == 0)
    assert region.requests_total <= cancelled, (region.requests_total, cancelled)
    await client.close()
    await good_client_served(proxy)


# -- the proxy's own refusals are no rapid reset --------------------------------------


@pytest.fixture
async def hostile() -> AsyncIterator[HostileRegion]:
    async with HostileRegion(events=3) as region:
        yield region


async def test_the_proxys_own_refusals_on_one_connection_are_no_rapid_reset(
    hostile: HostileRegion, make_proxy: ProxyFactory
) -> None:
    """A browser's connection carries a streaming answer while its other requests get the
    proxy's 429s, far more than h2_max_premature_resets: no GOAWAY, and the answer ends."""
    proxy = await make_proxy(
        [{"name": "hostile", "url": hostile.url}],
        server=H2C,
        admission={"ip_requests_per_second": 0.001, "ip_burst": 1},
        limits={"h2_max_premature_resets": 20},
    )
    client = await H2Attacker.open(proxy.url)
    stream = json.dumps({**json.loads(GOOD), "stream": True}).encode()
    sse, frames = client.request([*request_fields(), ("x-hostile-gate", "1")], body=stream)
    client.send(frames)
    await hostile.wait_until(lambda c: c.streams_opened == 1, timeout=20)
    refused = []
    for _ in range(60):
        stream_id, frames = client.request(body=GOOD)
        refused.append(stream_id)
        client.send(frames)
    answers = [await client.answer(s) for s in refused]
    assert all(a.status == 429 and a.ended for a in answers), [a.status for a in answers]
    hostile.open_gate()
    answer = await client.answer(sse)
    assert answer.status == 200 and answer.ended, answer
    assert answer.body.endswith(b"data: [DONE]\n\n"), bytes(answer.body[-200:])
    assert client.goaway is None
    assert proxy.guard.h2_rapid_resets == 0
    await client.close()


# -- frame floods ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FLOODS))
async def test_a_frame_flood_gets_goaway(proxy: EdgeProxy, name: str) -> None:
    client = await H2Attacker.open(proxy.url)
    # An open stream (a body still to come) for the frames that need one.
    stream_id = client.stream()
    client.send(client.headers_frame(stream_id, [*_chat_fields()]))
    sent = 0
    while sent < 20 * 100 and client.goaway is None and not client.closed.is_set():
        client.send(b"".join(flood_frame(name, stream_id, sent + i) for i in range(50)))
        sent += 50
        await client.drain()
        await asyncio.sleep(0)
    goaway = await client.wait_goaway()
    assert goaway is not None and goaway[0] == CALM, (name, goaway, sent)
    assert proxy.guard.h2_control_floods == 1
    await client.close()
    await good_client_served(proxy)


def _chat_fields() -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":path", CHAT),
        (":scheme", "http"),
        (":authority", "localhost"),
        ("content-type", "application/json"),
    ]


async def test_a_reading_client_is_no_flood(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    """A client reading long answers sends WINDOW_UPDATEs for every DATA frame, and ends
    each request with an empty DATA frame: hundreds of requests on one connection within
    the 10-second window are no flood."""
    region = await make_region("ap-1", model="m")
    proxy = await make_proxy([region], server=H2C, limits={"h2_max_control_frames": 20})
    async with httpx.AsyncClient(http1=False, http2=True, timeout=20) as client:
        for _ in range(5):
            answers = await asyncio.gather(
                *(
                    client.post(proxy.url + CHAT, json={**json.loads(GOOD), "stream": True})
                    for _ in range(40)
                )
            )
            assert all(a.status_code == 200 for a in answers)
    assert proxy.guard.h2_control_floods == 0


# -- the stream cap ---------------------------------------------------------------------


async def test_streams_past_the_cap_are_refused_and_the_rest_served(
    proxy: EdgeProxy,
) -> None:
    client = await H2Attacker.open(proxy.url)
    streams = []
    out = b""
    for _ in range(110):
        stream_id, frames = client.request(
            [
                (":method", "GET"),
                (":path", "/v1/models"),
                (":scheme", "http"),
                (":authority", "localhost"),
            ]
        )
        streams.append(stream_id)
        out += frames
    client.send(out)
    answers = [await client.answer(s) for s in streams]
    refused = [a for a in answers if a.reset == REFUSED_STREAM]
    served = [a for a in answers if a.status == 200 and a.ended]
    assert len(refused) == 10 and len(served) == 100
    assert client.goaway is None
    assert proxy.guard.h2_refused_streams == 10
    await client.close()
    await good_client_served(proxy)
