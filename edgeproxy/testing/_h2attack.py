"""A hostile HTTP/2 client: raw frames over cleartext (prior knowledge), to break the rules
on purpose and count what the server answered.

The client keeps no HTTP/2 state machine of its own (one would refuse to send what it is
meant to send): frames are built by hand, header blocks encoded with ``hpack`` (which does
not check names), and what comes back is parsed frame by frame. It answers SETTINGS and
PING as a client must, and gives back receive window as it reads, unless told not to (a
client that keeps its window shut).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import hpack

__all__ = [
    "FLOODS",
    "MALFORMED",
    "Answer",
    "H2Attacker",
    "flood_frame",
    "frame",
    "malformed_frames",
    "priority_frame",
    "settings_frame",
]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADER = struct.Struct(">BHBBL")
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x6, 0x7, 0x8, 0x9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
MAX_FRAME = 16384  # SETTINGS_MAX_FRAME_SIZE's initial value (RFC 9113 §6.5.2)
Field = tuple[str, str]


@dataclass
class Answer:
    """What came back on one stream: its status, body, whether it ended cleanly, and the
    RST_STREAM error code if it was reset."""

    status: int = 0
    body: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset: int | None = None
    data_frames: int = 0
    """DATA frames received, empty ones included (an answer to HEAD has none)."""

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame, as given (nothing is checked)."""
    size = len(payload)
    return _HEADER.pack(size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload


def request_fields(path: str = "/v1/chat/completions", method: str = "POST") -> list[Field]:
    return [
        (":method", method),
        (":path", path),
        (":scheme", "http"),
        (":authority", "localhost"),
        ("content-type", "application/json"),
    ]


class H2Attacker:
    """One raw HTTP/2 connection to ``url`` (``http://host:port``)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, read: bool
    ) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = 2**20
        self.answers: dict[int, Answer] = {}
        self.goaway: tuple[int, int] | None = None  # (error code, last stream id)
        self.settings: dict[int, int] = {}  # what the server's SETTINGS said, by code
        self.closed = asyncio.Event()
        self.give_window = read
        self.next_id = 1
        self._block = bytearray()  # a header block waiting for its CONTINUATION
        self._reading: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    @classmethod
    async def open(cls, url: str, *, window: int = 65535, read: bool = True) -> H2Attacker:
        """Connect and send the preface; ``window``: SETTINGS_INITIAL_WINDOW_SIZE;
        ``read``: give back receive window as answers arrive."""
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        client = cls(reader, writer, read=read)
        client.send(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HL", 0x4, window)))
        client._reading = asyncio.create_task(client._read())
        return client

    # -- sending -----------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except ConnectionError:
            pass

    def stream(self) -> int:
        stream_id = self.next_id
        self.next_id += 2
        self.answers[stream_id] = Answer()
        return stream_id

    def headers_frame(
        self, stream_id: int, fields: Iterable[Field], *, end_stream: bool = False
    ) -> bytes:
        """A HEADERS frame, and CONTINUATION frames for a block past the 16 KiB frame
        size a server takes unless it says otherwise."""
        block = self.encoder.encode(list(fields))
        flags = END_STREAM if end_stream else 0
        if len(block) <= MAX_FRAME:
            return frame(HEADERS, END_HEADERS | flags, stream_id, block)
        out = [frame(HEADERS, flags, stream_id, block[:MAX_FRAME])]
        for start in range(MAX_FRAME, len(block), MAX_FRAME):
            last = END_HEADERS if start + MAX_FRAME >= len(block) else 0
            out.append(frame(CONTINUATION, last, stream_id, block[start : start + MAX_FRAME]))
        return b"".join(out)

    def request(
        self, fields: Sequence[Field] | None = None, body: bytes | None = None
    ) -> tuple[int, bytes]:
        """A new stream's request as bytes (HEADERS, then DATA ending it when ``body`` is
        given); its stream id."""
        stream_id = self.stream()
        fields = request_fields() if fields is None else fields
        if body is None:
            return stream_id, self.headers_frame(stream_id, fields, end_stream=True)
        return stream_id, self.headers_frame(stream_id, fields) + frame(
            DATA, END_STREAM, stream_id, body
        )

    def reset(self, stream_id: int, code: int = 0x8) -> bytes:
        return frame(RST_STREAM, 0, stream_id, struct.pack(">L", code))

    # -- what came back ------------------------------------------------------------------

    async def answer(self, stream_id: int, timeout: float = 30) -> Answer:
        """Until the stream's answer ended or was reset (or the connection closed)."""
        answer = self.answers[stream_id]
        async with asyncio.timeout(timeout):
            while not answer.done and not self.closed.is_set():
                await self._wait()
        return answer

    async def wait_goaway(self, timeout: float = 30) -> tuple[int, int] | None:
        """Until GOAWAY came or the connection closed: (error code, last stream id)."""
        async with asyncio.timeout(timeout):
            while self.goaway is None and not self.closed.is_set():
                await self._wait()
        return self.goaway

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def _read(self) -> None:
        buffer = b""
        try:
            while data := await self.reader.read(65536):
                buffer += data
                while len(buffer) >= 9:
                    hi, lo, kind, flags, stream_id = _HEADER.unpack_from(buffer)
                    end = 9 + (hi << 16 | lo)
                    if len(buffer) < end:
                        break
                    self._frame(kind, flags, stream_id & 0x7FFFFFFF, buffer[9:end])
                    buffer = buffer[end:]
                self._changed.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed.set()
            self._changed.set()

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        answer = self.answers.get(stream_id)
        if kind == SETTINGS and not flags & ACK:
            for start in range(0, len(payload) - 5, 6):
                code, value = struct.unpack_from(">HL", payload, start)
                self.settings[code] = value
            self.send(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self.send(frame(PING, ACK, 0, payload))
        elif kind in (HEADERS, CONTINUATION):
            self._block += payload
            if flags & END_HEADERS:
                fields = dict(self.decoder.decode(bytes(self._block), raw=True))
                self._block.clear()
                if answer is not None and b":status" in fields:
                    status = int(fields[b":status"])
                    if status >= 200:
                        answer.status = status
                if answer is not None and flags & END_STREAM:
                    answer.ended = True
        elif kind == DATA:
            if answer is not None:
                answer.data_frames += 1
                answer.body += payload
                if flags & END_STREAM:
                    answer.ended = True
            if self.give_window and payload:
                increment = struct.pack(">L", len(payload))
                self.send(frame(WINDOW_UPDATE, 0, 0, increment))
                if answer is not None and not answer.done:
                    self.send(frame(WINDOW_UPDATE, 0, stream_id, increment))
        elif kind == RST_STREAM:
            if answer is not None:
                answer.reset = struct.unpack(">L", payload[:4])[0]
        elif kind == GOAWAY:
            last, code = struct.unpack(">LL", payload[:8])
            self.goaway = (code, last & 0x7FFFFFFF)

    async def close(self) -> None:
        self.writer.close()
        if self._reading is not None:
            self._reading.cancel()
            await asyncio.gather(self._reading, return_exceptions=True)


def _fields(*extra: Field, drop: str = "", first: Sequence[Field] = ()) -> list[Field]:
    fields = [f for f in request_fields() if f[0] != drop]
    return [*first, *fields, *extra]


# Malformed requests (RFC 9113 §8.1.1), each a stream error: (header fields, body frames).
# A body is a list of (payload, flags) DATA frames; a tuple entry is a HEADERS frame (the
# trailers' fields, their flags).
Body = list[tuple[bytes, int] | tuple[list[Field], int]]
MALFORMED: dict[str, tuple[list[Field], Body]] = {
    "content-length-short": (
        _fields(("content-length", "5")),
        [(b'{"model": "m", "messages": [{"role": "user", "x": "y"}]}', END_STREAM)],
    ),
    "content-length-long": (_fields(("content-length", "500")), [(b"{}", END_STREAM)]),
    "upper-case-name": (_fields(("X-Upper", "1")), [(b"{}", END_STREAM)]),
    "connection-header": (_fields(("connection", "keep-alive")), [(b"{}", END_STREAM)]),
    "te-gzip": (_fields(("te", "gzip")), [(b"{}", END_STREAM)]),
    "transfer-encoding": (_fields(("transfer-encoding", "chunked")), [(b"{}", END_STREAM)]),
    "pseudo-after-regular": (
        [("content-type", "application/json"), *request_fields()[:4]],
        [(b"{}", END_STREAM)],
    ),
    "no-path": (_fields(drop=":path"), [(b"{}", END_STREAM)]),
    "no-method": (_fields(drop=":method"), [(b"{}", END_STREAM)]),
    "unknown-pseudo": (_fields(first=[(":foo", "bar")]), [(b"{}", END_STREAM)]),
    "response-pseudo": (_fields(first=[(":status", "200")]), [(b"{}", END_STREAM)]),
    "duplicate-method": (_fields(first=[(":method", "GET")]), [(b"{}", END_STREAM)]),
    "authority-host-differ": (_fields(("host", "elsewhere")), [(b"{}", END_STREAM)]),
    "value-with-newline": (_fields(("x-a", "1\nx-b: 2")), [(b"{}", END_STREAM)]),
    "trailers-without-end-stream": (_fields(), [(b"{}", 0), ([("x-trailer", "1")], 0)]),
}


def malformed_frames(client: H2Attacker, name: str) -> tuple[int, bytes]:
    """The malformed request ``name`` on a new stream: its stream id and frames."""
    fields, body = MALFORMED[name]
    stream_id = client.stream()
    out = client.headers_frame(stream_id, fields)
    for payload, flags in body:
        if isinstance(payload, list):
            block = client.encoder.encode(payload)
            out += frame(HEADERS, END_HEADERS | flags, stream_id, block)
        else:
            out += frame(DATA, flags, stream_id, payload)
    return stream_id, out


# Frame floods, each built for an open stream: name -> frame for stream ``s``.
FLOODS: dict[str, str] = {
    "ping": "PING",
    "settings": "empty SETTINGS",
    "priority": "PRIORITY on the stream",
    "window-update-connection": "WINDOW_UPDATE of 1 on the connection",
    "window-update-stream": "WINDOW_UPDATE of 1 on the stream",
    "empty-data": "empty DATA on the stream, not ending it",
    "unknown-type": "a frame of type 0x77",
}


def flood_frame(name: str, stream_id: int, index: int) -> bytes:
    if name == "ping":
        return frame(PING, 0, 0, index.to_bytes(8, "big"))
    if name == "settings":
        return frame(SETTINGS, 0, 0)
    if name == "priority":
        return frame(PRIORITY, 0, stream_id, struct.pack(">LB", 0, 15))
    if name == "window-update-connection":
        return frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 1))
    if name == "window-update-stream":
        return frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">L", 1))
    if name == "empty-data":
        return frame(DATA, 0, stream_id)
    if name == "unknown-type":
        return frame(0x77, 0, 0, b"x")
    raise KeyError(name)


def settings_frame(entries: Iterable[tuple[int, int]]) -> bytes:
    """A SETTINGS frame of ``(code, value)`` entries, repeats included (nothing checked)."""
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HL", c, v) for c, v in entries))


def priority_frame(stream_id: int, depends_on: int, weight: int = 15) -> bytes:
    """A PRIORITY frame making ``stream_id`` depend on ``depends_on`` (itself, if asked)."""
    return frame(PRIORITY, 0, stream_id, struct.pack(">LB", depends_on, weight))
