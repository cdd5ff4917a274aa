"""The request's outcome is a record of its own, written by the obtain path, the cache's
lookup and the Responder only; the request's facts are fixed at entry, by the context
itself."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from multidict import CIMultiDict

from edgeproxy._core.config import RouteConfig
from edgeproxy._core.context import FixedFact, RequestContext, start_context
from edgeproxy._core.outcome import Outcome
from edgeproxy._protocol.headers import trace_context

PACKAGE = Path(__file__).resolve().parent.parent / "edgeproxy"
FIELDS = frozenset(f.name for f in dataclasses.fields(Outcome))

# Who writes the outcome: the pipeline and its obtain path's record from the values the
# stages return, the cache stage its status and key at lookup, the Responder what it sent
# (its heartbeats' beats included).
WRITERS = {
    "_pipeline.py",
    "_obtain/record.py",
    "_cache/stage.py",
    "_answer/responder.py",
    "_answer/body.py",  # the Responder's body loops
    "_realtime/sessions.py",  # a WebSocket session's handshake: its region, status, usage
    "_realtime/relay.py",  # a session relayed: what it sent, and how it ended
}


def _context() -> RequestContext:
    return start_context(
        "r", trace_context(None), "POST", "/v1/chat/completions", CIMultiDict(), "192.0.2.1",
        0.0, RouteConfig(name="default", path="/"), "http", "1.1", "h",
    )  # fmt: skip


def _writes_outcome(tree: ast.AST) -> bool:
    """Whether a module assigns an outcome field on an ``outcome`` (``ctx.outcome.status
    = ...``), on a name bound to one (``out = ctx.outcome``), or on a context directly."""
    bound = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "outcome"
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            elts = target.elts if isinstance(target, ast.Tuple) else [target]
            for elt in elts:
                if not isinstance(elt, ast.Attribute) or elt.attr not in FIELDS:
                    continue
                owner = elt.value
                if isinstance(owner, ast.Attribute) and owner.attr == "outcome":
                    return True
                if isinstance(owner, ast.Name) and owner.id in bound | {"ctx"}:
                    return True
    return False


def test_only_the_pipeline_the_obtain_path_the_cache_and_the_responder_write_the_outcome() -> None:
    writers = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("_core/") or relative.startswith("testing/"):
            continue
        if _writes_outcome(ast.parse(path.read_text())):
            writers.add(relative)
    assert writers == WRITERS


def test_a_new_context_has_a_new_outcome_as_the_dataclass_makes_it() -> None:
    ctx, other = _context(), _context()
    assert ctx.outcome == Outcome() and ctx.outcome is not other.outcome


def test_the_outcome_reads_the_same_on_the_context() -> None:
    ctx = _context()
    assert isinstance(ctx.outcome, Outcome)
    ctx.outcome.status = 503
    ctx.outcome.usage = {"total_tokens": 3}
    assert (ctx.status, ctx.usage) == (503, {"total_tokens": 3})
    ctx.region = "r1"  # plugins and tests may still set it on the context
    assert ctx.outcome.region == "r1"
    # Each field of the record has its name on the context.
    for name in FIELDS:
        assert getattr(ctx, name) == getattr(ctx.outcome, name)


def test_a_fixed_context_refuses_a_change_to_a_fact_until_answered() -> None:
    ctx = _context()
    ctx.set_json({"model": "m", "stream": True, "messages": []})
    ctx.tenant = "acme"
    facts = ctx.fix("chat.completions")
    assert (facts.model, facts.stream, facts.tenant) == ("m", True, "acme")
    for name, value in (("tenant", "other"), ("client_ip", "10.0.0.1"), ("body", b"{}")):
        with pytest.raises(FixedFact):
            setattr(ctx, name, value)
    ctx.model = "m-1"  # not a fact: the router sets it
    ctx.outcome.status = 200
    assert ctx.tenant == "acme" and isinstance(ctx, RequestContext)
    ctx.outcome.finished_at = 1.0  # answered
    ctx.client_ip = "0.0.0.0"  # the hooks after the answer may change it for the log
    assert ctx.facts is facts and facts.client_ip == "192.0.2.1"


def test_a_leg_is_a_draft_of_its_own_with_its_own_outcome() -> None:
    ctx = _context()
    ctx.set_json({"model": "m", "messages": []})
    ctx.fix("chat.completions")
    ctx.outcome.attempts = 2
    leg = ctx.with_json({"model": "m-small", "messages": []})
    assert leg.facts is not None and leg.facts.model == "m-small"
    leg.outcome.attempts = 5
    assert ctx.outcome.attempts == 2
    with pytest.raises(FixedFact):
        leg.tenant = "other"


def test_the_guard_is_armed_only_when_a_hook_after_entry_is_implemented() -> None:
    from edgeproxy import hookimpl
    from edgeproxy._plugins import Plugins

    class Observer:
        @hookimpl
        def edgeproxy_response_complete(self, ctx: RequestContext) -> None:
            pass

    class Router:
        @hookimpl
        def edgeproxy_route(self, ctx: RequestContext) -> None:
            pass

    plugins = Plugins()
    plugins.register(Observer(), "observer")
    assert not plugins.guards_facts  # nothing between entry and the answer could change a fact
    plugins.register(Router(), "router")
    assert plugins.guards_facts
    plugins.unregister("router")
    assert not plugins.guards_facts
    ctx = _context()
    ctx.fix("chat.completions", guard=False)
    assert type(ctx) is RequestContext
    leg = ctx.with_json({"model": "m", "messages": []})
    assert type(leg) is RequestContext  # a leg is guarded as its request is
