from __future__ import annotations

from pathlib import Path

import pytest

from edgeproxy import Config, ConfigError, RegionConfig, load_config
from edgeproxy._core.config import config_docs_markdown, iter_config_keys

GOOD = """
[server]
host = "127.0.0.1"
port = 8080

[admin]
host = "127.0.0.1"
port = 9901

[pop]
name = "edge-sin"
lat = 1.35
lon = 103.82

[[regions]]
name = "ap-southeast-1"
url = "http://127.0.0.1:9101"
http2 = true
lat = 1.29
lon = 103.85
api_key_env = "AP_KEY"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "edge.toml"
    path.write_text(text)
    return path


def test_load_good_config(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD), environ={"AP_KEY": "sk-ap"})
    assert config.server.port == 8080
    assert config.pop.name == "edge-sin"
    region = config.region("ap-southeast-1")
    assert region.http2 is True
    assert region.resolved_api_key({"AP_KEY": "sk-ap"}) == "sk-ap"
    assert region.resolved_api_key({}) is None


def test_every_error_is_listed_with_its_key(tmp_path: Path) -> None:
    text = """
[server]
port = "eighty"
prot = 1

[pop]
lat = 123

[[regions]]
name = "a"
url = "ftp://example"

[[regions]]
name = "b"
url = "http://127.0.0.1:99999"
weight = -1
"""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), environ={})
    errors = info.value.errors
    assert any(e.startswith("server.port:") for e in errors)
    assert "server.prot: unknown key" in errors
    assert any(e.startswith("pop.lat:") for e in errors)
    assert "regions[0].url: must be an http:// or https:// URL" in errors
    assert any(e.startswith("regions[1].url:") and "port" in e for e in errors)
    assert any(e.startswith("regions[1].weight:") for e in errors)
    assert str(tmp_path / "edge.toml") in str(info.value)


def test_empty_and_duplicate_regions(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least one"):
        load_config(write(tmp_path, "[server]\nport = 1\n"), environ={})
    dup = (
        '[[regions]]\nname = "a"\nurl = "http://h:1"\n[[regions]]\nname = "a"\nurl = "http://h:2"\n'
    )
    with pytest.raises(ConfigError, match="duplicate region name 'a'"):
        load_config(write(tmp_path, dup), environ={})


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[server\nport=1", "TOML syntax error"),
        ('[[regions]]\nname = "a"\nurl = "http://h:1"\nlat = nan\n', "regions[0].lat"),
        ('[[regions]]\nname = "a"\nurl = "http://h:1?x=1"\n', "query"),
        ('[[regions]]\nname = ""\nurl = "http://h:1"\n', "regions[0].name"),
    ],
)
def test_bad_values(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), environ={})
    assert fragment in str(info.value)


def test_unreadable_and_non_utf8(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'[server]\nhost = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


def test_environment_overrides(tmp_path: Path) -> None:
    env = {
        "EDGEPROXY_SERVER__PORT": "8181",
        "EDGEPROXY_POP__NAME": "edge-fra",
        "EDGEPROXY_REGIONS__AP_SOUTHEAST_1__API_KEY": "sk-env",
        "EDGEPROXY_REGIONS__0__WEIGHT": "2.5",
        "UNRELATED": "x",
    }
    config = load_config(write(tmp_path, GOOD), environ=env)
    assert config.server.port == 8181
    assert config.pop.name == "edge-fra"
    assert config.regions[0].api_key == "sk-env"
    assert config.regions[0].weight == 2.5


def test_environment_override_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="server.port"):
        load_config(write(tmp_path, GOOD), environ={"EDGEPROXY_SERVER__PORT": "no"})


def test_config_in_code_without_a_file() -> None:
    config = Config(regions=[RegionConfig(name="r", url="https://r.example")])
    assert config.upstream.http2 is True
    assert config.regions[0].url == "https://r.example"


def test_secrets_not_in_repr() -> None:
    config = Config.from_mapping(
        {"regions": [{"name": "r", "url": "http://h:1", "api_key": "sk-secret"}]}, environ={}
    )
    assert "sk-secret" not in repr(config)


def test_every_key_is_documented_in_the_readme() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for key, _type, _default, description in iter_config_keys():
        assert description, f"{key} has no description"
        assert f"`{key}`" in readme, f"{key} is missing from the README's config table"
    assert config_docs_markdown().startswith("| key |")


def _with_routes(routes: list[dict[str, object]]) -> dict[str, object]:
    return {"regions": [{"name": "r1", "url": "http://127.0.0.1:1"}], "routes": routes}


def test_routes_longest_prefix_on_segment_boundaries() -> None:
    config = Config.from_mapping(
        _with_routes(
            [
                {"name": "v1", "path": "/v1"},
                {"name": "chat", "path": "/v1/chat/completions", "methods": ["post"]},
            ]
        ),
        environ={},
    )
    assert config.route_for("POST", "/v1/chat/completions").name == "chat"
    assert config.route_for("GET", "/v1/chat/completions").name == "v1"
    assert config.route_for("GET", "/v1/models").name == "v1"
    assert config.route_for("GET", "/v10/models").name == "default"
    assert config.route_for("GET", "/").name == "default"


def test_route_errors_name_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(
            _with_routes([{"name": "a", "path": "v1"}, {"name": "b", "path": "/x", "extra": 1}]),
            environ={},
        )
    assert "routes[0].path: must start with '/'" in info.value.errors
    assert "routes[1].extra: unknown key" in info.value.errors
    with pytest.raises(ConfigError, match="duplicate route name 'a'"):
        Config.from_mapping(
            _with_routes([{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]), environ={}
        )


def test_region_url_with_credentials_is_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(
            {
                "regions": [
                    {"name": "a", "url": "http://user:s3cret@127.0.0.1:1"},
                    {"name": "b", "url": "http://127.0.0.1:2", "urls": ["http://u:p4ss@h:3"]},
                ]
            },
            environ={},
        )
    text = str(info.value)
    assert "regions[0].url: must not contain credentials" in text
    assert "regions[1].urls: entry 0 must not contain credentials" in text
    assert "s3cret" not in text and "p4ss" not in text


def test_empty_or_odd_unknown_keys_are_named_quoted() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(
            {"": 1, "a b": 2, "regions": [{"name": "a", "url": "http://127.0.0.1:1"}]},
            environ={},
        )
    assert '"": unknown key' in info.value.errors
    assert '"a b": unknown key' in info.value.errors
