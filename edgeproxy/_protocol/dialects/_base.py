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

from typing import Any, ClassVar, Final

import orjson

from edgeproxy._core.errors import ProxyError, error_body
from edgeproxy._protocol.sse import SSEEvent

__all__ = [
    "HEARTBEAT",
    "AnswerText",
    "Dialect",
    "StreamWriter",
    "counted_io",
    "number",
    "positive_int",
    "tokens",
]

HEARTBEAT: Final = b": waiting\n\n"
"""An SSE comment: nothing for a client, a sign of life for every proxy on the way."""

# A request's message list is read this far, for the estimate and the prefix.
_MAX_ITEMS: Final = 10_000


def number(value: Any) -> bool:
    """A JSON number (a bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def tokens(value: Any) -> int:
    """A token count as sent, or 0 for anything that is not one."""
    return value if positive_int(value) else 0


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


class AnswerText:
    """An answer the proxy writes itself (the cache's replay, the local model's), in any API:
    its id, model, creation time, text, why it ended and its usage (chat's fields)."""

    __slots__ = ("id", "model", "created", "text", "finish", "usage")

    def __init__(
        self,
        id: str,
        model: str,
        created: int,
        text: str = "",
        finish: str | None = "stop",
        usage: dict[str, Any] | None = None,
    ) -> None:
        self.id = id
        self.model = model
        self.created = created
        self.text = text
        self.finish = finish  # chat's names: "stop", "length", "tool_calls"...
        self.usage = usage


class StreamWriter:
    """Writes one streamed answer of a dialect, piece by piece: :meth:`open`, any number of
    :meth:`piece`, then :meth:`close` (the events of each, as bytes). The base writes
    nothing; each streaming dialect has its own."""

    def __init__(self, answer: AnswerText, *, include_usage: bool = False) -> None:
        self.answer = answer
        self.include_usage = include_usage
        self.text: list[str] = []

    def open(self) -> bytes:
        return b""

    def piece(self, text: str) -> bytes:
        self.text.append(text)
        return b""

    def close(self, finish: str | None, usage: dict[str, Any] | None) -> bytes:
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
    """How a broken stream of it goes on elsewhere (``[[regions]] continuation``'s method
    names), or None: it is not continued."""
    heartbeat: ClassVar[bytes] = HEARTBEAT
    """What a stream waiting for its first token is sent, again and again."""
    writer: ClassVar[type[StreamWriter]] = StreamWriter

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

    def deterministic(self, body: dict[str, Any]) -> bool:
        """Whether the same request gets the same answer: greedy sampling, or a seed."""
        return body.get("temperature") == 0 or body.get("seed") is not None

    def state_refs(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        """The stored objects the request refers to, as ``(field, id)``: none by default."""
        return []

    def stores(self, body: dict[str, Any]) -> bool:
        """Whether the region is asked to store what it answers (a new owned object)."""
        return False

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
        for key, kinds in self.types.items():
            value = body.get(key)
            if value is not None and not _of_kind(value, kinds):
                return self.invalid(
                    f"Invalid type for '{key}': expected {_kinds(kinds)}, but got {_kind(value)}.",
                    key,
                    "invalid_type",
                )
        if body.get("model") == "":
            return self.invalid("'model' must not be empty.", "model", "invalid_value")
        turns = self.turns
        if turns is not None:
            value = body.get(turns)
            if value is not None and not value and self.needs_turns(body):
                return self.invalid(
                    f"'{turns}' must not be empty: send at least one.", turns, "empty_array"
                )
        for key, (low, high) in self.ranges.items():
            value = body.get(key)
            if value is None:
                continue
            if not number(value):
                return self.invalid(
                    f"Invalid type for '{key}': expected a number, but got {_kind(value)}.",
                    key,
                    "invalid_type",
                )
            if not low <= value <= high:
                return self.invalid(
                    f"'{key}' must be between {low:g} and {high:g}; got {value!r}.",
                    key,
                    "invalid_value",
                )
        for key in self.max_tokens_keys:
            err = self._at_least(body, key, self.min_tokens)
            if err is not None:
                return err
        for key, least in self.minimums.items():
            err = self._at_least(body, key, least)
            if err is not None:
                return err
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

    def usage_of(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The ``usage`` an event or a JSON answer of this API carries, as sent."""
        usage = obj.get("usage")
        return usage if isinstance(usage, dict) else None

    def counted(self, usage: dict[str, Any]) -> dict[str, Any]:
        """``usage`` with chat's fields (``prompt_tokens``, ``completion_tokens``,
        ``total_tokens``), which every reader of usage counts; the API's own kept beside."""
        return usage

    def merge_usage(self, old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
        """The usage after a stream's later event carried ``new``: it replaces the earlier."""
        return dict(new)

    def is_end(self, event: SSEEvent) -> bool:
        return event.data == b"[DONE]"

    def is_error(self, event: SSEEvent) -> bool:
        return event.event == "error" or event.data.startswith(b'{"error"')

    # -- what the proxy writes ---------------------------------------------------------------

    def error_body(self, err: ProxyError) -> bytes:
        """``err`` as this API's JSON error body."""
        return error_body(err.type, err.message, code=err.code, param=err.param)

    def error_event(self, err: ProxyError, *, sequence: int = 0) -> bytes:
        """The event that ends a broken stream with ``err``, which the API's SDK raises as
        its own error (OpenAI's raises ``APIError`` for an ``error`` key)."""
        return b"event: error\ndata: " + self.error_body(err) + b"\n\n"

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
