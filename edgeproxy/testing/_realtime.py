"""The fake region's OpenAI Realtime API: a WebSocket of JSON events at any path ending
``/realtime`` (``/v1/realtime?model=gpt-realtime``), in the GA shapes the ``openai`` SDK models.

A session opens with ``session.created``; its model is the handshake's ``model`` query
parameter, else the first ``session.update`` naming one, else ``fake-realtime``. It answers
``session.update`` (merged in), ``conversation.item.create`` / ``.delete`` / ``.retrieve``,
``input_audio_buffer.append`` / ``.commit`` (a user audio item) / ``.clear``,
``response.create`` and ``response.cancel`` (the response ends before its next delta,
``cancelled``), each with the events OpenAI sends; anything else, malformed or binary, gets an
``error`` (``invalid_request_error``) and the session stays open. A response sends
``response.created``, ``response.output_item.added``, ``conversation.item.added``, then for a
message ``response.content_part.added``, a delta per token (``response.output_text.delta``, or
``response.output_audio.delta`` with ``response.output_audio_transcript.delta``) and their
``.done``, ``response.content_part.done``; for a function call a
``response.function_call_arguments.delta`` per token and its ``.done``; then
``response.output_item.done``, ``conversation.item.done``, ``response.done`` (with its usage),
``rate_limits.updated``. With ``"conversation": "none"``, no ``conversation.item.*``.

The answer is deterministic: the tokens of :func:`~edgeproxy.testing.answer_text` of the
prompt, ``max_output_tokens`` of them (the response's, the session's, else
``Behavior.tokens``). The prompt is the text of the context's last user message (the base64
of its audio if it has no text), or the ``output`` of a later ``function_call_output``. The
output is a ``function_call`` (arguments ``{"text":"<the answer>"}``) when a function tool is
offered and ``tool_choice`` names it, or is ``auto``/``required`` and the user's prompt says
``call <tool name>``, or is ``required`` (the first tool). Audio is
:data:`AUDIO_BYTES_PER_TOKEN` bytes a token.

Usage counts words as tokens: the instructions and the context's texts, names, arguments and
outputs are input text; an audio item is an input audio token per 100 ms of 24 kHz PCM16;
each delta is an output text token, with audio an audio token too. ``cached_tokens`` is what
the session's previous response had seen. A region that stops closes its sessions with 1001
(going away); a killed one drops them. Not modelled: voice activity detection,
transcription, truncation, MCP, WebRTC, SIP.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol
from urllib.parse import parse_qs

import orjson

from edgeproxy.testing._behavior import Behavior
from edgeproxy.testing._content import count_words, digest, error_body, tokens
from edgeproxy.testing._counters import RealtimeStats
from edgeproxy.testing._exchange import Message, Receive, Scope, Send
from edgeproxy.testing._hypercorn import StreamHandle

__all__ = ["AUDIO_BYTES_PER_TOKEN", "DEFAULT_MODEL", "REALTIME_SUFFIX", "audio_delta", "serve"]

log = logging.getLogger(__name__)

REALTIME_SUFFIX: Final = "/realtime"
DEFAULT_MODEL: Final = "fake-realtime"
AUDIO_BYTES_PER_TOKEN: Final = 4800
"""100 ms of 24 kHz 16-bit mono PCM, the API's default format."""

_PCM: Final = {"type": "audio/pcm", "rate": 24000}
_CALL: Final = re.compile(r"\bcall\s+([A-Za-z0-9_.\-]+)")
_REQUESTS_LIMIT: Final = 1000
_TOKENS_LIMIT: Final = 100_000
_MAX_OUTPUT_TOKENS: Final = 4096
_EVENTS: Final = frozenset(
    "session.update conversation.item.create conversation.item.delete "
    "conversation.item.retrieve input_audio_buffer.append input_audio_buffer.commit "
    "input_audio_buffer.clear response.create response.cancel".split()
)
_ROLE_PARTS: Final = {
    "user": ("input_text", "input_audio", "input_image"),
    "system": ("input_text",),
    "assistant": ("output_text", "output_audio"),
}
# The streams of a response's deltas, and what each one's ``.done`` event carries whole.
_ARGUMENTS, _TEXT = "response.function_call_arguments", "response.output_text"
_AUDIO, _TRANSCRIPT = "response.output_audio", "response.output_audio_transcript"
_DONE_FIELD: Final = {_ARGUMENTS: "arguments", _TEXT: "text", _TRANSCRIPT: "transcript"}


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(10)


