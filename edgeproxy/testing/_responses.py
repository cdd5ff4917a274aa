"""The OpenAI Responses API of the fake region, stateful as vLLM's and OpenAI's are.

``POST /v1/responses`` answers from the same deterministic generator as chat
completions, fed with the whole conversation as chat ``messages``
(:func:`conversation`): ``instructions`` (if any) as a ``system`` message, then
the chain of the previous responses' inputs and outputs (through
``previous_response_id``, looked up in *this* region's store), then this
input, each message's text parts joined into one string. So the answer to a
chain equals the answer to the same conversation sent whole, and equals
:func:`~edgeproxy.testing.answer_text` of those messages; a chain that lost
its history (continued on a region that never saw it, say) answers
differently. Every answer also carries ``x-fake-conversation-messages`` (the
messages it answered) and ``x-fake-conversation-digest`` (the first 16 hex
digits of their digest).

The answer has ``Behavior.tokens`` tokens, fewer when ``max_output_tokens``
is smaller: the response is then ``incomplete`` (``incomplete_details.reason
= "max_output_tokens"``), and its text a prefix of the whole answer. Usage
counts input tokens with the KV model's tokeniser (:mod:`edgeproxy.testing._kv`),
its cached prefix in ``input_tokens_details.cached_tokens``, and one output
token per text delta.

A response is stored (unless ``store`` is false) once everything but its last part
(the JSON body, or the ``response.completed`` event) was written, before that part goes
out, so that a client holding the whole answer finds it stored: a stream cut by a fault
or by its client before its end leaves nothing behind, so chaining to
it gets 404 ``previous_response_not_found``, as on a region that never saw
it. The store holds ``capacity`` responses, the oldest dropped first, and is
emptied when the region (re)starts, like a server's in-memory store.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol
from urllib.parse import parse_qs

from edgeproxy.testing import _content as content
from edgeproxy.testing._behavior import Behavior
from edgeproxy.testing._exchange import (
    BadRequest,
    Exchange,
    Generation,
    Reply,
    joined_text,
    json_reply,
    set_json,
)
from edgeproxy.testing._kv import read_prompt

DEFAULT_CAPACITY: Final = 10_000
"""Responses a region stores before it drops the oldest."""

_MESSAGE_ROLES: Final = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text"})
_SSE_HEADERS: Final = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Conversations(Protocol):
    """The region's conversations, as a Responses request uses them (its
    :class:`~edgeproxy.testing._objects.ObjectStore`)."""

    def conversation_messages(self, conversation_id: str) -> list[Any]:
        """The conversation's items as chat messages; the API's 404 if it is not here."""
        ...

    def add_to_conversation(
        self, conversation_id: str, messages: list[Any], items: list[dict[str, Any]]
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One response as the region keeps it."""

    response: dict[str, Any]
    """The response object, as ``GET /v1/responses/{id}`` returns it."""
    history: tuple[Any, ...]
    """The conversation a response chained to this one starts with: the chain's
    inputs and outputs, this response's answer last (instructions left out, as
    OpenAI does not carry them over)."""
    input_items: tuple[dict[str, Any], ...]
    """This response's input items, with ids, in order."""


@dataclass(frozen=True, slots=True)
class StoreCounters:
    stored: int
    stored_total: int
    evicted_total: int
    previous_hits_total: int
    previous_misses_total: int
    lookups_total: int
    lookup_misses_total: int


