"""Client geo (headers, MaxMind) and residency rules; config errors of the routing sections."""

from __future__ import annotations

import ipaddress
import struct
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from edgeproxy import Config, ConfigError
from edgeproxy._core.context import RequestContext
from edgeproxy._protocol.clientip import client_ip_resolver
from edgeproxy._protocol.headers import trace_context
from edgeproxy._routing.geo import GeoResolver, Residency, parse_lat_lon

from .conftest import ProxyFactory, RegionFactory, proxy_config

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SIN = {"lat": 1.29, "lon": 103.85}
FRANKFURT = {"lat": 50.11, "lon": 8.68}
VIRGINIA = {"lat": 38.9, "lon": -77.4}
# The tests' clients connect from here; geo headers are believed only from trusted peers.
LOCAL_PEERS = ["127.0.0.0/8", "::1"]


def config(regions: list[dict[str, Any]] | None = None, **sections: Any) -> Any:
    regions = regions or [{"name": "r1", "url": "http://127.0.0.1:9"}]
    return Config.from_mapping(proxy_config(regions, **sections), environ={})


def context(
    headers: dict[str, str] | None = None, peer: str = "127.0.0.1", cfg: Config | None = None
) -> RequestContext:
    """A request from ``peer`` as the pipeline hands it on: its client resolved at entry
    from ``cfg``'s [server] trusted_proxies."""
    cfg = cfg or config()
    fields = CIMultiDict(headers or {})
    client_ip, trusted = client_ip_resolver(cfg.server.trusted_proxies).resolve_peer(
        peer, fields.getall("x-forwarded-for", ())
    )
    return RequestContext(
        request_id="r",
        trace=trace_context(None),
        method="POST",
        target=CHAT,
        headers=fields,
        client_ip=client_ip,
        started=time.monotonic(),
        route=cfg.route_for("POST", CHAT),
        peer=peer,
        peer_trusted=trusted,
    )


# -- client geo --------------------------------------------------------------------------


def test_parse_lat_lon() -> None:
    assert parse_lat_lon("48.85, 2.35") == (48.85, 2.35)
    assert parse_lat_lon("-33.9,151.2") == (-33.9, 151.2)
    for bad in ("", "48.85", "91,0", "0,181", "a,b", "1,2,3", "nan,1"):
        assert parse_lat_lon(bad) is None, bad


def test_headers_give_country_and_location() -> None:
    cfg = config(server={"trusted_proxies": LOCAL_PEERS})
    geo = GeoResolver(cfg.geo)
    assert geo.locate(context({"CF-IPCountry": "de", "X-Client-Geo": "52.5,13.4"}, cfg=cfg)) == (
        "DE",
        (52.5, 13.4),
    )
    # Unknown, Tor, malformed and repeated values are hints to ignore, not errors.
    assert geo.locate(context({"CF-IPCountry": "XX"}, cfg=cfg)) == (None, None)
    malformed = {"CF-IPCountry": "T1", "X-Client-Geo": "north"}
    assert geo.locate(context(malformed, cfg=cfg)) == (None, None)
    repeated = context(cfg=cfg)
    repeated.headers.add("CF-IPCountry", "DE")
    repeated.headers.add("CF-IPCountry", "FR")
    assert geo.locate(repeated) == (None, None)
    # What a plugin already set wins.
    ctx = context({"CF-IPCountry": "DE"}, cfg=cfg)
    ctx.client_country = "JP"
    assert geo.locate(ctx) == ("JP", None)
    assert ctx.client_geo is None  # the resolver never writes into ctx


def test_geo_headers_are_believed_from_no_peer_by_default() -> None:
    geo = GeoResolver(config().geo)
    headers = {"CF-IPCountry": "de", "X-Client-Geo": "52.5,13.4"}
    assert geo.locate(context(headers)) == (None, None)
    assert geo.locate(context(headers, peer="10.1.2.3")) == (None, None)


def test_configured_headers_and_trusted_proxies() -> None:
    cfg = config(
        server={"trusted_proxies": ["10.0.0.0/8"]},
        geo={"country_headers": ["X-Country", "CF-IPCountry"], "geo_header": ""},
    )
    geo = GeoResolver(cfg.geo)
    headers = {"X-Country": "fr", "CF-IPCountry": "DE", "X-Client-Geo": "1,2"}
    assert geo.locate(context(headers, peer="10.1.2.3", cfg=cfg)) == ("FR", None)
    assert geo.locate(context(headers, peer="::ffff:10.1.2.3", cfg=cfg)) == ("FR", None)
    assert geo.locate(context(headers, peer="192.0.2.1", cfg=cfg)) == (None, None)


