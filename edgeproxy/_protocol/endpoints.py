"""The OpenAI endpoints the proxy knows, and what each one means to the stages.

This table is the one answer to "is this an LLM endpoint": admission reads
it to validate JSON bodies and estimate prompt tokens, failover to know
which POSTs may be retried, the cache which answers it may store, the local
model what it can answer, and the usage tracker which answers to scan for
``usage``.

A path names an endpoint when it ends with the endpoint's suffix: not only
``/v1/chat/completions``, but ``/openai/deployments/gpt-4o/chat/completions``
(Azure OpenAI) or ``/api/v1/chat/completions`` as well. The longest suffix
wins, so ``/v1/chat/completions`` is chat, never text completions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import Any, Final, Literal

from edgeproxy._protocol.dialects import CHAT, COUNT_TOKENS, OPENAI, Dialect
from edgeproxy._protocol.dialects import COMPLETIONS as COMPLETIONS_DIALECT
from edgeproxy._protocol.dialects import EMBEDDINGS as EMBEDDINGS_DIALECT
from edgeproxy._protocol.dialects import MESSAGES as MESSAGES_DIALECT
from edgeproxy._protocol.dialects import RESPONSES as RESPONSES_DIALECT

__all__ = [
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "EMBEDDINGS",
    "ENDPOINTS",
    "ENDPOINT_NAMED",
    "EndpointPaths",
    "MESSAGES",
    "MESSAGES_COUNT_TOKENS",
    "MODERATIONS",
    "OpenAIEndpoint",
    "Property",
    "REALTIME",
    "RESPONSES",
    "dialect_for",
    "endpoint_has",
    "endpoint_paths",
    "endpoint_suffixes",
    "openai_endpoint",
]

Property = Literal[
    "json_body", "usage", "retry_safe", "cacheable", "deterministic", "local", "websocket"
]


@dataclass(frozen=True, slots=True)
class OpenAIEndpoint:
    """One OpenAI endpoint (a POST) and the properties the stages act on."""

    name: str
    """The API's name for it: ``chat.completions``, ``embeddings``..."""
    suffix: str
    """How its paths end: ``/chat/completions``."""
    json_body: bool
    """The body is a JSON object: admission validates it (400) and reads it for the stages."""
    usage: bool
    """Answers carry token ``usage``: the prompt is estimated for token limits, then settled."""
    retry_safe: bool
    """A repeated POST only costs compute: when nothing came back, failover may retry it."""
    cacheable: bool
    """Answers may be cached when the dialect says the request is
    (:meth:`~edgeproxy._protocol.dialects.Dialect.cacheable`: deterministic, stateless)."""
    deterministic: bool
    """Every request is deterministic (no sampling): cacheable without temperature 0 or a seed."""
    local: bool
    """The local model can answer it."""
    dialect: Dialect = OPENAI
    """The API's wire semantics (:mod:`edgeproxy._protocol.dialects`): how its requests,
    streams and errors read and are written."""
    websocket: bool = False
    """A WebSocket API (the Realtime API): a session of JSON events both ways, whose
    wire semantics are :mod:`edgeproxy._protocol.realtime`'s, not a dialect's."""


def _charged(
    name: str, suffix: str, dialect: Dialect, *, deterministic: bool = False, local: bool = True
) -> OpenAIEndpoint:
    """An endpoint a model answers and charges tokens for: a JSON body with ``usage`` in its
    answers, retried when nothing came back, cacheable."""
    return OpenAIEndpoint(
        name,
        suffix,
        json_body=True,
        usage=True,
        retry_safe=True,
        cacheable=True,
        deterministic=deterministic,
        local=local,
        dialect=dialect,
    )


def _uncharged(
    name: str, suffix: str, *, deterministic: bool, dialect: Dialect = OPENAI
) -> OpenAIEndpoint:
    """An endpoint whose answers cost no tokens: as a charged one, but without ``usage``,
    never cached and never answered locally."""
    endpoint = _charged(name, suffix, dialect, deterministic=deterministic, local=False)
    return replace(endpoint, usage=False, cacheable=False)


CHAT_COMPLETIONS: Final = _charged("chat.completions", "/chat/completions", CHAT)
COMPLETIONS: Final = _charged("completions", "/completions", COMPLETIONS_DIALECT)
EMBEDDINGS: Final = _charged(
    "embeddings", "/embeddings", EMBEDDINGS_DIALECT, deterministic=True, local=False
)
# Cacheable only when nothing is stored or referred to (``store: false``, no
# previous_response_id, no conversation): the dialect says which. The local model answers
# only a request that refers to no stored state, and stores nothing.
RESPONSES: Final = _charged("responses", "/responses", RESPONSES_DIALECT)
# Answers carry no token usage: a moderation is not charged against token limits.
MODERATIONS: Final = _uncharged("moderations", "/moderations", deterministic=False)

