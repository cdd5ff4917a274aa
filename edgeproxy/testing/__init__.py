"""A fake OpenAI-compatible regional cluster for tests, demos and benchmarks.

Each :class:`FakeRegion` is a real HTTP server (hypercorn, HTTP/1.1 and
HTTP/2 on one port) on its own thread, with deterministic completions,
injectable faults and request counters::

    from edgeproxy.testing import Behavior, FakeRegion

    async with FakeRegion(name="eu-west-1", behavior=Behavior(ttft=0.05)) as region:
        ...  # point the proxy at region.url
        region.behavior.fault = "5xx"  # the next requests fail
        assert region.requests_total == 3

A region can also run as its own process, controlled over HTTP::

    python -m edgeproxy.testing --name r1 --port 9101 --ttft 0.05

``POST /_control`` with a JSON object of :class:`Behavior` fields changes the
behaviour, ``GET /_control`` returns it with the counters,
``POST /_control/reset-counters`` zeroes the counters,
``POST /_control/clear-kv-cache`` empties the prefix cache and
``POST /_control/clear-responses`` the stored Responses API responses.

Besides chat completions, completions and embeddings, a region speaks the
OpenAI Responses API, statefully (``previous_response_id`` works only on the
region that stored the response), and Anthropic's Messages API (with
assistant prefill continuations), with the same faults. At any path ending
``/realtime`` it speaks OpenAI's Realtime API over a WebSocket (text, audio and
function calls, usage in ``response.done``), with faults of its own
(``realtime_refuse``, ``realtime_accept_delay``, ``realtime_fault``).

:func:`answer_text` is the deterministic answer to a prompt, to compare
what a client received (spliced from a continuation or not) against.

For LLM-aware routing, a region models an LLM server (see :class:`FakeRegion`):
a FIFO queue in front of ``max_running`` slots, an LRU prefix (KV) cache whose
hits shorten the modelled TTFT, vLLM's ORCA ``endpoint-load-metrics`` header
and a Prometheus ``GET /metrics`` with vLLM's (or SGLang's) load gauges.

:func:`tiny_llama_gguf` builds a tiny random-weight llama GGUF model
(``Q8_0`` or ``Q4_0``) for the local-model fallback: real llama.cpp, no
download, gibberish answers by design.

:class:`H2Attacker` is a hostile HTTP/2 client (raw frames, h2c prior knowledge) for the
proxy's own listener: :data:`MALFORMED` requests (each a stream error), :data:`FLOODS` of
frames, windows kept shut, rapid resets.

Requires hypercorn (the ``test`` or ``bench`` extra); the model needs numpy
and gguf (the ``testing`` extra).
"""

from edgeproxy.testing._app import Counters
from edgeproxy.testing._behavior import FAULTS, Behavior, Fault
from edgeproxy.testing._content import answer_text
from edgeproxy.testing._gguf import TinyLlamaSpec, tiny_llama_gguf, write_tiny_llama_gguf
from edgeproxy.testing._h2attack import (
    FLOODS,
    MALFORMED,
    Answer,
    H2Attacker,
    flood_frame,
    malformed_frames,
)
from edgeproxy.testing._hostile import HostileCounters, HostileRegion
from edgeproxy.testing._load import LOAD_METRICS_FAULTS, LoadMetricsFault
from edgeproxy.testing._upstream import FakeRegion
from edgeproxy.testing._wan import WanCounters, WanLink

__all__ = [
    "Answer",
    "Behavior",
    "Counters",
    "FAULTS",
    "FLOODS",
    "FakeRegion",
    "Fault",
    "H2Attacker",
    "HostileCounters",
    "HostileRegion",
    "LOAD_METRICS_FAULTS",
    "LoadMetricsFault",
    "MALFORMED",
    "TinyLlamaSpec",
    "WanCounters",
    "WanLink",
    "answer_text",
    "flood_frame",
    "malformed_frames",
    "tiny_llama_gguf",
    "write_tiny_llama_gguf",
]
