"""The fake region's model of an LLM server's prefix (KV) cache.

A prompt is canonicalised and cut into tokens cheaply and deterministically:

* chat ``messages``, in order: a ``<|role|>`` marker token per message, then
  its text content (a string, or the ``"text"`` of its ``text`` parts; any
  other part counts as one token standing for the whole part). Other message
  fields (tool calls, names) are ignored;
* a completions ``prompt``: a string, a list of strings (one sequence), token
  ids (each id one token) or lists of them; anything else is one token.

Text becomes tokens by splitting on whitespace and cutting each word into
pieces of :data:`TOKEN_CHARS` characters. Because every message contributes its
own tokens, a conversation's next turn starts with exactly the tokens of the
turn before.

Full blocks of ``block_size`` tokens are chained: block *i*'s hash covers
blocks 0..i, so a block is only found after the same whole prefix, as in
vLLM's automatic prefix caching. A partial last block is never cached.

**Answers are cached too.** vLLM and SGLang keep the blocks of the tokens a
request generated, not only of its prompt: in a chat, the answer is the
start of the next turn's prompt, so the next turn finds the whole previous
turn cached, answer included, where it was generated. The fake's answer
depends only on the prompt and its length (:mod:`edgeproxy.testing._content`),
so :func:`read_prompt` can chain the answer's blocks after the prompt's: the
tokens of ``<|assistant|>`` and the answer's text, as a next chat turn that
sends the answer back as an ``assistant`` message has them (a completions
answer: its text right after the prompt, as when the client appends it after
a space). Like a server, only full blocks count, and the answer's last token
is left out (it was sampled, never fed through the model). The answer's
length is the request's ``max_tokens`` (or ``max_completion_tokens``), or
``completion_tokens`` when the caller knows it; without either, only the
prompt is cached. The region inserts all these blocks when the request gets
its slot, not when it ends: a prompt can only start with an answer once the
client has read it, so this changes no lookup, only where the answer's
blocks stand in the LRU order while the request runs (and a request cut
short leaves its whole answer cached).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from edgeproxy.testing import _content as content

TOKEN_CHARS: Final = 4
"""Characters per token piece of a word."""

MAX_ANSWER_TOKENS: Final = 100_000
"""The fake's longest answer (its ``max_tokens`` cap)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as the KV model sees it."""

    tokens: int
    """Prompt tokens (the model's own count, not ``usage.prompt_tokens``)."""
    blocks: tuple[bytes, ...] = ()
    """Chained hashes of the full blocks of the prompt, then of the answer after it
    (see the module's docstring); empty when not hashed. A lookup only counts the
    prompt's: the first ``(tokens - 1) // block_size``."""
    answer_tokens: int = 0
    """Tokens of the answer chained after the prompt's, by this module's tokeniser
    (0: the answer is not cached)."""


def _units(request: Mapping[str, Any], *, chat: bool) -> Iterator[tuple[bool, str]]:
    """``(True, text)`` for text to cut into pieces, ``(False, token)`` for one token."""
    if chat:
        messages = request.get("messages")
        if not isinstance(messages, list):
            return
        for message in messages:
            if not isinstance(message, dict):
                yield False, "<|?" + content.digest(message).hex()[:16] + "|>"
                continue
            role = message.get("role")
            yield False, f"<|{role}|>" if isinstance(role, str) else "<|?|>"
            yield from _message_content(message.get("content"))
        return
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        yield True, prompt
    elif isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, str):
                yield True, item
            elif isinstance(item, int) and not isinstance(item, bool):
                yield False, f"#{item}"
            elif isinstance(item, list):
                for token in item:
                    yield False, f"#{token}" if isinstance(token, int) else _opaque(token)
            else:
                yield False, _opaque(item)
    elif prompt is not None:
        yield False, _opaque(prompt)


def _message_content(value: object) -> Iterator[tuple[bool, str]]:
    if isinstance(value, str):
        yield True, value
    elif isinstance(value, list):
        for part in value:
            if isinstance(part, dict) and part.get("type") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    yield True, text
                    continue
            yield False, _opaque(part)
    elif value is not None:
        yield False, _opaque(value)


