"""The models each region serves, learnt from the region's own ``GET /v1/models``.

A region that lists no ``models`` in its config (``[[regions]] learn_models``, on by
default for such a region) is asked for its ``/v1/models`` when the regions open, then
every ``models_refresh`` seconds by one background task of its own
(:class:`~edgeproxy._upstream.regiontasks.RegionTasks`), through its warm pools and with
its credentials, bounded by ``[routing] models_fetch_timeout``. Its answer, in OpenAI's
list shape (``{"data": [{"id": ...}, ...]}``, read by
:func:`~edgeproxy._protocol.modelnames.parse_model_list`; vLLM adds each model's
``max_model_len``, kept as its context window), becomes the region's
:class:`LearnedModels`, which the model catalog (:mod:`edgeproxy._routing.modelcatalog`) routes
by.

Some servers answer any model name with the one model they hold, whatever their list says;
:func:`answers_any_name` recognises them by their list (llama-cpp-python's server, which
lists ``owned_by: "me"`` and the model file's path as its id; llama.cpp's ``llama-server``
holding one model, ``owned_by: "llamacpp"``), and the catalog makes such a region a
candidate for the names no region lists (``[[regions]] serves_any_model`` decides instead
when set).

Until a region's list is known, it serves every model, as a region with no list does: a
region whose ``/v1/models`` never answers (a gateway without one, a region down since the
start) is routed to as before. A fetch that fails once the list is known (no answer in
time, a status other than 200, an answer that is not a list) keeps the last list: a
region that is down is health's business, not the catalog's. Each change of a known list
bumps :attr:`ModelLearner.version`, which tells the catalog to forget the answers it
remembered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from edgeproxy._protocol.modelnames import MAX_MODEL_LIST_BYTES, ModelListError, parse_model_list
from edgeproxy._upstream.endpoint import Endpoint, RegionEndpoints
from edgeproxy._upstream.pool import UpstreamError
from edgeproxy._upstream.regiontasks import RegionTasks

if TYPE_CHECKING:
    from edgeproxy._core.config import RegionConfig

__all__ = [
    "MODELS_PATH",
    "LearnedModels",
    "LearningRegion",
    "ModelLearner",
    "answers_any_name",
    "few_names",
]

logger = logging.getLogger("edgeproxy.regions")

MODELS_PATH = "/v1/models"
# A reason kept for /status is cut to this length.
_REASON_LIMIT = 200
# Names a log line or an error message shows before "and N more"; each cut to this length.
_FEW = 5
_NAME_LIMIT = 128


def few_names(names: Iterable[str], limit: int = _FEW) -> str:
    """```a`, `b` and 3 more``: the first ``limit`` of ``names``, in backquotes, each cut
    short; "none" for none. What a log line or an error shows of a list of models."""
    names = list(names)
    if not names:
        return "none"
    shown = [
        f"`{name}`" if len(name) <= _NAME_LIMIT else f"`{name[:_NAME_LIMIT]}...`"
        for name in names[:limit]
    ]
    more = len(names) - len(shown)
    if more:
        return f"{', '.join(shown)} and {more} more"
    if len(shown) == 1:
        return shown[0]
    return f"{', '.join(shown[:-1])} and {shown[-1]}"


def answers_any_name(entries: list[dict[str, Any]], body: bytes) -> str | None:
    """The server a ``/v1/models`` answer comes from, when that server answers any model
    name (with the one model it holds); None otherwise. ``entries``: the answer as
    :func:`~edgeproxy._protocol.modelnames.parse_model_list` read it; ``body``: its bytes.

    - llama-cpp-python's server lists each model it may load with ``owned_by: "me"`` (its
      id the model file's path unless given ``--model_alias``), and answers a name it does
      not list with its first model.
    - llama.cpp's ``llama-server`` lists its one model with ``owned_by: "llamacpp"`` and
      answers any name with it; in router mode (several models, each listed with a
      ``status``) it routes by the name, so it does not answer any name.
    """
    if not entries:
        return None
    owners = {entry.get("owned_by") for entry in entries}
    if owners == {"me"}:
        return "llama-cpp-python's server"
    if owners == {"llamacpp"} and len(entries) == 1 and not _router_mode(body):
        return "llama.cpp's llama-server"
    return None


def _router_mode(body: bytes) -> bool:
    """Whether a llama-server list comes from its router mode (its entries have a
    ``status``), read again from the bytes: the parsed entries keep no more than routing
    needs, and this is asked of one list a minute at most."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    data = value.get("data") if isinstance(value, dict) else None
    return isinstance(data, list) and any(
        isinstance(item, dict) and "status" in item for item in data
    )


