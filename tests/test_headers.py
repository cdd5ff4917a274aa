from __future__ import annotations

import pytest

from edgeproxy._protocol.headers import (
    append_forwarded_for,
    append_via,
    request_id,
    request_ids,
    strip_hop_by_hop,
    trace_context,
)


def test_strip_hop_by_hop_includes_connection_tokens() -> None:
    headers = [
        ("Connection", "keep-alive, X-Secret"),
        ("Keep-Alive", "timeout=5"),
        ("X-Secret", "1"),
        ("Transfer-Encoding", "chunked"),
        ("Upgrade", "h2c"),
        ("TE", "trailers"),
        ("Proxy-Authorization", "Basic x"),
        ("Content-Type", "application/json"),
    ]
    assert strip_hop_by_hop(headers) == [("Content-Type", "application/json")]


def test_request_id_kept_when_valid_and_generated_otherwise() -> None:
    assert request_id("abc-123") == "abc-123"
    generated = request_id("bad id with spaces\r\n")
    assert len(generated) == 32 and generated != request_id(None)


def test_request_ids_follow_the_rules_of_request_id_and_trace_context() -> None:
    # One draw of randomness at entry gives what the two helpers give one by one.
    incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    rid, trace = request_ids("abc-123", incoming)
    assert rid == "abc-123"
    assert trace.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace.parent_id == "00f067aa0ba902b7" and len(trace.span_id) == 16
    rid, trace = request_ids("bad id\r\n", "garbage")
    assert len(rid) == 32 and int(rid, 16) >= 0
    assert trace.parent_id is None and trace.flags == "01"
    assert len(trace.trace_id) == 32 and trace.trace_id != "0" * 32
    assert rid != trace.trace_id[: len(rid)]  # distinct parts of the draw
    others = {request_ids(None, None)[0] for _ in range(50)}
    assert len(others) == 50


def test_traceparent_continues_trace_with_new_span() -> None:
    incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    ctx = trace_context(incoming)
    assert ctx.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert ctx.parent_id == "00f067aa0ba902b7"
    assert ctx.span_id != ctx.parent_id
    assert ctx.traceparent.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    assert ctx.traceparent.endswith("-01")


def test_invalid_traceparent_starts_new_trace() -> None:
    for bad in (
        "garbage",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
    ):
        ctx = trace_context(bad)
        assert ctx.parent_id is None
        assert len(ctx.trace_id) == 32 and ctx.trace_id != "0" * 32


def test_forwarding_headers() -> None:
    assert append_forwarded_for(None, "10.0.0.1") == "10.0.0.1"
    assert append_forwarded_for("1.1.1.1", "10.0.0.1") == "1.1.1.1, 10.0.0.1"
    assert append_forwarded_for("1.1.1.1", None) == "1.1.1.1"
    assert append_via(None, "1.1", "edge-sin") == "1.1 edge-sin"
    assert append_via("1.0 a", "2.0", "edge-sin") == "1.0 a, 2.0 edge-sin"


def test_trace_contexts_built_slot_by_slot_are_ordinary_frozen_dataclasses() -> None:
    import dataclasses

    from edgeproxy._core.types import TraceContext
    from edgeproxy._protocol.headers import trace_context

    fresh = trace_context(None)
    twin = TraceContext(fresh.trace_id, fresh.span_id, None, "01")
    assert fresh == twin and hash(fresh) == hash(twin) and repr(fresh) == repr(twin)
    assert dataclasses.asdict(fresh) == dataclasses.asdict(twin)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fresh.trace_id = "0" * 32  # type: ignore[misc]
    assert len(fresh.trace_id) == 32 and len(fresh.span_id) == 16
    assert int(fresh.trace_id, 16) and int(fresh.span_id, 16)
    ids = {trace_context(None).span_id for _ in range(100)}
    assert len(ids) == 100