# Anthropic's Messages API. Its path is matched whole from /v1 on: the Assistants API's
# /v1/threads/{id}/messages creates objects, and a retry would create two.
MESSAGES: Final = _charged("messages", "/v1/messages", MESSAGES_DIALECT)
# Counting a Messages request's tokens costs no tokens: passed through, never charged.
MESSAGES_COUNT_TOKENS: Final = _uncharged(
    "messages.count_tokens", "/v1/messages/count_tokens", deterministic=True, dialect=COUNT_TOKENS
)

# The Realtime API: a WebSocket handshake (a GET, or HTTP/2's extended CONNECT), then a
# session of events; usage comes in each response.done, never cached or retried.
REALTIME: Final = OpenAIEndpoint(
    "realtime",
    "/realtime",
    json_body=False,
    usage=True,
    retry_safe=False,
    cacheable=False,
    deterministic=False,
    local=False,
    websocket=True,
)

ENDPOINTS: Final[tuple[OpenAIEndpoint, ...]] = (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
    MODERATIONS,
    MESSAGES,
    MESSAGES_COUNT_TOKENS,
    REALTIME,
)

# The endpoints by name (a request's dialect, fixed at entry in its facts).
ENDPOINT_NAMED: Final[dict[str | None, OpenAIEndpoint]] = {e.name: e for e in ENDPOINTS}

_UNKNOWN: Final[Any] = object()

# Longest suffix first: "/chat/completions" must be tried before "/completions".
_BY_SUFFIX: Final = tuple(sorted(ENDPOINTS, key=lambda e: len(e.suffix), reverse=True))


# Paths already looked up: several stages ask about every request's path. Bounded,
# since paths come from clients: emptied when full.
_KNOWN_PATHS: dict[str, OpenAIEndpoint | None] = {}
_KNOWN_PATHS_MAX = 1024


def openai_endpoint(path: str) -> OpenAIEndpoint | None:
    """The endpoint ``path`` (without its query) names, or None for any other path."""
    try:
        return _KNOWN_PATHS[path]
    except KeyError:
        pass
    found = None
    for endpoint in _BY_SUFFIX:
        if path.endswith(endpoint.suffix):
            found = endpoint
            break
    if len(_KNOWN_PATHS) >= _KNOWN_PATHS_MAX:
        _KNOWN_PATHS.clear()
    _KNOWN_PATHS[path] = found
    return found


def dialect_for(path: str) -> Dialect:
    """The dialect of the endpoint ``path`` names; OpenAI's conventions for any other path."""
    endpoint = _KNOWN_PATHS.get(path, _UNKNOWN)
    if endpoint is _UNKNOWN:
        endpoint = openai_endpoint(path)
    return endpoint.dialect if endpoint is not None else OPENAI


def endpoint_has(path: str, prop: Property) -> bool:
    """Whether ``path`` names an endpoint with the property ``prop``."""
    endpoint = _KNOWN_PATHS.get(path, _UNKNOWN)
    if endpoint is _UNKNOWN:
        endpoint = openai_endpoint(path)
    return endpoint is not None and bool(getattr(endpoint, prop))


class EndpointPaths:
    """The paths of the endpoints with one property, as a container: ``path in paths``."""

    __slots__ = ("prop",)

    def __init__(self, prop: Property) -> None:
        self.prop: Property = prop

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str) and endpoint_has(path, self.prop)

    def __repr__(self) -> str:
        return f"EndpointPaths({self.prop!r}: {', '.join(endpoint_suffixes(self.prop))})"


@cache
def endpoint_paths(prop: Property) -> EndpointPaths:
    """The paths of the endpoints that have ``prop``, matched as :func:`openai_endpoint` does."""
    return EndpointPaths(prop)


@cache
def endpoint_suffixes(prop: Property) -> tuple[str, ...]:
    """The suffixes of the endpoints that have ``prop``, for ``str.endswith``.

    Right only while no endpoint without ``prop`` has a suffix ending with the
    suffix of one that has it (tests check the table for that); otherwise
    use :func:`endpoint_has`.
    """
    return tuple(e.suffix for e in _BY_SUFFIX if getattr(e, prop))