def audio_delta(token: str) -> str:
    """The base64 audio a response sends for ``token``: :data:`AUDIO_BYTES_PER_TOKEN` bytes."""
    block = hashlib.sha256(token.encode()).digest()
    return base64.b64encode(block * (AUDIO_BYTES_PER_TOKEN // len(block))).decode()


class RealtimeRegion(Protocol):
    """What a session uses of its region (:class:`~edgeproxy.testing._app.RegionApp`)."""

    behavior: Behavior
    realtime: RealtimeStats

    @property
    def region_header(self) -> tuple[bytes, bytes]: ...

    async def wait_stopping(self) -> None: ...


class _Invalid(Exception):
    """A client event the session answers with an ``error`` event."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


# -- the handshake ----------------------------------------------------------------


async def serve(
    region: RealtimeRegion, scope: Scope, receive: Receive, send: Send, handle: StreamHandle | None
) -> None:
    """Answer one WebSocket handshake and, when it is accepted, run its session."""
    if (await receive())["type"] != "websocket.connect":
        return
    stats = region.realtime
    path: str = scope["path"]
    if not path.endswith(REALTIME_SUFFIX):
        stats.add("refused_total")
        await _refuse(region, scope, send, 404, f"no WebSocket endpoint at {path}")
        return
    query = bytes(scope.get("query_string", b"")).decode("latin-1")
    headers: dict[str, str] = {}
    for raw_name, raw_value in scope.get("headers", ()):
        name, value = bytes(raw_name).decode("latin-1").lower(), bytes(raw_value).decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    stats.handshake(path, query, headers)
    behavior = region.behavior  # the handshake's snapshot; each response takes its own
    if behavior.realtime_accept_delay > 0:
        outcome = await _delay(region, receive, behavior.realtime_accept_delay)
        if outcome == "gone":
            return
        if outcome == "stopping":
            await _refuse(region, scope, send, 503, "the region is shutting down")
            return
    status = behavior.realtime_refuse
    if status is not None:
        stats.add("refused_total")
        message = f"fake region: injected {status} on the Realtime handshake"
        await _refuse(region, scope, send, status, message, behavior.fault_retry_after)
        return
    accept: Message = {"type": "websocket.accept", "headers": [region.region_header]}
    # A browser's client authenticates through subprotocols and needs one chosen back.
    if "realtime" in (scope.get("subprotocols") or ()):
        accept["subprotocol"] = "realtime"
    models = parse_qs(query).get("model")
    stats.opened(+1)
    try:
        await send(accept)
        await _Session(region, receive, send, handle, models[-1] if models else None).run()
    finally:
        stats.opened(-1)


async def _delay(region: RealtimeRegion, receive: Receive, seconds: float) -> str | None:
    """Hold a handshake for ``seconds``: None once they are up, ``"gone"`` if the client
    left first, ``"stopping"`` if the region began to stop."""
    gone = asyncio.ensure_future(receive())  # before the accept, only a disconnect comes
    stopping = asyncio.ensure_future(region.wait_stopping())
    try:
        await asyncio.wait({gone, stopping}, timeout=seconds, return_when="FIRST_COMPLETED")
        # Read before cancelling: a receive that completed holds the disconnect.
        return "gone" if gone.done() else "stopping" if stopping.done() else None
    finally:
        for task in (gone, stopping):
            task.cancel()
        await asyncio.gather(gone, stopping, return_exceptions=True)


async def _refuse(
    region: RealtimeRegion,
    scope: Scope,
    send: Send,
    status: int,
    message: str,
    retry_after: str | None = None,
) -> None:
    if "websocket.http.response" not in (scope.get("extensions") or {}):
        # Without the extension a server can only close before the accept (hypercorn: 403).
        await send({"type": "websocket.close", "code": 1008})
        return
    type_, code = {
        401: ("invalid_request_error", "invalid_api_key"),
        404: ("invalid_request_error", "not_found"),
        429: ("rate_limit_error", "rate_limit_exceeded"),
    }.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    body = error_body(message, type_=type_, code=code)
    length = str(len(body)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", length)]
    headers.append(region.region_header)
    if retry_after is not None:
        headers.append((b"retry-after", retry_after.encode()))
    await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


# -- checks of client events -----------------------------------------------------------


def _object(value: object, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid(f"'{param}' must be an object", "invalid_type", param)
    return value


def _text(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"'{param}' must be a string", "invalid_type", param)
    return value


def _modalities(value: object, param: str) -> list[str]:
    if not isinstance(value, list) or not value or any(m not in ("text", "audio") for m in value):
        raise _Invalid(f"'{param}' must be ['text'] or ['audio']", "invalid_value", param)
    return list(value)


def _tools(value: object, param: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise _Invalid(f"'{param}' must be an array", "invalid_type", param)
    for tool in value:
        kind = _object(tool, param + "[]").get("type", "function")
        if kind not in ("function", "mcp"):
            raise _Invalid(f"unknown tool type {kind!r}", "invalid_value", param)
        if kind == "function" and not isinstance(tool.get("name"), str):
            raise _Invalid("a function tool needs a 'name'", "missing_required_parameter", param)
    return list(value)


def _tool_choice(value: object, param: str) -> str | dict[str, Any]:
    if value in ("auto", "none", "required"):
        return str(value)
    if isinstance(value, dict) and value.get("type") == "mcp":
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        _text(value.get("name"), param + ".name")
        return value
    raise _Invalid(f"'{param}' must be auto, none, required or a tool", "invalid_value", param)


def _max_tokens(value: object, param: str) -> int | str:
    if value == "inf":
        return "inf"
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"'{param}' must be an integer or 'inf'", "invalid_type", param)
    if not 1 <= value <= _MAX_OUTPUT_TOKENS:
        raise _Invalid(f"'{param}' must be 1 to {_MAX_OUTPUT_TOKENS}", "invalid_value", param)
    return value


def _decode_audio(value: object, param: str) -> bytes:
    try:
        return base64.b64decode(_text(value, param), validate=True)
    except binascii.Error:
        raise _Invalid(f"'{param}' is not valid base64", "invalid_value", param) from None


_CHECKS: Final[dict[str, Callable[[object, str], Any]]] = {
    "instructions": _text,
    "output_modalities": _modalities,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "max_output_tokens": _max_tokens,
}


# -- a session ------------------------------------------------------------------------


@dataclass(slots=True)
class _Plan:
    """What one ``response.create`` asks for, read when it arrives."""

    id: str
    behavior: Behavior
    config: dict[str, Any]  # the session's settings with the response's own over them
    audio_output: dict[str, Any]
    in_conversation: bool
    context: list[dict[str, Any]]
    own_input: bool  # ``response.input`` replaced the conversation as the context
    metadata: object
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class _Session:
    """One accepted WebSocket: the conversation, the audio buffer, the response under way."""

    def __init__(
        self,
        region: RealtimeRegion,
        receive: Receive,
        send: Send,
        handle: StreamHandle | None,
        model: str | None,
    ) -> None:
        self._region, self._stats = region, region.realtime
        self._receive, self._send, self._handle = receive, send, handle
        self.id, self.conversation_id = _new_id("sess_"), _new_id("conv_")
        self.model = model
        audio_input = dict.fromkeys(("transcription", "noise_reduction", "turn_detection"))
        self.config: dict[str, Any] = {
            "output_modalities": ["text"],
            "instructions": "",
            "tools": [],
            "tool_choice": "auto",
            "max_output_tokens": "inf",
            "audio": {
                "input": {"format": dict(_PCM), **audio_input},
                "output": {"format": dict(_PCM), "voice": "alloy", "speed": 1.0},
            },
            "tracing": None,
            "truncation": "auto",
            "prompt": None,
            "include": None,
        }
        self._expires_at = int(time.time()) + 3600
        self.items: list[dict[str, Any]] = []
        self._audio: dict[str, bytes] = {}  # an item's input audio, kept out of the item
        self._buffer = bytearray()
        self._active: _Plan | None = None
        self._responses = self._tokens_used = 0
        self._seen_context = 0  # the previous response's input and output: cached_tokens
        self._send_lock = asyncio.Lock()
        self._closed = False  # we closed (or dropped) the socket
        self._silent = False  # the "stall" fault: nothing more goes out
        self._ended = asyncio.Event()  # the session ends without waiting for the client

    # -- the socket ------------------------------------------------------------

    async def run(self) -> None:
        watcher = asyncio.ensure_future(self._close_on_stop())
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await self._emit("session.created", session=self._session_object())
            while True:
                receiving = asyncio.ensure_future(self._receive())
                await asyncio.wait({receiving, ended}, return_when="FIRST_COMPLETED")
                if not receiving.done():
                    receiving.cancel()
                    return
                message = receiving.result()
                if message["type"] == "websocket.disconnect":
                    return
                if message["type"] == "websocket.receive":
                    await self._on_message(message)
        finally:
            tasks = [watcher, ended]
            if self._active is not None and self._active.task is not None:
                tasks.append(self._active.task)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _emit(self, type_: str, **fields: Any) -> None:
        # Serialised now, as the objects in it change later; ``type`` first, as OpenAI
        # writes its events (readers may look for it there).
        data = orjson.dumps({"type": type_, "event_id": _new_id("event_"), **fields}).decode()
        async with self._send_lock:
            if self._closed or self._silent:
                return
            # Counted first: a client may read the counters as soon as the event reaches it.
            self._stats.add("messages_sent_total")
            await self._send({"type": "websocket.send", "text": data})

    async def _close(self, code: int, reason: str) -> None:
        async with self._send_lock:
            if not self._closed:
                self._closed = True
                await self._send({"type": "websocket.close", "code": code, "reason": reason})

    async def _drop(self) -> None:
        """End the connection without a close frame (HTTP/2: reset the stream)."""
        async with self._send_lock:
            if self._closed:
                self._ended.set()
                return
            self._closed = True
            if self._handle is None:
                await self._send({"type": "websocket.close", "code": 1011})
            else:
                await self._handle.reset()
        # HTTP/1.1 reports the closed connection as a disconnect; a reset stream does not.
        if self._handle is None or self._handle.http2:
            self._ended.set()

    async def _close_on_stop(self) -> None:
        await self._region.wait_stopping()
        # A kill drops every connection as soon as the stop begins: let it go first, so that
        # a dead region sends no goodbye.
        for _ in range(3):
            await asyncio.sleep(0)
        if self._handle is not None and self._handle.is_closing():
            return
        if self._silent or self._closed:
            await self._drop()  # a stalled session is dropped at once, as stalled requests are
        else:
            await self._close(1001, "the region is shutting down")

    # -- client events ----------------------------------------------------------

    async def _on_message(self, message: Message) -> None:
        self._stats.add("messages_received_total")
        event_id: str | None = None
        try:
            text = message.get("text")
            if text is None:
                raise _Invalid("binary messages are not Realtime events", "invalid_value")
            try:
                event = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                raise _Invalid(f"the message is not valid JSON: {exc}", "invalid_json") from None
            if not isinstance(event, dict):
                raise _Invalid("an event must be a JSON object", "invalid_type")
            if isinstance(event.get("event_id"), str):
                event_id = event["event_id"]
            kind = event.get("type")
            if not isinstance(kind, str):
                raise _Invalid("an event needs a 'type'", "missing_required_parameter", "type")
            if kind not in _EVENTS:
                raise _Invalid(f"unknown event type {kind!r}", "unknown_event_type", "type")
            await getattr(self, "_on_" + kind.replace(".", "_"))(event)
        except _Invalid as exc:
            self._stats.add("errors_total")
            error = {"type": "invalid_request_error", "code": exc.code, "message": str(exc)}
            await self._emit("error", error=error | {"param": exc.param, "event_id": event_id})

    def _session_object(self) -> dict[str, Any]:
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self.model or DEFAULT_MODEL,
            **self.config,
            "expires_at": self._expires_at,
        }

    async def _on_session_update(self, event: dict[str, Any]) -> None:
        session = _object(event.get("session"), "session")
        if session.get("type", "realtime") != "realtime":
            raise _Invalid("only 'realtime' sessions are served", "invalid_value", "session.type")
        model = session.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise _Invalid("'session.model' must be a string", "invalid_type", "session.model")
        changes = {
            k: check(session[k], "session." + k) for k, check in _CHECKS.items() if k in session
        }
        sides = {}
        for side, value in _object(session.get("audio") or {}, "session.audio").items():
            if side in ("input", "output"):
                sides[side] = _object(value, f"session.audio.{side}")
        # All checked before anything changes: a refused update changes nothing.
        self.model = self.model or model  # the model is fixed once known
        self.config.update(changes)
        for side, value in sides.items():
            self.config["audio"][side].update(value)
        for key in ("tracing", "truncation", "prompt", "include"):
            if key in session:
                self.config[key] = session[key]
        await self._emit("session.updated", session=self._session_object())

    def _take_item(self, raw: object, param: str) -> dict[str, Any]:
        """A client's item as the conversation holds it: with an id and a status, its audio
        moved out (items are sent back without it)."""
        item = dict(_object(raw, param))
        item_id = item.get("id") or _new_id("item_")
        _text(item_id, param + ".id")
        kind = item.get("type")
        if kind == "message":
            role = item.get("role")
            allowed = _ROLE_PARTS.get(role) if isinstance(role, str) else None
            if allowed is None:
                raise _Invalid("a message's role is user, assistant or system", "invalid_value")
            if not isinstance(item.get("content"), list):
                raise _Invalid(f"'{param}.content' must be an array", "invalid_type")
            parts, audio = [], b""
            for part in item["content"]:
                part = dict(_object(part, param + ".content[]"))
                if part.get("type") not in allowed:
                    raise _Invalid(f"no {part.get('type')!r} in a {role} message", "invalid_value")
                if "audio" in part:
                    audio += _decode_audio(part.pop("audio"), param + ".content[].audio")
                parts.append(part)
            item["content"] = parts
            if audio:
                self._audio[item_id] = audio
        elif kind == "function_call":
            _text(item.get("name"), param + ".name")
            item["arguments"] = _text(item.get("arguments", ""), param + ".arguments")
            item.setdefault("call_id", _new_id("call_"))
        elif kind == "function_call_output":
            _text(item.get("call_id"), param + ".call_id")
            _text(item.get("output"), param + ".output")
        else:
            raise _Invalid(f"unknown item type {kind!r}", "invalid_value", param + ".type")
        return {**item, "id": item_id, "object": "realtime.item", "status": "completed"}

    async def _add_item(self, item: dict[str, Any], after: object = None) -> None:
        index = len(self.items) if after is None else 0
        if after not in (None, "root"):
            index = self.items.index(self._find({"item_id": after}, "previous_item_id")) + 1
        self.items.insert(index, item)
        previous = self.items[index - 1]["id"] if index > 0 else None
        await self._emit("conversation.item.added", previous_item_id=previous, item=item)
        await self._emit("conversation.item.done", previous_item_id=previous, item=item)

    async def _on_conversation_item_create(self, event: dict[str, Any]) -> None:
        item = self._take_item(event.get("item"), "item")
        if any(it["id"] == item["id"] for it in self.items):
            raise _Invalid(f"an item with id {item['id']!r} exists", "invalid_value", "item.id")
        await self._add_item(item, event.get("previous_item_id"))

    def _find(self, event: dict[str, Any], param: str = "item_id") -> dict[str, Any]:
        for item in self.items:
            if item["id"] == event.get("item_id"):
                return item
        raise _Invalid(f"no item with id {event.get('item_id')!r}", "item_not_found", param)

    async def _on_conversation_item_delete(self, event: dict[str, Any]) -> None:
        item = self._find(event)
        self.items.remove(item)
        await self._emit("conversation.item.deleted", item_id=item["id"])

    async def _on_conversation_item_retrieve(self, event: dict[str, Any]) -> None:
        await self._emit("conversation.item.retrieved", item=self._find(event))

    async def _on_input_audio_buffer_append(self, event: dict[str, Any]) -> None:
        self._buffer += _decode_audio(event.get("audio"), "audio")

    async def _on_input_audio_buffer_commit(self, event: dict[str, Any]) -> None:
        if not self._buffer:
            raise _Invalid("the input audio buffer is empty", "input_audio_buffer_commit_empty")
        item_id = _new_id("item_")
        self._audio[item_id] = bytes(self._buffer)
        self._buffer.clear()
        previous = self.items[-1]["id"] if self.items else None
        await self._emit("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        content = [{"type": "input_audio", "transcript": None}]
        item = {"id": item_id, "object": "realtime.item", "type": "message", "status": "completed"}
        await self._add_item(item | {"role": "user", "content": content})

    async def _on_input_audio_buffer_clear(self, event: dict[str, Any]) -> None:
        self._buffer.clear()
        await self._emit("input_audio_buffer.cleared")

    # -- responses ----------------------------------------------------------------

    async def _on_response_create(self, event: dict[str, Any]) -> None:
        if self._active is not None:
            raise _Invalid(
                f"the conversation already has an active response: {self._active.id}",
                "conversation_already_has_active_response",
            )
        params = _object(event.get("response") or {}, "response")
        config = self.config | {
            k: check(params[k], "response." + k) for k, check in _CHECKS.items() if k in params
        }
        audio_output = dict(self.config["audio"]["output"])
        if "audio" in params:
            output = _object(params["audio"], "response.audio").get("output") or {}
            audio_output.update(_object(output, "response.audio.output"))
        context = self.items
        if "input" in params:
            if not isinstance(params["input"], list):
                raise _Invalid("'response.input' must be an array", "invalid_type")
            context = [self._input_item(entry) for entry in params["input"]]
        plan = _Plan(
            id=_new_id("resp_"),
            behavior=self._region.behavior,
            config=config,
            audio_output=audio_output,
            in_conversation=params.get("conversation", "auto") != "none",
            context=list(context),
            own_input="input" in params,
            metadata=params.get("metadata"),
        )
        plan.task = asyncio.ensure_future(self._respond(plan))
        self._active = plan

    async def _on_response_cancel(self, event: dict[str, Any]) -> None:
        wanted, active = event.get("response_id"), self._active
        if active is None or (wanted is not None and wanted != active.id):
            raise _Invalid("there is no active response to cancel", "response_cancel_not_active")
        active.cancel.set()

    def _input_item(self, entry: object) -> dict[str, Any]:
        entry = _object(entry, "response.input[]")
        if entry.get("type") == "item_reference":
            return self._find({"item_id": entry.get("id")}, "response.input[].id")
        return self._take_item(entry, "response.input[]")

    def _prompt(self, context: list[dict[str, Any]]) -> tuple[str, bool]:
        """The text the answer is derived from, and whether a user said it."""
        for item in reversed(context):
            if item["type"] == "function_call_output":
                return str(item["output"]), False
            if item["type"] == "message" and item["role"] == "user":
                texts = [p["text"] for p in item["content"] if isinstance(p.get("text"), str)]
                if texts:
                    return "".join(texts), True
                return base64.b64encode(self._audio.get(item["id"], b"")).decode(), True
        return "", False

    @staticmethod
    def _call(config: dict[str, Any], prompt: str, said_by_user: bool) -> str | None:
        """The function the response calls, if any."""
        tools = config["tools"]
        names = [t["name"] for t in tools if t.get("type", "function") == "function"]
        choice = config["tool_choice"]
        if isinstance(choice, dict):
            return str(choice["name"]) if choice.get("type") == "function" else None
        if not names or choice == "none":
            return None
        for name in _CALL.findall(prompt) if said_by_user else ():
            if name in names:
                return str(name)
        return str(names[0]) if choice == "required" else None

    async def _respond(self, plan: _Plan) -> None:
        try:
            await self._generate(plan)
        except Exception:
            log.exception("fake realtime session %s: response %s failed", self.id, plan.id)
            await self._close(1011, "internal error")
        finally:
            if self._active is plan:
                self._active = None

    async def _generate(self, plan: _Plan) -> None:
        behavior, rid = plan.behavior, plan.id
        prompt, said_by_user = self._prompt(plan.context)
        count = plan.config["max_output_tokens"]
        pieces = list(tokens(digest(prompt), count if isinstance(count, int) else behavior.tokens))
        call = self._call(plan.config, prompt, said_by_user)
        audio = call is None and "audio" in plan.config["output_modalities"]
        await self._emit("response.created", response=self._response(plan, []))
        item: dict[str, Any] = {"id": _new_id("item_"), "object": "realtime.item"}
        at = {"response_id": rid, "item_id": item["id"], "output_index": 0}
        if call is not None:
            # The answer as one JSON string argument, cut at its words.
            pieces = pieces or [""]
            pieces[0] = '{"text":"' + pieces[0]
            pieces[-1] += '"}'
            item |= {"type": "function_call", "status": "in_progress", "name": call}
            item |= {"call_id": _new_id("call_"), "arguments": ""}
            at["call_id"] = item["call_id"]
            streams = [_ARGUMENTS]
        else:
            item |= {"type": "message", "status": "in_progress", "role": "assistant", "content": []}
            at["content_index"] = 0
            streams = [_AUDIO, _TRANSCRIPT] if audio else [_TEXT]
        await self._emit("response.output_item.added", response_id=rid, output_index=0, item=item)
        previous = self.items[-1]["id"] if self.items else None
        if plan.in_conversation:
            self.items.append(item)
            await self._emit("conversation.item.added", previous_item_id=previous, item=item)
        part_key = "transcript" if audio else "text"
        part = {"type": "audio" if audio else "text", part_key: ""}
        if call is None:
            await self._emit("response.content_part.added", **at, part=part)

        fault, after = behavior.realtime_fault, behavior.realtime_fault_after_deltas
        sent: list[str] = []
        for index, piece in enumerate(pieces):
            if fault is not None and index == after:
                return await self._strike(fault)
            if await self._cancelled(plan, behavior.inter_token_delay if sent else behavior.ttft):
                break
            for stream in streams:
                delta = audio_delta(piece) if stream == _AUDIO else piece
                await self._emit(stream + ".delta", **at, delta=delta)
            sent.append(piece)
        cancelled = plan.cancel.is_set()
        if fault is not None and after >= len(pieces) and not cancelled:
            return await self._strike(fault)

        text = "".join(sent)
        item["status"] = "incomplete" if cancelled else "completed"
        for stream in streams:
            whole = {_DONE_FIELD[stream]: text} if stream in _DONE_FIELD else {}
            await self._emit(stream + ".done", **at, **({"name": call} if call else {}), **whole)
        if call is not None:
            item["arguments"] = text
        else:
            part[part_key] = text
            await self._emit("response.content_part.done", **at, part=part)
            item["content"] = [{"type": "output_audio" if audio else "output_text", part_key: text}]
        await self._emit("response.output_item.done", response_id=rid, output_index=0, item=item)
        if plan.in_conversation:
            await self._emit("conversation.item.done", previous_item_id=previous, item=item)

        usage = self._usage(plan, len(sent), audio)
        self._responses += 1
        self._tokens_used += usage["total_tokens"]
        self._stats.add("responses_total")
        if cancelled:
            self._stats.add("responses_cancelled_total")
        # Free before response.done goes out: a client may answer it with response.create.
        self._active = None
        await self._emit("response.done", response=self._response(plan, [item], usage))
        limits = [("requests", _REQUESTS_LIMIT, self._responses)]
        limits.append(("tokens", _TOKENS_LIMIT, self._tokens_used))
        rate_limits = [
            {"name": name, "limit": limit, "remaining": max(0, limit - used), "reset_seconds": 60.0}
            for name, limit, used in limits
        ]
        await self._emit("rate_limits.updated", rate_limits=rate_limits)

    def _usage(self, plan: _Plan, sent: int, audio: bool) -> dict[str, Any]:
        text_in = count_words(plan.config["instructions"])
        audio_in = 0
        for item in plan.context:
            if item["type"] == "message":
                text_in += sum(
                    count_words(p.get("text") or p.get("transcript")) for p in item["content"]
                )
                if item["id"] in self._audio:
                    audio_in += max(1, -(-len(self._audio[item["id"]]) // AUDIO_BYTES_PER_TOKEN))
            elif item["type"] == "function_call":
                text_in += count_words(item["name"]) + count_words(item["arguments"])
            else:
                text_in += count_words(item["output"])
        input_tokens = text_in + audio_in
        output_tokens = sent * (2 if audio else 1)
        cached = 0
        if plan.in_conversation and not plan.own_input:
            cached = min(self._seen_context, input_tokens)
            self._seen_context = input_tokens + output_tokens
        cached_text = min(cached, text_in)
        cached_details = {"text_tokens": cached_text, "audio_tokens": cached - cached_text}
        return {
            "total_tokens": input_tokens + output_tokens,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "input_token_details": {
                "cached_tokens": cached,
                "text_tokens": text_in,
                "audio_tokens": audio_in,
                "image_tokens": 0,
                "cached_tokens_details": cached_details | {"image_tokens": 0},
            },
            "output_token_details": {"text_tokens": sent, "audio_tokens": sent if audio else 0},
        }

    def _response(self, plan: _Plan, output: list[Any], usage: Any = None) -> dict[str, Any]:
        """The response object: in progress until it has its ``usage``."""
        status = "completed" if usage is not None else "in_progress"
        details = None
        if usage is not None and plan.cancel.is_set():
            status, details = "cancelled", {"type": "cancelled", "reason": "client_cancelled"}
        return {
            "object": "realtime.response",
            "id": plan.id,
            "status": status,
            "status_details": details,
            "output": output,
            "conversation_id": self.conversation_id if plan.in_conversation else None,
            "output_modalities": plan.config["output_modalities"],
            "max_output_tokens": plan.config["max_output_tokens"],
            "audio": {"output": plan.audio_output},
            "usage": usage,
            "metadata": plan.metadata,
        }

    async def _cancelled(self, plan: _Plan, delay: float) -> bool:
        """Wait ``delay``; whether ``response.cancel`` came before it was up."""
        if delay > 0 and not plan.cancel.is_set():
            try:
                await asyncio.wait_for(plan.cancel.wait(), delay)
            except TimeoutError:
                pass
        return plan.cancel.is_set()

    async def _strike(self, fault: str) -> None:
        self._stats.add("faults_total")
        if fault == "close":
            await self._close(1011, "fake region: injected fault")
        elif fault == "drop":
            await self._drop()
        else:
            async with self._send_lock:
                self._silent = True
            await asyncio.Event().wait()  # until the session ends and cancels this
