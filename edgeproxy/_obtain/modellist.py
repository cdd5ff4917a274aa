"""The proxy's own ``GET /v1/models`` (and ``GET /v1/models/{id}``), once any region lists
models or aliases: the configured names, merged with the learnt lists, or those fetched
from the regions that list none and whose list is not known (through the failover path).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import orjson
from multidict import CIMultiDict

from edgeproxy._core.config.models import is_model_glob
from edgeproxy._core.context import RequestContext
from edgeproxy._core.errors import ProxyError
from edgeproxy._core.response import Response
from edgeproxy._obtain.failover import Failover, Failure
from edgeproxy._plugins import PluginError
from edgeproxy._protocol.headers import request_id, trace_context
from edgeproxy._protocol.modelnames import ModelListError, parse_model_list
from edgeproxy._routing.modelcatalog import MODELS_PATH, model_not_found
from edgeproxy._upstream.catalog import NoModelList, read_model_list
from edgeproxy._upstream.pool import UpstreamError

if TYPE_CHECKING:
    from edgeproxy._core.config import Config
    from edgeproxy._upstream.regions import Region, RegionSet

__all__ = ["ModelList"]

logger = logging.getLogger("edgeproxy")


class ModelList:
    """The proxy's answer to ``GET /v1/models``, once a region lists models or aliases.

    The list is the union of the available regions' models (every region's
    when none is available): the concrete names a region lists (globs are not
    model ids) and its alias names, plus the concrete names ``[local_model]
    models`` lists. A region that lists no models is asked for its own
    ``/v1/models`` through the failover path, bounded by ``[routing]
    models_fetch_timeout``; what it answered is reused for ``models_cache_ttl``
    seconds, and kept for when it cannot answer: a region that is down never
    makes the list an error. Each entry names the regions that serve it in an
    ``edgeproxy`` member.
    """

    def __init__(self, config: Config, regions: RegionSet, failover: Failover) -> None:
        self.config = config
        self.regions = regions
        self.failover = failover
        local = config.local_model
        self._local = [m for m in local.models if not is_model_glob(m)] if local.path else []
        self.active = any(r.models or r.model_aliases for r in config.regions) or bool(
            local.path and local.models
        )
        # The concrete names of the regions that list models; the others are fetched.
        self._listed = {
            r.name: [m for m in r.models if not is_model_glob(m)]
            for r in config.regions
            if r.models
        }
        self.timeout = config.routing.models_fetch_timeout
        self.ttl = config.routing.models_cache_ttl
        self.created = int(time.time())
        # The last list each region with no models configured answered, and until when
        # the last round of fetches is fresh.
        self._fetched: dict[str, list[dict[str, Any]]] = {}
        self._fresh_until = 0.0
        self._lock = asyncio.Lock()

    def answers(self, ctx: RequestContext) -> bool:
        """Whether this request is a ``GET`` (or ``HEAD``) of ``/v1/models`` or one model
        (asked only when ``active``)."""
        if ctx.method not in ("GET", "HEAD"):
            return False
        _, found, rest = ctx.path.partition(MODELS_PATH)
        return bool(found) and (not rest or rest[0] == "/")

    async def respond(self, ctx: RequestContext) -> Response:
        """The list in OpenAI's shape, or one model; 404 ``model_not_found`` for an unknown id."""
        _, _, rest = ctx.path.partition(MODELS_PATH)
        data = await self.models()
        wanted = unquote(rest[1:]) if len(rest) > 1 else None
        body: dict[str, Any] | None
        if wanted is None:
            body = {"object": "list", "data": data}
        else:
            body = next((entry for entry in data if entry["id"] == wanted), None)
            if body is None:
                raise model_not_found(wanted, [entry["id"] for entry in data])
        return Response(body=orjson.dumps(body), content_type="application/json")

    async def models(self) -> list[dict[str, Any]]:
        """The merged list, sorted by id; fetches from the regions listing none when stale."""
        now = self.regions.clock()
        health = self.regions.health
        every = self.regions.regions
        up = [r for r in every if health.available(r, now)]
        # A region whose own list the learner knows needs no fetch of it here.
        fetch = [r for r in up if r.name not in self._listed and not r.learned.known]
        if fetch and time.monotonic() >= self._fresh_until:
            async with self._lock:
                # Whoever waited for the lock finds the lists fresh.
                if time.monotonic() >= self._fresh_until:
                    await self._fetch(fetch)
                    self._fresh_until = time.monotonic() + self.ttl
        return self._merge(up or every)

    async def _fetch(self, regions: list[Region]) -> None:
        lists = await asyncio.gather(*(self._fetch_one(region) for region in regions))
        for region, models in zip(regions, lists, strict=True):
            if models is not None:
                self._fetched[region.name] = models

    async def _fetch_one(self, region: Region) -> list[dict[str, Any]] | None:
        """``region``'s own /v1/models list, or None when it did not give one in time."""
        ctx = RequestContext(
            request_id=request_id(None),
            trace=trace_context(None),
            method="GET",
            target=MODELS_PATH,
            headers=CIMultiDict({"accept": "application/json"}),
            client_ip=None,
            started=time.monotonic(),
            route=self.config.route_for("GET", MODELS_PATH),
            body_read=True,
        )
        try:
            async with asyncio.timeout(self.timeout):
                upstream = await self.failover.send(None, ctx, [region])
                if isinstance(upstream, Failure):
                    raise upstream.error  # nothing is left running (no keep_late)
                body = await read_model_list(upstream)
            return _parse_list(body)
        except (_NoList, NoModelList, ProxyError, UpstreamError, PluginError, TimeoutError) as exc:
            reason = "it timed out" if isinstance(exc, TimeoutError) else str(exc)
            logger.warning("GET /v1/models: region %s gave no list: %s", region.name, reason)
            return None

    def _merge(self, regions: list[Region]) -> list[dict[str, Any]]:
        entries: dict[str, dict[str, Any]] = {}

        def add(model: str, region: str | None, found: dict[str, Any] | None = None) -> None:
            entry = entries.get(model)
            if entry is None:
                entry = entries[model] = {
                    "id": model,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "edgeproxy",
                    "edgeproxy": {"regions": []},
                }
                if found is not None:
                    entry["created"] = found.get("created", self.created)
                    entry["owned_by"] = found.get("owned_by", "edgeproxy")
            if region is None:
                entry["edgeproxy"]["local_model"] = True
            elif region not in entry["edgeproxy"]["regions"]:
                entry["edgeproxy"]["regions"].append(region)

        for region in regions:
            listed = self._listed.get(region.name)
            if listed is not None:
                for model in listed:
                    add(model, region.name)
            elif region.learned.known:
                for found in region.learned.models.values():
                    add(found["id"], region.name, dict(found))
            else:
                for found in self._fetched.get(region.name, ()):
                    add(found["id"], region.name, found)
            for model in region.config.model_aliases:
                add(model, region.name)
        for model in self._local:
            add(model, None)
        return [entries[model] for model in sorted(entries)]


class _NoList(Exception):
    """A region's /v1/models answer that is not a list of models."""


def _parse_list(body: bytes) -> list[dict[str, Any]]:
    try:
        return parse_model_list(body)
    except ModelListError as exc:
        raise _NoList(str(exc)) from None
