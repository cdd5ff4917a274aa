"""Kinds of value that several sections' keys share, each constraint declared once.

A key declares its kind as its type (``retry_budget: Share = Field(0.2, ...)``);
pydantic merges the kind's bounds into the key's own ``Field``, so the key keeps
its default and description, and a value out of bounds is refused with the key's
name as before. ``Positive`` and ``NonNegative`` let ``inf`` through (a time
without bound), as those keys always did; their ``Finite`` twins refuse it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

__all__ = [
    "Count",
    "CountOrZero",
    "FiniteNonNegative",
    "FinitePositive",
    "Name",
    "NonNegative",
    "Port",
    "Positive",
    "Share",
]

Share = Annotated[float, Field(ge=0, le=1)]
"""A share of a whole, from 0 (none) to 1 (all)."""

Positive = Annotated[float, Field(gt=0)]
"""More than zero, such as a timeout or an interval in seconds; ``inf`` passes."""

FinitePositive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""More than zero and finite, such as a timeout or an interval in seconds."""

NonNegative = Annotated[float, Field(ge=0)]
"""Zero or more, such as a rate or a wait in seconds; ``inf`` passes."""

FiniteNonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""Zero or more and finite, such as a rate, a weight or a wait in seconds."""

Count = Annotated[int, Field(ge=1)]
"""How many of something (entries, bytes, connections, seconds), at least one."""

CountOrZero = Annotated[int, Field(ge=0)]
"""How many of something, where zero is allowed (and often means none or no limit)."""

Port = Annotated[int, Field(ge=0, le=65535)]
"""A TCP port to listen on; 0 lets the system pick one."""

Name = Annotated[str, Field(min_length=1)]
"""A name that must not be empty."""
