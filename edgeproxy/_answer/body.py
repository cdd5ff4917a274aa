"""The Responder's body loops: a region's body to the client, and a stream's one parse.

:func:`body` is the general loop: each chunk through the ``edgeproxy_stream_chunk`` hooks,
a stream's events read once, as the client gets them, for whatever looks inside (the
usage, the cache's recorder and its followers, a continuation's splice). :func:`through`
is the loop of the common body, which nothing stores, splices or transforms: its
per-event cost is the proxy's on every such stream, so it does no more than it must.
Both are the Responder's (:mod:`edgeproxy._answer.responder`), which alone calls them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from edgeproxy._cache.recorder import CacheRecorder
from edgeproxy._core.context import RequestContext
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.outcome import Outcome
from edgeproxy._obtain.continuation import Splice
from edgeproxy._plugins import Plugins
from edgeproxy._protocol.sse import SSEEvent, SSEEventTooLarge, SSEReader
from edgeproxy._protocol.usage import UsageTracker
from edgeproxy._upstream.pool import UpstreamError

__all__ = ["body", "through"]


async def body(
    plugins: Plugins,
    request: Exchange | None,
    ctx: RequestContext,
    chunks: AsyncIterator[bytes] | None,
    recorder: CacheRecorder | None,
    write: Callable[[bytes], Awaitable[None]] | None,
    usage: UsageTracker | None,
    *,
    sse: bool,
    splice: Splice | None = None,
    first: bytes | None = None,
) -> None:
    """The one body loop, and a stream's one parse: ``first``, then ``chunks`` (None:
    nothing more), each chunk through the plugins; a
    stream's events read once, as the client gets them, for whatever looks inside (the
    usage, the cache's recorder and its followers, a continuation's splice); then to
    ``write`` (through ``splice``, whole events only).

    The events are read from every chunk when the recorder or a splice needs them all;
    else only where the usage may be: a chunk of whole events (none pending before it)
    that does not mention it, as the per-token events are, goes by unread."""
    transform = "edgeproxy_stream_chunk" in plugins.active
    out = ctx.outcome
    if not transform and recorder is None and splice is None and write is not None:
        await through(out, chunks, write, usage, sse, first)
        return
    every = splice is not None or (recorder is not None and recorder.reads)
    reader = SSEReader() if sse and (every or usage is not None) else None
    pending = first
    while True:
        if pending is not None:
            chunk = pending
            pending = None
        elif chunks is None:
            break
        else:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
        if transform:
            chunk = await plugins.call_chain(
                "edgeproxy_stream_chunk", "chunk", request=request, ctx=ctx, chunk=chunk
            )
            if not chunk:
                continue
        events: list[SSEEvent] | None = None
        if reader is not None and (
            every or reader.tail or not chunk.endswith(b"\n\n") or chunk.find(b'"usage"') >= 0
        ):
            try:
                events = reader.feed(chunk)
            except SSEEventTooLarge as exc:
                if splice is not None:
                    raise UpstreamError(str(exc)) from exc  # the leg is taken as broken
                reader = None
                if recorder is not None:
                    recorder.unreadable()
        if usage is not None:
            usage.feed(chunk, events)
        if recorder is not None:
            recorder.feed(chunk, events)
        if splice is not None:
            chunk = splice.feed(events) if events else b""
            if not chunk:
                continue
        if write is not None:
            await write(chunk)
        out.bytes_out += len(chunk)
    if recorder is not None:
        recorder.finish()
    if usage is not None:
        out.usage = usage.result()
        if usage.keeps:
            out.stored = usage.kept()


async def through(
    out: Outcome,
    chunks: AsyncIterator[bytes] | None,
    write: Callable[[bytes], Awaitable[None]],
    usage: UsageTracker | None,
    sse: bool,
    first: bytes | None,
) -> None:
    """:func:`body` for the common body, which nothing stores, splices or transforms:
    each chunk straight through, a stream's events read only where the usage may be
    (the same rule), and the bytes counted once at the end. Its loop is the per-event
    cost of every such stream: it does no more than it must."""
    sent = 0
    reader = SSEReader() if sse and usage is not None else None
    held = False  # the reader holds the start of an event
    try:
        if first is not None:
            if usage is not None:
                events = None
                if reader is not None:
                    try:
                        events = reader.feed(first)
                        held = bool(reader.tail)
                    except SSEEventTooLarge:
                        reader = None
                usage.feed(first, events)
            await write(first)
            sent += len(first)
        if chunks is None:
            pass
        elif usage is None:
            async for chunk in chunks:
                await write(chunk)
                sent += len(chunk)
        else:
            feed = usage.feed
            async for chunk in chunks:
                if reader is not None and (
                    held or chunk.find(b'"usage"') >= 0 or not chunk.endswith(b"\n\n")
                ):
                    try:
                        feed(chunk, reader.feed(chunk))
                        held = bool(reader.tail)
                    except SSEEventTooLarge:
                        reader = None
                        feed(chunk, None)
                else:
                    feed(chunk, None)
                await write(chunk)
                sent += len(chunk)
    finally:
        out.bytes_out += sent
    if usage is not None:
        out.usage = usage.result()
        if usage.keeps:
            out.stored = usage.kept()
