"""The Responder: the one writer of downstream bytes.

Every answer goes to the client through it: a region's, relayed chunk by chunk and never
buffered (:meth:`Responder.relay`), and every other :class:`~edgeproxy._core.answer.Answer`
(a cache entry, a coalesced flight, the local model, an error, a plugin's:
:meth:`Responder.send`). It writes the head, the body, the end, and a broken stream's end
(the API's error event, then no clean end); before the head, its heartbeats
(:mod:`edgeproxy._answer.heartbeat`) are its state. What it sent it records on the
request's outcome: the status, the bytes, the first byte's time, whether as SSE, the usage
and why an answer ended early.

A whole body is not written here but handed back ready (a :class:`Response`), for the front
end to frame with its own head in one go.

The same loop reads a region's answer for a background cache refresh, with no client:
:meth:`Responder.drain` calls the same hooks and feeds the cache's recorder the same way,
and writes nothing.

A region that knows the client's model under its own name (``[[regions]]
model_aliases``) answers with that name: the body is renamed back to the
client's as it passes (:class:`~edgeproxy._protocol.modelnames.ModelRewriter`),
before the hooks and the cache see it, and is sent chunked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

from edgeproxy._answer.body import body, through
from edgeproxy._answer.heartbeat import Heartbeat, wants_heartbeats
from edgeproxy._cache.stage import CacheRecorder
from edgeproxy._core.answer import Answer, AnswerBroken
from edgeproxy._core.context import RequestContext, UpstreamReply
from edgeproxy._core.errors import ProxyError, error_response
from edgeproxy._core.exchange import Exchange
from edgeproxy._core.outcome import LimitLevel
from edgeproxy._core.response import Response, StreamResponse
from edgeproxy._core.types import Headers
from edgeproxy._obtain.continuation import Leg, Splice
from edgeproxy._obtain.failover import AttemptResponse
from edgeproxy._plugins import PluginError, Plugins
from edgeproxy._protocol.compression import Compression, EncodedResponse
from edgeproxy._protocol.dialects import Dialect, dialect_named
from edgeproxy._protocol.endpoints import dialect_for
from edgeproxy._protocol.headers import strip_hop_by_hop
from edgeproxy._protocol.modelnames import ModelRewriter
from edgeproxy._protocol.ratelimits import limit_headers, stricter
from edgeproxy._protocol.usage import UsageTracker
from edgeproxy._upstream.pool import UpstreamError
from edgeproxy._upstream.regions import Region

__all__ = ["Responder"]

logger = logging.getLogger("edgeproxy")

_NO_BODY_STATUS = frozenset({204, 304})


class Legs(Protocol):
    """Where a broken stream's next leg comes from (the obtain path's continuation of one
    request), handed to :meth:`Responder.relay` for a route with ``continue_on_break``."""

    def splice(self, ctx: RequestContext, status: int, content_type: str) -> Splice | None:
        """A splice for this answer, or None when it cannot be continued."""
        ...

    async def next_leg(
        self, request: Exchange | None, ctx: RequestContext, splice: Splice, broken: str
    ) -> Leg | None:
        """The next leg after ``broken`` broke, owned by the caller; None: none."""
        ...


class Responder:
    """The one writer of downstream bytes; see the module's docstring.

    It reads a region's ``upstream`` but does not own it: the caller closes it, whatever
    happened here.
    """

    def __init__(
        self,
        plugins: Plugins,
        compression: Compression | None = None,
    ) -> None:
        self.plugins = plugins
        # Compresses answers for clients that accept it ([server] compression).
        self.compression = compression
        # While draining, answers close their connection so keep-alive clients reconnect
        # to a live instance.
        self.draining = False
        # Set when the proxy's grace period ended: a relay cancelled from then on
        # was cut by the shutdown, and tells its client so.
        self.shutting_down = False

    def heartbeats(self, request: Exchange | None, ctx: RequestContext) -> Heartbeat | None:
        """Early SSE heartbeats for this request, if its route asks for them and it streams:
        the Responder's state before the head (:mod:`edgeproxy._answer.heartbeat`)."""
        interval = wants_heartbeats(request, ctx)
        if interval is None or request is None:
            return None
        return Heartbeat(request, ctx, interval, self._beat)

    async def _beat(self, heartbeat: Heartbeat) -> None:
        """One heartbeat: the SSE response's head first (200, ``text/event-stream``), then
        the beat."""
        ctx = heartbeat.ctx
        out = ctx.outcome
        resp = heartbeat.response
        if resp is None:
            resp = heartbeat.response = StreamResponse(
                status=200,
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Request-Id": ctx.request_id,
                },
            )
            if self.draining:
                resp.force_close()
            out.status = 200
            out.response_is_sse = True
            await resp.prepare(heartbeat.request)
        beat = heartbeat.beat
        await resp.write(beat)
        heartbeat.sent += 1
        out.bytes_out += len(beat)

    async def relay(
        self,
        request: Exchange,
        ctx: RequestContext,
        upstream: AttemptResponse,
        *,
        recorder: CacheRecorder | None = None,
        started: StreamResponse | None = None,
        legs: Legs | None = None,
    ) -> StreamResponse:
        """Send the region's answer on; ``recorder`` (the cache's) sees the headers and each
        chunk as it passes, and is told when the body ended cleanly.

        ``started`` is the SSE response early heartbeats already began: the answer's events
        go on in it, and anything but a 200 stream becomes an ``error`` event there.
        ``legs``: where a stream that breaks after tokens were sent goes on (the route's
        ``continue_on_break``); without it, a break ends the stream with an error event."""
        region = upstream.region
        reply = await self._reply(request, ctx, upstream, recorder)
        if started is not None:
            return await self._after_heartbeats(
                request, ctx, upstream, reply, recorder, started, legs
            )
        transform = "edgeproxy_stream_chunk" in self.plugins.active
        # The headers go into one list that becomes the response's CIMultiDict in a
        # single step. _reply dropped any of the proxy's own names a region sent.
        headers: Headers = []
        content_length: int | None = None
        content_type = ""
        for name, value in reply.headers:
            lname = name.lower()
            if lname == "content-length":
                content_length = int(value) if value.isdigit() else None
            else:
                headers.append((name, value))
                if lname == "content-type":
                    content_type = value
        headers.append(("X-Edgeproxy-Region", region.name))
        headers.append(("X-Request-Id", ctx.request_id))
        if ctx.outcome.cache:
            headers.append(("X-Edgeproxy-Cache", ctx.outcome.cache))
        if ctx.outcome.state is not None:
            # A chain the edge rescued: its input was expanded from what the edge held.
            headers.append(("X-Edgeproxy-State", ctx.outcome.state))
        if ctx.outcome.limits is not None:
            anthropic = _dialect(ctx).anthropic
            ours = limit_headers(ctx.outcome.limits, anthropic=anthropic)
            headers = stricter(headers, ours, anthropic=anthropic)
        if upstream.other_model is not None:
            # Another model than asked answered: the ladder's lighter rung (degraded), or a
            # larger context window for a request too long for the model.
            if ctx.outcome.degraded == "lighter-model":
                headers.append(("X-Edgeproxy-Degraded", ctx.outcome.degraded))
            headers.append(("X-Edgeproxy-Model", ctx.model or ""))
        encoding = None
        if self.compression is not None:
            sse = content_type.startswith("text/event-stream")
            encoding = self.compression.choose(ctx, reply.status, content_length, headers, sse=sse)
        resp: StreamResponse
        if encoding is None:
            resp = StreamResponse(status=reply.status, headers=headers)
        else:
            resp = EncodedResponse(encoding, status=reply.status, headers=headers)
        if self.draining:
            resp.force_close()
        splice: Splice | None = None
        if legs is not None:
            splice = legs.splice(ctx, reply.status, content_type)
        # A transformed (or continued) body has an unknown length: the front end frames it.
        if (
            content_length is not None
            and reply.status not in _NO_BODY_STATUS
            and not transform
            and splice is None
            and encoding is None
        ):
            resp.content_length = content_length
        out = ctx.outcome
        out.response_is_sse = content_type.startswith("text/event-stream")
        usage = UsageTracker.for_response(
            ctx.path, content_type, reply.status, ctx.json, _keeps(ctx)
        )
        try:
            # Inside the try: the client may already be gone when headers go out.
            await resp.prepare(request)
            ctx.outcome.first_byte_at = time.monotonic()
            if splice is None or legs is None:
                sse = out.response_is_sse
                if ctx.model is None or _alias(ctx, region) is None:
                    # The attempt's body read here directly, no iterator of its own between.
                    first, rest = upstream.body()
                    try:
                        if recorder is None and not transform:
                            # The common body: its own loop, called here (a frame less
                            # to resume on every event).
                            await through(out, rest, resp.writer, usage, sse, first)
                        else:
                            await body(
                                self.plugins,
                                request,
                                ctx,
                                rest,
                                recorder,
                                resp.writer,
                                usage,
                                sse=sse,
                                first=first,
                            )
                    except UpstreamError as broke:
                        upstream.broke(broke)
                        raise
                    upstream.body_done()
                else:
                    chunks = self._chunks(ctx, upstream)
                    await body(
                        self.plugins, request, ctx, chunks, recorder, resp.writer, usage, sse=sse
                    )
            else:
                await self._spliced(request, ctx, upstream, recorder, resp, usage, splice, legs)
            await resp.write_eof()
        except UpstreamError as exc:
            # Counted against the region by the attempt itself (AttemptResponse).
            # The detail (addresses, parser text) is logged, never sent to the client.
            name = ctx.outcome.region or region.name
            ctx.outcome.error = f"upstream broke mid-body: {exc}"
            logger.warning("request %s: region %s broke the stream: %s", ctx.request_id, name, exc)
            await self._broken(request, resp, name, splice)
            return resp
        except ConnectionResetError:
            # The client went away: the pipeline's finally cancels the upstream stream.
            ctx.outcome.error = "client disconnected"
            return resp
        except PluginError as failed:
            # Too late for a 500: end the response so it cannot pass for complete.
            ctx.outcome.error = str(failed)
            logger.error("%s", failed, exc_info=failed.error)
            await self._abort(
                request,
                resp,
                500,
                "plugin_error",
                f"plugin {failed.plugin} failed mid-stream",
                "plugin_error",
            )
            return resp
        except asyncio.CancelledError:
            if self.shutting_down:
                # The grace period ended: no waiting now, only the event and the close.
                ctx.outcome.error = "cut at the end of the shutdown grace period"
                await self._cut(request, resp)
            raise
        return resp

    async def _after_heartbeats(
        self,
        request: Exchange,
        ctx: RequestContext,
        upstream: AttemptResponse,
        reply: UpstreamReply,
        recorder: CacheRecorder | None,
        resp: StreamResponse,
        legs: Legs | None,
    ) -> StreamResponse:
        """The region's answer in the SSE response the heartbeats started (status 200 sent)."""
        out = ctx.outcome
        name = upstream.region.name
        content_type = next((v for k, v in reply.headers if k.lower() == "content-type"), "")
        if reply.status != 200 or not content_type.startswith("text/event-stream"):
            out.error = f"region {name} answered {reply.status} after heartbeats"
            await self._abort(
                request,
                resp,
                reply.status if reply.status >= 400 else 502,
                "upstream_error",
                f"region {name} answered {reply.status}",
                "upstream_error",
            )
            return resp
        out.status = 200
        usage = UsageTracker.for_response(ctx.path, content_type, 200, ctx.json, _keeps(ctx))
        splice: Splice | None = None
        if legs is not None:
            splice = legs.splice(ctx, 200, content_type)
        try:
            out.first_byte_at = time.monotonic()
            if splice is None or legs is None:
                chunks = self._chunks(ctx, upstream)
                await body(
                    self.plugins, request, ctx, chunks, recorder, resp.writer, usage, sse=True
                )
            else:
                await self._spliced(request, ctx, upstream, recorder, resp, usage, splice, legs)
            await resp.write_eof()
        except UpstreamError as exc:
            out.error = f"upstream broke mid-body: {exc}"
            await self._broken(request, resp, out.region or name, splice)
        except ConnectionResetError:
            out.error = "client disconnected"
        return resp

    async def send(
        self,
        request: Exchange,
        ctx: RequestContext,
        answer: Answer,
        *,
        started: StreamResponse | None = None,
    ) -> StreamResponse:
        """Send ``answer`` (anything but a region's, which :meth:`relay` sends).

        A whole body is made (``make``) before anything goes, so that its failure is still
        a clean error answer, and is handed back ready for the front end to send. A body in
        pieces is written as they come, and a broken one ends as :meth:`relay` ends a
        broken stream. ``started``: the SSE response early heartbeats began (status 200
        sent): a streamed answer goes on in it, anything else becomes an ``error`` event."""
        out = ctx.outcome
        try:
            if started is not None:
                if answer.chunks is None or not answer.sse or answer.status != 200:
                    err = _after_heartbeats_error(answer)
                    out.error = err.message
                    await self._abort(
                        request, started, err.status, err.type, err.message, err.code or err.type
                    )
                    return started
                await self._pieces(request, ctx, answer, started)
                return started
            if answer.chunks is None:
                body = answer.body
                if answer.make is not None:
                    try:
                        body = await answer.make()
                    except ProxyError as err:
                        return self.error(ctx, err)
                    except ConnectionResetError:
                        out.error = "client disconnected"
                        out.status = answer.status
                        return answer.ready(b"")
                return self.ready(ctx, answer, body)
            resp = StreamResponse(status=answer.status, headers=answer.headers)
            if self.draining:
                resp.force_close()
            if out.limits is not None:
                _state_limits(ctx, resp, out.limits)
            out.status = answer.status
            out.response_is_sse = answer.sse
            await resp.prepare(request)
            await self._pieces(request, ctx, answer, resp)
            return resp
        finally:
            if answer.usage is not None:
                out.usage = answer.usage()
            if answer.release is not None:
                answer.release()

    def ready(
        self, ctx: RequestContext, answer: Answer, body: bytes | None = None
    ) -> StreamResponse:
        """A whole answer (``body``, else its own), ready for the front end to send: its
        head and body framed in one go (:meth:`Answer.ready`). Without a coroutine: a
        cache hit's answer, which holds nothing, comes this way."""
        resp = answer.ready(body)
        if self.draining:
            resp.force_close()
        out = ctx.outcome
        if out.limits is not None:
            _state_limits(ctx, resp, out.limits)
        out.status = answer.status
        out.response_is_sse = answer.sse
        parts = answer.parts
        if parts is not None:
            out.bytes_out += sum(map(len, parts))
        else:
            out.bytes_out += len(body if body is not None else answer.body or b"")
        return resp

    async def _pieces(
        self, request: Exchange, ctx: RequestContext, answer: Answer, resp: StreamResponse
    ) -> None:
        """An answer's body piece by piece, in ``resp`` (prepared), then its end."""
        out = ctx.outcome
        chunks = answer.chunks
        assert chunks is not None
        write = resp.writer
        try:
            out.first_byte_at = time.monotonic()
            async for chunk in chunks:
                await write(chunk)
                out.bytes_out += len(chunk)
                if request.client_gone():
                    # Without handler cancellation nobody else notices before the next write.
                    raise ConnectionResetError("client disconnected")
            await resp.write_eof()
        except ConnectionResetError:
            out.error = "client disconnected"
        except AnswerBroken as broken:
            out.error = broken.reason
            err = broken.error
            await self._abort(
                request,
                resp,
                err.status,
                err.type,
                err.message,
                err.code or err.type,
                sequence=broken.sequence,
            )
        finally:
            # What the body holds (a generation, a follower's place) is let go of now.
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    def error(self, ctx: RequestContext, err: ProxyError) -> Response:
        """The error answer, in the client's API, ready for the front end to send."""
        out = ctx.outcome
        out.status = err.status
        out.error = err.message
        headers = {"X-Edgeproxy-Region": out.region or "none", "X-Request-Id": ctx.request_id}
        if out.cache:
            headers["X-Edgeproxy-Cache"] = out.cache
        headers.update(err.headers)
        dialect = _dialect(ctx)
        answer = error_response(err.status, dialect.error_body(err), headers=headers)
        limits = err.limits if err.limits is not None else out.limits
        if limits is not None and ctx.route.rate_limit_headers:
            _state_limits(ctx, answer, limits)
        return answer

    async def error_after(
        self, request: Exchange, ctx: RequestContext, err: ProxyError, started: StreamResponse
    ) -> StreamResponse:
        """The answer is an error, but heartbeats already sent 200: an ``error`` event."""
        ctx.outcome.error = err.message
        await self._abort(request, started, err.status, err.type, err.message, err.code or err.type)
        return started

    def own(self, ctx: RequestContext, answer: StreamResponse) -> StreamResponse:
        """A response the proxy (or a plugin) made itself, with the proxy's headers, for the
        front end to send."""
        out = ctx.outcome
        answer.headers.setdefault("X-Edgeproxy-Region", out.region or "none")
        answer.headers["X-Request-Id"] = ctx.request_id
        if out.limits is not None:
            _state_limits(ctx, answer, out.limits)
        if out.degraded:
            answer.headers["X-Edgeproxy-Degraded"] = out.degraded
            if out.attempts:
                # What the regions were asked before the ladder answered.
                answer.headers["X-Edgeproxy-Attempts"] = str(out.attempts)
        out.status = answer.status
        return answer

    async def drain(
        self, ctx: RequestContext, upstream: AttemptResponse, recorder: CacheRecorder
    ) -> None:
        """Read the region's answer with no client (a background cache refresh) into
        ``recorder``, through the same hooks as :meth:`relay` (with ``request=None``).

        Raises what breaks it: :class:`UpstreamError`, :class:`PluginError`.
        """
        reply = await self._reply(None, ctx, upstream, recorder)
        sse = any(
            k.lower() == "content-type" and v.startswith("text/event-stream")
            for k, v in reply.headers
        )
        chunks = self._chunks(ctx, upstream)
        await body(self.plugins, None, ctx, chunks, recorder, None, None, sse=sse)

    async def _reply(
        self,
        request: Exchange | None,
        ctx: RequestContext,
        upstream: AttemptResponse,
        recorder: CacheRecorder | None,
    ) -> UpstreamReply:
        """The region's status and headers, once the plugins edited them; the recorder sees
        them too."""
        # The one filter of a region's headers, whatever the answer then goes to (a client
        # on any front end, the cache): the proxy's own are added after it.
        headers = strip_hop_by_hop(upstream.headers, passed=ctx.route.pass_response_headers)
        if upstream.attempts > 1:
            headers.append(("X-Edgeproxy-Attempts", str(upstream.attempts)))
        reply = UpstreamReply(upstream.status, headers)
        if ctx.model is not None and _alias(ctx, upstream.region) is not None:
            # The body is renamed back to the client's model: its length changes.
            reply.headers = [(k, v) for k, v in reply.headers if k.lower() != "content-length"]
        if "edgeproxy_upstream_response" in self.plugins.active:
            await self.plugins.call_all(
                "edgeproxy_upstream_response",
                request=request,
                ctx=ctx,
                region=upstream.region,
                reply=reply,
            )
        if recorder is not None:
            recorder.start(reply, upstream.region.name)
        ctx.outcome.status = reply.status
        return reply

    def _chunks(self, ctx: RequestContext, upstream: AttemptResponse) -> AsyncIterator[bytes]:
        """The region's body, renamed back to the client's model if the region aliases it."""
        chunks = upstream.aiter_bytes()
        if ctx.model is not None:
            target = _alias(ctx, upstream.region)
            if target is not None:
                # The region answered under its own name: the client sees its own again.
                chunks = ModelRewriter(target, ctx.model).stream(chunks)
        return chunks

    async def _spliced(
        self,
        request: Exchange,
        ctx: RequestContext,
        upstream: AttemptResponse,
        recorder: CacheRecorder | None,
        resp: StreamResponse,
        usage: UsageTracker | None,
        splice: Splice,
        legs: Legs,
    ) -> None:
        """The body with continuation on: whole events reach the client through ``splice``,
        and a break after tokens were sent goes on at the next leg ``legs`` finds. This
        stage owns each such leg (closed here); the first stays the caller's.

        Raises the :class:`UpstreamError` of a break that could not be continued.
        """
        out = ctx.outcome
        leg: Leg | None = None
        source = upstream.region.name
        chunks = self._chunks(ctx, upstream)
        write = resp.writer
        try:
            while True:
                try:
                    await body(
                        self.plugins,
                        request,
                        ctx,
                        chunks,
                        recorder,
                        write,
                        usage,
                        sse=True,
                        splice=splice,
                    )
                    break
                except UpstreamError as exc:
                    broke = exc
                # Past the handler: the compiled build (mypyc) re-raised an exception the
                # handler had caught when these awaits ran inside it.
                # The broken leg is let go of now, its region's slot with it.
                if leg is not None:
                    await leg.close()
                    leg = None
                else:
                    await upstream.aclose()
                leg = await legs.next_leg(request, ctx, splice, source)
                if leg is None:
                    raise broke
                # A spliced answer is not stored; its own usage is the legs' sum.
                source, chunks, recorder, usage = leg.name, leg.chunks, None, None
            if splice.continued:
                tail = splice.finish()
                if tail:
                    await write(tail)
                    out.bytes_out += len(tail)
                out.usage = splice.usage()
        finally:
            if leg is not None:
                await leg.close()

    async def _abort(
        self,
        request: Exchange,
        resp: StreamResponse,
        status: int,
        type: str,
        message: str,
        code: str,
        *,
        sequence: int = 0,
    ) -> None:
        """End a response that already started, so the client cannot take it as complete.

        SSE clients get a well-formed ``error`` event first, in the client's API with its
        ``code`` (numbered ``sequence`` where the API numbers its events); then the
        connection is closed without the final chunk, which every client reads as a
        truncated body rather than a clean end.
        """
        if _is_sse(resp):
            try:
                await resp.write(_error_event(request, status, type, message, code, sequence))
            except ConnectionResetError:
                pass
        resp.force_close()
        request.abort()

    async def _broken(
        self, request: Exchange, resp: StreamResponse, region: str, splice: Splice | None
    ) -> None:
        """End a stream that broke and was not continued: with the refusal of the region
        asked to continue it (a 4xx, passed on once), else saying that ``region`` broke it."""
        refused = splice.refused if splice is not None else None
        if refused is not None:
            status, type, message, code = (
                refused.status,
                refused.type,
                refused.message,
                refused.code,
            )
        else:
            status, type, code = 502, "upstream_error", "upstream_stream_broken"
            message = f"region {region} broke the stream"
        sequence = splice.sequence if splice is not None else 0
        await self._abort(request, resp, status, type, message, code or type, sequence=sequence)

    async def _cut(self, request: Exchange, resp: StreamResponse) -> None:
        """:meth:`_abort` for a relay cancelled at shutdown, which must not wait: the event
        is queued without waiting for the client to read it, then the answer is aborted."""
        if request.client_gone():
            return
        resp.force_close()
        if resp.prepared and _is_sse(resp):
            event = _error_event(
                request, 503, "service_unavailable", "the proxy is shutting down", "shutting_down"
            )
            await request.cut(event)
        else:
            request.abort()


