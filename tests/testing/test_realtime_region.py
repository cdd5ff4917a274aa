"""The fake region's OpenAI Realtime API, driven directly by a raw WebSocket client (aiohttp)
and by the official SDK: sessions, text and audio responses, function calls, usage, client
errors, cancellation, and the Realtime faults. Every event the region sends is checked
against the SDK's own models."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
import websockets
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from edgeproxy.testing import Behavior, Counters, FakeRegion, answer_text
from edgeproxy.testing._realtime import AUDIO_BYTES_PER_TOKEN, audio_delta

_EVENTS: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)

TEXT_RESPONSE = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 8,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
    "rate_limits.updated",
]


def checked(event: dict[str, Any]) -> dict[str, Any]:
    """``event``, once the SDK's models accept it as the event its type names."""
    model = _EVENTS.validate_python(event)
    assert model.type == event["type"]
    return event


def user_text(text: str) -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        },
    }


class Socket:
    """A raw client's side of a session."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(event))

    async def recv(self) -> dict[str, Any]:
        message = await self.ws.receive()
        assert message.type is aiohttp.WSMsgType.TEXT, message
        return checked(json.loads(message.data))

    async def until(self, last: str) -> list[dict[str, Any]]:
        """The events up to and including the first of type ``last``."""
        events = [await self.recv()]
        while events[-1]["type"] != last:
            events.append(await self.recv())
        return events

    async def closed(self) -> int | None:
        """Read until the session ends (no event may come first); its close code."""
        message = await self.ws.receive()
        assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), message
        return self.ws.close_code


Connect = Callable[..., Awaitable[Socket]]


@pytest.fixture
async def region() -> AsyncIterator[FakeRegion]:
    async with FakeRegion(name="r1") as region:
        yield region


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def connect(region: FakeRegion, http: aiohttp.ClientSession) -> AsyncIterator[Connect]:
    opened: list[aiohttp.ClientWebSocketResponse] = []

    async def factory(path: str = "/v1/realtime?model=gpt-realtime", **kwargs: Any) -> Socket:
        ws = await http.ws_connect(region.url + path, **kwargs)
        opened.append(ws)
        return Socket(ws)

    yield factory
    for ws in opened:
        await ws.close()


@pytest.fixture
async def client(region: FakeRegion) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=region.url + "/v1", api_key="x", max_retries=0
    ) as client:
        yield client


async def sdk_until(conn: Any, last: str) -> list[dict[str, Any]]:
    """Like :meth:`Socket.until`, through the SDK's connection."""
    events = [checked(json.loads(await conn.recv_bytes()))]
    while events[-1]["type"] != last:
        events.append(checked(json.loads(await conn.recv_bytes())))
    return events


