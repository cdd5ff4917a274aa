"""The fake region's ASGI application: connections, fault injection, counters, ``/_control``.

The routes and their answers are in :mod:`edgeproxy.testing._answers`; one
request/response, with its disconnect and fault plumbing, is an
:class:`~edgeproxy.testing._exchange.Exchange`.

Chat, completions, Responses and Messages requests also go through the region's model of an
LLM server (:class:`~edgeproxy.testing._generation.GenerationModel`): a FIFO queue in front
of ``max_running`` generation slots and a prefix (KV) cache
(:mod:`edgeproxy.testing._kv`) whose hits make the first token come sooner;
the load is reported as vLLM reports it (:mod:`edgeproxy.testing._load`). A WebSocket to a
path ending ``/realtime`` is a Realtime API session (:mod:`edgeproxy.testing._realtime`).

It runs on the region's own event loop thread. Counters are written there
and read from the test's thread, hence the lock around them.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import deque
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, Final

from edgeproxy.testing import _answers as answers
from edgeproxy.testing._behavior import Behavior, Fault, behavior_from_mapping
from edgeproxy.testing._counters import Counters, RealtimeStats
from edgeproxy.testing._exchange import (
    BadRequest,
    ClientGone,
    Exchange,
    Headers,
    Receive,
    Reply,
    Scope,
    Send,
    error_reply,
    json_reply,
    parse_json_object,
)
from edgeproxy.testing._generation import GenerationModel
from edgeproxy.testing._hypercorn import HTTP_1_1_REQUIRED, REFUSED_STREAM, StreamHandle
from edgeproxy.testing._kv import KVCache
from edgeproxy.testing._load import (
    ORCA_FORMAT_HEADER,
    ORCA_HEADER,
    PROMETHEUS_CONTENT_TYPE,
    LoadMetricsFormat,
    LoadSnapshot,
    MetricsFlavor,
    orca_header,
    prometheus_text,
    requested_format,
    spoiled_orca_header,
)
from edgeproxy.testing._messages import SeenHeaders
from edgeproxy.testing._objects import ObjectStore
from edgeproxy.testing._realtime import serve as serve_realtime
from edgeproxy.testing._responses import DEFAULT_CAPACITY, ResponseStore

__all__ = ["Counters", "RegionApp"]

_CONNECTIONS_PRUNE_AT: Final = 512


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


class RegionApp(GenerationModel):
    """The ASGI application of one fake region."""

    def __init__(
        self,
        name: str,
        behavior: Behavior,
        *,
        model: str,
        max_model_len: int = 4096,
        http1_only: bool = False,
        seed: int | None = None,
        kv_capacity_blocks: int = 0,
        kv_block_size: int = 16,
        max_running: int = 0,
        max_queue: int | None = None,
        queue_full_status: int = 503,
        load_metrics_always: LoadMetricsFormat | None = None,
        metrics_flavor: MetricsFlavor = "vllm",
        responses_capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self.name = name
        self.behavior = behavior
        self.model = model
        self.max_model_len = max_model_len
        self.http1_only = http1_only
        self.kv_block_size = kv_block_size
        self.max_running = max_running
        self.max_queue = max_queue
        self.queue_full_status = queue_full_status
        self.load_metrics_always: LoadMetricsFormat | None = load_metrics_always
        self.metrics_flavor: MetricsFlavor = metrics_flavor
        self._rng = random.Random(seed)
        self._region_header = (b"x-fake-region", name.encode("utf-8"))
        self._lock = threading.Lock()
        self._epoch = 0
        self._by_path: dict[str, int] = {}
        self._by_version: dict[str, int] = {}
        self._in_flight = 0
        self._connections: dict[object, _Connection] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._stop_event: asyncio.Event | None = None
        self._idle_event: asyncio.Event | None = None
        self._on_startup: Callable[[], None] | None = None
        # The LLM server model; the lock guards these too.
        self._kv = KVCache(kv_capacity_blocks)
        self._running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._kv_held = 0
        self._zero_counters()
        # The stateful APIs: stored responses, the Anthropic headers last seen.
        self.responses = ResponseStore(responses_capacity)
        self.objects = ObjectStore()  # conversations, files, batches, vector stores
        self.seen = SeenHeaders()
        self.realtime = RealtimeStats()  # what the Realtime sessions have seen

    @property
    def kv_capacity_blocks(self) -> int:
        return self._kv.capacity

    # -- lifecycle, called on the server loop ------------------------------

    def begin_run(self, on_startup: Callable[[], None]) -> None:
        """Prepare for a new serving run on the current loop."""
        self._stopping = False
        # Events bind to the loop that first waits on them; each run has its own loop.
        self._stop_event = asyncio.Event()
        self._idle_event = asyncio.Event()
        self._on_startup = on_startup
        self._connections.clear()
        with self._lock:
            # A restarted server starts cold, with nothing running or queued.
            self._kv.clear()
            self._running = 0
            self._waiting.clear()
            self._kv_held = 0
        self.responses.clear()  # an in-memory store, as vLLM's
        self.objects.clear()

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
        store = self.responses.counters()
        objects = self.objects.counters()
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
                requests_running=self._running,
                requests_waiting=len(self._waiting),
                peak_requests_waiting=self._peak_waiting,
                queue_rejected_total=self._queue_rejected,
                prompt_tokens_total=self._prompt_tokens,
                cached_tokens_total=self._cached_tokens,
                generation_tokens_total=self._generation_tokens,
                tokens_sent_total=self._tokens_sent,
                modelled_ttft_seconds_total=self._modelled_ttft,
                kv_cache_blocks=len(self._kv),
                kv_blocks_in_use=self._kv_held,
                kv_cache_usage=self._kv_usage(),
                kv_evicted_blocks_total=self._kv.evicted_total,
                responses_stored=store.stored,
                responses_stored_total=store.stored_total,
                responses_evicted_total=store.evicted_total,
                previous_response_hits_total=store.previous_hits_total,
                previous_response_misses_total=store.previous_misses_total,
                response_lookups_total=store.lookups_total,
                response_lookup_misses_total=store.lookup_misses_total,
                objects_stored=objects.stored,
                object_lookups_total=objects.lookups_total,
                object_lookup_misses_total=objects.lookup_misses_total,
                **self.realtime.counters(),
            )

    def reset_counters(self) -> None:
        with self._lock:
            self._epoch += 1
            self._zero_counters()
        self.responses.reset_counters()
        self.objects.reset_counters()
        self.realtime.reset_counters()

    def _zero_counters(self) -> None:
        # The totals start again from zero and the peaks from what holds now: a new region's
        # counters and reset ones are one state.
        self._requests_total = 0
        self._by_path.clear()
        self._by_version.clear()
        self._peak_in_flight = self._in_flight
        self._cancelled = 0
        self._faults = 0
        self._refused = 0
        self._connections_seen = 0
        self._peak_streams = 0
        self._peak_waiting = len(self._waiting)
        self._queue_rejected = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._generation_tokens = 0
        self._tokens_sent = 0
        self._modelled_ttft = 0.0
        self._kv.evicted_total = 0

    def clear_kv_cache(self) -> None:
        """Empty the prefix cache (blocks held by running requests stay held)."""
        with self._lock:
            self._kv.clear()

    def _kv_usage(self) -> float:
        capacity = self._kv.capacity
        return min(1.0, self._kv_held / capacity) if capacity > 0 else 0.0

    def load_snapshot(self) -> LoadSnapshot:
        """The load gauges now, as ``/metrics`` and the ORCA header report them."""
        with self._lock:
            return LoadSnapshot(
                running=self._running,
                waiting=len(self._waiting),
                kv_usage=self._kv_usage(),
                prompt_tokens_total=self._prompt_tokens,
                cached_tokens_total=self._cached_tokens,
                generation_tokens_total=self._generation_tokens,
            )

    def _count_fault(self) -> None:
        with self._lock:
            self._faults += 1

    # -- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
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
            await self._control(Exchange(self, scope, receive, send, None))
            return

        handle = StreamHandle.from_send(send)
        conn = self._connection(scope, handle)
        ex = Exchange(self, scope, receive, send, handle)

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
                except (ClientGone, BadRequest):
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

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket: the Realtime API at paths ending ``/realtime``, refused elsewhere."""
        handle = StreamHandle.from_send(send)
        conn = self._connection(scope, handle)
        # Counted as a request that stays in flight while its session is open, and its
        # connection is known, so that a kill drops it.
        self._enter(conn, scope["path"], scope["http_version"], handle)
        try:
            await serve_realtime(self, scope, receive, send, handle)
        finally:
            self._leave(conn)

    def _connection(self, scope: Scope, handle: StreamHandle | None) -> _Connection:
        key = scope.get("client") or (handle.connection_key if handle else None)
        conn = self._connections.get(key)
        if conn is None:
            conn = self._new_connection(key)
        if handle is not None:
            conn.handle = handle
        return conn

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
        fault = behavior.fault
        if self.behavior.fault_count is not None:
            left = self.behavior.fault_count - 1
            self.behavior.fault_count = left or None
            if not left:
                self.behavior.fault = None
        return fault

    def _draw_reset_point(self, reply: Reply) -> int:
        """Where a random reset comes: after 1 to tokens - 1 tokens (body parts if no tokens)."""
        units = (
            reply.generation.completion_tokens if reply.generation is not None else len(reply.parts)
        )
        return self._rng.randint(1, max(1, units - 1))

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

    async def _handle(self, ex: Exchange, behavior: Behavior, fault: Fault | None) -> None:
        echo = ex.path.startswith("/echo/") or ex.path == "/echo"
        reply: Reply | None = None
        body = b""
        try:
            if echo:
                length, sha256 = await ex.consume_body()
            else:
                body = await ex.read_body()
        except BadRequest as exc:
            reply = answers.bad_request(ex.path, exc)
        if fault is not None and behavior.fault_body is not None and not echo:
            if behavior.fault_body.encode() not in body:
                fault = None  # this request is not one the fault is for
        ex.watch_disconnect()

        if fault == "stall":
            await ex.hang()
            return
        if fault == "5xx":
            status = behavior.fault_status
            message = f"fake region {self.name}: injected {status}"
            refusal = answers.error_for(ex.path, status, message, "server_error")
            if behavior.fault_retry_after is not None:
                refusal.headers.append((b"retry-after", behavior.fault_retry_after.encode()))
            await ex.send_reply(refusal, None, behavior)
            return

        if reply is None:
            try:
                reply = (
                    answers.echo(ex, length, sha256, region=self.name)
                    if echo
                    else answers.route(
                        ex,
                        body,
                        behavior,
                        region_model=self.model,
                        max_model_len=self.max_model_len,
                        metrics=self._metrics_reply,
                        store=self.responses,
                        seen=self.seen,
                        objects=self.objects,
                    )
                )
            except BadRequest as exc:
                reply = answers.bad_request(ex.path, exc)
        if fault == "stream_error" and reply.stream_error is None:
            # An answer with no in-band error event gets the 5xx instead.
            status = behavior.fault_status
            message = f"fake region {self.name}: injected {status}"
            await ex.send_reply(
                answers.error_for(ex.path, status, message, "server_error"), None, behavior
            )
            return
        if fault == "reset" and behavior.fault_after_tokens_random:
            behavior = behavior.copy(fault_after_tokens=self._draw_reset_point(reply))
        if reply.generation is not None:
            await self._generate(ex, reply, behavior, fault)
        else:
            await ex.send_reply(reply, fault, behavior)

    def _orca_headers(self, ex: Exchange, behavior: Behavior) -> Headers:
        """The ``endpoint-load-metrics`` header, if the request (or the region) asks for it."""
        fmt = requested_format(ex.header(ORCA_FORMAT_HEADER)) or self.load_metrics_always
        spoil = behavior.load_metrics_fault
        if fmt is None:
            if spoil is None:
                return []
            fmt = "TEXT"
        snapshot = self.load_snapshot()
        if spoil is None:
            return [(ORCA_HEADER, orca_header(fmt, snapshot.named_metrics()))]
        if spoil == "many" and ex.handle is not None:
            ex.handle.plain_hpack()
        return [(ORCA_HEADER, spoiled_orca_header(spoil, fmt, snapshot))]

    def _metrics_reply(self) -> Reply:
        body = prometheus_text(self.metrics_flavor, self.model, self.load_snapshot())
        headers = [
            (b"content-type", PROMETHEUS_CONTENT_TYPE),
            (b"content-length", str(len(body)).encode()),
        ]
        return Reply(200, headers, [body])

    # -- /_control -----------------------------------------------------------

    async def _control(self, ex: Exchange) -> None:
        try:
            body = await ex.read_body()
            if ex.path == "/_control" and ex.method == "GET":
                reply = json_reply(200, self.control_state())
            elif ex.path == "/_control" and ex.method == "POST":
                self.behavior = behavior_from_mapping(self.behavior, parse_json_object(body))
                reply = json_reply(200, self.control_state())
            elif ex.path == "/_control/reset-counters" and ex.method == "POST":
                self.reset_counters()
                reply = json_reply(200, self.control_state())
            elif ex.path == "/_control/clear-kv-cache" and ex.method == "POST":
                self.clear_kv_cache()
                reply = json_reply(200, self.control_state())
            elif ex.path == "/_control/clear-responses" and ex.method == "POST":
                self.responses.clear()
                reply = json_reply(200, self.control_state())
            else:
                raise BadRequest(f"no route for {ex.method} {ex.path}", status=404)
        except BadRequest as exc:
            reply = error_reply(exc.status, str(exc))
        except ValueError as exc:  # a rejected Behavior field
            reply = error_reply(400, str(exc))
        await ex.send_reply(reply, None, self.behavior)

    def control_state(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "max_model_len": self.max_model_len,
            "llm": {
                "kv_capacity_blocks": self._kv.capacity,
                "kv_block_size": self.kv_block_size,
                "max_running": self.max_running,
                "max_queue": self.max_queue,
                "queue_full_status": self.queue_full_status,
                "load_metrics_always": self.load_metrics_always,
                "metrics_flavor": self.metrics_flavor,
            },
            "behavior": self.behavior.to_dict(),
            "anthropic_version": self.seen.anthropic_version,
            "anthropic_beta": self.seen.anthropic_beta,
            "counters": self.counters().to_dict(),
        }
