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
from typing import Any, NamedTuple

import orjson

from edgeproxy._cache.keys import cache_scope
from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext
from edgeproxy._core.response import Response
from edgeproxy._protocol.dialects import RESPONSES
from edgeproxy._protocol.objects import CONVERSATIONS, object_path
from edgeproxy._shared.chains import ChainStore, Held, Turn
from edgeproxy._upstream.regions import RegionSet

__all__ = ["ChainRecord", "EdgeChains", "HeldObject"]


class ChainRecord:
    """What a request continuing (or starting) a held chain needs at its end, to hold its
    stored response as the next turn: its parent, or its conversation, and its own input
    items."""

    __slots__ = ("parent", "own_input", "scope", "parent_turn", "conversation", "held")

    def __init__(
        self,
        parent: str | None,
        own_input: list[Any],
        scope: str,
        conversation: str | None = None,
    ) -> None:
        self.parent = parent
        self.own_input = own_input
        self.scope = scope
        # The parent's turn, once a rescue read it: holding the new turn reads it no more.
        self.parent_turn: Turn | None = None
        self.conversation = conversation
        # The conversation as the edge holds it, once read.
        self.held: Held | None = None

    @property
    def continues(self) -> bool:
        """It goes on from held state (a previous response, a conversation)."""
        return self.parent is not None or self.conversation is not None


