"""TLS on the client and admin listeners, mutual TLS, certificate reload, the admin token."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import warnings
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme

from edgeproxy import Config, ConfigError, EdgeProxy
from edgeproxy._cli import main

from .conftest import ProxyFactory, RegionFactory, proxy_config, spawn_serve, write_pair
from .test_cli import free_port

CHAT = "/v1/chat/completions"
# The fake regions serve (and list in their /v1/models, from which a proxy learns it) the
# model the requests name.
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


def client_context(ca: trustme.CA, **kwargs: Any) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    for name, value in kwargs.items():
        setattr(context, name, value)
    return context


async def post(url: str, context: ssl.SSLContext) -> int:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as client:
        async with client.post(url + CHAT, json=BODY) as resp:
            await resp.read()
            return resp.status


async def test_the_client_verifies_the_proxy_over_tls_1_2_and_later(
    tmp_path: Path, ca: trustme.CA, make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", model="m")
    cert, key = write_pair(ca, tmp_path)
    proxy = await make_proxy([region], server={"tls_cert": cert, "tls_key": key})
    assert proxy.url.startswith("https://127.0.0.1:")
    assert await post(proxy.url, client_context(ca)) == 200

    host, port = proxy.url.removeprefix("https://").split(":")
    # ALPN: HTTP/1.1 even when the client offers h2 first.
    context = client_context(ca)
    context.set_alpn_protocols(["h2", "http/1.1"])
    _, writer = await asyncio.open_connection(host, int(port), ssl=context)
    assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
    writer.close()
    await writer.wait_closed()

    # Not trusted: the client refuses; too old: the handshake fails.
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await post(proxy.url, ssl.create_default_context())
    old = client_context(ca)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLS 1.1 is, which is the point
        old.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
        old.maximum_version = ssl.TLSVersion.TLSv1_1
    with pytest.raises(aiohttp.ClientError):
        await post(proxy.url, old)


async def test_mutual_tls_refuses_a_client_without_a_certificate(
    tmp_path: Path, ca: trustme.CA, make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", model="m")
    cert, key = write_pair(ca, tmp_path)
    client_ca = trustme.CA()
    ca_path = tmp_path / "clients.pem"
    client_ca.cert_pem.write_to_path(str(ca_path))
    proxy = await make_proxy(
        [region], server={"tls_cert": cert, "tls_key": key, "tls_client_ca": str(ca_path)}
    )
    with pytest.raises(aiohttp.ClientError):
        await post(proxy.url, client_context(ca))
    # A certificate from another CA is refused too.
    stranger = client_context(ca)
    trustme.CA().issue_cert("client@example.com").configure_cert(stranger)
    with pytest.raises(aiohttp.ClientError):
        await post(proxy.url, stranger)
    known = client_context(ca)
    client_ca.issue_cert("client@example.com").configure_cert(known)
    assert await post(proxy.url, known) == 200


async def test_a_certificate_reloads_in_place_and_a_bad_one_is_refused(
    tmp_path: Path, ca: trustme.CA, make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", model="m")
    cert, key = write_pair(ca, tmp_path)
    proxy = await make_proxy([region], server={"tls_cert": cert, "tls_key": key})
    assert await post(proxy.url, client_context(ca)) == 200

    # A key that does not match: refused, the running pair stays.
    other_ca = trustme.CA()
    other_cert, other_key = write_pair(other_ca, tmp_path, "other")
    Path(cert).write_bytes(Path(other_cert).read_bytes())
    assert proxy.reload_tls() is False
    assert await post(proxy.url, client_context(ca)) == 200

    Path(key).write_bytes(Path(other_key).read_bytes())
    assert proxy.reload_tls() is True
    assert await post(proxy.url, client_context(other_ca)) == 200
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await post(proxy.url, client_context(ca))


async def test_sighup_reloads_the_certificate_of_a_running_serve(
    tmp_path: Path, ca: trustme.CA, make_region: RegionFactory
) -> None:
    region = await make_region("ap-1", model="m")
    cert, key = write_pair(ca, tmp_path)
    port, admin_port = free_port(), free_port()
    config = tmp_path / "edge.toml"
    config.write_text(
        f'[server]\nport = {port}\ntls_cert = "proxy.pem"\ntls_key = "proxy.key"\n'
        f'[admin]\nport = {admin_port}\n[[regions]]\nname = "ap-1"\nurl = "{region.url}"\n'
    )
    proc = await spawn_serve(config, stderr=asyncio.subprocess.PIPE)
    url = f"https://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                assert await post(url, client_context(ca)) == 200
                break
            except aiohttp.ClientConnectorError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("the proxy did not listen")
        new_ca = trustme.CA()
        new_cert, new_key = write_pair(new_ca, tmp_path, "new")
        Path(cert).write_bytes(Path(new_cert).read_bytes())
        Path(key).write_bytes(Path(new_key).read_bytes())
        proc.send_signal(signal.SIGHUP)
        for _ in range(600):
            try:
                assert await post(url, client_context(new_ca)) == 200
                break
            except aiohttp.ClientConnectorCertificateError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("the certificate was not reloaded")
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0
        assert b"server TLS certificate reloaded" in err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_tls_files_that_do_not_load_are_errors_naming_the_key(
    tmp_path: Path, ca: trustme.CA, capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key = write_pair(ca, tmp_path)
    _, other_key = write_pair(ca, tmp_path, "other")
    regions = [{"name": "a", "url": "http://127.0.0.1:9"}]
    cases = [
        (
            {"tls_cert": str(tmp_path / "missing.pem"), "tls_key": key},
            r"server\.tls_cert: cannot read",
        ),
        (
            {"tls_cert": cert, "tls_key": other_key},
            r"server\.tls_key: .* is not the key of server\.tls_cert",
        ),
        ({"tls_cert": key, "tls_key": key}, r"server\.tls_cert, server\.tls_key: not a PEM"),
    ]
    for server, expected in cases:
        config = Config.from_mapping(proxy_config(regions, server=server), environ={})
        with pytest.raises(ConfigError, match=expected):
            await EdgeProxy(config).start()

    path = tmp_path / "edge.toml"
    path.write_text(
        f'[server]\ntls_cert = "{cert}"\ntls_key = "{other_key}"\n'
        '[[regions]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )
    assert main(["check-config", str(path)]) == 2
    assert "server.tls_key:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"server": {"tls_cert": "c.pem"}}, "server.tls_key: needed with tls_cert"),
        ({"server": {"tls_key": "k.pem"}}, "server.tls_key: given without tls_cert"),
        ({"server": {"tls_client_ca": "ca.pem"}}, "server.tls_client_ca: needs tls_cert"),
        ({"admin": {"tls_cert": "c.pem"}}, "admin.tls_key: needed with tls_cert"),
        ({"admin": {"host": "0.0.0.0"}}, "admin: host = '0.0.0.0' is not a loopback address"),
    ],
)
def test_tls_and_exposure_settings_are_checked_at_load(
    section: dict[str, Any], expected: str
) -> None:
    data = {"regions": [{"name": "a", "url": "http://x"}], **section}
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(data, environ={})
    assert expected in str(info.value)


async def test_the_admin_token_guards_all_but_the_probes(
    tmp_path: Path, ca: trustme.CA, make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1", model="m")
    cert, key = write_pair(ca, tmp_path)
    os.environ["EDGEPROXY_TEST_ADMIN_TOKEN"] = "s3cret"
    try:
        proxy = await make_proxy(
            [region],
            admin={
                "host": "127.0.0.1",
                "port": 0,
                "token_env": "EDGEPROXY_TEST_ADMIN_TOKEN",
                "tls_cert": cert,
                "tls_key": key,
            },
        )
    finally:
        del os.environ["EDGEPROXY_TEST_ADMIN_TOKEN"]
    assert proxy.admin_url.startswith("https://")
    connector = aiohttp.TCPConnector(ssl=client_context(ca))
    async with aiohttp.ClientSession(connector=connector) as client:
        for path in ("/healthz", "/readyz"):
            async with client.get(proxy.admin_url + path) as resp:
                assert resp.status == 200, path
        for token in (None, "Bearer wrong", "s3cret"):
            headers = {"Authorization": token} if token else {}
            async with client.get(proxy.admin_url + "/status", headers=headers) as resp:
                assert resp.status == 401
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
                assert (await resp.json())["error"]["code"] == "invalid_admin_token"
        headers = {"Authorization": "Bearer s3cret"}
        async with client.get(proxy.admin_url + "/status", headers=headers) as resp:
            assert resp.status == 200
        async with client.post(
            proxy.admin_url + "/cache/purge", json={"prefix": ""}, headers=headers
        ) as resp:
            assert resp.status == 200


def test_an_admin_token_variable_that_is_not_set_is_an_error() -> None:
    data = proxy_config(
        [{"name": "a", "url": "http://x"}],
        admin={"host": "0.0.0.0", "token_env": "EDGEPROXY_TEST_UNSET_TOKEN"},
    )
    config = Config.from_mapping(data, environ={})
    with pytest.raises(ConfigError, match="admin.token_env: EDGEPROXY_TEST_UNSET_TOKEN is not set"):
        EdgeProxy(config)
