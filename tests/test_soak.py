"""The soak bench's short form: a minute of mixed load with faults, and no leak.

``bench/soak.py`` runs ``edgeproxy serve`` in front of three fake regions and
its own Redis, pauses Redis, kills and restarts a region, and fails (exit 1)
if RSS or open fds grew by more than 10%, if anything is still in flight once
the load stopped, or if a request was lost before its first byte. The full run
is ``bench/soak.py --minutes 8`` or longer; see ``bench/README.md``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOAK = ROOT / "bench" / "soak.py"


@pytest.mark.soak
@pytest.mark.timeout(420)
def test_one_minute_soak_leaks_nothing(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("the soak starts its own redis-server, and none is installed")
    argv = [sys.executable, str(SOAK), "--minutes", "1", "--sample", "10", "--rate", "40"]
    out = subprocess.run(
        [*argv, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=360,
    )
    report = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0, report

    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["passed"], report
    requests = data["requests"]
    assert requests["lost"] == 0
    assert requests["sent"] == requests["answered"] > 0
    assert requests["disconnected_on_purpose"] > 0  # the client did drop streams
    events = " ".join(e["event"] for e in data["events"])
    assert "redis paused" in events and "redis resumed" in events
    assert "killed" in events and "restarted" in events
