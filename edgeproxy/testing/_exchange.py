"""One request/response of the fake region: the ASGI plumbing under every route.

:class:`Exchange` reads the request body, watches for the client leaving and
writes a :class:`Reply`, applying the response-side faults (slow headers,
resets, stalled bodies) on the way.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

import orjson

from edgeproxy.testing import _content as content
from edgeproxy.testing._behavior import Behavior, Fault
from edgeproxy.testing._hypercorn import StreamHandle

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

MAX_REQUEST_BODY: Final = 16 * 2**20

_JSON: Final = (b"content-type", b"application/json")


@dataclass(slots=True)
class Generation:
    """What a chat or completions request asks the model to do (for the KV and queue model)."""

    request: dict[str, Any]
    chat: bool
    completion_tokens: int


@dataclass(slots=True)
class Reply:
    status: int
    headers: Headers
    parts: list[bytes]
    first_delay: float = 0.0
    gap: float = 0.0
    # The first ``gap_units`` parts are separated by ``gap``; later parts (an
    # SSE stream's closing events) follow without delay.
    gap_units: int = 0
    # Set on chat and completions answers: the region queues them and models their TTFT.
    generation: Generation | None = None
    # Headers computed when the response starts, after ``first_delay`` (load reports).
    late_headers: Callable[[], Headers] | None = None
    # Parts sent with the headers, before ``first_delay`` and the tokens: the opening
    # events of a Responses or Messages stream (``response.created``, ``message_start``),
    # which servers send before the first token. A reset counts tokens after them.
    lead_parts: int = 0
    # The in-band error event that replaces the rest of a stream under the
    # ``stream_error`` fault, given the index of the part it replaces; ``None`` for
    # answers that have no such event (they get the ``5xx`` fault instead).
    stream_error: Callable[[int], bytes] | None = None
    # Called with the prompt tokens the KV model found cached, before the answer
    # starts: answers that report cached tokens in their usage rebuild ``parts``.
    with_cache: Callable[[int], None] | None = None
    # Called once nothing but the answer's last part is left to write (a stateful API
    # stores it then, so that a client holding the whole answer finds it stored).
    on_complete: Callable[[], None] | None = None


def json_reply(status: int, payload: object) -> Reply:
    body = orjson.dumps(payload)
    return Reply(status, [_JSON, (b"content-length", str(len(body)).encode())], [body])


def set_json(reply: Reply, payload: object) -> None:
    """Replace a JSON reply's body (and its ``content-length``)."""
    body = orjson.dumps(payload)
    reply.parts = [body]
    reply.headers = [
        (b"content-length", str(len(body)).encode()) if key == b"content-length" else (key, value)
        for key, value in reply.headers
    ]


def error_reply(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    *,
    param: str | None = None,
    code: str | None = None,
) -> Reply:
    body = content.error_body(message, type_=type_, param=param, code=code)
    return Reply(status, [_JSON, (b"content-length", str(len(body)).encode())], [body])


class ClientGone(Exception):
    """The client disconnected; unwinds a handler."""


class BadRequest(Exception):
    """A request the fake answers with a 4xx error (OpenAI's shape, or Anthropic's on
    the Messages API); ``type_``, ``param`` and ``code`` fill in the OpenAI body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type_ = type_
        self.param = param
        self.code = code


def joined_text(
    value: object, text_types: frozenset[str], *, not_list: str, not_object: str
) -> str | list[Any]:
    """A message's content as a conversation holds it: its text (a string, or the text of
    its text parts, joined), or the parts as given when some are not text (an image, a
    tool result), so that they still change the answer. ``BadRequest`` with ``not_list`` or
    ``not_object`` (each API words them its own way) for a malformed one."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRequest(not_list)
    texts: list[str] = []
    for part in value:
        if not isinstance(part, dict):
            raise BadRequest(not_object)
        text = part.get("text")
        if part.get("type") not in text_types or not isinstance(text, str):
            return value
        texts.append(text)
    return "".join(texts)


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest("request body must be a JSON object")
    return value


class ExchangeRegion(Protocol):
    """What an exchange uses of its :class:`~edgeproxy.testing._app.RegionApp`: a Protocol, as
    the app's module imports this one to answer requests."""

    @property
    def region_header(self) -> tuple[bytes, bytes]: ...

    async def wait_stopping(self) -> None: ...


