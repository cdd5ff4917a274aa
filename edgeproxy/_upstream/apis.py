"""The APIs each region speaks, configured or learnt on first use.

``[[regions]] apis`` lists them (``chat``, ``completions``, ``embeddings``, ``moderations``,
``responses``, ``messages``); unset, they are unknown, and the region is sent every API
until it shows it lacks one: a ``404`` or ``405`` to a Messages or Responses request whose
chat completion translation it then answers (the proof that it speaks chat completions but
not the API). The request that found it out is that very translation, sent again within
the same attempt (:class:`~edgeproxy._obtain.forward.UpstreamStage`), so learning costs the
client nothing; the region's requests of that API are translated from then on
(:mod:`edgeproxy._protocol.translate`). A region whose chat completions 404 too keeps its
404 (a model it does not serve, say), and learns nothing.

Routing reads :attr:`SpokenApis.lacking` only when the set's :class:`ApiBook` says some
region lacks an API: every request's path pays one attribute check, no more.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from edgeproxy._protocol.endpoints import ENDPOINTS
from edgeproxy._protocol.translate import API_ENDPOINTS, CHAT, TRANSLATED

__all__ = ["NATIVE", "TRANSLATED_TIER", "UNSERVED", "ApiBook", "SpokenApis"]

NATIVE = 0
"""A region that speaks the request's API (or may: not known yet)."""
TRANSLATED_TIER = 1
"""A region that speaks chat completions only: the request is translated."""
UNSERVED = 2
"""A region that cannot answer the request: it lacks its API, and it cannot be translated
(a stateful Responses request, an API other than Messages and Responses)."""


class ApiBook:
    """What routing asks first of a set of regions: whether any lacks an API."""

    __slots__ = ("partial",)

    def __init__(self) -> None:
        self.partial = False

    @classmethod
    def of(cls, regions: Iterable[Any]) -> ApiBook:
        """One book for ``regions`` (each with its :class:`SpokenApis` as ``apis``)."""
        book = cls()
        for region in regions:
            apis: SpokenApis = region.apis
            apis.book = book
            book.partial = book.partial or bool(apis.lacking)
        return book


class SpokenApis:
    """One region's APIs: those configured, or what was learnt (endpoint names, as in the
    endpoint table), and how many of its requests were translated."""

    __slots__ = ("configured", "lacking", "learnt", "book", "translated")

    def __init__(self, configured: Iterable[str] | None, book: ApiBook | None = None) -> None:
        self.book = ApiBook() if book is None else book
        self.configured = None if configured is None else tuple(configured)
        self.lacking: frozenset[str] = frozenset()
        """The endpoints the region does not speak: its requests are translated, or it
        is no candidate for them."""
        if self.configured is not None:
            spoken = {name for api in self.configured for name in API_ENDPOINTS[api]}
            self.lacking = frozenset(e.name for e in ENDPOINTS if e.name not in spoken)
            self.book.partial = self.book.partial or bool(self.lacking)
        self.learnt: dict[str, int] = {}  # endpoint -> the status that showed it lacking
        self.translated: Counter[str] = Counter()

    @property
    def learns(self) -> bool:
        """Whether a 404 or 405 may teach it something: no ``apis`` configured."""
        return self.configured is None

    def translates(self, name: str) -> bool:
        """Whether a request of the endpoint ``name`` is translated for this region."""
        return name in self.lacking and name in TRANSLATED and CHAT not in self.lacking

    def tier(self, name: str | None, stateful: bool) -> int:
        """How well the region answers a request of ``name``: :data:`NATIVE`,
        :data:`TRANSLATED_TIER`, or :data:`UNSERVED` (``stateful``: it needs stored state,
        which a translation cannot have)."""
        if name is None or name not in self.lacking:
            return NATIVE
        return TRANSLATED_TIER if self.translates(name) and not stateful else UNSERVED

    def learn(self, name: str, status: int) -> None:
        """The region answered ``status`` (404, 405) to ``name`` and speaks chat completions:
        ``name`` is translated from now on (a Messages request's token count with it)."""
        names = {name}
        if name == "messages":
            names.add("messages.count_tokens")
        for each in names:
            self.learnt.setdefault(each, status)
        self.lacking = self.lacking | names
        self.book.partial = True

    def snapshot(self) -> dict[str, Any]:
        """The ``apis`` member of a region in ``/status``."""
        return {
            "configured": list(self.configured) if self.configured is not None else None,
            "lacking": sorted(self.lacking),
            "translated": sorted(name for name in self.lacking if self.translates(name)),
            "learnt": dict(self.learnt),
            "translated_total": dict(self.translated),
        }
