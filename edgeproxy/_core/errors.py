"""JSON error answers in the OpenAI error shape."""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from edgeproxy._core.outcome import LimitLevel
from edgeproxy._core.response import Response

__all__ = ["ProxyError", "error_body", "error_response"]


class ProxyError(Exception):
    """An error the pipeline answers itself, with a status and an OpenAI-shaped JSON body.

    Stages raise it; the pipeline turns it into the response. ``headers``
    carries extras such as ``Retry-After``; ``limits``, a rate limit's levels (a 429's),
    which the answer states in its API's rate-limit headers.
    """

    limits: dict[str, LimitLevel] | None = None

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


def error_response(
    status: int,
    type_or_body: str | bytes,
    message: str = "",
    *,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
    param: str | None = None,
) -> Response:
    """A complete JSON error response: OpenAI's shape from ``type`` and ``message``, or a
    body its API's dialect wrote (bytes)."""
    body = (
        type_or_body
        if isinstance(type_or_body, bytes)
        else error_body(type_or_body, message, code=code, param=param)
    )
    resp = Response(status=status, body=body, content_type="application/json")
    if headers:
        resp.headers.update(headers)
    return resp
