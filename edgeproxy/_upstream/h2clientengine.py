"""The HTTP/2 protocol engine (jh2) as the upstream pools run it: its client connection
(:class:`ClientEngine`) for :mod:`edgeproxy._upstream.h2conn`, which drains after GOAWAY
and makes a malformed response its stream's error rather than the connection's.

* A malformed response (RFC 9113 §8.1.1: frames out of order, trailers that do not end
  the stream, an informational response after the final one) becomes an event
  (:class:`MalformedHeaders`, :class:`MalformedData`) on which the connection resets that
  stream alone; ``Content-Length`` is checked by the connection, per stream.
* What both ends share of the engine (its settings, the table of closed streams) is
  :mod:`edgeproxy._http2.engine`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jh2 as h2
import jh2.config
import jh2.connection
import jh2.events
import jh2.stream
import jh2.utilities

from edgeproxy._http2.engine import RECEIVING, Engine, EngineStream

__all__ = ["ClientEngine", "MalformedData", "MalformedHeaders"]


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


class _H2Stream(EngineStream):
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
        if machine.state in RECEIVING:
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
        if machine.state in RECEIVING and not machine.headers_received:
            event = MalformedData(
                stream_id=self.stream_id,
                flow_controlled_length=flow_control_len,
                reason="DATA came before the response headers",
            )
            return [], [event]
        return super().receive_data(data, end_stream, flow_control_len)


class ClientEngine(Engine):
    """An h2 client connection that can drain after GOAWAY, with per-stream errors."""

    stream_class = _H2Stream

    def __init__(self, config: h2.config.H2Configuration, reset_streams_kept: int) -> None:
        super().__init__(config, reset_streams_kept)
        self.state_machine = _DrainingStateMachine()

    def clear_outbound_data_buffer(self) -> None:
        # h2 calls this only on a received GOAWAY; the buffer may still hold
        # WINDOW_UPDATEs or body frames for streams the peer will finish, so it
        # must be written, not dropped.
        return