class ResponseStore:
    """A region's stored responses: bounded, oldest dropped first, safe from any thread."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._stored_total = 0
        self._evicted_total = 0
        self._previous_hits = 0
        self._previous_misses = 0
        self._lookups = 0
        self._lookup_misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        with self._lock:
            self._items[stored.response["id"]] = stored
            self._stored_total += 1
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
                self._evicted_total += 1

    def previous(self, response_id: str) -> StoredResponse | None:
        """Look up a ``previous_response_id``, counting the hit or miss."""
        with self._lock:
            stored = self._items.get(response_id)
            if stored is None:
                self._previous_misses += 1
            else:
                self._previous_hits += 1
            return stored

    def lookup(self, response_id: str, *, delete: bool = False) -> StoredResponse | None:
        """Look up (or take out) a response for the ``/v1/responses/{id}`` routes."""
        with self._lock:
            stored = self._items.pop(response_id, None) if delete else self._items.get(response_id)
            if stored is None:
                self._lookup_misses += 1
            else:
                self._lookups += 1
            return stored

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """The stored response objects by id, oldest first."""
        with self._lock:
            return {key: stored.response for key, stored in self._items.items()}

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def counters(self) -> StoreCounters:
        with self._lock:
            return StoreCounters(
                stored=len(self._items),
                stored_total=self._stored_total,
                evicted_total=self._evicted_total,
                previous_hits_total=self._previous_hits,
                previous_misses_total=self._previous_misses,
                lookups_total=self._lookups,
                lookup_misses_total=self._lookup_misses,
            )

    def reset_counters(self) -> None:
        with self._lock:
            self._stored_total = self._evicted_total = 0
            self._previous_hits = self._previous_misses = 0
            self._lookups = self._lookup_misses = 0


# -- requests ------------------------------------------------------------------


def _text_of(value: object, where: str) -> str | list[Any]:
    """A message's content as the conversation holds it (see ``joined_text``)."""
    return joined_text(
        value,
        _TEXT_PARTS,
        not_list=f"'{where}' must be a string or an array of content parts",
        not_object=f"'{where}' parts must be objects",
    )


def read_input(raw: object) -> tuple[list[Any], list[dict[str, Any]]]:
    """The input as conversation messages, and as input items with ids."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise BadRequest("'input' must be a string or an array of items", param="input")
    messages: list[Any] = []
    items: list[dict[str, Any]] = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise BadRequest(f"'input[{index}]' must be an object", param="input")
        role = item.get("role")
        if item.get("type", "message") == "message" and role is not None:
            if role not in _MESSAGE_ROLES:
                raise BadRequest(f"'input[{index}].role' must be one of {sorted(_MESSAGE_ROLES)}")
            text = _text_of(item.get("content"), f"input[{index}].content")
            messages.append({"role": role, "content": text})
            kind = "output_text" if role == "assistant" else "input_text"
            parts = [{"type": kind, "text": text}] if isinstance(text, str) else text
            items.append(
                {
                    "id": item.get("id") or "msg_" + secrets.token_hex(24),
                    "type": "message",
                    "role": role,
                    "content": parts,
                    "status": "completed",
                }
            )
        else:
            # Tool calls, their outputs, references: part of the conversation as given.
            messages.append(item)
            items.append({"id": item.get("id") or "item_" + secrets.token_hex(24), **item})
    return messages, items


def _optional(request: Mapping[str, Any], key: str, kind: type) -> Any:
    """``request[key]``, ``None`` if absent; ``BadRequest`` unless it is a ``kind``."""
    value = request.get(key)
    if value is None:
        return None
    # ``True`` is an ``int`` to Python, not to JSON.
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise BadRequest(f"'{key}' must be of type {kind.__name__}", param=key)
    return value


def conversation(
    instructions: str | None, history: tuple[Any, ...], messages: list[Any]
) -> list[Any]:
    """The chat ``messages`` a Responses request is answered as (see the module's docstring)."""
    system = [{"role": "system", "content": instructions}] if instructions else []
    return [*system, *history, *messages]


class _Answer:
    """One response being answered: its objects and events, rebuilt once the KV model
    says how much of the prompt was cached."""

    def __init__(
        self,
        request: dict[str, Any],
        *,
        model: str,
        words: list[str],
        prompt_tokens: int,
        incomplete: bool,
        previous: str | None,
        store: bool,
    ) -> None:
        self.id = "resp_" + secrets.token_hex(24)
        self.item_id = "msg_" + secrets.token_hex(24)
        self.created_at = int(time.time())
        self.request = request
        self.model = model
        self.words = words
        self.prompt_tokens = prompt_tokens
        self.cached = 0
        self.incomplete = incomplete
        self.previous = previous
        self.store = store
        self.final = self.response(done=True)

    def set_cached(self, cached: int) -> None:
        self.cached = cached
        self.final = self.response(done=True)

    def usage(self) -> dict[str, Any]:
        output = len(self.words)
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached, "cache_write_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + output,
        }

    def text_part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, *, done: bool) -> dict[str, Any]:
        status = "incomplete" if self.incomplete else "completed"
        return {
            "type": "message",
            "id": self.item_id,
            "status": status if done else "in_progress",
            "role": "assistant",
            "content": [self.text_part("".join(self.words))] if done else [],
        }

    def response(self, *, done: bool) -> dict[str, Any]:
        request = self.request
        status = ("incomplete" if self.incomplete else "completed") if done else "in_progress"
        conversation_ = request.get("conversation")
        if isinstance(conversation_, str):
            conversation_ = {"id": conversation_}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if done else None,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if done and self.incomplete
            else None,
            "instructions": request.get("instructions"),
            "max_output_tokens": request.get("max_output_tokens"),
            "metadata": request.get("metadata") or {},
            "model": self.model,
            "output": [self.item(done=True)] if done else [],
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "previous_response_id": self.previous,
            "conversation": conversation_,
            "store": self.store,
            "temperature": request.get("temperature", 1.0),
            "top_p": request.get("top_p", 1.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": request.get("tool_choice", "auto"),
            "tools": request.get("tools") or [],
            "truncation": request.get("truncation") or "disabled",
            "usage": self.usage() if done else None,
            "user": request.get("user"),
        }

    def events(self) -> list[bytes]:
        """The stream: one part of opening events, one per delta, one of closing events."""
        seq = 0

        def event(type_: str, **fields: Any) -> bytes:
            nonlocal seq
            payload = {"type": type_, "sequence_number": seq, **fields}
            seq += 1
            return content.sse_named_event(type_, payload)

        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        opening = [
            event("response.created", response=self.response(done=False)),
            event("response.in_progress", response=self.response(done=False)),
            event("response.output_item.added", output_index=0, item=self.item(done=False)),
            event("response.content_part.added", **where, part=self.text_part("")),
        ]
        parts = [b"".join(opening)]
        for word in self.words:
            parts.append(event("response.output_text.delta", **where, delta=word, logprobs=[]))
        text = "".join(self.words)
        final = self.final
        closing = [
            event("response.output_text.done", **where, text=text, logprobs=[]),
            event("response.content_part.done", **where, part=self.text_part(text)),
            event("response.output_item.done", output_index=0, item=self.item(done=True)),
            event(
                "response.incomplete" if self.incomplete else "response.completed", response=final
            ),
        ]
        parts.append(b"".join(closing))
        return parts


