"""The base of every config section: unknown keys are errors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Section"]


class Section(BaseModel):
    """A config table. Unknown keys are errors: a typo like ``prot = 8080`` must not be ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
