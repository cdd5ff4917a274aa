"""The fake region's routes and their answers.

OpenAI-style completions and embeddings (deterministic, from
:mod:`edgeproxy.testing._content`), the Responses API
(:mod:`edgeproxy.testing._responses`), Anthropic's Messages API
(:mod:`edgeproxy.testing._messages`), models, health, echo and status-code
endpoints. Each answer is a :class:`~edgeproxy.testing._exchange.Reply`; a
request it cannot answer raises :class:`~edgeproxy.testing._exchange.BadRequest`.
On a region with a prefix cache, chat and completions usage (JSON, and a stream's usage
chunk) carries ``prompt_tokens_details.cached_tokens``, as OpenAI and vLLM report it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar
from urllib.parse import parse_qs

from edgeproxy._protocol.openai import completion_id
from edgeproxy.testing import _content as content
from edgeproxy.testing import _messages as messages
from edgeproxy.testing import _objects
from edgeproxy.testing import _responses as responses
from edgeproxy.testing._behavior import Behavior
from edgeproxy.testing._exchange import (
    BadRequest,
    Exchange,
    Generation,
    Headers,
    Reply,
    error_reply,
    json_reply,
    parse_json_object,
    set_json,
)
from edgeproxy.testing._kv import read_prompt

MAX_TOKENS: Final = 100_000
MAX_ECHO_SIZE: Final = 256 * 2**20
_ECHO_PART: Final = 64 * 2**10
_ECHO_PATTERN: Final = bytes(range(33, 127))  # printable, so bodies are easy to eyeball


def route(
    ex: Exchange,
    body: bytes,
    behavior: Behavior,
    *,
    region_model: str,
    max_model_len: int = 4096,
    metrics: Callable[[], Reply],
    store: responses.ResponseStore,
    seen: messages.SeenHeaders,
    objects: _objects.ObjectStore,
) -> Reply:
    path, method = ex.path, ex.method
    if path == "/v1/responses":
        _require_method(method, "POST")
        return responses.create(parse_json_object(body), behavior, region_model, store, objects)
    if path.startswith("/v1/responses/"):
        return responses.route(ex, store)
    if any(path == c or path.startswith(c + "/") for c in _objects.COLLECTIONS):
        return _objects.route(ex, body, objects)
    if path in ("/v1/messages", "/v1/messages/count_tokens"):
        seen.record(ex)
        _require_method(method, "POST")
        request = parse_json_object(body)
        if path == "/v1/messages":
            return messages.create(request, behavior, region_model)
        return messages.count_tokens(request)
    if path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        _require_method(method, "POST")
        request = parse_json_object(body)
        if path == "/v1/embeddings":
            return _embeddings(request, behavior, region_model)
        return _completion(request, behavior, region_model, chat=path == "/v1/chat/completions")
    if path == "/v1/models":
        _require_method(method, "GET", "HEAD")
        # As vLLM lists them: with each model's context window.
        models = {
            "object": "list",
            "data": [
                {
                    "id": region_model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "edgeproxy",
                    "max_model_len": max_model_len,
                }
            ],
        }
        return json_reply(200, models)
    if path == "/metrics":
        _require_method(method, "GET", "HEAD")
        return metrics()
    if path == "/healthz":
        _require_method(method, "GET", "HEAD")
        return json_reply(200, {"status": "ok"})
    if path.startswith("/status/"):
        return _status(path.removeprefix("/status/"))
    raise BadRequest(f"no route for {method} {path}", status=404)


def _completion(
    request: dict[str, Any], behavior: Behavior, region_model: str, *, chat: bool
) -> Reply:
    prompt_key = "messages" if chat else "prompt"
    if prompt_key not in request:
        raise BadRequest(f"'{prompt_key}' is required")
    prompt = request[prompt_key]
    if chat and not isinstance(prompt, list):
        raise BadRequest("'messages' must be an array")
    n_tokens = _max_tokens(request, behavior.tokens)
    stream = request.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    model = request.get("model")
    model = model if isinstance(model, str) and model else region_model

    partial = _continued_answer(request, prompt) if chat else None
    if partial is None:
        words = list(content.tokens(content.digest(prompt), n_tokens))
    else:
        # The digest of the conversation without the partial answer: the same
        # as the unbroken request's, whose answer this continues.
        base = content.digest(prompt[:-1])
        overlap = behavior.continuation_overlap
        if any(request.get(key) is not None for key in ("max_tokens", "max_completion_tokens")):
            # As vLLM counts it, the limit is on the new tokens (a repeated
            # overlap included), so the answer runs on past the partial one.
            answer = list(content.tokens(base, len(partial.split()) + n_tokens + 1))
            words = content.continuation(answer, partial, overlap)[:n_tokens]
        else:
            # Unlimited, it ends where the unbroken answer does.
            answer = list(content.tokens(base, n_tokens))
            words = content.continuation(answer, partial, overlap)
    generation = Generation(request, chat, len(words))
    usage: dict[str, Any] = dict(content.usage(max(1, content.count_words(prompt)), len(words)))
    created = int(time.time())
    id_ = completion_id(chat=chat)

    if not stream:
        text = "".join(words)
        payload = (
            content.chat_completion(id_, created, model, text, usage)
            if chat
            else content.text_completion(id_, created, model, text, usage)
        )
        reply = json_reply(200, payload)

        def with_cache(cached: int) -> None:
            _report_cached(usage, request, chat=chat, cached=cached)
            set_json(reply, payload)

        reply.first_delay = behavior.ttft
        reply.generation = generation
        reply.with_cache = with_cache
        return reply

    parts: list[bytes] = []
    for index, word in enumerate(words):
        if chat:
            delta = {"role": "assistant", "content": word} if index == 0 else {"content": word}
            parts.append(content.sse_event(content.chat_chunk(id_, created, model, delta)))
        else:
            parts.append(content.sse_event(content.text_chunk(id_, created, model, word)))
    if chat:
        final = content.chat_chunk(id_, created, model, {} if words else {"role": "assistant"})
        final["choices"][0]["finish_reason"] = "stop"
    else:
        final = content.text_chunk(id_, created, model, "", "stop")
    parts.append(content.sse_event(final))
    options = request.get("stream_options")
    at_usage: int | None = None
    if isinstance(options, dict) and options.get("include_usage") is True:
        at_usage = len(parts)
        parts.append(content.usage_chunk(id_, created, model, chat=chat, usage_=usage))
    parts.append(content.SSE_DONE)
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    def stream_error(index: int) -> bytes:
        # vLLM's in-band error: one data event with an error object, then [DONE].
        message = f"injected error after {index} tokens"
        return (
            b"data: "
            + content.error_body(message, type_="server_error")
            + b"\n\n"
            + content.SSE_DONE
        )

    streamed = Reply(
        200,
        headers,
        parts,
        first_delay=behavior.ttft,
        gap=behavior.inter_token_delay,
        gap_units=len(words),
        generation=generation,
        stream_error=stream_error,
    )

    def with_cache_streamed(cached: int) -> None:
        _report_cached(usage, request, chat=chat, cached=cached)
        if at_usage is not None:
            chunk = content.usage_chunk(id_, created, model, chat=chat, usage_=usage)
            streamed.parts[at_usage] = chunk

    streamed.with_cache = with_cache_streamed
    return streamed


def _report_cached(
    usage: dict[str, Any], request: dict[str, Any], *, chat: bool, cached: int
) -> None:
    """Add the KV cache's hit to a chat or completions ``usage``, as OpenAI and vLLM report it.

    The usage counts the prompt's words, the KV model its own finer tokens: the hit is
    scaled to the usage's count, so that the share of the prompt cached is the KV model's.
    """
    kv_tokens = read_prompt(request, chat=chat, block_size=1, hashed=False).tokens
    prompt_tokens = int(usage["prompt_tokens"])
    shown = min(prompt_tokens, cached * prompt_tokens // kv_tokens) if kv_tokens else 0
    usage["prompt_tokens_details"] = {"cached_tokens": shown}


def error_for(path: str, status: int, message: str, type_: str = "invalid_request_error") -> Reply:
    """An error answer in the shape of the API ``path`` belongs to."""
    if path.startswith("/v1/messages"):
        return messages.error_reply(status, message)
    return error_reply(status, message, type_)


def bad_request(path: str, exc: BadRequest) -> Reply:
    """The answer to a request refused with ``exc``, in its API's shape."""
    if path.startswith("/v1/messages"):
        return messages.error_reply(exc.status, str(exc))
    return error_reply(exc.status, str(exc), exc.type_, param=exc.param, code=exc.code)