def _mmdb(path: Path, networks: dict[str, dict[str, Any]]) -> None:
    """A minimal MaxMind DB (IPv4, 24-bit records) written by hand, following the spec."""

    def ctrl(kind: int, size: int) -> bytes:
        assert size < 29
        return bytes([(kind << 5) | size]) if kind <= 7 else bytes([size, kind - 7])

    def encode(value: Any) -> bytes:
        if isinstance(value, str):
            raw = value.encode()
            return ctrl(2, len(raw)) + raw
        if isinstance(value, float):
            return ctrl(3, 8) + struct.pack(">d", value)
        if isinstance(value, int):
            raw = value.to_bytes(4, "big").lstrip(b"\0")
            return ctrl(6, len(raw)) + raw
        if isinstance(value, list):
            return ctrl(11, len(value)) + b"".join(encode(v) for v in value)
        assert isinstance(value, dict)
        return ctrl(7, len(value)) + b"".join(encode(k) + encode(v) for k, v in value.items())

    data = b""
    root: list[Any] = [None, None]
    for cidr, record in networks.items():
        net = ipaddress.ip_network(cidr)
        bits = format(int(net.network_address), "032b")[: net.prefixlen]
        node = root
        for bit in bits[:-1]:
            child = node[int(bit)]
            if child is None:
                child = node[int(bit)] = [None, None]
            node = child
        node[int(bits[-1])] = ("data", len(data))
        data += encode(record)
    nodes, queue = [], [root]
    while queue:
        node = queue.pop(0)
        nodes.append(node)
        queue.extend(c for c in node if isinstance(c, list))
    index = {id(n): i for i, n in enumerate(nodes)}
    count = len(nodes)

    def record(child: Any) -> int:
        if child is None:
            return count
        if isinstance(child, tuple):
            return count + 16 + child[1]
        return index[id(child)]

    tree = b"".join(
        record(n[0]).to_bytes(3, "big") + record(n[1]).to_bytes(3, "big") for n in nodes
    )
    metadata = {
        "node_count": count,
        "record_size": 24,
        "ip_version": 4,
        "database_type": "Test-City",
        "languages": ["en"],
        "binary_format_major_version": 2,
        "binary_format_minor_version": 0,
        "build_epoch": 1700000000,
        "description": {"en": "test"},
    }
    path.write_bytes(tree + b"\0" * 16 + data + b"\xab\xcd\xefMaxMind.com" + encode(metadata))


def test_maxmind_lookup_for_clients_without_headers(tmp_path: Path) -> None:
    pytest.importorskip("maxminddb", reason="the maxminddb package is not installed")
    db = tmp_path / "geo.mmdb"
    _mmdb(
        db,
        {
            "81.2.69.0/24": {
                "country": {"iso_code": "GB"},
                "location": {"latitude": 51.5, "longitude": -0.12},
            },
            "2.0.0.0/8": {"registered_country": {"iso_code": "FR"}},
        },
    )
    cfg = config(server={"trusted_proxies": ["10.0.0.0/8"]}, geo={"maxmind_db": str(db)})
    geo = GeoResolver(cfg.geo)
    assert geo.has_database
    try:
        assert geo.locate(context(peer="81.2.69.160", cfg=cfg)) == ("GB", (51.5, -0.12))
        assert geo.locate(context(peer="2.3.4.5", cfg=cfg)) == ("FR", None)
        assert geo.locate(context(peer="::ffff:2.3.4.5", cfg=cfg)) == ("FR", None)
        assert geo.locate(context(peer="192.0.2.1", cfg=cfg)) == (None, None)
        assert geo.locate(context(peer="::1", cfg=cfg)) == (None, None)  # not in an IPv4 database
        # Behind a trusted peer: its headers come first, and the database looks up
        # the client it forwarded, filling in what the headers leave unknown.
        forwarded = {"CF-IPCountry": "IE", "X-Forwarded-For": "81.2.69.1"}
        assert geo.locate(context(forwarded, peer="10.0.0.1", cfg=cfg)) == ("IE", (51.5, -0.12))
        assert geo.locate(context({"X-Forwarded-For": "2.3.4.5"}, peer="10.0.0.1", cfg=cfg)) == (
            "FR",
            None,
        )
        # From any other peer: headers ignored, the peer itself looked up.
        assert geo.locate(context(forwarded, peer="2.3.4.5", cfg=cfg)) == ("FR", None)
    finally:
        geo.close()


