"""apikey_auth through the real server, loaded from [plugins] like users do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from edgeproxy import PluginLoadError
from edgeproxy.plugins.apikey_auth import ApiKeyAuth, derived_tenant

from ..conftest import RegionFactory
from .conftest import CHAT, PluginProxyFactory, Recorder, build_proxy, plugins_section

NO_REGION = [{"name": "r1", "url": "http://127.0.0.1:9"}]  # never contacted
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}

KEYS_FILE = """\
# team keys
sk-alpha-0123456789abcdef   team-a
sk-beta-0123456789abcdef\tteam-b   # inline comment
sk-no#hash-in-key

sk-lonely-0123456789abcdef
"""


@pytest.fixture(autouse=True)
def no_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDGEPROXY_API_KEYS", raising=False)


@pytest.fixture
def keys_file(tmp_path: Path) -> str:
    path = tmp_path / "keys.txt"
    path.write_text(KEYS_FILE)
    return str(path)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def post(
    client: aiohttp.ClientSession, url: str, headers: Any = None, path: str = CHAT
) -> tuple[int, Any, CIMultiDict[str]]:
    async with client.post(url + path, json=BODY, headers=headers) as resp:
        return resp.status, await resp.json(), CIMultiDict(resp.headers)


async def test_valid_keys_pass_and_set_the_tenant(
    make_region: RegionFactory,
    make_plugin_proxy: PluginProxyFactory,
    keys_file: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGEPROXY_API_KEYS", " sk-env-0123456789abcdef:team-env , sk-env2-xyz ")
    region = await make_region("r1")
    recorder = Recorder()
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        extra=[recorder],
        plugins=plugins_section(apikey_auth={"keys_file": keys_file}),
    )
    cases = [
        (auth("sk-alpha-0123456789abcdef"), "team-a"),
        ({"api-key": "sk-beta-0123456789abcdef"}, "team-b"),
        ({"x-api-key": "sk-no#hash-in-key"}, derived_tenant("sk-no#hash-in-key")),
        (auth("sk-lonely-0123456789abcdef"), derived_tenant("sk-lonely-0123456789abcdef")),
        (auth("sk-env-0123456789abcdef"), "team-env"),
        ({"authorization": "bearer   sk-env2-xyz  "}, derived_tenant("sk-env2-xyz")),
        # The same key in two headers is not ambiguous.
        ({**auth("sk-alpha-0123456789abcdef"), "api-key": "sk-alpha-0123456789abcdef"}, "team-a"),
    ]
    async with aiohttp.ClientSession() as client:
        for headers, tenant in cases:
            status, data, _ = await post(client, proxy.url, headers)
            assert status == 200, (headers, data)
            assert data["object"] == "chat.completion"
            assert (await recorder.next()).tenant == tenant
    assert derived_tenant("sk-env2-xyz").startswith("key:")
    assert len(derived_tenant("sk-env2-xyz")) == len("key:") + 16


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        (auth("sk-wrong-0123456789abcdef"), "invalid_api_key"),
        (auth("sk-alpha-0123456789abcdeF"), "invalid_api_key"),
        ({"api-key": "sk-alpha-0123456789abcde"}, "invalid_api_key"),
        ({"Authorization": "Basic c2stYWxwaGE6"}, "invalid_api_key"),
        ({"Authorization": "Bearer"}, "invalid_api_key"),
        ({"Authorization": "Bearer sk-alpha-0123456789abcdef extra"}, "invalid_api_key"),
        ({"Authorization": "sk-alpha-0123456789abcdef"}, "invalid_api_key"),
        ({"api-key": ""}, "invalid_api_key"),
        (
            {**auth("sk-alpha-0123456789abcdef"), "api-key": "sk-beta-0123456789abcdef"},
            "invalid_api_key",
        ),
        (
            [
                ("Authorization", "Bearer sk-alpha-0123456789abcdef"),
                ("Authorization", "Bearer sk-wrong"),
            ],
            "invalid_api_key",
        ),
    ],
    ids=[
        "missing",
        "unknown",
        "case-differs",
        "prefix-of-a-key",
        "basic-scheme",
        "bearer-without-key",
        "bearer-with-space",
        "no-scheme",
        "empty-api-key",
        "two-different-keys",
        "authorization-twice",
    ],
)
async def test_bad_credentials_get_401_and_never_reach_the_region(
    make_region: RegionFactory,
    make_plugin_proxy: PluginProxyFactory,
    keys_file: str,
    headers: Any,
    code: str,
) -> None:
    region = await make_region("r1")
    recorder = Recorder()
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        extra=[recorder],
        plugins=plugins_section(apikey_auth={"keys_file": keys_file}),
    )
    before = region.requests_total
    async with aiohttp.ClientSession() as client:
        status, data, resp_headers = await post(client, proxy.url, headers)
        # Anything may be sent: the answer is the same 401, and nothing goes upstream.
        async with client.get(proxy.url + "/echo/x", headers=headers) as resp:
            assert resp.status == 401
    assert status == 401
    assert set(data) == {"error"}
    assert set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["type"] == "invalid_request_error"
    assert data["error"]["code"] == code
    assert data["error"]["param"] is None
    assert "sk-" not in data["error"]["message"]
    assert resp_headers["Content-Type"].startswith("application/json")
    assert resp_headers["WWW-Authenticate"].startswith("Bearer")
    assert resp_headers["X-Request-Id"]
    assert region.requests_total == before
    ctx = await recorder.next()
    assert (ctx.status, ctx.tenant) == (401, None)


async def test_exempt_paths(
    make_region: RegionFactory, make_plugin_proxy: PluginProxyFactory, keys_file: str
) -> None:
    region = await make_region("r1")
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        plugins=plugins_section(
            apikey_auth={"keys_file": keys_file, "exempt_paths": ["/healthz", "/echo/public/"]}
        ),
    )
    before = region.requests_total
    exempt = ["/healthz", "/healthz?probe=1", "/echo/public/a", "/echo/public/a/b"]
    not_exempt = [
        "/healthzz",
        "/healthz-extra",
        "/echo/public",
        "/echo/publicity",
        "/healthz/../v1/models",
        "/healthz/%2e%2e/v1/models",
        "/echo/public/%2E%2E/private",
        "/echo/public/..%2fprivate",
        "/echo/public/./a",
    ]
    async with aiohttp.ClientSession() as client:
        for path in exempt:
            async with client.get(yarl_url(proxy.url + path)) as resp:
                assert resp.status == 200, path
        for path in not_exempt:
            async with client.get(yarl_url(proxy.url + path)) as resp:
                assert resp.status == 401, path
                assert (await resp.json())["error"]["code"] == "missing_api_key"
        # An exempt path with a key is fine too.
        async with client.get(proxy.url + "/healthz", headers=auth("nonsense")) as resp:
            assert resp.status == 200
    assert region.requests_total == before + len(exempt) + 1


def yarl_url(url: str) -> Any:
    import yarl

    return yarl.URL(url, encoded=True)  # sent byte for byte, dot segments included


async def test_keys_from_env_only(
    make_region: RegionFactory,
    make_plugin_proxy: PluginProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MY_EDGE_KEYS", "sk-env-a:tenant-a,sk-env-b")
    region = await make_region("r1")
    recorder = Recorder()
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        extra=[recorder],
        plugins=plugins_section(apikey_auth={"keys_env": "MY_EDGE_KEYS"}),
    )
    async with aiohttp.ClientSession() as client:
        assert (await post(client, proxy.url, auth("sk-env-a")))[0] == 200
        assert (await recorder.next()).tenant == "tenant-a"
        assert (await post(client, proxy.url, {"api-key": "sk-env-b"}))[0] == 200
        assert (await recorder.next()).tenant == derived_tenant("sk-env-b")
        assert (await post(client, proxy.url, auth("sk-env-c")))[0] == 401


def test_no_keys_is_a_load_error_naming_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(PluginLoadError, match="apikey_auth") as info:
        build_proxy(NO_REGION, plugins=plugins_section(apikey_auth={}))
    assert info.value.plugin == "apikey_auth"
    assert "no API keys" in str(info.value)

    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n\n")
    monkeypatch.setenv("EDGEPROXY_API_KEYS", " , ")
    with pytest.raises(PluginLoadError, match="apikey_auth"):
        build_proxy(NO_REGION, plugins=plugins_section(apikey_auth={"keys_file": str(empty)}))


@pytest.mark.parametrize(
    ("settings", "file_text", "message"),
    [
        ({"keys_file": "{missing}"}, None, "No such file"),
        ({"keys_file": "{file}"}, "sk-secret-1 team a\n", "line 1"),
        ({"keys_file": "{file}"}, "sk-ok\nsk-secret-2 bad/tenant\n", "line 2"),
        ({"keys_file": "{file}"}, "sk-secret-3 t1\nsk-secret-3 t2\n", "another tenant"),
        ({"keys_file": "{file}"}, "sk-s\u00e9cret\n", "printable ASCII"),
        ({"keys_file": "{file}", "exempt_paths": "/healthz"}, "k\n", "exempt_paths"),
        ({"keys_file": "{file}", "exempt_paths": ["healthz"]}, "k\n", "exempt_paths"),
        ({"keys_file": "{file}", "keys": ["k"]}, "k\n", "unknown settings: keys"),
    ],
    ids=[
        "missing-file",
        "three-fields",
        "bad-tenant",
        "conflict",
        "non-ascii",
        "str-exempt",
        "relative-exempt",
        "unknown-setting",
    ],
)
def test_bad_settings_are_load_errors_without_key_material(
    tmp_path: Path, settings: dict[str, Any], file_text: str | None, message: str
) -> None:
    path = tmp_path / "keys.txt"
    if file_text is not None:
        path.write_text(file_text)
    resolved = {
        k: (v.format(file=path, missing=tmp_path / "nope.txt") if isinstance(v, str) else v)
        for k, v in settings.items()
    }
    with pytest.raises(PluginLoadError, match="apikey_auth") as info:
        build_proxy(NO_REGION, plugins=plugins_section(apikey_auth=resolved))
    assert message in str(info.value)
    assert "secret" not in str(info.value)


def test_lookup_compares_against_every_key() -> None:
    plugin = ApiKeyAuth({"k1": "t1", "k2": None})
    assert plugin.lookup("k1") == (True, "t1")
    assert plugin.lookup("k2") == (True, derived_tenant("k2"))
    assert plugin.lookup("k3") == (False, None)
    assert plugin.lookup("") == (False, None)
