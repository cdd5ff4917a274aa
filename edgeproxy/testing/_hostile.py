"""``HostileRegion``: an HTTP/2 (h2c) server that breaks the protocol on purpose.

Built on ``h2`` directly (not hypercorn), because it must send what a correct
server never would: malformed header blocks, a wrong ``Content-Length``,
frames out of order, floods of control frames. Each request picks its own
misbehaviour, so healthy streams can share a connection with a bad one::

    async with HostileRegion(events=5) as region:
        pool = H2Pool(region.url, PoolLimits(max_connections=1))
        good = await pool.request("GET", "/hostile/sse?gate=1", [])   # slow SSE
        await pool.request("GET", "/hostile/cr-in-value", [])         # raises
        region.open_gate()                                            # good one ends
        assert region.counters.connections == 1

The behaviour comes from the ``x-hostile`` request header, else from the path
``/hostile/<behaviour>``, else from ``default``. Parameters come from the
query string or from ``x-hostile-<name>`` headers (the header wins):
``events`` and ``interval`` (SSE), ``gate`` (1: after the first SSE event,
wait for :meth:`HostileRegion.open_gate`), ``bytes`` (body or header size),
``count`` (frames in a flood), ``code`` (RST_STREAM/GOAWAY error code) and
``last`` (GOAWAY's last stream id).

Behaviours (see :attr:`HostileRegion.BEHAVIORS`):

* well-formed: ``sse`` (OpenAI chat chunks, then ``[DONE]``), ``json``;
* malformed responses, each a *stream* error for the client (RFC 9113
  §8.1.1): every name in :attr:`HostileRegion.MALFORMED`;
* connection-level abuse: ``oversized-headers``, ``settings-flood``,
  ``ping-flood``, ``window-update-zero[-connection]``,
  ``window-update-overflow[-connection]``, ``goaway``, ``goaway-refuse``;
* stream-level trouble: ``rst-after`` (RST_STREAM after ``bytes`` bytes),
  ``stall-window`` (never acknowledges the request body; this stalls the whole
  connection's upload window, as a server that stops reading would),
  ``endless`` (a body that never ends), ``hang`` (never answers).

Unlike :class:`~edgeproxy.testing.FakeRegion` it runs on the event loop that
started it, so a test can gate it without threads; :attr:`counters` says what
it saw (connections, streams, resets, GOAWAYs, flood acknowledgements).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, cast
from urllib.parse import parse_qsl, urlsplit

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hyperframe.frame
from hpack import NeverIndexedHeaderTuple

from edgeproxy.testing._served import Served

__all__ = ["HOSTILE_BEHAVIORS", "MALFORMED_RESPONSES", "HostileCounters", "HostileRegion"]

Header = tuple[bytes, bytes]

_OK: Final = (b":status", b"200")
_MAX_WINDOW: Final = 2**31 - 1

# Header blocks that make a response malformed (RFC 9113 §8.1.1, §8.2, §8.3);
# each is sent as the response's (only) HEADERS, followed by a short body.
_BAD_HEADER_BLOCKS: Final[dict[str, list[Header]]] = {
    "cr-in-value": [_OK, (b"x-bad", b"a\rb")],
    "lf-in-value": [_OK, (b"x-bad", b"a\nb")],
    "nul-in-value": [_OK, (b"x-bad", b"a\x00b")],
    "space-around-value": [_OK, (b"x-bad", b" padded ")],
    "uppercase-name": [_OK, (b"X-Bad", b"1")],
    "empty-name": [_OK, (b"", b"1")],
    "colon-in-name": [_OK, (b"x:bad", b"1")],
    "connection-header": [_OK, (b"connection", b"keep-alive")],
    "transfer-encoding": [_OK, (b"transfer-encoding", b"chunked")],
    "te-header": [_OK, (b"te", b"gzip")],
    "status-nonnumeric": [(b":status", b"abc")],
    "status-out-of-range": [(b":status", b"600")],
    "status-two-digits": [(b":status", b"99")],
    "status-missing": [(b"content-type", b"text/plain")],
    "status-duplicate": [_OK, (b":status", b"204")],
    "pseudo-after-regular": [(b"x-first", b"1"), _OK],
    "unknown-pseudo": [_OK, (b":path", b"/")],
    "content-length-invalid": [_OK, (b"content-length", b"abc")],
    "content-length-conflict": [_OK, (b"content-length", b"3"), (b"content-length", b"4")],
}

MALFORMED_RESPONSES: Final[frozenset[str]] = frozenset(
    {
        *_BAD_HEADER_BLOCKS,
        "status-101",
        "content-length-short",
        "content-length-long",
        "informational-end-stream",
        "interim-after-final",
        "trailers-without-end-stream",
        "pseudo-in-trailers",
        "data-before-headers",
    }
)
"""Behaviours whose response is malformed: the client must reset just that stream."""

_GOOD: Final = frozenset({"sse", "json"})
_ABUSE: Final = frozenset(
    {
        "oversized-headers",
        "settings-flood",
        "ping-flood",
        "window-update-zero",
        "window-update-zero-connection",
        "window-update-overflow",
        "window-update-overflow-connection",
        "goaway",
        "goaway-refuse",
        "rst-after",
        "stall-window",
        "endless",
        "hang",
    }
)
HOSTILE_BEHAVIORS: Final[frozenset[str]] = _GOOD | MALFORMED_RESPONSES | _ABUSE
"""Every behaviour a request may ask for."""

# Answered as soon as the request headers arrive, without reading the body.
_NO_BODY_WAIT: Final = frozenset({"stall-window", "hang"})


@dataclass
class HostileCounters:
    """What a :class:`HostileRegion` saw since it started or since its counters were reset."""

    connections: int = 0
    """TCP connections accepted."""
    streams_opened: int = 0
    """Requests (HEADERS opening a stream) received."""
    streams_completed: int = 0
    """Responses this server ended with END_STREAM."""
    resets_received: int = 0
    """RST_STREAM frames received from clients."""
    reset_codes: Counter[int] = field(default_factory=Counter)
    """RST_STREAM error codes received, by code (1 is PROTOCOL_ERROR, 8 CANCEL)."""
    goaways_received: int = 0
    pings_acked: int = 0
    """PING ACKs received (answers to ``ping-flood``)."""
    settings_acked: int = 0
    """SETTINGS ACKs received (answers to ``settings-flood`` and the preface)."""
    client_errors: int = 0
    """Connections this server closed because the client broke the protocol."""
    behaviors: Counter[str] = field(default_factory=Counter)
    """Requests by behaviour."""


class _Exchange:
    """One request/response on a connection."""

    __slots__ = ("stream_id", "behavior", "params", "body_done", "task")

    def __init__(self, stream_id: int, behavior: str, params: dict[str, str]) -> None:
        self.stream_id = stream_id
        self.behavior = behavior
        self.params = params
        self.body_done = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def int_param(self, name: str, default: int) -> int:
        value = self.params.get(name)
        return int(value) if value else default

    def float_param(self, name: str, default: float) -> float:
        value = self.params.get(name)
        return float(value) if value else default


class _StreamGone(Exception):
    """The client reset the stream or the connection went away."""


class _Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection."""

    def __init__(self, region: HostileRegion) -> None:
        self.region = region
        self.loop = asyncio.get_running_loop()
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self.h2 = h2.connection.H2Connection(config)
        self.transport: asyncio.Transport | None = None
        self.exchanges: dict[int, _Exchange] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._window_waiters: list[asyncio.Future[None]] = []
        self.goaway_last: int | None = None

    # -- asyncio.Protocol ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.region._connections.add(self)
        self.region._counters.connections += 1
        self.h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: (
                    self.region.max_concurrent_streams
                ),
            },
        )
        self.h2.initiate_connection()
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.region._connections.discard(self)
        self._wake_senders()
        for task in list(self.tasks):
            task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            self.region._counters.client_errors += 1
            self.flush()
            self.close()
            return
        counters = self.region._counters
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                self._on_request(event)
            elif isinstance(event, h2.events.DataReceived):
                exchange = self.exchanges.get(event.stream_id)
                if exchange is None or exchange.behavior != "stall-window":
                    with contextlib.suppress(h2.exceptions.ProtocolError):
                        self.h2.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
            elif isinstance(event, h2.events.StreamEnded):
                exchange = self.exchanges.get(event.stream_id)
                if exchange is not None:
                    exchange.body_done.set()
            elif isinstance(event, h2.events.StreamReset):
                counters.resets_received += 1
                counters.reset_codes[int(event.error_code or 0)] += 1
                exchange = self.exchanges.pop(event.stream_id, None)
                if exchange is not None and exchange.task is not None:
                    exchange.task.cancel()
                self._wake_senders()
            elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                self._wake_senders()
            elif isinstance(event, h2.events.ConnectionTerminated):
                counters.goaways_received += 1
            elif isinstance(event, h2.events.PingAckReceived):
                counters.pings_acked += 1
            elif isinstance(event, h2.events.SettingsAcknowledged):
                counters.settings_acked += 1
        self.flush()

    # -- plumbing --------------------------------------------------------

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def write_raw(self, frame: hyperframe.frame.Frame) -> None:
        """Write a frame behind h2's back (after whatever h2 has queued)."""
        self.flush()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame.serialize())

    def raw_headers(self, stream_id: int, headers: list[Header], *, end_stream: bool) -> None:
        """A HEADERS frame h2 would refuse to send; HPACK state stays shared with h2."""
        flags = ["END_HEADERS", "END_STREAM"] if end_stream else ["END_HEADERS"]
        block = self.h2.encoder.encode(headers)
        self.write_raw(hyperframe.frame.HeadersFrame(stream_id, data=block, flags=flags))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _wake_senders(self) -> None:
        waiters, self._window_waiters = self._window_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _window_changed(self) -> None:
        waiter: asyncio.Future[None] = self.loop.create_future()
        self._window_waiters.append(waiter)
        await waiter

    def _check(self, exchange: _Exchange) -> None:
        if self.transport is None or exchange.stream_id not in self.exchanges:
            raise _StreamGone

    async def send_data(self, exchange: _Exchange, data: bytes, *, end_stream: bool) -> None:
        """Send ``data`` within the client's flow-control windows."""
        view = memoryview(data)
        while True:
            self._check(exchange)
            window = min(
                self.h2.local_flow_control_window(exchange.stream_id),
                self.h2.max_outbound_frame_size,
            )
            if window <= 0 and len(view):
                await self._window_changed()
                continue
            size = min(window, len(view))
            last = size == len(view)
            piece = bytes(view[:size])
            self.h2.send_data(exchange.stream_id, piece, end_stream=end_stream and last)
            self.flush()
            if last:
                if end_stream:
                    self._completed(exchange)
                return
            view = view[size:]

    def send_headers(
        self, exchange: _Exchange, headers: list[Header], *, end_stream: bool = False
    ) -> None:
        self._check(exchange)
        self.h2.send_headers(exchange.stream_id, headers, end_stream=end_stream)
        self.flush()
        if end_stream:
            self._completed(exchange)

    def _completed(self, exchange: _Exchange) -> None:
        self.region._counters.streams_completed += 1
        self.exchanges.pop(exchange.stream_id, None)
        self._maybe_close_after_goaway()

    def _maybe_close_after_goaway(self) -> None:
        if self.goaway_last is not None and not any(
            sid <= self.goaway_last for sid in self.exchanges
        ):
            self.loop.call_soon(self.close)

    # -- requests --------------------------------------------------------

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        region = self.region
        stream_id = event.stream_id
        assert stream_id is not None
        region._counters.streams_opened += 1
        headers = {name: value for name, value in event.headers or []}
        target = headers.get(b":path", b"/").decode("latin-1")
        parts = urlsplit(target)
        params = dict(parse_qsl(parts.query))
        for name, value in headers.items():
            if name.startswith(b"x-hostile-"):
                params[name[10:].decode("latin-1")] = value.decode("latin-1")
        behavior = region.default
        if parts.path.startswith("/hostile/"):
            behavior = parts.path[len("/hostile/") :]
        if b"x-hostile" in headers:
            behavior = headers[b"x-hostile"].decode("latin-1")
        if behavior not in HOSTILE_BEHAVIORS:
            behavior = "unknown"
        region._counters.behaviors[behavior] += 1
        exchange = _Exchange(stream_id, behavior, params)
        if self.goaway_last is not None and stream_id > self.goaway_last:
            return  # above the GOAWAY's last stream id: ignored, as servers do
        self.exchanges[stream_id] = exchange
        if event.stream_ended is not None:
            exchange.body_done.set()
        task = self.loop.create_task(self._run(exchange))
        exchange.task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, exchange: _Exchange) -> None:
        handler = _HANDLERS.get(exchange.behavior, _unknown)
        try:
            if exchange.behavior not in _NO_BODY_WAIT:
                await exchange.body_done.wait()
            await handler(self, exchange)
        except (_StreamGone, h2.exceptions.StreamClosedError):
            pass
        except h2.exceptions.ProtocolError:
            # The connection is no longer usable for this stream (GOAWAY, reset).
            pass
        finally:
            self.flush()


