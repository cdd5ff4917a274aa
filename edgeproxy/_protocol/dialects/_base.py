"""What every dialect does, and what each may change: the base class of the five APIs.

A dialect is one API's wire semantics, and nothing else: how its requests name the
model, ask for a stream and bound their answer; what of them is the prompt; which
stored objects they refer to; which fields any server would refuse; how its streams
show their first content, their usage, their end and their errors; and how the proxy
writes in it (an error body, the error that ends a broken stream, a heartbeat, an
answer of its own, streamed or not). Stages ask the request's dialect, fixed at entry
in its facts (:func:`edgeproxy._protocol.dialects.dialect_named`), instead of knowing
any API themselves.

The base class speaks OpenAI's conventions, which chat, completions and embeddings
share; Responses and Messages override what differs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, NamedTuple

import orjson

from edgeproxy._core.errors import ProxyError, error_body
from edgeproxy._protocol.sse import SSEEvent, events_of

__all__ = [
    "HEARTBEAT",
    "REGION_METHOD",
    "AnswerText",
    "Dialect",
    "Piece",
    "Seam",
    "StreamWriter",
    "ToolCall",
    "asks_usage",
    "named_event",
    "counted_io",
    "number",
    "plain_text",
    "text_parts",
    "positive_int",
    "tokens",
    "words",
]

HEARTBEAT: Final = b": waiting\n\n"
"""An SSE comment: nothing for a client, a sign of life for every proxy on the way."""

REGION_METHOD: Final = "region"
"""A dialect's :attr:`Dialect.continuation` when each region's own method applies
(``[[regions]] continuation``): chat's."""

# A request's message list is read this far, for the estimate and the prefix.
_MAX_ITEMS: Final = 10_000

# Chat's roles, as chat templates know them ("developer" is OpenAI's new name for "system").
_CHAT_ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def number(value: Any) -> bool:
    """A JSON number (a bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def named_event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with an ``event:`` name and a JSON ``data:`` line, as the
    Responses API and Messages write every event."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def asks_usage(body: dict[str, Any]) -> bool:
    """``stream_options.include_usage``: an OpenAI stream is to end with its usage."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def tokens(value: Any) -> int:
    """A token count as sent, or 0 for anything that is not one."""
    return value if positive_int(value) else 0


_WORDS: Final = re.compile(r"\s*\S+|\s+")


def words(text: str) -> list[str]:
    """Word-sized pieces of ``text`` that join back into it exactly (none for ``""``): how
    an answer said at once is streamed again."""
    return _WORDS.findall(text)