def of_type(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


# -- sessions -----------------------------------------------------------------------


async def test_session_created_names_the_query_model_and_the_handshake_is_counted(
    region: FakeRegion, connect: Connect
) -> None:
    sock = await connect(headers={"Authorization": "Bearer k", "OpenAI-Beta": "realtime=v1"})
    created = await sock.recv()
    assert created["type"] == "session.created"
    session = created["session"]
    assert session["id"].startswith("sess_") and session["model"] == "gpt-realtime"
    assert session["type"] == "realtime" and session["output_modalities"] == ["text"]
    counters = region.counters()
    assert counters.realtime_sessions_total == counters.realtime_sessions_open == 1
    assert counters.realtime_last_path == "/v1/realtime"
    assert counters.realtime_last_query == "model=gpt-realtime"
    assert counters.realtime_last_headers["authorization"] == "Bearer k"
    assert counters.realtime_last_headers["openai-beta"] == "realtime=v1"
    assert counters.requests_by_path == {"/v1/realtime": 1} and counters.in_flight == 1
    assert counters.realtime_messages_sent_total == 1
    await sock.ws.close()
    await region.wait_until(lambda c: c.realtime_sessions_open == 0 and c.in_flight == 0)


async def test_the_model_comes_from_the_first_session_update_else_the_default(
    connect: Connect,
) -> None:
    sock = await connect("/openai/realtime")
    assert (await sock.recv())["session"]["model"] == "fake-realtime"
    update = {"type": "session.update", "session": {"type": "realtime", "model": "m1"}}
    await sock.send(update)
    updated = await sock.recv()
    assert updated["type"] == "session.updated" and updated["session"]["model"] == "m1"
    await sock.send({"type": "session.update", "session": {"model": "m2", "instructions": "x"}})
    updated = await sock.recv()
    assert updated["session"]["model"] == "m1" and updated["session"]["instructions"] == "x"


async def test_session_update_merges_what_it_names(connect: Connect) -> None:
    sock = await connect()
    await sock.recv()
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    session = {
        "type": "realtime",
        "instructions": "Be brief",
        "tools": [tool],
        "output_modalities": ["audio"],
        "audio": {"output": {"voice": "marin"}},
    }
    await sock.send({"type": "session.update", "session": session})
    merged = (await sock.recv())["session"]
    assert merged["instructions"] == "Be brief" and merged["tools"] == [tool]
    assert merged["output_modalities"] == ["audio"] and merged["tool_choice"] == "auto"
    assert merged["audio"]["output"]["voice"] == "marin"
    assert merged["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    await sock.send({"type": "session.update", "session": {"tool_choice": "none"}})
    merged = (await sock.recv())["session"]
    assert merged["instructions"] == "Be brief" and merged["tool_choice"] == "none"


# -- responses ----------------------------------------------------------------------


async def test_text_response_events_and_usage(region: FakeRegion, connect: Connect) -> None:
    sock = await connect()
    await sock.recv()
    await sock.send({"type": "session.update", "session": {"instructions": "Be brief"}})
    await sock.recv()
    await sock.send(user_text("Hello there") | {"event_id": "c1"})
    added, done = await sock.recv(), await sock.recv()
    assert (added["type"], done["type"]) == ("conversation.item.added", "conversation.item.done")
    user_item = done["item"]
    assert user_item["id"].startswith("item_") and user_item["status"] == "completed"
    assert user_item["content"] == [{"type": "input_text", "text": "Hello there"}]
    await sock.send({"type": "response.create"})
    events = await sock.until("rate_limits.updated")
    assert [e["type"] for e in events] == TEXT_RESPONSE

    created, done_event = events[0]["response"], events[-2]["response"]
    assert created["id"].startswith("resp_") and created["status"] == "in_progress"
    assert done_event["id"] == created["id"] and done_event["status"] == "completed"
    deltas = of_type(events, "response.output_text.delta")
    text = "".join(d["delta"] for d in deltas)
    assert text == answer_text("Hello there", 8)
    assert of_type(events, "response.output_text.done")[0]["text"] == text
    item = events[1]["item"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert {d["item_id"] for d in deltas} == {item["id"]}
    assert {d["response_id"] for d in deltas} == {created["id"]}
    assert events[2]["previous_item_id"] == user_item["id"]
    assert done_event["output"] == [
        item | {"status": "completed", "content": [{"type": "output_text", "text": text}]}
    ]
    usage = done_event["usage"]
    assert usage["input_tokens"] == 4 and usage["output_tokens"] == 8
    assert usage["total_tokens"] == 12
    assert usage["input_token_details"] | {"cached_tokens_details": None} == {
        "cached_tokens": 0,
        "text_tokens": 4,
        "audio_tokens": 0,
        "image_tokens": 0,
        "cached_tokens_details": None,
    }
    assert usage["output_token_details"] == {"text_tokens": 8, "audio_tokens": 0}
    limits = {limit["name"]: limit for limit in events[-1]["rate_limits"]}
    assert limits["tokens"]["remaining"] == limits["tokens"]["limit"] - 12

    # The next turn's context holds the last one, which the region has seen: cached.
    await sock.send(user_text("And then?"))
    await sock.until("conversation.item.done")
    await sock.send({"type": "response.create", "response": {"max_output_tokens": 3}})
    events = await sock.until("rate_limits.updated")
    text = "".join(d["delta"] for d in of_type(events, "response.output_text.delta"))
    assert text == answer_text("And then?", 3)
    usage = events[-2]["response"]["usage"]
    assert usage["input_tokens"] == 4 + 8 + 2 and usage["output_tokens"] == 3
    assert usage["input_token_details"]["cached_tokens"] == 12
    counters = region.counters()
    assert counters.realtime_responses_total == 2 and counters.realtime_errors_total == 0
    assert counters.realtime_messages_received_total == 5


async def test_audio_in_and_audio_out(region: FakeRegion, connect: Connect) -> None:
    sock = await connect()
    await sock.recv()
    audio = bytes(range(256)) * 40  # 10,240 bytes: 3 audio tokens of 100 ms
    for chunk in (audio[:5000], audio[5000:]):
        await sock.send(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
        )
    await sock.send({"type": "input_audio_buffer.commit"})
    committed, added, done = await sock.until("conversation.item.done")
    assert committed["type"] == "input_audio_buffer.committed"
    assert added["item"]["id"] == done["item"]["id"] == committed["item_id"]
    assert done["item"]["content"] == [{"type": "input_audio", "transcript": None}]
    await sock.send({"type": "response.create", "response": {"output_modalities": ["audio"]}})
    events = await sock.until("rate_limits.updated")
    answer = answer_text(base64.b64encode(audio).decode(), 8)
    transcript = of_type(events, "response.output_audio_transcript.delta")
    assert "".join(d["delta"] for d in transcript) == answer
    chunks = [base64.b64decode(d["delta"]) for d in of_type(events, "response.output_audio.delta")]
    assert len(chunks) == 8 and {len(c) for c in chunks} == {AUDIO_BYTES_PER_TOKEN}
    assert [base64.b64encode(c).decode() for c in chunks] == [
        audio_delta(d["delta"]) for d in transcript
    ]
    assert of_type(events, "response.output_audio_transcript.done")[0]["transcript"] == answer
    assert len(of_type(events, "response.output_audio.done")) == 1
    assert of_type(events, "response.content_part.added")[0]["part"]["type"] == "audio"
    response = events[-2]["response"]
    assert response["output"][0]["content"] == [{"type": "output_audio", "transcript": answer}]
    assert response["output_modalities"] == ["audio"]
    usage = response["usage"]
    assert usage["input_token_details"]["audio_tokens"] == 3
    assert usage["output_token_details"] == {"text_tokens": 8, "audio_tokens": 8}
    assert usage["output_tokens"] == 16 and usage["total_tokens"] == 19

    await sock.send({"type": "input_audio_buffer.append", "audio": "AAAA"})
    await sock.send({"type": "input_audio_buffer.clear"})
    assert (await sock.recv())["type"] == "input_audio_buffer.cleared"
    await sock.send({"type": "input_audio_buffer.commit"})
    error = (await sock.recv())["error"]
    assert error["code"] == "input_audio_buffer_commit_empty"


async def test_function_call_round_trip(connect: Connect) -> None:
    sock = await connect()
    await sock.recv()
    tools = [{"type": "function", "name": "get_weather"}, {"type": "function", "name": "other"}]
    await sock.send({"type": "session.update", "session": {"tools": tools}})
    await sock.recv()
    prompt = "Please call get_weather for Paris"
    await sock.send(user_text(prompt))
    await sock.until("conversation.item.done")
    await sock.send({"type": "response.create"})
    events = await sock.until("rate_limits.updated")
    assert [e["type"] for e in events] == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        *["response.function_call_arguments.delta"] * 8,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
        "rate_limits.updated",
    ]
    call = events[-2]["response"]["output"][0]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
    deltas = of_type(events, "response.function_call_arguments.delta")
    assert {d["call_id"] for d in deltas} == {call["call_id"]}
    arguments = "".join(d["delta"] for d in deltas)
    done = of_type(events, "response.function_call_arguments.done")[0]
    assert done["arguments"] == arguments == call["arguments"] and done["name"] == "get_weather"
    assert json.loads(arguments) == {"text": answer_text(prompt, 8)}

    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    await sock.send({"type": "conversation.item.create", "item": output})
    await sock.until("conversation.item.done")
    await sock.send({"type": "response.create"})
    events = await sock.until("rate_limits.updated")
    assert [e["type"] for e in events] == TEXT_RESPONSE
    text = "".join(d["delta"] for d in of_type(events, "response.output_text.delta"))
    assert text == answer_text("sunny", 8)


async def test_tool_choice_decides_the_call(connect: Connect) -> None:
    sock = await connect()
    await sock.recv()
    tools = [{"type": "function", "name": "first"}, {"type": "function", "name": "second"}]
    await sock.send({"type": "session.update", "session": {"tools": tools}})
    await sock.recv()
    await sock.send(user_text("no request for a tool here"))
    await sock.until("conversation.item.done")
    names = []
    for choice in ("auto", "required", {"type": "function", "name": "second"}, "none"):
        await sock.send({"type": "response.create", "response": {"tool_choice": choice}})
        output = (await sock.until("response.done"))[-1]["response"]["output"][0]
        names.append(output.get("name"))
        await sock.until("rate_limits.updated")
    assert names == [None, "first", "second", None]
    # A call of a single token still has whole JSON arguments.
    await sock.send(
        {"type": "response.create", "response": {"tool_choice": "required", "max_output_tokens": 1}}
    )
    output = (await sock.until("response.done"))[-1]["response"]["output"][0]
    assert json.loads(output["arguments"]) == {"text": answer_text("no request for a tool here", 1)}


async def test_out_of_band_response_leaves_the_conversation_alone(connect: Connect) -> None:
    sock = await connect()
    await sock.recv()
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    response = {"conversation": "none", "input": [item], "metadata": {"topic": "x"}}
    await sock.send({"type": "response.create", "response": response})
    events = await sock.until("rate_limits.updated")
    assert not [e for e in events if e["type"].startswith("conversation.")]
    done = events[-2]["response"]
    assert done["conversation_id"] is None and done["metadata"] == {"topic": "x"}
    assert done["output"][0]["content"][0]["text"] == answer_text("Hi", 8)
    await sock.send({"type": "conversation.item.retrieve", "item_id": done["output"][0]["id"]})
    assert (await sock.recv())["error"]["code"] == "item_not_found"


async def test_response_cancel(region: FakeRegion, connect: Connect) -> None:
    region.configure(inter_token_delay=60.0, tokens=5)
    sock = await connect()
    await sock.recv()
    await sock.send(user_text("Hello"))
    await sock.until("conversation.item.done")
    await sock.send({"type": "response.create"})
    first = (await sock.until("response.output_text.delta"))[-1]
    # One response at a time.
    await sock.send({"type": "response.create", "event_id": "again"})
    error = await sock.recv()
    assert error["error"]["code"] == "conversation_already_has_active_response"
    assert error["error"]["event_id"] == "again"
    await sock.send({"type": "response.cancel", "response_id": first["response_id"]})
    events = await sock.until("rate_limits.updated")
    assert not of_type(events, "response.output_text.delta")
    assert of_type(events, "response.output_text.done")[0]["text"] == first["delta"]
    response = events[-2]["response"]
    assert response["status"] == "cancelled"
    assert response["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert response["output"][0]["status"] == "incomplete"
    assert response["usage"]["output_tokens"] == 1
    await sock.send({"type": "response.cancel"})
    assert (await sock.recv())["error"]["code"] == "response_cancel_not_active"
    counters = region.counters()
    assert counters.realtime_responses_total == counters.realtime_responses_cancelled_total == 1


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("not json", "invalid_json"),
        ("[1, 2]", "invalid_type"),
        ('{"event_id": "e1"}', "missing_required_parameter"),
        ('{"type": "response.launch", "event_id": "e1"}', "unknown_event_type"),
        (
            '{"type": "session.update", "session": {"output_modalities": ["video"]}}',
            "invalid_value",
        ),
        ('{"type": "session.update", "session": "x"}', "invalid_type"),
        ('{"type": "conversation.item.create", "item": {"type": "nope"}}', "invalid_value"),
        ('{"type": "input_audio_buffer.append", "audio": "***"}', "invalid_value"),
        ('{"type": "conversation.item.delete", "item_id": "item_x"}', "item_not_found"),
        (b"\x00\x01", "invalid_value"),
    ],
)
async def test_a_bad_client_event_gets_an_error_and_the_session_goes_on(
    region: FakeRegion, connect: Connect, message: str | bytes, code: str
) -> None:
    sock = await connect()
    await sock.recv()
    if isinstance(message, bytes):
        await sock.ws.send_bytes(message)
    else:
        await sock.ws.send_str(message)
    error = await sock.recv()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["code"] == code
    assert error["error"]["event_id"] == ("e1" if '"e1"' in str(message) else None)
    await sock.send(user_text("still here"))
    await sock.until("conversation.item.done")
    assert region.counters().realtime_errors_total == 1


async def test_a_websocket_elsewhere_is_refused(region: FakeRegion, connect: Connect) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
        await connect("/v1/chat/completions")
    assert caught.value.status == 404
    assert region.counters().realtime_refused_total == 1


async def test_a_stopping_region_closes_its_sessions_going_away(
    region: FakeRegion, connect: Connect
) -> None:
    sock = await connect()
    await sock.recv()
    stopping = asyncio.ensure_future(region.stop())
    assert await sock.closed() == 1001
    await stopping


async def test_a_killed_region_drops_its_sessions(region: FakeRegion, connect: Connect) -> None:
    sock = await connect()
    await sock.recv()
    killing = asyncio.ensure_future(region.kill())
    assert await sock.closed() == aiohttp.WSCloseCode.ABNORMAL_CLOSURE
    await killing


# -- faults ------------------------------------------------------------------------


@pytest.mark.parametrize("status", [401, 429, 503])
async def test_refused_handshake_set_through_control(
    region: FakeRegion, http: aiohttp.ClientSession, connect: Connect, status: int
) -> None:
    async with http.post(region.url + "/_control", json={"realtime_refuse": status}) as answer:
        assert answer.status == 200
        assert (await answer.json())["behavior"]["realtime_refuse"] == status
    with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
        await connect()
    assert caught.value.status == status
    counters = region.counters()
    assert counters.realtime_refused_total == 1 and counters.realtime_sessions_total == 0
    assert counters.realtime_last_query == "model=gpt-realtime"


@pytest.mark.parametrize("after", [0, 2, 8])
async def test_close_fault_after_k_deltas(region: FakeRegion, connect: Connect, after: int) -> None:
    region.configure(realtime_fault="close", realtime_fault_after_deltas=after)
    sock = await connect()
    await sock.recv()
    await sock.send({"type": "response.create"})
    events = await sock.until("response.content_part.added")
    assert events[0]["type"] == "response.created"
    deltas = [(await sock.recv())["type"] for _ in range(after)]
    assert deltas == ["response.output_text.delta"] * after
    assert await sock.closed() == 1011
    assert region.counters().realtime_faults_total == 1


async def test_drop_fault_ends_the_connection_without_a_close_frame(
    region: FakeRegion, connect: Connect
) -> None:
    region.configure(realtime_fault="drop", realtime_fault_after_deltas=1)
    sock = await connect()
    await sock.recv()
    await sock.send({"type": "response.create"})
    await sock.until("response.output_text.delta")
    message = await sock.ws.receive()
    assert message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR), message
    assert sock.ws.close_code == aiohttp.WSCloseCode.ABNORMAL_CLOSURE
    await region.wait_until(lambda c: c.realtime_sessions_open == 0 and c.in_flight == 0)


