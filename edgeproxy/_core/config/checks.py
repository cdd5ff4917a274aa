"""Field checks shared by several sections: header names, networks, paths and URLs."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated
from urllib.parse import SplitResult, parse_qs, urlsplit

from pydantic import AfterValidator

__all__ = [
    "REDIS_SCHEMES",
    "HeaderName",
    "Networks",
    "UrlPath",
    "check_header_name",
    "check_host_port",
    "check_networks",
    "check_path",
    "check_redis_url",
    "one_of",
]

# RFC 9110 field-name token.
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")

REDIS_SCHEMES = ("redis", "rediss", "unix")
"""URL schemes a ``redis_url`` may use: TCP, TCP with TLS, and a Unix socket."""


def check_header_name(value: str) -> str:
    """``value`` if it is an HTTP header name or ``''`` (turned off); else ``ValueError``."""
    if value and not _HEADER_NAME_RE.fullmatch(value):
        raise ValueError("must be an HTTP header name, or '' to turn it off")
    return value


HeaderName = Annotated[str, AfterValidator(check_header_name)]
"""The name of an HTTP header, or ``''`` (turned off), checked."""


def one_of(*choices: str) -> AfterValidator:
    """A field check that a value is one of ``choices``; its ``ValueError`` names them."""
    expected = "must be " + ", ".join(map(repr, choices[:-1])) + " or " + repr(choices[-1])

    def check(value: str) -> str:
        if value not in choices:
            raise ValueError(expected)
        return value

    return AfterValidator(check)


def check_networks(value: list[str]) -> list[str]:
    """``value`` if every entry is an IP address or CIDR network; else ``ValueError``."""
    for entry in value:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ValueError(f"{entry!r} is not an IP address or CIDR network") from None
    return value


Networks = Annotated[list[str], AfterValidator(check_networks)]
"""A list of IP addresses and CIDR networks, each checked."""


def check_host_port(parts: SplitResult) -> None:
    """A URL's host and port: ``ValueError`` if it has no host or an invalid port."""
    if not parts.hostname:
        raise ValueError("has no host")
    try:
        parts.port  # noqa: B018 - raises on an invalid port
    except ValueError as exc:
        raise ValueError(f"has an invalid port ({exc})") from None


def check_path(value: str) -> str:
    """``value`` if it is an absolute URL path; else ``ValueError``."""
    if not value.startswith("/"):
        raise ValueError("must start with '/'")
    return value


UrlPath = Annotated[str, AfterValidator(check_path)]
"""An absolute URL path, checked."""


def check_redis_url(value: str, *, allow_empty: bool = False, cluster: bool = False) -> str:
    """``value`` if it is a Redis URL redis-py can connect to; else ``ValueError`` with the reason.

    ``redis://[user:password@]host[:port][/db]`` and ``rediss://`` (TLS) need
    a host, a valid port and a numeric database; ``unix:///path/to/redis.sock
    [?db=N]`` needs a socket path. Query parameters other than a socket's
    ``db`` are refused: TLS and AUTH have keys of their own, and a parameter
    the client would not read must not pass silently. With ``cluster`` (a
    section's ``redis_cluster``) the URL names one node of a Redis Cluster:
    TCP only, database 0 only. ``''`` passes only with ``allow_empty`` (the key
    then turns Redis off). Messages never repeat the URL, which may hold a
    password; pydantic prefixes them with the key.
    """
    expected = "must be a redis://, rediss:// or unix:// URL" + (", or ''" if allow_empty else "")
    if not value:
        if allow_empty:
            return value
        raise ValueError(expected)
    parts = urlsplit(value)
    if parts.scheme not in REDIS_SCHEMES:
        raise ValueError(expected)
    if parts.fragment:
        raise ValueError("must not have a fragment")
    query = parse_qs(parts.query, keep_blank_values=True)
    if parts.scheme == "unix":
        if not parts.path.strip("/"):
            raise ValueError("has no socket path: write unix:///path/to/redis.sock")
        if cluster:
            raise ValueError(
                "is a Unix socket: a Redis Cluster is reached by redis:// or rediss://"
            )
        db = ",".join(query.pop("db", []))
    else:
        check_host_port(parts)
        db = parts.path.strip("/")
    if query:
        names = ", ".join(sorted(query))
        raise ValueError(
            f"has query parameters ({names}) the client does not read: "
            "TLS and AUTH have redis_* keys of their own"
        )
    if db and not db.isdigit():
        raise ValueError(f"database must be a number, not {db!r}")
    if cluster and db and int(db) != 0:
        raise ValueError(f"names database {db}: a Redis Cluster has database 0 only")
    return value