Handler = Callable[[_Connection, _Exchange], Awaitable[None]]


# -- well-formed answers ---------------------------------------------------


def _sse_event(index: int, last: bool) -> bytes:
    finish = '"stop"' if last else "null"
    return (
        'data: {"id":"chatcmpl-hostile","object":"chat.completion.chunk","created":0,'
        f'"model":"hostile","choices":[{{"index":0,"delta":{{"content":"tok{index} "}},'
        f'"finish_reason":{finish}}}]}}\n\n'
    ).encode()


def sse_body(events: int) -> bytes:
    """The whole body of an ``sse`` answer of ``events`` events."""
    return b"".join(_sse_event(i, i == events - 1) for i in range(events)) + b"data: [DONE]\n\n"


async def _sse(conn: _Connection, exchange: _Exchange) -> None:
    region = conn.region
    events = max(1, exchange.int_param("events", region.events))
    interval = exchange.float_param("interval", region.interval)
    gated = exchange.params.get("gate", "") not in ("", "0")
    conn.send_headers(
        exchange,
        [_OK, (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
    )
    for index in range(events):
        if index == 1 and gated:
            await region._gate.wait()
        if index and interval:
            await asyncio.sleep(interval)
        await conn.send_data(exchange, _sse_event(index, index == events - 1), end_stream=False)
    await conn.send_data(exchange, b"data: [DONE]\n\n", end_stream=True)


_JSON_BODY: Final = (
    b'{"id":"chatcmpl-hostile","object":"chat.completion","created":0,"model":"hostile",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
    b'"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)


async def _json(conn: _Connection, exchange: _Exchange) -> None:
    conn.send_headers(
        exchange,
        [
            _OK,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(_JSON_BODY)).encode()),
        ],
    )
    await conn.send_data(exchange, _JSON_BODY, end_stream=True)


async def _unknown(conn: _Connection, exchange: _Exchange) -> None:
    body = b"unknown hostile behaviour"
    conn.send_headers(exchange, [(b":status", b"404"), (b"content-length", b"25")])
    await conn.send_data(exchange, body, end_stream=True)


# -- malformed responses ---------------------------------------------------


# The malformed answers below keep their stream open after the bad frame, as a
# server streaming an answer would, so the client's RST_STREAM is seen (and
# counted) rather than ignored on a stream this side already ended.


async def _hang(conn: _Connection, exchange: _Exchange) -> None:
    await asyncio.Future()  # until the client resets the stream or leaves


def _bad_headers(block: list[Header]) -> Handler:
    async def handler(conn: _Connection, exchange: _Exchange) -> None:
        conn.send_headers(exchange, block)
        await conn.send_data(exchange, b"bad", end_stream=False)
        await _hang(conn, exchange)

    return handler


async def _status_101(conn: _Connection, exchange: _Exchange) -> None:
    # HTTP/2 has no 101 (RFC 9113 §8.6); a final answer follows, as if upgraded.
    conn.send_headers(exchange, [(b":status", b"101")])
    conn.send_headers(exchange, [_OK])
    await conn.send_data(exchange, b"upgraded?", end_stream=False)
    await _hang(conn, exchange)


async def _content_length_short(conn: _Connection, exchange: _Exchange) -> None:
    conn.send_headers(exchange, [_OK, (b"content-length", b"100")])
    await conn.send_data(exchange, b"only ten b", end_stream=True)


async def _content_length_long(conn: _Connection, exchange: _Exchange) -> None:
    conn.send_headers(exchange, [_OK, (b"content-length", b"5")])
    await conn.send_data(exchange, b"x" * 100, end_stream=False)
    await _hang(conn, exchange)


async def _informational_end_stream(conn: _Connection, exchange: _Exchange) -> None:
    conn._check(exchange)
    conn.raw_headers(exchange.stream_id, [(b":status", b"103")], end_stream=True)


async def _interim_after_final(conn: _Connection, exchange: _Exchange) -> None:
    conn.send_headers(exchange, [_OK])
    await conn.send_data(exchange, b"body", end_stream=False)
    conn.raw_headers(exchange.stream_id, [(b":status", b"103")], end_stream=False)


async def _trailers_without_end_stream(conn: _Connection, exchange: _Exchange) -> None:
    conn.send_headers(exchange, [_OK])
    await conn.send_data(exchange, b"body", end_stream=False)
    conn.raw_headers(exchange.stream_id, [(b"x-trailer", b"1")], end_stream=False)


async def _pseudo_in_trailers(conn: _Connection, exchange: _Exchange) -> None:
    conn.send_headers(exchange, [_OK])
    await conn.send_data(exchange, b"body", end_stream=False)
    conn.send_headers(exchange, [(b":status", b"200")], end_stream=True)


async def _data_before_headers(conn: _Connection, exchange: _Exchange) -> None:
    conn._check(exchange)
    conn.write_raw(hyperframe.frame.DataFrame(exchange.stream_id, data=b"early"))


# -- abuse -----------------------------------------------------------------


async def _oversized_headers(conn: _Connection, exchange: _Exchange) -> None:
    conn._check(exchange)
    size = exchange.int_param("bytes", 1024 * 1024)
    # Never indexed and not Huffman-coded: h2 would spend seconds coding it.
    headers = [_OK, NeverIndexedHeaderTuple(b"x-big", b"x" * size)]
    block = conn.h2.encoder.encode(headers, huffman=False)
    step = conn.h2.max_outbound_frame_size
    frames: list[hyperframe.frame.Frame] = [
        hyperframe.frame.HeadersFrame(exchange.stream_id, data=block[:step])
    ]
    for offset in range(step, len(block), step):
        piece = block[offset : offset + step]
        frames.append(hyperframe.frame.ContinuationFrame(exchange.stream_id, data=piece))
    frames[-1].flags.add("END_HEADERS")
    for frame in frames:
        conn.write_raw(frame)


async def _settings_flood(conn: _Connection, exchange: _Exchange) -> None:
    count = exchange.int_param("count", 1000)
    streams = conn.region.max_concurrent_streams
    for _ in range(count):
        conn.h2.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: streams})
    conn.flush()
    await _json(conn, exchange)


