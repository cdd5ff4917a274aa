"""A cached answer: what is stored, how it is encoded for Redis, and how it is replayed.

An :class:`Entry` holds one complete 200 answer (a JSON body, a whole SSE
stream that ended as its API ends one, or a cacheable GET body) with its freshness
deadlines. It is replayed in the form the client asked for: a stream as SSE
events written one by one, a JSON answer as JSON, and across the two the
answer is converted by its API's dialect (a stream assembled into its JSON answer,
a JSON answer written as its stream, in the API's own events).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import orjson

from edgeproxy._protocol.dialects import Dialect
from edgeproxy._protocol.sse import SSEEvent, events_of

__all__ = ["BadEntry", "Entry", "ReadyForm", "ready_form", "replay_parts"]

# Encoded entries start with this magic and version: anything else is garbage.
_MAGIC: Final = b"EPC1"
_META_LEN: Final = 4
# Rough per-entry overhead beyond the body, for the memory tier's byte budget.
_OVERHEAD: Final = 256

# Headers that describe one particular delivery, not the answer: never stored.
_NOT_STORED: Final = frozenset(
    {
        "content-length",
        "date",
        "age",
        "set-cookie",
        "x-request-id",
        "server",
        "alt-svc",
        "via",
        "traceparent",
        "tracestate",
    }
)


class ReadyForm(NamedTuple):
    """One form an entry is served in, made once and kept with the entry: the head's
    stored headers (content type included; never mutated: each hit copies them with its
    own), the whole body (``body``) or its events (``parts``, an SSE form), and whether it
    goes as a stream."""

    head: list[tuple[str, str]]
    body: bytes | None
    parts: tuple[bytes, ...] | None
    sse: bool
    length: int | None
    """The body's size when it goes in one piece (a stream's parts go one by one)."""


class BadEntry(ValueError):
    """Bytes that are not an encoded entry (truncated, foreign or corrupt)."""


@dataclass(slots=True)
class Entry:
    """One stored answer and its freshness, in wall-clock seconds (shared across hosts)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    kind: str
    """``sse`` (a whole event stream), ``json``, or ``raw`` (replayed byte for byte)."""
    stored_at: float
    fresh_until: float
    swr_until: float
    """Until then a stale entry is served while one background request refreshes it."""
    sie_until: float
    """Until then a stale entry is served when every region fails."""
    delta: float
    """Seconds the answer took to compute: XFetch refreshes earlier for slow answers."""
    region: str | None = None
    _events: list[SSEEvent] | None = field(default=None, repr=False, compare=False)
    encoded: dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)
    """The answer as sent in a content coding, made on the first hit that asks for it."""
    forms: dict[tuple[bool, bool, str], ReadyForm] = field(
        default_factory=dict, repr=False, compare=False
    )
    """The forms served as stored (not converted), made on the first hit that asks for
    each: (stream?, with usage?, API) to its :class:`ReadyForm`. An entry stored again is
    a new entry: its forms are made again."""

    @classmethod
    def build(
        cls,
        *,
        status: int,
        headers: Iterable[tuple[str, str]],
        body: bytes,
        kind: str,
        ttl: float,
        swr: float,
        sie: float,
        delta: float,
        region: str | None,
        now: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Entry:
        """An entry stored ``now`` (else read from ``clock``, wall-clock seconds).

        Its windows follow from that: fresh for ``ttl``, then served stale for
        ``swr`` (stale-while-revalidate) or ``sie`` (stale-if-error) more.
        """
        now = clock() if now is None else now
        kept = tuple(
            (k.lower(), v)
            for k, v in headers
            if k.lower() not in _NOT_STORED and not k.lower().startswith("x-edgeproxy-")
        )
        fresh = now + ttl
        return cls(status, kept, body, kind, now, fresh, fresh + swr, fresh + sie, delta, region)

    # -- freshness -------------------------------------------------------

    @property
    def keep_until(self) -> float:
        """When a backend may drop the entry: past every window it can be served in."""
        return max(self.fresh_until, self.swr_until, self.sie_until)

    def age(self, now: float) -> int:
        """The ``Age`` header's value at ``now``: whole seconds since it was stored."""
        return max(0, int(now - self.stored_at))

    def should_refresh_early(self, now: float, beta: float, rand: float) -> bool:
        """XFetch (Vattani et al.): refresh before expiry with a probability that grows
        as expiry nears and with how long the answer took to compute.

        ``rand`` is uniform in (0, 1]; ``-log(rand)`` is an exponential draw.
        """
        if beta <= 0 or self.delta <= 0:
            return False
        return now - self.delta * beta * math.log(rand) >= self.fresh_until

    @property
    def size(self) -> int:
        return len(self.body) + sum(len(k) + len(v) for k, v in self.headers) + _OVERHEAD

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def events(self) -> list[SSEEvent]:
        """The SSE events of a stream entry, read once; an unfinished end, which a
        recorded stream never has, is one more event, so that their ``raw`` bytes are
        the whole body."""
        if self._events is None:
            body = self.body
            self._events = events_of(body, whole=True, max_event=len(body) + 1)
        return self._events

    # -- encoding for Redis ----------------------------------------------

    def encode(self) -> bytes:
        meta = orjson.dumps(
            {
                "s": self.status,
                "h": self.headers,
                "k": self.kind,
                "t": self.stored_at,
                "f": self.fresh_until,
                "w": self.swr_until,
                "e": self.sie_until,
                "d": self.delta,
                "r": self.region,
                "n": len(self.body),
            }
        )
        return _MAGIC + len(meta).to_bytes(_META_LEN, "big") + meta + self.body

    @classmethod
    def decode(cls, data: object) -> Entry:
        """Parse :meth:`encode`'s output; :class:`BadEntry` for anything else."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise BadEntry(f"not bytes but {type(data).__name__}")
        raw = bytes(data)
        head = len(_MAGIC) + _META_LEN
        if len(raw) < head or not raw.startswith(_MAGIC):
            raise BadEntry("no entry header")
        meta_len = int.from_bytes(raw[len(_MAGIC) : head], "big")
        try:
            meta = orjson.loads(raw[head : head + meta_len])
        except orjson.JSONDecodeError as exc:
            raise BadEntry(f"bad metadata: {exc}") from None
        body = raw[head + meta_len :]
        try:
            if len(body) != meta["n"]:
                raise BadEntry("truncated body")
            entry = cls(
                status=_int(meta["s"]),
                headers=tuple((str(k), str(v)) for k, v in meta["h"]),
                body=body,
                kind=str(meta["k"]),
                stored_at=_float(meta["t"]),
                fresh_until=_float(meta["f"]),
                swr_until=_float(meta["w"]),
                sie_until=_float(meta["e"]),
                delta=_float(meta["d"]),
                region=meta["r"] if isinstance(meta["r"], str) else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BadEntry(f"bad metadata: {exc!r}") from None
        if entry.kind not in ("sse", "json", "raw") or not 100 <= entry.status <= 599:
            raise BadEntry("bad metadata: kind or status")
        return entry


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"not an integer: {value!r}")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"not a number: {value!r}")
    return float(value)


# -- replay ------------------------------------------------------------------------


def replay_parts(
    entry: Entry, *, wants_sse: bool, include_usage: bool, dialect: Dialect
) -> tuple[list[bytes], bool] | None:
    """The body of ``entry``, an answer of ``dialect``'s API, as the client wants it:
    (parts, is_sse).

    A stream asked as a stream comes back event by event, as recorded (without the usage
    the client did not ask for), a JSON answer as one part, and across the two the dialect
    converts: a stream is assembled into its JSON answer, a JSON answer written as its
    stream. None when a conversion is impossible: the caller treats that as a miss.
    """
    if entry.kind == "sse":
        events = entry.events()
        if wants_sse:
            if include_usage:
                parts = [event.raw for event in events]
            else:
                parts = [event.raw for event in events if not dialect.usage_only(event)]
            return parts, True
        answer = dialect.assemble(events)
        if answer is None:
            return None
        return [orjson.dumps(answer)], False
    if entry.kind == "json" and wants_sse:
        try:
            answer = orjson.loads(entry.body)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(answer, dict):
            return None
        stream = dialect.stream_of(answer, include_usage=include_usage)
        if stream is None:
            # Embeddings and other answers have no stream form: sent as they are, where
            # the API's clients read that.
            if dialect.streams and not dialect.unstreamable_as_json:
                return None
            return [entry.body], False
        return stream, True
    return [entry.body], False


def ready_form(
    entry: Entry, *, wants_sse: bool, include_usage: bool, dialect: Dialect
) -> ReadyForm | None:
    """``entry`` as the client wants it, when it goes as it was stored (a stream as a
    stream, a JSON or raw body as it is), made once and kept with the entry; None when the
    form is a conversion between the two, which is made per hit (:func:`replay_parts`): a
    converted answer may carry ids made as it is written."""
    kind = entry.kind
    if kind == "sse":
        if not wants_sse:
            return None
        form_key = (True, include_usage, dialect.name)
    elif kind == "json" and wants_sse:
        return None
    else:
        form_key = (False, False, "")
    form = entry.forms.get(form_key)
    if form is None:
        if kind == "sse":
            events = entry.events()
            usage_only = dialect.usage_only
            parts = tuple(e.raw for e in events if include_usage or not usage_only(e))
            form = ReadyForm(list(entry.headers), None, parts, True, None)
        else:
            form = ReadyForm(list(entry.headers), entry.body, None, False, len(entry.body))
        entry.forms[form_key] = form
    return form


def response_headers(entry: Entry, *, sse: bool) -> list[tuple[str, str]]:
    """The stored headers, with the content type of the form being sent."""
    if (entry.kind == "sse") == sse:
        return list(entry.headers)
    out = [(k, v) for k, v in entry.headers if k not in ("content-type", "cache-control")]
    if sse:
        out += [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
    else:
        out.append(("content-type", "application/json"))
    return out