def test_missing_or_corrupt_maxmind_database_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad.mmdb"
    bad.write_bytes(b"not a database")
    for path in (tmp_path / "missing.mmdb", bad):
        cfg = config(server={"trusted_proxies": LOCAL_PEERS}, geo={"maxmind_db": str(path)})
        geo = GeoResolver(cfg.geo)
        assert not geo.has_database
        assert geo.locate(context({"CF-IPCountry": "DE"}, cfg=cfg)) == ("DE", None)
    assert any("maxmind" in r.getMessage() for r in caplog.records)


# -- residency ---------------------------------------------------------------------------


REGIONS = [
    {"name": "eu-west", "url": "http://127.0.0.1:9", "jurisdiction": "eu"},
    {"name": "eu-central", "url": "http://127.0.0.1:9", "jurisdiction": "eu", "tags": ["gpu"]},
    {"name": "us-east", "url": "http://127.0.0.1:9", "jurisdiction": "us", "tags": ["gpu"]},
]


def test_residency_rules_compile_to_region_sets() -> None:
    cfg = config(
        REGIONS,
        geo={
            "residency": {
                "eu": ["eu"],
                "CH": ["eu-central", "us-east"],
                "gb": ["gpu"],
                "*": ["us"],
            },
            "country_groups": {"dach": ["de", "at", "ch"]},
        },
    )
    rules = Residency(cfg.geo, cfg.regions)
    assert rules.allowed("DE") == {"eu-west", "eu-central"}
    assert rules.allowed("CH") == {"eu-central", "us-east"}  # its own rule beats groups
    assert rules.allowed("GB") == {"eu-central", "us-east"}  # a tag
    assert rules.allowed("JP") == {"us-east"}  # '*'
    assert rules.allowed(None) == {"us-east"}  # unknown location: '*' too
    assert Residency(config(REGIONS).geo, cfg.regions).allowed("DE") is None


