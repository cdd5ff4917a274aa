"""The limits and counters one listener's connections share (:class:`ConnectionGuard`),
and the raw HTTP/1.1 answer a connection gets before any request of it is read."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Protocol

from edgeproxy._core.config import LimitsConfig
from edgeproxy._core.errors import ProxyError, error_body
from edgeproxy._protocol.bodies import BodyDeadline, BodyTimeout, BodyTooLarge, SlowBody

__all__ = ["ConnectionGuard", "Drainable", "raw_error"]


class Drainable(Protocol):
    """A connection the guard tells when the proxy drains, and cuts at its end (an
    HTTP/1.1 handler, an HTTP/2 connection)."""

    def check_body(self) -> None: ...

    def cancel_request(self) -> bool: ...


class ConnectionGuard:
    """The limits and counters shared by every connection of one listener, and the Server
    header of its answers (``""``: none)."""

    def __init__(self, limits: LimitsConfig, server_header: str = "edgeproxy") -> None:
        self.limits = limits
        self.server_header = server_header
        self.open = 0
        # Open connections by client address, and the connections themselves.
        self.per_ip: dict[str, int] = {}
        self.connections: set[Drainable] = set()
        self.refused = 0
        self.refused_per_ip = 0
        self.header_timeouts = 0
        self.body_timeouts = 0
        self.body_deadlines = 0
        self.slow_bodies = 0
        self.bodies_too_large = 0
        self.shutdown_cuts = 0
        # The HTTP/2 listener's abusers, by what they did (each lost its connection).
        self.h2_rapid_resets = 0
        self.h2_control_floods = 0
        self.h2_protocol_errors = 0
        # HTTP/2 streams reset alone: malformed requests (PROTOCOL_ERROR), and streams past
        # h2_max_concurrent_streams (REFUSED_STREAM).
        self.h2_stream_errors = 0
        self.h2_refused_streams = 0
        # HTTP/2 streams reset because their client took nothing of the answer for
        # server.h2_send_stall_timeout; bytes of answers the HTTP/2 listener holds for
        # clients that have not taken them (now, and the most at once).
        self.h2_send_stalls = 0
        self.h2_buffered = 0
        self.h2_buffered_peak = 0
        # The listener drains (bodies get a short rate grace) / cut what was left.
        self.draining = False
        self.shutting_down = False

    @property
    def max_per_ip(self) -> int:
        """Most connections from one address; 0 for no cap."""
        cap = self.limits.max_connections_per_ip
        if cap is None:
            return max(self.limits.max_connections // 2, 64)
        return cap

    def handler_kwargs(self) -> dict[str, Any]:
        """aiohttp ``RequestHandler`` settings for these limits."""
        limits = self.limits
        return {
            "max_line_size": limits.max_request_line,
            "max_field_size": limits.max_header_size,
            "max_headers": limits.max_headers,
            "keepalive_timeout": limits.keepalive_timeout,
            # A proxy forwards bodies as they are: decoding gzip here would
            # both corrupt them (Content-Encoding still says gzip) and let a
            # small upload expand past max_body_size.
            "auto_decompress": False,
            # After an answer that closes the connection with the body unread (a 413,
            # a 417), aiohttp reads and drops what still comes, so that the client sees
            # the answer rather than a reset: 1 s, not its 10 s default, which let a client
            # that never sends the body hold the connection that long.
            "lingering_time": 1.0,
        }

    def admit(self, ip: str) -> str | None:
        """Count a new connection from ``ip`` among the open ones; or, over a cap, count
        the refusal and return why (the message of its 503)."""
        if self.open >= self.limits.max_connections:
            self.refused += 1
            return "Too many connections to this proxy; retry shortly."
        cap = self.max_per_ip
        if cap and self.per_ip.get(ip, 0) >= cap:
            self.refused_per_ip += 1
            return "Too many connections from this address; retry shortly."
        self.open += 1
        self.per_ip[ip] = self.per_ip.get(ip, 0) + 1
        return None

    def refusal(self, message: str) -> bytes:
        """The answer to a connection :meth:`admit` refused (with ``message``): a 503 with
        ``Retry-After``, written before reading a byte of the connection (a refused one
        must cost next to nothing), so in HTTP/1.1 whatever the client speaks."""
        raw = raw_error(503, message, "too_many_connections", self.server_header)
        return raw.replace(b"\r\n\r\n", b"\r\nRetry-After: 1\r\n\r\n", 1)

    def release(self, ip: str) -> None:
        """A connection :meth:`admit` counted has closed."""
        self.open -= 1
        left = self.per_ip.get(ip, 1) - 1
        if left > 0:
            self.per_ip[ip] = left
        else:
            self.per_ip.pop(ip, None)

    def count_body_error(self, error: ProxyError) -> None:
        """Count a request body that broke one of its bounds (any front end's)."""
        if isinstance(error, BodyTimeout):
            self.body_timeouts += 1
        elif isinstance(error, BodyDeadline):
            self.body_deadlines += 1
        elif isinstance(error, SlowBody):
            self.slow_bodies += 1
        elif isinstance(error, BodyTooLarge):
            self.bodies_too_large += 1

    def start_draining(self) -> None:
        """The proxy drains: a body still arriving must now keep up its minimum rate
        after a short grace, so that slow clients do not hold the drain open."""
        self.draining = True
        for conn in list(self.connections):
            conn.check_body()

    def cut_requests(self) -> int:
        """The grace period is over: cancel every request still running (a request not
        answered yet gets a 503, an SSE stream its error event). Returns how many."""
        self.shutting_down = True
        cut = sum(1 for conn in list(self.connections) if conn.cancel_request())
        self.shutdown_cuts += cut
        return cut

    def snapshot(self) -> dict[str, Any]:
        return {
            "connections_open": self.open,
            "max_connections": self.limits.max_connections,
            "max_connections_per_ip": self.max_per_ip,
            "connections_refused": self.refused,
            "connections_refused_per_ip": self.refused_per_ip,
            "header_timeouts": self.header_timeouts,
            "body_timeouts": self.body_timeouts,
            "body_deadlines": self.body_deadlines,
            "slow_bodies": self.slow_bodies,
            "bodies_too_large": self.bodies_too_large,
            "h2_rapid_resets": self.h2_rapid_resets,
            "h2_control_floods": self.h2_control_floods,
            "h2_protocol_errors": self.h2_protocol_errors,
            "h2_stream_errors": self.h2_stream_errors,
            "h2_refused_streams": self.h2_refused_streams,
            "h2_send_stalls": self.h2_send_stalls,
            "h2_buffered_bytes": self.h2_buffered,
        }


def raw_error(status: int, message: str, code: str, server: str) -> bytes:
    body = error_body("invalid_request_error", message, code=code)
    phrase = HTTPStatus(status).phrase
    named = f"Server: {server}\r\n" if server else ""
    return (
        f"HTTP/1.1 {status} {phrase}\r\n{named}Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        "X-Edgeproxy-Region: none\r\n\r\n"
    ).encode("ascii") + body
