"""The request context: the pipeline's fast constructor and the cached path."""

from __future__ import annotations

import dataclasses

from multidict import CIMultiDict

from edgeproxy import RequestContext
from edgeproxy._core.config import RouteConfig
from edgeproxy._core.context import start_context
from edgeproxy._protocol.headers import trace_context


def test_start_context_sets_every_field_as_the_dataclass_does() -> None:
    args = {
        "request_id": "r1",
        "trace": trace_context(None),
        "method": "POST",
        "target": "/v1/chat/completions?x=1",
        "headers": CIMultiDict({"a": "1"}),
        "client_ip": "10.0.0.1",
        "started": 12.5,
        "route": RouteConfig(name="default", path="/"),
        "scheme": "https",
        "http_version": "1.0",
        "host": "edge.example",
        "peer": "10.0.0.2",
        "peer_trusted": True,
    }
    fast = start_context(**args)
    slow = RequestContext(**args)  # type: ignore[arg-type]
    for f in dataclasses.fields(RequestContext):
        assert getattr(fast, f.name) == getattr(slow, f.name), f.name
    assert fast == slow
    assert fast.extra is not slow.extra


def test_path_follows_the_target() -> None:
    ctx = start_context(
        "r", trace_context(None), "GET", "/a/b?q=1", CIMultiDict(), None, 0.0,
        RouteConfig(name="default", path="/"), "http", "1.1", "h",
    )  # fmt: skip
    assert ctx.path == "/a/b"
    ctx.target = "/c?z"
    assert ctx.path == "/c"
    assert dataclasses.replace(ctx, target="/d").path == "/d"