def _alias(ctx: RequestContext, region: Region) -> str | None:
    """The region's own name for the model the client named, if it aliases it."""
    aliases = region.config.model_aliases
    return aliases.get(ctx.model) if aliases and ctx.model is not None else None


def _is_sse(resp: StreamResponse) -> bool:
    return resp.headers.get("content-type", "").startswith("text/event-stream")


def _error_event(
    request: Exchange, status: int, type: str, message: str, code: str, sequence: int = 0
) -> bytes:
    """The event that ends a broken stream, in the client's API: its SDK raises it as its
    own error (see each dialect's ``error_event``)."""
    dialect = dialect_for(request.target.split("?", 1)[0])
    return dialect.error_event(ProxyError(status, type, message, code=code), sequence=sequence)


def _after_heartbeats_error(answer: Answer) -> ProxyError:
    """What a client is told when, after heartbeats (200 sent), the answer is not a 200
    stream: another answer cannot follow the 200 already sent."""
    return ProxyError(503, "service_unavailable", "no region answered", code="no_region")


def _keeps(ctx: RequestContext) -> bool:
    """Whether the answer's stored response is kept for the edge's copy of its chain."""
    facts = ctx.facts
    return (
        ctx.route.responses_state == "edge" and facts is not None and facts.dialect == "responses"
    )


def _dialect(ctx: RequestContext) -> Dialect:
    facts = ctx.facts
    return dialect_named(facts.dialect) if facts is not None else dialect_for(ctx.path)


def _state_limits(ctx: RequestContext, resp: StreamResponse, limits: dict[str, LimitLevel]) -> None:
    """The rate limits' levels on an answer of the proxy's own, in the API's headers."""
    for name, value in limit_headers(limits, anthropic=_dialect(ctx).anthropic):
        resp.headers[name] = value
