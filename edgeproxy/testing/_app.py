"""The fake region's ASGI application: routes, fault injection and counters.

It runs on the region's own event loop thread. Counters are written there
and read from the test's thread, hence the lock around them.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, TypeVar
from urllib.parse import parse_qs

import orjson

from edgeproxy.testing import _content as content
from edgeproxy.testing._behavior import Behavior, Fault, behavior_from_mapping
from edgeproxy.testing._hypercorn import HTTP_1_1_REQUIRED, REFUSED_STREAM, StreamHandle

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

MAX_TOKENS: Final = 100_000
MAX_ECHO_SIZE: Final = 256 * 2**20
MAX_REQUEST_BODY: Final = 16 * 2**20
_ECHO_PART: Final = 64 * 2**10
_ECHO_PATTERN: Final = bytes(range(33, 127))  # printable, so bodies are easy to eyeball
_CONNECTIONS_PRUNE_AT: Final = 512

_JSON: Final = (b"content-type", b"application/json")


@dataclass(frozen=True, slots=True)
class Counters:
    """A snapshot of what a region has seen since it was built or last reset.

    Requests to ``/_control`` are not counted anywhere.
    """

    requests_total: int = 0
    """Requests that reached the application (refused streams excluded)."""
    requests_by_path: Mapping[str, int] = field(default_factory=dict)
    requests_by_http_version: Mapping[str, int] = field(default_factory=dict)
    """Keyed by ASGI ``http_version``: ``"1.1"`` or ``"2"``."""
    in_flight: int = 0
    """Requests being answered now (a gauge; a reset does not zero it)."""
    peak_in_flight: int = 0
    cancelled_total: int = 0
    """Requests whose client went away before the response was complete."""
    faults_total: int = 0
    """Requests that got the configured fault (a GOAWAY counts once)."""
    refused_total: int = 0
    """HTTP/2 streams refused (REFUSED_STREAM) after this region sent GOAWAY,
    or because the region is HTTP/1.1-only."""
    connections_total: int = 0
    """Distinct client connections that carried at least one request. A
    connection is identified by the client's (host, port)."""
    peak_streams_per_connection: int = 0
    """Most requests seen in flight at once on one connection."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests_total": self.requests_total,
            "requests_by_path": dict(self.requests_by_path),
            "requests_by_http_version": dict(self.requests_by_http_version),
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "cancelled_total": self.cancelled_total,
            "faults_total": self.faults_total,
            "refused_total": self.refused_total,
            "connections_total": self.connections_total,
            "peak_streams_per_connection": self.peak_streams_per_connection,
        }


class _Connection:
    __slots__ = (
        "epoch",
        "requests",
        "in_flight",
        "max_stream_id",
        "goaway_claimed",
        "goaway_stream_id",
        "closing",
        "handle",
    )

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.requests = 0
        self.in_flight = 0
        self.max_stream_id = 0
        self.goaway_claimed = False
        self.goaway_stream_id: int | None = None
        self.closing = False
        self.handle: StreamHandle | None = None


@dataclass(slots=True)
class _Reply:
    status: int
    headers: Headers
    parts: list[bytes]
    first_delay: float = 0.0
    gap: float = 0.0
    # The first ``gap_units`` parts are separated by ``gap``; later parts (an
    # SSE stream's closing events) follow without delay.
    gap_units: int = 0


class _ClientGone(Exception):
    """The client disconnected; unwinds a handler."""


class BadRequest(Exception):
    """A request the fake answers with a 4xx OpenAI error."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RegionApp:
    """The ASGI application of one fake region."""

    def __init__(
        self,
        name: str,
        behavior: Behavior,
        *,
        model: str,
        http1_only: bool = False,
        seed: int | None = None,
    ) -> None:
        self.name = name
        self.behavior = behavior
        self.model = model
        self.http1_only = http1_only
        self._rng = random.Random(seed)
        self._region_header = (b"x-fake-region", name.encode("utf-8"))
        self._lock = threading.Lock()
        self._epoch = 0
        self._requests_total = 0
        self._by_path: dict[str, int] = {}
        self._by_version: dict[str, int] = {}
        self._in_flight = 0
        self._peak_in_flight = 0
        self._cancelled = 0
        self._faults = 0
        self._refused = 0
        self._connections_seen = 0
        self._peak_streams = 0
        self._connections: dict[object, _Connection] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._stop_event: asyncio.Event | None = None
        self._idle_event: asyncio.Event | None = None
        self._on_startup: Callable[[], None] | None = None

    # -- lifecycle, called on the server loop ------------------------------

    def begin_run(self, on_startup: Callable[[], None]) -> None:
        """Prepare for a new serving run on the current loop."""
        self._stopping = False
        # Events bind to the loop that first waits on them; each run has its own loop.
        self._stop_event = asyncio.Event()
        self._idle_event = asyncio.Event()
        self._on_startup = on_startup
        self._connections.clear()

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def region_header(self) -> tuple[bytes, bytes]:
        return self._region_header

    async def wait_stopping(self) -> None:
        """Return once the region has begun to stop and no longer accepts connections."""
        if not self._stopping and self._stop_event is not None:
            await self._stop_event.wait()
        for conn in list(self._connections.values()):
            if conn.handle is not None:
                await conn.handle.wait_server_terminated()
                return

    def begin_stop(self) -> None:
        """Stop: stalled requests abort now; others may finish until :meth:`abort_all`."""
        self._stopping = True
        if self._stop_event is not None:
            self._stop_event.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        while self._in_flight > 0:
            assert self._idle_event is not None
            self._idle_event.clear()
            await self._idle_event.wait()

    def abort_all(self) -> None:
        """Drop every connection that carried a request."""
        for conn in self._connections.values():
            if conn.handle is not None and not conn.handle.is_closing():
                conn.handle.abort()

    # -- counters, any thread -----------------------------------------------

    def counters(self) -> Counters:
        with self._lock:
            return Counters(
                requests_total=self._requests_total,
                requests_by_path=MappingProxyType(dict(self._by_path)),
                requests_by_http_version=MappingProxyType(dict(self._by_version)),
                in_flight=self._in_flight,
                peak_in_flight=self._peak_in_flight,
                cancelled_total=self._cancelled,
                faults_total=self._faults,
                refused_total=self._refused,
                connections_total=self._connections_seen,
                peak_streams_per_connection=self._peak_streams,
            )

    def reset_counters(self) -> None:
        with self._lock:
            self._epoch += 1
            self._requests_total = 0
            self._by_path.clear()
            self._by_version.clear()
            self._peak_in_flight = self._in_flight
            self._cancelled = 0
            self._faults = 0
            self._refused = 0
            self._connections_seen = 0
            self._peak_streams = 0

    def _count_fault(self) -> None:
        with self._lock:
            self._faults += 1

    # -- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
                if self._on_startup is not None:
                    self._on_startup()
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if path == "/_control" or path.startswith("/_control/"):
            await self._control(_Exchange(self, scope, receive, send, None))
            return

        handle = StreamHandle.from_send(send)
        key = scope.get("client") or (handle.connection_key if handle else None)
        conn = self._connections.get(key)
        if conn is None:
            conn = self._new_connection(key)
        if handle is not None:
            conn.handle = handle
        ex = _Exchange(self, scope, receive, send, handle)

        if handle is not None and handle.http2:
            refuse: int | None = None
            if self.http1_only:
                refuse = HTTP_1_1_REQUIRED
            elif conn.goaway_stream_id is not None and handle.stream_id > conn.goaway_stream_id:
                # The client sent this before it saw our GOAWAY; RFC 9113
                # lets it retry a refused stream anywhere.
                refuse = REFUSED_STREAM
            if refuse is not None:
                with self._lock:
                    self._refused += 1
                # Hypercorn (0.18) crashes the whole connection with a KeyError
                # if body frames arrive for a stream whose handler has already
                # returned, so take the body in before refusing.
                try:
                    await ex.read_body()
                except (_ClientGone, BadRequest):
                    pass
                await handle.reset(refuse)
                return

        behavior = self.behavior  # one consistent snapshot for this request
        fault = self._draw_fault(behavior, path)
        self._enter(conn, path, scope["http_version"], handle)
        try:
            goaway = False
            if fault == "goaway":
                fault = None
                if conn.requests >= behavior.goaway_after and not conn.goaway_claimed:
                    conn.goaway_claimed = goaway = True
                    self._count_fault()
                    ex.close_connection = handle is None or not handle.http2
            elif fault is not None:
                self._count_fault()
            await ex.run(self._handle(ex, behavior, fault))
            if goaway and handle is not None and handle.http2:
                # Sent after this response rather than before it: clients such
                # as httpx fail every open stream when GOAWAY arrives, even
                # those it names as processed. Every stream accepted so far is
                # still answered; later ones are refused.
                conn.goaway_stream_id = conn.max_stream_id
                await handle.send_goaway(conn.max_stream_id)
        finally:
            self._leave(conn)
            if ex.cancelled and not self._stopping:
                with self._lock:
                    self._cancelled += 1

    def _new_connection(self, key: object) -> _Connection:
        if len(self._connections) >= _CONNECTIONS_PRUNE_AT:
            # Forget finished connections so long runs do not grow this without bound.
            for old_key, old in list(self._connections.items()):
                if old.in_flight == 0 and (old.handle is None or old.handle.is_closing()):
                    del self._connections[old_key]
        conn = self._connections[key] = _Connection(epoch=-1)
        return conn

    def _draw_fault(self, behavior: Behavior, path: str) -> Fault | None:
        if behavior.fault is None or not behavior.applies_to(path):
            return None
        # Only draw when the rate is below one, so that a seeded sequence
        # depends on the requests that can actually be spared.
        if behavior.fault_rate < 1.0 and self._rng.random() >= behavior.fault_rate:
            return None
        return behavior.fault

    def _enter(
        self, conn: _Connection, path: str, http_version: str, handle: StreamHandle | None
    ) -> None:
        if handle is not None:
            conn.max_stream_id = max(conn.max_stream_id, handle.stream_id)
        with self._lock:
            if conn.epoch != self._epoch:
                conn.epoch = self._epoch
                self._connections_seen += 1
            conn.requests += 1
            conn.in_flight += 1
            self._requests_total += 1
            self._by_path[path] = self._by_path.get(path, 0) + 1
            self._by_version[http_version] = self._by_version.get(http_version, 0) + 1
            self._in_flight += 1
            self._peak_in_flight = max(self._peak_in_flight, self._in_flight)
            self._peak_streams = max(self._peak_streams, conn.in_flight)

    def _leave(self, conn: _Connection) -> None:
        with self._lock:
            conn.in_flight -= 1
            self._in_flight -= 1
        if self._in_flight == 0 and self._idle_event is not None:
            self._idle_event.set()
        if (
            conn.goaway_stream_id is not None
            and conn.in_flight == 0
            and not conn.closing
            and conn.handle is not None
        ):
            conn.closing = True
            task = asyncio.get_running_loop().create_task(conn.handle.close_when_flushed())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # -- request handling ----------------------------------------------------

    async def _handle(self, ex: _Exchange, behavior: Behavior, fault: Fault | None) -> None:
        echo = ex.path.startswith("/echo/") or ex.path == "/echo"
        reply: _Reply | None = None
        body = b""
        try:
            if echo:
                length, sha256 = await ex.consume_body()
            else:
                body = await ex.read_body()
        except BadRequest as exc:
            reply = self._error(exc.status, str(exc))
        ex.watch_disconnect()

        if fault == "stall":
            await ex.hang()
            return
        if fault == "5xx":
            status = behavior.fault_status
            message = f"fake region {self.name}: injected {status}"
            await ex.send_reply(self._error(status, message, "server_error"), None, behavior)
            return

        if reply is None:
            try:
                reply = self._echo(ex, length, sha256) if echo else self._route(ex, body, behavior)
            except BadRequest as exc:
                reply = self._error(exc.status, str(exc))
        await ex.send_reply(reply, fault, behavior)

    def _route(self, ex: _Exchange, body: bytes, behavior: Behavior) -> _Reply:
        path, method = ex.path, ex.method
        if path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            _require_method(method, "POST")
            request = _parse_json_object(body)
            if path == "/v1/embeddings":
                return self._embeddings(request, behavior)
            return self._completion(request, behavior, chat=path == "/v1/chat/completions")
        if path == "/v1/models":
            _require_method(method, "GET", "HEAD")
            models = {
                "object": "list",
                "data": [
                    {"id": self.model, "object": "model", "created": 0, "owned_by": "edgeproxy"}
                ],
            }
            return self._json(200, models)
        if path == "/healthz":
            _require_method(method, "GET", "HEAD")
            return self._json(200, {"status": "ok"})
        if path.startswith("/status/"):
            return self._status(path.removeprefix("/status/"))
        raise BadRequest(f"no route for {method} {path}", status=404)

    def _completion(self, request: dict[str, Any], behavior: Behavior, *, chat: bool) -> _Reply:
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
        model = model if isinstance(model, str) and model else self.model

        words = list(content.tokens(content.digest(prompt), n_tokens))
        usage = content.usage(max(1, content.count_words(prompt)), n_tokens)
        created = int(time.time())
        id_ = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)

        if not stream:
            text = "".join(words)
            payload = (
                content.chat_completion(id_, created, model, text, usage)
                if chat
                else content.text_completion(id_, created, model, text, usage)
            )
            reply = self._json(200, payload)
            reply.first_delay = behavior.ttft
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
        if isinstance(options, dict) and options.get("include_usage") is True:
            obj = "chat.completion.chunk" if chat else "text_completion"
            parts.append(content.usage_chunk(id_, created, model, obj, usage))
        parts.append(content.SSE_DONE)
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        return _Reply(
            200,
            headers,
            parts,
            first_delay=behavior.ttft,
            gap=behavior.inter_token_delay,
            gap_units=len(words),
        )

    def _embeddings(self, request: dict[str, Any], behavior: Behavior) -> _Reply:
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
            "model": model if isinstance(model, str) and model else self.model,
            "usage": {
                "prompt_tokens": content.count_words(inputs),
                "total_tokens": content.count_words(inputs),
            },
        }
        reply = self._json(200, payload)
        reply.first_delay = behavior.ttft
        return reply

    def _echo(self, ex: _Exchange, length: int, sha256: str) -> _Reply:
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
                "region": self.name,
                "method": ex.method,
                "path": ex.path,
                "raw_path": ex.raw_path,
                "query_string": ex.query_string,
                "http_version": ex.scope["http_version"],
                "headers": [
                    [k.decode("latin-1"), v.decode("latin-1")] for k, v in ex.scope["headers"]
                ],
                "body_length": length,
                "body_sha256": sha256,
            }
            reply = self._json(200, payload)
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
        return _Reply(200, headers, parts, gap=delay or 0.0, gap_units=len(parts))

    def _status(self, raw: str) -> _Reply:
        try:
            status = int(raw)
        except ValueError:
            raise BadRequest(f"not a status code: {raw!r}") from None
        if not 200 <= status <= 599:
            raise BadRequest(f"status must be 200-599, not {status}")
        if status in (204, 304):
            return _Reply(status, [], [])
        return self._json(status, {"status": status})

    def _json(self, status: int, payload: object) -> _Reply:
        body = orjson.dumps(payload)
        return _Reply(status, [_JSON, (b"content-length", str(len(body)).encode())], [body])

    def _error(self, status: int, message: str, type_: str = "invalid_request_error") -> _Reply:
        body = content.error_body(message, type_=type_)
        return _Reply(status, [_JSON, (b"content-length", str(len(body)).encode())], [body])

    # -- /_control -----------------------------------------------------------

    async def _control(self, ex: _Exchange) -> None:
        try:
            body = await ex.read_body()
            if ex.path == "/_control" and ex.method == "GET":
                reply = self._json(200, self.control_state())
            elif ex.path == "/_control" and ex.method == "POST":
                self.behavior = behavior_from_mapping(self.behavior, _parse_json_object(body))
                reply = self._json(200, self.control_state())
            elif ex.path == "/_control/reset-counters" and ex.method == "POST":
                self.reset_counters()
                reply = self._json(200, self.control_state())
            else:
                raise BadRequest(f"no route for {ex.method} {ex.path}", status=404)
        except BadRequest as exc:
            reply = self._error(exc.status, str(exc))
        except ValueError as exc:  # a rejected Behavior field
            reply = self._error(400, str(exc))
        await ex.send_reply(reply, None, self.behavior)

    def control_state(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "behavior": self.behavior.to_dict(),
            "counters": self.counters().to_dict(),
        }


