"""Server-sent events, read incrementally: the one home of SSE framing.

A stream is parsed once in each direction. A region's stream is read by its
attempt (``edgeproxy/_obtain/attempt.py``: its opening events, up to the one
that commits it, and on to a continuation leg's first token); the body as the
client gets it is read by the Responder (``edgeproxy/_answer/responder.py``),
whose events feed whatever looks inside (the usage, the cache's recorder and
its followers, a continuation's splice). Bytes held whole are read with
:func:`events_of`. Each :class:`SSEReader` follows the WHATWG event-stream
rules:

* lines end with ``\\n``, ``\\r\\n`` or ``\\r``, and a chunk may end anywhere,
  even between the two bytes of a ``\\r\\n``;
* a blank line ends an event; ``data:`` lines are joined with ``\\n``; one
  space after the colon is dropped; a line without a colon is a field with an
  empty value; a line starting with ``:`` is a comment;
* a UTF-8 byte-order mark at the start of the stream is skipped.

Each :class:`SSEEvent` keeps its exact bytes (``raw``, blank line included),
so a caller can hold events and forward them unchanged: the ``raw`` of the
events a reader returned, followed by its ``tail``, is always exactly the
bytes it was fed. Blank lines between events (no event per the spec) belong
to the ``raw`` of the event after them, and so does the LF of a CRLF that a
chunk cut in two after its CR (the CR ended the event already).

Unlike a browser, the reader returns every block a blank line ends, also
those a browser would not dispatch (comments only, ``event:`` alone): a
proxy forwards them. ``comment`` marks a block of comment lines only, such
as a ``: ping`` heartbeat.

Bounded: an event (or an unfinished tail) longer than ``max_event`` bytes
raises :class:`SSEEventTooLarge`; the stream is then to be abandoned.

Fast path: a chunk that is exactly one ``data: ...\\n\\n`` event, what
OpenAI-style servers send per token, is one event with no line loop and no
copy of ``raw``.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator
from typing import Final, NamedTuple

__all__ = [
    "MAX_EVENT",
    "SSEEvent",
    "SSEEventTooLarge",
    "SSEReader",
    "events_of",
    "iter_events",
]

MAX_EVENT: Final = 1024 * 1024
"""The default bound on one event's bytes."""

_BOM: Final = b"\xef\xbb\xbf"
_LINE_END: Final = re.compile(rb"\r\n|\r|\n")
# A line end followed by another (a blank line): where an event ends. A CR directly
# followed by LF is one line end, never two.
_BLANK: Final = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
_NAMES: dict[bytes, str] = {}  # event names seen, decoded once (bounded below)


class SSEEvent(NamedTuple):
    """One event of a stream, as sent (immutable)."""

    event: str | None
    """The ``event:`` field (the last one), None when absent or empty."""
    data: bytes
    """The ``data:`` lines' values joined with ``\\n`` (empty when there were none)."""
    raw: bytes
    """The event's exact bytes, its blank line (and any blank lines before it) included."""
    comment: bool = False
    """Only comment lines (``: ping``): nothing for a client, a heartbeat for a proxy."""
    id: str | None = None
    """The ``id:`` field, when the event has one."""


