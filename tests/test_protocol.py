"""The protocol tables and builders: the endpoint table, OpenAI answers, the client-IP resolver."""

from __future__ import annotations

from typing import Any, get_args

import orjson
import pytest

from edgeproxy import ClientIPResolver
from edgeproxy._cache.keys import CACHEABLE_PATHS
from edgeproxy._core.config import LocalModelConfig, RouteConfig
from edgeproxy._local.model import LocalModel
from edgeproxy._obtain.failover import LLM_SUFFIXES
from edgeproxy._protocol.bodies import is_llm_request, requires_json
from edgeproxy._protocol.clientip import MAX_HOPS
from edgeproxy._protocol.dialects import CHAT
from edgeproxy._protocol.endpoints import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    EMBEDDINGS,
    ENDPOINTS,
    MODERATIONS,
    RESPONSES,
    Property,
    endpoint_has,
    endpoint_paths,
    endpoint_suffixes,
    openai_endpoint,
)
from edgeproxy._protocol.openai import (
    SSE_DONE,
    AnswerHead,
    chat_choice,
    chat_chunk_choice,
    chunk,
    completion,
    completion_id,
    sse_event,
    text_choice,
    usage,
    usage_chunk,
)
from edgeproxy._protocol.sse import SSEReader
from edgeproxy._protocol.usage import UsageTracker

PROPERTIES: tuple[Property, ...] = get_args(Property)

# -- the endpoint table --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/chat/completions", CHAT_COMPLETIONS),
        ("/v1/completions", COMPLETIONS),
        ("/v1/embeddings", EMBEDDINGS),
        ("/v1/responses", RESPONSES),
        ("/v1/moderations", MODERATIONS),
        # Azure OpenAI, and APIs under a prefix.
        ("/openai/deployments/gpt-4o/chat/completions", CHAT_COMPLETIONS),
        ("/openai/v1/embeddings", EMBEDDINGS),
        ("/v1/models", None),
        ("/v1/chat/completions/", None),
        ("/v1/chat/completions/abc123", None),  # a stored completion, not a new one
        ("/v1/responses/resp_1/cancel", None),
        ("/v1/chatcompletions", None),
        ("/healthz", None),
        ("", None),
    ],
)
def test_openai_endpoint_matches_the_longest_suffix(path: str, expected: object) -> None:
    assert openai_endpoint(path) is expected


def test_every_suffix_list_agrees_with_the_lookup() -> None:
    # endpoint_suffixes() is only right while no endpoint lacking a property ends
    # like one that has it ("/chat/completions" ends like "/completions").
    for prop in PROPERTIES:
        for endpoint in ENDPOINTS:
            path = "/v1" + endpoint.suffix
            assert path.endswith(endpoint_suffixes(prop)) == getattr(endpoint, prop), (prop, path)
            assert (path in endpoint_paths(prop)) == getattr(endpoint, prop)
            assert endpoint_has(path, prop) == getattr(endpoint, prop)
        assert "/v1/models" not in endpoint_paths(prop)
        assert not "/v1/models".endswith(endpoint_suffixes(prop))
    assert 42 not in endpoint_paths("cacheable")
    assert "cacheable" in repr(endpoint_paths("cacheable"))


def test_each_user_reads_the_table() -> None:
    route = RouteConfig(name="r", path="/")
    chat = "/v1/chat/completions"
    # Admission: JSON bodies, and prompt estimates where answers carry usage.
    assert requires_json("POST", chat, route)
    assert requires_json("POST", "/v1/moderations", route)
    assert not requires_json("POST", "/v1/files", route)
    assert not requires_json("GET", chat, route)
    assert is_llm_request("POST", "/v1/embeddings")
    assert not is_llm_request("POST", "/v1/moderations")
    assert not is_llm_request("GET", chat)
    # Failover, cache, local model, usage.
    assert "/v1/moderations".endswith(LLM_SUFFIXES)
    assert not "/v1/files".endswith(LLM_SUFFIXES)
    assert chat in CACHEABLE_PATHS and "/v1/embeddings" in CACHEABLE_PATHS
    assert "/v1/responses" in CACHEABLE_PATHS and "/v1/messages" in CACHEABLE_PATHS
    assert "/v1/moderations" not in CACHEABLE_PATHS
    assert "/v1/messages/count_tokens" not in CACHEABLE_PATHS
    model = LocalModel(LocalModelConfig())
    assert model.serves("POST", chat) and model.serves("POST", "/v1/completions")
    assert not model.serves("POST", "/v1/embeddings") and not model.serves("GET", chat)
    assert UsageTracker.for_response(chat, "application/json", 200) is not None
    assert UsageTracker.for_response("/v1/moderations", "application/json", 200) is None
    assert UsageTracker.for_response("/v1/models", "application/json", 200) is None
    assert UsageTracker.for_response(chat, "application/json", 500) is None