def counted_io(usage: dict[str, Any], prompt: int) -> dict[str, Any]:
    """``usage`` of an API that counts ``input_tokens`` and ``output_tokens``, with chat's
    fields added; ``prompt`` is the whole prompt's tokens."""
    completion = tokens(usage.get("output_tokens"))
    return {
        **usage,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class ToolCall(NamedTuple):
    """A function the answer calls, as chat completions name it: the call's id, the
    function's name and its arguments (a JSON text)."""

    id: str
    name: str
    arguments: str


class AnswerText:
    """An answer the proxy writes itself (the cache's replay, the local model's, a region's
    translated from chat completions), in any API: its id, model, creation time, text, the
    functions it calls, why it ended and its usage (chat's fields), and the client's stop
    sequence that ended it, if one did (for an API that says which: Messages; a stream's
    writer reads it when it closes)."""

    __slots__ = ("id", "model", "created", "text", "finish", "usage", "stop_sequence", "calls")

    def __init__(
        self,
        id: str,
        model: str,
        created: int,
        text: str = "",
        finish: str | None = "stop",
        usage: dict[str, Any] | None = None,
        stop_sequence: str | None = None,
        calls: tuple[ToolCall, ...] = (),
    ) -> None:
        self.id = id
        self.model = model
        self.created = created
        self.text = text
        self.finish = finish  # chat's names: "stop", "length", "tool_calls"...
        self.usage = usage
        self.stop_sequence = stop_sequence
        self.calls = calls


class StreamWriter:
    """Writes one streamed answer of a dialect, piece by piece: :meth:`open`, any number of
    :meth:`piece` and :meth:`tool`, then :meth:`close` (the events of each, as bytes). The
    base writes nothing; each streaming dialect has its own.

    ``text_first``: the stream opens its text at once (the proxy's own answers, which are
    text); False opens a text block or item with the first text, as a region's answer
    translated from chat completions may start with a tool call instead. ``usage`` of the
    answer, when given, is the prompt's as known when the stream opens; None: it is known
    only at the end, and :meth:`close` says it."""

    def __init__(
        self, answer: AnswerText, *, include_usage: bool = False, text_first: bool = True
    ) -> None:
        self.answer = answer
        self.include_usage = include_usage
        self.text_first = text_first
        self.text: list[str] = []

    def open(self) -> bytes:
        return b""

    def piece(self, text: str) -> bytes:
        self.text.append(text)
        return b""

    def tool(self, index: int, call_id: str | None, name: str | None, arguments: str) -> bytes:
        """A piece of the function call ``index`` (chat's ``tool_calls`` index): its id and
        name with its first piece, then its arguments as they come."""
        return b""

    def close(self, finish: str | None, usage: dict[str, Any] | None) -> bytes:
        return b""


@dataclass(slots=True, eq=False)
class Piece:
    """What one event of a stream being continued carries, as its dialect's :class:`Seam`
    reads it. ``kind`` says what the splice does with a later leg's event:

    * ``drop``: nothing reaches the client (a new leg's opening events, pings, a usage
      chunk whose counts are summed at the end);
    * ``text``: a text delta, its :attr:`text` going through the seam (a reissue's repeat
      skipped, a repeated overlap trimmed), then written by :meth:`Seam.write`;
    * ``pass``: an event the client gets rewritten into its stream (:meth:`Seam.write`),
      once the seam before it is settled;
    * ``raw``: relayed as it came (an error event), once the seam is settled;
    * ``hold``: the answer's end (a finish, a stop, the final usage), kept by the seam
      and written once the last leg ended (:meth:`Seam.close`).

    The first leg's events reach the client as they came: only :attr:`text`,
    :attr:`other` and :attr:`finish` count there.
    """

    kind: str = "drop"
    obj: Any = None
    """The event's data, parsed (a later leg's, for :meth:`Seam.write`)."""
    text: str = field(default="", kw_only=True)
    """The answer text the event adds."""
    other: bool = field(default=False, kw_only=True)
    """Content that cannot be continued: a tool call, thinking, another output item."""
    finish: bool = field(default=False, kw_only=True)
    """The answer ended with it (a finish reason, a stop reason, the response done)."""
    usage: dict[str, Any] | None = field(default=None, kw_only=True)
    """The usage it reports, in the API's shape."""


class Seam:
    """One API's view of a streamed answer being continued across legs: what the client's
    first leg said (its ids, its text block or item), and how each later leg's events are
    written into the client's stream. One per continued stream; the stage's splice holds
    the mechanics (framing, the seam's overlap, a reissue's skip, the legs' usage) and asks
    this for what each event means. The base continues nothing (it reads no event)."""

    sequence: int = 0
    """The next sequence number of the client's stream, for an API that numbers its events
    (the error that ends a broken one)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def first(self, event: SSEEvent) -> Piece:
        """The first leg's ``event``, sent to the client as it came: what it carries."""
        return Piece()

    def start_leg(self) -> None:
        """A new leg takes over (what the last held of its own is forgotten)."""

    def later(self, event: SSEEvent) -> Piece:
        """A later leg's ``event``: what it carries and what becomes of it."""
        return Piece()

    def write(self, piece: Piece, text: str) -> bytes:
        """A later leg's ``piece`` as the client gets it; ``text``: the whole answer's text
        so far, this piece's included."""
        return b""

    def close(self, usage: dict[str, Any] | None, text: str) -> bytes:
        """The held end of the last leg, written once it ended cleanly: ``usage`` is the
        legs' sum in chat's fields (None if the last leg reported none), ``text`` the
        whole answer's."""
        return b""


class Dialect:
    """One API's wire semantics. Instances are stateless singletons, one per API."""

    name: ClassVar[str] = ""
    """The endpoint table's name for the API (``chat.completions``...), as in request facts."""
    anthropic: ClassVar[bool] = False
    """Its clients read errors in Anthropic's shape."""
    streams: ClassVar[bool] = True
    """Its answers may be streamed (embeddings' never are)."""
    max_tokens_keys: ClassVar[tuple[str, ...]] = ("max_tokens",)
    """The fields that bound the answer's tokens, the first present winning."""
    prompt_keys: ClassVar[tuple[str, ...]] = ()
    """The body fields that hold the prompt, besides ``messages``."""
    continuation: ClassVar[str | None] = None
    """How a broken stream of it goes on elsewhere: a ``[[regions]] continuation`` method
    name, :data:`REGION_METHOD` when each region's own method applies, or None: it is not
    continued."""
    seam: ClassVar[type[Seam]] = Seam
    """What reads and rewrites its streams' events across a continuation's legs."""
    heartbeat: ClassVar[bytes] = HEARTBEAT
    """What a stream waiting for its first token is sent, again and again."""
    writer: ClassVar[type[StreamWriter]] = StreamWriter
    unstreamable_as_json: ClassVar[bool] = True
    """A JSON answer that :meth:`stream_of` cannot write as a stream is sent as it is to a
    client that asked for a stream (embeddings and other objects of OpenAI-style servers);
    False: the cache asks a region instead, since the API's clients read nothing else."""

    keeps_state: ClassVar[bool] = False
    """Its requests may refer to objects a server stores, or ask it to store one
    (:meth:`state_refs`, :meth:`stores`)."""

    # -- requests ----------------------------------------------------------------------------

    def model(self, body: dict[str, Any]) -> str | None:
        model = body.get("model")
        return model if isinstance(model, str) and model else None

    def stream(self, body: dict[str, Any]) -> bool:
        return body.get("stream") is True

    def max_tokens(self, body: dict[str, Any]) -> int | None:
        for key in self.max_tokens_keys:
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
        return None

    def prompt(self, body: dict[str, Any]) -> list[Any]:
        """The values that hold the prompt's text, in order (for the token estimate and the
        prefix the affinity router hashes): the system prompt first, then the turns."""
        out: list[Any] = [body[key] for key in self.prompt_keys if key in body]
        messages = body.get("messages")
        if isinstance(messages, list):
            out.extend(messages[:_MAX_ITEMS])
        return out

    def conversation(self, body: dict[str, Any]) -> list[Any]:
        """The request's turns as chat messages (``{"role", "content"}``), the system prompt
        first: what the affinity router keys a conversation's KV cache on. Empty for an
        API without turns."""
        messages = body.get("messages")
        return messages[:_MAX_ITEMS] if isinstance(messages, list) else []

    def cache_intent(self, body: dict[str, Any]) -> list[tuple[Any, bool | None]] | None:
        """What the client asks the provider to cache, for prompt-cache affinity: blocks in
        the provider's cache order up to the last one marked, each with its mark (None: none;
        True: the extended TTL; False: the default). None: the request states no intent."""
        return None

    def text_turns(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        """The whole conversation as ``(role, text)`` turns, the system prompt first, for a
        reader of text only (the local model): roles as chat templates know them
        (``system``, ``user``, ``assistant``; chat's ``tool`` and ``function`` kept), the
        text parts of a turn joined by newlines.

        Raises the API's 400 naming the field for a conversation that is not one, or that
        holds anything but text (images, tool calls...). Chat's: ``messages``."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise self.invalid("messages must be a list of messages", "messages", "invalid_type")
        if not messages:
            raise self.invalid("messages must not be empty", "messages", "empty_messages")
        turns: list[tuple[str, str]] = []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict):
                raise self.invalid(f"{where} must be an object", where, "invalid_type")
            role = message.get("role")
            if role not in _CHAT_ROLES:
                raise self.invalid(
                    f"{where}.role must be one of {', '.join(sorted(_CHAT_ROLES))}",
                    f"{where}.role",
                    "invalid_value",
                )
            content = message.get("content")
            if content is None:
                text = ""
            elif isinstance(content, (str, list)):
                text = text_parts(self, f"{where}.content", content, ("text",), "parts")
            else:
                raise self.invalid(
                    f"{where}.content must be a string or a list of text parts",
                    f"{where}.content",
                    "invalid_type",
                )
            turns.append(("system" if role == "developer" else str(role), text))
        return turns

    def last_question(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """The text of the request's last turn when it is the user's and text only, and the
        body with that text taken out: what a semantic cache compares by meaning, and what
        must be equal, to the byte, for a hit (system prompt, earlier turns, model,
        sampling, tools). None when the last turn is anything else. Chat's and Messages':
        the last of ``messages``."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        last = messages[-1]
        if not isinstance(last, dict) or last.get("role") != "user":
            return None
        text = plain_text(last.get("content"), ("text",))
        if text is None:
            return None
        asked = {k: v for k, v in last.items() if k != "content"}
        return text, {**body, "messages": [*messages[:-1], asked]}

    def stateful(self, body: dict[str, Any]) -> bool:
        """Whether only a server that keeps the API's state can answer the request (it refers
        to stored objects, or asks for work it will be asked about later): never one that
        answers it from the request alone, as the local model does."""
        return bool(self.state_refs(body))

    def deterministic(self, body: dict[str, Any]) -> bool:
        """Whether the same request gets the same answer: greedy sampling, or a seed."""
        return body.get("temperature") == 0 or body.get("seed") is not None

    def state_refs(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        """The stored objects the request refers to, as ``(field, id)``: none by default."""
        return []

    def stores(self, body: dict[str, Any]) -> bool:
        """Whether the region is asked to store what it answers (a new owned object)."""
        return False

    def stateless(self, body: dict[str, Any]) -> bool:
        """Whether the answer neither is stored by the region nor depends on anything stored:
        then another client may be given it again."""
        return not self.stores(body) and not self.stateful(body)

    def cacheable(self, body: dict[str, Any]) -> bool:
        """Whether the answer may be kept and given to the same request again: the request
        is deterministic and stateless."""
        return self.deterministic(body) and self.stateless(body)

    def include_usage(self, body: dict[str, Any]) -> bool:
        """Whether a streamed answer is to end with its usage: OpenAI's streams carry it only
        when ``stream_options.include_usage`` asks (in a chunk of its own)."""
        return asks_usage(body)

    def created_id(self, answer: dict[str, Any]) -> str | None:
        """The id of the object a JSON answer is, for a request that created or stored one
        (OpenAI's objects all carry theirs as ``id``)."""
        object_id = answer.get("id")
        return object_id if isinstance(object_id, str) and object_id else None

    def created_in(self, event: SSEEvent) -> str | None:
        """The id of the stored object a stream's ``event`` announces, if it does: none
        by default (the Responses API's ``response.created`` does)."""
        return None

    def ref_not_found(self, field: str, object_id: str) -> ProxyError:
        """The API's own 404 for a request whose ``field`` (one :meth:`state_refs` named)
        refers to ``object_id``, which no server holds."""
        return ProxyError(
            404,
            "invalid_request_error",
            f"No object found with id '{object_id}'.",
            param=field,
        )

    required: ClassVar[tuple[str, ...]] = ("model",)
    """Fields a request must have."""
    turns: ClassVar[str | None] = "messages"
    """The field that holds the conversation: a list that must not be empty."""
    ranges: ClassVar[dict[str, tuple[float, float]]] = {"temperature": (0, 2), "top_p": (0, 1)}
    """Numbers and the range any server accepts them in."""
    minimums: ClassVar[dict[str, int]] = {}
    """Integers and the least value any server accepts (besides the token bounds)."""
    min_tokens: ClassVar[int] = 1
    """The least value of a token bound (``max_tokens_keys``)."""
    types: ClassVar[dict[str, tuple[type, ...]]] = {
        "model": (str,),
        "stream": (bool,),
        "messages": (list,),
        "max_tokens": (int,),
        "n": (int,),
        "seed": (int,),
        "stop": (str, list),
        "user": (str,),
        "metadata": (dict,),
        "tools": (list,),
    }
    """The JSON types a field may have (None is always allowed, as "not given"). JSON has
    one kind of number: an integer may be written ``5.0``, as some encoders do."""

    def requires(self, body: dict[str, Any]) -> tuple[str, ...]:
        """The fields this request must have: :attr:`required`, unless something else in
        it stands for them."""
        return self.required

    def needs_turns(self, body: dict[str, Any]) -> bool:
        """Whether this request must bring its conversation in :attr:`turns` (not empty)."""
        return True

    def check(self, body: dict[str, Any]) -> ProxyError | None:
        """The first field any server of the API would refuse, as its 400; None if none.

        Only what every server refuses: a field of the wrong JSON type, a missing model, an
        empty conversation, a sampling parameter out of its range, a token bound below its
        least. What a server may accept (an unknown field, a model it serves, the shape of
        a message) is left to it.
        """
        for key in self.requires(body):
            if body.get(key) is None:
                return self.invalid(
                    f"Missing required parameter: '{key}'.", key, "missing_required_parameter"
                )
        # One pass over the fields the body has (a few), not over every rule (dozens); a
        # field of a plain type and nothing more to check is passed at once.
        rules = _RULES.get(type(self))
        if rules is None:
            rules = _RULES[type(self)] = self._rules()
        for key, value in body.items():
            rule = rules.get(key)
            if rule is None or value is None:
                continue
            kinds, bounds, least, plain = rule
            if type(value) in plain:
                if least is None or (type(value) is int and value >= least):
                    continue
            err = self._field(key, value, (kinds, bounds, least))
            if err is not None:
                return err
        if body.get("model") == "":
            return self.invalid("'model' must not be empty.", "model", "invalid_value")
        turns = self.turns
        if turns is not None:
            value = body.get(turns)
            if value is not None and not value and self.needs_turns(body):
                return self.invalid(
                    f"'{turns}' must not be empty: send at least one.", turns, "empty_array"
                )
        return None

    def _rules(self) -> dict[str, _Rules]:
        """Each checked field's JSON types, range and least value, in one table."""
        rules: dict[str, _Rules] = {}
        least = {**dict.fromkeys(self.max_tokens_keys, self.min_tokens), **self.minimums}
        for key in {*self.types, *self.ranges, *least}:
            kinds = self.types.get(key)
            if key in least and kinds is None:
                kinds = (int,)
            bounds = self.ranges.get(key)
            # The types that need no closer look: any of the field's, unless it has a range.
            plain = frozenset(kinds) if kinds is not None and bounds is None else frozenset()
            rules[key] = (kinds, bounds, least.get(key), plain)
        return rules

    def _field(self, key: str, value: Any, rule: _Rule) -> ProxyError | None:
        kinds, bounds, least = rule
        if kinds is not None and type(value) not in kinds and not _of_kind(value, kinds):
            return self.invalid(
                f"Invalid type for '{key}': expected {_kinds(kinds)}, but got {_kind(value)}.",
                key,
                "invalid_type",
            )
        if bounds is not None:
            if not number(value):
                return self.invalid(
                    f"Invalid type for '{key}': expected a number, but got {_kind(value)}.",
                    key,
                    "invalid_type",
                )
            low, high = bounds
            if not low <= value <= high:
                return self.invalid(
                    f"'{key}' must be between {low:g} and {high:g}; got {value!r}.",
                    key,
                    "invalid_value",
                )
        if least is not None and not (type(value) is int and value >= least):
            return self._at_least({key: value}, key, least)
        return None

    def _at_least(self, body: dict[str, Any], key: str, least: int) -> ProxyError | None:
        value = body.get(key)
        if value is None:
            return None
        if not _of_kind(value, (int,)):
            return self.invalid(
                f"Invalid type for '{key}': expected an integer, but got {_kind(value)}.",
                key,
                "invalid_type",
            )
        if value < least:
            return self.invalid(
                f"'{key}' must be at least {least}; got {value:g}.", key, "invalid_value"
            )
        return None

    def invalid(self, message: str, param: str, code: str) -> ProxyError:
        """A 400 about the field ``param``, in the API's error shape."""
        return ProxyError(400, "invalid_request_error", message, code=code, param=param)

    # -- streams -----------------------------------------------------------------------------

    def commits(self, event: SSEEvent) -> bool:
        """Whether ``event`` commits its stream to its region: its first content, its end,
        or an error. Before one came, a failed region is failed over as if it sent nothing.
        OpenAI-style streams' first event is already content."""
        return True

    usage_inside: ClassVar[str | None] = None
    """The member of a stream's events whose object carries the usage, when the event itself
    does not (the Responses API's ``response``, Messages' ``message``)."""

    def usage_of(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The ``usage`` an event or a JSON answer of this API carries, as sent."""
        usage = obj.get("usage")
        if isinstance(usage, dict):
            return usage
        inside = self.usage_inside
        holder = obj.get(inside) if inside is not None else None
        usage = holder.get("usage") if isinstance(holder, dict) else None
        return usage if isinstance(usage, dict) else None

    def counted(self, usage: dict[str, Any]) -> dict[str, Any]:
        """``usage`` with chat's fields (``prompt_tokens``, ``completion_tokens``,
        ``total_tokens``, and ``cached_tokens`` of the prompt's read from a cache), which
        every reader of usage counts; the API's own kept beside."""
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and "cached_tokens" not in usage:
            return {**usage, "cached_tokens": tokens(details.get("cached_tokens"))}
        return usage

    def merge_usage(self, old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
        """The usage after a stream's later event carried ``new``: it replaces the earlier."""
        return dict(new)

    def is_end(self, event: SSEEvent) -> bool:
        return event.data == b"[DONE]"

    def usage_only(self, event: SSEEvent) -> bool:
        """Whether ``event`` carries nothing but the usage a client asks for apart
        (:meth:`include_usage`): OpenAI's last chunk, with no choices. A replay of a recorded
        stream leaves it out for a client that did not ask."""
        data = event.data
        if data.find(b'"usage"') < 0:
            return False
        obj = loads(data)
        return isinstance(obj, dict) and obj.get("choices") == [] and bool(obj.get("usage"))

    def is_error(self, event: SSEEvent) -> bool:
        return event.event == "error" or event.data.startswith(b'{"error"')

    # -- continuation ------------------------------------------------------------------------

    def continuable(self, body: dict[str, Any]) -> bool:
        """Whether a streamed answer to ``body`` may be continued elsewhere if it breaks: a
        request of an API that continues, whose answer another leg can go on with."""
        return self.continuation is not None and self.streams

    def continued_by(self, configured: str, method: str) -> str | None:
        """How a region continues a stream of this API, given its ``[[regions]]
        continuation`` as ``configured`` and as ``method`` (``auto`` resolved from its
        server); None: it does not. The region's method where the API takes it, else the
        API's own, on any region that is not set to ``off``."""
        own = self.continuation
        if own is None or configured == "off":
            return None
        if own == REGION_METHOD:
            return None if method == "off" else method
        return own

    def prefilled(self, text: str) -> str:
        """``text`` (a partial answer) as a final assistant message of the API carries it."""
        return text

    def continuation_body(self, body: dict[str, Any], text: str, method: str) -> dict[str, Any]:
        """The request a leg continuing the partial answer ``text`` by ``method`` sends
        (a copy; the token bound is the caller's): the original request again for a
        reissue."""
        return dict(body)

    # -- what the proxy writes ---------------------------------------------------------------

    def error_body(self, err: ProxyError) -> bytes:
        """``err`` as this API's JSON error body."""
        return error_body(err.type, err.message, code=err.code, param=err.param)

    def error_event(self, err: ProxyError, *, sequence: int = 0) -> bytes:
        """The event that ends a broken stream with ``err``, which the API's SDK raises as
        its own error (OpenAI's raises ``APIError`` for an ``error`` key)."""
        return b"event: error\ndata: " + self.error_body(err) + b"\n\n"

    def answer_id(self) -> str:
        """A fresh id for an answer the proxy writes in the API (``chatcmpl-...``)."""
        raise NotImplementedError(f"the proxy writes no answers of {self.name}")

    def own_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Chat's ``usage`` (``prompt_tokens``, ``completion_tokens``) in the API's own shape,
        as its answers carry it: what :meth:`counted` reads back."""
        return usage

    def answer(self, text: AnswerText) -> dict[str, Any]:
        """A whole JSON answer of the API that says ``text``."""
        raise NotImplementedError(f"the proxy writes no answers of {self.name}")

    def text_of(self, answer: dict[str, Any]) -> AnswerText | None:
        """What a JSON answer of the API says, for a replay in pieces; None if the proxy
        cannot say it again faithfully (tool calls, several choices, another object)."""
        return None

    def assemble(self, events: list[SSEEvent]) -> dict[str, Any] | None:
        """The JSON answer a whole recorded stream amounts to; None if it is not whole or
        not understood."""
        return None

    def stream_of(
        self, answer: dict[str, Any], *, include_usage: bool = False
    ) -> list[bytes] | None:
        """A whole JSON answer as the stream that would have carried it, its text a word at a
        time (what :meth:`text_of` reads, written by :attr:`writer`); None if it cannot be."""
        text = self.text_of(answer) if self.streams else None
        return self.written(text, include_usage=include_usage) if text is not None else None

    def written(self, text: AnswerText, *, include_usage: bool = False) -> list[bytes]:
        """``text`` as its :attr:`writer` streams it, a word at a time, then its calls: its
        events, one each, in order."""
        writer = self.writer(text, include_usage=include_usage)
        writer.text_first = not text.calls
        steps = [writer.open()]
        steps.extend(writer.piece(word) for word in words(text.text))
        steps.extend(writer.tool(i, *call) for i, call in enumerate(text.calls))
        steps.append(writer.close(text.finish, text.usage))
        return [event.raw for event in events_of(b"".join(steps))]


def plain_text(content: Any, kinds: tuple[str, ...]) -> str | None:
    """A turn's text when it holds nothing else: a string, or text parts of the types
    ``kinds`` joined by newlines; None for anything else (an image, a tool result)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in kinds:
            return None
        text = part.get("text")
        if not isinstance(text, str):
            return None
        texts.append(text)
    return "\n".join(texts)


def text_parts(
    dialect: Dialect, where: str, content: str | list[Any], kinds: tuple[str, ...], noun: str
) -> str:
    """The text of a turn's ``content``: a string, or a list of parts (``noun``: ``parts``,
    ``blocks``) of the types ``kinds``, each with a string ``text``, joined by newlines.
    Raises the API's 400 for any other part: the proxy's own answers read text only."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise dialect.invalid(
                f"{where}: the proxy's own answers read text only, not {kind!r} {noun}",
                f"{where}[{j}]",
                "unsupported_content",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise dialect.invalid(
                f"{where}: a text part needs a string 'text'", f"{where}[{j}].text", "invalid_type"
            )
        texts.append(text)
    return "\n".join(texts)


# A field's rule: its JSON types, its range, its least value (each None: not checked).
_Rule = tuple[tuple[type, ...] | None, tuple[float, float] | None, int | None]
# With the set of types that need no closer look.
_Rules = tuple[tuple[type, ...] | None, tuple[float, float] | None, int | None, frozenset[type]]
_RULES: dict[type, dict[str, _Rules]] = {}


def _of_kind(value: Any, kinds: tuple[type, ...]) -> bool:
    """Whether ``value`` has one of the JSON types ``kinds`` (a bool is no number; an
    integral float is an integer)."""
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, kinds):
        return True
    return int in kinds and isinstance(value, float) and value.is_integer()


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return "an object"


_KIND_NAMES: Final = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    list: "an array",
    dict: "an object",
}


def _kinds(kinds: tuple[type, ...]) -> str:
    return " or ".join(_KIND_NAMES[kind] for kind in kinds)


def loads(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
