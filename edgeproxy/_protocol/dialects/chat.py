"""OpenAI's chat completions and text completions: the dialects the proxy was born with.

A stream is ``data: <chunk>`` events and ``data: [DONE]``; the first chunk usually
carries only the ``role``, and the first content is a delta with ``content`` or
``tool_calls`` (or, for text completions, a choice with ``text``). Usage comes at the
top of the JSON answer, or of a last chunk without choices
(``stream_options.include_usage``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol import openai
from edgeproxy._protocol.dialects._base import (
    REGION_METHOD,
    AnswerText,
    Dialect,
    Piece,
    Seam,
    StreamWriter,
    _kind,
    asks_usage,
    loads,
    words,
)
from edgeproxy._protocol.sse import SSEEvent

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "ChatDialect",
    "ChatSeam",
    "ChatText",
    "ChatWriter",
    "CompletionsDialect",
]


class ChatText(AnswerText):
    """What a completion says, with the ``system_fingerprint`` its chunks repeat."""

    __slots__ = ("system_fingerprint",)

    def __init__(self, *args: Any, system_fingerprint: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.system_fingerprint = system_fingerprint


class ChatWriter(StreamWriter):
    """A chat (or text) completion as chunks: the role, the pieces, the finish, the usage."""

    chat: ClassVar[bool] = True

    def __init__(self, answer: AnswerText, *, include_usage: bool = False) -> None:
        super().__init__(answer, include_usage=include_usage)
        fingerprint = answer.system_fingerprint if isinstance(answer, ChatText) else None
        self.head = openai.AnswerHead(
            answer.id, answer.created, answer.model, self.chat, fingerprint
        )

    def open(self) -> bytes:
        if not self.chat:
            return b""
        choice = openai.chat_chunk_choice(0, {"role": "assistant", "content": ""})
        return openai.sse_event(openai.chunk(self.head, [choice]))

    def piece(self, text: str) -> bytes:
        self.text.append(text)
        if self.chat:
            choice = openai.chat_chunk_choice(0, {"content": text})
        else:
            choice = openai.text_choice(0, text)
        return openai.sse_event(openai.chunk(self.head, [choice]))

    def close(self, finish: str | None, usage: dict[str, Any] | None) -> bytes:
        if self.chat:
            choice = openai.chat_chunk_choice(0, {}, finish)
        else:
            choice = openai.text_choice(0, "", finish)
        out = openai.sse_event(openai.chunk(self.head, [choice]))
        if usage is not None and self.include_usage:
            out += openai.sse_event(openai.usage_chunk(self.head, usage))
        return out + openai.SSE_DONE


class TextWriter(ChatWriter):
    chat = False


class ChatSeam(Seam):
    """A chat completion continued across legs: the first leg's ``id``, ``created``,
    ``model`` (and ``system_fingerprint``) on every later chunk, no second ``role`` delta,
    the legs' usage in one last chunk (``stream_options.include_usage``) and one
    ``[DONE]``."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.include_usage = asks_usage(body)
        self.head: dict[str, Any] | None = None
        self.done = False  # the last leg's [DONE] came

    def first(self, event: SSEEvent) -> Piece:
        obj = loads(event.data) if event.data.startswith(b"{") else None
        if not isinstance(obj, dict):
            return Piece()
        if self.head is None and "id" in obj:
            self.head = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
            if obj.get("system_fingerprint") is not None:
                self.head["system_fingerprint"] = obj["system_fingerprint"]
        return self._read(obj)

    def start_leg(self) -> None:
        self.done = False

    def later(self, event: SSEEvent) -> Piece:
        data = event.data
        if data == b"[DONE]":
            self.done = True
            return Piece("hold")
        obj = loads(data) if data.startswith(b"{") else None
        if not isinstance(obj, dict):
            # An event without data passes; data that is no chunk does not.
            return Piece("drop" if data else "raw")
        if "error" in obj and not obj.get("choices"):
            return Piece("raw")  # an in-band error: the client is told
        return self._read(obj)

    def _read(self, obj: dict[str, Any]) -> Piece:
        usage = obj.get("usage")
        usage = usage if isinstance(usage, dict) else None
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return Piece("hold", obj, usage=usage)  # the usage chunk: summed at the end
        choice = choices[0]
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        content = delta.get("content")
        text = content if isinstance(content, str) else ""
        other = bool(delta.get("tool_calls"))
        finish = bool(choice.get("finish_reason"))
        kind = "text" if text else "pass" if other or finish else "drop"
        return Piece(kind, obj, text=text, other=other, finish=finish, usage=usage)

    def write(self, piece: Piece, text: str) -> bytes:
        obj = piece.obj
        if self.head is not None:
            obj.update(self.head)
        obj.pop("usage", None)
        delta = obj["choices"][0].get("delta")
        if isinstance(delta, dict):
            delta.pop("role", None)
            if piece.text:
                delta["content"] = piece.text
            else:
                delta.pop("content", None)
        return openai.sse_event(obj)

    def close(self, usage: dict[str, Any] | None, text: str) -> bytes:
        out = b""
        if self.include_usage and usage is not None and self.head is not None:
            out += openai.sse_event({**self.head, "choices": [], "usage": usage})
        return out + openai.SSE_DONE if self.done else out


