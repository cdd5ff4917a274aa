"""geo_tenant through the real server: headers parsed into ctx, and never forwarded."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from edgeproxy import PluginLoadError
from edgeproxy.plugins.apikey_auth import derived_tenant
from edgeproxy.plugins.geo_tenant import parse_lat_lon

from ..conftest import RegionFactory
from .conftest import PluginProxyFactory, Recorder, build_proxy, plugins_section

GEO_HEADERS = ("cf-ipcountry", "x-client-geo", "x-tenant-id", "x-priority")
# The tests' clients connect from here: the CDN or gateway the plugin believes.
TRUSTING = {"trusted_peers": ["127.0.0.0/8", "::1"]}


async def echo(
    client: aiohttp.ClientSession, url: str, headers: Any, **kwargs: Any
) -> dict[str, str]:
    """The headers the region received, lower-cased."""
    async with client.post(url + "/echo/geo", data=b"x", headers=headers, **kwargs) as resp:
        assert resp.status == 200
        data = await resp.json()
    return {k.lower(): v for k, v in data["headers"]}


async def test_headers_set_ctx_and_are_not_forwarded(
    make_region: RegionFactory, make_plugin_proxy: PluginProxyFactory
) -> None:
    region = await make_region("r1")
    recorder = Recorder()
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        extra=[recorder],
        plugins=plugins_section(geo_tenant=TRUSTING),
    )
    headers = {
        "CF-IPCountry": "sg",
        "X-Client-Geo": " 1.3521, 103.8198 ",
        "X-Tenant-Id": "acme.corp-1",
        "X-Priority": "-5",
        "X-Other": "kept",
    }
    async with aiohttp.ClientSession() as client:
        seen = await echo(client, proxy.url, headers)
    ctx = await recorder.next()
    assert ctx.client_country == "SG"
    assert ctx.client_geo == (1.3521, 103.8198)
    assert ctx.tenant == "acme.corp-1"
    assert ctx.priority == -5
    assert not set(GEO_HEADERS) & set(seen)
    assert seen["x-other"] == "kept"


async def test_no_peer_is_trusted_by_default(
    make_region: RegionFactory, make_plugin_proxy: PluginProxyFactory
) -> None:
    region = await make_region("r1")
    recorder = Recorder()
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        extra=[recorder],
        plugins=plugins_section(geo_tenant={}),
    )
    headers = {"CF-IPCountry": "sg", "X-Client-Geo": "1,2", "X-Tenant-Id": "t", "X-Priority": "5"}
    async with aiohttp.ClientSession() as client:
        seen = await echo(client, proxy.url, headers)
    ctx = await recorder.next()
    # Ignored, and still removed: clients never choose their own tenant or priority.
    assert (ctx.client_country, ctx.client_geo, ctx.tenant, ctx.priority) == (None, None, None, 0)
    assert not set(GEO_HEADERS) & set(seen)


@pytest.mark.parametrize(
    "headers",
    [
        {"CF-IPCountry": "XX", "X-Client-Geo": "91,0", "X-Tenant-Id": "", "X-Priority": "--5"},
        {"CF-IPCountry": "SGP", "X-Client-Geo": "nan,1", "X-Tenant-Id": "a b", "X-Priority": "1.5"},
        {"CF-IPCountry": "T1", "X-Client-Geo": "1;2", "X-Tenant-Id": "x/y", "X-Priority": "99999"},
        {
            "CF-IPCountry": "s1",
            "X-Client-Geo": "1e5,3",
            "X-Tenant-Id": "t" * 129,
            "X-Priority": "5x",
        },
        {"CF-IPCountry": "", "X-Client-Geo": "1,2,3", "X-Tenant-Id": "é", "X-Priority": "inf"},
        {"CF-IPCountry": "S", "X-Client-Geo": "infinity,0", "X-Priority": "+"},
    ],
)
async def test_malformed_values_are_ignored_and_still_removed(
    make_region: RegionFactory, make_plugin_proxy: PluginProxyFactory, headers: dict[str, str]
) -> None:
    region = await make_region("r1")
    recorder = Recorder()
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        extra=[recorder],
        plugins=plugins_section(geo_tenant=TRUSTING),
    )
    async with aiohttp.ClientSession() as client:
        seen = await echo(client, proxy.url, headers)
    ctx = await recorder.next()
    assert (ctx.client_country, ctx.client_geo, ctx.tenant, ctx.priority) == (None, None, None, 0)
    assert not set(GEO_HEADERS) & set(seen)


async def test_repeated_header_is_ambiguous(
    make_region: RegionFactory, make_plugin_proxy: PluginProxyFactory
) -> None:
    region = await make_region("r1")
    recorder = Recorder()
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        extra=[recorder],
        plugins=plugins_section(geo_tenant=TRUSTING),
    )
    headers = [("X-Tenant-Id", "mine"), ("X-Tenant-Id", "theirs"), ("X-Priority", "3")]
    async with aiohttp.ClientSession() as client:
        seen = await echo(client, proxy.url, headers)
    ctx = await recorder.next()
    assert ctx.tenant is None
    assert ctx.priority == 3
    assert "x-tenant-id" not in seen


async def test_api_key_tenant_wins_over_the_header(
    make_region: RegionFactory,
    make_plugin_proxy: PluginProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGEPROXY_API_KEYS", "sk-with-tenant:paying,sk-without")
    region = await make_region("r1")
    recorder = Recorder()
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        extra=[recorder],
        plugins=plugins_section(geo_tenant=TRUSTING, apikey_auth={}),
    )
    async with aiohttp.ClientSession() as client:
        for key, tenant in (("sk-with-tenant", "paying"), ("sk-without", None)):
            headers = {"Authorization": f"Bearer {key}", "X-Tenant-Id": "forged", "X-Priority": "7"}
            seen = await echo(client, proxy.url, headers)
            ctx = await recorder.next()
            assert ctx.tenant == (tenant or derived_tenant(key))
            assert ctx.priority == 7
            assert "x-tenant-id" not in seen


async def test_custom_header_names_and_trusted_peers(
    make_region: RegionFactory, make_plugin_proxy: PluginProxyFactory
) -> None:
    region = await make_region("r1")
    recorder = Recorder()
    names = {
        "country_header": "X-Country",
        "geo_header": "",  # ignored: the header passes through untouched
        "tenant_header": "X-Org",
        "priority_header": "X-Prio",
    }
    trusted = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        extra=[recorder],
        plugins=plugins_section(geo_tenant={**names, "trusted_peers": ["127.0.0.0/8", "::1"]}),
    )
    untrusted = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        extra=[recorder],
        plugins=plugins_section(geo_tenant={**names, "trusted_peers": ["10.0.0.0/8"]}),
    )
    headers = {"X-Country": "de", "X-Client-Geo": "1,2", "X-Org": "org1", "X-Prio": "9"}
    async with aiohttp.ClientSession() as client:
        seen = await echo(client, trusted.url, headers)
        ctx = await recorder.next()
        assert (ctx.client_country, ctx.client_geo, ctx.tenant, ctx.priority) == (
            "DE",
            None,
            "org1",
            9,
        )
        assert seen["x-client-geo"] == "1,2"
        assert not {"x-country", "x-org", "x-prio"} & set(seen)

        seen = await echo(client, untrusted.url, headers)
        ctx = await recorder.next()
        assert (ctx.client_country, ctx.tenant, ctx.priority) == (None, None, 0)
        assert not {"x-country", "x-org", "x-prio"} & set(seen)


@pytest.mark.parametrize(
    "settings",
    [
        {"tenant_heder": "X-T"},
        {"tenant_header": 5},
        {"trusted_peers": "10.0.0.0/8"},
        {"trusted_peers": ["10.0.0.300"]},
    ],
)
def test_bad_settings_are_load_errors(settings: dict[str, Any]) -> None:
    regions = [{"name": "r1", "url": "http://127.0.0.1:9"}]
    with pytest.raises(PluginLoadError, match="geo_tenant"):
        build_proxy(regions, plugins=plugins_section(geo_tenant=settings))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1.35,103.82", (1.35, 103.82)),
        ("-33.8688 , 151.2093", (-33.8688, 151.2093)),
        ("+90,-180", (90.0, -180.0)),
        ("90.0001,0", None),
        ("0,180.5", None),
        ("1_0,2", None),
        ("0x1,2", None),
        ("", None),
        ("1,", None),
        ("1 2", None),
    ],
)
def test_parse_lat_lon(value: str, expected: tuple[float, float] | None) -> None:
    assert parse_lat_lon(value) == expected
