"""Client location and data residency: ``[geo]``."""

from __future__ import annotations

from typing import Final

from pydantic import Field, field_validator, model_validator

from edgeproxy._core.config.base import Section
from edgeproxy._core.config.checks import Networks

__all__ = ["BUILTIN_GROUPS", "GeoConfig"]


_EU: Final = "AT BE BG HR CY CZ DK EE FI FR DE GR IE IT LV LT LU MT NL PL PT RO SK SI ES SE".split()
BUILTIN_GROUPS: Final[dict[str, frozenset[str]]] = {
    "EU": frozenset(_EU),
    "EEA": frozenset([*_EU, "IS", "LI", "NO"]),
}
"""Country groups residency rules may name without defining them."""


class GeoConfig(Section):
    """Where clients are, and which regions may serve them (data residency)."""

    country_headers: list[str] = Field(
        default_factory=lambda: ["CF-IPCountry"],
        description="Headers holding the client's ISO country code, first match wins.",
    )
    geo_header: str = Field(
        "X-Client-Geo",
        description="Header holding the client's 'lat,lon' in degrees; '' to ignore it.",
    )
    trusted_peers: Networks = Field(
        default_factory=list,
        # Out of dumps, as admission.trusted_proxies: server.trusted_proxies holds it.
        exclude=True,
        description="Deprecated: set server.trusted_proxies, which this feeds (they must "
        "agree when both are set). Addresses or CIDR networks of the peers (proxies, CDNs) "
        "whose geo headers are believed; empty believes no peer. List '0.0.0.0/0' and '::/0' "
        "to believe every peer.",
    )
    maxmind_db: str | None = Field(
        None,
        description="MaxMind GeoLite2/GeoIP2 .mmdb file for clients without geo headers "
        "(needs the maxminddb package).",
    )
    residency: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Country code (or group such as 'EU', or '*' for every other client) -> "
        "jurisdictions, tags or region names allowed to serve it.",
    )
    country_groups: dict[str, list[str]] = Field(
        default_factory=dict,
        description="More country groups for residency keys, name -> country codes ('EU' and "
        "'EEA' are built in).",
    )

    @field_validator("country_groups")
    @classmethod
    def _check_groups(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, countries in value.items():
            for code in countries:
                if len(code) != 2 or not code.isalpha():
                    raise ValueError(f"{name}: {code!r} is not a two-letter country code")
            out[name.upper()] = [c.upper() for c in countries]
        return out

    @model_validator(mode="after")
    def _check_residency_keys(self) -> GeoConfig:
        groups = set(BUILTIN_GROUPS) | set(self.country_groups)
        rules: dict[str, list[str]] = {}
        for key, allowed in self.residency.items():
            name = key.upper()
            if name != "*" and name not in groups and not (len(name) == 2 and name.isalpha()):
                raise ValueError(
                    f"residency: {key!r} is not a country code, a country group or '*'"
                )
            if not allowed:
                raise ValueError(f"residency.{key}: lists no jurisdiction or region")
            rules[name] = allowed
        # Assigning through __dict__ keeps validate_assignment from re-running this validator.
        self.__dict__["residency"] = rules
        return self
