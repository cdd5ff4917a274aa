"""A cached answer: what is stored, how it is encoded for Redis, and how it is replayed.

An :class:`Entry` holds one complete 200 answer (a JSON body, a whole SSE
stream ending in ``[DONE]``, or a cacheable GET body) with its freshness
deadlines. It is replayed in the form the client asked for: a stream as SSE
events written one by one, a JSON answer as JSON, and across the two the
answer is converted (a stream assembled into one JSON completion, a JSON
completion cut into chunks).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from edgeproxy._core.response import StreamResponse
from edgeproxy._protocol.openai import (
    SSE_DONE,
    AnswerHead,
    chat_chunk_choice,
    chunk,
    sse_event,
    text_choice,
    usage_chunk,
)

__all__ = ["BadEntry", "Entry", "ReplayResponse", "replay_parts"]

# Encoded entries start with this magic and version: anything else is garbage.
_MAGIC: Final = b"EPC1"
_META_LEN: Final = 4
# Rough per-entry overhead beyond the body, for the memory tier's byte budget.
_OVERHEAD: Final = 256

# Headers that describe one particular delivery, not the answer: never stored.
_NOT_STORED: Final = frozenset(
    {
        "content-length",
        "date",
        "age",
        "set-cookie",
        "x-request-id",
        "server",
        "alt-svc",
        "via",
        "traceparent",
        "tracestate",
    }
)


class BadEntry(ValueError):
    """Bytes that are not an encoded entry (truncated, foreign or corrupt)."""


@dataclass(slots=True)
class Entry:
    """One stored answer and its freshness, in wall-clock seconds (shared across hosts)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    kind: str
    """``sse`` (a whole event stream), ``json``, or ``raw`` (replayed byte for byte)."""
    stored_at: float
    fresh_until: float
    swr_until: float
    """Until then a stale entry is served while one background request refreshes it."""
    sie_until: float
    """Until then a stale entry is served when every region fails."""
    delta: float
    """Seconds the answer took to compute: XFetch refreshes earlier for slow answers."""
    region: str | None = None
    _events: list[bytes] | None = field(default=None, repr=False, compare=False)
    encoded: dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)
    """The answer as sent in a content coding, made on the first hit that asks for it."""

    @classmethod
    def build(
        cls,
        *,
        status: int,
        headers: Iterable[tuple[str, str]],
        body: bytes,
        kind: str,
        ttl: float,
        swr: float,
        sie: float,
        delta: float,
        region: str | None,
        now: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Entry:
        """An entry stored ``now`` (else read from ``clock``, wall-clock seconds).

        Its windows follow from that: fresh for ``ttl``, then served stale for
        ``swr`` (stale-while-revalidate) or ``sie`` (stale-if-error) more.
        """
        now = clock() if now is None else now
        kept = tuple(
            (k.lower(), v)
            for k, v in headers
            if k.lower() not in _NOT_STORED and not k.lower().startswith("x-edgeproxy-")
        )
        fresh = now + ttl
        return cls(status, kept, body, kind, now, fresh, fresh + swr, fresh + sie, delta, region)

    # -- freshness -------------------------------------------------------

    @property
    def keep_until(self) -> float:
        """When a backend may drop the entry: past every window it can be served in."""
        return max(self.fresh_until, self.swr_until, self.sie_until)

    def age(self, now: float) -> int:
        """The ``Age`` header's value at ``now``: whole seconds since it was stored."""
        return max(0, int(now - self.stored_at))

    def should_refresh_early(self, now: float, beta: float, rand: float) -> bool:
        """XFetch (Vattani et al.): refresh before expiry with a probability that grows
        as expiry nears and with how long the answer took to compute.

        ``rand`` is uniform in (0, 1]; ``-log(rand)`` is an exponential draw.
        """
        if beta <= 0 or self.delta <= 0:
            return False
        return now - self.delta * beta * math.log(rand) >= self.fresh_until

    @property
    def size(self) -> int:
        return len(self.body) + sum(len(k) + len(v) for k, v in self.headers) + _OVERHEAD

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def events(self) -> list[bytes]:
        """The SSE events of a stream entry, each with its blank-line terminator."""
        if self._events is None:
            self._events = split_events(self.body)
        return self._events

    # -- encoding for Redis ----------------------------------------------

    def encode(self) -> bytes:
        meta = orjson.dumps(
            {
                "s": self.status,
                "h": self.headers,
                "k": self.kind,
                "t": self.stored_at,
                "f": self.fresh_until,
                "w": self.swr_until,
                "e": self.sie_until,
                "d": self.delta,
                "r": self.region,
                "n": len(self.body),
            }
        )
        return _MAGIC + len(meta).to_bytes(_META_LEN, "big") + meta + self.body

    @classmethod
    def decode(cls, data: object) -> Entry:
        """Parse :meth:`encode`'s output; :class:`BadEntry` for anything else."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise BadEntry(f"not bytes but {type(data).__name__}")
        raw = bytes(data)
        head = len(_MAGIC) + _META_LEN
        if len(raw) < head or not raw.startswith(_MAGIC):
            raise BadEntry("no entry header")
        meta_len = int.from_bytes(raw[len(_MAGIC) : head], "big")
        try:
            meta = orjson.loads(raw[head : head + meta_len])
        except orjson.JSONDecodeError as exc:
            raise BadEntry(f"bad metadata: {exc}") from None
        body = raw[head + meta_len :]
        try:
            if len(body) != meta["n"]:
                raise BadEntry("truncated body")
            entry = cls(
                status=_int(meta["s"]),
                headers=tuple((str(k), str(v)) for k, v in meta["h"]),
                body=body,
                kind=str(meta["k"]),
                stored_at=_float(meta["t"]),
                fresh_until=_float(meta["f"]),
                swr_until=_float(meta["w"]),
                sie_until=_float(meta["e"]),
                delta=_float(meta["d"]),
                region=meta["r"] if isinstance(meta["r"], str) else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BadEntry(f"bad metadata: {exc!r}") from None
        if entry.kind not in ("sse", "json", "raw") or not 100 <= entry.status <= 599:
            raise BadEntry("bad metadata: kind or status")
        return entry


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"not an integer: {value!r}")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"not a number: {value!r}")
    return float(value)


# -- SSE ---------------------------------------------------------------------


def split_events(body: bytes) -> list[bytes]:
    """Cut an SSE body into events, each ending with its blank line."""
    body = body.replace(b"\r\n", b"\n")
    return [part + b"\n\n" for part in body.split(b"\n\n") if part.strip()]


_DONE_EVENT: Final = re.compile(rb"(?:^|\n)data: ?\[DONE\]\r?\n\r?\n")


def stream_complete(tail: bytes) -> bool:
    """Whether ``tail``, the end of an SSE body, holds the whole ``data: [DONE]`` event."""
    return _DONE_EVENT.search(tail) is not None


def _event_data(event: bytes) -> Any:
    """The JSON of an event's ``data:`` lines; None for ``[DONE]`` and non-JSON events."""
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    data = b"\n".join(lines)
    if data == b"[DONE]":
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def is_usage_event(event: bytes) -> bool:
    """The extra chunk OpenAI sends for ``stream_options.include_usage``: no choices, usage."""
    if b'"usage"' not in event:
        return False
    data = _event_data(event)
    return isinstance(data, dict) and data.get("choices") == [] and bool(data.get("usage"))


# -- conversions between a stream and one JSON answer -------------------------------


def assemble(events: Sequence[bytes]) -> dict[str, Any] | None:
    """Rebuild the non-streamed answer from a chat or text completion stream.

    None when the stream is not something this knows how to assemble.
    """
    out: dict[str, Any] | None = None
    choices: dict[int, dict[str, Any]] = {}
    tools: dict[int, dict[int, dict[str, Any]]] = {}
    chat = True
    for event in events:
        data = _event_data(event)
        if not isinstance(data, dict):
            continue
        if out is None:
            obj = data.get("object")
            if obj == "chat.completion.chunk":
                chat = True
            elif obj == "text_completion":
                chat = False
            else:
                return None
            out = {
                "id": data.get("id"),
                "object": "chat.completion" if chat else "text_completion",
                "created": data.get("created"),
                "model": data.get("model"),
            }
            if data.get("system_fingerprint") is not None:
                out["system_fingerprint"] = data["system_fingerprint"]
        if isinstance(data.get("usage"), dict):
            out["usage"] = data["usage"]
        chunk_choices = data.get("choices") or []
        if not isinstance(chunk_choices, list):
            return None
        for choice in chunk_choices:
            # Indexes are integers: they key and sort the choices and tool calls.
            if not isinstance(choice, dict) or not _is_index(choice.get("index", 0)):
                return None
            index = choice.get("index", 0)
            if chat:
                cur = choices.setdefault(
                    index,
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": None},
                        "logprobs": None,
                        "finish_reason": None,
                    },
                )
                delta = choice.get("delta") or {}
                calls = (delta.get("tool_calls") or []) if isinstance(delta, dict) else None
                if not isinstance(calls, list):
                    return None
                message = cur["message"]
                if delta.get("role"):
                    message["role"] = delta["role"]
                for name in ("content", "refusal"):
                    if isinstance(delta.get(name), str):
                        message[name] = (message.get(name) or "") + delta[name]
                for call in calls:
                    function = (call.get("function") or {}) if isinstance(call, dict) else None
                    if (
                        not isinstance(function, dict)
                        or not _is_index(call.get("index", 0))
                        or not isinstance(function.get("name") or "", str)
                        or not isinstance(function.get("arguments") or "", str)
                    ):
                        return None
                    slot = tools.setdefault(index, {}).setdefault(
                        call.get("index", 0),
                        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    if call.get("id"):
                        slot["id"] = call["id"]
                    if call.get("type"):
                        slot["type"] = call["type"]
                    slot["function"]["name"] += function.get("name") or ""
                    slot["function"]["arguments"] += function.get("arguments") or ""
                logprobs = choice.get("logprobs")
                if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
                    if cur["logprobs"] is None:
                        cur["logprobs"] = {"content": []}
                    cur["logprobs"]["content"].extend(logprobs["content"])
            else:
                cur = choices.setdefault(
                    index, {"index": index, "text": "", "logprobs": None, "finish_reason": None}
                )
                if isinstance(choice.get("text"), str):
                    cur["text"] += choice["text"]
            if choice.get("finish_reason"):
                cur["finish_reason"] = choice["finish_reason"]
    if out is None:
        return None
    for index, calls in tools.items():
        choices[index]["message"]["tool_calls"] = [calls[i] for i in sorted(calls)]
    out["choices"] = [choices[i] for i in sorted(choices)]
    return out


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_PIECES = re.compile(r"\s*\S+|\s+")


def _pieces(text: str) -> list[str]:
    """Word-sized pieces of ``text`` that join back into it exactly."""
    return _PIECES.findall(text) or [text]


def explode(answer: dict[str, Any], *, include_usage: bool) -> list[bytes] | None:
    """Cut a chat or text completion into the SSE events a streamed answer would have had.

    None when ``answer`` is not a completion this knows how to stream.
    """
    head = AnswerHead.of(answer)
    if head is None:
        return None
    events: list[bytes] = []

    def emit(choice: dict[str, Any]) -> None:
        events.append(sse_event(chunk(head, [choice])))

    choices = answer.get("choices") or []
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if not isinstance(choice, dict):
            return None
        index = choice.get("index", 0)
        finish = choice.get("finish_reason")
        if head.chat:
            message = choice.get("message") or {}
            calls = (message.get("tool_calls") or []) if isinstance(message, dict) else None
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                return None
            role = message.get("role", "assistant")
            emit(chat_chunk_choice(index, {"role": role, "content": ""}))
            content = message.get("content")
            if isinstance(content, str) and content:
                for piece in _pieces(content):
                    emit(chat_chunk_choice(index, {"content": piece}))
            for i, call in enumerate(calls):
                emit(chat_chunk_choice(index, {"tool_calls": [{**call, "index": i}]}))
            emit(chat_chunk_choice(index, {}, finish))
        else:
            text = choice.get("text")
            if isinstance(text, str) and text:
                for piece in _pieces(text):
                    emit(text_choice(index, piece))
            emit(text_choice(index, "", finish))
    if include_usage and isinstance(answer.get("usage"), dict):
        events.append(sse_event(usage_chunk(head, answer["usage"])))
    events.append(SSE_DONE)
    return events


# -- replay ------------------------------------------------------------------------


def replay_parts(
    entry: Entry, *, wants_sse: bool, include_usage: bool
) -> tuple[list[bytes], bool] | None:
    """The body of ``entry`` as the client wants it: (parts, is_sse).

    A stream asked as a stream comes back event by event (the usage chunk only
    when asked for), a JSON answer as one part, and across the two the answer
    is converted. None when a conversion is impossible: the caller treats that
    as a miss.
    """
    if entry.kind == "sse":
        events = entry.events()
        if wants_sse:
            if not include_usage:
                events = [e for e in events if not is_usage_event(e)]
            return events, True
        answer = assemble(events)
        if answer is None:
            return None
        return [orjson.dumps(answer)], False
    if entry.kind == "json" and wants_sse:
        try:
            answer = orjson.loads(entry.body)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(answer, dict):
            return None
        events_out = explode(answer, include_usage=include_usage)
        if events_out is None:
            # Embeddings and other answers have no stream form: send them as they are.
            return [entry.body], False
        return events_out, True
    return [entry.body], False


class ReplayResponse(StreamResponse):
    """A cached SSE answer, written event by event once aiohttp sends the response.

    It leaves the handler unprepared, like a ``Response``, so the pipeline
    and fallback plugins can still add headers or replace it.
    """

    def __init__(self, *, status: int, parts: list[bytes]) -> None:
        super().__init__(status=status)
        self._parts = parts

    async def write_eof(self, data: bytes = b"") -> None:
        parts, self._parts = self._parts, []
        for part in parts:
            await self.write(part)
        await super().write_eof(data)


def response_headers(entry: Entry, *, sse: bool) -> list[tuple[str, str]]:
    """The stored headers, with the content type of the form being sent."""
    if (entry.kind == "sse") == sse:
        return list(entry.headers)
    out = [(k, v) for k, v in entry.headers if k not in ("content-type", "cache-control")]
    if sse:
        out += [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
    else:
        out.append(("content-type", "application/json"))
    return out
