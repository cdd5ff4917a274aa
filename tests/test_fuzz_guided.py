"""The coverage-guided fuzz harnesses of ``fuzz/``: their corpus, a short run, what they found.

* Every file of the checked-in corpus (``fuzz/corpus/<target>/``) goes
  through its harness, without atheris: the seeds, and the inputs that
  once crashed (``crash_*``), keep holding their property.
* Each harness fuzzes briefly under atheris (a fixed number of inputs, a
  fixed seed) and must end cleanly, with no crash file; skipped, saying
  why, when atheris cannot be imported.
* The bugs the fuzzers found, as plain regression tests.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest

from edgeproxy._cache.entry import Entry, replay_parts
from edgeproxy._core.config import Config, ConfigError, load_config
from edgeproxy._protocol.dialects import CHAT
from edgeproxy._protocol.sse import SSEReader

FUZZ = Path(__file__).resolve().parent.parent / "fuzz"
TARGETS = sorted(p.stem.removeprefix("fuzz_") for p in FUZZ.glob("fuzz_*.py"))
CORPUS = sorted(p for p in FUZZ.glob("corpus/*/*") if p.is_file())
# Inputs per harness in the short run: a few seconds each on a busy 2-core machine.
RUNS = 5000


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@cache
def harness(target: str) -> ModuleType:
    """``fuzz/fuzz_<target>.py`` as a module (it imports ``_harness`` from its folder)."""
    if "_harness" not in sys.modules:
        _load("_harness", FUZZ / "_harness.py")
    return _load(f"fuzz_{target}", FUZZ / f"fuzz_{target}.py")


@cache
def runner() -> ModuleType:
    return _load("fuzz_run", FUZZ / "run.py")


def test_every_target_has_a_corpus() -> None:
    assert TARGETS == [
        "cache_entry",
        "clientip",
        "config",
        "json_body",
        "loadmetrics",
        "request_head",
        "sse",
    ]
    for target in TARGETS:
        seeds = list((FUZZ / "corpus" / target).iterdir())
        assert seeds, target
        # Small: the corpus is checked in.
        assert sum(p.stat().st_size for p in seeds) < 4096, target


@pytest.mark.parametrize("path", CORPUS, ids=[f"{p.parent.name}/{p.name}" for p in CORPUS])
def test_corpus_holds_its_property(path: Path) -> None:
    harness(path.parent.name).test_one_input(path.read_bytes())


@pytest.fixture(scope="module")
def atheris_importable() -> None:
    probe = subprocess.run([sys.executable, "-c", "import atheris"], capture_output=True, text=True)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        pytest.skip(f"atheris is not importable ({reason}); pip install atheris")


@pytest.mark.usefixtures("atheris_importable")
@pytest.mark.parametrize("target", TARGETS)
def test_short_guided_run(target: str, tmp_path: Path) -> None:
    # seconds is only a backstop: the run stops after RUNS inputs.
    result = runner().run_target(target, tmp_path, seconds=100, runs=RUNS, seed=1)
    log = (tmp_path / target / "last.log").read_text()
    assert result.returncode == 0, log[-4000:]
    assert result.crashes == [], log[-4000:]
    assert result.runs, log[-4000:]
    # libFuzzer wrote what it found to the working corpus, never to the checked-in one.
    assert not list((FUZZ / "corpus" / target).glob("[0-9a-f]" * 40))


def test_run_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = runner().Result("sse", 2.0, 100, 150, 300, 20, [], 0)
    table = runner().table([result])
    assert table.splitlines()[0].split() == [
        "target",
        "seconds",
        "executions",
        "exec/s",
        "cov",
        "features",
        "corpus",
        "crashes",
    ]
    assert table.splitlines()[2].split() == ["sse", "2", "100", "50", "150", "300", "20", "0"]
    with pytest.raises(SystemExit):
        runner().main(["no_such_target", "--work", str(tmp_path)])
    assert "no harness for no_such_target" in capsys.readouterr().err


# -- what the fuzzers found ---------------------------------------------------------


def _stream(*chunks: Any) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _entry(kind: str, body: bytes) -> Entry:
    return Entry.build(
        status=200,
        headers=[("content-type", "application/json")],
        body=body,
        kind=kind,
        ttl=60,
        swr=0,
        sie=0,
        delta=0,
        region="r1",
        now=1000.0,
    )


CHUNK = "chat.completion.chunk"
MALFORMED_STREAMS = {
    "delta a string": [{"object": CHUNK, "choices": [{"index": 0, "delta": "x"}]}],
    "index an object": [{"object": CHUNK, "choices": [{"index": {}, "delta": {}}]}],
    "indexes of two types": [
        {"object": CHUNK, "choices": [{"index": "a", "delta": {}}, {"index": 0, "delta": {}}]}
    ],
    "choices a number": [{"object": CHUNK, "choices": 5}],
    "tool_calls a string": [
        {"object": CHUNK, "choices": [{"index": 0, "delta": {"tool_calls": "ab"}}]}
    ],
    "tool call a number": [{"object": CHUNK, "choices": [{"delta": {"tool_calls": [1]}}]}],
    "tool call index a list": [
        {"object": CHUNK, "choices": [{"delta": {"tool_calls": [{"index": [0]}]}}]}
    ],
    "function a list": [
        {"object": CHUNK, "choices": [{"delta": {"tool_calls": [{"function": [1]}]}}]}
    ],
    "function name a number": [
        {"object": CHUNK, "choices": [{"delta": {"tool_calls": [{"function": {"name": 7}}]}}]}
    ],
    "text index a list": [{"object": "text_completion", "choices": [{"index": [], "text": "a"}]}],
}


@pytest.mark.parametrize("chunks", MALFORMED_STREAMS.values(), ids=MALFORMED_STREAMS.keys())
def test_a_malformed_cached_stream_is_a_miss_for_json(chunks: list[Any]) -> None:
    # An upstream's stream, cached, then asked for as JSON: assembling it raised
    # (AttributeError, TypeError) instead of giving up.
    body = _stream(*chunks)
    assert CHAT.assemble(SSEReader().feed(body)) is None
    entry = _entry("sse", body)
    assert replay_parts(entry, wants_sse=False, include_usage=False, dialect=CHAT) is None
    replayed = replay_parts(entry, wants_sse=True, include_usage=True, dialect=CHAT)
    assert replayed is not None and b"".join(replayed[0]) == body


MALFORMED_COMPLETIONS = {
    "message a list": {"object": "chat.completion", "choices": [{"index": 0, "message": [1]}]},
    "tool_calls a string": {
        "object": "chat.completion",
        "choices": [{"message": {"tool_calls": "ab"}}],
    },
    "tool call a number": {
        "object": "chat.completion",
        "choices": [{"message": {"tool_calls": [1]}}],
    },
    "choices a number": {"object": "text_completion", "choices": 3},
}


@pytest.mark.parametrize("answer", MALFORMED_COMPLETIONS.values(), ids=MALFORMED_COMPLETIONS.keys())
def test_a_malformed_cached_completion_is_sent_as_it_is_to_a_stream(answer: Any) -> None:
    assert CHAT.stream_of(answer, include_usage=True) is None
    body = orjson.dumps(answer)
    assert replay_parts(_entry("json", body), wants_sse=True, include_usage=True, dialect=CHAT) == (
        [body],
        False,
    )


REGIONS = [{"name": "eu", "url": "http://eu.test"}]


@pytest.mark.parametrize(
    ("data", "environ"),
    [
        # EDGEPROXY_REGIONS__A made "regions" a table; the next override iterated its keys.
        ({}, {"EDGEPROXY_REGIONS__A": "1", "EDGEPROXY_REGIONS__B__URL": '"http://y"'}),
        ({"regions": [1, "a"]}, {"EDGEPROXY_REGIONS__A__URL": "1"}),
        ({"regions": [1]}, {"EDGEPROXY_REGIONS__0__URL": "1"}),
        ({"regions": {"x": 1}}, {"EDGEPROXY_REGIONS__X__URL": "1"}),
        ({"regions": "eu"}, {"EDGEPROXY_REGIONS__0__URL": "1"}),
    ],
)
def test_region_overrides_of_regions_that_are_not_tables(
    data: dict[str, Any], environ: dict[str, str]
) -> None:
    with pytest.raises(ConfigError) as caught:
        Config.from_mapping(data, environ=environ)
    assert any(line.startswith("regions") for line in caught.value.errors)


@pytest.mark.parametrize("index", ["²", "1" * 5000, "9" * 12])
def test_region_override_indexes_that_int_refuses(index: str) -> None:
    # int("²") and int() of 5000 digits raise ValueError; neither is a region's index.
    environ = {f"EDGEPROXY_REGIONS__{index}__URL": '"http://elsewhere"'}
    config = Config.from_mapping({"regions": REGIONS}, environ=environ)
    assert [r.url for r in config.regions] == ["http://eu.test"]


@pytest.mark.parametrize("value", ["9" * 5000, "[" * 3000])
def test_env_values_past_tomllib_limits_are_strings(value: str) -> None:
    # tomllib raised ValueError (over 4300 digits) or RecursionError, not TOMLDecodeError.
    environ = {"EDGEPROXY_LIMITS__MAX_BODY_SIZE": value}
    with pytest.raises(ConfigError) as caught:
        Config.from_mapping({"regions": REGIONS}, environ=environ)
    assert caught.value.errors[0].startswith(
        "limits.max_body_size (from the environment variable EDGEPROXY_LIMITS__MAX_BODY_SIZE): "
    )


@pytest.mark.parametrize("text", ["a = " + "1" * 5000, "a = " + "[" * 3000])
def test_config_files_past_tomllib_limits_are_config_errors(tmp_path: Path, text: str) -> None:
    path = tmp_path / "edgeproxy.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="TOML not readable"):
        load_config(path, environ={})
