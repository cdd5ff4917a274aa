"""What the ASGI front ends share: the ASGI types, and a scope's target, headers and TLS
read as the aiohttp listener reads a request's (:mod:`.asgi` for HTTP, :mod:`.asgiws` for
WebSockets)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import quote

from multidict import CIMultiDict, CIMultiDictProxy

from edgeproxy._core.exchange import TlsInfo

__all__ = [
    "CONNECTION_HEADERS",
    "CUT_WAIT",
    "ClientGone",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "scope_headers",
    "scope_target",
    "scope_tls",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Headers a response may not carry on HTTP/2 (RFC 9113 8.2.2): the connection's own.
CONNECTION_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"}
)
# The TLS extension gives the protocol version as its wire number.
_TLS_VERSIONS = {0x0301: "TLSv1", 0x0302: "TLSv1.1", 0x0303: "TLSv1.2", 0x0304: "TLSv1.3"}
# How long an answer cut at shutdown may wait for the client to take its last event.
CUT_WAIT = 0.5


class ClientGone(ConnectionResetError):
    """The client disconnected (``http.disconnect``) while its request was served."""


def scope_target(scope: Scope) -> str:
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if raw else quote(scope.get("path", "/"), safe="/%:@!$&'()*+,;=")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        # Mounted (Starlette's Mount, FastAPI's mount): the prefix is the host's.
        path = path[len(root) :] or "/"
    query = scope.get("query_string", b"")
    return f"{path}?{query.decode('latin-1')}" if query else path


def scope_headers(raw: list[tuple[bytes, bytes]]) -> CIMultiDictProxy[str]:
    # As aiohttp decodes them: bytes that are not UTF-8 survive as surrogates, so the
    # head check can refuse them by name.
    return CIMultiDictProxy(
        CIMultiDict(
            (name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
            for name, value in raw
        )
    )


def scope_tls(scope: Scope, version: str) -> TlsInfo | None:
    extension = scope.get("extensions", {}).get("tls")
    if not isinstance(extension, dict):
        return TlsInfo(alpn="h2" if version == "2" else None)
    number = extension.get("tls_version")
    return TlsInfo(
        _TLS_VERSIONS.get(number) if isinstance(number, int) else None,
        "h2" if version == "2" else extension.get("alpn"),
        extension.get("server_name"),
    )