class LearnedModels:
    """What one region's ``GET /v1/models`` said: the models it serves, each with what its
    entry told (``id``, and ``created``, ``owned_by``, ``max_model_len`` when given), and
    how the fetches went. ``known``: a list came; before, the region serves every model.
    ``any_name``: the server its list shows it to be, when that server answers any model
    name (:func:`answers_any_name`); None otherwise."""

    __slots__ = (
        "learns",
        "models",
        "known",
        "any_name",
        "stamp",
        "fetches_total",
        "failures_total",
        "changes_total",
        "last_error",
    )

    def __init__(self, learns: bool) -> None:
        self.learns = learns
        self.models: Mapping[str, Mapping[str, Any]] = {}
        self.known = False
        self.any_name: str | None = None
        self.stamp = 0.0
        self.fetches_total = 0
        self.failures_total = 0
        self.changes_total = 0
        self.last_error: str | None = None

    def serves(self, model: str) -> bool:
        """Whether the region serves ``model``, as far as is known (every model while its
        list is not)."""
        return not self.known or model in self.models

    def context_window(self, model: str) -> int | None:
        """The tokens ``model`` takes in all, prompt and answer, when the region said so
        (vLLM's ``max_model_len``); None when it did not, or the model is not listed."""
        entry = self.models.get(model)
        window = entry.get("max_model_len") if entry is not None else None
        return window if isinstance(window, int) else None

    def learned(
        self, entries: list[dict[str, Any]], now: float, any_name: str | None = None
    ) -> bool:
        """A list came at ``now`` (from a server answering any name when ``any_name``);
        True when it changed what is known."""
        models = {entry["id"]: entry for entry in entries}
        self.fetches_total += 1
        self.stamp = now
        self.last_error = None
        if self.known and models == self.models and any_name == self.any_name:
            return False
        self.models = models
        self.any_name = any_name
        self.known = True
        self.changes_total += 1
        return True

    def failed(self, reason: str) -> None:
        """A fetch gave no list: what was known stands."""
        self.fetches_total += 1
        self.failures_total += 1
        self.last_error = reason[:_REASON_LIMIT]

    def snapshot(self, now: float) -> dict[str, Any]:
        """The ``models`` member of a region in ``/status``."""
        return {
            "learns": self.learns,
            "known": self.known,
            "count": len(self.models) if self.known else None,
            "age_s": round(now - self.stamp, 3) if self.known else None,
            "fetches_total": self.fetches_total,
            "failures_total": self.failures_total,
            "changes_total": self.changes_total,
            "last_error": self.last_error,
        }


class LearningRegion(RegionEndpoints, Protocol):
    """A region as the learner sees it: its config and what was learnt (a ``Region``)."""

    @property
    def config(self) -> RegionConfig: ...

    @property
    def learned(self) -> LearnedModels: ...


