"""Translation: a request of one API answered by a region that speaks only chat completions.

llama.cpp's servers, and many gateways, speak OpenAI's chat completions and nothing else.
A client of Anthropic's Messages API (``/v1/messages``, its token count) or of the Responses
API (a stateless request: nothing it refers to is stored) sent to such a region would get
the region's 404. Instead its request is translated (:func:`translate`): the region is
sent the chat completion request that asks the same, and the :class:`Translation` turns
the region's answer back into the client's API, whole or streamed, errors included, each
written by the client's dialect (:mod:`edgeproxy._protocol.dialects`). Nothing else of the
proxy sees chat: the upstream layer wraps the region's response in one that is already in
the client's API.

A stateful Responses request (``previous_response_id``, ``conversation``, stored prompts,
``item_reference`` items, ``background``) cannot be translated, since a chat server stores
nothing: it gets a 400 in the Responses API's shape saying so (:func:`cannot_store`).

Which APIs a region speaks is each region's (``[[regions]] apis``, else learnt from a 404
or 405 on first use, see :mod:`edgeproxy._upstream.apis`); the names here are the
endpoint table's (:mod:`edgeproxy._protocol.endpoints`).
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.bodies import estimate_prompt_tokens
from edgeproxy._protocol.dialects import COUNT_TOKENS, MESSAGES, RESPONSES, Dialect, dialect_named
from edgeproxy._protocol.dialects._base import loads
from edgeproxy._protocol.endpoints import ENDPOINT_NAMED
from edgeproxy._protocol.translate.answers import ChatStream, answer_text, error_of, head_for
from edgeproxy._protocol.translate.requests import (
    Untranslatable,
    count_request,
    messages_request,
    responses_request,
    untranslatable,
)

__all__ = [
    "API_ENDPOINTS",
    "CHAT",
    "TRANSLATED",
    "ChatStream",
    "Translation",
    "cannot_store",
    "translate",
]

CHAT: Final = "chat.completions"
"""The one API a translated request is sent in."""

TRANSLATED: Final = frozenset({"messages", "messages.count_tokens", "responses"})
"""The endpoints whose requests a region speaking chat completions can be sent."""

API_ENDPOINTS: Final[dict[str, tuple[str, ...]]] = {
    "chat": ("chat.completions",),
    "completions": ("completions",),
    "embeddings": ("embeddings",),
    "moderations": ("moderations",),
    "responses": ("responses",),
    "messages": ("messages", "messages.count_tokens"),
}
"""The names of ``[[regions]] apis``, as the endpoints each covers."""


def cannot_store(region: str, field: str) -> ProxyError:
    """The 400 of a Responses request that needs a stored response on a region speaking
    chat completions only."""
    return ProxyError(
        400,
        "invalid_request_error",
        f"region {region} speaks chat completions only and cannot store responses: a "
        f"request that refers to stored state ({field}) needs a region that serves the "
        "Responses API; send the conversation in input, with store: false",
        code="stateful_unsupported",
        param=field,
    )


def _stateful_field(body: dict[str, Any]) -> str | None:
    """The field that makes a Responses request need stored state, if one does."""
    refs = RESPONSES.state_refs(body)
    if refs:
        return refs[0][0]
    if body.get("background") is True:
        return "background"
    if body.get("prompt"):
        return "prompt"
    if RESPONSES.stateful(body):
        return "input"  # an item_reference
    return None


class Translation:
    """One request as the chat completion a region is sent (:attr:`body`, to
    :meth:`target`), and what the region's answer becomes in the client's API:
    :meth:`stream` for a streamed one, :meth:`whole` for a JSON answer, :meth:`error` for
    a refusal."""

    __slots__ = ("dialect", "body", "streams", "counts", "model", "prompt")

    def __init__(self, dialect: Dialect, body: dict[str, Any], model: str) -> None:
        self.dialect = dialect
        self.body = body
        self.streams = body.get("stream") is True
        self.counts = dialect is COUNT_TOKENS
        self.model = model  # the client's name, as its answer says it
        self.prompt = estimate_prompt_tokens(body)

    def sent(self) -> bytes:
        """The body the region is sent."""
        return orjson.dumps(self.body)

    def target(self, path: str) -> str:
        """The chat completions path beside the client's ``path`` (same prefix, no query)."""
        endpoint = ENDPOINT_NAMED[self.dialect.name]
        prefix = path[: len(path) - len(endpoint.suffix)]
        return prefix + (
            "/v1/chat/completions" if endpoint.suffix.startswith("/v1/") else "/chat/completions"
        )

    @property
    def content_type(self) -> str:
        """The content type of a good answer in the client's API."""
        return "text/event-stream" if self.streams else "application/json"

    def stream(self) -> ChatStream:
        """The reader of the region's stream, writing the client's."""
        return ChatStream(self.dialect, head_for(self.dialect, self.model), self.prompt)

    def whole(self, body: bytes) -> tuple[int, bytes]:
        """A region's JSON answer (a 2xx) as the client's: its status and body; a 502 in
        the client's shape for one that is no chat completion."""
        obj = loads(body)
        if self.counts:
            usage = obj.get("usage") if isinstance(obj, dict) else None
            count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            if not isinstance(count, int) or isinstance(count, bool):
                count = self.prompt  # a region that counts nothing: the estimate
            return 200, orjson.dumps({"input_tokens": count})
        text = answer_text(obj, head_for(self.dialect, self.model), self.prompt)
        if text is None:
            return 502, self.error(
                502, b'{"error": {"message": "the region\'s answer is no chat completion"}}'
            )
        if self.streams:
            # A region that answered a stream with a whole completion: written as one.
            return 200, b"".join(self.dialect.written(text))
        return 200, orjson.dumps(self.dialect.answer(text))

    def error(self, status: int, body: bytes) -> bytes:
        """A region's refusal (its status and body) in the client's API's error shape."""
        return error_of(self.dialect, status, body)


def translate(
    name: str | None, body: Any, *, model: str | None, region: str, method: str
) -> Translation | ProxyError | None:
    """The chat completion ``body`` (a request of the endpoint ``name``) becomes for
    ``region``, which continues a chat by ``method``; ``model``: the region's name for
    the requested model (its alias), None for the name the client sent. A 400 (in the
    client's API) when it cannot be translated; None for an endpoint that is not."""
    if name not in TRANSLATED or not isinstance(body, dict):
        return None
    dialect = dialect_named(name)
    sent = body.get("model")
    client_model = sent if isinstance(sent, str) else ""
    target = model or client_model
    try:
        if dialect is RESPONSES:
            field = _stateful_field(body)
            if field is not None:
                return cannot_store(region, field)
            chat = responses_request(body, model=target)
        elif dialect is MESSAGES:
            chat = messages_request(body, model=target, method=method)
        else:
            chat = count_request(body, model=target)
    except Untranslatable as err:
        return untranslatable(err, region)
    return Translation(dialect, chat, client_model)
