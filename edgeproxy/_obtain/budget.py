"""Extra work a proxy allows itself over a sliding window: the retry and hedge budgets."""

from __future__ import annotations

import time

__all__ = ["Budget"]


class Budget:
    """Extra work allowed over a sliding window: ``ratio`` of requests, plus ``min_per_s``.

    Counted in ten buckets across the window, so old traffic stops counting
    smoothly rather than all at once.
    """

    __slots__ = ("ratio", "reserve", "slot", "_requests", "_spent", "_epoch")

    def __init__(self, ratio: float, min_per_s: float, window: float) -> None:
        self.ratio = ratio
        self.reserve = min_per_s * window
        self.slot = window / 10
        self._requests = [0] * 10
        self._spent = [0] * 10
        self._epoch = 0

    def _advance(self, now: float) -> int:
        epoch = int(now / self.slot)
        if epoch != self._epoch:
            for e in range(max(self._epoch + 1, epoch - 9), epoch + 1):
                self._requests[e % 10] = 0
                self._spent[e % 10] = 0
            self._epoch = epoch
        return epoch % 10

    def deposit(self, now: float | None = None) -> None:
        """Count one request."""
        if now is None:
            now = time.monotonic()
        epoch = int(now / self.slot)
        # _advance() only when a bucket ends: most requests land in the current one.
        self._requests[(epoch if epoch == self._epoch else self._advance(now)) % 10] += 1

    def available(self, now: float | None = None) -> float:
        self._advance(time.monotonic() if now is None else now)
        return self.reserve + self.ratio * sum(self._requests) - sum(self._spent)

    def try_spend(self, now: float | None = None) -> bool:
        """Take one unit of extra work if the budget allows it."""
        now = time.monotonic() if now is None else now
        if self.available(now) < 1:
            return False
        self._spent[self._advance(now)] += 1
        return True