def _require_method(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise BadRequest(f"method {method} not allowed; use {' or '.join(allowed)}", status=405)


def _parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest("request body must be a JSON object")
    return value


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


class _Exchange:
    """One request/response, with the disconnect and fault plumbing."""

    def __init__(
        self,
        app: RegionApp,
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

    async def run(self, handler: Awaitable[None]) -> None:
        """Run ``handler``, turning a client disconnect into a normal return."""
        self._task = asyncio.current_task()
        try:
            await handler
        except _ClientGone:
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
                raise _ClientGone
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
                raise _ClientGone
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
            raise _ClientGone
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
            raise _ClientGone
        try:
            await self.send(message)
        except (OSError, RuntimeError) as exc:
            # Hypercorn lets a write to a connection the client just closed
            # surface as one of these; the disconnect watcher has not run yet.
            raise _ClientGone from exc

    async def send_reply(self, reply: _Reply, fault: Fault | None, behavior: Behavior) -> None:
        parts = reply.parts
        if fault in ("reset", "stall_body") and len(parts) == 1 and len(parts[0]) >= 2:
            half = len(parts[0]) // 2
            parts = [parts[0][:half], parts[0][half:]]

        delay = reply.first_delay
        if fault == "slow_headers":
            delay += behavior.slow_headers_delay
        await self.pause(delay)

        reset_at = None
        if fault == "reset":
            reset_at = min(behavior.fault_after_tokens, max(len(parts) - 1, 0))
            if reset_at == 0:
                await self.abort()
                return

        await self.start(reply.status, reply.headers)
        if fault == "stall_body":
            await self.write(parts[0] if parts else b"", more=True)
            await self.hang()
            return
        for index, part in enumerate(parts):
            if 0 < index < reply.gap_units:
                await self.pause(reply.gap)
            if index == reset_at:
                await self.abort()
                return
            await self.write(part, more=index < len(parts) - 1)
        if not parts:
            await self.write(b"", more=False)
