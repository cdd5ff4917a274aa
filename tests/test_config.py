from __future__ import annotations

from pathlib import Path

import pytest

from edgeproxy import AdmissionConfig, CacheConfig, Config, ConfigError, RegionConfig, load_config
from edgeproxy._core.config import (
    check_redis_url,
    config_from_mapping,
    iter_config_keys,
)

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
    assert "server.prot: unknown key; did you mean 'port'?" in errors
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
    assert config.upstream.http2 == "auto"
    assert config.regions[0].url == "https://r.example"


def test_secrets_not_in_repr() -> None:
    config = Config.from_mapping(
        {"regions": [{"name": "r", "url": "http://h:1", "api_key": "sk-secret"}]}, environ={}
    )
    assert "sk-secret" not in repr(config)


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


# -- Config.from_mapping ---------------------------------------------------------------

MINIMAL: dict[str, object] = {"regions": [{"name": "r-1", "url": "http://127.0.0.1:1"}]}


def test_from_mapping_validates_without_touching_the_data() -> None:
    data = {"server": {"port": 8181}, "regions": [{"name": "r-1", "url": "http://127.0.0.1:1"}]}
    env = {"EDGEPROXY_SERVER__PORT": "9191", "EDGEPROXY_REGIONS__R_1__WEIGHT": "3"}
    config = Config.from_mapping(data, environ=env)
    assert isinstance(config, Config)
    assert config.server.port == 9191 and config.regions[0].weight == 3
    assert data == {
        "server": {"port": 8181},
        "regions": [{"name": "r-1", "url": "http://127.0.0.1:1"}],
    }
    assert config.base_dir is None


def test_from_mapping_reads_os_environ_unless_given_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEPROXY_SERVER__PORT", "8282")
    assert Config.from_mapping(MINIMAL).server.port == 8282
    assert Config.from_mapping(MINIMAL, environ={}).server.port == 8080


def test_from_mapping_base_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        Config.from_mapping(MINIMAL, environ={}, base_dir=tmp_path).base_dir == tmp_path.resolve()
    )
    monkeypatch.chdir(tmp_path)
    relative = Config.from_mapping(MINIMAL, environ={}, base_dir="conf")
    assert relative.base_dir == tmp_path.resolve() / "conf"
    loaded = load_config(write(tmp_path, GOOD), environ={})
    assert loaded.base_dir == tmp_path.resolve()


def test_from_mapping_errors_name_every_key_and_the_source() -> None:
    data = {"server": {"port": -1}, "regions": [{"name": "r", "url": "ftp://h"}]}
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(data, environ={}, source="edge.yaml")
    assert info.value.source == "edge.yaml"
    assert "invalid configuration in edge.yaml" in str(info.value)
    assert any(e.startswith("server.port:") for e in info.value.errors)
    assert "regions[0].url: must be an http:// or https:// URL" in info.value.errors
    # The old name is the same function, errors and all.
    with pytest.raises(ConfigError) as old:
        config_from_mapping(data, environ={}, source="edge.yaml")
    assert old.value.errors == info.value.errors


# -- Redis URLs: one check for [cache] and [admission] ----------------------------------

GOOD_REDIS_URLS = [
    "redis://127.0.0.1:6379/0",
    "redis://user:pass@cache.internal",
    "rediss://cache.internal:6380/3",
    "unix:///run/redis/redis.sock",
    "unix:///run/redis/redis.sock?db=2",
]
BAD_REDIS_URLS = [
    ("http://cache.internal:6379", "must be a redis://, rediss:// or unix:// URL"),
    ("cache.internal:6379", "must be a redis://, rediss:// or unix:// URL"),
    ("redis://", "has no host"),
    ("rediss://:6380/0", "has no host"),
    ("redis://cache.internal:99999", "has an invalid port"),
    ("redis://cache.internal/zero", "database must be a number, not 'zero'"),
    ("unix://", "has no socket path"),
    ("unix://redis.sock", "has no socket path"),
    ("unix:///run/redis.sock?db=x", "database must be a number, not 'x'"),
    ("redis://cache.internal#x", "must not have a fragment"),
]


@pytest.mark.parametrize("section", ["cache", "admission"])
@pytest.mark.parametrize("url", GOOD_REDIS_URLS)
def test_redis_url_schemes_accepted_by_both_keys(section: str, url: str) -> None:
    config = Config.from_mapping({**MINIMAL, section: {"redis_url": url}}, environ={})
    assert getattr(config, section).redis_url == url