def _opaque(value: object) -> str:
    return "<|" + content.digest(value).hex()[:16] + "|>"


def _pieces(units: Iterable[tuple[bool, str]]) -> Iterator[str]:
    for is_text, unit in units:
        if not is_text:
            yield unit
            continue
        for word in unit.split():
            if len(word) <= TOKEN_CHARS:
                yield word
            else:
                for start in range(0, len(word), TOKEN_CHARS):
                    yield word[start : start + TOKEN_CHARS]


def _count(units: Iterable[tuple[bool, str]]) -> int:
    total = 0
    for is_text, unit in units:
        if is_text:
            total += sum(-(-len(word) // TOKEN_CHARS) for word in unit.split())
        else:
            total += 1
    return total


def prompt_tokens(request: Mapping[str, Any], *, chat: bool) -> list[str]:
    """The prompt's tokens, in order (for tests and tools; the server hashes as it goes)."""
    return list(_pieces(_units(request, chat=chat)))


def answer_length(request: Mapping[str, Any]) -> int | None:
    """The answer's length in completion tokens, as the request states it; None if it
    does not (then the region's default applies, which only the region knows)."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = request.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None
        return min(value, MAX_ANSWER_TOKENS)
    return None


def _answer_units(
    request: Mapping[str, Any], *, chat: bool, completion_tokens: int
) -> Iterator[tuple[bool, str]]:
    """The answer as the next turn's prompt holds it, its last token left out."""
    prompt = request.get("messages" if chat else "prompt")
    words = list(content.tokens(content.digest(prompt), completion_tokens))[:-1]
    if chat:
        yield False, "<|assistant|>"
    if words:
        yield True, "".join(words)


def read_prompt(
    request: Mapping[str, Any],
    *,
    chat: bool,
    block_size: int,
    hashed: bool,
    completion_tokens: int | None = None,
) -> Prompt:
    """Count the prompt's tokens and, if ``hashed``, chain-hash its full blocks, then
    those of the answer after it (``completion_tokens`` long, else as the request
    states; see the module's docstring)."""
    units = _units(request, chat=chat)
    if not hashed:
        return Prompt(_count(units))
    hashes: list[bytes] = []
    block: list[str] = []
    previous = b""

    def chain(pieces: Iterable[str]) -> int:
        nonlocal previous
        n = 0
        for piece in pieces:
            n += 1
            block.append(piece)
            if len(block) == block_size:
                data = previous + "\x00".join(block).encode("utf-8", "surrogatepass")
                previous = hashlib.blake2b(data, digest_size=16).digest()
                hashes.append(previous)
                block.clear()
        return n

    count = chain(_pieces(units))
    if completion_tokens is None:
        completion_tokens = answer_length(request)
    answered = 0
    if completion_tokens and count:
        answered = chain(
            _pieces(_answer_units(request, chat=chat, completion_tokens=completion_tokens))
        )
    return Prompt(count, tuple(hashes), answered)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` tokens (a partial block counts)."""
    return -(-tokens // block_size)


class KVCache:
    """An LRU of prompt blocks, ``capacity`` blocks at most (0: no cache).

    Not thread-safe; the region guards it with its lock.
    """

    __slots__ = ("capacity", "evicted_total", "_blocks")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.evicted_total = 0
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def lookup(self, blocks: Sequence[bytes], eligible: int) -> int:
        """How many of the first ``eligible`` blocks are cached, counted from the start."""
        matched = 0
        for block in blocks[:eligible]:
            if block not in self._blocks:
                break
            matched += 1
        return matched

    def insert(self, blocks: Sequence[bytes]) -> None:
        """Cache ``blocks``, most recently used first; evict the least recently used.

        The blocks are refreshed from the last to the first, so eviction takes
        the ends of prompts before their beginnings (vLLM frees a finished
        request's blocks in reverse order for the same reason).
        """
        if self.capacity <= 0:
            return
        cache = self._blocks
        for block in reversed(blocks):
            if block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
        while len(cache) > self.capacity:
            cache.popitem(last=False)
            self.evicted_total += 1

    def clear(self) -> None:
        self._blocks.clear()
