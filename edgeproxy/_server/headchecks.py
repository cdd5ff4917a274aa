"""The request head, checked before any stage or plugin sees it, and the answers the
listener gives itself.

:func:`limits_middleware` refuses framing that could smuggle a second request past
another hop (``Transfer-Encoding`` the proxy would not read the same way, duplicate
``Content-Length``), HTTP versions other than 1.0/1.1 (505), request-target forms,
methods that make no sense through a reverse proxy, header bytes that are not UTF-8,
expectations other than ``100-continue`` (417), and a declared body over
``max_body_size`` (413 before reading it). A framing error closes the connection,
since the proxy can no longer tell where the next request starts. What aiohttp would
answer itself (its router's 404 or 405, its 417) comes out in the same JSON shape:
every answer the proxy gives itself carries ``X-Edgeproxy-Region`` and an HTTP/1.1
status line, whatever version the client sent.
"""

from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.web_request import BaseRequest
from multidict import CIMultiDictProxy

from edgeproxy._core.config import LimitsConfig
from edgeproxy._core.errors import ProxyError, error_response
from edgeproxy._core.response import Response
from edgeproxy._protocol.bodies import BodyTooLarge
from edgeproxy._protocol.headers import request_id

__all__ = [
    "ECHO_LIMIT",
    "check_head",
    "check_request_head",
    "http_exception_error",
    "own_answer",
    "own_error",
    "version_error",
]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Methods a reverse proxy must not forward: CONNECT would tunnel, TRACE reflects
# the request (cookies and credentials included) back to a script (XST).
_REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
# Codings a server may receive in Transfer-Encoding; the proxy only decodes chunked.
_KNOWN_CODINGS = frozenset({"chunked", "gzip", "x-gzip", "deflate", "compress", "identity"})
# Error messages echo at most this much of what the client sent.
ECHO_LIMIT = 120
# Codes of the router's own answers, which the middleware turns into JSON.
_HTTP_ERROR_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    417: "expectation_failed",
}


# -- the request head ------------------------------------------------------------


def _framing_error(status: int, message: str, code: str) -> ProxyError:
    # The proxy cannot know where the next request on this connection starts.
    return ProxyError(
        status, "invalid_request_error", message, code=code, headers={"Connection": "close"}
    )


def version_error() -> ProxyError:
    return _framing_error(
        505, "Only HTTP/1.0 and HTTP/1.1 are supported.", "http_version_not_supported"
    )


def check_request_head(request: BaseRequest, limits: LimitsConfig) -> ProxyError | None:
    """What is wrong with the request line and headers, if anything; None when they are fine."""
    version = request.version
    if version.major != 1 or version.minor not in (0, 1):
        return version_error()
    return check_head(request.method, request.raw_path, request.headers, version.minor, limits)


