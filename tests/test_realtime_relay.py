"""The Realtime API's wire semantics and one session's relay, with in-memory sockets.

The sessions end to end, through every front end to a fake region, are in
tests/test_realtime.py; here each rule is held on its own: what an event means, how a
session ends and who hears what, a drain waiting for the response under way, a token
limit answered with an error event, and a peer that does not read pushing back.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest

from edgeproxy._core.config import WebSocketConfig
from edgeproxy._core.outcome import Outcome
from edgeproxy._core.websocket import Closed, WebSocket, is_websocket_upgrade
from edgeproxy._protocol.realtime import (
    client_event,
    error_event,
    query_model,
    region_event_type,
    region_usage,
)
from edgeproxy._realtime.meter import Meter
from edgeproxy._realtime.relay import Drain, Relay

USAGE = {
    "total_tokens": 30,
    "input_tokens": 12,
    "output_tokens": 18,
    "input_token_details": {"cached_tokens": 4, "text_tokens": 10, "audio_tokens": 2},
    "output_token_details": {"text_tokens": 8, "audio_tokens": 10},
}


class MemorySocket(WebSocket):
    """One side of a session in memory: what the relay sends goes to ``sent`` (a bounded
    queue: a full one is a peer that does not read), what it receives comes from
    ``incoming``."""

    def __init__(self, room: int = 1000) -> None:
        self.incoming: asyncio.Queue[str | bytes | Closed] = asyncio.Queue()
        self.sent: asyncio.Queue[str | bytes] = asyncio.Queue(room)
        self.closed: Closed | None = None

    async def receive(self) -> str | bytes | Closed:
        if self.closed is not None:
            return self.closed
        return await self.incoming.get()

    async def send(self, message: str | bytes) -> None:
        if self.closed is not None:
            raise ConnectionResetError("closed")
        await self.sent.put(message)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        if self.closed is None:
            self.closed = Closed(code, reason)

    def drained(self) -> list[Any]:
        out = []
        while not self.sent.empty():
            out.append(self.sent.get_nowait())
        return out


def event(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, **fields})


def settings(**values: Any) -> WebSocketConfig:
    return WebSocketConfig(**values)


def realtime_meter(observed: list[float] | None = None) -> Meter:
    seen = observed if observed is not None else []
    return Meter(rate=None, charges=[], first_delta=seen.append)


async def start(
    meter: Meter | None = None, **config: Any
) -> tuple[Relay, MemorySocket, MemorySocket, asyncio.Task[None], Outcome]:
    client, region, outcome = MemorySocket(), MemorySocket(), Outcome()
    relay = Relay(client, region, outcome, settings(**config), meter)
    task = asyncio.create_task(relay.run())
    return relay, client, region, task, outcome


# -- the wire semantics -----------------------------------------------------------------


def test_a_clients_event_reads_as_the_region_will_last_duplicate_key_wins() -> None:
    sneaky = '{"type":"input_audio_buffer.append","audio":"AAAA","type":"response.create"}'
    assert client_event(sneaky).type == "response.create"
    assert client_event('{"type":"session.update","session":{}}').type == "session.update"
    assert client_event("not json").type is None
    assert client_event("[1, 2]").type is None
    assert client_event('{"type": 3}').type is None


def test_a_regions_event_type_is_read_from_its_start_or_whole() -> None:
    big = '{"type":"response.output_audio.delta","delta":"' + "A" * 100_000 + '"}'
    assert region_event_type(big) == ("response.output_audio.delta", None)
    late = '{"delta":"xyz","type":"response.output_text.delta"}'
    assert region_event_type(late)[0] == "response.output_text.delta"
    kind, body = region_event_type(event("response.done", response={"usage": USAGE}))
    assert kind == "response.done" and body is not None
    assert region_event_type("garbage") == (None, None)


def test_usage_of_a_response_done_in_the_proxys_terms() -> None:
    usage = region_usage({"type": "response.done", "response": {"usage": USAGE}})
    assert usage == {
        "prompt_tokens": 12,
        "completion_tokens": 18,
        "total_tokens": 30,
        "input_text_tokens": 10,
        "input_audio_tokens": 2,
        "cached_tokens": 4,
        "output_text_tokens": 8,
        "output_audio_tokens": 10,
    }
    assert region_usage({"type": "response.done", "response": {}}) is None
    assert region_usage({"response": {"usage": {"input_tokens": -1, "output_tokens": "x"}}}) == {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
    }


def test_the_model_of_a_handshakes_query_and_the_error_event_shape() -> None:
    assert query_model("/v1/realtime?model=gpt-realtime") == "gpt-realtime"
    assert query_model("/v1/realtime?x=1&model=a%2Fb") == "a/b"
    assert query_model("/v1/realtime") is None
    assert query_model("/v1/realtime?model=") is None
    body = orjson.loads(error_event("gone", code="region_failed"))
    assert body["type"] == "error"
    assert body["error"]["code"] == "region_failed" and body["error"]["message"] == "gone"


@pytest.mark.parametrize(
    ("connection", "upgrade", "expected"),
    [
        ("Upgrade", "websocket", True),
        ("keep-alive, upgrade", "WebSocket", True),
        ("keep-alive", "websocket", False),
        ("Upgrade", "h2c", False),
        (None, "websocket", False),
    ],
)
def test_what_asks_for_a_websocket(connection: str | None, upgrade: str, expected: bool) -> None:
    assert is_websocket_upgrade(connection, upgrade) is expected


# -- the relay ----------------------------------------------------------------------------


async def test_messages_pass_both_ways_and_the_clients_close_closes_the_region() -> None:
    relay, client, region, task, outcome = await start()
    client.incoming.put_nowait("hello")
    client.incoming.put_nowait(b"\x00\x01")
    region.incoming.put_nowait("world")
    assert await region.sent.get() == "hello"
    assert await region.sent.get() == b"\x00\x01"
    assert await client.sent.get() == "world"
    client.incoming.put_nowait(Closed(1000, "bye"))
    await task
    assert region.closed == Closed(1000, "")
    assert outcome.session is not None
    assert (outcome.session.messages_in, outcome.session.messages_out) == (2, 1)
    assert outcome.session.bytes_in == 7 and outcome.bytes_out == 5
    assert outcome.session.ended_by == "client" and outcome.error is None


async def test_a_region_that_dies_gives_the_client_an_error_event_and_1011() -> None:
    relay, client, region, task, outcome = await start(realtime_meter())
    region.incoming.put_nowait(Closed(1006, "connection lost"))
    await task
    (sent,) = client.drained()
    assert orjson.loads(sent)["error"]["code"] == "region_failed"
    assert client.closed is not None and client.closed.code == 1011
    assert outcome.session is not None and outcome.session.ended_by == "region"


async def test_a_regions_own_close_code_goes_to_the_client_as_it_is() -> None:
    relay, client, region, task, outcome = await start(realtime_meter())
    region.incoming.put_nowait(Closed(4000, "session expired"))
    await task
    assert client.drained() == []
    assert client.closed == Closed(4000, "session expired")


async def test_a_plain_websocket_ends_without_an_event_of_the_realtime_api() -> None:
    relay, client, region, task, outcome = await start(None)
    region.incoming.put_nowait(Closed(1006, "connection lost"))
    await task
    assert client.drained() == []
    assert client.closed is not None and client.closed.code == 1011


async def test_a_drain_waits_for_the_response_under_way_then_closes_with_its_code() -> None:
    observed: list[float] = []
    meter = realtime_meter(observed)
    relay, client, region, task, outcome = await start(meter)
    client.incoming.put_nowait(event("response.create"))
    assert orjson.loads(await region.sent.get())["type"] == "response.create"
    region.incoming.put_nowait(event("response.created", response={"id": "r"}))
    await client.sent.get()
    relay.drain(Drain(1012, "service restart", "reloading"))
    region.incoming.put_nowait(event("response.output_text.delta", delta="hi"))
    await client.sent.get()
    assert not task.done()  # the response is under way
    region.incoming.put_nowait(event("response.done", response={"usage": USAGE}))
    await task
    done, closing = client.drained()
    assert orjson.loads(done)["type"] == "response.done"
    assert orjson.loads(closing)["error"]["code"] == "session_closing"
    assert client.closed == Closed(1012, "service restart")
    assert meter.usage is not None and meter.usage["total_tokens"] == 30
    assert meter.responses == 1 and len(observed) == 1


async def test_a_drain_of_an_idle_session_closes_it_at_once() -> None:
    relay, client, region, task, outcome = await start(realtime_meter())
    relay.drain(Drain(1001, "going away", "shutting down"))
    await task
    assert client.closed == Closed(1001, "going away")
    assert outcome.session is not None and outcome.session.ended_by == "drain"


async def test_an_idle_session_ends_with_1001() -> None:
    relay, client, region, task, outcome = await start(
        realtime_meter(), idle_timeout=0.05, ping_interval=10.0
    )
    await task
    (sent,) = client.drained()
    assert orjson.loads(sent)["error"]["code"] == "session_idle"
    assert client.closed is not None and client.closed.code == 1001
    assert outcome.session is not None and outcome.session.ended_by == "idle"


async def test_a_cut_session_tells_the_client_why() -> None:
    relay, client, region, task, outcome = await start(realtime_meter())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (sent,) = client.drained()
    assert orjson.loads(sent)["error"]["code"] == "session_closing"
    assert client.closed is not None and client.closed.code == 1001


async def test_a_client_that_does_not_read_stops_the_region_being_read() -> None:
    client, region, outcome = MemorySocket(room=4), MemorySocket(), Outcome()
    relay = Relay(client, region, outcome, settings(), None)
    task = asyncio.create_task(relay.run())
    for i in range(100):
        region.incoming.put_nowait(f"delta {i}")
    while region.incoming.qsize() > 100 - 5:
        await asyncio.sleep(0)
    for _ in range(20):
        await asyncio.sleep(0)
    # Four taken by the client's socket, one in the relay's hands: the rest stay unread.
    assert client.sent.qsize() == 4
    assert region.incoming.qsize() == 95
    client.incoming.put_nowait(Closed(1000))
    await task


async def test_a_token_limit_answers_response_create_with_an_error_event() -> None:
    from edgeproxy._admission.ratelimit import RateLimiter
    from edgeproxy._core.config import AdmissionConfig

    limiter = RateLimiter(AdmissionConfig(key_tokens_per_minute=20))
    charges = [c for c in limiter.charges("tenant", "ip", 1) if c.limit.unit == "tokens"]
    assert charges
    meter = Meter(rate=limiter, charges=charges, first_delta=lambda _: None)
    relay, client, region, task, outcome = await start(meter)
    client.incoming.put_nowait(event("response.create"))
    await region.sent.get()
    region.incoming.put_nowait(event("response.done", response={"usage": USAGE}))
    await client.sent.get()
    client.incoming.put_nowait(event("response.create"))  # 30 tokens used of 20
    refusal = orjson.loads(await client.sent.get())
    assert refusal["type"] == "error" and refusal["error"]["code"] == "rate_limit_exceeded"
    assert region.sent.empty()
    client.incoming.put_nowait(Closed(1000))
    await task
    assert outcome.session is not None and outcome.session.refused == 1


async def test_a_response_create_spelt_with_json_escapes_is_still_checked() -> None:
    from edgeproxy._admission.ratelimit import RateLimiter
    from edgeproxy._core.config import AdmissionConfig

    limiter = RateLimiter(AdmissionConfig(key_tokens_per_minute=1))
    charges = [c for c in limiter.charges("tenant", "ip", 1) if c.limit.unit == "tokens"]
    meter = Meter(rate=limiter, charges=charges, first_delta=lambda _: None)
    spelt = '{"type":"response\\u002ecreate"}'
    assert orjson.loads(spelt)["type"] == "response.create"
    first = meter.from_client(spelt)
    assert first is not None and await first is None  # within the limit: relayed
    second = meter.from_client(spelt)
    assert second is not None
    refusal = await second
    assert refusal is not None and "rate_limit_exceeded" in refusal
    assert meter.from_client('{"type":"input_audio_buffer.append","audio":"AAAA"}') is None


def test_a_clients_type_is_read_quickly_only_where_nothing_could_override_it() -> None:
    from edgeproxy._protocol.realtime import client_event_type

    audio = '{"type":"input_audio_buffer.append","audio":"' + "QUJD" * 2000 + '"}'
    assert client_event_type(audio) == "input_audio_buffer.append"
    # A later key, or an escape that could spell one, is read as the region reads it.
    twice = '{"type":"input_audio_buffer.append","audio":"AAAA","type":"response.create"}'
    escaped = '{"type":"input_audio_buffer.append","audio":"AAAA","t\\u0079pe":"response.create"}'
    assert client_event_type(twice) == "response.create"
    assert client_event_type(escaped) == "response.create"
    assert client_event_type('{"type":"response\\u002ecreate"}') == "response.create"
    assert client_event_type('{"event_id":"e","type":"session.update"}') == "session.update"


def test_a_key_carried_in_a_subprotocol_stays_at_the_edge() -> None:
    from edgeproxy._protocol.realtime import offered_protocols

    offered = ["realtime, openai-insecure-api-key.sk-secret", "openai-beta.realtime-v1"]
    assert offered_protocols(offered, credentials=False) == ["realtime", "openai-beta.realtime-v1"]
    assert "openai-insecure-api-key.sk-secret" in offered_protocols(offered, credentials=True)
