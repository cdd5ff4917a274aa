"""The Realtime API's wire semantics: the one place that knows what its events mean.

OpenAI's Realtime API (and vLLM's, LocalAI's) is a WebSocket of JSON events both ways:
the client sends ``session.update``, ``input_audio_buffer.append``,
``conversation.item.create``, ``response.create``...; the server answers with
``session.created``, ``response.*.delta`` events, ``response.done`` (which carries the
response's ``usage``), ``rate_limits.updated`` and ``error``. The proxy reads only what
it acts on: the model, when a response starts and sends its first delta, its usage, and
the ids of the items it makes; everything else passes through untouched.

An event's type decides what the proxy does with it, so the proxy must read the same type
the region will. A client's event is parsed whole (as the region parses it: the last of
duplicate keys wins); a region's own events, which the proxy trusts, are read by their
opening ``"type"`` when they have one (a delta of audio is mostly base64), else whole.
"""

from __future__ import annotations

import re
from typing import Any, Final
from urllib.parse import parse_qs

import orjson

__all__ = [
    "REALTIME_SUFFIX",
    "ClientEvent",
    "client_event",
    "client_event_type",
    "error_event",
    "offered_protocols",
    "query_call",
    "query_model",
    "query_value",
    "region_event_type",
    "region_usage",
    "session_id",
    "session_model",
    "sum_usage",
]

REALTIME_SUFFIX: Final = "/realtime"
"""How a Realtime endpoint's path ends: ``/v1/realtime``, ``/openai/realtime``."""

# A region's event as OpenAI writes it: {"type":"response.audio.delta", ...}. Looked for
# in its first bytes only; an event written otherwise is parsed whole.
_TYPE_AT_START: Final = re.compile(r'\A\s*\{\s*"type"\s*:\s*"([A-Za-z0-9_.]{1,80})"')
_HEAD: Final = 160


class ClientEvent:
    """A client's event as the proxy reads it: its type and, for the few it acts on, its
    parsed body. ``type`` is None for a message that is no JSON object with a string
    ``type`` (the region answers it; the proxy only relays it)."""

    __slots__ = ("body", "type")

    def __init__(self, type: str | None, body: dict[str, Any] | None) -> None:
        self.type = type
        self.body = body


def client_event(message: str | bytes) -> ClientEvent:
    """Read a client's message the way the region will (see the module's docstring)."""
    try:
        body = orjson.loads(message)
    except orjson.JSONDecodeError:
        return ClientEvent(None, None)
    if type(body) is not dict:
        return ClientEvent(None, None)
    kind = body.get("type")
    return ClientEvent(kind if type(kind) is str else None, body)


def client_event_type(message: str) -> str | None:
    """A client's event's type, as the region will read it where the proxy acts on it
    (``response.create``, ``session.update``), without parsing an audio append's base64:
    its opening ``"type"``, when nothing later could override it with one of those (no
    escape that could spell one, and no second ``"type"`` key, or neither name at all);
    else the whole event's."""
    if "\\" not in message:
        found = _TYPE_AT_START.match(message[:_HEAD])
        if found is not None and (
            message.find('"type"', found.end()) < 0
            or ("response.create" not in message and "session.update" not in message)
        ):
            return found.group(1)
    return client_event(message).type


def region_event_type(message: str | bytes) -> tuple[str | None, dict[str, Any] | None]:
    """A region's event: its type, and its body when it had to be parsed to find it (or the
    type is one the proxy reads further: ``response.done``, ``session.*``, ``error``)."""
    head = message[:_HEAD]
    if isinstance(head, bytes):
        head = head.decode("utf-8", "replace")
    found = _TYPE_AT_START.match(head)
    if found is not None:
        kind = found.group(1)
        if not _READ_WHOLE(kind):
            return kind, None
    try:
        body = orjson.loads(message)
    except orjson.JSONDecodeError:
        return None, None
    if type(body) is not dict:
        return None, None
    kind = body.get("type")
    return (kind if type(kind) is str else None), body


