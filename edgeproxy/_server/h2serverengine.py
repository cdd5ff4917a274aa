"""jh2's server side as the HTTP/2 listener runs it (:mod:`edgeproxy._server.h2server`):
a malformed request is its stream's error, not the connection's (RFC 9113 §8.1.1), closed
streams are forgotten as they end, and the cap on open streams is the listener's own."""

from __future__ import annotations

from typing import Any, Final, cast

import jh2.connection
import jh2.events
import jh2.stream

from edgeproxy._http2.engine import Engine, EngineStream

__all__ = ["MalformedRequest", "SelfDependent", "ServerEngine"]

_RECV_HEADERS: Final = jh2.stream.StreamInputs.RECV_HEADERS


class MalformedRequest(jh2.events.Event):
    """A header block jh2 would end the connection for; this stream alone is reset."""

    def __init__(self, stream_id: int, reason: str) -> None:
        self.stream_id = stream_id
        self.reason = reason


class SelfDependent(MalformedRequest):
    """A PRIORITY frame, or the priority of a HEADERS frame, making a stream depend on
    itself: that stream's error (RFC 7540 §5.3.1), which jh2 makes the connection's."""


class _H2Stream(EngineStream):
    """A jh2 stream whose malformed requests are stream errors (RFC 9113 §8.1.1);
    ``content-length`` is checked by
    :class:`~edgeproxy._server.h2connection.H2Connection`, per stream."""

    def receive_headers(
        self, headers: Any, end_stream: bool, header_encoding: Any
    ) -> tuple[list[Any], list[jh2.events.Event]]:
        headers = list(headers)
        machine = self.state_machine
        reason = ""
        if machine.headers_received:
            if not end_stream:
                reason = "trailers did not end the stream"
        elif headers and headers[0][0] == b":status":
            # jh2 would take it for an informational response: a connection error.
            reason = "a response pseudo-header in a request"
        if not reason:
            return cast(
                "tuple[list[Any], list[jh2.events.Event]]",
                super().receive_headers(headers, end_stream, header_encoding),
            )
        if not machine.headers_received:
            machine.process_input(_RECV_HEADERS)  # open, so that it can be reset
        return [], [MalformedRequest(self.stream_id, reason)]


class ServerEngine(Engine):
    """jh2's server connection: streams of :class:`_H2Stream`, closed ones forgotten as
    they end, and no cap on open streams of its own (the listener refuses a stream past
    its cap with REFUSED_STREAM; jh2 would end the connection)."""

    stream_class = _H2Stream

    @property
    def open_inbound_streams(self) -> int:
        return 0

    def _receive_settings_frame(self, frame: Any) -> tuple[list[Any], list[Any]]:
        frames, events = super()._receive_settings_frame(frame)
        if "ACK" not in frame.flags:
            # What the frame cost to take is one per entry, repeated ones included.
            events[-1].entries = frame.body_len // 6
        return frames, events

    def _receive_priority_frame(self, frame: Any) -> tuple[list[Any], list[Any]]:
        if frame.depends_on != frame.stream_id:
            return cast("tuple[list[Any], list[Any]]", super()._receive_priority_frame(frame))
        events = self.state_machine.process_input(jh2.connection.ConnectionInputs.RECV_PRIORITY)
        return [], [*events, SelfDependent(frame.stream_id, "a stream depends on itself")]

    def forget(self, stream_id: int) -> None:
        """A closed stream leaves the table (jh2 sweeps it only when counting streams)."""
        stream = self.streams.get(stream_id)
        if stream is not None and stream.closed:
            del self.streams[stream_id]
            self._closed_streams[stream_id] = stream.closed_by
