"""What the hook specifications name of the proxy and of a region, as Protocols.

The hooks are specified below the layers that define :class:`~edgeproxy.EdgeProxy` and
``Region``; typing their arguments with these lets the specifications import nothing
from above, while plugins annotated with the concrete classes still check.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from edgeproxy._core.config import Config, RegionConfig

__all__ = ["ProxyView", "RegionView"]


class RegionView(Protocol):
    """A region as a hook sees it: its name and its ``[[regions]]`` table."""

    @property
    def name(self) -> str:
        """The region's name, as the config gives it."""
        ...

    @property
    def config(self) -> RegionConfig:
        """The region's ``[[regions]]`` table."""
        ...


class ProxyView(Protocol):
    """The proxy as ``edgeproxy_startup`` and ``edgeproxy_shutdown`` see it."""

    @property
    def config(self) -> Config:
        """The config the proxy serves."""
        ...

    @property
    def regions(self) -> Iterable[RegionView]:
        """The regions of that config, open while the proxy is."""
        ...