@pytest.mark.parametrize("section", ["cache", "admission"])
@pytest.mark.parametrize(("url", "reason"), BAD_REDIS_URLS)
def test_bad_redis_url_names_the_key_and_the_reason(section: str, url: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_mapping({**MINIMAL, section: {"redis_url": url}}, environ={})
    [error] = info.value.errors
    assert error.startswith(f"{section}.redis_url: {reason}"), error


def test_redis_url_errors_never_show_the_password() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(
            {
                **MINIMAL,
                "cache": {"redis_url": "redis://u:s3cret@h:99999"},
                "admission": {"redis_url": "http://u:s3cret@h"},
            },
            environ={},
        )
    assert len(info.value.errors) == 2
    assert "s3cret" not in str(info.value)


def test_empty_redis_url_turns_admission_redis_off_but_not_the_cache_url() -> None:
    assert AdmissionConfig(redis_url="").redis_url == ""
    with pytest.raises(ConfigError) as info:
        Config.from_mapping({**MINIMAL, "cache": {"redis_url": ""}}, environ={})
    assert info.value.errors == ["cache.redis_url: must be a redis://, rediss:// or unix:// URL"]
    with pytest.raises(ConfigError) as info:
        Config.from_mapping({**MINIMAL, "admission": {"redis_url": "ftp://h"}}, environ={})
    assert info.value.errors == [
        "admission.redis_url: must be a redis://, rediss:// or unix:// URL, or ''"
    ]


def test_both_sections_share_the_one_check() -> None:
    for url in GOOD_REDIS_URLS:
        assert check_redis_url(url) == url
        assert CacheConfig(redis_url=url).redis_url == AdmissionConfig(redis_url=url).redis_url
    for url, reason in BAD_REDIS_URLS:
        with pytest.raises(ValueError, match=reason.replace("(", r"\(")):
            check_redis_url(url)
        with pytest.raises(ValueError, match=reason.replace("(", r"\(")):
            check_redis_url(url, allow_empty=True)
    assert check_redis_url("", allow_empty=True) == ""


# -- [geo] trusted_peers ----------------------------------------------------------------


def test_geo_trusted_peers_default_trusts_nobody_and_says_so() -> None:
    config = Config.from_mapping(MINIMAL, environ={})
    assert config.geo.trusted_peers == []
    docs = {key: description for key, _type, _default, description in iter_config_keys()}
    assert "empty believes no peer" in docs["geo.trusted_peers"]
    assert "empty trusts every peer" not in docs["geo.trusted_peers"]
    everyone = Config.from_mapping({**MINIMAL, "geo": {"trusted_peers": ["0.0.0.0/0", "::/0"]}})
    assert everyone.geo.trusted_peers == ["0.0.0.0/0", "::/0"]


def test_route_table_longest_prefix_methods_and_segment_boundaries() -> None:
    config = Config.from_mapping(
        {
            "regions": [{"name": "r", "url": "http://r"}],
            "routes": [
                {"name": "v1", "path": "/v1"},
                {"name": "chat", "path": "/v1/chat/"},
                {"name": "chat-get", "path": "/v1/chat", "methods": ["GET"]},
                {"name": "root", "path": "/"},
            ],
        },
        environ={},
    )
    # Longest prefix first: "/v1/chat/" (9 characters) beats "/v1/chat" and "/v1".
    assert config.route_for("POST", "/v1/chat/completions").name == "chat"
    assert config.route_for("GET", "/v1/chat/completions").name == "chat"
    # Equal prefixes: the method filter decides, and "/v1/chat" itself matches.
    assert config.route_for("GET", "/v1/chat").name == "chat"
    assert config.route_for("POST", "/v1/embeddings").name == "v1"
    # Segment boundaries: "/v1" does not match "/v1x".
    assert config.route_for("POST", "/v1x").name == "root"
    assert config.route_for("GET", "/").name == "root"


def test_without_a_matching_route_the_default_route_applies() -> None:
    config = Config.from_mapping(
        {
            "regions": [{"name": "r", "url": "http://r"}],
            "routes": [{"name": "chat", "path": "/v1/chat", "methods": ["POST"]}],
        },
        environ={},
    )
    assert config.route_for("GET", "/v1/chat").name == "default"
    assert config.route_for("POST", "/v1/chat/completions").name == "chat"
    assert config.route_for("POST", "/other").name == "default"
