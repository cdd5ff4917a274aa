"""Deterministic completions and OpenAI-shaped payloads.

The text depends only on the prompt (never on the region, the time or the
token budget beyond its length), so two regions answer the same request
identically and a shorter ``max_tokens`` yields a prefix of a longer one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, Final

import orjson

from edgeproxy._protocol import openai
from edgeproxy._protocol.openai import SSE_DONE as SSE_DONE
from edgeproxy._protocol.openai import AnswerHead
from edgeproxy._protocol.openai import sse_event as sse_event
from edgeproxy._protocol.openai import usage as usage

_VOCABULARY: Final = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
    "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
    "zulu amber basil cedar dune ember fjord grove harbor island jade kelp lagoon "
    "meadow nectar orchid pebble quartz river summit tundra umber valley willow "
    "yarrow zephyr atlas beacon canyon dawn estuary fable glacier horizon"
).split()

_EMBEDDING_DIMENSIONS: Final = 8


def digest(value: object) -> bytes:
    """A stable hash of a JSON value (key order does not matter)."""
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).digest()


def tokens(prompt_digest: bytes, count: int) -> Iterator[str]:
    """The completion for a prompt, one token at a time.

    Tokens after the first start with a space, so joining them reads as text.
    """
    for index in range(count):
        h = hashlib.sha256(prompt_digest + index.to_bytes(4, "big")).digest()
        word = _VOCABULARY[int.from_bytes(h[:4], "big") % len(_VOCABULARY)]
        yield word if index == 0 else " " + word


def answer_text(prompt: object, count: int) -> str:
    """The whole answer a fake region gives to ``prompt`` with ``count`` tokens.

    ``prompt`` is a chat request's ``messages`` or a completions request's
    ``prompt``, as sent; ``count`` its ``max_tokens``, or the region's
    ``Behavior.tokens`` when it sets none. A test compares what a client
    received, spliced or not, against this.
    """
    return "".join(tokens(digest(prompt), count))


def continuation(answer: Sequence[str], partial: str, overlap: int = 0) -> list[str]:
    """The tokens of ``answer`` that follow the text ``partial``.

    ``partial`` is normally a prefix of the joined ``answer``: the rest is
    returned, beginning with the rest of a token the prefix cuts, so that
    ``partial + "".join(result) == "".join(answer)``. With ``overlap``, the
    last ``overlap`` tokens of ``partial`` (a cut token counting as one) come
    first again, whole. A ``partial`` that is not a prefix is taken as that
    many tokens as it has words.
    """
    if not "".join(answer).startswith(partial):
        return list(answer[max(0, len(partial.split()) - overlap) :])
    cut = len(partial)
    start = whole = 0
    while whole < len(answer) and start + len(answer[whole]) <= cut:
        start += len(answer[whole])
        whole += 1
    cut_token = start < cut
    if overlap > 0:
        return list(answer[max(0, whole + cut_token - overlap) :])
    if not cut_token:
        return list(answer[whole:])
    return [answer[whole][cut - start :], *answer[whole + 1 :]]


def count_words(value: object) -> int:
    """A rough prompt token count: whitespace-separated words in every string inside."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list | tuple):
        return sum(count_words(item) for item in value)
    if isinstance(value, dict):
        return sum(count_words(item) for item in value.values())
    return 0


def embedding(value: object) -> list[float]:
    """A small deterministic unit-range vector for one embeddings input."""
    h = digest(value)
    return [
        round(int.from_bytes(h[i * 4 : i * 4 + 4], "big") / 2**31 - 1.0, 6)
        for i in range(_EMBEDDING_DIMENSIONS)
    ]


def error_body(
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> bytes:
    """The OpenAI error shape."""
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def sse_named_event(event: str, payload: object) -> bytes:
    """An SSE event with an ``event:`` line, as the Responses and Messages APIs send them."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


# Each object's head (its fields, in OpenAI's order) is the proxy's own; the fake's chat
# choices carry no ``logprobs``, unlike the proxy's.
def chat_completion(
    id_: str, created: int, model: str, text: str, usage_: dict[str, int]
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": "stop",
    }
    return openai.completion(AnswerHead(id_, created, model, chat=True), [choice], usage_)


def chat_chunk(
    id_: str,
    created: int,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None = None,
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    return openai.chunk(AnswerHead(id_, created, model, chat=True), [choice])


def text_completion(
    id_: str, created: int, model: str, text: str, usage_: dict[str, int]
) -> dict[str, Any]:
    choice = openai.text_choice(0, text, "stop")
    return openai.completion(AnswerHead(id_, created, model, chat=False), [choice], usage_)


def text_chunk(
    id_: str, created: int, model: str, text: str, finish_reason: str | None = None
) -> dict[str, Any]:
    return openai.chunk(
        AnswerHead(id_, created, model, chat=False), [openai.text_choice(0, text, finish_reason)]
    )


def usage_chunk(id_: str, created: int, model: str, *, chat: bool, usage_: dict[str, int]) -> bytes:
    return sse_event(openai.usage_chunk(AnswerHead(id_, created, model, chat=chat), usage_))