async def _ping_flood(conn: _Connection, exchange: _Exchange) -> None:
    for index in range(exchange.int_param("count", 1000)):
        conn.h2.ping(index.to_bytes(8, "big"))
    conn.flush()
    await _json(conn, exchange)


def _window_update(increment: int, *, connection: bool) -> Handler:
    async def handler(conn: _Connection, exchange: _Exchange) -> None:
        conn._check(exchange)
        stream_id = 0 if connection else exchange.stream_id
        frame = hyperframe.frame.WindowUpdateFrame(stream_id, window_increment=increment)
        conn.write_raw(frame)
        await _json(conn, exchange)

    return handler


def _goaway_frame(last: int, code: int) -> hyperframe.frame.GoAwayFrame:
    return hyperframe.frame.GoAwayFrame(0, last_stream_id=last, error_code=code)


async def _goaway(conn: _Connection, exchange: _Exchange) -> None:
    # Written by hand: after h2's close_connection() it would send nothing more,
    # while the streams up to ``last`` are still to be answered.
    last = exchange.int_param("last", exchange.stream_id)
    conn.goaway_last = last
    conn.write_raw(_goaway_frame(last, exchange.int_param("code", 0)))
    for stream_id in [sid for sid in conn.exchanges if sid > last]:
        dropped = conn.exchanges.pop(stream_id)
        if dropped.task is not None and dropped is not exchange:
            dropped.task.cancel()
    if exchange.stream_id <= last:
        await _sse(conn, exchange)
    conn._maybe_close_after_goaway()


