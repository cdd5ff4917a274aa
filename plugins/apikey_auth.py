"""API-key authentication at the edge.

Clients present a key as ``Authorization: Bearer <key>``, or as ``api-key:
<key>`` (Azure OpenAI clients) or ``x-api-key: <key>``. Keys come from a file
and/or an environment variable, read once when the plugin loads; each may
name the tenant it belongs to. A missing, unknown or malformed key gets a 401
in the OpenAI error shape before any upstream work, and the region is never
contacted.

Settings (``[plugins.settings.apikey_auth]``):

``keys_file``
    Path to a UTF-8 file with one key per line, optionally followed by
    whitespace and a tenant name. Blank lines and ``#`` comments (a whole
    line, or the rest of a line after whitespace) are ignored.
``keys_env``
    Name of an environment variable holding comma-separated ``key`` or
    ``key:tenant`` entries. Default ``EDGEPROXY_API_KEYS``.
``exempt_paths``
    List of paths served without a key, e.g. ``["/healthz", "/v1/models"]``.
    A path is exempt when it equals an entry or continues it after a ``/``
    (``"/public/"`` covers everything below it). Paths with ``.``/``..``
    segments or encoded slashes, dots or backslashes are never exempt, so
    ``/healthz/../v1/chat/completions`` still needs a key. Matched against the
    path the region sees (without a mount prefix). Default: none.

Loading fails, naming the plugin, when no key is configured at all, when the
file cannot be read, or when a line is malformed (the error gives the line
number, never the key).

Keys are printable ASCII without spaces, up to 512 characters. Tenants are
1-128 characters of ``A-Z a-z 0-9 . _ : @ -``. A key without a tenant is given
the tenant ``key:<first 16 hex digits of its SHA-256>``, stable across restarts
and PoPs. The authenticated tenant is set on ``ctx.tenant`` (a tenant header
read by another plugin, such as ``geo_tenant``, never overrides it).

A request presenting different keys in several headers (or the same header
twice) is refused as ambiguous. Keys are kept only as SHA-256 digests and
compared in constant time against every known key, so the comparison time
says nothing about which key was close.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from edgeproxy import Exchange, RequestContext, Response, error_response, hookimpl

__all__ = ["ApiKeyAuth", "edgeproxy_plugin"]

CREDENTIAL_HEADERS = ("authorization", "api-key", "x-api-key")
MAX_KEY_LENGTH = 512

_KEY_RE = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_LENGTH}}}")
_TENANT_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
# Encoded dot, slash and backslash: a path using them is never exempt.
_ENCODED_SEPARATORS = re.compile(r"%(?:2e|2f|5c)", re.IGNORECASE)
_SETTINGS = frozenset({"keys_file", "keys_env", "exempt_paths"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def derived_tenant(key: str) -> str:
    """The tenant of a key configured without one: stable, and reveals nothing usable."""
    return "key:" + _digest(key).hex()[:16]


class ApiKeyAuth:
    """The plugin object; build it with :func:`edgeproxy_plugin` or directly.

    ``keys`` maps each key to its tenant, or to None for a derived tenant.
    """

    def __init__(self, keys: Mapping[str, str | None], *, exempt_paths: Iterable[str] = ()) -> None:
        if not keys:
            raise ValueError("no API keys configured")
        for key, tenant in keys.items():
            if not _KEY_RE.fullmatch(key):
                raise ValueError("an API key has characters other than printable ASCII")
            if tenant is not None and not _TENANT_RE.fullmatch(tenant):
                raise ValueError(f"invalid tenant name {tenant!r}")
        self._keys: list[tuple[bytes, str]] = [
            (_digest(key), tenant or derived_tenant(key)) for key, tenant in keys.items()
        ]
        self.exempt_paths = _check_exempt_paths(exempt_paths)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> ApiKeyAuth:
        unknown = set(settings) - _SETTINGS
        if unknown:
            raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
        keys: dict[str, str | None] = {}
        keys_file = settings.get("keys_file")
        if keys_file is not None:
            if not isinstance(keys_file, str) or not keys_file:
                raise ValueError("keys_file must be a path")
            path = Path(keys_file).expanduser()
            for number, key, tenant in _parse_keys_file(path.read_text(encoding="utf-8")):
                _add_key(keys, key, tenant, f"{path}, line {number}")
        env_name = settings.get("keys_env", "EDGEPROXY_API_KEYS")
        if not isinstance(env_name, str) or not env_name:
            raise ValueError("keys_env must be the name of an environment variable")
        for index, entry in enumerate(os.environ.get(env_name, "").split(","), 1):
            entry = entry.strip()
            if not entry:
                continue
            key, sep, tenant = entry.partition(":")
            key, tenant = key.strip(), tenant.strip()
            if not key or (sep and not tenant):
                raise ValueError(f"${env_name}, entry {index}: expected KEY or KEY:TENANT")
            _add_key(keys, key, tenant or None, f"${env_name}, entry {index}")
        if not keys:
            if keys_file is None:
                raise ValueError(f"no API keys: set keys_file, or the variable {env_name}")
            raise ValueError(f"no API keys: {keys_file} has none and ${env_name} is unset or empty")
        exempt = settings.get("exempt_paths", ())
        if isinstance(exempt, str) or not isinstance(exempt, list | tuple):
            raise ValueError("exempt_paths must be a list of paths")
        return cls(keys, exempt_paths=exempt)

    def lookup(self, presented: str) -> tuple[bool, str | None]:
        """Whether ``presented`` is a known key, and its tenant; constant time over all keys."""
        digest = _digest(presented)
        found = False
        tenant: str | None = None
        for known, known_tenant in self._keys:
            # No early exit: every key is compared whatever matched.
            if hmac.compare_digest(digest, known):
                found = True
                tenant = known_tenant
        return found, tenant

    def is_exempt(self, path: str) -> bool:
        """Whether ``path`` (as sent upstream, still percent-encoded) may skip authentication."""
        if not self.exempt_paths or _ENCODED_SEPARATORS.search(path) or "\\" in path:
            return False
        if any(segment in (".", "..") for segment in unquote(path).split("/")):
            return False
        for prefix in self.exempt_paths:
            if path == prefix or path.startswith(prefix if prefix.endswith("/") else prefix + "/"):
                return True
        return False

    @hookimpl(tryfirst=True)
    def edgeproxy_request_received(self, request: Exchange, ctx: RequestContext) -> Response | None:
        if self.is_exempt(ctx.path):
            return None
        keys: set[str] = set()
        for name in CREDENTIAL_HEADERS:
            for value in request.headers.getall(name, ()):
                key = _bearer(value) if name == "authorization" else value.strip()
                if key is None or not _KEY_RE.fullmatch(key):
                    return _unauthorized(
                        f"Malformed {name} header: expected "
                        + ("'Bearer YOUR_KEY'." if name == "authorization" else "an API key."),
                        "invalid_api_key",
                    )
                keys.add(key)
        if not keys:
            return _unauthorized(
                "You didn't provide an API key. Provide it in an Authorization header "
                "using Bearer auth (Authorization: Bearer YOUR_KEY).",
                "missing_api_key",
            )
        if len(keys) > 1:
            return _unauthorized(
                "Several different API keys were provided; send exactly one.", "invalid_api_key"
            )
        ok, tenant = self.lookup(keys.pop())
        if not ok:
            return _unauthorized("Incorrect API key provided.", "invalid_api_key")
        ctx.tenant = tenant
        return None


def _parse_keys_file(text: str) -> Iterable[tuple[int, str, str | None]]:
    for number, raw in enumerate(text.splitlines(), 1):
        fields = raw.split()
        # A comment starts a line, or a field after whitespace.
        for i, field in enumerate(fields):
            if field.startswith("#"):
                del fields[i:]
                break
        if not fields:
            continue
        if len(fields) > 2:
            raise ValueError(f"line {number}: expected KEY [TENANT]")
        yield number, fields[0], fields[1] if len(fields) == 2 else None


def _add_key(keys: dict[str, str | None], key: str, tenant: str | None, where: str) -> None:
    if not _KEY_RE.fullmatch(key):
        raise ValueError(
            f"{where}: a key must be 1-{MAX_KEY_LENGTH} printable ASCII characters, no spaces"
        )
    if tenant is not None and not _TENANT_RE.fullmatch(tenant):
        raise ValueError(f"{where}: invalid tenant name {tenant!r}")
    if key in keys and keys[key] != tenant:
        raise ValueError(f"{where}: this key is already configured with another tenant")
    keys[key] = tenant


def _check_exempt_paths(paths: Iterable[str]) -> tuple[str, ...]:
    checked = []
    for path in paths:
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"exempt_paths entries must be paths starting with '/', not {path!r}")
        checked.append(path)
    return tuple(checked)


def _bearer(value: str) -> str | None:
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _unauthorized(message: str, code: str) -> Response:
    return error_response(
        401,
        "invalid_request_error",
        message,
        code=code,
        headers={"WWW-Authenticate": 'Bearer realm="edgeproxy"'},
    )


def edgeproxy_plugin(settings: dict[str, Any]) -> ApiKeyAuth:
    """Plugin factory: edgeproxy calls it with ``[plugins.settings.apikey_auth]``."""
    return ApiKeyAuth.from_settings(settings)