def _continued_answer(request: dict[str, Any], messages: list[Any]) -> str | None:
    """The partial answer a chat request asks to continue, or ``None`` for a new answer.

    vLLM continues the final assistant message with ``continue_final_message``
    (and refuses it alongside its default ``add_generation_prompt``);
    llama.cpp continues a trailing assistant message without being asked.
    """
    flag = request.get("continue_final_message", False)
    if not isinstance(flag, bool):
        raise BadRequest("'continue_final_message' must be a boolean")
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        if flag:
            raise BadRequest(
                "'continue_final_message' is set but the final message is not from the assistant"
            )
        return None
    if flag and request.get("add_generation_prompt", True) is not False:
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    text = last.get("content")
    if text is None:
        return ""
    if isinstance(text, str):
        return text
    if isinstance(text, list):
        return "".join(
            part["text"]
            for part in text
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    raise BadRequest("the final assistant message's 'content' must be a string or an array")


def _embeddings(request: dict[str, Any], behavior: Behavior, region_model: str) -> Reply:
    if "input" not in request:
        raise BadRequest("'input' is required")
    raw = request["input"]
    inputs: list[object] = raw if isinstance(raw, list) and raw else [raw]
    model = request.get("model")
    payload = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": content.embedding(item)}
            for i, item in enumerate(inputs)
        ],
        "model": model if isinstance(model, str) and model else region_model,
        "usage": {
            "prompt_tokens": content.count_words(inputs),
            "total_tokens": content.count_words(inputs),
        },
    }
    reply = json_reply(200, payload)
    reply.first_delay = behavior.ttft
    return reply