class Exchange:
    """One request/response, with the disconnect and fault plumbing."""

    def __init__(
        self,
        app: ExchangeRegion,
        scope: Scope,
        receive: Receive,
        send: Send,
        handle: StreamHandle | None,
    ) -> None:
        self.app = app
        self.scope = scope
        self.path: str = scope["path"]
        self.method: str = scope["method"]
        raw_path = scope.get("raw_path")
        self.raw_path = raw_path.decode("latin-1") if raw_path else self.path
        self.query_string: str = scope.get("query_string", b"").decode("latin-1")
        self.receive = receive
        self.send = send
        self.handle = handle
        self.close_connection = False
        self.cancelled = False
        # Once the response is complete or deliberately aborted, a disconnect
        # is expected and must not cancel the handler or count as a cancel.
        self._settled = False
        self._task: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._gone = asyncio.Event()
        self._cancel_requested = False
        # Completion tokens of a generated answer that were written out.
        self.tokens_sent = 0

    async def run(self, handler: Awaitable[None]) -> None:
        """Run ``handler``, turning a client disconnect into a normal return."""
        self._task = asyncio.current_task()
        try:
            await handler
        except ClientGone:
            self.cancelled = True
        except asyncio.CancelledError:
            assert self._task is not None
            if self._cancel_requested and self._task.uncancel() == 0:
                self.cancelled = True
            else:
                raise
        finally:
            if self._watcher is not None:
                self._watcher.cancel()

    def header(self, name: bytes) -> bytes | None:
        """The first value of request header ``name`` (lower case), if any."""
        for key, value in self.scope["headers"]:
            if key == name:
                return bytes(value)
        return None

    # -- request body ---------------------------------------------------

    async def read_body(self) -> bytes:
        """The whole request body; ``BadRequest`` (413) past ``MAX_REQUEST_BODY``.

        The body is always read to its end, even when it is refused: see the
        hypercorn note in ``RegionApp._http``.
        """
        body = bytearray()
        too_large = False
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            if not too_large:
                body += message.get("body", b"")
                too_large = len(body) > MAX_REQUEST_BODY
            if not message.get("more_body", False):
                if too_large:
                    raise BadRequest("request body too large", status=413)
                return bytes(body)

    async def consume_body(self) -> tuple[int, str]:
        """Read the body without keeping it; return its length and sha256."""
        hasher = hashlib.sha256()
        length = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            hasher.update(chunk)
            length += len(chunk)
            if not message.get("more_body", False):
                return length, hasher.hexdigest()

    def watch_disconnect(self) -> None:
        """From now on, a client disconnect cancels the handler."""
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                break
        self._gone.set()
        if not self._settled and self._task is not None and not self._task.done():
            self._cancel_requested = True
            self._task.cancel()

    # -- response -------------------------------------------------------

    async def pause(self, seconds: float) -> None:
        if self._gone.is_set() and not self._settled:
            raise ClientGone
        if seconds > 0:
            await asyncio.sleep(seconds)

    async def hang(self) -> None:
        """Wait for the client to leave (which cancels us) or the region to stop."""
        await self.app.wait_stopping()
        await self.abort()

    async def abort(self, error_code: int | None = None) -> None:
        """Reset the response (HTTP/2) or drop the connection (HTTP/1.1)."""
        self._settled = True
        if self.handle is None:
            return  # without hypercorn's internals, ending the handler is all we can do
        if error_code is None:
            await self.handle.reset()
        else:
            await self.handle.reset(error_code)
        if not self.handle.http2:
            # Hypercorn would answer 500 on a connection whose request
            # handler returns early; wait until it has noticed the close.
            try:
                await asyncio.wait_for(self._gone.wait(), 5.0)
            except TimeoutError:
                pass

    async def start(self, status: int, headers: Headers) -> None:
        headers = [*headers, self.app.region_header]
        if self.close_connection:
            headers.append((b"connection", b"close"))
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, data: bytes, *, more: bool) -> None:
        if not more:
            self._settled = True
        await self._send({"type": "http.response.body", "body": data, "more_body": more})
        if more and self.handle is not None:
            await self.handle.flush()

    async def _send(self, message: Message) -> None:
        if self._gone.is_set() and not self._settled:
            raise ClientGone
        try:
            await self.send(message)
        except (OSError, RuntimeError) as exc:
            # Hypercorn lets a write to a connection the client just closed
            # surface as one of these; the disconnect watcher has not run yet.
            raise ClientGone from exc

    async def send_reply(self, reply: Reply, fault: Fault | None, behavior: Behavior) -> None:
        parts = reply.parts
        if fault in ("reset", "stall_body") and len(parts) == 1 and len(parts[0]) >= 2:
            half = len(parts[0]) // 2
            parts = [parts[0][:half], parts[0][half:]]

        lead = reply.lead_parts
        delay = reply.first_delay
        slow = behavior.slow_headers_delay if fault == "slow_headers" else 0.0
        # With lead parts, the modelled TTFT comes after them, before the first token.
        await self.pause(slow if lead else delay + slow)

        cut = None  # the part a reset or an in-band error replaces
        if fault == "reset":
            cut = min(behavior.fault_after_tokens + lead, max(len(parts) - 1, 0))
            if cut == 0:
                await self.abort()
                return
        elif fault == "stream_error" and reply.stream_error is not None:
            cut = min(behavior.fault_after_tokens, reply.gap_units) + lead

        headers = reply.headers
        if reply.late_headers is not None:
            headers = [*headers, *reply.late_headers()]
        await self.start(reply.status, headers)
        if fault == "stall_body":
            await self.write(parts[0] if parts else b"", more=True)
            await self.hang()
            return
        tokens_end = lead + reply.gap_units
        for index, part in enumerate(parts):
            if lead and index == lead:
                await self.pause(delay)
            elif lead < index < tokens_end:
                await self.pause(reply.gap)
            if index == cut:
                if reply.stream_error is not None and fault == "stream_error":
                    await self.write(reply.stream_error(index), more=False)
                else:
                    await self.abort()
                return
            last = index == len(parts) - 1
            if last and reply.on_complete is not None:
                # Done before the last part goes out, as a server stores an answer before
                # its end: a client that has the end may already refer to it.
                reply.on_complete()
            await self.write(part, more=not last)
            if lead <= index < tokens_end and reply.generation is not None:
                self.tokens_sent += 1
        if not parts:
            if reply.on_complete is not None:
                reply.on_complete()
            await self.write(b"", more=False)
        if reply.gap_units == 0 and reply.generation is not None:
            self.tokens_sent = reply.generation.completion_tokens  # a JSON answer, sent whole
