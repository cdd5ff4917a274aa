"""What the test kit's servers share: ``async with`` starts one and stops it."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["Served"]


class Served:
    """A server started by :meth:`start` and stopped by :meth:`stop`, or by ``async with``."""

    __slots__ = ()

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
