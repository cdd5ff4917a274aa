"""Rate-limit headers in each API's own names, as its clients read them.

OpenAI's clients read ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, the reset
a duration in OpenAI's format (``1s``, ``6m0s``, ``20ms``); Anthropic's read
``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}``, the reset an RFC 3339
time. The proxy states its own limits in them (the levels after the request was charged,
or a 429's); where a region sent its own, the client sees the stricter of the two: per
unit, the set whose remaining is lower.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Final

from edgeproxy._core.outcome import LimitLevel
from edgeproxy._core.types import Headers

__all__ = ["duration", "limit_headers", "stricter"]

_UNITS: Final = ("requests", "tokens")


def duration(seconds: float) -> str:
    """``seconds`` in OpenAI's format: ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1.0:
        return f"{max(0, round(seconds * 1000))}ms"
    whole = round(seconds, 3)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{text}"
    if minutes:
        return f"{int(minutes)}m{text}"
    return text


def _names(unit: str, anthropic: bool) -> tuple[str, str, str]:
    if anthropic:
        base = f"anthropic-ratelimit-{unit}-"
        return base + "limit", base + "remaining", base + "reset"
    return (
        f"x-ratelimit-limit-{unit}",
        f"x-ratelimit-remaining-{unit}",
        f"x-ratelimit-reset-{unit}",
    )


def limit_headers(
    limits: dict[str, LimitLevel],
    *,
    anthropic: bool,
    wall: Callable[[], float] = time.time,
) -> Headers:
    """The headers stating ``limits`` in the API's names."""
    out: Headers = []
    for unit in _UNITS:
        level = limits.get(unit)
        if level is None:
            continue
        limit, remaining, reset = _names(unit, anthropic)
        if anthropic:
            at = datetime.datetime.fromtimestamp(wall() + level.reset, datetime.UTC)
            when = at.replace(microsecond=0).isoformat().replace("+00:00", "Z")
        else:
            when = duration(level.reset)
        out += [(limit, str(level.limit)), (remaining, str(level.remaining)), (reset, when)]
    return out


def _remaining(headers: Headers, name: str) -> int | None:
    for key, value in headers:
        if key.lower() == name:
            try:
                return int(float(value))
            except ValueError:
                return None
    return None


def stricter(region: Headers, ours: Headers, *, anthropic: bool) -> Headers:
    """A region's answer headers with the proxy's limits stated: per unit, the proxy's
    three headers replace the region's unless the region's remaining is lower."""
    out = list(region)
    for unit in _UNITS:
        names = _names(unit, anthropic)
        mine = [(k, v) for k, v in ours if k in names]
        if not mine:
            continue
        theirs = _remaining(region, names[1])
        own = _remaining(mine, names[1])
        if theirs is not None and own is not None and theirs < own:
            continue  # the region's limit is the stricter: its headers stand
        out = [(k, v) for k, v in out if k.lower() not in names]
        out += mine
    return out
