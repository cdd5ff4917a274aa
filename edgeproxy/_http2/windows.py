"""HTTP/2 flow control (RFC 9113 §5.2, §6.9) on the fast paths of both ends: the receive
windows a DATA frame taken without the protocol engine is charged to, when handing bytes
back makes the engine send a WINDOW_UPDATE, and the send windows a DATA frame built here
is charged to, each as jh2 itself does it.
"""

from __future__ import annotations

from typing import Any, Final

import jh2.connection
import jh2.stream

from edgeproxy._http2.engine import HALF_CLOSED_LOCAL, STREAM_OPEN
from edgeproxy._http2.frames import FRAME_HEADER

__all__ = ["queue_data", "take_data", "window_update_due"]


_SEND_DATA: Final = jh2.connection.ConnectionInputs.SEND_DATA
_STREAM_SEND_DATA: Final = jh2.stream.StreamInputs.SEND_DATA
_STREAM_SEND_END_STREAM: Final = jh2.stream.StreamInputs.SEND_END_STREAM


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
    state = machine.state
    # RECEIVING's two states, by identity: this runs for every DATA frame at either end.
    if (state is not STREAM_OPEN and state is not HALF_CLOSED_LOCAL) or (
        after_headers and not machine.headers_received
    ):
        return None
    conn_window = h2conn._inbound_flow_control_window_manager
    stream_window = h2stream._inbound_window_manager
    if conn_window.current_window_size < length or stream_window.current_window_size < length:
        return None
    conn_window.current_window_size -= length
    stream_window.current_window_size -= length
    return h2stream


def window_update_due(window: Any, size: int) -> bool:
    """Whether h2's window manager would send a WINDOW_UPDATE once ``size`` more bytes are
    processed (its own rule, ``WindowManager._maybe_update_window``)."""
    processed = window._bytes_processed + size
    if window.current_window_size == 0 and processed > min(1024, window.max_window_size // 4):
        return True
    return bool(processed >= window.max_window_size // 2)


def queue_data(h2conn: Any, h2stream: Any, data: bytes | bytearray | memoryview, end: bool) -> None:
    """jh2's ``send_data`` for one unpadded DATA frame, taken without its frame objects:
    both state machines moved, both send windows charged, the frame queued. The caller
    has made sure that the windows and the frame size allow ``data``."""
    size = len(data)
    h2conn.state_machine.process_input(_SEND_DATA)
    machine = h2stream.state_machine
    machine.process_input(_STREAM_SEND_DATA)
    if end:
        machine.process_input(_STREAM_SEND_END_STREAM)
    h2stream.outbound_flow_control_window -= size
    h2conn.outbound_flow_control_window -= size
    out = h2conn._data_to_send
    out += FRAME_HEADER.pack(size >> 16, size & 0xFFFF, 0, 1 if end else 0, h2stream.stream_id)
    out += data
