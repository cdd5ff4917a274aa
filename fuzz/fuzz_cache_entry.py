"""Fuzz the cache entry decoder: stored bytes to an ``Entry``, and entries replayed.

Input: the bytes a cache backend reads back (Redis, or the memory tier's
encoded form). The same bytes also serve as a stored answer: the first
byte picks its kind (``sse``, ``json`` or ``raw``, by its value modulo 3)
and the rest is the body, built into an entry as the recorder builds one.
The first form fuzzes the decoder, the second the replay of any body an
upstream could have sent (the decoder rarely lets random bytes through).

Property: ``Entry.decode`` raises only ``BadEntry``, and the same for
``bytes``, ``bytearray`` and ``memoryview``. A decoded entry has a kind the
cache knows, a status from 100 to 599, string headers and finite times, and
encodes back to an equal entry. Replaying an entry as an answer of each API, as a
stream or as JSON, with or without the usage chunk, gives None (the caller's miss) or the
parts to send, and its headers for either form are string pairs; its
freshness arithmetic does not fail.
"""

from __future__ import annotations

import math
import sys

from _harness import check, fuzz

from edgeproxy._cache.entry import BadEntry, Entry, replay_parts, response_headers
from edgeproxy._protocol.dialects import CHAT, EMBEDDINGS, MESSAGES, OPENAI, RESPONSES

_NOW = 1_700_000_000.0


def _decode(data: object) -> Entry | None:
    try:
        return Entry.decode(data)
    except BadEntry:
        return None


def _check_entry(entry: Entry) -> None:
    check(entry.kind in ("sse", "json", "raw"), "kind", entry.kind)
    check(type(entry.status) is int and 100 <= entry.status <= 599, "status", entry.status)
    check(type(entry.body) is bytes, "body", type(entry.body))
    check(
        type(entry.headers) is tuple
        and all(type(k) is str and type(v) is str for k, v in entry.headers),
        "headers",
        entry.headers,
    )
    times = (entry.stored_at, entry.fresh_until, entry.swr_until, entry.sie_until, entry.delta)
    check(all(type(t) is float and math.isfinite(t) for t in times), "times", times)
    check(entry.region is None or type(entry.region) is str, "region", entry.region)
    check(Entry.decode(entry.encode()) == entry, "encode does not round-trip", entry)
    check(type(entry.keep_until) is float and entry.size > 0, "keep_until or size", entry)
    check(entry.age(_NOW) >= 0, "age", entry.age(_NOW))
    for rand in (1.0, 0.5, 1e-300):
        check(type(entry.should_refresh_early(_NOW, 1.0, rand)) is bool, "xfetch", rand)


_FORMS = [
    (dialect, wants_sse, include_usage)
    for dialect in (CHAT, RESPONSES, MESSAGES, EMBEDDINGS, OPENAI)
    for wants_sse in (False, True)
    for include_usage in (False, True)
]


def _check_replay(entry: Entry) -> None:
    for dialect, wants_sse, include_usage in _FORMS:
        out = replay_parts(entry, wants_sse=wants_sse, include_usage=include_usage, dialect=dialect)
        if out is None:
            continue
        parts, sse = out
        check(type(sse) is bool, "replay shape", out)
        check(all(type(p) is bytes for p in parts), "replay parts", parts)
        check(sse or len(parts) == 1, "a JSON answer in several parts", parts)
        headers = response_headers(entry, sse=sse)
        check(all(type(k) is str and type(v) is str for k, v in headers), "headers", headers)


def _built(data: bytes) -> Entry:
    kind = ("sse", "json", "raw")[data[0] % 3]
    content_type = "text/event-stream" if kind == "sse" else "application/json"
    return Entry.build(
        status=200,
        headers=[("Content-Type", content_type), ("Date", "x"), ("X-Edgeproxy-Region", "r1")],
        body=data[1:],
        kind=kind,
        ttl=60.0,
        swr=30.0,
        sie=600.0,
        delta=0.25,
        region="r1",
        now=_NOW,
    )


def test_one_input(data: bytes) -> None:
    entry = _decode(data)
    check(_decode(bytearray(data)) == entry, "bytearray decodes differently", data)
    check(_decode(memoryview(data)) == entry, "memoryview decodes differently", data)
    if entry is not None:
        _check_entry(entry)
        _check_replay(entry)
    if data:
        built = _built(data)
        check(Entry.decode(built.encode()) == built, "a built entry does not round-trip", built)
        _check_entry(built)
        _check_replay(built)


if __name__ == "__main__":
    fuzz(
        test_one_input,
        "edgeproxy._cache.entry",
        "edgeproxy._protocol.dialects",
        "edgeproxy._protocol.openai",
    )
    sys.exit(0)