class ModelLearner:
    """Learns the models of every region whose :class:`LearnedModels` ``learns``.

    :meth:`open` asks each of them once, all at once, and waits for the answers (each
    bounded by ``timeout``), then starts one task per region, which asks again every
    ``models_refresh`` seconds of its config until :meth:`close` cancels it. ``clock``
    dates the lists (monotonic seconds).
    """

    def __init__(
        self,
        regions: Iterable[LearningRegion],
        *,
        timeout: float,
        clock: Callable[[], float],
    ) -> None:
        self.regions = [r for r in regions if r.learned.learns]
        self.timeout = timeout
        self.clock = clock
        self.version = 0
        """Bumped whenever a region's known list changes."""
        self._tasks: RegionTasks[LearningRegion] = RegionTasks(
            "learn-models", self.refresh, _refresh_interval, wait_first=True
        )

    async def open(self) -> None:
        """Ask every learning region with an endpoint not known down, then start the
        refreshes. A region that gave no list serves every model until one comes."""
        await asyncio.gather(
            *(
                self.refresh(region)
                for region in self.regions
                if any(e.state != "down" for e in region.endpoints)
            )
        )
        self._tasks.start(self.regions)

    async def close(self) -> None:
        await self._tasks.close()

    async def refresh(self, region: LearningRegion) -> bool:
        """Ask ``region`` for its list once and keep what it says; True when it gave one."""
        learned = region.learned
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._fetch(region)
            entries = parse_model_list(body)
        except (TimeoutError, UpstreamError, ModelListError, _NoList) as exc:
            reason = (
                f"no answer within {self.timeout:g}s"
                if isinstance(exc, TimeoutError)
                else str(exc) or type(exc).__name__
            )
            learned.failed(reason)
            logger.debug("region %s: GET %s gave no list: %s", region.name, MODELS_PATH, reason)
            return False
        except Exception as exc:  # noqa: BLE001 - a fetch never fails the start nor its task
            learned.failed(f"{type(exc).__name__}: {exc}")
            logger.warning(
                "region %s: GET %s failed unexpectedly", region.name, MODELS_PATH, exc_info=True
            )
            return False
        any_name = answers_any_name(entries, body)
        if learned.learned(entries, self.clock(), any_name):
            self.version += 1
            self._log_learnt(region, entries, any_name)
        return True

    @staticmethod
    def _log_learnt(
        region: LearningRegion, entries: list[dict[str, Any]], any_name: str | None
    ) -> None:
        # Named, not counted: "serves 1 models" left an operator guessing what to ask for.
        count = len(entries)
        names = few_names(entry["id"] for entry in entries)
        said = f"region {region.name} serves {count} model{'' if count == 1 else 's'} "
        said += f"(from its {MODELS_PATH}): {names}"
        setting = region.config.serves_any_model
        if any_name is not None and setting is not False:
            said += (
                f"; it is {any_name}, which answers any model name: it is sent the names "
                "no region lists (serves_any_model = false stops that)"
            )
        elif setting:
            said += "; serves_any_model: it is sent the names no region lists"
        logger.info("%s", said)

    async def _fetch(self, region: LearningRegion) -> bytes:
        """The body of the region's /v1/models, from its first endpoint that answers 200
        (those not known down first)."""
        endpoints = sorted(region.endpoints, key=lambda e: e.state == "down")
        failure: Exception = _NoList("no endpoint")
        for endpoint in endpoints:
            try:
                return await self._fetch_one(region, endpoint)
            except (UpstreamError, _NoList) as exc:
                failure = exc
        raise failure

    async def _fetch_one(self, region: LearningRegion, endpoint: Endpoint) -> bytes:
        headers = [
            ("accept", "application/json"),
            ("user-agent", "edgeproxy-models"),
            *region.credential_headers,
        ]
        resp = await endpoint.pool.request(
            "GET", endpoint.base_path + MODELS_PATH, headers, None, authority=endpoint.authority
        )
        return await read_model_list(resp)


def _refresh_interval(region: LearningRegion) -> float:
    return region.config.models_refresh_interval


class _NoList(Exception):
    """A region's /v1/models answer that is no list of models."""


async def read_model_list(resp: Any) -> bytes:
    """The body of a region's ``/v1/models`` answer (``resp``: any upstream response, with
    ``status``, ``aiter_bytes`` and ``aclose``), at most ``MAX_MODEL_LIST_BYTES``; raises
    :class:`NoModelList` for an answer that is not 200 or too large. Closes ``resp``."""
    body = bytearray()
    try:
        if resp.status != 200:
            raise _NoList(f"it answered {resp.status}")
        async for chunk in resp.aiter_bytes():
            body += chunk
            if len(body) > MAX_MODEL_LIST_BYTES:
                raise _NoList("its list is too large")
    finally:
        await resp.aclose()
    return bytes(body)


NoModelList = _NoList