def _READ_WHOLE(kind: str) -> bool:  # noqa: N802 - a predicate table, read as a name
    return kind == "response.done" or kind.startswith("session.") or kind == "error"


# A browser cannot set Authorization on a WebSocket: OpenAI's clients carry the API key in
# a subprotocol instead (openai-insecure-api-key.<key>). It is a credential like any other.
_KEY_PROTOCOLS: Final = ("openai-insecure-api-key.",)


def offered_protocols(values: list[str] | tuple[str, ...], *, credentials: bool) -> list[str]:
    """The subprotocols a client offered (its ``Sec-WebSocket-Protocol`` values), those
    carrying a credential left out unless clients' credentials are forwarded
    (``[server] forward_client_credentials``): the regions get their own."""
    offered = [p.strip() for value in values for p in value.split(",") if p.strip()]
    if credentials:
        return offered
    return [p for p in offered if not p.startswith(_KEY_PROTOCOLS)]


def query_value(target: str, name: str) -> str | None:
    """The value of ``name`` in a handshake's query string (the last, when repeated)."""
    _, _, query = target.partition("?")
    if not query:
        return None
    values = parse_qs(query, keep_blank_values=False).get(name)
    return values[-1] if values else None


def query_model(target: str) -> str | None:
    """The ``model=`` of a handshake's query string (OpenAI's ``/v1/realtime?model=...``)."""
    return query_value(target, "model")


def query_call(target: str) -> str | None:
    """The ``call_id=`` of a handshake's query: a session joining a call (a WebRTC or SIP
    call's sideband, or a session reconnecting to the region that holds it)."""
    return query_value(target, "call_id")


def _session_field(body: dict[str, Any], name: str) -> str | None:
    session = body.get("session")
    if isinstance(session, dict):
        found = session.get(name)
        if isinstance(found, str) and found:
            return found
    return None


def session_id(body: dict[str, Any]) -> str | None:
    """The id of the session a region's ``session.created`` made."""
    return _session_field(body, "id")


def session_model(body: dict[str, Any]) -> str | None:
    """The model a ``session.update`` (or a region's ``session.created``) names."""
    return _session_field(body, "model")


def _count(value: object) -> int:
    return value if type(value) is int and value >= 0 else 0


def region_usage(body: dict[str, Any]) -> dict[str, Any] | None:
    """A ``response.done``'s usage in the proxy's terms (``prompt_tokens``,
    ``completion_tokens``, ``total_tokens``), with the Realtime API's details kept: text and
    audio tokens each way, and the cached input tokens."""
    response = body.get("response")
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt = _count(usage.get("input_tokens"))
    completion = _count(usage.get("output_tokens"))
    total = _count(usage.get("total_tokens")) or prompt + completion
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": total,
    }
    inputs = usage.get("input_token_details")
    if isinstance(inputs, dict):
        out["input_text_tokens"] = _count(inputs.get("text_tokens"))
        out["input_audio_tokens"] = _count(inputs.get("audio_tokens"))
        out["cached_tokens"] = _count(inputs.get("cached_tokens"))
    outputs = usage.get("output_token_details")
    if isinstance(outputs, dict):
        out["output_text_tokens"] = _count(outputs.get("text_tokens"))
        out["output_audio_tokens"] = _count(outputs.get("audio_tokens"))
    return out


def sum_usage(total: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    """A session's usage so far with one more response's added (key by key)."""
    if total is None:
        return dict(more)
    for key, value in more.items():
        total[key] = _count(total.get(key)) + _count(value)
    return total


def error_event(
    message: str, *, code: str, type: str = "server_error", event_id: str | None = None
) -> str:
    """An ``error`` event in the Realtime API's shape, as the proxy's own (its
    ``event_id`` says so), for a client about to be closed or refused something."""
    return orjson.dumps(
        {
            "type": "error",
            "event_id": event_id or "edgeproxy",
            "error": {
                "type": type,
                "code": code,
                "message": message,
                "param": None,
                "event_id": None,
            },
        }
    ).decode()
