"""``edgeproxy serve`` with a pyinstrument profiler that signals switch on and off.

    python bench/_profiled_serve.py OUT.pyisession serve --config edge.toml

SIGUSR1 starts sampling, SIGUSR2 stops it and writes the session to OUT.
Profiling only the loaded window matters: wrapping the whole process (``python
-m pyinstrument -m edgeproxy ...``) mixes start-up imports and idle seconds into
the percentages, and under uvloop idle time is indistinguishable from the
loop's own native work (both show as ``Runner.run [self]``).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import FrameType


def main(argv: list[str]) -> int:
    from pyinstrument import Profiler

    out = Path(argv[0])
    # Sample raw stacks: "enabled" async mode would re-attribute time spent
    # awaiting to the awaiting coroutine, but this profile is about CPU.
    profiler = Profiler(interval=0.001, async_mode="disabled")

    def start(signum: int, frame: FrameType | None) -> None:
        if not profiler.is_running:
            profiler.start()

    def stop(signum: int, frame: FrameType | None) -> None:
        if profiler.is_running:
            session = profiler.stop()
            tmp = out.with_suffix(".partial")
            session.save(str(tmp))
            tmp.replace(out)  # the driver polls for OUT: it must appear complete

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)

    from edgeproxy._cli import main as edgeproxy_main

    return edgeproxy_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