def echo(ex: Exchange, length: int, sha256: str, *, region: str) -> Reply:
    query = parse_qs(ex.query_string, keep_blank_values=True)
    size = _query_number(query, "size", int, 0, MAX_ECHO_SIZE)
    chunks = _query_number(query, "chunks", int, 1, 100_000)
    delay = _query_number(query, "delay", float, 0.0, 3600.0)
    headers: Headers = [
        (b"x-echo-method", ex.method.encode("latin-1")),
        (b"x-echo-body-length", str(length).encode()),
        (b"x-echo-body-sha256", sha256.encode()),
    ]
    if size is None and chunks is None:
        payload = {
            "region": region,
            "method": ex.method,
            "path": ex.path,
            "raw_path": ex.raw_path,
            "query_string": ex.query_string,
            "http_version": ex.scope["http_version"],
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in ex.scope["headers"]],
            "body_length": length,
            "body_sha256": sha256,
        }
        reply = json_reply(200, payload)
        reply.headers.extend(headers)
        return reply

    if size is None:
        assert chunks is not None
        parts = [b"chunk %d\n" % i for i in range(chunks)]
    else:
        body = (_ECHO_PATTERN * (size // len(_ECHO_PATTERN) + 1))[:size]
        count = chunks if chunks is not None else max(1, math.ceil(size / _ECHO_PART))
        step = max(1, math.ceil(size / count))
        parts = [body[i : i + step] for i in range(0, size, step)] or [b""]
    total = sum(len(p) for p in parts)
    headers += [
        (b"content-type", b"application/octet-stream"),
        (b"content-length", str(total).encode()),
    ]
    return Reply(200, headers, parts, gap=delay or 0.0, gap_units=len(parts))


def _status(raw: str) -> Reply:
    try:
        status = int(raw)
    except ValueError:
        raise BadRequest(f"not a status code: {raw!r}") from None
    if not 200 <= status <= 599:
        raise BadRequest(f"status must be 200-599, not {status}")
    if status in (204, 304):
        return Reply(status, [], [])
    return json_reply(status, {"status": status})


def _require_method(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise BadRequest(f"method {method} not allowed; use {' or '.join(allowed)}", status=405)


def _max_tokens(request: dict[str, Any], default: int) -> int:
    for key in ("max_tokens", "max_completion_tokens"):
        value = request.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadRequest(f"'{key}' must be a non-negative integer")
        return min(value, MAX_TOKENS)
    return default


_Number = TypeVar("_Number", int, float)


def _query_number(
    query: dict[str, list[str]],
    name: str,
    kind: Callable[[str], _Number],
    low: _Number,
    high: _Number,
) -> _Number | None:
    values = query.get(name)
    if not values:
        return None
    try:
        value = kind(values[-1])
    except ValueError:
        raise BadRequest(f"query parameter {name}={values[-1]!r} is not a number") from None
    if not low <= value <= high:
        raise BadRequest(f"query parameter {name} must be between {low} and {high}")
    return value