class ChatDialect(Dialect):
    """``/v1/chat/completions``."""

    name = "chat.completions"
    chat: ClassVar[bool] = True
    """Its answers are chat completions (not text completions)."""
    max_tokens_keys: ClassVar[tuple[str, ...]] = ("max_completion_tokens", "max_tokens")
    continuation: ClassVar[str | None] = REGION_METHOD
    seam = ChatSeam
    writer = ChatWriter
    required: ClassVar[tuple[str, ...]] = ("model", "messages")
    minimums: ClassVar[dict[str, int]] = {"n": 1, "top_logprobs": 0}
    # The documented fields of OpenAI's chat completions and their types; vLLM, SGLang and
    # llama.cpp read the same fields with the same types, or ignore them.
    types: ClassVar[dict[str, tuple[type, ...]]] = {
        **Dialect.types,
        "max_completion_tokens": (int,),
        "stream_options": (dict,),
        "response_format": (dict,),
        "tool_choice": (str, dict),
        "parallel_tool_calls": (bool,),
        "functions": (list,),
        "function_call": (str, dict),
        "logit_bias": (dict,),
        "logprobs": (bool,),
        "top_logprobs": (int,),
        "presence_penalty": (int, float),
        "frequency_penalty": (int, float),
        "store": (bool,),
        "modalities": (list,),
        "audio": (dict,),
        "prediction": (dict,),
        "reasoning_effort": (str,),
        "service_tier": (str,),
        "web_search_options": (dict,),
        "prompt_cache_key": (str,),
        "safety_identifier": (str,),
        "verbosity": (str,),
    }

    def cache_intent(self, body: dict[str, Any]) -> list[tuple[Any, bool | None]] | None:
        """``prompt_cache_key``: the client's name for the cache its requests share (OpenAI
        routes the requests naming it to the same machines)."""
        key = body.get("prompt_cache_key")
        return [({"prompt_cache_key": key}, False)] if isinstance(key, str) and key else None

    def check(self, body: dict[str, Any]) -> ProxyError | None:
        """The base checks, then the items of the lists every server reads item by item:
        each message an object with a string ``role`` (its content and the role's value
        are left to the server: chat templates know roles of their own), each ``stop`` a
        string, each tool an object. A missing ``messages`` is refused here too: llama.cpp
        answered such a request 200, with an answer to no question."""
        err = super().check(body)
        if err is not None:
            return err
        if self.chat:
            err = self._messages(body.get("messages"))
            if err is None:
                err = self._items(body.get("tools"), "tools", dict)
        if err is None:
            err = self._items(body.get("stop"), "stop", str)
        return err

    def _messages(self, messages: Any) -> ProxyError | None:
        if not isinstance(messages, list):
            return None  # absent where allowed; its type was checked before
        for index, message in enumerate(messages):
            if type(message) is not dict:
                return self._wrong_item(message, "messages", index, dict)
            role = message.get("role")
            if type(role) is str:
                continue
            if role is None:
                return self.invalid(
                    f"Missing required parameter: 'messages[{index}].role'.",
                    f"messages[{index}].role",
                    "missing_required_parameter",
                )
            return self.invalid(
                f"Invalid type for 'messages[{index}].role': expected a string, but got "
                f"{_kind(role)}.",
                f"messages[{index}].role",
                "invalid_type",
            )
        return None

    def _items(self, value: Any, key: str, kind: type) -> ProxyError | None:
        """The first item of the list ``value`` (the field ``key``) not of ``kind``."""
        if not isinstance(value, list):
            return None
        for index, item in enumerate(value):
            if type(item) is not kind:
                return self._wrong_item(item, key, index, kind)
        return None

    def _wrong_item(self, item: Any, key: str, index: int, kind: type) -> ProxyError:
        """The 400 for ``item``, at ``index`` in the list ``key``, not of ``kind`` (the type
        is checked in the loops: no call per item)."""
        return self.invalid(
            f"Invalid type for '{key}[{index}]': expected "
            f"{'a string' if kind is str else 'an object'}, but got {_kind(item)}.",
            f"{key}[{index}]",
            "invalid_type",
        )

    def answer_id(self) -> str:
        return openai.completion_id(chat=True)

    def continuable(self, body: dict[str, Any]) -> bool:
        # One choice, whose text a final assistant message can carry.
        return isinstance(body.get("messages"), list) and body.get("n", 1) == 1

    def continuation_body(self, body: dict[str, Any], text: str, method: str) -> dict[str, Any]:
        """The conversation plus the partial answer as a final assistant message; with
        vLLM's and SGLang's switches for ``continue_final_message``."""
        out = dict(body)
        if method == "reissue":
            return out
        out["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
        if method == "continue_final_message":
            out["continue_final_message"] = True
            out["add_generation_prompt"] = False
        return out

    def commits(self, event: SSEEvent) -> bool:
        if event.comment:
            return False  # a keep-alive comment is no content
        data = event.data
        if event.event is not None or data == b"[DONE]" or not data.startswith(b"{"):
            return True
        if (
            data.find(b'"content"') < 0
            and data.find(b'"tool_calls"') < 0
            and data.find(b'"text"') < 0
            and data.find(b'"finish_reason"') < 0
            and data.find(b'"error"') < 0
        ):
            return False
        obj = loads(data)
        if not isinstance(obj, dict):
            return True
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            return "error" in obj
        for choice in choices:
            if not isinstance(choice, dict):
                return True
            if choice.get("finish_reason") or choice.get("text"):
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict) and (
                delta.get("content") or delta.get("tool_calls") or delta.get("refusal")
            ):
                return True
        return False

    def answer(self, text: AnswerText) -> dict[str, Any]:
        head = openai.AnswerHead(text.id, text.created, text.model, True)
        return openai.completion(head, [openai.chat_choice(0, text.text, text.finish)], text.usage)

    def text_of(self, answer: dict[str, Any]) -> AnswerText | None:
        # One choice of text alone: tool calls, a refusal or several choices are not text.
        head = openai.AnswerHead.of(answer)
        if head is None or head.chat is not self.chat:
            return None
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            return None
        choice = choices[0]
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            return None
        if head.chat:
            message = choice.get("message")
            if (
                not isinstance(message, dict)
                or message.get("role", "assistant") != "assistant"
                or message.get("tool_calls")
                or message.get("function_call")
                or message.get("refusal")
            ):
                return None
            text = message.get("content")
        else:
            text = choice.get("text")
        if text is not None and not isinstance(text, str):
            return None
        usage = answer.get("usage")
        return ChatText(
            head.id,
            head.model,
            head.created,
            text or "",
            choice.get("finish_reason"),
            usage if isinstance(usage, dict) else None,
            system_fingerprint=head.system_fingerprint,
        )

    def stream_of(
        self, answer: dict[str, Any], *, include_usage: bool = False
    ) -> list[bytes] | None:
        text = self.text_of(answer)
        if text is not None:
            return self.written(text, include_usage=include_usage)
        return _chunks_of(answer, include_usage=include_usage)

    def assemble(self, events: list[SSEEvent]) -> dict[str, Any] | None:
        return _assemble(events)


