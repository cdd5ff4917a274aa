"""Plain types shared by every layer: header lists, bodies, the trace context."""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass

__all__ = ["Body", "Headers", "TraceContext"]

Headers = list[tuple[str, str]]
Body = bytes | AsyncIterable[bytes] | None


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A W3C trace context for one hop: ``trace_id`` is kept, ``span_id`` is this proxy's."""

    trace_id: str
    span_id: str
    parent_id: str | None
    flags: str

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"
