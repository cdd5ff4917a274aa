"""Each API's wire semantics, one dialect each: chat completions, completions, the Responses
API, Anthropic Messages and embeddings (see :mod:`._base` for what a dialect is)."""

from __future__ import annotations

from typing import Final

from edgeproxy._protocol.dialects._base import (
    REGION_METHOD,
    AnswerText,
    Dialect,
    Piece,
    Seam,
    StreamWriter,
    tokens,
)
from edgeproxy._protocol.dialects.chat import CHAT, COMPLETIONS
from edgeproxy._protocol.dialects.embeddings import EMBEDDINGS
from edgeproxy._protocol.dialects.messages import COUNT_TOKENS, MESSAGES
from edgeproxy._protocol.dialects.responses import RESPONSES

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "COUNT_TOKENS",
    "DIALECTS",
    "EMBEDDINGS",
    "MESSAGES",
    "OPENAI",
    "REGION_METHOD",
    "RESPONSES",
    "AnswerText",
    "Dialect",
    "Piece",
    "Seam",
    "StreamWriter",
    "dialect_named",
    "tokens",
]

OPENAI: Final = Dialect()
"""What the proxy speaks to a request of no dialect (plain HTTP, moderations): OpenAI's
error shape, SSE comments as heartbeats."""

DIALECTS: Final[dict[str, Dialect]] = {
    d.name: d for d in (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES, COUNT_TOKENS)
}


def dialect_named(name: str | None) -> Dialect:
    """The dialect a request's facts name (``facts.dialect``); :data:`OPENAI` for None or a
    name of no dialect."""
    return DIALECTS.get(name, OPENAI) if name is not None else OPENAI
