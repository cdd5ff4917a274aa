"""The model catalog: which regions serve a request's model.

``[[regions]] models`` lists the models a region serves (exact names or
``fnmatch`` globs); a region that lists none learns them from its own
``GET /v1/models`` (``learn_models``, :mod:`edgeproxy._upstream.catalog`), and
serves every model until its list is known, or always with ``learn_models =
false``. ``model_aliases`` maps a client's model name to the region's own. A region
that answers any model name (``serves_any_model``, or recognised from its list: llama.cpp's
servers) serves, besides the names it lists, every name no region lists.
:class:`ModelCatalog` answers, for the router, which regions serve the model a
request names; the answer is cached per model name until a learnt list changes.
The proxy's own ``GET /v1/models`` is :mod:`edgeproxy._obtain.modellist`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from edgeproxy._core.context import RequestContext
from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.endpoints import endpoint_has
from edgeproxy._protocol.modelnames import (
    ModelMatcher,
    model_from_body,
)
from edgeproxy._upstream.catalog import few_names

if TYPE_CHECKING:
    from edgeproxy._core.config import RegionConfig
    from edgeproxy._upstream.catalog import ModelLearner

__all__ = ["MODELS_PATH", "ModelCatalog", "ModelError", "model_not_found"]

logger = logging.getLogger("edgeproxy")

# Model names remembered by the catalog; past this many (clients naming models at random)
# the memory starts over.
_CACHE_SIZE = 1024
# A model name echoed in an error message is cut to this length.
_ECHO_LIMIT = 256
MODELS_PATH = "/v1/models"


class ModelError(ProxyError):
    """A request's model cannot be served: 404 ``model_not_found``, or 400 when it is not a
    name. Only the 404 may go down the degradation ladder, and only to the local model."""


def model_not_found(model: str, served: Sequence[str] = ()) -> ModelError:
    """OpenAI's 404 for a model no region serves; ``served``: the names the regions do
    serve, the first few of which it names, with the key that maps a name to one."""
    shown = model if len(model) <= _ECHO_LIMIT else model[:_ECHO_LIMIT] + "..."
    # OpenAI's sentence first, as clients may match it; then what a client could name
    # instead, and how an operator makes this name one of them.
    message = f"The model `{shown}` does not exist or you do not have access to it."
    if served:
        message += (
            f" The models served here are {few_names(served)}; an operator can map "
            "another name to one of them with the region's model_aliases."
        )
    return ModelError(
        404,
        "invalid_request_error",
        message,
        code="model_not_found",
        param="model",
    )


class ModelCatalog:
    """Which regions serve a model, from ``[[regions]] models`` and ``model_aliases``, and
    for the regions that learn their models, from what their own ``/v1/models`` said
    (``learner``, :class:`~edgeproxy._upstream.catalog.ModelLearner`).

    ``active``: some region lists models or aliases, or learns its models, so the router
    looks up each LLM request's model (and sets ``ctx.model``); ``restricts``: some region
    lists or learns models, so a model may be served by only some regions, or by none
    (404). A learning region whose list is not known yet serves every model: a model is
    served by none only once every such list is known.

    A region that answers any model name (``serves_any_model = true``, or, unset, a server
    its learnt list shows to be one: :func:`~edgeproxy._upstream.catalog.answers_any_name`)
    serves the names it lists as any region does, and the names no region lists besides:
    a name some region lists goes to the regions listing it, never to one that would answer
    it with another model.
    """

    def __init__(self, regions: list[RegionConfig], learner: ModelLearner | None = None) -> None:
        learned = {r.name: r.learned for r in learner.regions} if learner is not None else {}
        # Per region: its name, a matcher of its models (None: every model, or what it
        # learns), its aliases, what it learnt of its models (None: it does not learn),
        # serves_any_model (None: as its learnt list shows).
        self._regions = tuple(
            (
                r.name,
                ModelMatcher(r.models) if r.models else None,
                frozenset(r.model_aliases),
                learned.get(r.name),
                r.serves_any_model,
            )
            for r in regions
        )
        for r in regions:
            if r.serves_any_model:
                logger.info(
                    "region %s serves any model name (serves_any_model): it is sent the names "
                    "no region lists",
                    r.name,
                )
        self._learner = learner if learned else None
        self.restricts = any(r.models for r in regions) or bool(learned)
        self.active = self.restricts or any(r.model_aliases for r in regions)
        # Nothing configured, only learnt: until a list is learnt, there is nothing to ask.
        self._learnt_only = not any(r.models or r.model_aliases for r in regions)
        # Model name -> the names of the regions serving it; None when every region does.
        # Forgotten whenever a learnt list changes (the learner's version).
        self._served: dict[str, frozenset[str] | None] = {}
        self._version = 0
        # The names the regions serve, for a 404's message: (learner version, names).
        self._names: tuple[int, tuple[str, ...]] | None = None
        self._configured = frozenset(
            name for r in regions for name in (*r.models, *r.model_aliases)
        )

    def serving(self, model: str) -> frozenset[str] | None:
        """The names of the regions that serve ``model`` (maybe none); None: every region."""
        learner = self._learner
        if learner is not None and learner.version != self._version:
            self._served.clear()
            self._version = learner.version
        try:
            return self._served[model]
        except KeyError:
            pass
        # Those that list the name, those that serve every model (no list, or none known
        # yet), and those that answer any name, the last only for names no region lists.
        listing: list[str] = []
        every: list[str] = []
        any_name: list[str] = []
        for name, matcher, aliases, learned, any_model in self._regions:
            if model in aliases:
                listing.append(name)
            elif matcher is not None:
                if matcher.matches(model):
                    listing.append(name)
                elif any_model:
                    any_name.append(name)
            elif learned is None or not learned.known:
                every.append(name)
            elif model in learned.models:
                listing.append(name)
            elif any_model or (any_model is None and learned.any_name is not None):
                any_name.append(name)
        names = frozenset((*listing, *every) if listing else (*every, *any_name))
        served = None if len(names) == len(self._regions) else names
        if len(self._served) >= _CACHE_SIZE:
            self._served.clear()
        self._served[model] = served
        return served

    def lookup(self, ctx: RequestContext) -> frozenset[str] | None:
        """The regions that may serve this request by its model; None: any region.

        Only POSTs to the LLM endpoints with JSON bodies, and Realtime sessions (by their
        facts), name a model; one with
        no ``model`` may go to any region (it answers as it would). Sets
        ``ctx.model``. Raises :class:`ModelError`: 400 when ``model`` is not a
        string, 404 ``model_not_found`` when no region serves it.
        """
        if self._learnt_only and (self._learner is None or not self._learner.version):
            return None
        if ctx.method == "POST" and endpoint_has(ctx.path, "json_body"):
            model = model_from_body(ctx.json)
        elif ctx.facts is not None and endpoint_has(ctx.path, "websocket"):
            # A Realtime session's model: its handshake's query, or its first session.update.
            model = ctx.facts.model
        else:
            return None
        if model is None:
            return None
        if not isinstance(model, str):
            raise ModelError(
                400,
                "invalid_request_error",
                "Invalid type for 'model': expected a string.",
                code="invalid_type",
                param="model",
            )
        ctx.model = model
        if not self.restricts:
            return None
        served = self.serving(model)
        if served is not None and not served:
            raise model_not_found(model, self.served_names())
        return served

    def served_names(self) -> tuple[str, ...]:
        """The names the regions serve, sorted: their ``models`` (globs as written), their
        aliases' names and their learnt lists; remembered until a learnt list changes."""
        version = self._learner.version if self._learner is not None else 0
        if self._names is not None and self._names[0] == version:
            return self._names[1]
        found = set(self._configured)
        for _, matcher, _, learned, _ in self._regions:
            if matcher is None and learned is not None and learned.known:
                found.update(learned.models)
        names = tuple(sorted(found))
        self._names = (version, names)
        return names