async def test_stall_fault_goes_silent_and_keeps_reading(
    region: FakeRegion, connect: Connect
) -> None:
    region.configure(realtime_fault="stall", realtime_fault_after_deltas=2)
    sock = await connect()
    await sock.recv()
    await sock.send({"type": "response.create"})
    await sock.until("response.content_part.added")
    assert [(await sock.recv())["type"] for _ in range(2)] == ["response.output_text.delta"] * 2
    await region.wait_until(lambda c: c.realtime_faults_total == 1)
    sent = region.counters().realtime_messages_sent_total
    # The region reads on but answers nothing, not even the events that always get one.
    await sock.send(user_text("anyone there?"))
    await sock.ws.send_str("not json")
    counters = await region.wait_until(lambda c: c.realtime_messages_received_total == 3)
    assert counters.realtime_messages_sent_total == sent
    assert counters.realtime_sessions_open == 1 and not sock.ws.closed


async def test_accept_delay_holds_the_handshake(region: FakeRegion, connect: Connect) -> None:
    region.configure(realtime_accept_delay=0.05)
    sock = await connect()
    assert (await sock.recv())["type"] == "session.created"


# -- the official SDK ---------------------------------------------------------------


async def test_sdk_text_response(region: FakeRegion, client: openai.AsyncOpenAI) -> None:
    async with client.realtime.connect(model="gpt-realtime") as conn:
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief"})
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hi"}],
            }
        )
        await conn.response.create()
        seen = []
        text = ""
        async for event in conn:
            seen.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type == "response.done":
                usage = event.response.usage
                break
    assert seen[:4] == [
        "session.created",
        "session.updated",
        "conversation.item.added",
        "conversation.item.done",
    ]
    assert seen[4:] == TEXT_RESPONSE[:-1]
    assert text == answer_text("Hi", 8)
    assert usage is not None and usage.input_token_details is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (3, 8, 11)
    assert usage.input_token_details.cached_tokens == 0
    counters = region.counters()
    assert counters.realtime_last_path == "/v1/realtime"
    assert counters.realtime_last_query == "model=gpt-realtime"
    assert counters.realtime_last_headers["authorization"] == "Bearer x"


