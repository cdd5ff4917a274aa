"""What a request sends on its h2c stream (the HEADERS that open it, the DATA of its body),
with jh2's state machines moved as jh2 moves them but without their ``process_input``
where the move is the usual one: a new stream opened, a body sent on an open one. Any
other state takes jh2's own steps (:func:`~edgeproxy._http2.engine.queue_headers`,
:func:`~edgeproxy._http2.windows.queue_data`), which raise as jh2 does.
"""

from __future__ import annotations

from typing import Any, Final

import jh2.connection
import jh2.stream

from edgeproxy._http2.engine import HALF_CLOSED_LOCAL, STREAM_OPEN, queue_headers
from edgeproxy._http2.frames import FRAME_HEADER, header_frames
from edgeproxy._http2.windows import queue_data

__all__ = ["new_request_stream", "request_data", "request_headers"]

_ODD: Final = jh2.connection.AllowedStreamIDs.ODD
_CLIENT_OPEN: Final = jh2.connection.ConnectionState.CLIENT_OPEN
_IDLE: Final = jh2.stream.StreamState.IDLE


def new_request_stream(engine: Any, stream_id: int) -> Any:
    """jh2's ``_begin_new_stream`` for the client's next stream, an odd id past the last:
    the engine's own stream class made at once, with the windows and frame sizes jh2
    gives it. Any other id is jh2's, which raises."""
    if stream_id <= engine.highest_outbound_stream_id or not stream_id & 1:
        return engine._begin_new_stream(stream_id, _ODD)
    stream = engine.stream_class(
        stream_id,
        config=engine.config,
        inbound_window_size=engine.local_settings.initial_window_size,
        outbound_window_size=engine.remote_settings.initial_window_size,
    )
    stream.max_inbound_frame_size = engine.max_inbound_frame_size
    stream.max_outbound_frame_size = engine.max_outbound_frame_size
    engine.streams[stream_id] = stream
    engine.highest_outbound_stream_id = stream_id
    return stream


def request_headers(engine: Any, h2stream: Any, block: bytes, end_stream: bool) -> None:
    """The header ``block`` of a request queued on its new ``h2stream``: the stream's
    state machine moved (jh2's ``request_sent``, then END_STREAM), the frames queued."""
    machine = h2stream.state_machine
    if machine.state is not _IDLE:
        queue_headers(engine, h2stream, block, end_stream)
        return
    machine.client = True
    machine.headers_sent = True
    machine.state = HALF_CLOSED_LOCAL if end_stream else STREAM_OPEN
    engine._data_to_send += header_frames(
        h2stream.stream_id, block, end_stream, engine.max_outbound_frame_size
    )


def request_data(engine: Any, h2stream: Any, data: memoryview, end: bool) -> None:
    """One unpadded DATA frame of a request body queued, both send windows charged; the
    caller has made sure that the windows and the frame size allow ``data``."""
    machine = h2stream.state_machine
    if machine.state is not STREAM_OPEN or engine.state_machine.state is not _CLIENT_OPEN:
        queue_data(engine, h2stream, data, end)
        return
    if end:
        machine.state = HALF_CLOSED_LOCAL
    size = len(data)
    h2stream.outbound_flow_control_window -= size
    engine.outbound_flow_control_window -= size
    out = engine._data_to_send
    out += FRAME_HEADER.pack(size >> 16, size & 0xFFFF, 0, 1 if end else 0, h2stream.stream_id)
    out += data
