"""What an upstream HTTP/2 connection needs around it to be driven by hand: a pool that asks
nothing of it and a transport that keeps what it wrote, for a test's own peer to read."""

from __future__ import annotations


class StubPool:
    origin = "http://stub"

    def stream_budget(self, now: float | None = None) -> int:
        return 0

    def _learn_stream_budget(self, accepted: int) -> None: ...

    def _slot_freed(self, conn: object) -> None: ...

    def _capacity_changed(self, conn: object) -> None: ...

    def _connection_gone(self, conn: object) -> None: ...


class Wire:
    """A transport that keeps what the client wrote, for the server side to read."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def take(self) -> bytes:
        data, self.out = bytes(self.out), bytearray()
        return data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> None:
        return None
