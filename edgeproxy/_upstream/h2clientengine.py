"""The HTTP/2 protocol engine (jh2) as both ends of the proxy run it: its settings, the
fast path's charges to its windows and states, and its client connection
(:class:`ClientEngine`) for :mod:`edgeproxy._upstream.h2conn`, which drains after GOAWAY
and makes a malformed response its stream's error rather than the connection's.

* A malformed response (RFC 9113 §8.1.1: frames out of order, trailers that do not end
  the stream, an informational response after the final one) becomes an event
  (:class:`MalformedHeaders`, :class:`MalformedData`) on which the connection resets that
  stream alone; ``Content-Length`` is checked by the connection, per stream.
* h2 remembers how each of the last 65,536 closed streams closed; only streams closed by
  RST_STREAM are kept, and only the last :data:`RESET_STREAMS_KEPT` of them
  (:class:`ResetStreams`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

# The protocol engine: jh2, h2's maintained fork with a compiled HPACK and the same API
# (the GOAWAY-draining state machine and the stream subclass touch its internals, so its
# version is pinned to a tested range in setup.cfg).
import jh2 as h2
import jh2.config
import jh2.connection
import jh2.events
import jh2.settings
import jh2.stream
import jh2.utilities

__all__ = [
    "RESET_STREAMS_KEPT",
    "ClientEngine",
    "MalformedData",
    "MalformedHeaders",
    "ResetStreams",
    "engine_config",
    "peer_defaults",
    "received_end_stream",
    "take_data",
]

# Streams closed by RST_STREAM whose closing h2 remembers, so that frames the
# peer sent before it saw the reset stay stream errors. Ten times the usual
# SETTINGS_MAX_CONCURRENT_STREAMS: far more resets than fit in one round trip.
RESET_STREAMS_KEPT: Final = 1024
_RESET_BY: Final = frozenset(
    {h2.stream.StreamClosedBy.SEND_RST_STREAM, h2.stream.StreamClosedBy.RECV_RST_STREAM}
)
_HALF_CLOSED_LOCAL: Final = h2.stream.StreamState.HALF_CLOSED_LOCAL
_HALF_CLOSED_REMOTE: Final = h2.stream.StreamState.HALF_CLOSED_REMOTE
_CLOSED: Final = h2.stream.StreamState.CLOSED
_CLOSED_BY_END_STREAM: Final = h2.stream.StreamClosedBy.RECV_END_STREAM
# States in which a stream still expects response frames from the peer.
_RECEIVING: Final = frozenset({h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_LOCAL})


def engine_config(*, client_side: bool) -> Any:
    """The engine's settings for either end: headers as bytes, and the engine's own
    header checks off, both ways; each end checks what it receives per stream, since the
    engine would make every malformed header block a connection error."""
    return h2.config.H2Configuration(
        client_side=client_side,
        header_encoding=None,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
        validate_inbound_headers=False,
        normalize_inbound_headers=False,
    )


def peer_defaults(*, peer_is_client: bool) -> Any:
    """What the peer may take before its SETTINGS say otherwise: RFC 9113's defaults
    (§6.5.2), not jh2's (a 6 MiB window, a 64 KiB header table), which would let a body
    or an answer overrun a peer whose SETTINGS leave INITIAL_WINDOW_SIZE out."""
    return h2.settings.Settings(
        client=peer_is_client,
        initial_values={
            h2.settings.SettingCodes.HEADER_TABLE_SIZE: 4096,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 65535,
        },
    )


def take_data(
    h2conn: Any, stream_id: int, length: int, *, connection_open: Any, after_headers: bool
) -> Any:
    """The h2 stream a DATA frame of ``length`` bytes on ``stream_id`` may be taken for
    without h2, its connection's and its own receive windows charged as h2 does; None,
    with nothing charged, where h2 must take it: the connection not in
    ``connection_open``, a header block in progress, the frame over the size limit, the
    stream unknown or not receiving (or, with ``after_headers``, its headers not in), or
    a window without room for it."""
    h2stream = h2conn.streams.get(stream_id)
    if (
        h2stream is None
        or length > h2conn.max_inbound_frame_size
        or h2conn.incoming_buffer._headers_buffer
        or h2conn.state_machine.state is not connection_open
    ):
        return None
    machine = h2stream.state_machine
    if machine.state not in _RECEIVING or (after_headers and not machine.headers_received):
        return None
    conn_window = h2conn._inbound_flow_control_window_manager
    stream_window = h2stream._inbound_window_manager
    if conn_window.current_window_size < length or stream_window.current_window_size < length:
        return None
    conn_window.current_window_size -= length
    stream_window.current_window_size -= length
    return h2stream


def received_end_stream(machine: Any) -> None:
    """h2's stream state machine on a received END_STREAM (its stream_ended/_half_closed)."""
    if machine.state is _HALF_CLOSED_LOCAL:
        machine.state = _CLOSED
        machine.stream_closed_by = _CLOSED_BY_END_STREAM
    else:
        machine.state = _HALF_CLOSED_REMOTE


