"""The Realtime API through the proxy, driven by the official ``openai`` SDK's realtime
client (``client.realtime.connect``) on every front end, to the test kit's fake region:
text, audio deltas, a function call, usage counted; a region refusing or too slow at the
handshake (failed over), one dying mid-session (the client hears it), a browser-style
client over HTTP/2 extended CONNECT, and headless Chromium's own WebSocket over HTTP/2.

Regions that fail in ways the fake region cannot are in tests/test_realtime_sessions.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import trustme
import websockets
from wsproto.events import CloseConnection, TextMessage

from edgeproxy import EdgeProxy, RequestContext, Response, hookimpl
from edgeproxy.testing import FakeRegion, answer_text

from ._h2ws import Client
from .conftest import ProxyFactory, RegionFactory, eventually, write_pair

MODEL = "gpt-realtime"
USER_TEXT = "Tell me something deterministic"


class Ended:
    """Each WebSocket session's end, as ``edgeproxy_response_complete`` sees it."""

    def __init__(self) -> None:
        self.sessions: list[RequestContext] = []

    @hookimpl
    def edgeproxy_response_complete(self, request: Any, ctx: RequestContext) -> None:
        if request.websocket:
            self.sessions.append(ctx)


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)


def user_item(text: str) -> Any:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def until(conn: Any, last: str) -> list[Any]:
    events = []
    async for event in conn:
        events.append(event)
        if event.type == last:
            return events
    raise AssertionError(f"the session ended before {last}")


async def conversation(url: str) -> dict[str, Any]:
    """A session through ``url``: a text answer, an audio answer, a function call and its
    output's answer; what the client saw."""
    audio = base64.b64encode(b"\x01\x02" * 2400).decode()
    tool: Any = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    async with sdk(url) as client, client.realtime.connect(model=MODEL) as conn:
        created = await until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "tools": [tool]})
        await conn.conversation.item.create(item=user_item(USER_TEXT))
        await conn.response.create()
        text_events = await until(conn, "response.done")
        await conn.session.update(
            session={"type": "realtime", "output_modalities": ["audio"], "tools": []}
        )
        await conn.input_audio_buffer.append(audio=audio)
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        audio_events = await until(conn, "response.done")
        await conn.session.update(
            session={"type": "realtime", "output_modalities": ["text"], "tools": [tool]}
        )
        await conn.conversation.item.create(item=user_item("call lookup"))
        await conn.response.create()
        call = (await until(conn, "response.done"))[-1].response.output[0]
        await conn.conversation.item.create(
            item={"type": "function_call_output", "call_id": call.call_id, "output": "42"}
        )
        await conn.response.create()
        after_call = await until(conn, "response.done")
    return {
        "model": created[-1].session.model,
        "text": "".join(e.delta for e in text_events if e.type == "response.output_text.delta"),
        "audio_deltas": sum(e.type == "response.output_audio.delta" for e in audio_events),
        "transcript": "".join(
            e.delta for e in audio_events if e.type == "response.output_audio_transcript.delta"
        ),
        "call": call,
        "after_call": "".join(
            e.delta for e in after_call if e.type == "response.output_text.delta"
        ),
        "usages": [events[-1].response.usage for events in (text_events, audio_events, after_call)],
        "audio": audio,
    }


def check_conversation(seen: dict[str, Any]) -> None:
    assert seen["model"] == MODEL
    assert seen["text"] == answer_text(USER_TEXT, 8)
    assert seen["audio_deltas"] == 8
    assert seen["transcript"] == answer_text(seen["audio"], 8)
    assert seen["call"].type == "function_call" and seen["call"].name == "lookup"
    assert json.loads(seen["call"].arguments) == {"text": answer_text("call lookup", 8)}
    assert seen["after_call"] == answer_text("42", 8)


def check_metered(proxy: EdgeProxy, ended: Ended, seen: dict[str, Any]) -> None:
    """The session's usage, summed, reached the hook, /status and the token counters."""
    (ctx,) = ended.sessions
    assert ctx.status == 101 and ctx.outcome.region == "r1"
    usage = ctx.usage
    assert usage is not None
    # Four responses: the text, the audio, the call and the answer after it.
    assert ctx.outcome.session is not None and ctx.outcome.session.responses == 4
    first = seen["usages"][0]
    assert usage["total_tokens"] >= first.total_tokens + seen["usages"][1].total_tokens
    assert usage["output_audio_tokens"] == seen["usages"][1].output_token_details.audio_tokens
    assert usage["input_audio_tokens"] >= 1
    status = proxy.status()["websocket"]
    assert status["responses_total"] == 4 and status["opened_total"] == 1
    assert status["tokens"]["total_tokens"] == usage["total_tokens"]
    assert status["first_delta_histogram"][-1][1] == 4