async def _goaway_refuse(conn: _Connection, exchange: _Exchange) -> None:
    exchange.params.setdefault("last", str(max(0, exchange.stream_id - 2)))
    await _goaway(conn, exchange)


async def _rst_after(conn: _Connection, exchange: _Exchange) -> None:
    conn.send_headers(exchange, [_OK])
    size = exchange.int_param("bytes", 100)
    if size:
        await conn.send_data(exchange, b"r" * size, end_stream=False)
    conn._check(exchange)
    code = exchange.int_param("code", h2.errors.ErrorCodes.INTERNAL_ERROR)
    conn.h2.reset_stream(exchange.stream_id, code)
    conn.exchanges.pop(exchange.stream_id, None)
    conn.flush()


async def _endless(conn: _Connection, exchange: _Exchange) -> None:
    chunk = b"e" * exchange.int_param("bytes", 1024)
    interval = exchange.float_param("interval", 0.0)
    conn.send_headers(exchange, [_OK, (b"content-type", b"application/octet-stream")])
    while True:
        await conn.send_data(exchange, chunk, end_stream=False)
        await asyncio.sleep(interval)


_HANDLERS: Final[dict[str, Handler]] = {
    "sse": _sse,
    "json": _json,
    **{name: _bad_headers(block) for name, block in _BAD_HEADER_BLOCKS.items()},
    "status-101": _status_101,
    "content-length-short": _content_length_short,
    "content-length-long": _content_length_long,
    "informational-end-stream": _informational_end_stream,
    "interim-after-final": _interim_after_final,
    "trailers-without-end-stream": _trailers_without_end_stream,
    "pseudo-in-trailers": _pseudo_in_trailers,
    "data-before-headers": _data_before_headers,
    "oversized-headers": _oversized_headers,
    "settings-flood": _settings_flood,
    "ping-flood": _ping_flood,
    "window-update-zero": _window_update(0, connection=False),
    "window-update-zero-connection": _window_update(0, connection=True),
    "window-update-overflow": _window_update(_MAX_WINDOW, connection=False),
    "window-update-overflow-connection": _window_update(_MAX_WINDOW, connection=True),
    "goaway": _goaway,
    "goaway-refuse": _goaway_refuse,
    "rst-after": _rst_after,
    "stall-window": _hang,
    "endless": _endless,
    "hang": _hang,
}
assert set(_HANDLERS) == HOSTILE_BEHAVIORS