def check_head(
    method: str,
    target: str,
    headers: CIMultiDictProxy[str],
    minor: int,
    limits: LimitsConfig,
) -> ProxyError | None:
    """:func:`check_request_head` for any front end, the HTTP version already checked:
    ``minor`` is its minor number (HTTP/2 framing has no ``Transfer-Encoding``, which its
    server refuses, nor ``Expect`` semantics of its own: pass 1)."""
    te = headers.getall("Transfer-Encoding", ())
    if te:
        if minor == 0:
            # RFC 9112 6.1: a 1.0 message with Transfer-Encoding has faulty framing.
            return _framing_error(
                400, "Transfer-Encoding is not allowed in HTTP/1.0.", "invalid_framing"
            )
        if "Content-Length" in headers:
            return _framing_error(
                400, "Content-Length and Transfer-Encoding together.", "invalid_framing"
            )
        codings = [c.strip().lower() for value in te for c in value.split(",")]
        if codings != ["chunked"]:
            known = all(c in _KNOWN_CODINGS for c in codings)
            if known and codings[-1] == "chunked" and codings.count("chunked") == 1:
                return _framing_error(
                    501, "Only Transfer-Encoding: chunked is supported.", "not_implemented"
                )
            return _framing_error(400, "Invalid Transfer-Encoding.", "invalid_framing")
    lengths = headers.getall("Content-Length", ())
    if len(lengths) > 1:
        return _framing_error(400, "Duplicate Content-Length.", "invalid_framing")
    if lengths:
        if not lengths[0].isdigit() or not lengths[0].isascii():
            return _framing_error(400, "Invalid Content-Length.", "invalid_framing")
        if limits.max_body_size and int(lengths[0]) > limits.max_body_size:
            return BodyTooLarge(limits.max_body_size)
    if method in _REFUSED_METHODS:
        return ProxyError(
            405,
            "invalid_request_error",
            f"Method {method} is not allowed through this proxy.",
            code="method_not_allowed",
        )
    if not target.startswith("/"):
        if target == "*" and method == "OPTIONS":
            # The server-wide form: no region has a resource to answer it for.
            return ProxyError(
                501,
                "invalid_request_error",
                "OPTIONS * is not supported by this proxy; send OPTIONS to a path.",
                code="not_implemented",
            )
        return ProxyError(
            400,
            "invalid_request_error",
            "The request target must be a path (origin-form); this is not a forward proxy.",
            code="invalid_target",
        )
    if not target.isascii():
        return ProxyError(
            400,
            "invalid_request_error",
            "The request target has raw non-ASCII bytes; percent-encode them.",
            code="invalid_target",
        )
    for name, value in headers.items():
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                # aiohttp keeps undecodable bytes as surrogates; they cannot be forwarded.
                return ProxyError(
                    400,
                    "invalid_request_error",
                    f"Header {name[:ECHO_LIMIT]!r} is not valid UTF-8.",
                    code="invalid_header",
                )
    if minor == 1 and "Expect" in headers:
        # RFC 9110 10.1.1: a 1.0 request's expectations are ignored.
        expect = ",".join(headers.getall("Expect")).strip().lower()
        if expect and expect != "100-continue":
            # The client may be waiting before it sends its body, or may send it
            # anyway: the connection closes rather than guess.
            return _framing_error(
                417, "Only the 100-continue expectation is supported.", "expectation_failed"
            )
    return None


class _OwnAnswer(web.Response):
    """An answer the listener gives itself: an HTTP/1.1 status line, whatever the request's
    version (a client sending ``HTTP/0.9`` or ``HTTP/2.0`` must not see it echoed back)."""

    unnamed = False

    async def _write_headers(self) -> None:
        writer = self._payload_writer
        assert writer is not None
        if self.unnamed:
            # aiohttp gave it its own (see own_error).
            self.headers.popall(hdrs.SERVER, None)
        if not self.keep_alive:
            # Said outright: the status line claims 1.1, where connections persist by default.
            self.headers["Connection"] = "close"
        await writer.write_headers(f"HTTP/1.1 {self.status} {self.reason}", self.headers)
        if self._send_headers_immediately:
            writer.send_headers()


def own_answer(error: ProxyError) -> Response:
    """``error`` as the proxy's own JSON answer, for any front end: its headers (a
    ``Connection: close`` among them), ``X-Edgeproxy-Region: none`` and a request id."""
    answer = error_response(
        error.status, error.type, error.message, code=error.code, headers=error.headers
    )
    answer.headers["X-Edgeproxy-Region"] = "none"
    answer.headers["X-Request-Id"] = request_id(None)
    return answer


def own_error(error: ProxyError, *, close: bool = False, server: str = "edgeproxy") -> web.Response:
    """:func:`own_answer` on the aiohttp listener; ``close`` ends the connection after it
    (so does a framing error, and a 413). ``server``: its Server header (``""``: none)."""
    answer = own_answer(error)
    headers = {k: v for k, v in answer.headers.items() if k.lower() != "connection"}
    if server:
        # Given one, aiohttp does not add its own (which names its version and Python's).
        headers[hdrs.SERVER] = server
    resp = _OwnAnswer(status=answer.status, body=answer.body, headers=headers)
    resp.unnamed = not server
    if close or error.headers.get("Connection") == "close" or error.status == 413:
        resp.force_close()
    return resp


def http_exception_error(exc: web.HTTPException) -> ProxyError:
    """What aiohttp itself would answer (its router, its body limit), as the proxy's error."""
    headers = {
        name: value
        for name, value in exc.headers.items()
        if name.lower() not in ("content-type", "content-length")
    }
    return ProxyError(
        exc.status,
        "invalid_request_error",
        f"{exc.reason}.",
        code=_HTTP_ERROR_CODES.get(exc.status, "http_error"),
        headers=headers,
    )