class CompletionsDialect(ChatDialect):
    """``/v1/completions``: a ``prompt`` instead of messages."""

    name = "completions"
    chat: ClassVar[bool] = False
    required: ClassVar[tuple[str, ...]] = ("model",)
    max_tokens_keys: ClassVar[tuple[str, ...]] = ("max_tokens",)
    prompt_keys: ClassVar[tuple[str, ...]] = ("prompt",)
    turns: ClassVar[str | None] = None
    continuation: ClassVar[str | None] = None
    writer = TextWriter
    # ``max_tokens: 0`` with ``echo`` scores a prompt without generating: OpenAI's legacy
    # completions and the servers that copy them take it.
    min_tokens: ClassVar[int] = 0
    types: ClassVar[dict[str, tuple[type, ...]]] = {
        **Dialect.types,
        "prompt": (str, list),
        "stream_options": (dict,),
        "echo": (bool,),
        "logprobs": (int,),
        "best_of": (int,),
        "suffix": (str,),
    }

    def conversation(self, body: dict[str, Any]) -> list[Any]:
        return []  # a prompt, not turns: keyed as text (see edgeproxy._protocol.prefix)

    def text_turns(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        return []  # a prompt, not turns: read by whoever answers it

    def answer_id(self) -> str:
        return openai.completion_id(chat=False)

    def check(self, body: dict[str, Any]) -> ProxyError | None:
        err = super().check(body)
        # An empty list is no prompt at all; an empty string is one (the model starts a
        # document from nothing), which OpenAI's completions take.
        if err is None and body.get("prompt") == []:
            return self.invalid("'prompt' must not be empty.", "prompt", "empty_array")
        return err

    def answer(self, text: AnswerText) -> dict[str, Any]:
        head = openai.AnswerHead(text.id, text.created, text.model, False)
        return openai.completion(head, [openai.text_choice(0, text.text, text.finish)], text.usage)


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _assemble(events: list[SSEEvent]) -> dict[str, Any] | None:
    """The completion a whole chat or text completion stream amounts to: its choices' text,
    refusals, tool calls and logprobs put together; None for a stream without its
    ``[DONE]``, with an error, or of anything else."""
    out: dict[str, Any] | None = None
    choices: dict[int, dict[str, Any]] = {}
    tools: dict[int, dict[int, dict[str, Any]]] = {}
    chat = True
    ended = False
    for event in events:
        if event.data == b"[DONE]":
            ended = True
            continue
        if event.comment or not event.data:
            continue
        data = loads(event.data)
        if not isinstance(data, dict):
            continue
        if "error" in data and "choices" not in data:
            return None
        if out is None:
            obj = data.get("object")
            if obj == openai.CHAT_CHUNK:
                chat = True
            elif obj == openai.TEXT_COMPLETION:
                chat = False
            else:
                return None
            out = {
                "id": data.get("id"),
                "object": openai.CHAT_COMPLETION if chat else openai.TEXT_COMPLETION,
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
    if out is None or not ended:
        return None
    for index, calls in tools.items():
        choices[index]["message"]["tool_calls"] = [calls[i] for i in sorted(calls)]
    out["choices"] = [choices[i] for i in sorted(choices)]
    return out


def _chunks_of(answer: dict[str, Any], *, include_usage: bool) -> list[bytes] | None:
    """A completion that is more than one choice of text (tool calls, a refusal, several
    choices) as the chunks a stream of it would have had, a word of content at a time;
    None for anything but a completion."""
    head = openai.AnswerHead.of(answer)
    if head is None:
        return None
    events: list[bytes] = []

    def emit(choice: dict[str, Any]) -> None:
        events.append(openai.sse_event(openai.chunk(head, [choice])))

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
            emit(openai.chat_chunk_choice(index, {"role": role, "content": ""}))
            content = message.get("content")
            if isinstance(content, str):
                for piece in words(content):
                    emit(openai.chat_chunk_choice(index, {"content": piece}))
            for i, call in enumerate(calls):
                emit(openai.chat_chunk_choice(index, {"tool_calls": [{**call, "index": i}]}))
            emit(openai.chat_chunk_choice(index, {}, finish))
        else:
            text = choice.get("text")
            if isinstance(text, str):
                for piece in words(text):
                    emit(openai.text_choice(index, piece))
            emit(openai.text_choice(index, "", finish))
    if include_usage and isinstance(answer.get("usage"), dict):
        events.append(openai.sse_event(openai.usage_chunk(head, answer["usage"])))
    events.append(openai.SSE_DONE)
    return events


CHAT: Final = ChatDialect()
COMPLETIONS: Final = CompletionsDialect()