class HostileRegion(Served):
    """An h2c server whose every request may ask it to break HTTP/2 in a chosen way.

    Args:
        name: A label for ``repr`` and test output.
        host: Address to listen on.
        port: Port to listen on; 0 picks a free one.
        default: Behaviour of a request that names none.
        events: Events in an ``sse`` answer, unless the request says.
        interval: Seconds between ``sse`` events, unless the request says.
        max_concurrent_streams: SETTINGS_MAX_CONCURRENT_STREAMS it announces.
    """

    BEHAVIORS: Final = HOSTILE_BEHAVIORS
    """Every behaviour a request may ask for."""
    MALFORMED: Final = MALFORMED_RESPONSES
    """The behaviours whose response is malformed (a stream error for the client)."""

    def __init__(
        self,
        name: str = "hostile",
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        default: str = "sse",
        events: int = 5,
        interval: float = 0.0,
        max_concurrent_streams: int = 100,
    ) -> None:
        if default not in HOSTILE_BEHAVIORS:
            raise ValueError(f"unknown behaviour {default!r}")
        self.name = name
        self.host = host
        self._port = port
        self.default = default
        self.events = events
        self.interval = interval
        self.max_concurrent_streams = max_concurrent_streams
        self._counters = HostileCounters()
        self._connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._gate = asyncio.Event()

    @staticmethod
    def sse_body(events: int) -> bytes:
        """The whole body of an ``sse`` answer of ``events`` events, ``[DONE]`` included."""
        return sse_body(events)

    # -- state -----------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def counters(self) -> HostileCounters:
        """The live counters (mutated as the server runs; copy what you compare later)."""
        return self._counters

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def reset_counters(self) -> None:
        self._counters = HostileCounters()

    def open_gate(self) -> None:
        """Let gated ``sse`` answers (``gate=1``) send the rest of their events."""
        self._gate.set()

    def close_gate(self) -> None:
        self._gate.clear()

    async def wait_until(
        self, predicate: Callable[[HostileCounters], bool], timeout: float = 5.0
    ) -> HostileCounters:
        """Poll the counters until ``predicate`` holds; ``TimeoutError`` after ``timeout``."""
        async with asyncio.timeout(timeout):
            while not predicate(self._counters):
                await asyncio.sleep(0.005)
        return self._counters

    # -- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Start listening on the running event loop."""
        if self._server is not None:
            raise RuntimeError(f"hostile region {self.name} is running")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.host, self._port, reuse_address=True
        )
        self._port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening, drop every connection and end every answer in progress."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        tasks: list[asyncio.Task[None]] = []
        for conn in list(self._connections):
            tasks.extend(conn.tasks)
            if conn.transport is not None:
                conn.transport.abort()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<HostileRegion {self.name} {self.url} {state}>"