class SSEEventTooLarge(ValueError):
    """An event, or the unfinished end of a stream, passed the reader's ``max_event``."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"a server-sent event of {size} bytes or more passed the {limit}-byte limit"
        )
        self.size = size
        self.limit = limit


_new = tuple.__new__


def _name(value: bytes) -> str | None:
    if not value:
        return None
    name = _NAMES.get(value)
    if name is None:
        name = value.decode("utf-8", "replace")
        if len(_NAMES) < 256:
            _NAMES[value] = name
    return name


def _event(block: bytes, raw: bytes, cr: bool) -> SSEEvent:
    """The event of ``block`` (its lines, without the last line end)."""
    if block.startswith(b"data:") and (
        block.find(b"\n") < 0 if not cr else _LINE_END.search(block) is None
    ):
        data = block[6:] if block[5:6] == b" " else block[5:]
        return _new(SSEEvent, (None, data, raw, False, None))
    if not cr and block.startswith(b"event:"):
        # "event: <name>" then one data line: Anthropic's and the Responses API's events.
        nl = block.find(b"\n")
        if nl > 0 and block.startswith(b"data:", nl + 1) and block.find(b"\n", nl + 1) < 0:
            name = _name(block[7:nl] if block[6] == 32 else block[6:nl])
            at = nl + 7 if block[nl + 6 : nl + 7] == b" " else nl + 6
            return _new(SSEEvent, (name, block[at:], raw, False, None))
    lines = _LINE_END.split(block) if cr else block.split(b"\n")
    event: str | None = None
    event_id: str | None = None
    parts: list[bytes] = []
    comment = True
    for line in lines:
        if line[:1] == b":":
            continue
        comment = False
        field, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            parts.append(value)
        elif field == b"event":
            event = _name(value)
        elif field == b"id" and b"\0" not in value:
            event_id = value.decode("utf-8", "replace")
    data = parts[0] if len(parts) == 1 else b"\n".join(parts)
    return _new(SSEEvent, (event, data, raw, comment, event_id))


class SSEReader:
    """Reads one stream's events as its chunks come: :meth:`feed` returns those each completes."""

    __slots__ = ("_tail", "_lead", "_fresh", "_plain", "max_event")

    def __init__(self, *, max_event: int = MAX_EVENT) -> None:
        self.max_event = max_event
        self._tail = b""
        self._lead = 0  # bytes of a byte-order mark at the start of the tail
        self._fresh = True  # the stream's first bytes are still to be checked for a BOM
        self._plain = False  # no tail and past the start: the fast path may apply

    @property
    def tail(self) -> bytes:
        """The bytes fed after the last complete event (an event not yet ended)."""
        return self._tail

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """The events ``chunk`` completes, in order; the rest is kept for the next chunk.

        Raises :class:`SSEEventTooLarge` for an event longer than ``max_event``.
        """
        if self._plain:
            # The fast paths: a chunk that is exactly one event, as servers write them.
            end = len(chunk) - 2
            first = chunk.find(b"\n")
            if first == end:
                # One data line: OpenAI-style servers' per-token event.
                if (
                    chunk.startswith(b"data:")
                    and chunk[-1] == 10
                    and chunk.find(b"\r") < 0
                    and end < self.max_event
                ):
                    data = chunk[6:end] if chunk[5] == 32 else chunk[5:end]
                    return [_new(SSEEvent, (None, data, chunk, False, None))]
            elif (
                first > 0
                and chunk.find(b"\n\n", first) == end
                and chunk.find(b"\r") < 0
                and end < self.max_event
            ):
                # Several lines (``event:`` and ``data:``): Anthropic's, the Responses API's.
                return [_event(chunk[:end], chunk, False)]
            return self._scan(chunk, 0)
        tail = self._tail
        buf = tail + chunk if tail else chunk
        resume = max(0, len(tail) - 3)
        if self._fresh:
            if len(buf) < 3 and _BOM.startswith(buf):
                self._tail = buf
                return []
            self._fresh = False
            self._lead = 3 if buf.startswith(_BOM) else 0
        return self._scan(buf, resume)

    def _scan(self, buf: bytes, resume: int) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        size = len(buf)
        cr = buf.find(b"\r") >= 0
        limit = self.max_event
        if (
            not cr
            and not resume
            and not self._lead
            and buf[:1] != b"\n"
            and buf.find(b"\n\n\n") < 0
        ):
            # LF line ends and no blank lines between events: each "\n\n" ends one.
            parts = buf.split(b"\n\n")
            tail = parts.pop()
            for part in parts:
                if len(part) + 2 > limit:
                    raise self._overflow(len(part) + 2, limit)
                events.append(_event(part, part + b"\n\n", False))
            if len(tail) > limit:
                raise self._overflow(len(tail), limit)
            self._tail = tail
            self._plain = not tail
            return events
        start = 0  # where the next event's raw bytes start
        pos = self._lead
        while True:
            # Blank lines before an event (and the LF of a CRLF cut by a chunk) go with it.
            while pos < size and buf[pos] in (10, 13):
                pos += 1
            if pos >= size:
                break
            frm = pos if pos > resume else resume
            if cr:
                match = _BLANK.search(buf, frm)
                if match is None:
                    break
                end, after = match.span()
            else:
                end = buf.find(b"\n\n", frm)
                if end < 0:
                    break
                after = end + 2
            if after - start > limit:
                raise self._overflow(after - start, limit)
            events.append(_event(buf[pos:end], buf[start:after], cr))
            start = pos = after
            self._lead = 0
        tail = buf[start:] if start else buf
        if len(tail) > limit:
            raise self._overflow(len(tail), limit)
        self._tail = tail
        self._plain = not tail
        return events

    def _overflow(self, size: int, limit: int) -> SSEEventTooLarge:
        """The error for an event of ``size`` bytes over ``limit``; the stream is abandoned,
        so nothing of it is kept."""
        self._tail = b""
        self._plain = True
        return SSEEventTooLarge(size, limit)

    def close(self, *, dispatch: bool = False) -> SSEEvent | None:
        """The end of the stream. With ``dispatch``, the unfinished last event, if any, as
        an event (its ``raw`` without a blank line); without (the spec's rule: a client
        drops it), None. :attr:`tail` still holds the unfinished bytes either way."""
        if not dispatch:
            return None
        tail = self._tail
        block = tail[self._lead :].lstrip(b"\r\n").rstrip(b"\r\n")
        if not block:
            return None
        return _event(block, tail, tail.find(b"\r") >= 0)


def iter_events(
    chunks: AsyncIterable[bytes], *, max_event: int = MAX_EVENT
) -> AsyncIterator[SSEEvent]:
    """The events of a stream of chunks, each as soon as its blank line came (an unfinished
    last event is dropped, as the spec says)."""
    return _Events(chunks.__aiter__(), SSEReader(max_event=max_event))


class _Events:
    """:func:`iter_events`'s iterator, a class rather than an async generator so that the
    compiled build (mypyc, which has no async generators) compiles it too."""

    __slots__ = ("_chunks", "_reader", "_ready")

    def __init__(self, chunks: AsyncIterator[bytes], reader: SSEReader) -> None:
        self._chunks = chunks
        self._reader = reader
        self._ready: deque[SSEEvent] = deque()

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> SSEEvent:
        ready = self._ready
        while not ready:
            # StopAsyncIteration from the chunks ends the events as well.
            ready.extend(self._reader.feed(await self._chunks.__anext__()))
        return ready.popleft()


def events_of(body: bytes, *, whole: bool = False, max_event: int = MAX_EVENT) -> list[SSEEvent]:
    """The events of bytes held whole (a stream's opening, a stored stream, events the proxy
    wrote itself), read in one go. With ``whole``, an unfinished end is one more event, so
    that the events' ``raw`` bytes are all of ``body``; without, it is dropped, as the spec
    says. Raises :class:`SSEEventTooLarge` for an event longer than ``max_event``."""
    reader = SSEReader(max_event=max_event)
    events = reader.feed(body)
    if whole and reader.tail:
        last = reader.close(dispatch=True)
        events.append(last if last is not None else SSEEvent(None, b"", reader.tail, True))
    return events
