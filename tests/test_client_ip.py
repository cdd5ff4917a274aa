"""One trusted-proxy list, ``[server] trusted_proxies``; the client IP resolved once, at entry.

The rate limits, geo, the plugins and the access log all read ``ctx.client_ip`` as the
pipeline resolved it; ``[admission] trusted_proxies`` and ``[geo] trusted_peers`` are
deprecated aliases that feed the one list.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from edgeproxy import ClientIPResolver, Config, ConfigError, EdgeProxy, RequestContext
from edgeproxy._core.config import iter_config_keys
from edgeproxy._protocol.headers import trace_context
from edgeproxy._server.generation import restart_errors
from edgeproxy.plugins import geo_tenant

from .conftest import ProxyFactory, RegionFactory, eventually, proxy_config
from .plugins.conftest import Recorder, plugins_section
from .plugins.test_access_log import lines as log_lines

LOCAL = ["127.0.0.0/8", "::1"]  # where the tests' clients connect from
MINIMAL: dict[str, Any] = {"regions": [{"name": "r1", "url": "http://127.0.0.1:9"}]}
DEPRECATED = "edgeproxy.config"
CLIENT = "203.0.113.9"
OTHER = "198.51.100.7"
# The same list, each way it may be given.
WAYS = {
    "server": {"server": {"trusted_proxies": LOCAL}},
    "admission alias": {"admission": {"trusted_proxies": LOCAL}},
    "geo alias": {"geo": {"trusted_peers": LOCAL}},
}


def load(**sections: Any) -> Config:
    return Config.from_mapping({**MINIMAL, **sections}, environ={})


async def start(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    log: Path,
    recorder: Recorder,
    trust: dict[str, dict[str, Any]],
) -> EdgeProxy:
    """A proxy with a per-IP limit of one request, residency by country (geo's headers),
    geo_tenant reading the tenant, and the access log: each reads the client IP."""
    eu = await make_region("eu")
    us = await make_region("us")
    sections: dict[str, dict[str, Any]] = {
        "admission": {"ip_requests_per_second": 0.001, "ip_burst": 1},
        "geo": {"residency": {"DE": ["eu"], "*": ["us"]}},
        "plugins": plugins_section(
            geo_tenant={"country_header": ""}, access_log={"path": str(log)}
        ),
    }
    for name, values in trust.items():
        sections[name] = {**sections.get(name, {}), **values}
    regions = [
        {"name": "eu", "url": eu.url, "jurisdiction": "eu"},
        {"name": "us", "url": us.url, "jurisdiction": "us"},
    ]
    config = Config.from_mapping(proxy_config(regions, **sections), environ={})
    return await make_proxy(config=config, plugins=[recorder])


async def send(
    client: aiohttp.ClientSession, proxy: EdgeProxy, forwarded: str
) -> tuple[int, dict[str, Any]]:
    headers = {"X-Forwarded-For": forwarded, "CF-IPCountry": "DE", "X-Tenant-Id": "acme"}
    async with client.post(proxy.url + "/echo/ip", data=b"x", headers=headers) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("way", list(WAYS))
async def test_one_list_resolves_the_client_for_limits_geo_plugins_and_the_log(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    way: str,
) -> None:
    log, recorder = tmp_path / "access.log", Recorder()
    with caplog.at_level(logging.WARNING, logger=DEPRECATED):
        proxy = await start(make_region, make_proxy, log, recorder, WAYS[way])
    deprecations = [r.getMessage() for r in caplog.records if r.name == DEPRECATED]
    if way == "server":
        assert not deprecations
    else:
        [message] = deprecations
        assert "deprecated" in message and "server.trusted_proxies" in message
    async with aiohttp.ClientSession() as client:
        status, echoed = await send(client, proxy, CLIENT)
        assert status == 200
        # Geo believed the trusted proxy's country header: residency sent DE to the EU.
        assert echoed["region"] == "eu"
        upstream = {k.lower(): v for k, v in echoed["headers"]}
        # The chain goes on with the hop this proxy saw, not the client it resolved.
        assert upstream["x-forwarded-for"] == f"{CLIENT}, 127.0.0.1"
        ctx = await recorder.next()
        assert (ctx.client_ip, ctx.peer, ctx.peer_trusted) == (CLIENT, "127.0.0.1", True)
        assert ctx.tenant == "acme"  # geo_tenant believed it too
        # The limit is the forwarded client's: it is spent, another client's is not.
        assert (await send(client, proxy, CLIENT))[0] == 429
        assert (await send(client, proxy, OTHER))[0] == 200
    await eventually(lambda: len(log_lines(log)) == 3)
    assert [line["client_ip"] for line in log_lines(log)] == [CLIENT, CLIENT, OTHER]


async def test_an_untrusted_peers_forwarded_for_is_ignored_everywhere(
    make_region: RegionFactory, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    log, recorder = tmp_path / "access.log", Recorder()
    trust = {"server": {"trusted_proxies": ["10.0.0.0/8"]}}
    proxy = await start(make_region, make_proxy, log, recorder, trust)
    async with aiohttp.ClientSession() as client:
        status, echoed = await send(client, proxy, CLIENT)
        assert status == 200
        assert echoed["region"] == "us"  # the country header was not believed
        ctx = await recorder.next()
        assert (ctx.client_ip, ctx.peer, ctx.peer_trusted) == ("127.0.0.1", "127.0.0.1", False)
        assert ctx.tenant is None
        # Whatever it claims to forward, the peer is the client: one bucket for both.
        assert (await send(client, proxy, OTHER))[0] == 429
    await eventually(lambda: len(log_lines(log)) == 2)
    assert [line["client_ip"] for line in log_lines(log)] == ["127.0.0.1", "127.0.0.1"]


# -- the config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sections", "warned"),
    [
        ({"admission": {"trusted_proxies": ["10.0.0.0/8"]}}, ["admission.trusted_proxies"]),
        ({"geo": {"trusted_peers": ["10.0.0.0/8"]}}, ["geo.trusted_peers"]),
        (
            {
                "admission": {"trusted_proxies": ["10.0.0.0/8"]},
                "geo": {"trusted_peers": ["10.0.0.0/8"]},
            },
            ["admission.trusted_proxies", "geo.trusted_peers"],
        ),
        (
            {
                "server": {"trusted_proxies": ["10.0.0.0/8", "::1"]},
                "geo": {"trusted_peers": ["::1/128", "10.1.2.3/8"]},
            },
            ["geo.trusted_peers"],
        ),
    ],
)
def test_the_aliases_feed_the_one_list_and_warn_naming_it(
    caplog: pytest.LogCaptureFixture, sections: dict[str, Any], warned: list[str]
) -> None:
    with caplog.at_level(logging.WARNING, logger=DEPRECATED):
        config = load(**sections)
    messages = [r.getMessage() for r in caplog.records if r.name == DEPRECATED]
    assert [m.split(" ", 1)[0] for m in messages] == warned
    assert all("deprecated" in m and "server.trusted_proxies" in m for m in messages)
    expected = sections.get("server", sections.get("admission", {})).get("trusted_proxies")
    assert config.server.trusted_proxies == (expected or ["10.0.0.0/8"])


def test_an_alias_from_the_environment_feeds_it_too(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=DEPRECATED):
        config = Config.from_mapping(
            MINIMAL, environ={"EDGEPROXY_ADMISSION__TRUSTED_PROXIES": '["10.0.0.0/8"]'}
        )
    assert config.server.trusted_proxies == ["10.0.0.0/8"]
    assert any("server.trusted_proxies" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("sections", "error"),
    [
        (
            {
                "admission": {"trusted_proxies": ["10.0.0.0/8"]},
                "geo": {"trusted_peers": ["192.0.2.0/24"]},
            },
            "geo.trusted_peers: differs from admission.trusted_proxies",
        ),
        (
            {"server": {"trusted_proxies": []}, "admission": {"trusted_proxies": ["10.0.0.1"]}},
            "admission.trusted_proxies: differs from server.trusted_proxies",
        ),
        (
            {"server": {"trusted_proxies": ["10.0.0.0/33"]}},
            "server.trusted_proxies: '10.0.0.0/33' is not an IP address or CIDR network",
        ),
    ],
)
def test_lists_that_disagree_are_an_error_naming_both_keys(
    sections: dict[str, Any], error: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_mapping({**MINIMAL, **sections}, environ={}, source="edge.toml")
    [found] = info.value.errors
    assert found.startswith(error), found
    assert info.value.source == "edge.toml"


def test_a_dumped_config_keeps_the_list_and_warns_no_more(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Workers get the supervisor's config as JSON: the list, not the alias, again."""
    config = load(geo={"trusted_peers": ["10.0.0.0/8"]})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=DEPRECATED):
        again = Config.from_mapping(config.model_dump(mode="json"), environ={})
    assert again.server.trusted_proxies == ["10.0.0.0/8"]
    assert not [r for r in caplog.records if r.name == DEPRECATED]


