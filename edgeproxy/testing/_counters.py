"""What a fake region has seen (:class:`Counters`), as :meth:`RegionApp.counters
<edgeproxy.testing._app.RegionApp.counters>` takes it, under the region's lock."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["Counters", "RealtimeStats"]


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

    # Realtime sessions (see edgeproxy.testing._realtime). Each handshake also counts as a
    # request (``requests_by_path``), in flight while its session is open.
    realtime_sessions_total: int = 0
    """Realtime handshakes accepted."""
    realtime_sessions_open: int = 0
    """Realtime sessions open now (a gauge; a reset does not zero it)."""
    realtime_refused_total: int = 0
    """Realtime handshakes answered with an HTTP status instead (``realtime_refuse``, or a
    WebSocket to a path that is no Realtime endpoint)."""
    realtime_messages_received_total: int = 0
    """Messages the clients sent in their sessions, well formed or not."""
    realtime_messages_sent_total: int = 0
    """Events the region sent in its sessions (``error`` events included)."""
    realtime_responses_total: int = 0
    """Responses that ended with ``response.done`` (cancelled ones included)."""
    realtime_responses_cancelled_total: int = 0
    """Of those, the ones ``response.cancel`` cut short."""
    realtime_errors_total: int = 0
    """``error`` events sent (malformed, unknown or refused client events)."""
    realtime_faults_total: int = 0
    """Responses that got ``realtime_fault``."""
    realtime_last_path: str | None = None
    """The path of the last Realtime handshake (``None`` before any)."""
    realtime_last_query: str | None = None
    """Its query string, undecoded (``model=gpt-realtime``)."""
    realtime_last_headers: Mapping[str, str] = field(default_factory=dict)
    """Its headers, by lower-case name (repeated ones joined with ``", "``)."""

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
            "realtime_sessions_total": self.realtime_sessions_total,
            "realtime_sessions_open": self.realtime_sessions_open,
            "realtime_refused_total": self.realtime_refused_total,
            "realtime_messages_received_total": self.realtime_messages_received_total,
            "realtime_messages_sent_total": self.realtime_messages_sent_total,
            "realtime_responses_total": self.realtime_responses_total,
            "realtime_responses_cancelled_total": self.realtime_responses_cancelled_total,
            "realtime_errors_total": self.realtime_errors_total,
            "realtime_faults_total": self.realtime_faults_total,
            "realtime_last_path": self.realtime_last_path,
            "realtime_last_query": self.realtime_last_query,
            "realtime_last_headers": dict(self.realtime_last_headers),
        }


_REALTIME_TOTALS: Final = (
    "sessions_total refused_total messages_received_total messages_sent_total responses_total "
    "responses_cancelled_total errors_total faults_total"
).split()


class RealtimeStats:
    """The counters of a region's Realtime sessions (``Counters.realtime_*``): written on
    the region's loop, read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(_REALTIME_TOTALS, 0)
        self._open = 0
        self._last: tuple[str, str, dict[str, str]] | None = None

    def add(self, name: str, amount: int = 1) -> None:
        """Add to the total ``realtime_<name>``."""
        with self._lock:
            self._totals[name] += amount

    def handshake(self, path: str, query: str, headers: dict[str, str]) -> None:
        with self._lock:
            self._last = (path, query, headers)

    def opened(self, change: int) -> None:
        """A session opened (``+1``) or ended (``-1``)."""
        with self._lock:
            self._open += change
            self._totals["sessions_total"] += max(0, change)

    def counters(self) -> dict[str, Any]:
        """The ``realtime_*`` fields of :class:`Counters`."""
        with self._lock:
            out: dict[str, Any] = {f"realtime_{k}": v for k, v in self._totals.items()}
            out["realtime_sessions_open"] = self._open
            path, query, headers = self._last or (None, None, {})
        out |= {"realtime_last_path": path, "realtime_last_query": query}
        out["realtime_last_headers"] = dict(headers)
        return out

    def reset_counters(self) -> None:
        with self._lock:
            self._totals = dict.fromkeys(_REALTIME_TOTALS, 0)
            self._last = None
