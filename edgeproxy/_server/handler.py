"""The HTTP/1.1 connection handler of the proxy's listener (:class:`EdgeRequestHandler`):
aiohttp's, with the connection limits aiohttp lacks (see :mod:`edgeproxy._server.listener`)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadStatusLine, LineTooLong
from aiohttp.http_writer import HttpVersion11
from aiohttp.web_request import BaseRequest

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.bodies import BodyTooLarge, body_bound_due, body_bound_passed
from edgeproxy._server.guard import ConnectionGuard, raw_error
from edgeproxy._server.headchecks import ECHO_LIMIT, own_error, version_error

__all__ = ["EdgeRequestHandler"]

logger = logging.getLogger("edgeproxy")

# While the proxy drains, a body has this long (at most) before its rate is checked.
_DRAIN_RATE_GRACE = 1.0
# After a client's FIN, what tells a client that only shut its sending side from one that
# closed: an interim answer every HTTP/1.1 client must read and skip (RFC 9110 §15.2),
# which a closed socket answers with a reset. The socket's TCP state is then read every
# _GONE_POLL seconds while the request runs (Linux's TCP_INFO; TCP_CLOSE after a reset).
_PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"
_GONE_POLL = 0.25
_TCP_CLOSE = 7
_TCP_INFO: int | None = getattr(socket, "TCP_INFO", None)

# Connection phases, see EdgeRequestHandler.
_IDLE, _HEAD, _BODY, _BUSY, _DRAIN = range(5)


def _parser_reason(message: str | None) -> str:
    """The parser's explanation without the bytes it quotes (the client's own, echoed)."""
    parts = []
    for line in (message or "bad request").splitlines():
        # llhttp quotes them on a line of their own (b'...'), the pure-Python parser inline.
        line, quote, _ = line.replace('"', "'").partition("'")
        line = line.strip()
        if quote and (line == "b" or line.endswith(" b")):
            line = line[:-1]  # the prefix of a bytes literal
        line = line.rstrip(" :")
        if line:
            parts.append(line)
        if quote:
            break
    return ": ".join(parts)[:ECHO_LIMIT] or "bad request"


class EdgeRequestHandler(web.RequestHandler):
    """aiohttp's HTTP/1.1 connection handler plus the limits it lacks.

    Phases: idle (between requests), head (bytes of a request head are
    arriving: the header timeout runs), body (the handler runs and the body
    is still arriving: its timers run and the size is counted), busy (the
    handler runs, the body is complete), drain (the handler answered without
    reading the whole body, which aiohttp now discards). The middleware
    reports when a handler starts and ends.

    A body in progress is bounded three ways, each a 408 that closes the
    connection: ``body_timeout`` between two reads, an average of
    ``min_body_rate`` bytes a second once ``body_rate_grace`` has passed, and
    ``body_deadline`` in all. Time the proxy itself stopped reading
    (backpressure from a slow region) counts for none of them.
    """

    __slots__ = (
        "_guard",
        "_counted",
        "_peer",
        "_phase",
        "_timer",
        "_head_timer",
        "_head_at",
        "_payload",
        "_request_task",
        "_last_data",
        "_body_started",
        "_paused_at",
        "_paused_total",
        "_head_bytes",
        "_line_len",
        "_stalled",
        "_half_closed",
        "_request",
        "_probe_timer",
        "_handled",
        "_queued",
    )

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._counted = False
        self._peer = ""
        self._phase = _IDLE
        # The body's timers; the head's has its own, kept armed across the requests of a
        # busy connection: it checks, when it fires, whether the head now arriving is late.
        self._timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_at = 0.0  # when the bytes of the head now arriving started
        self._payload: Any = None
        self._request_task: asyncio.Task[Any] | None = None
        self._last_data = 0.0
        self._body_started = 0.0
        self._paused_at = -1.0  # when the proxy stopped reading this body; -1: reading
        self._paused_total = 0.0
        self._head_bytes = 0
        self._line_len = -1  # length of the request line, once its end arrived
        self._stalled = False
        self._half_closed = False  # the client shut its side after whole requests
        self._request: BaseRequest | None = None  # the request whose handler runs
        self._probe_timer: asyncio.TimerHandle | None = None
        self._handled = 0  # requests whose handler returned (aiohttp counts those parsed)
        self._queued = False  # the request running waits in admission's queue

    # -- asyncio protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        guard = self._guard
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refused = guard.admit(ip)
        if refused is not None:
            self._refuse(guard.refusal(refused))
            return
        guard.connections.add(self)
        self._peer = ip
        self._counted = True
        # A new connection must send its first request head in time.
        self._head_started()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._counted = False
            self._guard.connections.discard(self)
            self._guard.release(self._peer)
        self._cancel_timer()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._probe_timer is not None:
            self._probe_timer.cancel()
            self._probe_timer = None
        self._payload = None
        self._request_task = None
        self._request = None
        super().connection_lost(exc)

    # aiohttp types it as returning None; asyncio reads True as "keep the transport open".
    def eof_received(self) -> bool | None:  # type: ignore[override]
        """The client shut its side of the connection (shutdown(SHUT_WR)).

        A client may do that once it has sent its requests (curl with --http1.1 after
        sending, some load balancers): it still reads. The requests received whole are
        answered, then the connection closes. With nothing whole to answer (idle, part
        of a head, a body cut short), it closes at once, as aiohttp would, and so it does
        for a request waiting in admission's queue (a FIN is also how a client that closed
        looks: its place goes to the next) and with ``half_close = "abort"``; the close
        cancels the request.
        """
        transport = self.transport
        payload = self._payload
        unanswered = self._request_count > self._handled
        if (
            transport is None
            or self._guard.limits.half_close == "abort"
            or self._queued
            # asyncio's TLS cannot write once the peer's side is shut: it closes anyway.
            or transport.get_extra_info("sslcontext") is not None
            or not (unanswered or self._request_in_progress)
            or (self._phase == _BODY and payload is not None and not payload.is_eof())
        ):
            return None
        self._half_closed = True
        if self._phase == _DRAIN and payload is not None:
            # The rest of the body aiohttp would read and drop cannot come now.
            payload.feed_eof()
        if not unanswered:
            # The last handler returned: its answer is on its way out, then the close.
            self.close()
        else:
            self._probe()
        return True

    def _probe(self) -> None:
        """After a FIN, find out whether the client still reads; one that closed its socket
        entirely is taken as gone (its request cancelled, its upstream work with it).

        Only before the answer's first byte, to an HTTP/1.1 client, where TCP_INFO exists;
        elsewhere the request is answered as ``half_close = "answer"`` says.
        """
        request, transport = self._request, self.transport
        if (
            _TCP_INFO is None
            or request is None
            or transport is None
            or self._probe_timer is not None
            or request.version < HttpVersion11
            or request.writer.output_size
        ):
            return
        sock = transport.get_extra_info("socket")
        if sock is None:
            return
        transport.write(_PROBE)
        self._probe_timer = self._loop.call_later(_GONE_POLL, self._check_gone, sock)

    def _check_gone(self, sock: Any) -> None:
        self._probe_timer = None
        transport = self.transport
        if transport is None or _TCP_INFO is None:
            return
        try:
            state = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 1)[0]
        except OSError:
            state = _TCP_CLOSE
        if state == _TCP_CLOSE:
            # The probe was answered with a reset: nobody reads this answer.
            logger.debug("client %s closed after its request: cancelled", self._peer)
            transport.abort()
            return
        request = self._request
        if request is not None and not request.writer.output_size:
            # Once the answer is going out, its writes find a closed client themselves.
            self._probe_timer = self._loop.call_later(_GONE_POLL, self._check_gone, sock)

    def data_received(self, data: bytes) -> None:
        phase = self._phase
        if phase == _BODY:
            self._last_data = self._loop.time()
        elif phase == _DRAIN:
            super().data_received(data)
            if self._payload is None or self._payload.is_eof():
                self._payload = None
                self._phase = _IDLE
            return
        elif data and phase != _BUSY:
            if phase == _IDLE:
                self._head_bytes = 0
                self._line_len = -1
                self._head_started()
            if self._line_len < 0:
                end = data.find(b"\n")
                if end >= 0:
                    self._line_len = self._head_bytes + end
                self._head_bytes += len(data)
        super().data_received(data)
        if self._phase == _BODY:
            self._check_size()

    def pause_reading(self) -> None:
        # The proxy, not the client, stopped the body: not a stall, and not the client's time.
        if not self._stalled:
            self._paused_at = self._loop.time()
        self._stalled = True
        super().pause_reading()

    def resume_reading(self, resume_parser: bool = True) -> None:
        now = self._loop.time()
        if self._paused_at >= 0:
            self._paused_total += now - self._paused_at
            self._paused_at = -1.0
        was_stalled, self._stalled = self._stalled, False
        self._last_data = now
        if was_stalled and self._phase == _BODY and self._timer is not None:
            # The body's clocks run again: its next check is due from now.
            self._arm(self._next_body_check(now), self._body_timer)
        super().resume_reading(resume_parser)

    # -- request lifecycle (from the middleware) -------------------------------------

    def request_started(self, request: BaseRequest) -> None:
        self._cancel_timer()
        self._request_task = asyncio.current_task()
        self._request = request
        payload = request.content
        self._payload = payload
        # Part of the body, or all of it, may have arrived with the head.
        self._check_size()
        if payload.is_eof():
            self._phase = _BUSY
            if self._half_closed:
                self._probe()  # the FIN came with this request, before its handler ran
            return
        if self._half_closed:
            # The client shut its side before this body was whole: it never will be.
            self.force_close()
            return
        self._phase = _BODY
        now = self._body_started = self._last_data = self._loop.time()
        self._paused_total = 0.0
        self._paused_at = now if self._stalled else -1.0
        self._arm(self._next_body_check(now), self._body_timer)

    def request_queued(self, waiting: bool) -> None:
        """The request running waits in admission's queue (``waiting``), or no longer: a
        client that half-closed already is taken as gone (the close cancels the request)."""
        self._queued = waiting
        if waiting and self._half_closed:
            self.force_close()

    def head_refused(self, error: ProxyError) -> None:
        """The head checks refused the request (a body error among them is counted)."""
        self._guard.count_body_error(error)

    def _check_size(self) -> None:
        payload = self._payload
        limit = self._guard.limits.max_body_size
        if payload is not None and limit and payload.total_bytes > limit:
            if payload.exception() is None:
                error = BodyTooLarge(limit)
                self._guard.count_body_error(error)
                self._abort_body(error)

    def _abort_body(self, error: ProxyError) -> None:
        """Fail the body for whoever reads it, and close once the answer is sent.

        The handler reading the body gets ``error`` and answers it; aiohttp
        must then not "linger" reading the rest of an unwanted body (it would
        hit the same error), so the connection closes right after the answer.
        """
        assert self._payload is not None
        self._payload.set_exception(error)
        self._lingering_time = 0.0
        self.close()

    def request_finished(self) -> None:
        self._cancel_timer()
        self._request_task = None
        self._request = None
        self._handled += 1
        if self._half_closed and self._handled >= self._request_count:
            # No request can follow: close once this answer is out.
            self.close()
        payload = self._payload
        if payload is not None and not payload.is_eof() and payload.exception() is None:
            # aiohttp drains the unread body ("lingering"): those bytes are no request head.
            self._phase = _DRAIN
            return
        self._payload = None
        self._phase = _IDLE

    def request_cancelled(self, request: BaseRequest) -> None:
        """The handler was cancelled: when the proxy cut it at shutdown and nothing of
        the answer went out yet, the client still learns why (a 503) before the close."""
        transport = self.transport
        if (
            self._guard.shutting_down
            and transport is not None
            and not transport.is_closing()
            and request.writer.output_size == 0
        ):
            transport.write(
                raw_error(
                    503,
                    "The proxy is shutting down; retry the request.",
                    "shutting_down",
                    self._guard.server_header,
                )
            )
            self.force_close()

    def cancel_request(self) -> bool:
        """Cancel the request this connection is running, if any (shutdown)."""
        task = self._request_task
        if self._phase not in (_BODY, _BUSY) or task is None or task.done():
            return False
        task.cancel()
        return True

    # -- timers ----------------------------------------------------------------

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_started(self) -> None:
        """A request head starts arriving: it has ``header_timeout`` seconds from now."""
        self._phase = _HEAD
        loop = self._loop
        self._head_at = now = loop.time()
        if self._head_timer is None:
            self._head_timer = loop.call_at(
                now + self._guard.limits.header_timeout, self._head_timeout
            )

    def head_since(self, since: float) -> None:
        """A listener read this connection's first bytes before handing it over: its
        head deadline runs from ``since``, when the connection was accepted."""
        if self._phase == _HEAD and self.transport is not None:
            self._head_at = since
            if self._loop.time() >= since + self._guard.limits.header_timeout:
                self._head_timeout()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._phase != _HEAD or self.transport is None:
            return
        due = self._head_at + self._guard.limits.header_timeout
        if self._loop.time() < due:
            # Armed for an earlier head, answered in time: this one is due later.
            self._head_timer = self._loop.call_at(due, self._head_timeout)
            return
        guard = self._guard
        guard.header_timeouts += 1
        message = f"The request head did not arrive within {guard.limits.header_timeout:g} seconds."
        self._refuse(raw_error(408, message, "request_timeout", guard.server_header))

    def _active(self, now: float) -> float:
        """Seconds the body has been arriving, less those the proxy did not read."""
        paused = self._paused_total
        if self._paused_at >= 0:
            paused += now - self._paused_at
        return now - self._body_started - paused

    def _rate_grace(self) -> float:
        grace = self._guard.limits.body_rate_grace
        return min(grace, _DRAIN_RATE_GRACE) if self._guard.draining else grace

    def _received(self) -> int:
        return self._payload.total_bytes if self._payload is not None else 0

    def _next_body_check(self, now: float) -> float:
        """Seconds until the earliest moment one of the body's bounds could be passed."""
        return body_bound_due(
            self._guard.limits,
            stalled=now - self._last_data,
            active=self._active(now),
            received=self._received(),
            rate_grace=self._rate_grace(),
        )

    def _body_error(self, now: float) -> ProxyError | None:
        """The bound this body has passed, if any (and counted)."""
        guard = self._guard
        error = body_bound_passed(
            guard.limits,
            stalled=now - self._last_data,
            active=self._active(now),
            received=self._received(),
            rate_grace=self._rate_grace(),
        )
        if error is not None:
            guard.count_body_error(error)
        return error

    def _body_timer(self) -> None:
        self._timer = None
        self.check_body()

    def check_body(self) -> None:
        """Check the body in progress against its bounds now; 408 when one is passed."""
        payload = self._payload
        if self._phase != _BODY or payload is None or payload.is_eof():
            return
        if payload.exception() is not None:
            return
        if self._stalled:
            # The proxy stopped reading: nothing the client does counts until it resumes.
            self._arm(self._guard.limits.body_timeout, self._body_timer)
            return
        now = self._loop.time()
        error = self._body_error(now)
        if error is not None:
            self._cancel_timer()
            self._abort_body(error)
            return
        self._arm(self._next_body_check(now), self._body_timer)

    def _refuse(self, raw: bytes) -> None:
        """Answer ``raw`` outside any request (no handler runs) and close the connection."""
        transport = self.transport
        if transport is None:
            return
        transport.write(raw)
        self.force_close()

    # -- errors ----------------------------------------------------------------

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Parser and handler errors as OpenAI-shaped JSON, always closing the connection."""
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        code = "bad_request"
        if status == 500:
            logger.error("unhandled error serving a request", exc_info=exc)
            message, code, type_ = "Internal error in the proxy.", "internal_error", "server_error"
        elif status == 504:
            message, code, type_ = "The proxy timed out.", "timeout", "server_error"
        else:
            type_ = "invalid_request_error"
            if isinstance(exc, LineTooLong):
                # Which line ran long: the request line, unless it ended in time.
                line_len = self._line_len
                if 0 <= line_len <= self._guard.limits.max_request_line + 1:
                    status, code = 431, "headers_too_large"
                    message = "Request header fields too large."
                else:
                    status, code = 414, "request_line_too_long"
                    message = "Request line (method and target) too long."
            elif isinstance(exc, BadStatusLine) and "Invalid HTTP version" in str(exc):
                # llhttp knows 1.0, 1.1 and 2.0 (refused by the middleware); any
                # other version is a version the proxy does not support.
                version = version_error()
                status, code, message = version.status, str(version.code), version.message
            elif message and "Too many headers" in message:
                status, code, message = 431, "headers_too_large", "Too many header fields."
            else:
                # Parser messages quote the offending bytes: only say what was wrong.
                message = f"Malformed request: {_parser_reason(message)}"
            logger.debug("bad request from %s: %s", request.remote, exc)
        resp = own_error(
            ProxyError(status, type_, message, code=code),
            close=True,
            server=self._guard.server_header,
        )
        return resp
