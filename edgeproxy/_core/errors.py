"""JSON error answers in the OpenAI error shape."""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from edgeproxy._core.response import Response

__all__ = ["ProxyError", "anthropic_error_body", "error_body", "error_response"]


class ProxyError(Exception):
    """An error the pipeline answers itself, with a status and an OpenAI-shaped JSON body.

    Stages raise it; the pipeline turns it into the response. ``headers``
    carries extras such as ``Retry-After``.
    """

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        *,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.code = code
        self.headers = dict(headers or {})
        self.param = param


def error_body(
    type: str, message: str, *, code: str | None = None, param: str | None = None
) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it; ``param`` names
    the request field at fault, if one is."""
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


# Anthropic's error types by status (its clients, Claude Code among them, retry on
# overloaded_error and rate_limit_error).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}`` as Anthropic's API sends it."""
    kind = _ANTHROPIC_TYPES.get(status) or (
        "invalid_request_error" if status < 500 else "api_error"
    )
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def error_response(
    status: int,
    type: str,
    message: str,
    *,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
    param: str | None = None,
    anthropic: bool = False,
) -> Response:
    """A complete JSON error response, in OpenAI's shape (or Anthropic's, for a request of
    its API)."""
    resp = Response(
        status=status,
        body=(
            anthropic_error_body(status, message)
            if anthropic
            else error_body(type, message, code=code, param=param)
        ),
        content_type="application/json",
    )
    if headers:
        resp.headers.update(headers)
    return resp
