"""A raw HTTP/2 client (prior knowledge) speaking WebSocket on RFC 8441 extended CONNECTs,
framed with wsproto: the HTTP/2 listener's tests, and a browser-like client of the proxy."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, Event, TextMessage
from wsproto.extensions import Extension, PerMessageDeflate

__all__ = ["END", "Client", "ClientStream", "extended_connect"]

END = "end"  # the stream ended (END_STREAM)


@dataclass
class ClientStream:
    head: asyncio.Future[dict[bytes, bytes]]
    events: asyncio.Queue[Event | str] = field(default_factory=asyncio.Queue)
    ws: Connection | None = None
    body: bytearray = field(default_factory=bytearray)
    reset: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Client:
    """A raw HTTP/2 client (prior knowledge) speaking WebSocket on extended CONNECTs."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, window: int
    ) -> None:
        self.reader, self.writer = reader, writer
        config = h2.config.H2Configuration(client_side=True, validate_outbound_headers=False)
        self.conn = h2.connection.H2Connection(config)
        self.conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window}
        )
        self.settings: asyncio.Future[dict[int, int]] = asyncio.get_running_loop().create_future()
        self.streams: dict[int, ClientStream] = {}
        self._window = asyncio.Event()
        self._reading: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, port: int, *, window: int = 65535) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer, window)
        client.conn.initiate_connection()
        client.flush()
        client._reading = asyncio.create_task(client._read())
        await client.settings
        return client

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)

    def request(
        self, fields: list[tuple[str, str]], *, end: bool = False, ws: bool = False
    ) -> ClientStream:
        stream_id = self.conn.get_next_available_stream_id()
        stream = ClientStream(asyncio.get_running_loop().create_future())
        self.streams[stream_id] = stream
        self.conn.send_headers(stream_id, fields, end_stream=end)
        self.flush()
        return stream

    async def websocket(
        self, path: str = "/echo", extra: tuple[tuple[str, str], ...] = ()
    ) -> tuple[int, ClientStream]:
        """An extended CONNECT for a WebSocket, its 200 awaited."""
        stream_id = self.conn.get_next_available_stream_id()
        stream = self.request(extended_connect(path, extra))
        head = await stream.head
        assert head[b":status"] == b"200", head
        extensions: list[Extension] = []
        agreed = head.get(b"sec-websocket-extensions")
        if agreed is not None:
            deflate = PerMessageDeflate()
            deflate.finalize(agreed.decode())
            extensions.append(deflate)
        stream.ws = Connection(ConnectionType.CLIENT, extensions)
        if stream.body:
            # DATA read with the head, before the session's framing was known.
            stream.ws.receive_data(bytes(stream.body))
            stream.body.clear()
            for ws_event in stream.ws.events():
                stream.events.put_nowait(ws_event)
        return stream_id, stream

    async def send(self, stream_id: int, event: Event, *, end: bool = False) -> None:
        """A WebSocket frame on the stream, as the stream's windows allow."""
        ws = self.streams[stream_id].ws
        assert ws is not None
        await self.send_raw(stream_id, ws.send(event), end=end)

    async def send_raw(self, stream_id: int, data: bytes, *, end: bool = False) -> None:
        conn = self.conn
        while True:
            room = min(conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)
            piece, data = data[:room], data[room:]
            conn.send_data(stream_id, piece, end_stream=end and not data)
            self.flush()
            if not data:
                return
            while conn.local_flow_control_window(stream_id) <= 0:
                self._window.clear()
                await self._window.wait()

    async def next(self, stream: ClientStream) -> Event | str:
        """The next WebSocket event of the stream (END once it ended)."""
        return await asyncio.wait_for(stream.events.get(), 10)

    async def message(self, stream: ClientStream) -> str | bytes:
        """The next whole message (pings answered, fragments joined)."""
        parts: list[Any] = []
        while True:
            event = await self.next(stream)
            assert isinstance(event, TextMessage | BytesMessage), event
            parts.append(event.data)
            if event.message_finished:
                return "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)

    async def _read(self) -> None:
        while data := await self.reader.read(65536):
            for event in self.conn.receive_data(data):
                self._event(event)
            self.flush()

    def _event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RemoteSettingsChanged):
            if not self.settings.done():
                self.settings.set_result(
                    {int(code): change.new_value for code, change in event.changed_settings.items()}
                )
            self._window.set()
            return
        if isinstance(event, h2.events.WindowUpdated):
            self._window.set()
            return
        stream = self.streams.get(getattr(event, "stream_id", 0))
        if stream is None:
            return
        if isinstance(event, h2.events.ResponseReceived):
            stream.head.set_result(dict(event.headers))
        elif isinstance(event, h2.events.DataReceived):
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if stream.ws is None:
                stream.body += event.data
            else:
                stream.ws.receive_data(event.data)
                for ws_event in stream.ws.events():
                    stream.events.put_nowait(ws_event)
        elif isinstance(event, h2.events.StreamEnded):
            stream.events.put_nowait(END)
        elif isinstance(event, h2.events.StreamReset):
            stream.reset.set_result(int(event.error_code or 0))
            if not stream.head.done():
                stream.head.cancel()

    async def close(self) -> None:
        self.conn.close_connection()
        self.flush()
        self.writer.close()
        if self._reading is not None:
            await asyncio.gather(self._reading, return_exceptions=True)
        await asyncio.gather(self.writer.wait_closed(), return_exceptions=True)


def extended_connect(
    path: str = "/echo", extra: tuple[tuple[str, str], ...] = ()
) -> list[tuple[str, str]]:
    return [
        (":method", "CONNECT"),
        (":protocol", "websocket"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("sec-websocket-version", "13"),
        *extra,
    ]