class HeldObject(NamedTuple):
    """A held object a request retrieves or deletes: a response (``items``: its
    ``input_items``) or a conversation (``items``: its ``items``)."""

    conversation: bool
    id: str
    items: bool


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
            # A conversation the edge took on before: it alone holds it whole.
            "edge_holds": 0,
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
        conversation = RESPONSES.conversation_of(body)
        if conversation is not None:
            return ChainRecord(None, RESPONSES.own_items(body), cache_scope(ctx), conversation)
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
        """The request's body with the chain's whole input (or its conversation's items),
        when the edge holds it."""
        started = time.monotonic()
        body = ctx.json
        if not isinstance(body, dict):
            return None
        if record.conversation is not None:
            held = await self.held_conversation(record)
            if held is None:
                return None
            record.held = held._replace(taken=True)  # the edge goes on with it from here
            items = held.items
        else:
            assert record.parent is not None
            turns = await self._whole(record.parent, record.scope)
            if turns is None:
                return None
            record.parent_turn = turns[-1]
            items = RESPONSES.turn_items([(t.input, t.response) for t in turns])
        self.rescued[why] += 1
        self.rescue_seconds_sum += time.monotonic() - started
        return RESPONSES.with_items(body, items)

    async def held_conversation(self, record: ChainRecord) -> Held | None:
        """The conversation a request goes on with, as the edge holds it (None: not held,
        or another scope's)."""
        if record.held is not None or record.conversation is None:
            return record.held
        held = await self.store.conversation(record.conversation)
        if held is None or (self.binding and held.scope != record.scope):
            return None
        record.held = held
        return held

    async def taken(self, record: ChainRecord) -> str | None:
        """``edge_holds`` when the edge took the request's conversation on before: its
        owner's copy lacks what the edge went on with."""
        if record.conversation is None:
            return None
        held = await self.held_conversation(record)
        return "edge_holds" if held is not None and held.taken else None

    async def hold(self, record: ChainRecord, stored: dict[str, Any] | None) -> None:
        """The stored response a request was answered with, as its chain's next turn."""
        if stored is None or not self.store.up:
            if stored is not None:
                self.store.not_held["redis_down"] += 1
            return
        if record.conversation is not None:
            output = stored.get("output")
            await self.add_items(
                record, [*record.own_input, *(output if isinstance(output, list) else [])]
            )
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

    async def add_items(self, record: ChainRecord, items: list[Any]) -> None:
        """``items`` added to the conversation the edge holds (one it does not hold stays
        unheld: its items before these are not known)."""
        held = await self.held_conversation(record)
        if held is None or record.conversation is None:
            return
        grown = self.store.conversation_of(record.conversation, record.scope, items, held)
        if grown is None:
            await self.store.delete(record.conversation, conversation=True)
            return
        if await self.store.put_conversation(grown):
            record.held = grown

    async def hold_created(self, ctx: RequestContext, answer: bytes | None) -> None:
        """A conversation made on an edge route (``POST /v1/conversations``): held from its
        first items."""
        made = loads_object(answer)
        body = ctx.json
        conversation = made.get("id") if made is not None else None
        if not isinstance(conversation, str) or not self.store.up:
            return
        given = body.get("items") if isinstance(body, dict) else None
        items = [i for i in given if isinstance(i, dict)] if isinstance(given, list) else []
        held = self.store.conversation_of(conversation, cache_scope(ctx), items)
        if held is not None:
            await self.store.put_conversation(held)

    def conversation_made(self, ctx: RequestContext) -> bool:
        """``POST /v1/conversations`` on an edge route."""
        if not self.active or ctx.route.responses_state != "edge" or ctx.method != "POST":
            return False
        target = object_path(ctx.path)
        return target is not None and target.kind is CONVERSATIONS and target.object_id is None

    def items_added(self, ctx: RequestContext) -> ChainRecord | None:
        """``POST /v1/conversations/{id}/items`` on an edge route: the items it adds, to
        add to the edge's copy once the owner took them."""
        if not self.active or ctx.route.responses_state != "edge" or ctx.method != "POST":
            return None
        target = object_path(ctx.path)
        if target is None or target.kind is not CONVERSATIONS or not target.object_id:
            return None
        if target.rest != "items":
            return None
        body = ctx.json
        given = body.get("items") if isinstance(body, dict) else None
        if not isinstance(given, list):
            return None
        items = [i for i in given if isinstance(i, dict)]
        return ChainRecord(None, items, cache_scope(ctx), target.object_id)

    async def hold_answer(self, record: ChainRecord, answer: bytes | None) -> None:
        """:meth:`hold` for a JSON answer read whole, before it is relayed."""
        stored = loads_object(answer)
        if stored is not None:
            await self.hold(record, stored)

    # -- retrieve and delete ---------------------------------------------------------

    def object_of(self, ctx: RequestContext) -> HeldObject | None:
        """``GET``/``DELETE`` of a response (``.../input_items``) or a conversation
        (``.../items``) on an edge route."""
        if not self.active or ctx.route.responses_state != "edge":
            return None
        if ctx.method not in ("GET", "DELETE"):
            return None
        target = object_path(ctx.path)
        if target is None or not target.object_id:
            return None
        rest = target.rest or ""
        if target.kind is CONVERSATIONS and rest in ("", "items"):
            return HeldObject(True, target.object_id, rest == "items")
        if target.kind.collection == "responses" and rest in ("", "input_items"):
            return HeldObject(False, target.object_id, rest == "input_items")
        return None

    async def forget(self, held: HeldObject) -> None:
        """The edge's copy of an object its owner deleted."""
        await self.store.delete(held.id, conversation=held.conversation)

    async def answer(self, ctx: RequestContext, obj: HeldObject) -> Response | None:
        """The edge's own answer for a held response or conversation (None: not held, or
        not the caller's)."""
        if obj.conversation:
            return await self._conversation_answer(ctx, obj)
        held = await self._held(obj.id, cache_scope(ctx))
        if held is None:
            return None
        self.answered_total += 1
        if ctx.method == "DELETE":
            await self.store.delete(obj.id)
            return Response.json({"id": obj.id, "object": "response", "deleted": True})
        if not obj.items:
            return Response.json(held.response)
        # The response's own input, newest first, as the API lists it by default.
        data = RESPONSES.listed_items(held.id, held.input)
        data.reverse()
        return _listed(data)

    async def _conversation_answer(self, ctx: RequestContext, obj: HeldObject) -> Response | None:
        record = ChainRecord(None, [], cache_scope(ctx), obj.id)
        held = await self.held_conversation(record)
        if held is None:
            return None
        self.answered_total += 1
        if ctx.method == "DELETE":
            await self.store.delete(obj.id, conversation=True)
            return Response.json({"id": obj.id, "object": "conversation.deleted", "deleted": True})
        if not obj.items:
            return Response.json(
                {
                    "id": obj.id,
                    "object": "conversation",
                    "created_at": held.created_at,
                    "metadata": {},
                }
            )
        # Oldest first, as the API lists a conversation's items by default.
        return _listed(RESPONSES.listed_items(obj.id, held.items))

    async def _held(self, response_id: str, scope: str) -> Turn | None:
        turn = await self.store.get(response_id)
        if turn is None or (self.binding and turn.scope != scope):
            return None
        return turn

    def snapshot(self) -> dict[str, Any] | None:
        """``/status``'s ``chains`` (None where no route holds chains)."""
        if not self.active:
            return None
        rescues = sum(self.rescued.values())
        return {
            **self.store.snapshot(),
            "rescued": dict(self.rescued),
            "rescue_seconds_sum": round(self.rescue_seconds_sum, 6),
            "rescue_seconds_mean": round(self.rescue_seconds_sum / rescues, 6) if rescues else 0,
            "answered_total": self.answered_total,
            "stateless_regions": sorted(self.stateless),
        }


def _listed(data: list[dict[str, Any]]) -> Response:
    return Response.json(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": False,
        }
    )


def loads_object(answer: bytes | None) -> dict[str, Any] | None:
    """A JSON answer's object, or None."""
    if not answer:
        return None
    try:
        value = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