def test_the_list_reloads_in_place() -> None:
    old = load(server={"trusted_proxies": ["10.0.0.0/8"]})
    assert restart_errors(old, load(server={"trusted_proxies": ["192.0.2.0/24"]})) == []
    assert restart_errors(old, load(geo={"trusted_peers": ["192.0.2.0/24"]})) == []
    assert restart_errors(old, load(server={"port": 1, "trusted_proxies": ["10.0.0.0/8"]})) == [
        "server.port: listener changes need a restart"
    ]


def test_the_reference_names_the_one_list_and_the_aliases() -> None:
    docs = {key: description for key, _type, _default, description in iter_config_keys()}
    assert "forwarded_allow_ips" in docs["server.trusted_proxies"]
    for alias in ("admission.trusted_proxies", "geo.trusted_peers"):
        assert docs[alias].startswith("Deprecated: set server.trusted_proxies"), alias


# -- geo_tenant's own list -------------------------------------------------------------------


def context(peer: str, peer_trusted: bool) -> RequestContext:
    return RequestContext(
        request_id="r",
        trace=trace_context(None),
        method="POST",
        target="/v1/chat/completions",
        headers=CIMultiDict(),
        client_ip=peer,
        started=time.monotonic(),
        route=load().route_for("POST", "/"),
        peer=peer,
        peer_trusted=peer_trusted,
    )


