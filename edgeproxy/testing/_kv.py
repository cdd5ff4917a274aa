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


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as the KV model sees it."""

    tokens: int
    """Prompt tokens (the model's own count, not ``usage.prompt_tokens``)."""
    blocks: tuple[bytes, ...] = ()
    """Chained hashes of the full blocks; empty when not hashed."""


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


def read_prompt(request: Mapping[str, Any], *, chat: bool, block_size: int, hashed: bool) -> Prompt:
    """Count the prompt's tokens and, if ``hashed``, chain-hash its full blocks."""
    units = _units(request, chat=chat)
    if not hashed:
        return Prompt(_count(units))
    hashes: list[bytes] = []
    block: list[str] = []
    previous = b""
    count = 0
    for piece in _pieces(units):
        count += 1
        block.append(piece)
        if len(block) == block_size:
            data = previous + "\x00".join(block).encode("utf-8", "surrogatepass")
            previous = hashlib.blake2b(data, digest_size=16).digest()
            hashes.append(previous)
            block.clear()
    return Prompt(count, tuple(hashes))


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
