"""The upstream pool assumes RFC 9113's defaults of a region that has not said otherwise.

A region whose SETTINGS frame leaves INITIAL_WINDOW_SIZE out gives each stream 65,535
bytes (RFC 9113 §6.5.2). Its connection window may be far larger (servers open it wide
with a WINDOW_UPDATE on stream 0). A request body must still stop at the stream's window
until the region opens it: more is a FLOW_CONTROL_ERROR the region answers by dropping
the stream, or the connection."""

from __future__ import annotations

import asyncio
import os

import hyperframe.frame as hf

from edgeproxy._upstream.h2pool import H2Pool

from .test_h2pool import limits

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
WINDOW = 65_535


class StrictRegion:
    """A bare HTTP/2 server: empty SETTINGS, a 16 MiB connection window, streams of the
    RFC's default window, opened by WINDOW_UPDATE only once what it allowed arrived.
    It records any DATA beyond what it allowed."""

    def __init__(self) -> None:
        self.received = 0
        self.overrun = 0
        self.done = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readexactly(len(PREFACE))
            writer.write(hf.SettingsFrame(0).serialize())  # nothing said: the defaults
            update = hf.WindowUpdateFrame(0)
            update.window_increment = 16 * 1024 * 1024 - WINDOW
            writer.write(update.serialize())
            allowed = WINDOW
            while True:
                head = await reader.readexactly(9)
                frame, length = hf.Frame.parse_frame_header(memoryview(head))
                frame.parse_body(memoryview(await reader.readexactly(length)))
                if isinstance(frame, hf.SettingsFrame) and "ACK" not in frame.flags:
                    writer.write(hf.SettingsFrame(0, flags=["ACK"]).serialize())
                elif isinstance(frame, hf.DataFrame) and frame.stream_id == 1:
                    self.received += len(frame.data)
                    self.overrun = max(self.overrun, self.received - allowed)
                    if self.received == allowed:
                        # All it allowed came: allow as much again.
                        more = hf.WindowUpdateFrame(1)
                        more.window_increment = WINDOW
                        writer.write(more.serialize())
                        allowed += WINDOW
                    if "END_STREAM" in frame.flags:
                        headers = hf.HeadersFrame(1, flags=["END_HEADERS", "END_STREAM"])
                        headers.data = b"\x88"  # :status 200, from the static table
                        writer.write(headers.serialize())
                        self.done.set()
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_body_keeps_to_the_rfcs_stream_window_when_settings_leave_it_out() -> None:
    region = StrictRegion()
    server = await asyncio.start_server(region.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = H2Pool(f"http://127.0.0.1:{port}", limits(warm_connections=0))
    body = os.urandom(200_000)
    try:
        resp = await pool.request("POST", "/v1/chat/completions", [], body)
        assert resp.status == 200
        await resp.aclose()
    finally:
        await pool.aclose()
        server.close()
        await server.wait_closed()
    assert region.done.is_set() and region.received == len(body)
    assert region.overrun == 0