async def test_residency_holds_and_an_empty_allowed_set_is_a_503(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    eu = await make_region("eu", ttft=0.02)
    us = await make_region("us", ttft=0.001)
    proxy = await make_proxy(
        [
            {"name": "eu", "url": eu.url, "jurisdiction": "eu", **FRANKFURT},
            # Nearer to the PoP and faster: without the rule it would win.
            {"name": "us", "url": us.url, "jurisdiction": "us", **SIN},
        ],
        geo={"residency": {"EU": ["eu"]}, "trusted_peers": LOCAL_PEERS},
    )
    async with aiohttp.ClientSession() as client:

        async def region_for(headers: dict[str, str]) -> str:
            async with client.post(proxy.url + CHAT, json=BODY, headers=headers) as resp:
                assert resp.status == 200
                return resp.headers["X-Edgeproxy-Region"]

        for _ in range(10):
            assert await region_for({"CF-IPCountry": "DE"}) == "eu"
            assert await region_for({"CF-IPCountry": "US"}) == "us"
        assert await region_for({}) == "us"  # unknown location, no '*' rule

        # The only EU region fails: EU clients get a clear 503, never a US region.
        await eu.kill()
        proxy.regions.by_name["eu"].mark_down("killed")
        async with client.post(proxy.url + CHAT, json=BODY, headers={"CF-IPCountry": "FR"}) as r:
            assert r.status == 503
            assert r.headers["X-Edgeproxy-Region"] == "none"
            error = (await r.json())["error"]
        assert error["code"] == "residency" and error["type"] == "no_region"
        assert "FR" in error["message"] and "eu" in error["message"]
        assert await region_for({"CF-IPCountry": "US"}) == "us"
    assert us.requests_by_path.get(CHAT) == 12


async def test_geo_prior_from_the_client(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    eu = await make_region("eu")
    us = await make_region("us")
    regions = [
        {"name": "eu", "url": eu.url, **FRANKFURT},
        {"name": "us", "url": us.url, **VIRGINIA},
    ]
    trusting = {"trusted_peers": LOCAL_PEERS}
    from_pop = await make_proxy(regions, pop={"lat": 48.8, "lon": 2.3}, geo=trusting)
    from_client = await make_proxy(
        regions, pop={"lat": 48.8, "lon": 2.3}, routing={"prior_from": "client"}, geo=trusting
    )
    headers = {"X-Client-Geo": "40.7,-74.0"}  # New York
    async with aiohttp.ClientSession() as client:
        async with client.post(from_pop.url + CHAT, json=BODY, headers=headers) as resp:
            assert resp.headers["X-Edgeproxy-Region"] == "eu"
        async with client.post(from_client.url + CHAT, json=BODY, headers=headers) as resp:
            assert resp.headers["X-Edgeproxy-Region"] == "us"


# -- config errors -------------------------------------------------------------------------


def errors_of(regions: list[dict[str, Any]], **sections: Any) -> list[str]:
    data = proxy_config(regions, **sections)
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(data, environ={})
    return info.value.errors


@pytest.mark.parametrize(
    ("region", "expected"),
    [
        ({"lat": 91}, "regions[0].lat: must be a latitude in degrees between -90 and 90, not 91"),
        ({"lat": float("nan")}, "regions[0].lat: must be a latitude"),
        ({"lon": -180.5}, "regions[0].lon: must be a longitude in degrees between -180 and 180"),
        ({"weight": 0}, "regions[0].weight: must be a positive finite number, not 0"),
        ({"weight": -2}, "regions[0].weight: must be a positive finite number"),
        ({"weight": float("inf")}, "regions[0].weight: must be a positive finite number"),
        ({"priority": -1}, "regions[0].priority: Input should be greater than or equal to 0"),
        ({"urls": ["ftp://x"]}, "regions[0].urls: entry 0 must be an http:// or https:// URL"),
    ],
)
def test_bad_region_fields_are_config_errors(region: dict[str, Any], expected: str) -> None:
    errors = errors_of([{"name": "r1", "url": "http://127.0.0.1:9", **region}])
    assert any(e.startswith(expected) for e in errors), errors


def test_empty_region_list_is_a_config_error() -> None:
    assert errors_of([]) == ["regions: at least one [[regions]] entry is required"]


def test_unknown_names_in_residency_rules_are_config_errors() -> None:
    regions = [{"name": "eu-west-1", "url": "http://127.0.0.1:9", "jurisdiction": "eu"}]
    errors = errors_of(regions, geo={"residency": {"DE": ["eu-wset-1"]}})
    assert errors == [
        "geo.residency.DE: unknown region or jurisdiction 'eu-wset-1' (known: eu, eu-west-1)"
    ]
    assert errors_of(regions, geo={"residency": {"Germany": ["eu"]}}) == [
        "geo: residency: 'Germany' is not a country code, a country group or '*'"
    ]
    assert errors_of(regions, geo={"residency": {"DE": []}}) == [
        "geo: residency.DE: lists no jurisdiction or region"
    ]
    assert errors_of(regions, geo={"trusted_peers": ["10.0.0.0/33"]}) == [
        "geo.trusted_peers: '10.0.0.0/33' is not an IP address or CIDR network"
    ]


def test_bad_routing_and_health_values_are_config_errors() -> None:
    regions = [{"name": "r1", "url": "http://127.0.0.1:9"}]
    assert errors_of(regions, routing={"retry_statuses": [404]}) == [
        "routing.retry_statuses: 404 is not a 5xx status"
    ]
    assert errors_of(regions, health={"base_ejection_time": 60, "max_ejection_time": 30}) == [
        "health: max_ejection_time must not be shorter than base_ejection_time"
    ]
    assert errors_of(regions, routing={"retry_budget": 1.5}) == [
        "routing.retry_budget: Input should be less than or equal to 1 (got 1.5)"
    ]
    data = proxy_config(regions)
    data["routes"] = [{"name": "chat", "path": CHAT, "deadline": 0, "hedge_delay": -1}]
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(data, environ={})
    assert info.value.errors == [
        "routes[0].deadline: Input should be greater than 0 (got 0)",
        "routes[0].hedge_delay: Input should be greater than 0 (got -1)",
    ]
