"""Responses chains the edge holds (a route's ``responses_state = "edge"``): when a chain
goes to its owner, and when the edge takes it on.

A request continuing a chain (``previous_response_id``) goes to the region that stored
its previous response while that region is up and keeps stored responses. The edge takes
it on, sending the chain's whole input to whichever region the router picks, when:

* the owner is unknown, down, or cannot be looked up;
* the owner keeps no stored responses (llama.cpp's ``llama-server``, or a region set
  ``stores_responses = false``);
* the owner answers that it holds no such response (a vLLM restarted, its memory gone),
  or that it keeps none (llama-server's 400).

Only a chain held whole, made by the same scope (the tenant binding), is taken on; any
other goes the owner's way, with the owner's answers. Each stored response a route
answers is held as its chain's next turn (:mod:`edgeproxy._shared.chains`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from edgeproxy._cache.keys import cache_scope
from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext
from edgeproxy._core.response import Response
from edgeproxy._protocol.dialects import RESPONSES
from edgeproxy._protocol.objects import object_path
from edgeproxy._shared.chains import ChainStore, Turn
from edgeproxy._upstream.regions import RegionSet

__all__ = ["ChainRecord", "EdgeChains"]


class ChainRecord:
    """What a request continuing (or starting) a held chain needs at its end, to hold its
    stored response as the next turn: its parent and its own input items."""

    __slots__ = ("parent", "own_input", "scope", "parent_turn")

    def __init__(self, parent: str | None, own_input: list[Any], scope: str) -> None:
        self.parent = parent
        self.own_input = own_input
        self.scope = scope
        # The parent's turn, once a rescue read it: holding the new turn reads it no more.
        self.parent_turn: Turn | None = None


class EdgeChains:
    """The chains the edge holds, for one pipeline (see the module's docstring)."""

    def __init__(
        self, config: Config, regions: RegionSet, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.regions = regions
        self.store = ChainStore(config.stateful, clock=clock)
        self.binding = config.stateful.tenant_binding
        self.active = any(route.responses_state == "edge" for route in config.routes)
        self.rescued: dict[str, int] = {
            "owner_unavailable": 0,
            "owner_cannot_store": 0,
            "owner_forgot": 0,
        }
        self.rescue_seconds_sum = 0.0
        self.answered_total = 0
        # Regions whose own 400 said they keep no stored responses (llama-server's).
        self.stateless: set[str] = set()

    async def open(self) -> None:
        if self.active:
            await self.store.open()

    async def close(self) -> None:
        await self.store.close()

    # -- which requests --------------------------------------------------------------

    def record_of(self, ctx: RequestContext) -> ChainRecord | None:
        """A stored Responses request on an edge route: what its turn will need."""
        if not self.active or ctx.route.responses_state != "edge" or ctx.method != "POST":
            return None
        facts = ctx.facts
        if facts is None or facts.dialect != "responses":
            return None
        body = ctx.json
        if not isinstance(body, dict) or not RESPONSES.stores(body):
            return None
        if body.get("conversation"):
            return None  # a conversation's state is the region's (not a chain of turns)
        previous = body.get("previous_response_id")
        return ChainRecord(
            previous if isinstance(previous, str) and previous else None,
            RESPONSES.own_items(body),
            cache_scope(ctx),
        )

    def takes_over(self, owner: str | None) -> str | None:
        """Why the edge takes a chain on from ``owner`` (None: it does not)."""
        if owner is None:
            return "owner_unavailable"
        region = self.regions.by_name.get(owner)
        if region is None or region.state == "down":
            return "owner_unavailable"
        if not region.config.keeps_responses or owner in self.stateless:
            return "owner_cannot_store"
        return None

    def learn_stateless(self, region: str) -> None:
        """``region`` answered that it keeps no stored responses: its chains are sent
        whole from now on, without asking it first."""
        self.stateless.add(region)

    # -- the rescue ------------------------------------------------------------------

    async def _whole(self, response_id: str, scope: str) -> list[Turn] | None:
        turns = await self.store.chain(response_id)
        if turns is None:
            return None
        if self.binding and any(t.scope != scope for t in turns):
            return None  # another scope's chain: as if the edge held none
        return turns

    async def expanded(
        self, ctx: RequestContext, record: ChainRecord, why: str
    ) -> dict[str, Any] | None:
        """The request's body with the chain's whole input, when the edge holds it."""
        assert record.parent is not None
        started = time.monotonic()
        turns = await self._whole(record.parent, record.scope)
        body = ctx.json
        if turns is None or not isinstance(body, dict):
            return None
        self.rescued[why] += 1
        self.rescue_seconds_sum += time.monotonic() - started
        record.parent_turn = turns[-1]
        return RESPONSES.expanded(body, [(t.input, t.response) for t in turns])

    async def hold(self, record: ChainRecord, stored: dict[str, Any] | None) -> None:
        """The stored response a request was answered with, as its chain's next turn."""
        if stored is None or not self.store.up:
            if stored is not None:
                self.store.not_held["redis_down"] += 1
            return
        response_id = stored.get("id")
        if not isinstance(response_id, str) or not response_id:
            return
        parent = record.parent_turn
        if record.parent is not None and parent is None:
            parent = await self.store.get(record.parent)
            if parent is None:
                return  # its chain is not held whole: the owner alone continues it
        turn = self.store.turn(response_id, record.scope, parent, record.own_input, stored)
        if turn is not None:
            await self.store.put(turn)

    async def hold_answer(self, record: ChainRecord, answer: bytes | None) -> None:
        """:meth:`hold` for a JSON answer read whole, before it is relayed."""
        if not answer:
            return
        try:
            stored = orjson.loads(answer)
        except orjson.JSONDecodeError:
            return
        if isinstance(stored, dict):
            await self.hold(record, stored)

    # -- retrieve and delete ---------------------------------------------------------

    def object_of(self, ctx: RequestContext) -> tuple[str, bool] | None:
        """``GET``/``DELETE /v1/responses/{id}`` (``True``: ``.../input_items``) on an
        edge route: the response's id."""
        if not self.active or ctx.route.responses_state != "edge":
            return None
        if ctx.method not in ("GET", "DELETE"):
            return None
        target = object_path(ctx.path)
        if target is None or target.kind.collection != "responses" or not target.object_id:
            return None
        rest = target.rest or ""
        if rest not in ("", "input_items"):
            return None
        return target.object_id, rest == "input_items"

    async def answer(self, ctx: RequestContext, response_id: str, items: bool) -> Response | None:
        """The edge's own answer for a held response (None: not held, or not the
        caller's)."""
        held = await self._held(response_id, cache_scope(ctx))
        if held is None:
            return None
        self.answered_total += 1
        if ctx.method == "DELETE":
            await self.store.delete(response_id)
            return Response.json({"id": response_id, "object": "response", "deleted": True})
        if not items:
            return Response.json(held.response)
        # The response's own input, newest first, as the API lists it by default.
        data = RESPONSES.listed_items(held.id, held.input)
        data.reverse()
        return Response.json(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": False,
            }
        )

    async def _held(self, response_id: str, scope: str) -> Turn | None:
        turn = await self.store.get(response_id)
        if turn is None or (self.binding and turn.scope != scope):
            return None
        return turn

    def snapshot(self) -> dict[str, Any]:
        rescues = sum(self.rescued.values())
        return {
            **self.store.snapshot(),
            "rescued": dict(self.rescued),
            "rescue_seconds_sum": round(self.rescue_seconds_sum, 6),
            "rescue_seconds_mean": round(self.rescue_seconds_sum / rescues, 6) if rescues else 0,
            "answered_total": self.answered_total,
            "stateless_regions": sorted(self.stateless),
        }