def create(
    request: dict[str, Any],
    behavior: Behavior,
    region_model: str,
    store: ResponseStore,
    objects: Conversations | None = None,
) -> Reply:
    """``POST /v1/responses``; ``conversation`` is looked up in ``objects``."""
    if "input" not in request:
        raise BadRequest("'input' is required", param="input")
    messages, items = read_input(request["input"])
    instructions = _optional(request, "instructions", str)
    stream = _optional(request, "stream", bool) or False
    keep = _optional(request, "store", bool) is not False
    limit = _optional(request, "max_output_tokens", int)
    if limit is not None and limit < 1:
        raise BadRequest("'max_output_tokens' must be at least 1", param="max_output_tokens")
    previous_id = _optional(request, "previous_response_id", str)
    history: tuple[Any, ...] = ()
    if previous_id is not None:
        previous = store.previous(previous_id)
        if previous is None:
            raise BadRequest(
                f"Previous response with id '{previous_id}' not found.",
                status=404,
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = previous.history
    conversation_id = request.get("conversation")
    if isinstance(conversation_id, dict):
        conversation_id = conversation_id.get("id")
    if conversation_id is not None:
        if not isinstance(conversation_id, str) or not conversation_id:
            raise BadRequest("'conversation' must be an id or an object with one")
        if previous_id is not None:
            raise BadRequest(
                "Mutually exclusive parameters: Ensure you are only providing one of: "
                "'previous_response_id' or 'conversation'."
            )
        if objects is None:
            raise BadRequest(f"Conversation with id '{conversation_id}' not found.", status=404)
        history = tuple(objects.conversation_messages(conversation_id))
    model = request.get("model")
    model = model if isinstance(model, str) and model else region_model

    convo = conversation(instructions, history, messages)
    n_tokens = behavior.tokens if limit is None else min(limit, behavior.tokens)
    words = list(content.tokens(content.digest(convo), n_tokens))
    chat_request = {"messages": convo, "max_tokens": n_tokens}
    answer = _Answer(
        request,
        model=model,
        words=words,
        prompt_tokens=read_prompt(chat_request, chat=True, block_size=1, hashed=False).tokens,
        incomplete=n_tokens < behavior.tokens,
        previous=previous_id,
        store=keep,
    )

    def on_complete() -> None:
        said = {"role": "assistant", "content": "".join(words)}
        if keep or conversation_id is not None:
            stored = StoredResponse(answer.final, (*history, *messages, said), tuple(items))
            store.put(stored)
        if conversation_id is not None and objects is not None:
            # The conversation goes on with this input and this answer.
            objects.add_to_conversation(
                conversation_id, [*messages, said], [*items, answer.item(done=True)]
            )

    headers = [
        (b"x-fake-conversation-messages", str(len(convo)).encode()),
        (b"x-fake-conversation-digest", content.digest(convo).hex()[:16].encode()),
    ]
    if not stream:
        reply = json_reply(200, answer.final)

        def with_cache(cached: int) -> None:
            answer.set_cached(cached)
            set_json(reply, answer.final)

    else:
        reply = Reply(
            200,
            [*_SSE_HEADERS],
            answer.events(),
            gap=behavior.inter_token_delay,
            gap_units=len(words),
            lead_parts=1,
        )

        def with_cache(cached: int) -> None:
            answer.set_cached(cached)
            reply.parts = answer.events()

        def stream_error(index: int) -> bytes:
            # The opening part holds four events; each later part one delta.
            error = {
                "type": "error",
                "sequence_number": index + 3,
                "code": "server_error",
                "message": f"injected error after {index - 1} tokens",
                "param": None,
            }
            return content.sse_named_event("error", error)

        reply.stream_error = stream_error
    reply.headers.extend(headers)
    reply.first_delay = behavior.ttft
    reply.generation = Generation(chat_request, True, len(words))
    reply.with_cache = with_cache
    reply.on_complete = on_complete
    return reply


def route(ex: Exchange, store: ResponseStore) -> Reply:
    """``GET``/``DELETE /v1/responses/{id}``, ``GET .../input_items``, ``POST .../cancel``."""
    rest = ex.path.removeprefix("/v1/responses/").split("/")
    response_id, action = rest[0], "/".join(rest[1:])
    allowed = {"": ("GET", "DELETE"), "input_items": ("GET",), "cancel": ("POST",)}.get(action)
    if not response_id or allowed is None:
        raise BadRequest(f"no route for {ex.method} {ex.path}", status=404)
    if ex.method not in allowed:
        raise BadRequest(f"method {ex.method} not allowed; use {' or '.join(allowed)}", status=405)
    stored = store.lookup(response_id, delete=ex.method == "DELETE")
    if stored is None:
        raise BadRequest(
            f"Response with id '{response_id}' not found.",
            status=404,
            param="response_id",
            code="response_not_found",
        )
    if ex.method == "DELETE":
        return json_reply(200, {"id": response_id, "object": "response.deleted", "deleted": True})
    if action == "input_items":
        return json_reply(200, _input_items(ex, stored))
    # ``cancel`` only changes a background response in progress; a stored one is done.
    return json_reply(200, stored.response)


def _input_items(ex: Exchange, stored: StoredResponse) -> dict[str, Any]:
    query = parse_qs(ex.query_string)
    order = query.get("order", ["desc"])[-1]
    if order not in ("asc", "desc"):
        raise BadRequest("'order' must be asc or desc", param="order")
    try:
        limit = int(query.get("limit", ["20"])[-1])
    except ValueError:
        raise BadRequest("'limit' must be an integer", param="limit") from None
    if not 1 <= limit <= 100:
        raise BadRequest("'limit' must be between 1 and 100", param="limit")
    items = list(stored.input_items if order == "asc" else reversed(stored.input_items))
    after = query.get("after", [None])[-1]
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