@pytest.fixture
async def region(make_region: RegionFactory) -> FakeRegion:
    return await make_region("r1", tokens=8, inter_token_delay=0.0, model=MODEL)


# -- the official SDK through each front end ------------------------------------------


async def test_the_sdk_through_the_aiohttp_listener(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    ended = Ended()
    proxy = await make_proxy([region], plugins=[ended])
    seen = await conversation(proxy.url)
    check_conversation(seen)
    await eventually(lambda: len(ended.sessions) == 1)
    check_metered(proxy, ended, seen)
    # The region saw the SDK's handshake as the proxy passed it on.
    counters = region.counters()
    assert counters.realtime_last_query == f"model={MODEL}"
    assert counters.realtime_last_headers["via"].endswith("edge-test")


async def test_the_sdk_through_the_http2_listeners_port(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    ended = Ended()
    proxy = await make_proxy([region], plugins=[ended], server={"http2": True, "h2c": True})
    # The SDK speaks HTTP/1.1: the listener's HTTP/1.1 side takes its Upgrade.
    seen = await conversation(proxy.url)
    check_conversation(seen)
    await eventually(lambda: len(ended.sessions) == 1)
    check_metered(proxy, ended, seen)


@pytest.mark.parametrize("server", ["hypercorn", "uvicorn"])
async def test_the_sdk_through_the_asgi_mount(
    region: FakeRegion, make_proxy: ProxyFactory, server: str
) -> None:
    from .test_asgi import served as uvicorn_served
    from .test_asgi_websocket import hypercorn_served

    ended = Ended()
    proxy = await make_proxy([region], plugins=[ended])
    serve = hypercorn_served if server == "hypercorn" else uvicorn_served
    async with serve(proxy.asgi) as url:
        seen = await conversation(url.replace("ws://", "http://"))
    check_conversation(seen)
    await eventually(lambda: len(ended.sessions) == 1)
    check_metered(proxy, ended, seen)


# -- faults ---------------------------------------------------------------------------


async def test_a_region_refusing_or_too_slow_at_the_handshake_is_failed_over(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    near = await make_region("near", model=MODEL, realtime_refuse=503)
    slow = await make_region("slow", model=MODEL, realtime_accept_delay=30.0)
    far = await make_region("far", model=MODEL, tokens=4)
    places = [{"lat": 1.3, "lon": 103.8}, {"lat": 35.7, "lon": 139.7}, {"lat": 50.1, "lon": 8.7}]
    proxy = await make_proxy(
        [
            {"name": r.name, "url": r.url, **p}
            for r, p in zip((near, slow, far), places, strict=True)
        ],
        websocket={"connect_timeout": 0.5},
    )
    async with sdk(proxy.url) as client, client.realtime.connect(model=MODEL) as conn:
        created = await until(conn, "session.created")
        await conn.conversation.item.create(item=user_item("hello"))
        await conn.response.create()
        await until(conn, "response.done")
    assert created[-1].session.model == MODEL
    assert near.counters().realtime_refused_total == 1
    assert far.counters().realtime_sessions_total == 1
    assert proxy.status()["websocket"]["failovers_total"] == 2


async def test_refusals_before_the_upgrade_reach_the_sdk_as_json(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        [{"name": "r1", "url": region.url, "models": [MODEL]}],
        admission={"ip_requests_per_second": 1, "ip_burst": 1},
    )
    async with sdk(proxy.url) as client:
        with pytest.raises(websockets.InvalidStatus) as unknown:
            async with client.realtime.connect(model="no-such-model"):
                pass
        with pytest.raises(websockets.InvalidStatus) as limited:
            async with client.realtime.connect(model=MODEL):
                pass
    body = json.loads(unknown.value.response.body)
    assert unknown.value.response.status_code == 404
    assert body["error"]["code"] == "model_not_found"
    assert limited.value.response.status_code == 429
    assert "retry-after" in limited.value.response.headers
    assert region.counters().realtime_sessions_total == 0


@pytest.mark.parametrize("fault", ["close", "drop"])
async def test_a_region_dying_mid_session_gives_the_client_an_error_and_a_close_code(
    region: FakeRegion, make_proxy: ProxyFactory, fault: str
) -> None:
    ended = Ended()
    proxy = await make_proxy([region], plugins=[ended])
    region.configure(realtime_fault=fault, realtime_fault_after_deltas=3)
    events: list[Any] = []
    async with sdk(proxy.url) as client, client.realtime.connect(model=MODEL) as conn:
        await conn.response.create()
        with pytest.raises(websockets.ConnectionClosedError) as caught:
            while True:
                events.append(await conn.recv())
    kinds = [e.type for e in events]
    assert kinds.count("response.output_text.delta") == 3 and "response.done" not in kinds
    assert events[-1].type == "error" and events[-1].error.code == "region_failed"
    assert caught.value.rcvd is not None and caught.value.rcvd.code == 1011
    await eventually(lambda: len(ended.sessions) == 1)
    assert ended.sessions[0].outcome.session is not None
    assert ended.sessions[0].outcome.session.ended_by == "region"


async def test_a_drain_closes_an_sdk_session_after_its_response(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("r1", model=MODEL, tokens=6, inter_token_delay=0.2)
    proxy = await make_proxy([region])
    async with sdk(proxy.url) as client, client.realtime.connect(model=MODEL) as conn:
        await until(conn, "session.created")
        await conn.response.create()
        await until(conn, "response.output_text.delta")
        stopping = asyncio.create_task(proxy.stop(grace=30.0))
        rest: list[Any] = []
        with pytest.raises(websockets.ConnectionClosedOK) as caught:
            while True:
                rest.append(await conn.recv())
        await stopping
    kinds = [e.type for e in rest]
    assert "response.done" in kinds
    assert kinds[-1] == "error" and rest[-1].error.code == "session_closing"
    assert caught.value.rcvd is not None and caught.value.rcvd.code == 1001


# -- HTTP/2: a browser-style client, and Chromium itself ------------------------------


async def test_a_browser_style_client_over_http2_extended_connect(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    ended = Ended()
    proxy = await make_proxy([region], plugins=[ended], server={"http2": True, "h2c": True})
    port = int(proxy.url.rsplit(":", 1)[1])
    client = await Client.open(port)
    try:
        stream_id, stream = await client.websocket(
            f"/v1/realtime?model={MODEL}", (("sec-websocket-protocol", "realtime"),)
        )
        assert (await stream.head)[b"x-edgeproxy-region"] == b"r1"

        async def event() -> dict[str, Any]:
            message = await client.message(stream)
            assert isinstance(message, str)
            return dict(json.loads(message))

        assert (await event())["type"] == "session.created"
        create = {"type": "conversation.item.create", "item": user_item(USER_TEXT)}
        await client.send(stream_id, TextMessage(json.dumps(create)))
        await client.send(stream_id, TextMessage(json.dumps({"type": "response.create"})))
        text, kinds = "", []
        while not kinds or kinds[-1] != "response.done":
            got = await event()
            kinds.append(got["type"])
            if got["type"] == "response.output_text.delta":
                text += got["delta"]
        assert text == answer_text(USER_TEXT, 8)
        await client.send(stream_id, CloseConnection(1000))
        await eventually(lambda: len(ended.sessions) == 1)
    finally:
        await client.close()
    ctx = ended.sessions[0]
    assert ctx.http_version == "2" and ctx.usage is not None and ctx.usage["total_tokens"] > 0


PAGE = """<!doctype html><meta charset="utf-8"><title>voice</title>
<link rel="icon" href="data:,">
<script>
window.kinds = []; window.text = ""; window.wsClosed = null;
const ws = new WebSocket(location.origin.replace("https", "wss") + "/v1/realtime?model=MODEL");
ws.onopen = () => {
  ws.send(JSON.stringify({type: "conversation.item.create", item: {type: "message",
    role: "user", content: [{type: "input_text", text: "USER_TEXT"}]}}));
  ws.send(JSON.stringify({type: "response.create"}));
};
ws.onmessage = (e) => {
  const event = JSON.parse(e.data);
  window.kinds.push(event.type);
  if (event.type === "response.output_text.delta") window.text += event.delta;
  if (event.type === "response.done") ws.close(1000);
};
ws.onclose = (e) => { window.wsClosed = e.code; };
</script>""".replace("MODEL", MODEL).replace("USER_TEXT", USER_TEXT)


class Page:
    """The page (through the public API), and each session's HTTP version."""

    def __init__(self) -> None:
        self.versions: list[str] = []

    @hookimpl
    def edgeproxy_request_received(self, request: Any, ctx: RequestContext) -> Response | None:
        if ctx.path == "/page":
            return Response(body=PAGE.encode(), content_type="text/html; charset=utf-8")
        if request.websocket:
            self.versions.append(ctx.http_version)
        return None


async def test_chromiums_websocket_over_http2(
    region: FakeRegion, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    from ._browser import launch
    from .test_browser_h2 import spki_hash

    cert_path, key_path = write_pair(trustme.CA(), tmp_path)
    page = Page()
    proxy = await make_proxy(
        [region],
        plugins=[page],
        server={"http2": True, "tls_cert": cert_path, "tls_key": key_path},
    )
    async with launch(
        tmp_path, f"--ignore-certificate-errors-spki-list={spki_hash(cert_path)}"
    ) as browser:
        await browser.send("Page.navigate", url=proxy.url + "/page")
        assert await browser.wait_for('typeof window.wsClosed === "number"', timeout=60)
        assert await browser.evaluate("window.wsClosed") == 1000
        assert await browser.evaluate("window.text") == answer_text(USER_TEXT, 8)
        assert "response.done" in await browser.evaluate("window.kinds")
    # Chromium carried the WebSocket on the page's HTTP/2 connection (RFC 8441).
    assert page.versions == ["2"]


# -- the model from the first event, limits, compression, metrics ---------------------


async def test_a_session_without_a_model_is_routed_by_its_first_session_update(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    other = await make_region("other", model="other-model")
    serving = await make_region("serving", model=MODEL, tokens=3)
    proxy = await make_proxy(
        [
            {"name": "other", "url": other.url, "models": ["other-model"]},
            {"name": "serving", "url": serving.url, "models": [MODEL]},
        ]
    )
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(proxy.url + "/v1/realtime")
        update = {"type": "session.update", "session": {"type": "realtime", "model": MODEL}}
        await ws.send_str(json.dumps(update))
        kinds = [json.loads(await ws.receive_str())["type"] for _ in range(2)]
        assert kinds == ["session.created", "session.updated"]
        await ws.close()
        # A first event naming a model no region serves: the error, then 1013.
        ws = await http.ws_connect(proxy.url + "/v1/realtime")
        bad = {"type": "session.update", "session": {"type": "realtime", "model": "nope"}}
        await ws.send_str(json.dumps(bad))
        error = json.loads(await ws.receive_str())
        close = await ws.receive()
    assert serving.counters().realtime_sessions_total == 1
    assert other.counters().realtime_sessions_total == 0
    assert error["type"] == "error" and error["error"]["code"] == "model_not_found"
    assert close.type is aiohttp.WSMsgType.CLOSE and close.data == 1013


async def test_an_oversize_message_ends_the_session_with_1009(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy([region], websocket={"max_message_size": 4096})
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(proxy.url + f"/v1/realtime?model={MODEL}")
        await ws.receive_str()
        append = {"type": "input_audio_buffer.append", "audio": "A" * 8192}
        await ws.send_str(json.dumps(append))
        close = await ws.receive()
    assert close.type is aiohttp.WSMsgType.CLOSE and close.data == 1009
    await eventually(lambda: region.counters().realtime_sessions_open == 0)
    assert region.counters().realtime_messages_received_total == 0


async def test_compression_toward_a_client_that_offers_it(
    region: FakeRegion, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy([region])
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(proxy.url + f"/v1/realtime?model={MODEL}", compress=15)
        agreed = ws._response.headers.get("Sec-WebSocket-Extensions", "")
        assert json.loads(await ws.receive_str())["type"] == "session.created"
        await ws.close()
        plain = await http.ws_connect(proxy.url + f"/v1/realtime?model={MODEL}")
        offered_none = plain._response.headers.get("Sec-WebSocket-Extensions")
        await plain.close()
    assert agreed.startswith("permessage-deflate")
    assert offered_none is None
    # The region's link is not compressed by default (a deflate state per session).
    assert "sec-websocket-extensions" not in region.counters().realtime_last_headers


async def test_the_sessions_prometheus_series(region: FakeRegion, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy([region])
    async with sdk(proxy.url) as client, client.realtime.connect(model=MODEL) as conn:
        await conn.conversation.item.create(item=user_item("hello"))
        await conn.response.create()
        await until(conn, "response.done")
        async with aiohttp.ClientSession() as http:
            async with http.get(proxy.admin_url + "/metrics") as response:
                during = await response.text()
    await eventually(lambda: proxy.status()["websocket"]["open"] == 0)
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.admin_url + "/metrics") as response:
            after = await response.text()
    assert "edgeproxy_websocket_sessions_open 1.0" in during
    assert "edgeproxy_websocket_sessions_open 0.0" in after
    assert "edgeproxy_websocket_sessions_total 1.0" in after
    assert "edgeproxy_websocket_realtime_responses_total 1.0" in after
    assert 'edgeproxy_websocket_messages_total{direction="in"}' in after
    assert "edgeproxy_websocket_session_duration_seconds_count 1.0" in after
    assert "edgeproxy_websocket_realtime_first_delta_seconds_count 1.0" in after
    # The session's usage reached the token counters, as any request's does.
    tokens = re.search(
        r'edgeproxy_tokens_total\{[^}]*kind="completion"[^}]*region="r1"[^}]*\} ([0-9.]+)', after
    )
    assert tokens is not None and float(tokens.group(1)) > 0