def test_geo_tenant_believes_the_one_list(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        plugin = geo_tenant.edgeproxy_plugin({})
    assert not caplog.records
    assert plugin.trusts(context("10.0.0.1", peer_trusted=True))
    assert not plugin.trusts(context("10.0.0.1", peer_trusted=False))


def test_geo_tenants_trusted_peers_still_decide_and_warn_naming_the_one_list(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        plugin = geo_tenant.edgeproxy_plugin({"trusted_peers": ["10.0.0.0/8"]})
    [record] = caplog.records
    assert "trusted_peers is deprecated" in record.getMessage()
    assert "server.trusted_proxies" in record.getMessage()
    # As before: its own list alone says whose headers it believes.
    assert plugin.trusts(context("10.0.0.1", peer_trusted=False))
    assert not plugin.trusts(context("192.0.2.1", peer_trusted=True))


@pytest.mark.parametrize(
    ("peer", "resolved"),
    [
        ("192.0.2.7", "192.0.2.7"),
        ("192.168.1.1%lo", "192.168.1.1"),
        ("::ffff:192.0.2.7", "192.0.2.7"),
        ("2001:DB8::1", "2001:db8::1"),
        ("not-an-address", "not-an-address"),
    ],
)
def test_the_peer_is_normalized_when_nobody_is_trusted(peer: str, resolved: str) -> None:
    # The no-trusted-proxy fast path must give what the parse gives.
    assert ClientIPResolver().resolve_peer(peer) == (resolved, False)
