"""The lag scenarios' short form: each runs for seconds, and only its invariants are checked.

``bench/scenarios.py --short`` runs every scenario through every variant (the direct
client, the plain proxy, edgeproxy with its defaults and with the checked-in config) and
writes ``scenarios.json``; timings are the full run's business, not a test's.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edgeproxy import load_config

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "scenarios.py"
CONFIGS = ROOT / "bench" / "scenarios"
# The plots need the bench extra's matplotlib; the test extra goes without.
PLOTS = importlib.util.find_spec("matplotlib") is not None
SCENARIOS = [
    "cross_region",
    "streaming",
    "cache",
    "storm",
    "saturation",
    "lighter",
    "backlog",
    "cold_start",
]


@pytest.mark.scenarios
@pytest.mark.timeout(300)
def test_every_scenario_accounts_for_every_request(tmp_path: Path) -> None:
    # The script bounds each scenario itself (--timeout); this bounds the process.
    argv = [sys.executable, str(SCRIPT), "--short", "--timeout", "60", "--out", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    outcomes: dict[str, dict[str, Any]] = {
        o["name"]: o["invariants"]
        for o in json.loads((tmp_path / "scenarios.json").read_text())["outcomes"]
    }
    assert sorted(outcomes) == sorted(SCENARIOS)
    for name, invariants in outcomes.items():
        assert invariants["requests"] == invariants["offered"], name
        if PLOTS:
            assert (tmp_path / f"scenario-{name}.png").stat().st_size > 0
        # The storm kills a region and the saturation sheds: their failures are what they count.
        if name not in ("storm", "saturation"):
            assert invariants["answered"] == invariants["requests"], name
    cache = outcomes["cache"]
    assert 0 < cache["calls_with_cache"] < cache["requests_per_variant"]
    assert "## Summary" in (tmp_path / "scenarios.md").read_text()


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_every_scenario_config_is_a_valid_edgeproxy_config(config: Path, tmp_path: Path) -> None:
    # The bench puts the listeners and regions in front of the checked-in text, as here.
    path = tmp_path / config.name
    path.write_text('[[regions]]\nname = "r"\nurl = "http://127.0.0.1:9"\n\n' + config.read_text())
    load_config(path, environ={})
