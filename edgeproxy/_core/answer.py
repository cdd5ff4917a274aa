"""One shape for the answers the proxy makes itself.

A cache entry, a coalesced flight, the stale rung and the local model answer with an
:class:`Answer`: a head (status, headers, whether it is an SSE stream) and a body, whole
(``body``, ``parts``) or piece by piece (``chunks``). Nothing that makes an answer writes
it: the :class:`~edgeproxy._answer.responder.Responder` alone sends it downstream, and
records what it sent on the request's outcome. The same Responder relays a region's answer
straight from its attempt (whose head the hooks may still edit, and whose body is read
with no layer between), writes the errors in the client's API, and passes a plugin's own
response through.

A body that streams may end broken: its iterator raises :class:`AnswerBroken`, with the
error the client's API reads as the stream's end; the Responder writes it as that API's
error event and ends the answer so that it cannot pass for complete.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

from edgeproxy._core.errors import ProxyError
from edgeproxy._core.response import ReadyStream, Response, StreamResponse
from edgeproxy._core.types import Headers

__all__ = ["Answer", "AnswerBroken"]


class AnswerBroken(Exception):
    """An answer's body could not go on: ``error`` is the client's to read, as its API's
    error event numbered after the ``sequence`` events already sent."""

    def __init__(self, error: ProxyError, sequence: int = 0, reason: str = "") -> None:
        super().__init__(error.message)
        self.error = error
        self.sequence = sequence
        self.reason = reason or error.message


class Answer(NamedTuple):
    """What answers one request, before anything of it is sent.

    ``source`` says what made it: ``cache``, ``coalesced``, ``local``, ``error``
    (a region's answer is relayed from its attempt). At most one of ``body`` (the whole
    body, known now), ``parts`` (the whole body as the events it was recorded in, each sent
    as its own piece), ``chunks`` (the body piece by piece as it comes) and ``make`` (the
    whole body, made before the head goes, so that a failure is still a clean error
    answer) is set; with none, the body is empty.

    ``usage``, when set, is read once the body was sent: the answer's own token counts.
    ``release`` is called on every way out, sent or not: what the answer held (a local
    model's generation slot, a follower's place) is let go of.

    A named tuple: immutable, and built in a fraction of a class's time (a cache hit makes
    one per request).
    """

    status: int
    headers: Headers
    source: str
    body: bytes | None = None
    parts: list[bytes] | None = None
    chunks: AsyncIterator[bytes] | None = None
    make: Callable[[], Awaitable[bytes]] | None = None
    sse: bool = False
    usage: Callable[[], dict[str, Any] | None] | None = None
    release: Callable[[], None] | None = None

    def ready(self, body: bytes | None = None) -> StreamResponse:
        """A whole answer (its ``body``, or ``body`` given here) as a response ready to
        send: its head and its body, framed by the front end in one go (an SSE body as a
        stream with no length)."""
        if self.parts is not None:
            return ReadyStream(status=self.status, parts=self.parts, headers=self.headers)
        if body is None:
            body = self.body or b""
        if self.sse:
            return ReadyStream(status=self.status, parts=[body], headers=self.headers)
        return Response(status=self.status, body=body, headers=self.headers)