# -- OpenAI answers -----------------------------------------------------------------------

HEAD = AnswerHead("chatcmpl-1", 1700000000, "m", chat=True)
TEXT_HEAD = AnswerHead("cmpl-1", 1700000000, "m", chat=False, system_fingerprint="fp_1")


def test_completion_objects_have_openai_fields_in_openai_order() -> None:
    answer = completion(HEAD, [chat_choice(0, "hi", "stop")], usage(3, 1))
    assert orjson.dumps(answer) == (
        b'{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":"m",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},'
        b'"logprobs":null,"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
    )
    text = completion(TEXT_HEAD, [text_choice(0, "hi", "length")])
    assert orjson.dumps(text) == (
        b'{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m",'
        b'"system_fingerprint":"fp_1","choices":[{"index":0,"text":"hi","logprobs":null,'
        b'"finish_reason":"length"}]}'
    )
    assert AnswerHead.of(text) == TEXT_HEAD
    assert AnswerHead.of(answer) == HEAD
    assert AnswerHead.of({"object": "list"}) is None


def test_chunks_and_their_sse_framing() -> None:
    event = sse_event(chunk(HEAD, [chat_chunk_choice(0, {"content": "hi"})]))
    assert event == (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"m","choices":[{"index":0,"delta":{"content":"hi"},"logprobs":null,'
        b'"finish_reason":null}]}\n\n'
    )
    last = sse_event(usage_chunk(TEXT_HEAD, usage(2, 2)))
    assert last == (
        b'data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m",'
        b'"system_fingerprint":"fp_1","choices":[],'
        b'"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}\n\n'
    )
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert completion_id(chat=True).startswith("chatcmpl-")
    assert completion_id(chat=False).startswith("cmpl-")
    assert completion_id(chat=True) != completion_id(chat=True)


def test_the_cache_streams_a_stored_answer_with_the_same_builders() -> None:
    answer: dict[str, Any] = completion(HEAD, [chat_choice(0, "Hello world", "stop")], usage(5, 2))
    events = CHAT.stream_of(answer, include_usage=True)
    assert events is not None
    assert events[0] == sse_event(
        chunk(HEAD, [chat_chunk_choice(0, {"role": "assistant", "content": ""})])
    )
    assert events[1] == sse_event(chunk(HEAD, [chat_chunk_choice(0, {"content": "Hello"})]))
    assert events[-3] == sse_event(chunk(HEAD, [chat_chunk_choice(0, {}, "stop")]))
    assert events[-2] == sse_event(usage_chunk(HEAD, usage(5, 2)))
    assert events[-1] == SSE_DONE
    assert CHAT.assemble(SSEReader().feed(b"".join(events))) == answer


# -- the client-IP resolver ------------------------------------------------------------------

PROXIES = ["10.0.0.0/8", "fd00::/8"]


@pytest.mark.parametrize(
    ("peer", "xff", "trusted", "expected"),
    [
        # Trust nobody unless configured: the peer is the client.
        ("198.51.100.1", ["203.0.113.9"], [], "198.51.100.1"),
        ("10.0.0.2", ["203.0.113.9"], [], "10.0.0.2"),
        # A peer outside the trusted networks is the client; its header is not believed.
        ("198.51.100.1", ["203.0.113.9"], PROXIES, "198.51.100.1"),
        ("10.0.0.2", ["203.0.113.9"], PROXIES, "203.0.113.9"),
        # The rightmost hop outside the trusted networks; spoofed left hops prove nothing.
        ("10.0.0.2", ["1.1.1.1, 203.0.113.9, 10.0.0.7"], PROXIES, "203.0.113.9"),
        ("10.0.0.2", ["1.1.1.1", "203.0.113.9"], PROXIES, "203.0.113.9"),
        # Every hop trusted: the leftmost; no header: the peer.
        ("10.0.0.2", ["10.0.0.3"], PROXIES, "10.0.0.3"),
        ("10.0.0.2", [], PROXIES, "10.0.0.2"),
        # Garbage ends the walk at the last trusted hop.
        ("10.0.0.2", ["garbage, 10.0.0.7"], PROXIES, "10.0.0.7"),
        ("10.0.0.2", ["203.0.113.9, garbage"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["unknown"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["<script>"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["1.2.3.4.5"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["256.1.1.1"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["010.1.1.1"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["1.2.3.4:port"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["1.2.3.4:99999999"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["1.2.3.4:\u0661\u0662"], PROXIES, "10.0.0.2"),  # non-ASCII digits
        ("10.0.0.2", ["\u0661.2.3.4"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["1.2.3.4\x00"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["9" * 5000], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["[2001:db8::5"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["[2001:db8::5]junk"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["[]"], PROXIES, "10.0.0.2"),
        # Ports, IPv6 in its forms, zones, IPv4-mapped addresses.
        ("10.0.0.2", ["203.0.113.9:4711"], PROXIES, "203.0.113.9"),
        ("10.0.0.2", ["[2001:db8::5]:443"], PROXIES, "2001:db8::5"),
        ("10.0.0.2", ["[2001:db8::5]"], PROXIES, "2001:db8::5"),
        ("10.0.0.2", ["2001:DB8:0:0::5"], PROXIES, "2001:db8::5"),
        ("10.0.0.2", ["fe80::1%eth0"], PROXIES, "fe80::1"),
        ("10.0.0.2", ["::ffff:203.0.113.9"], PROXIES, "203.0.113.9"),
        ("::ffff:10.0.0.2", ["203.0.113.9"], PROXIES, "203.0.113.9"),
        ("fd00::1", ["2001:db8::5, fd00::2"], PROXIES, "2001:db8::5"),
        ("::1", ["2001:db8::5"], ["::1"], "2001:db8::5"),
        ("::ffff:198.51.100.1", ["203.0.113.9"], PROXIES, "198.51.100.1"),
        # Spaces, tabs and empty list elements around hops.
        ("10.0.0.2", ["  203.0.113.9  ,\t10.0.0.7\t"], PROXIES, "203.0.113.9"),
        ("10.0.0.2", [" , ,203.0.113.9,, "], PROXIES, "203.0.113.9"),
        ("10.0.0.2", [""], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["203.0.113.9 10.0.0.7"], PROXIES, "10.0.0.2"),
        ("10.0.0.2", ["203.0.113.9, 10.0.0 .7"], PROXIES, "10.0.0.2"),
        # No peer, or one that is not an address (a Unix socket).
        (None, ["203.0.113.9"], PROXIES, None),
        ("", ["203.0.113.9"], PROXIES, None),
        ("/run/edgeproxy.sock", ["203.0.113.9"], PROXIES, "/run/edgeproxy.sock"),
    ],
)
def test_resolve(peer: str | None, xff: list[str], trusted: list[str], expected: str) -> None:
    assert ClientIPResolver(trusted).resolve(peer, xff) == expected


def test_many_hops_are_walked_only_so_far() -> None:
    clients = ClientIPResolver(PROXIES)
    trusted_hops = ", ".join(f"10.0.{i // 250}.{i % 250}" for i in range(MAX_HOPS * 4))
    # A client hiding behind more trusted-looking hops than any real chain: a trusted
    # address comes back, never the client's choice.
    found = clients.resolve("10.0.0.2", [f"6.6.6.6, {trusted_hops}"])
    assert found is not None and clients.trusts(found)
    # A long spoofed prefix costs nothing: the walk stops at the real client.
    spoofed = ", ".join(["6.6.6.6"] * 10_000)
    assert clients.resolve("10.0.0.2", [f"{spoofed}, 203.0.113.9, 10.0.0.7"]) == "203.0.113.9"


def test_trusts_only_configured_peers() -> None:
    nobody = ClientIPResolver()
    assert not nobody.trusts("127.0.0.1") and not nobody.trusts("10.0.0.1")
    clients = ClientIPResolver(["10.0.0.0/8", " ::1 "])
    assert clients.trusts("10.1.2.3") and clients.trusts("::ffff:10.1.2.3")
    assert clients.trusts("::1") and clients.trusts("::1%lo")
    assert not clients.trusts("192.0.2.1") and not clients.trusts("::2")
    assert not clients.trusts(None) and not clients.trusts("") and not clients.trusts("x")
    assert "10.0.0.0/8" in repr(clients)


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "10.0.0.300", "", "x", 5, None])
def test_bad_networks_are_value_errors(entry: Any) -> None:
    with pytest.raises(ValueError, match="is not an IP address or CIDR network"):
        ClientIPResolver(["10.0.0.0/8", entry])


def test_endpoint_lookups_are_remembered_within_a_bound() -> None:
    from edgeproxy._protocol import endpoints

    for i in range(3 * endpoints._KNOWN_PATHS_MAX):
        path = f"/tenant-{i}/v1/chat/completions" if i % 2 else f"/other/{i}"
        assert (openai_endpoint(path) is CHAT_COMPLETIONS) == bool(i % 2)
        assert endpoint_has(path, "usage") == bool(i % 2)
        assert len(endpoints._KNOWN_PATHS) <= endpoints._KNOWN_PATHS_MAX
    assert openai_endpoint("/v1/embeddings") is EMBEDDINGS
    assert openai_endpoint("/v1/embeddings") is EMBEDDINGS
