"""End to end: a real client, the real proxy, real HTTP/2 (h2c) and HTTP/1.1 fake regions."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import orjson
import pytest

from .conftest import ProxyFactory, RegionFactory, check_disconnect_cancels_upstream, eventually

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def sse_events(raw: bytes) -> list[str]:
    return [
        line[len(b"data: ") :].decode() for line in raw.split(b"\n") if line.startswith(b"data: ")
    ]


@pytest.fixture(params=[True, False], ids=["h2c", "http1"])
def http2(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


async def test_json_passthrough(
    make_region: RegionFactory, make_proxy: ProxyFactory, http2: bool
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url, "http2": http2}])
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200
            assert resp.headers["X-Edgeproxy-Region"] == "ap-1"
            assert resp.headers["x-fake-region"] == "ap-1"
            data = await resp.json()
        # The same request straight to the region gives the same answer.
        async with client.post(region.url + CHAT, json=BODY) as direct:
            direct_data = await direct.json()
            assert direct_data["choices"] == data["choices"]
            assert direct_data["usage"] == data["usage"]
    assert data["object"] == "chat.completion"
    assert data["usage"]["total_tokens"] > 0


async def test_sse_chunks_arrive_before_upstream_finishes(
    make_region: RegionFactory, make_proxy: ProxyFactory, http2: bool
) -> None:
    # The region sends its first event, then stalls: anything buffering
    # would never show the client that first event.
    # Only the API stalls: the HTTP/1.1 pool's warm-up (OPTIONS /) is answered.
    region = await make_region("ap-1", fault="stall_body", fault_paths=["/v1/"])
    proxy = await make_proxy([{"name": "ap-1", "url": region.url, "http2": http2}])
    assert proxy.regions.by_name["ap-1"].state == "up"
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
            assert first.startswith(b"data: ")
            assert region.in_flight == 1


async def test_sse_full_stream(
    make_region: RegionFactory, make_proxy: ProxyFactory, http2: bool
) -> None:
    region = await make_region("ap-1", inter_token_delay=0.01, tokens=6)
    proxy = await make_proxy([{"name": "ap-1", "url": region.url, "http2": http2}])
    reads = 0
    raw = b""
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json={**BODY, "stream": True}) as resp:
            async for chunk in resp.content.iter_any():
                reads += 1
                raw += chunk
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    assert len(events) >= 7
    assert reads > 1  # delivered incrementally, not as one blob
    text = "".join(
        json.loads(e)["choices"][0]["delta"].get("content", "")
        for e in events[:-1]
        if json.loads(e)["choices"]
    )
    assert text


async def test_multiplexing_over_few_connections(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", ttft=0.05)
    proxy = await make_proxy(
        [{"name": "ap-1", "url": region.url, "http2": True}],
        upstream={"max_connections": 2, "warm_connections": 1},
    )
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:

        async def one() -> int:
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(one() for _ in range(100)))
    assert statuses == [200] * 100
    assert region.requests_total >= 100
    # 100 concurrent requests rode on at most the two pooled connections.
    assert 1 <= region.connections_total <= 2
    stats = proxy.regions.by_name["ap-1"].pool.stats()
    assert stats.connections_open <= 2
    assert stats.streams_in_use == 0


async def test_forwarding_and_hop_by_hop_headers(
    make_region: RegionFactory, make_proxy: ProxyFactory, http2: bool
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy(
        [{"name": "ap-1", "url": region.url, "http2": http2, "api_key": "sk-region-secret"}]
    )
    headers = {
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "must-not-pass",
        "Keep-Alive": "timeout=5",
        "Proxy-Authorization": "Basic abc",
        "Authorization": "Bearer client-key",
        "X-Forwarded-For": "203.0.113.7",
        "X-Edgeproxy-Internal": "forged",
        "X-Request-Id": "req-42",
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "X-Custom": "kept",
    }
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/echo/x?q=1", data=b"abc", headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["X-Request-Id"] == "req-42"
            assert resp.headers["X-Edgeproxy-Region"] == "ap-1"
            assert "sk-region-secret" not in str(resp.headers)
            echo = await resp.json()
    seen = {k.lower(): v for k, v in echo["headers"]}
    # The hop to the region is its own: HTTP/2 has no Connection header at all, and on
    # HTTP/1.1 the proxy sends none (keep-alive is the default), let alone the client's.
    assert echo["http_version"] == ("2" if http2 else "1.1")
    for hop in ("connection", "x-hop", "keep-alive", "proxy-authorization", "x-edgeproxy-internal"):
        assert hop not in seen
    assert seen["authorization"] == "Bearer sk-region-secret"
    assert seen["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "http"
    assert seen["via"].endswith("edge-test")
    assert seen["x-custom"] == "kept"
    assert seen["x-request-id"] == "req-42"
    trace = seen["traceparent"].split("-")
    assert trace[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace[2] != "00f067aa0ba902b7"
    host = seen.get("host") or seen.get(":authority")
    assert host == region.url.removeprefix("http://")
    assert echo["path"] == "/echo/x"
    assert echo["query_string"] == "q=1"
    assert echo["body_length"] == 3


async def test_large_body_streams_both_ways(
    make_region: RegionFactory, make_proxy: ProxyFactory, http2: bool
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url, "http2": http2}])
    payload = bytes(range(256)) * 8192  # 2 MiB, above the in-one-go threshold

    async def gen() -> object:
        for i in range(0, len(payload), 65536):
            yield payload[i : i + 65536]

    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/echo/upload", data=gen()) as resp:
            echo = await resp.json()
        async with client.get(proxy.url + "/echo/download?size=3000000") as resp:
            assert resp.status == 200
            body = await resp.read()
    import hashlib

    assert echo["body_length"] == len(payload)
    assert echo["body_sha256"] == hashlib.sha256(payload).hexdigest()
    assert len(body) == 3_000_000


async def test_status_codes_pass_through(
    make_region: RegionFactory, make_proxy: ProxyFactory, http2: bool
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url, "http2": http2}])
    async with aiohttp.ClientSession() as client:
        for code in (201, 404, 429, 500, 503):
            async with client.get(proxy.url + f"/status/{code}") as resp:
                assert resp.status == code
                assert resp.headers["X-Edgeproxy-Region"] == "ap-1"
                await resp.read()
        async with client.post(
            proxy.url + CHAT, data=b"{not json", headers={"content-type": "application/json"}
        ) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "invalid_request_error"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_connect_failure_is_502(make_proxy: ProxyFactory, http2: bool) -> None:
    proxy = await make_proxy(
        [{"name": "dead", "url": f"http://127.0.0.1:{closed_port()}", "http2": http2}]
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 502
            assert resp.headers["X-Edgeproxy-Region"] == "dead"
            error = (await resp.json())["error"]
    assert error["type"] == "upstream_error"
    assert "dead" in error["message"]


async def test_stalled_region_is_504(
    make_region: RegionFactory, make_proxy: ProxyFactory, http2: bool
) -> None:
    region = await make_region("ap-1", fault="stall", fault_paths=["/v1/"])
    proxy = await make_proxy(
        [{"name": "ap-1", "url": region.url, "http2": http2}], upstream={"read_timeout": 0.5}
    )
    assert proxy.regions.by_name["ap-1"].state == "up"  # it only stalls the request
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 504
            error = (await resp.json())["error"]
    assert error["type"] == "upstream_timeout"
    await eventually(lambda: region.in_flight == 0)


async def test_upstream_5xx_passes_through(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", fault="5xx")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}])
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 503
            assert "error" in await resp.json()


async def test_reset_mid_stream_is_not_a_clean_end(
    make_region: RegionFactory, make_proxy: ProxyFactory, http2: bool
) -> None:
    region = await make_region("ap-1", fault="reset", fault_after_tokens=2, inter_token_delay=0.01)
    proxy = await make_proxy([{"name": "ap-1", "url": region.url, "http2": http2}])
    raw = b""
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in resp.content.iter_any():
                    raw += chunk
    assert b"event: error" in raw
    assert b"[DONE]" not in raw
    error_line = [line for line in raw.split(b"\n") if line.startswith(b'data: {"error"')]
    assert orjson.loads(error_line[0][6:])["error"]["type"] == "upstream_error"


async def test_client_disconnect_cancels_upstream(
    make_region: RegionFactory, make_proxy: ProxyFactory, http2: bool
) -> None:
    region = await make_region("ap-1", inter_token_delay=0.2, tokens=200)
    proxy = await make_proxy([{"name": "ap-1", "url": region.url, "http2": http2}])
    await check_disconnect_cancels_upstream(proxy.url + CHAT, BODY, region, proxy)


async def test_client_disconnect_while_waiting_for_headers(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", fault="stall")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}])
    async with aiohttp.ClientSession() as client:
        task = asyncio.ensure_future(client.post(proxy.url + CHAT, json=BODY))
        await eventually(lambda: region.in_flight == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await eventually(lambda: region.in_flight == 0 and region.cancelled_total == 1)
    await eventually(lambda: proxy.pipeline.in_flight == 0)


async def test_unreachable_region_at_startup(
    make_region: RegionFactory, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    port = closed_port()
    proxy = await make_proxy([{"name": "late", "url": f"http://127.0.0.1:{port}"}])
    assert any(
        "late" in r.getMessage() and "not reachable" in r.getMessage() for r in caplog.records
    )
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/readyz") as resp:
            assert resp.status == 503
            body = await resp.json()
        assert any("late" in reason for reason in body["reasons"])
        async with client.get(proxy.admin_url + "/healthz") as resp:
            assert resp.status == 200
        async with client.get(proxy.admin_url + "/status") as resp:
            status = await resp.json()
        assert status["regions"][0]["state"] == "down"


async def test_region_that_comes_up_later_becomes_ready(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("late")
    await region.kill()
    proxy = await make_proxy([{"name": "late", "url": region.url}])
    assert not proxy.ready
    await region.restart()
    await eventually(lambda: proxy.ready, timeout=15)


async def test_status_and_readyz(make_region: RegionFactory, make_proxy: ProxyFactory) -> None:
    r1 = await make_region("ap-1")
    r2 = await make_region("us-1")
    proxy = await make_proxy(
        [
            {"name": "ap-1", "url": r1.url, "lat": 1.29, "lon": 103.85},
            {"name": "us-1", "url": r2.url, "lat": 45.5, "lon": -122.7, "http2": False},
        ]
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            # Before any history, the nearest region serves.
            assert resp.headers["X-Edgeproxy-Region"] == "ap-1"
        async with client.get(proxy.admin_url + "/readyz") as resp:
            assert resp.status == 200
        async with client.get(proxy.admin_url + "/status") as resp:
            status = await resp.json()
    assert status["pop"] == "edge-test"
    names = {r["name"]: r for r in status["regions"]}
    assert names["ap-1"]["pool"]["http_version"] == "2"
    assert names["us-1"]["pool"]["http_version"] == "1.1"
    assert names["ap-1"]["state"] == "up"
    assert names["ap-1"]["pool"]["connections_open"] >= 1


async def raw_exchange(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    await writer.wait_closed()
    return data


@pytest.mark.parametrize(
    "payload",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
        b"GET /\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    ],
    ids=["no-version", "header-no-colon", "nul-in-target", "bad-version", "bad-length"],
)
async def test_malformed_request_gets_400_and_proxy_keeps_serving(
    make_region: RegionFactory, make_proxy: ProxyFactory, payload: bytes
) -> None:
    region = await make_region("ap-1")
    proxy = await make_proxy([{"name": "ap-1", "url": region.url}])
    port = int(proxy.url.rsplit(":", 1)[1])
    before = region.requests_total
    answer = await raw_exchange(port, payload)
    # A well-formed version other than 1.0/1.1 is 505, always with an HTTP/1.1 status line.
    assert answer.startswith(b"HTTP/1.1 505" if b"HTTP/9.9" in payload else b"HTTP/1.1 400")
    assert region.requests_total == before
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.status == 200


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    folder = tmp_path_factory.mktemp("tls")
    certfile, keyfile = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
        + ["-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
        + ["-keyout", str(keyfile), "-out", str(certfile)],
        check=True,
        capture_output=True,
    )
    return str(certfile), str(keyfile)


async def test_tls_regions_with_alpn(
    make_proxy: ProxyFactory, tls_cert: tuple[str, str], http2: bool
) -> None:
    from edgeproxy.testing import FakeRegion

    certfile, keyfile = tls_cert
    async with FakeRegion(name="tls-1", certfile=certfile, keyfile=keyfile) as region:
        assert region.url.startswith("https://")
        proxy = await make_proxy(
            [{"name": "tls-1", "url": region.url, "http2": http2}],
            upstream={"ca_file": certfile},
        )
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json={**BODY, "stream": True}) as resp:
                assert resp.status == 200
                raw = await resp.read()
        assert raw.rstrip().endswith(b"data: [DONE]")
        expected = "2" if http2 else "1.1"
        assert region.counters().requests_by_http_version.get(expected, 0) >= 1


async def test_tls_region_with_untrusted_certificate_is_502(
    make_proxy: ProxyFactory, tls_cert: tuple[str, str]
) -> None:
    from edgeproxy.testing import FakeRegion

    certfile, keyfile = tls_cert
    async with FakeRegion(name="tls-1", certfile=certfile, keyfile=keyfile) as region:
        proxy = await make_proxy([{"name": "tls-1", "url": region.url}])
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json=BODY) as resp:
                assert resp.status == 502
                assert "tls-1" in (await resp.json())["error"]["message"]


async def test_two_proxies_share_a_port_with_reuse_port(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proxies = [
        await make_proxy([region], server={"port": port, "reuse_port": True}) for _ in range(2)
    ]
    assert proxies[0].url == proxies[1].url == f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as client:
        for _ in range(4):
            # A new connection each time: the kernel picks a listener.
            async with client.get(
                f"http://127.0.0.1:{port}/v1/models", headers={"Connection": "close"}
            ) as resp:
                assert resp.status == 200
