"""Reading a pyinstrument session of the proxy under load: where does edgeproxy's time go?

pyinstrument samples the main thread's stack every millisecond, and under
saturation the event loop is never idle, so a frame's share of the samples is
its share of the CPU. Three views are pulled out of the call tree:

* edgeproxy functions by inclusive time (a function counted once even when it
  recurses or appears under several parents),
* edgeproxy functions by self time (the Python in the function body itself),
* the library calls edgeproxy makes (edgeproxy caller -> first non-edgeproxy
  callee), which is where "the cost of a feature" usually hides: a header
  copy that walks a multidict, a fresh response object per request, and so on,
* every function by self time, libraries included (hpack's encoder, aiohttp's
  header writer): what a change would have to remove calls to.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_PACKAGE_MARK = "/edgeproxy/"


@dataclass
class Hotspot:
    where: str  # file:function, shortened to the package-relative path
    share: float  # fraction of all samples
    self_share: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ProfileSummary:
    total_s: float
    edgeproxy_self_share: float
    edgeproxy_inclusive_share: float
    inclusive: list[Hotspot]
    self_time: list[Hotspot]
    library_calls: list[Hotspot]
    flat_self: list[Hotspot]
    text_report: str

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("text_report")
        return data


# Process entry frames (``python -m edgeproxy`` -> main -> asyncio.Runner) sit at
# the bottom of every sample; counting them as "edgeproxy's time" would make
# every profile read 100%.
_ENTRY_FILES = ("edgeproxy/__main__.py", "edgeproxy/_cli.py")


def _is_ours(frame: Any) -> bool:
    path = frame.file_path
    if not path or _PACKAGE_MARK not in path or "site-packages" in path:
        return False
    # The fake region lives in edgeproxy/testing but is not the proxy's own cost.
    if "/edgeproxy/testing/" in path or path.endswith(_ENTRY_FILES):
        return False
    return bool(frame.function != "<module>")


def _short(path: str | None) -> str:
    if not path:
        return "?"
    if _PACKAGE_MARK in path:
        return "edgeproxy/" + path.rsplit(_PACKAGE_MARK, 1)[1]
    for marker in ("site-packages/", "/lib/python"):
        if marker in path:
            return path.rsplit(marker, 1)[1].lstrip("/")
    return path


def _label(frame: Any) -> str:
    cls = f"{frame.class_name}." if getattr(frame, "class_name", None) else ""
    return f"{_short(frame.file_path)}:{cls}{frame.function}"


def summarize(session_path: Path, *, top: int = 12) -> ProfileSummary:
    """Aggregate a ``.pyisession`` file; raises ImportError without pyinstrument."""
    from pyinstrument.renderers import ConsoleRenderer
    from pyinstrument.session import Session

    session = Session.load(str(session_path))
    root = session.root_frame()
    if root is None:
        return ProfileSummary(0.0, 0.0, 0.0, [], [], [], [], "(no samples)\n")
    total = root.time or 1e-9

    inclusive: dict[str, float] = defaultdict(float)
    self_time: dict[str, float] = defaultdict(float)
    calls: dict[str, float] = defaultdict(float)
    flat: dict[str, float] = defaultdict(float)
    ours_inclusive = 0.0

    # Iterative walk: deep asyncio stacks would hit the recursion limit otherwise.
    # Each entry carries the labels of the edgeproxy frames above it, so a
    # function that recurses (or is re-entered through a library callback) is
    # counted once in the inclusive view.
    stack: list[tuple[Any, frozenset[str]]] = [(root, frozenset())]
    while stack:
        frame, ours_above = stack.pop()
        label = _label(frame)
        ours = _is_ours(frame)
        below = ours_above
        if not frame.is_synthetic:
            flat[label] += frame.total_self_time
        if ours:
            self_time[label] += frame.total_self_time
            if label not in ours_above:
                inclusive[label] += frame.time
            if not ours_above:
                ours_inclusive += frame.time
            below = ours_above | {label}
        for child in frame.children:
            if child.is_synthetic:
                continue
            if ours and not _is_ours(child):
                # The first library frame below edgeproxy code: the price of a call it makes.
                calls[f"{label} -> {_label(child)}"] += child.time
            stack.append((child, below))

    text = ConsoleRenderer(unicode=False, color=False, time="percent_of_total").render(session)

    def ranked(table: dict[str, float], key_self: dict[str, float] | None = None) -> list[Hotspot]:
        rows = sorted(table.items(), key=lambda kv: kv[1], reverse=True)[:top]
        return [
            Hotspot(where, round(t / total, 4), round((key_self or {}).get(where, 0.0) / total, 4))
            for where, t in rows
        ]

    return ProfileSummary(
        total_s=round(total, 3),
        edgeproxy_self_share=round(sum(self_time.values()) / total, 4),
        edgeproxy_inclusive_share=round(ours_inclusive / total, 4),
        inclusive=ranked(inclusive, self_time),
        self_time=ranked(self_time, self_time),
        library_calls=ranked(calls),
        flat_self=ranked(flat, flat),
        text_report=text,
    )
