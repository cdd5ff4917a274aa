"""Prompt prefixes as chained block hashes, for routing a conversation back to its KV cache.

A model server keeps the KV cache of the prompts it computed (vLLM's
automatic prefix caching, SGLang's radix cache): a request whose prompt
starts like an earlier one skips that part of the prefill. To send it where
that cache is, the router only needs a cheap, stable fingerprint of each
prompt's beginning. :func:`prompt_key` makes one:

1. **Canonical text.** Chat ``messages``, in order, each as ``\\x1e`` +
   ``role`` + ``\\x1f`` + its text (a string, or the ``text`` of its text
   parts joined by ``\\x1d``; any other part, an image for instance, stands
   as a short digest of its JSON). Other message fields (names, tool calls)
   and the request's other members (``tools``, sampling) are left out: the
   key is an approximation of the prompt, not the prompt. A completions
   ``prompt`` is its text, its strings joined by ``\\x1e``, or its token ids
   written out. A conversation's next turn starts with exactly the text of
   the turn before.
2. **Blocks.** The text is cut into blocks of ``block_chars`` characters
   (256 by default, about 64 tokens at the usual 4 characters a token: a
   cheap stand-in for the server's token blocks, which the proxy cannot
   see); only whole blocks count, and at most ``max_blocks`` of them (the
   beginning of a prompt is what a prefix cache can share).
3. **Chained hashes.** Block *i*'s hash covers the model name and blocks
   0..i (``hash((previous, block))``: Python's keyed 64-bit SipHash of the
   block, mixed with the previous block's hash), so a block matches only after
   the same whole prefix, as in the servers' own prefix caches. The hashes
   are the process's own (its hash key is drawn at start): what an index in
   this process needs, at a third of the cost of BLAKE2b. They are not meant
   to be shared with other processes.
4. **Session.** With a session key (a header or the body's ``user``), the
   key's hash is an extra leading block, chained into all the others: the
   requests of one session match each other whatever their prompts, and
   never another session's.

Pure functions and one small dataclass, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = ["MAX_SESSION_CHARS", "PromptKey", "prompt_key"]

MAX_SESSION_CHARS: Final = 256
"""A longer session key is cut to this many characters before it is hashed."""

_MESSAGE: Final = "\x1e"
_ROLE_END: Final = "\x1f"
_PART: Final = "\x1d"
_OPAQUE: Final = "\x1c"


@dataclass(frozen=True, slots=True)
class PromptKey:
    """One request's prompt as chained block hashes (Python hashes: 64-bit integers).

    ``blocks[i]`` covers the model, the session (when ``session``) and
    blocks 0..i; with ``session``, ``blocks[0]`` is the session key alone.
    Valid in this process only (see the module's docstring).
    Never empty: a prompt shorter than one block and without a session has
    no key at all.
    """

    blocks: tuple[int, ...]
    session: bool = False


def _digest(value: object) -> str:
    try:
        data = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        data = repr(type(value)).encode()
    return f"{_OPAQUE}{hash(data) & 0xFFFF_FFFF_FFFF_FFFF:016x}{_OPAQUE}"


def _content(value: object, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        for index, part in enumerate(value):
            if index:
                out.append(_PART)
            if isinstance(part, dict) and part.get("type") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text)
                    continue
            out.append(_digest(part))
    elif value is not None:
        out.append(_digest(value))


def _chat_text(messages: object, limit: int) -> str:
    if not isinstance(messages, list):
        return ""
    out: list[str] = []
    size = 0
    for message in messages:
        start = len(out)
        if isinstance(message, dict):
            role = message.get("role")
            out.append(_MESSAGE + (role if isinstance(role, str) else "?") + _ROLE_END)
            _content(message.get("content"), out)
        else:
            out.append(_MESSAGE + _digest(message))
        size += sum(len(piece) for piece in out[start:])
        if size >= limit:
            break
    return _joined(out, limit)


def _completion_text(prompt: object, limit: int) -> str:
    if isinstance(prompt, str):
        return prompt[:limit]
    if not isinstance(prompt, list) or not prompt:
        return ""
    out: list[str] = []
    size = 0
    for item in prompt:
        if isinstance(item, str):
            piece = item
        elif isinstance(item, int) and not isinstance(item, bool):
            piece = f"#{item} "
        elif isinstance(item, list):
            piece = "".join(
                f"#{t} " if isinstance(t, int) and not isinstance(t, bool) else _digest(t)
                for t in item
            )
        else:
            piece = _digest(item)
        out.append(_MESSAGE + piece)
        size += len(piece) + 1
        if size >= limit:
            break
    return _joined(out, limit)


def _joined(pieces: list[str], limit: int) -> str:
    """The first ``limit`` characters of ``pieces`` joined, without copying the rest."""
    size = 0
    for index, piece in enumerate(pieces):
        size += len(piece)
        if size >= limit:
            del pieces[index + 1 :]
            pieces[index] = piece[: len(piece) - (size - limit)]
            break
    return "".join(pieces)


def prompt_key(
    body: object,
    *,
    chat: bool,
    block_chars: int = 256,
    max_blocks: int = 64,
    session: str | None = None,
    turns: list[Any] | None = None,
) -> PromptKey | None:
    """The chained block hashes of a chat (``chat``) or completions request body.

    ``body`` is the parsed JSON; ``session`` the client's session key, if any; ``turns``
    the conversation as chat messages, when the request's dialect writes it otherwise
    (Messages' ``system``, the Responses API's ``instructions`` and ``input``).
    None when there is nothing to key on: not a JSON object, or a prompt
    shorter than one block and no session.
    """
    if not isinstance(body, dict) or block_chars < 1 or max_blocks < 1:
        return None
    model = body.get("model")
    chained = hash(("edgeproxy.prefix", model if isinstance(model, str) else None))
    blocks: list[int] = []
    if session:
        chained = hash((chained, "session", session[:MAX_SESSION_CHARS]))
        blocks.append(chained)
    limit = (max_blocks - len(blocks)) * block_chars
    if limit > 0:
        if chat:
            text = _chat_text(body.get("messages") if turns is None else turns, limit)
        else:
            text = _completion_text(body.get("prompt"), limit)
        end = len(text) // block_chars * block_chars
        for start in range(0, end, block_chars):
            chained = hash((chained, text[start : start + block_chars]))
            blocks.append(chained)
    if not blocks:
        return None
    return PromptKey(tuple(blocks), session=bool(session))
