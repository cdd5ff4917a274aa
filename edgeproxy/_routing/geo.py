"""Where a client is, and which regions may serve it.

The client's country and location come, in order, from what a plugin already
set on the context (``ctx.client_country`` / ``ctx.client_geo``), from the
headers a CDN adds (``CF-IPCountry``, ``X-Client-Geo: lat,lon``), and last
from a MaxMind GeoLite2/GeoIP2 database when ``[geo] maxmind_db`` names one
and the ``maxminddb`` package is installed.

The headers are believed only from the peers ``[server] trusted_proxies``
lists (``ctx.peer_trusted``); empty (the default) trusts nobody. The database
looks up the client's address, ``ctx.client_ip``: the peer, or behind trusted
proxies the address they forwarded (``X-Forwarded-For``), as the pipeline
resolved it when the request came in.

Residency rules map a client's country to the jurisdictions (or tags, or
region names) allowed to serve it. A request under a rule never leaves the
allowed set: when no allowed region is healthy it gets a 503, not a quiet
cross-border route.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from edgeproxy._core.config import BUILTIN_GROUPS
from edgeproxy._core.errors import ProxyError

if TYPE_CHECKING:
    from edgeproxy._core.config import GeoConfig, RegionConfig
    from edgeproxy._core.context import RequestContext

__all__ = ["GeoResolver", "Residency", "parse_lat_lon"]

logger = logging.getLogger("edgeproxy.geo")


_COUNTRY_RE = re.compile(r"[A-Za-z]{2}")
# Cloudflare's "unknown" and "Tor" pseudo-countries say nothing about residency.
_NOT_COUNTRIES = frozenset({"XX", "T1"})
_NUMBER = r"[+-]?[0-9]{1,3}(?:\.[0-9]{1,12})?"
_LAT_LON_RE = re.compile(rf"\s*({_NUMBER})\s*,\s*({_NUMBER})\s*")


def parse_lat_lon(value: str) -> tuple[float, float] | None:
    """``"48.85,2.35"`` as ``(lat, lon)``; None when malformed or out of range."""
    match = _LAT_LON_RE.fullmatch(value)
    if match is None:
        return None
    lat, lon = float(match.group(1)), float(match.group(2))
    if not (math.isfinite(lat) and math.isfinite(lon)):
        return None
    if not (-90.0 <= lat <= 90.0 and -180.0 <= lon <= 180.0):
        return None
    return lat, lon


def _country(value: str) -> str | None:
    value = value.strip()
    if _COUNTRY_RE.fullmatch(value) and value.upper() not in _NOT_COUNTRIES:
        return value.upper()
    return None


class GeoResolver:
    """Fills ``ctx.client_country`` and ``ctx.client_geo`` for the router.

    Values a plugin already set win. Header values are hints: a malformed
    or repeated header is ignored, never a reason to fail the request.
    """

    def __init__(self, config: GeoConfig) -> None:
        self.country_headers = tuple(h for h in config.country_headers if h)
        self.geo_header = config.geo_header
        self._reader: Any = None
        if config.maxmind_db:
            self._reader = _open_maxmind(config.maxmind_db)

    @property
    def has_database(self) -> bool:
        return self._reader is not None

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def locate(self, ctx: RequestContext) -> tuple[str | None, tuple[float, float] | None]:
        """The client's ISO country code and ``(lat, lon)``, each None when unknown."""
        country, geo = ctx.client_country, ctx.client_geo
        if country is not None and geo is not None:
            return country, geo
        if ctx.peer_trusted:
            headers = ctx.headers
            if country is None:
                for name in self.country_headers:
                    found = headers.getall(name, ())
                    if len(found) == 1 and (country := _country(found[0])) is not None:
                        break
            if geo is None and self.geo_header:
                found = headers.getall(self.geo_header, ())
                if len(found) == 1:
                    geo = parse_lat_lon(found[0])
        if self._reader is not None and (country is None or geo is None):
            client = ctx.client_ip
            if client:
                found_country, found_geo = self._lookup(client)
                country = country or found_country
                geo = geo or found_geo
        return country, geo

    def _lookup(self, client_ip: str) -> tuple[str | None, tuple[float, float] | None]:
        try:
            record = self._reader.get(client_ip)
        except (ValueError, OSError, RuntimeError) as exc:
            # A corrupt database or an odd address costs the geo hint, not the request.
            logger.debug("maxmind lookup of %s failed: %s", client_ip, exc)
            return None, None
        if not isinstance(record, dict):
            return None, None
        country: str | None = None
        found = record.get("country") or record.get("registered_country") or {}
        code = found.get("iso_code") if isinstance(found, dict) else None
        if isinstance(code, str):
            country = _country(code)
        geo: tuple[float, float] | None = None
        location = record.get("location")
        if isinstance(location, dict):
            lat, lon = location.get("latitude"), location.get("longitude")
            if isinstance(lat, int | float) and isinstance(lon, int | float):
                geo = (float(lat), float(lon))
        return country, geo


def _open_maxmind(path: str) -> Any:
    try:
        # Optional, and imported by name so that it stays optional for the type checker too.
        maxminddb = importlib.import_module("maxminddb")
    except ImportError:
        logger.warning(
            "geo.maxmind_db is set but the maxminddb package is not installed; "
            "client geo comes from headers only"
        )
        return None
    try:
        # Memory-mapped: opening is cheap and lookups never read the disk on the loop.
        return maxminddb.open_database(path, maxminddb.MODE_MMAP)
    except (OSError, ValueError, RuntimeError) as exc:  # InvalidDatabaseError is a RuntimeError
        logger.warning(
            "cannot open geo.maxmind_db %s: %s; client geo comes from headers only", path, exc
        )
        return None


class Residency:
    """Residency rules compiled to the set of region names each country may use."""

    def __init__(self, config: GeoConfig, regions: Iterable[RegionConfig]) -> None:
        regions = list(regions)
        groups = {**BUILTIN_GROUPS, **{k: frozenset(v) for k, v in config.country_groups.items()}}
        self._default: frozenset[str] | None = None
        self._by_country: dict[str, frozenset[str]] = {}
        by_group: dict[str, frozenset[str]] = {}
        for key, allowed in config.residency.items():
            names = frozenset(
                r.name
                for r in regions
                if r.name in allowed
                or (r.jurisdiction is not None and r.jurisdiction in allowed)
                or any(tag in allowed for tag in r.tags)
            )
            if key == "*":
                self._default = names
            elif key in groups:
                by_group[key] = names
            else:
                self._by_country[key] = names
        # A country's own rule beats its groups'. A country in several ruled
        # groups gets what all of them allow: residency rules only ever narrow.
        explicit = set(self._by_country)
        for group, names in by_group.items():
            for country in groups[group]:
                if country in explicit:
                    continue
                current = self._by_country.get(country)
                self._by_country[country] = names if current is None else current & names
        self.enabled = bool(config.residency)

    def allowed(self, country: str | None) -> frozenset[str] | None:
        """Region names allowed for a client from ``country``; None when no rule applies."""
        if not self.enabled:
            return None
        if country is not None:
            names = self._by_country.get(country)
            if names is not None:
                return names
        return self._default

    def no_region(self, country: str | None, allowed: Iterable[str]) -> ProxyError:
        """The 503 for a rule that leaves no region able to serve."""
        names = ", ".join(sorted(allowed)) or "none"
        who = f"clients in {country}" if country else "clients of unknown location"
        return ProxyError(
            503,
            "no_region",
            f"no healthy region may serve {who} under the residency rules (allowed: {names})",
            code="residency",
            headers={"Retry-After": "5"},
        )