class _DrainingStateMachine(h2.connection.H2ConnectionStateMachine):
    """h2's connection state machine, except that a received GOAWAY keeps it open.

    Stock h2 treats GOAWAY as terminal and then rejects the HEADERS and DATA
    of streams the peer promised to finish (nginx sends GOAWAY *before* the
    response of its last request), so every in-flight request would fail. We
    keep the machine open and stop opening streams ourselves.
    """

    _transitions = {
        **h2.connection.H2ConnectionStateMachine._transitions,
        (
            h2.connection.ConnectionState.IDLE,
            h2.connection.ConnectionInputs.RECV_GOAWAY,
        ): (None, h2.connection.ConnectionState.IDLE),
        (
            h2.connection.ConnectionState.CLIENT_OPEN,
            h2.connection.ConnectionInputs.RECV_GOAWAY,
        ): (None, h2.connection.ConnectionState.CLIENT_OPEN),
    }


class ResetStreams(h2.utilities.SizeLimitDict):
    """h2's table of closed streams, keeping only the last streams closed by RST_STREAM.

    h2 consults it for frames on a stream it no longer tracks: on a stream
    that was reset they are a stream error (the peer sent them before it saw
    the reset), otherwise a connection error. A stream closed by END_STREAM
    that is not in the table gets that same connection error, so such entries
    change nothing and are not stored: a long-lived connection would
    otherwise hold 65,536 of them.
    """

    def __setitem__(self, key: int, value: Any) -> None:
        if value in _RESET_BY:
            super().__setitem__(key, value)


class MalformedHeaders(h2.events.ResponseReceived):
    """A HEADERS frame that makes the response malformed; h2 would end the connection.

    A :class:`~h2.events.ResponseReceived`, because h2 attaches PRIORITY
    information to the first event a HEADERS frame yields.
    """

    def __init__(self, stream_id: int, headers: list[Any], reason: str) -> None:
        super().__init__()
        self.stream_id = stream_id
        self.headers = headers
        self.reason = reason


class MalformedData(h2.events.Event):
    """A DATA frame before the response's HEADERS; h2 would end the connection."""

    def __init__(self, stream_id: int, flow_controlled_length: int, reason: str) -> None:
        self.stream_id = stream_id
        self.flow_controlled_length = flow_controlled_length
        self.reason = reason


class _H2Stream(h2.stream.H2Stream):
    """An h2 stream whose malformed responses are stream errors (RFC 9113 §8.1.1).

    The frame sequences h2 rejects with a connection error become events for
    :class:`~edgeproxy._upstream.h2conn.Connection` to reset this stream alone;
    ``Content-Length`` is checked by the connection too, per stream.
    """

    def receive_headers(
        self,
        headers: Iterable[Any],
        end_stream: bool,
        header_encoding: bool | str | None,
    ) -> tuple[list[Any], list[h2.events.Event]]:
        headers = list(headers)
        machine = self.state_machine
        if machine.state in _RECEIVING:
            reason = ""
            if h2.utilities.is_informational_response(headers):
                if end_stream:
                    reason = "an informational (1xx) response ended the stream"
                elif machine.headers_received:
                    reason = "an informational (1xx) response came after the final one"
            elif machine.headers_received and not end_stream:
                reason = "trailers did not end the stream"
            if reason:
                event = MalformedHeaders(stream_id=self.stream_id, headers=headers, reason=reason)
                return [], [event]
        return super().receive_headers(headers, end_stream, header_encoding)

    def receive_data(
        self, data: bytes, end_stream: bool, flow_control_len: int
    ) -> tuple[list[Any], list[h2.events.Event]]:
        machine = self.state_machine
        if machine.state in _RECEIVING and not machine.headers_received:
            event = MalformedData(
                stream_id=self.stream_id,
                flow_controlled_length=flow_control_len,
                reason="DATA came before the response headers",
            )
            return [], [event]
        return super().receive_data(data, end_stream, flow_control_len)

    def _initialize_content_length(self, headers: Iterable[Any]) -> None:
        # Checked by Connection, where a bad value or a mismatch resets only
        # this stream; h2 would end the connection.
        self._expected_content_length = None


class ClientEngine(h2.connection.H2Connection):
    """An h2 client connection that can drain after GOAWAY, with per-stream errors."""

    def __init__(self, config: h2.config.H2Configuration, reset_streams_kept: int) -> None:
        super().__init__(config)
        self.state_machine = _DrainingStateMachine()
        self._closed_streams = ResetStreams(size_limit=reset_streams_kept)

    def _begin_new_stream(
        self, stream_id: int, allowed_ids: h2.connection.AllowedStreamIDs
    ) -> h2.stream.H2Stream:
        stream = super()._begin_new_stream(stream_id, allowed_ids)
        # h2 builds its own stream class; ours only overrides methods.
        stream.__class__ = _H2Stream
        return stream

    def clear_outbound_data_buffer(self) -> None:
        # h2 calls this only on a received GOAWAY; the buffer may still hold
        # WINDOW_UPDATEs or body frames for streams the peer will finish, so it
        # must be written, not dropped.
        return
