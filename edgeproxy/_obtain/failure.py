"""Why no region answered a request, as a value: :class:`Failure`, of a :class:`FailureKind`.

A failure owns the attempts still running past the deadline (``deadline_action =
"race"``), as a :class:`Pending`; whoever holds the failure closes it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from edgeproxy._core.errors import ProxyError
from edgeproxy._obtain.attempt import AttemptResponse

__all__ = ["DeadlineExceeded", "Failure", "FailureKind", "Pending", "no_region"]


class Pending(Protocol):
    """Attempts still running past the deadline, kept for the fallback to race
    (:class:`edgeproxy._obtain.failover.PendingUpstream`)."""

    async def ready(self) -> bool: ...

    def take(self) -> AttemptResponse: ...

    async def aclose(self) -> None: ...


class DeadlineExceeded(ProxyError):
    """504 ``deadline_exceeded``: no first byte by the route's deadline."""

    def __init__(self, deadline: float, *, headers: dict[str, str]) -> None:
        super().__init__(
            504,
            "upstream_timeout",
            f"no region answered within the route's deadline of {deadline:g}s",
            code="deadline_exceeded",
            headers=headers,
        )


def no_region() -> ProxyError:
    """The 503 of a request no region may serve."""
    return ProxyError(503, "no_region", "no region may serve this request", code="no_region")


class FailureKind(enum.Enum):
    """Why no region answered a request, which decides what may still answer it."""

    NO_REGION = "no_region"
    """No region may serve it (none configured for it, or none left to try)."""
    OVERLOADED = "overloaded"
    """Admission shed it, or every region it may use is at its concurrency limit."""
    DEADLINE = "deadline"
    """No first byte by the route's deadline."""
    UPSTREAM = "upstream"
    """Every attempt failed: a transport error, or a status the route retries."""
    MODEL_UNKNOWN = "model_unknown"
    """No region serves the request's model (404): only the local model may answer."""
    RESIDENCY = "residency"
    """A residency rule allows no available region: refused, never degraded."""
    BAD_REQUEST = "bad_request"
    """The request cannot be routed as sent (a model that is not a name): never degraded."""
    OWNER_UNAVAILABLE = "owner_unavailable"
    """The one region holding the request's state is unavailable: 503, never another
    region (it would answer 404), never degraded."""
    REJECTED = "rejected"
    """Two regions answered this request's body with 5xx (a poison request, see
    :mod:`edgeproxy._admission.poison`): 502, never tried further, never degraded."""


@dataclass(slots=True, eq=False)
class Failure:
    """A request the regions could not answer: its kind, the error it gets if nothing else
    answers, and the attempts still running past the deadline (``deadline_action =
    "race"``), which this value owns: :meth:`aclose` cancels them, and its holder calls it
    on every way out (it is idempotent).

    It also says what was tried, for the obtain path to record on the request
    (:func:`edgeproxy._obtain.record`): the ``attempts`` sent, the ``region`` the latest
    of them went to (None when none was sent), and whether a hedge was (``hedged``).
    """

    kind: FailureKind
    error: ProxyError
    pending: Pending | None = None
    attempts: int = field(default=0, kw_only=True)
    region: str | None = field(default=None, kw_only=True)
    hedged: bool = field(default=False, kw_only=True)

    def with_error(self, error: ProxyError) -> Failure:
        """The same failure (what was tried) answered with ``error`` instead; it holds
        no pending attempts (those stay this value's to close)."""
        return Failure(
            self.kind, error, attempts=self.attempts, region=self.region, hedged=self.hedged
        )

    @property
    def status(self) -> int:
        """The status of :attr:`error`."""
        return self.error.status

    def __repr__(self) -> str:
        return f"Failure({self.kind.name}, {self.error.status} {self.error.code})"

    async def aclose(self) -> None:
        """Cancel the attempts still running, if any; idempotent."""
        pending, self.pending = self.pending, None
        if pending is not None:
            await pending.aclose()
