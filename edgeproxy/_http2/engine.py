"""The HTTP/2 protocol engine (jh2) as both ends of the proxy run it: its settings, its
connection and stream classes with the parts both ends change, and the steps of its state
machines that the fast paths take without it (an END_STREAM received, HEADERS sent).

* Each end checks the header blocks it receives per stream (:mod:`~edgeproxy._http2.fields`),
  so that a malformed one is that stream's error: jh2's own checks, which would end the
  connection, are off (:func:`engine_config`), and so is its ``Content-Length`` check
  (:class:`EngineStream`).
* jh2 remembers how each of the last 65,536 closed streams closed; only streams closed by
  RST_STREAM are kept, and only the last :data:`RESET_STREAMS_KEPT` of them
  (:class:`ResetStreams`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

# The protocol engine: jh2, h2's maintained fork with a compiled HPACK and the same API
# (the subclasses here and the fast paths touch its internals, so its version is pinned to
# a tested range in setup.cfg).
import jh2 as h2
import jh2.config
import jh2.connection
import jh2.settings
import jh2.stream
import jh2.utilities

from edgeproxy._http2.frames import header_frames

__all__ = [
    "CLOSED_BY_END_STREAM",
    "HALF_CLOSED_LOCAL",
    "RECEIVING",
    "RESET_STREAMS_KEPT",
    "STREAM_OPEN",
    "Engine",
    "EngineStream",
    "ResetStreams",
    "engine_config",
    "peer_defaults",
    "queue_headers",
    "received_end_stream",
]

# Streams closed by RST_STREAM whose closing h2 remembers, so that frames the
# peer sent before it saw the reset stay stream errors. Ten times the usual
# SETTINGS_MAX_CONCURRENT_STREAMS: far more resets than fit in one round trip.
RESET_STREAMS_KEPT: Final = 1024
_RESET_BY: Final = frozenset(
    {h2.stream.StreamClosedBy.SEND_RST_STREAM, h2.stream.StreamClosedBy.RECV_RST_STREAM}
)
STREAM_OPEN: Final = h2.stream.StreamState.OPEN
HALF_CLOSED_LOCAL: Final = h2.stream.StreamState.HALF_CLOSED_LOCAL
_HALF_CLOSED_REMOTE: Final = h2.stream.StreamState.HALF_CLOSED_REMOTE
_CLOSED: Final = h2.stream.StreamState.CLOSED
_STREAM_SEND_HEADERS: Final = h2.stream.StreamInputs.SEND_HEADERS
_STREAM_SEND_END_STREAM: Final = h2.stream.StreamInputs.SEND_END_STREAM
CLOSED_BY_END_STREAM: Final = h2.stream.StreamClosedBy.RECV_END_STREAM
"""How a stream closed whose peer's END_STREAM closed it."""
RECEIVING: Final = frozenset({STREAM_OPEN, HALF_CLOSED_LOCAL})
"""The states in which a stream still takes frames from the peer (compared by identity
with the two names on the paths every frame takes: an Enum's hash is a Python call)."""


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


def received_end_stream(machine: Any) -> None:
    """h2's stream state machine on a received END_STREAM (its stream_ended/_half_closed)."""
    if machine.state is HALF_CLOSED_LOCAL:
        machine.state = _CLOSED
        machine.stream_closed_by = CLOSED_BY_END_STREAM
    else:
        machine.state = _HALF_CLOSED_REMOTE


def queue_headers(engine: Any, h2stream: Any, block: bytes, end_stream: bool) -> None:
    """jh2's steps for HEADERS sent on ``h2stream``, taken without its frame objects: the
    stream's state machine (the connection's is the caller's), and the encoded header
    ``block`` queued as frames of the size the peer takes."""
    machine = h2stream.state_machine
    machine.process_input(_STREAM_SEND_HEADERS)
    if end_stream:
        machine.process_input(_STREAM_SEND_END_STREAM)
    engine._data_to_send += header_frames(
        h2stream.stream_id, block, end_stream, engine.max_outbound_frame_size
    )


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


class EngineStream(h2.stream.H2Stream):
    """A jh2 stream whose ``Content-Length`` is checked by the connection, per stream,
    where a bad value or a mismatch resets only this stream; jh2 would end the
    connection."""

    def _initialize_content_length(self, headers: Iterable[Any]) -> None:
        self._expected_content_length = None


class Engine(h2.connection.H2Connection):
    """A jh2 connection whose streams are of :attr:`stream_class` and whose table of
    closed streams is a :class:`ResetStreams`."""

    stream_class: type[EngineStream] = EngineStream

    def __init__(
        self, config: h2.config.H2Configuration, reset_streams_kept: int = RESET_STREAMS_KEPT
    ) -> None:
        super().__init__(config)
        self._closed_streams = ResetStreams(size_limit=reset_streams_kept)

    def _begin_new_stream(
        self, stream_id: int, allowed_ids: h2.connection.AllowedStreamIDs
    ) -> h2.stream.H2Stream:
        stream = super()._begin_new_stream(stream_id, allowed_ids)
        # h2 builds its own stream class; ours only overrides methods.
        stream.__class__ = self.stream_class
        return stream
