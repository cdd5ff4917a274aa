"""Client geo, tenant and priority from request headers set by a CDN or a gateway.

Settings (``[plugins.settings.geo_tenant]``); set a header name to ``""`` to
ignore that header:

``country_header``
    Header with the client's ISO 3166-1 alpha-2 country, default
    ``CF-IPCountry``; sets ``ctx.client_country`` (upper case). Cloudflare's
    ``XX`` (unknown) and ``T1`` (Tor) are ignored.
``geo_header``
    Header with ``lat,lon`` in decimal degrees, default ``X-Client-Geo``;
    sets ``ctx.client_geo``.
``tenant_header``
    Header naming the tenant (1-128 characters of ``A-Z a-z 0-9 . _ : @ -``),
    default ``X-Tenant-Id``; sets ``ctx.tenant`` unless a tenant is already set.
    An API key's tenant (see ``apikey_auth``) wins over it.
``priority_header``
    Header with an integer priority from -9999 to 9999 (higher first), default
    ``X-Priority``; sets ``ctx.priority``.
``trusted_peers``
    Deprecated: list the CDN or gateway that sets these headers in
    ``[server] trusted_proxies``, the one list of trusted proxies, instead.
    Until then this list (``["10.0.0.0/8", "::1"]``) alone decides, as it did,
    whose headers the plugin believes, and loading it logs a warning.

The headers are believed only from a peer in ``[server] trusted_proxies``
(``ctx.peer_trusted``, decided once as the request came in). Requests from
any other peer have the headers removed and ignored. The default list is
empty, which trusts nobody (as everywhere in edgeproxy): the headers are only
removed until the peers that set them are listed, so that clients never
choose their own tenant and priority.

Malformed values are ignored rather than rejected: a CDN header is a hint,
never a reason to fail a request. A header sent more than once is ambiguous
and ignored too. All the configured headers are removed before the request
goes upstream, so clients cannot use them to talk to the regions.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from edgeproxy import ClientIPResolver, RequestContext, hookimpl, parse_lat_lon

__all__ = ["GeoTenant", "edgeproxy_plugin", "parse_lat_lon"]

logger = logging.getLogger("edgeproxy.plugins.geo_tenant")

_COUNTRY_RE = re.compile(r"[A-Za-z]{2}")
_TENANT_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
_PRIORITY_RE = re.compile(r"[+-]?[0-9]{1,4}")
_NOT_COUNTRIES = frozenset({"XX", "T1"})


class GeoTenant:
    def __init__(
        self,
        *,
        country_header: str = "CF-IPCountry",
        geo_header: str = "X-Client-Geo",
        tenant_header: str = "X-Tenant-Id",
        priority_header: str = "X-Priority",
        trusted_peers: Iterable[str] | None = None,
    ) -> None:
        self.country_header = country_header
        self.geo_header = geo_header
        self.tenant_header = tenant_header
        self.priority_header = priority_header
        self.headers = tuple(
            h for h in (country_header, geo_header, tenant_header, priority_header) if h
        )
        # The deprecated list of its own, None when [server] trusted_proxies decides.
        self.peers = None if trusted_peers is None else ClientIPResolver(trusted_peers)

    def trusts(self, ctx: RequestContext) -> bool:
        """Whether the headers of the request's peer are believed."""
        if self.peers is None:
            return ctx.peer_trusted
        return self.peers.trusts(ctx.peer)

    @hookimpl
    def edgeproxy_request_received(self, request: web.Request, ctx: RequestContext) -> None:
        headers = ctx.headers
        values: dict[str, str] = {}
        for name in self.headers:
            found = headers.getall(name, ())
            if len(found) == 1:
                values[name] = found[0].strip()
            if found:
                headers.popall(name)
        if not values or not self.trusts(ctx):
            return None
        country = values.get(self.country_header, "")
        if _COUNTRY_RE.fullmatch(country) and country.upper() not in _NOT_COUNTRIES:
            ctx.client_country = country.upper()
        geo = parse_lat_lon(values.get(self.geo_header, ""))
        if geo is not None:
            ctx.client_geo = geo
        tenant = values.get(self.tenant_header, "")
        if ctx.tenant is None and _TENANT_RE.fullmatch(tenant):
            ctx.tenant = tenant
        priority = values.get(self.priority_header, "")
        if _PRIORITY_RE.fullmatch(priority):
            ctx.priority = int(priority)
        return None


def edgeproxy_plugin(settings: dict[str, Any]) -> GeoTenant:
    """Plugin factory: edgeproxy calls it with ``[plugins.settings.geo_tenant]``."""
    names = {"country_header", "geo_header", "tenant_header", "priority_header"}
    unknown = set(settings) - names - {"trusted_peers"}
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    for name in names & set(settings):
        if not isinstance(settings[name], str):
            raise ValueError(f'{name} must be a header name (or "" to ignore that header)')
    headers = {k: v for k, v in settings.items() if k in names}
    if "trusted_peers" not in settings:
        return GeoTenant(**headers)
    peers = settings["trusted_peers"]
    if isinstance(peers, str) or not isinstance(peers, list | tuple):
        raise ValueError("trusted_peers must be a list of addresses or CIDR networks")
    try:
        plugin = GeoTenant(**headers, trusted_peers=list(peers))
    except ValueError as exc:  # only the peers can be wrong by now
        raise ValueError(f"trusted_peers: {exc}") from None
    logger.warning(
        "geo_tenant: trusted_peers is deprecated: list those peers in server.trusted_proxies, "
        "the one list of trusted proxies; until then trusted_peers alone decides whose "
        "headers geo_tenant believes"
    )
    return plugin