async def test_sdk_audio_response(client: openai.AsyncOpenAI) -> None:
    audio = base64.b64encode(b"\x01\x02" * 3000).decode()
    async with client.realtime.connect(model="gpt-realtime") as conn:
        await sdk_until(conn, "session.created")
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {"output": {"voice": "cedar"}},
            }
        )
        await conn.input_audio_buffer.append(audio=audio)
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        events = await sdk_until(conn, "rate_limits.updated")
    transcript = "".join(
        d["delta"] for d in of_type(events, "response.output_audio_transcript.delta")
    )
    assert transcript == answer_text(audio, 8)
    assert len(of_type(events, "response.output_audio.delta")) == 8
    response = of_type(events, "response.done")[0]["response"]
    assert response["audio"]["output"]["voice"] == "cedar"
    assert response["usage"]["input_token_details"]["audio_tokens"] == 2
    assert response["usage"]["output_token_details"] == {"text_tokens": 8, "audio_tokens": 8}


async def test_sdk_function_call_round_trip(client: openai.AsyncOpenAI) -> None:
    tool: Any = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    async with client.realtime.connect(model="gpt-realtime") as conn:
        await conn.session.update(session={"type": "realtime", "tools": [tool]})
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "call lookup"}],
            }
        )
        await conn.response.create()
        events = await sdk_until(conn, "response.done")
        call = events[-1]["response"]["output"][0]
        assert call["type"] == "function_call" and call["name"] == "lookup"
        assert json.loads(call["arguments"]) == {"text": answer_text("call lookup", 8)}
        await conn.conversation.item.create(
            item={"type": "function_call_output", "call_id": call["call_id"], "output": "42"}
        )
        await conn.response.create()
        events = await sdk_until(conn, "response.done")
    text = "".join(d["delta"] for d in of_type(events, "response.output_text.delta"))
    assert text == answer_text("42", 8)


