"""What a fake region has seen (:class:`Counters`), as :meth:`RegionApp.counters
<edgeproxy.testing._app.RegionApp.counters>` takes it, under the region's lock."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Counters"]


@dataclass(frozen=True, slots=True)
class Counters:
    """A snapshot of what a region has seen since it was built or last reset.

    Requests to ``/_control`` are not counted anywhere.
    """

    requests_total: int = 0
    """Requests that reached the application (refused streams excluded)."""
    requests_by_path: Mapping[str, int] = field(default_factory=dict)
    requests_by_http_version: Mapping[str, int] = field(default_factory=dict)
    """Keyed by ASGI ``http_version``: ``"1.1"`` or ``"2"``."""
    in_flight: int = 0
    """Requests being answered now (a gauge; a reset does not zero it)."""
    peak_in_flight: int = 0
    cancelled_total: int = 0
    """Requests whose client went away before the response was complete."""
    faults_total: int = 0
    """Requests that got the configured fault (a GOAWAY counts once)."""
    refused_total: int = 0
    """HTTP/2 streams refused (REFUSED_STREAM) after this region sent GOAWAY,
    or because the region is HTTP/1.1-only."""
    connections_total: int = 0
    """Distinct client connections that carried at least one request. A
    connection is identified by the client's (host, port)."""
    peak_streams_per_connection: int = 0
    """Most requests seen in flight at once on one connection."""

    # The LLM server model: chat and completions requests only.
    requests_running: int = 0
    """Requests holding a generation slot now (a gauge)."""
    requests_waiting: int = 0
    """Requests queued for a slot now (a gauge; only with ``max_running``)."""
    peak_requests_waiting: int = 0
    queue_rejected_total: int = 0
    """Requests turned away because ``max_queue`` requests were waiting."""
    prompt_tokens_total: int = 0
    """Prompt tokens of the requests that got a slot, by the KV model's tokeniser."""
    cached_tokens_total: int = 0
    """Of those, the tokens found in the prefix cache."""
    generation_tokens_total: int = 0
    """Completion tokens of the requests that got a slot."""
    tokens_sent_total: int = 0
    """Completion tokens that left the region: the token events a stream wrote
    (a stream reset after *k* tokens counts *k*), a JSON answer's tokens once
    its body was written whole."""
    modelled_ttft_seconds_total: float = 0.0
    """Sum of the modelled TTFTs (``x-fake-ttft-ms``; queue time excluded)."""
    kv_cache_blocks: int = 0
    """Blocks in the prefix cache now (a gauge)."""
    kv_blocks_in_use: int = 0
    """Blocks held by the running requests now (a gauge)."""
    kv_cache_usage: float = 0.0
    """``kv_blocks_in_use / kv_capacity_blocks``, at most 1 (a gauge; 0 without a cache)."""
    kv_evicted_blocks_total: int = 0

    # The Responses API's store (see edgeproxy.testing._responses).
    responses_stored: int = 0
    """Responses in the store now (a gauge; a reset does not zero it)."""
    responses_stored_total: int = 0
    """Responses stored (written whole, with ``store`` not false)."""
    responses_evicted_total: int = 0
    """Stored responses dropped because the store was full."""
    previous_response_hits_total: int = 0
    """``previous_response_id`` values found in the store."""
    previous_response_misses_total: int = 0
    """``previous_response_id`` values not found (answered 404)."""
    response_lookups_total: int = 0
    """``GET``/``DELETE /v1/responses/{id}``, ``input_items`` and ``cancel`` that found it."""
    response_lookup_misses_total: int = 0
    """Those that did not (answered 404)."""

    # Conversations, files, batches and vector stores (see edgeproxy.testing._objects).
    objects_stored: int = 0
    """Objects of the four kinds stored now (a gauge)."""
    object_lookups_total: int = 0
    """Requests naming one of them (by path, or a body's file ids) that found it."""
    object_lookup_misses_total: int = 0
    """Those that did not (answered the API's 404)."""

    @property
    def kv_hit_rate(self) -> float:
        """``cached_tokens_total / prompt_tokens_total`` (0.0 before any prompt)."""
        return (
            self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests_total": self.requests_total,
            "requests_by_path": dict(self.requests_by_path),
            "requests_by_http_version": dict(self.requests_by_http_version),
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "cancelled_total": self.cancelled_total,
            "faults_total": self.faults_total,
            "refused_total": self.refused_total,
            "connections_total": self.connections_total,
            "peak_streams_per_connection": self.peak_streams_per_connection,
            "requests_running": self.requests_running,
            "requests_waiting": self.requests_waiting,
            "peak_requests_waiting": self.peak_requests_waiting,
            "queue_rejected_total": self.queue_rejected_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "kv_hit_rate": self.kv_hit_rate,
            "generation_tokens_total": self.generation_tokens_total,
            "tokens_sent_total": self.tokens_sent_total,
            "modelled_ttft_seconds_total": self.modelled_ttft_seconds_total,
            "kv_cache_blocks": self.kv_cache_blocks,
            "kv_blocks_in_use": self.kv_blocks_in_use,
            "kv_cache_usage": self.kv_cache_usage,
            "kv_evicted_blocks_total": self.kv_evicted_blocks_total,
            "responses_stored": self.responses_stored,
            "responses_stored_total": self.responses_stored_total,
            "responses_evicted_total": self.responses_evicted_total,
            "previous_response_hits_total": self.previous_response_hits_total,
            "previous_response_misses_total": self.previous_response_misses_total,
            "response_lookups_total": self.response_lookups_total,
            "response_lookup_misses_total": self.response_lookup_misses_total,
            "objects_stored": self.objects_stored,
            "object_lookups_total": self.object_lookups_total,
            "object_lookup_misses_total": self.object_lookup_misses_total,
        }
