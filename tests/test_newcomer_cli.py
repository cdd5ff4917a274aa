"""What a first hour with the command trips on: configurations check-config let pass,
errors that came one fix at a time, operator commands that did not find the admin
listener serve was told of, and help texts that said more than is so."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

from edgeproxy import Config, ConfigError
from edgeproxy._cli import main
from edgeproxy._core.config import loader
from edgeproxy._opscli import DEFAULT_ADMIN, TOKEN_ENV

from .conftest import ProxyFactory, RegionFactory

REGION = '[[regions]]\nname = "a"\nurl = "http://127.0.0.1:9101"\n'
LOCAL_ONLY = '[[routes]]\nname = "chat"\npath = "/v1/chat/completions"\nfallback = ["local"]\n'


@pytest.fixture(autouse=True)
def no_config_around(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Whatever the machine has at the default path or in the environment stays out."""
    monkeypatch.delenv(loader.CONFIG_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setattr(loader, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent" / "edge.toml"))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


async def run_cli(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``edgeproxy argv`` in a thread (it blocks; the proxy runs on this loop)."""
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- check-config: what cannot work, and every error at once -------------------------------


def test_a_local_rung_without_a_local_model_is_refused_by_check_config_and_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "edge.toml", REGION + LOCAL_ONLY)
    for argv in (["check-config", str(path)], ["serve", "--config", str(path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"invalid configuration in {path}:" in err
        assert "routes[0].fallback: lists 'local' but [local_model] path is not set" in err
    # The model named by the environment, as serve would read it, makes it whole.
    monkeypatch.setenv("EDGEPROXY_LOCAL_MODEL__PATH", "model.gguf")
    assert main(["check-config", str(path)]) == 0


def test_the_default_ladder_needs_no_local_model() -> None:
    # ["stale", "local"] is every route's ladder unless it names one: 'local' there is
    # for whoever configures the model, and a config dumped and loaded again keeps it.
    for routes in ([], [{"name": "r", "path": "/", "fallback": ["stale", "local"]}]):
        data = {"regions": [{"name": "a", "url": "http://127.0.0.1:9101"}], "routes": routes}
        config = Config.from_mapping(data, environ={})
        Config.from_mapping(config.model_dump(), environ={})


def test_every_error_comes_in_one_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        tmp_path / "edge.toml",
        '[server]\nport = "abc"\n'
        + REGION * 2
        + LOCAL_ONLY * 2
        + '[[regions]]\nname = "b"\nurl = "http://127.0.0.1:9102"\nweigth = 2\n',
    )
    assert main(["check-config", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()[1:]
    assert [line.strip().split(":")[0] for line in lines] == [
        "server.port",
        "regions[2].weigth",
        "regions",
        "routes",
        "routes[0].fallback",
        "routes[1].fallback",
    ]
    assert "  regions: duplicate region name 'a'" in lines
    assert "  routes: duplicate route name 'chat'" in lines

    # With every field right, the checks across sections still all come, each once.
    fields_right = REGION * 2 + LOCAL_ONLY * 2
    with pytest.raises(ConfigError) as caught:
        loader.load_config(write(tmp_path / "b.toml", fields_right), environ={})
    assert caught.value.errors == [
        "regions: duplicate region name 'a'",
        "routes: duplicate route name 'chat'",
        "routes[0].fallback: lists 'local' but [local_model] path is not set, so that rung "
        "would never answer: set [local_model] path (or EDGEPROXY_LOCAL_MODEL__PATH) or "
        "drop 'local'",
        "routes[1].fallback: lists 'local' but [local_model] path is not set, so that rung "
        "would never answer: set [local_model] path (or EDGEPROXY_LOCAL_MODEL__PATH) or "
        "drop 'local'",
    ]


def test_check_config_counts_one_region_and_several(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = write(tmp_path / "one.toml", REGION)
    assert main(["check-config", str(one)]) == 0
    assert capsys.readouterr().out == f"{one}: OK (1 region: a)\n"
    two = write(tmp_path / "two.toml", REGION + REGION.replace('"a"', '"b"'))
    assert main(["check-config", str(two)]) == 0
    assert capsys.readouterr().out == f"{two}: OK (2 regions: a, b)\n"


def test_serve_and_check_config_find_the_config_as_one_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for argv in (["serve"], ["check-config"]):
        assert main(argv) == 2
        assert "no such file: give --config PATH or set EDGEPROXY_CONFIG" in (
            capsys.readouterr().err
        )
    path = write(tmp_path / "edge.toml", REGION + LOCAL_ONLY)
    monkeypatch.setenv(loader.CONFIG_ENV, str(path))
    for argv in (["serve"], ["check-config"]):
        assert main(argv) == 2
        assert f"in {path} (from EDGEPROXY_CONFIG):" in capsys.readouterr().err
    monkeypatch.delenv(loader.CONFIG_ENV)
    monkeypatch.setattr(loader, "DEFAULT_CONFIG_PATH", str(write(tmp_path / "d.toml", REGION)))
    assert main(["check-config"]) == 0
    assert capsys.readouterr().out.endswith("d.toml (the default path): OK (1 region: a)\n")


# -- the operator's commands find the admin listener serve was told of ----------------------


async def test_status_and_top_read_the_admin_address_from_the_config(
    tmp_path: Path,
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proxy = await make_proxy([await make_region("ap-1")], admin={"token": "s3cret"})
    port = proxy.admin_url.rsplit(":", 1)[1]
    # The listener binds 127.0.0.1; a config that says every interface is reached on loopback.
    path = write(
        tmp_path / "edge.toml",
        f'[admin]\nhost = "0.0.0.0"\nport = {port}\ntoken = "s3cret"\n' + REGION,
    )
    code, out, err = await run_cli(["status", "--config", str(path)], capsys)
    assert code == 0, err
    assert "PoP edge-test" in out

    monkeypatch.setenv(loader.CONFIG_ENV, str(path))
    code, out, err = await run_cli(["top", "--once"], capsys)
    assert code == 0, err
    assert f"edgeproxy top  http://127.0.0.1:{port}" in out
    assert "Ctrl-C" not in out  # one frame, nothing to quit

    monkeypatch.delenv(loader.CONFIG_ENV)
    monkeypatch.setattr(loader, "DEFAULT_CONFIG_PATH", str(path))
    code, out, err = await run_cli(["status", "--json"], capsys)
    assert code == 0 and '"regions"' in out, err


@pytest.mark.parametrize(
    "argv", [["status"], ["top", "--once"], ["reload"], ["purge", "--prefix", ""]]
)
async def test_an_unreachable_admin_says_where_its_address_came_from(
    argv: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hint = "(set --admin URL or --config PATH)"
    code, _, err = await run_cli(argv, capsys)
    assert code == 1
    assert err.startswith(f"edgeproxy: cannot reach the admin listener at {DEFAULT_ADMIN} ")
    assert "(the default: no --admin, --config or EDGEPROXY_CONFIG, and no " in err
    assert err.rstrip().endswith(hint) and err.count("\n") == 1

    port = closed_port()
    path = write(tmp_path / "edge.toml", f"[admin]\nport = {port}\n" + REGION)
    code, _, err = await run_cli([*argv, "--config", str(path)], capsys)
    assert code == 1
    assert err.startswith(
        f"edgeproxy: cannot reach the admin listener at http://127.0.0.1:{port}"
        f" (from [admin] of {path}, named by --config): "
    )
    assert err.rstrip().endswith(hint)

    monkeypatch.setenv(loader.CONFIG_ENV, str(path))
    code, _, err = await run_cli(argv, capsys)
    assert code == 1 and f"(from [admin] of {path}, named by EDGEPROXY_CONFIG)" in err

    # --admin wins over every config.
    admin = f"http://127.0.0.1:{closed_port()}"
    code, _, err = await run_cli([*argv, "--admin", admin], capsys)
    assert code == 1
    assert err.startswith(f"edgeproxy: cannot reach the admin listener at {admin} (given by")


async def test_a_config_that_names_no_reachable_listener_is_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write(tmp_path / "bad.toml", REGION * 2)
    code, _, err = await run_cli(["status", "--config", str(bad)], capsys)
    assert code == 2
    assert "regions: duplicate region name 'a'" in err and "give --admin URL" in err
    off = write(tmp_path / "off.toml", "[admin]\nenabled = false\n" + REGION)
    code, _, err = await run_cli(["status", "--config", str(off)], capsys)
    assert code == 1 and "enabled = false, there is no listener to reach" in err
    picked = write(tmp_path / "picked.toml", "[admin]\nport = 0\n" + REGION)
    code, _, err = await run_cli(["reload", "--config", str(picked)], capsys)
    assert code == 1 and "port = 0 is picked when the proxy starts" in err


# -- help texts ----------------------------------------------------------------------------


def test_reload_help_does_not_ask_for_workers(capsys: pytest.CaptureFixture[str]) -> None:
    # A single serve process reloads in place as well as a supervisor does.
    for argv in (["--help"], ["reload", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "reload" in out and "--workers" not in out