async def test_sdk_refused_handshake(region: FakeRegion, client: openai.AsyncOpenAI) -> None:
    region.configure(realtime_refuse=429, fault_retry_after="7")
    with pytest.raises(websockets.InvalidStatus) as caught:
        async with client.realtime.connect(model="gpt-realtime"):
            pass
    response = caught.value.response
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7" and response.headers["x-fake-region"] == "r1"
    assert json.loads(response.body)["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize(("fault", "code"), [("close", 1011), ("drop", None)])
async def test_sdk_sees_the_session_break(
    region: FakeRegion, client: openai.AsyncOpenAI, fault: str, code: int | None
) -> None:
    region.configure(realtime_fault=fault, realtime_fault_after_deltas=3)
    async with client.realtime.connect(model="gpt-realtime") as conn:
        await conn.response.create()
        events = []
        with pytest.raises(websockets.ConnectionClosedError) as caught:
            while True:
                events.append((await conn.recv()).type)
    assert events.count("response.output_text.delta") == 3
    assert "response.done" not in events
    received = caught.value.rcvd
    assert (received.code if received is not None else None) == code


async def test_sdk_connect_timeout_on_a_delayed_handshake(
    region: FakeRegion, client: openai.AsyncOpenAI
) -> None:
    region.configure(realtime_accept_delay=60.0)
    options: Any = {"open_timeout": 0.2}
    with pytest.raises(TimeoutError):
        async with client.realtime.connect(model="m", websocket_connection_options=options):
            pass
    # The region let the handshake go as soon as the client left, with no session opened.
    counters = await region.wait_until(lambda c: c.in_flight == 0)
    assert counters.realtime_sessions_total == 0 and counters.requests_total == 1


# -- knobs ------------------------------------------------------------------------------


def test_realtime_behavior_fields_are_checked() -> None:
    behavior = Behavior()
    with pytest.raises(ValueError):
        behavior.realtime_refuse = 200
    with pytest.raises(ValueError):
        behavior.realtime_fault = "explode"  # type: ignore[assignment]
    with pytest.raises(ValueError):
        behavior.realtime_accept_delay = -1.0
    with pytest.raises(ValueError):
        behavior.realtime_fault_after_deltas = -1
    changed = behavior.copy(realtime_fault="stall", realtime_refuse=None)
    assert changed.to_dict()["realtime_fault"] == "stall"
    assert "realtime_sessions_total" in Counters().to_dict()
