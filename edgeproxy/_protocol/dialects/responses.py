"""OpenAI's Responses API (``/v1/responses``).

A request's prompt is its ``instructions`` and ``input`` (a string or a list of
items); it refers to stored state through ``previous_response_id`` and
``conversation`` (and to uploaded files and vector stores through its input's parts and
its ``file_search`` tools), and asks the region to store its answer unless ``store`` is
false.

A stream is named events (``event: response.output_text.delta`` and its ``data``), each
with a ``sequence_number`` that increases from 0. It opens with ``response.created`` and
``response.in_progress`` before the model produced anything; its first content is a text,
refusal or tool-call delta, or an output item done; it ends with ``response.completed``
(``.incomplete``, ``.failed``), whose ``response`` is the whole answer, usage included
(``input_tokens``, cached ones among them, and ``output_tokens``). A broken stream ends
with an ``error`` event.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects._base import (
    AnswerText,
    Dialect,
    Piece,
    Seam,
    counted_io,
    loads,
    named_event,
    plain_text,
    text_parts,
    tokens,
)
from edgeproxy._protocol.dialects.responses_stream import (
    INCOMPLETE,
    ResponsesWriter,
    ResponseText,
    output_items,
    response_id,
    response_object,
    responses_usage,
)
from edgeproxy._protocol.objects import CONVERSATIONS, FILES, VECTOR_STORES
from edgeproxy._protocol.sse import SSEEvent

__all__ = [
    "RESPONSES",
    "ResponseText",
    "ResponsesDialect",
    "ResponsesSeam",
    "ResponsesWriter",
    "response_id",
    "response_object",
]

_ENDS: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})
# The roles of a message item, and the types of its text parts.
_ROLES: Final = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}
_TEXT_PARTS: Final = ("input_text", "output_text")
# Items that say nothing of the conversation's text: a reasoning model's own reasoning.
_SILENT_ITEMS: Final = frozenset({"reasoning"})
# What a new leg of a continued response opens with, which the client had already.
_OPENING: Final = frozenset({"response.created", "response.queued", "response.in_progress"})
# The events that close the text of the message item, each sent to the client once.
_CLOSING: Final = frozenset(
    {"response.output_text.done", "response.content_part.done", "response.output_item.done"}
)

# Input items, their parts and tools read for the stored objects they name.
_MAX_SCANNED: Final = 1_000


class ResponsesSeam(Seam):
    """A response continued across legs, by reissuing the request: the client's one
    response, its id and its message item's, and one run of ``sequence_number`` values.

    A later leg's opening events (``response.created``, ``response.in_progress``, its
    message item's ``output_item.added`` and ``content_part.added``) are dropped; its text
    deltas go on in the client's item, renumbered after the client's last event; the events
    closing the item carry the whole text (once each: a break after one came does not send
    it twice), and its ``response.completed`` is held and written once at the end, with
    the first leg's ids, the whole text and the legs' usage summed.
    """

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.response: dict[str, Any] = {}  # the client's response: its id, created_at
        self.item: str | None = None  # the client's message item
        self.output_index = 0
        self.content_index = 0
        self.closed: set[str] = set()  # the closing events the client got
        self.leg_item: str | None = None  # the current leg's message item
        self.end: dict[str, Any] | None = None  # the last leg's response.completed

    def _read(self, event: SSEEvent) -> tuple[str, dict[str, Any]] | None:
        obj = loads(event.data)
        if not isinstance(obj, dict):
            return None
        name = event.event or obj.get("type")
        return (name, obj) if isinstance(name, str) else None

    def first(self, event: SSEEvent) -> Piece:
        read = self._read(event)
        if read is None:
            return Piece()
        name, obj = read
        sequence = obj.get("sequence_number")
        if isinstance(sequence, int) and not isinstance(sequence, bool):
            self.sequence = sequence + 1
        if name == "response.created":
            response = obj.get("response")
            if isinstance(response, dict):
                self.response = {k: response[k] for k in ("id", "created_at") if k in response}
            return Piece()
        if name == "response.output_item.added":
            item = obj.get("item")
            if isinstance(item, dict) and item.get("type") == "message" and self.item is None:
                self.item = item.get("id")
                self.output_index = _int(obj.get("output_index"))
                return Piece()
            return Piece(other=True)
        if name == "response.content_part.added":
            part = obj.get("part")
            if isinstance(part, dict) and part.get("type") == "output_text":
                self.content_index = _int(obj.get("content_index"))
                return Piece()
            return Piece(other=True)
        if name == "response.output_text.delta" and obj.get("item_id") == self.item:
            return Piece(text=str(obj.get("delta") or ""))
        if (
            name in _CLOSING
            and self.item is not None
            and obj.get("item_id", _item_id(obj)) == self.item
        ):
            self.closed.add(name)
            return Piece()
        if name in _ENDS:
            return Piece(finish=True)
        return Piece(other=name.endswith(".delta"))

    def start_leg(self) -> None:
        self.leg_item = None
        self.end = None

    def later(self, event: SSEEvent) -> Piece:
        read = self._read(event)
        if read is None:
            return Piece()
        name, obj = read
        if name in _OPENING:
            return Piece()
        if name == "response.output_item.added":
            item = obj.get("item")
            if isinstance(item, dict) and item.get("type") == "message" and self.leg_item is None:
                self.leg_item = item.get("id")
                return Piece()
            return Piece("pass", obj, other=True)
        ours = self.leg_item is not None and obj.get("item_id", _item_id(obj)) == self.leg_item
        if name == "response.content_part.added" and ours:
            return Piece()
        if name == "response.output_text.delta" and ours:
            return Piece("text", obj, text=str(obj.get("delta") or ""))
        if name in _CLOSING and ours:
            return Piece() if name in self.closed else Piece("pass", obj)
        if name in ("response.completed", "response.incomplete"):
            self.end = obj
            response = obj.get("response")
            usage = response.get("usage") if isinstance(response, dict) else None
            return Piece("hold", obj, finish=True, usage=usage if isinstance(usage, dict) else None)
        return Piece("pass", obj, other=name.endswith(".delta"))

    def write(self, piece: Piece, text: str) -> bytes:
        obj = piece.obj
        name = str(obj.get("type"))
        if self.leg_item is not None and obj.get("item_id") == self.leg_item:
            obj["item_id"] = self.item
            obj["output_index"] = self.output_index
            obj["content_index"] = self.content_index
        if piece.kind == "text":
            obj["delta"] = piece.text
        elif name == "response.output_text.done":
            obj["text"] = text
        elif name == "response.content_part.done" and isinstance(obj.get("part"), dict):
            obj["part"]["text"] = text
        elif name == "response.output_item.done":
            item = obj.get("item")
            if isinstance(item, dict) and item.get("id") == self.leg_item:
                self._as_client_item(item, text)
                obj["output_index"] = self.output_index
        elif name == "response.failed" and isinstance(obj.get("response"), dict):
            obj["response"].update(self.response)
        if name in _CLOSING:
            self.closed.add(name)
        return self._numbered(name, obj)

    def close(self, usage: dict[str, Any] | None, text: str) -> bytes:
        end = self.end
        if end is None:
            return b""
        response = end.get("response")
        if isinstance(response, dict):
            response.update(self.response)
            for item in response.get("output") or ():
                if isinstance(item, dict) and item.get("id") == self.leg_item:
                    self._as_client_item(item, text)
            if usage is not None:
                prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
                reported = response.get("usage")
                response["usage"] = {
                    **(reported if isinstance(reported, dict) else {}),
                    "input_tokens": prompt,
                    "output_tokens": completion,
                    "total_tokens": prompt + completion,
                }
        return self._numbered(str(end.get("type")), end)

    def _as_client_item(self, item: dict[str, Any], text: str) -> None:
        item["id"] = self.item
        parts = item.get("content")
        if isinstance(parts, list) and self.content_index < len(parts):
            part = parts[self.content_index]
            if isinstance(part, dict) and part.get("type") == "output_text":
                part["text"] = text

    def _numbered(self, name: str, obj: dict[str, Any]) -> bytes:
        obj["sequence_number"] = self.sequence
        self.sequence += 1
        return named_event(name, obj)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _item_id(obj: dict[str, Any]) -> Any:
    """The id of the item an ``output_item`` event carries."""
    item = obj.get("item")
    return item.get("id") if isinstance(item, dict) else None


class ResponsesDialect(Dialect):
    """``/v1/responses``."""

    name = "responses"
    max_tokens_keys: ClassVar[tuple[str, ...]] = ("max_output_tokens",)
    prompt_keys: ClassVar[tuple[str, ...]] = ("instructions", "input")
    turns: ClassVar[str | None] = "input"
    continuation: ClassVar[str | None] = "reissue"
    seam = ResponsesSeam
    usage_inside: ClassVar[str | None] = "response"
    writer = ResponsesWriter
    unstreamable_as_json = False

    keeps_state = True
    required: ClassVar[tuple[str, ...]] = ("model",)
    types: ClassVar[dict[str, tuple[type, ...]]] = {
        "model": (str,),
        "input": (str, list),
        "instructions": (str,),
        "stream": (bool,),
        "store": (bool,),
        "background": (bool,),
        "max_output_tokens": (int,),
        "max_tool_calls": (int,),
        "previous_response_id": (str,),
        "conversation": (str, dict),
        "metadata": (dict,),
        "tools": (list,),
        "tool_choice": (str, dict),
        "parallel_tool_calls": (bool,),
        "text": (dict,),
        "reasoning": (dict,),
        "truncation": (str,),
        "include": (list,),
        "user": (str,),
        "prompt": (dict,),
    }

    def prompt(self, body: dict[str, Any]) -> list[Any]:
        return [body[key] for key in self.prompt_keys if key in body]

    def conversation(self, body: dict[str, Any]) -> list[Any]:
        turns: list[Any] = []
        instructions = body.get("instructions")
        if instructions:
            turns.append({"role": "system", "content": instructions})
        given = body.get("input")
        if isinstance(given, str):
            turns.append({"role": "user", "content": given})
        elif isinstance(given, list):
            turns.extend(given[:10_000])
        return turns

    def cache_intent(self, body: dict[str, Any]) -> list[tuple[Any, bool | None]] | None:
        """``prompt_cache_key``, as chat's: the same key in either API names the same cache."""
        key = body.get("prompt_cache_key")
        return [({"prompt_cache_key": key}, False)] if isinstance(key, str) and key else None

    def last_question(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """``input`` as a string, or the last of its items when it is a user message of
        text only."""
        given = body.get("input")
        if isinstance(given, str):
            return given, {**body, "input": None}
        if not isinstance(given, list) or not given:
            return None
        last = given[-1]
        if not isinstance(last, dict) or last.get("role") != "user":
            return None
        if last.get("type", "message") != "message":
            return None
        text = plain_text(last.get("content"), ("input_text",))
        if text is None:
            return None
        asked = {k: v for k, v in last.items() if k != "content"}
        return text, {**body, "input": [*given[:-1], asked]}

    def text_turns(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        """``instructions`` as the system prompt, then ``input``: a string (one user turn) or
        a list of message items, each with a string ``content`` or a list of
        ``input_text``/``output_text`` parts. Reasoning items are passed over; any other item
        (a function call, its output, an image part...) is a 400."""
        turns: list[tuple[str, str]] = []
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            turns.append(("system", instructions))
        elif instructions is not None and not isinstance(instructions, str):
            raise self.invalid("instructions must be a string", "instructions", "invalid_type")
        given = body.get("input")
        if isinstance(given, str):
            turns.append(("user", given))
            return turns
        if not isinstance(given, list):
            raise self.invalid("input must be a string or a list of items", "input", "invalid_type")
        if not given:
            raise self.invalid("input must not be empty", "input", "empty_array")
        for i, item in enumerate(given):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise self.invalid(f"{where} must be an object", where, "invalid_type")
            kind = item.get("type", "message")
            if kind in _SILENT_ITEMS:
                continue
            if kind != "message":
                raise self.invalid(
                    f"{where}: the proxy's own answers read text only, not {kind!r} items",
                    where,
                    "unsupported_content",
                )
            named = item.get("role")
            role = _ROLES.get(named) if isinstance(named, str) else None
            if role is None:
                raise self.invalid(
                    f"{where}.role must be one of {', '.join(sorted(_ROLES))}",
                    f"{where}.role",
                    "invalid_value",
                )
            content = item.get("content")
            if not isinstance(content, (str, list)):
                raise self.invalid(
                    f"{where}.content must be a string or a list of text parts",
                    f"{where}.content",
                    "invalid_type",
                )
            turns.append(
                (role, text_parts(self, f"{where}.content", content, _TEXT_PARTS, "parts"))
            )
        return turns

    def stateful(self, body: dict[str, Any]) -> bool:
        """A stored response or conversation it refers to, a stored prompt template
        (``prompt``), items referred to by id (``item_reference``), or a background run
        (polled for later by its id)."""
        if self.state_refs(body) or body.get("background") is True or body.get("prompt"):
            return True
        given = body.get("input")
        return isinstance(given, list) and any(
            isinstance(item, dict) and item.get("type") == "item_reference"
            for item in given[:10_000]
        )

    def deterministic(self, body: dict[str, Any]) -> bool:
        return body.get("temperature") == 0

    def state_refs(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        refs: list[tuple[str, str]] = []
        previous = body.get("previous_response_id")
        if isinstance(previous, str) and previous:
            refs.append(("previous_response_id", previous))
        conversation = self.conversation_of(body)
        if conversation is not None:
            refs.append(("conversation", conversation))
        # Uploaded files in the input (an input_file's or an input_image's file_id), and the
        # vector stores file_search reads: the region holding them must answer too.
        given = body.get("input")
        if isinstance(given, list):
            for item in given[:_MAX_SCANNED]:
                parts = item.get("content") if isinstance(item, dict) else None
                if not isinstance(parts, list):
                    continue
                for part in parts[:_MAX_SCANNED]:
                    file_id = part.get("file_id") if isinstance(part, dict) else None
                    if isinstance(file_id, str) and file_id:
                        refs.append(("input", file_id))
        tools = body.get("tools")
        if isinstance(tools, list):
            for tool in tools[:_MAX_SCANNED]:
                stores = tool.get("vector_store_ids") if isinstance(tool, dict) else None
                if isinstance(stores, list):
                    refs.extend(("tools", s) for s in stores[:_MAX_SCANNED] if isinstance(s, str))
        return refs

    def stores(self, body: dict[str, Any]) -> bool:
        return body.get("store") is not False or bool(body.get("conversation"))

    def include_usage(self, body: dict[str, Any]) -> bool:
        return True  # the response at its end always carries it

    def continuable(self, body: dict[str, Any]) -> bool:
        """Only a deterministic request that neither stores nor refers to state: the same
        request again gives the same answer, and creates no second stored response."""
        return self.deterministic(body) and self.stateless(body)

    def created_in(self, event: SSEEvent) -> str | None:
        # The stream's first event, before any token: the stored response's id. Its type is
        # in its data too (some servers send no event line).
        if event.event not in ("response.created", None):
            return None
        obj = loads(event.data)
        if not isinstance(obj, dict) or obj.get("type", event.event) != "response.created":
            return None
        response = obj.get("response")
        return self.created_id(response) if isinstance(response, dict) else None

    def ref_not_found(self, field: str, object_id: str) -> ProxyError:
        if field == "previous_response_id":
            return ProxyError(
                404,
                "invalid_request_error",
                f"Previous response with id '{object_id}' not found.",
                code="previous_response_not_found",
                param=field,
            )
        if field == "conversation":
            # OpenAI names neither the field nor a code here.
            return CONVERSATIONS.not_found(object_id)
        if field == "input":
            return FILES.not_found(object_id)
        if field == "tools":
            return VECTOR_STORES.not_found(object_id)
        return super().ref_not_found(field, object_id)

    def requires(self, body: dict[str, Any]) -> tuple[str, ...]:
        # A stored prompt (``prompt``) may name the model.
        return () if body.get("prompt") is not None else self.required

    def needs_turns(self, body: dict[str, Any]) -> bool:
        # A follow-up of a stored response or conversation, or a stored prompt, has a
        # conversation already: its input may be left out, or empty.
        return not (
            body.get("previous_response_id") or body.get("conversation") or body.get("prompt")
        )

    def check(self, body: dict[str, Any]) -> ProxyError | None:
        err = super().check(body)
        if err is not None:
            return err
        if body.get("input") is None and self.needs_turns(body):
            return self.invalid(
                "Missing required parameter: 'input'.", "input", "missing_required_parameter"
            )
        conversation = body.get("conversation")
        if isinstance(conversation, dict) and not isinstance(conversation.get("id"), str):
            return self.invalid(
                "Invalid type for 'conversation.id': expected a string.",
                "conversation",
                "invalid_type",
            )
        return None

    # -- streams -----------------------------------------------------------------------------

    def commits(self, event: SSEEvent) -> bool:
        name = event.event
        if event.comment:
            return False  # a keep-alive comment is no content
        if name is None:
            # No event line: the type is in the data (some servers send it only there).
            obj = loads(event.data)
            name = obj.get("type") if isinstance(obj, dict) else None
            if not isinstance(name, str):
                return True
        return (
            name.endswith(".delta")
            or name == "response.output_item.done"
            or name in _ENDS
            or name == "error"
        )

    def counted(self, usage: dict[str, Any]) -> dict[str, Any]:
        # input_tokens includes the cached ones (input_tokens_details.cached_tokens).
        if "prompt_tokens" in usage:
            return usage
        out = counted_io(usage, tokens(usage.get("input_tokens")))
        details = usage.get("input_tokens_details")
        if isinstance(details, dict):
            out["cached_tokens"] = tokens(details.get("cached_tokens"))
        return out

    def is_end(self, event: SSEEvent) -> bool:
        return event.event in _ENDS

    def is_error(self, event: SSEEvent) -> bool:
        return event.event in ("error", "response.failed")

    # -- what the proxy writes ---------------------------------------------------------------

    def error_event(self, err: ProxyError, *, sequence: int = 0) -> bytes:
        """The Responses API's ``error`` event, with OpenAI's ``error`` object beside its
        fields: the openai SDK raises ``APIError`` on it."""
        code = err.code or err.type
        data = {
            "type": "error",
            "code": code,
            "message": err.message,
            "param": err.param,
            "sequence_number": sequence,
            "error": {"type": err.type, "code": code, "message": err.message, "param": err.param},
        }
        return named_event("error", data)

    def answer_id(self) -> str:
        return response_id()

    def own_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return responses_usage(usage) or {}

    def response_object(
        self, text: AnswerText, status: str, output: list[Any], usage: Any
    ) -> dict[str, Any]:
        return response_object(text, status, output, usage)

    def answer(self, text: AnswerText) -> dict[str, Any]:
        reason = INCOMPLETE.get(text.finish or "")
        status = "incomplete" if reason else "completed"
        out = response_object(text, status, output_items(text), text.usage)
        if reason:
            out["incomplete_details"] = {"reason": reason}
        return out

    def text_of(self, answer: dict[str, Any]) -> AnswerText | None:
        if answer.get("object") != "response" or answer.get("status") not in (
            "completed",
            "incomplete",
        ):
            return None
        output = answer.get("output")
        if not isinstance(output, list) or len(output) != 1:
            return None
        item = output[0]
        if not isinstance(item, dict) or item.get("type") != "message":
            return None
        parts = item.get("content")
        if not isinstance(parts, list):
            return None
        text = []
        for part in parts:
            if not isinstance(part, dict) or part.get("type") != "output_text":
                return None
            if not isinstance(part.get("text"), str):
                return None
            text.append(part["text"])
        details = answer.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        finish = "length" if reason == "max_output_tokens" else "stop"
        usage = answer.get("usage")
        item_id = item.get("id")
        return ResponseText(
            str(answer.get("id") or response_id()),
            str(answer.get("model") or ""),
            created if isinstance(created := answer.get("created_at"), int) else 0,
            "".join(text),
            finish,
            usage if isinstance(usage, dict) else None,
            response=answer,
            item_id=item_id if isinstance(item_id, str) and item_id else None,
        )

    # -- chains held at the edge -----------------------------------------------------

    def own_items(self, body: dict[str, Any]) -> list[Any]:
        """The request's own ``input`` as a list of items (a string is one user message)."""
        given = body.get("input")
        if isinstance(given, str):
            return [{"type": "message", "role": "user", "content": given}]
        return list(given) if isinstance(given, list) else []

    def conversation_of(self, body: dict[str, Any]) -> str | None:
        """The conversation a request goes on with (``conversation``: an id, or
        ``{"id": ...}``)."""
        conversation = body.get("conversation")
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
        return conversation if isinstance(conversation, str) and conversation else None

    def turn_items(self, turns: list[tuple[list[Any], dict[str, Any]]]) -> list[Any]:
        """A chain's turns as input items: each its input items, then its response's output
        items, as the region returned them (reasoning and other opaque items included)."""
        items: list[Any] = []
        for own, response in turns:
            items.extend(own)
            output = response.get("output")
            if isinstance(output, list):
                items.extend(output)
        return items

    def with_items(self, body: dict[str, Any], items: list[Any]) -> dict[str, Any]:
        """``body`` without the state it refers to (``previous_response_id``,
        ``conversation``): ``items`` (that state's, as the edge holds it) before its own
        input, as the API reads them."""
        out = {k: v for k, v in body.items() if k != "previous_response_id" and k != "conversation"}
        out["input"] = [*items, *self.own_items(body)]
        return out

    def expanded(
        self, body: dict[str, Any], turns: list[tuple[list[Any], dict[str, Any]]]
    ) -> dict[str, Any]:
        """``body`` with its chain's turns (:meth:`turn_items`) before its own input, and
        no ``previous_response_id``."""
        return self.with_items(body, self.turn_items(turns))

    def listed_items(self, response_id: str, items: list[Any]) -> list[dict[str, Any]]:
        """A held response's input items as ``GET .../input_items`` lists them: each with an
        id (its own, else one derived from the response's) and a message's text as
        ``input_text`` parts."""
        listed: list[dict[str, Any]] = []
        for index, item in enumerate(items):
            if not isinstance(item, dict):
                continue
            out = dict(item)
            out.setdefault("type", "message")
            if not isinstance(out.get("id"), str):
                out["id"] = f"msg_{response_id.removeprefix('resp_')}_{index}"
            if out["type"] == "message":
                content = out.get("content")
                if isinstance(content, str):
                    out["content"] = [{"type": "input_text", "text": content}]
                out.setdefault("status", "completed")
            listed.append(out)
        return listed

    def forgot(self, status: int, answer: bytes) -> bool:
        """Whether a region's error answer says it cannot continue from a
        ``previous_response_id`` or a ``conversation``: it holds no such response or
        conversation (404), or it keeps none at all (llama-server's 400)."""
        if status not in (400, 404):
            return False
        error = loads(answer)
        detail = error.get("error") if isinstance(error, dict) else None
        if not isinstance(detail, dict):
            return False
        if detail.get("code") == "previous_response_not_found":
            return True
        message = detail.get("message")
        if not isinstance(message, str):
            return False
        # llama-server's 400, or a conversation's 404 (OpenAI names no code for it).
        return "previous_response_id" in message or (
            status == 404 and message.startswith("Conversation with id")
        )

    def assemble(self, events: list[SSEEvent]) -> dict[str, Any] | None:
        for event in reversed(events):
            if event.event in ("response.completed", "response.incomplete"):
                obj = loads(event.data)
                response = obj.get("response") if isinstance(obj, dict) else None
                return response if isinstance(response, dict) else None
        return None


RESPONSES: Final = ResponsesDialect()
