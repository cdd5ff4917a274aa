"""Load reports of the fake region: the ORCA ``endpoint-load-metrics`` header and ``/metrics``.

The header follows vLLM (``vllm/entrypoints/openai/orca_metrics.py``): the
client asks with ``endpoint-load-metrics-format: TEXT`` or ``JSON`` (any
case; anything else gets no header) and gets, for example::

    endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.25,
        named_metrics.num_requests_waiting=2.0, named_metrics.num_requests_running=4.0
    endpoint-load-metrics: JSON {"named_metrics": {"kv_cache_usage_perc": 0.25,
        "num_requests_waiting": 2.0, "num_requests_running": 4.0}}

(each on one line). vLLM reports ``kv_cache_usage_perc`` (a fraction, 0 to
1, despite the name) and ``num_requests_waiting``; the fake adds
``num_requests_running``.

Values are Python floats written as vLLM writes them (``str(float)`` for
TEXT, ``json.dumps`` for JSON).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, get_args

ORCA_HEADER: Final = b"endpoint-load-metrics"
ORCA_FORMAT_HEADER: Final = b"endpoint-load-metrics-format"

LoadMetricsFormat = Literal["TEXT", "JSON"]
LOAD_METRICS_FORMATS: Final[frozenset[str]] = frozenset(get_args(LoadMetricsFormat))

MetricsFlavor = Literal["vllm", "sglang"]
METRICS_FLAVORS: Final[frozenset[str]] = frozenset(get_args(MetricsFlavor))

LoadMetricsFault = Literal[
    "huge", "nan", "inf", "negative", "many", "garbage", "empty", "no_prefix", "wrong_type"
]
"""Ways to spoil the ``endpoint-load-metrics`` header; see ``Behavior.load_metrics_fault``."""
LOAD_METRICS_FAULTS: Final[frozenset[str]] = frozenset(get_args(LoadMetricsFault))

MANY_FIELDS: Final = 10_000
"""Named metrics in a header spoiled with ``"many"``."""

PROMETHEUS_CONTENT_TYPE: Final = b"text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The load gauges at one instant."""

    running: int
    waiting: int
    kv_usage: float
    """Blocks held by running requests over the KV capacity, 0.0 to 1.0."""
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    generation_tokens_total: int = 0

    def named_metrics(self) -> list[tuple[str, float]]:
        """The ORCA named metrics: vLLM's two, then the running count."""
        return [
            ("kv_cache_usage_perc", float(self.kv_usage)),
            ("num_requests_waiting", float(self.waiting)),
            ("num_requests_running", float(self.running)),
        ]


def requested_format(value: bytes | None) -> LoadMetricsFormat | None:
    """The format a request header asks for, as vLLM reads it: TEXT, JSON or nothing."""
    if not value:
        return None
    wanted = value.decode("latin-1").strip().upper()
    return wanted if wanted in LOAD_METRICS_FORMATS else None  # type: ignore[return-value]


def orca_header(fmt: LoadMetricsFormat, metrics: Sequence[tuple[str, float]]) -> bytes:
    """The ``endpoint-load-metrics`` value for ``metrics``, as vLLM writes it."""
    if fmt == "TEXT":
        text = ", ".join(f"named_metrics.{name}={value}" for name, value in metrics)
        return ("TEXT " + text).encode("latin-1")
    return ("JSON " + json.dumps({"named_metrics": dict(metrics)})).encode("latin-1")


def spoiled_orca_header(
    fault: LoadMetricsFault, fmt: LoadMetricsFormat, snapshot: LoadSnapshot
) -> bytes:
    """A malformed ``endpoint-load-metrics`` value; see ``Behavior.load_metrics_fault``."""
    names = [name for name, _ in snapshot.named_metrics()]
    if fault == "huge":
        return orca_header(fmt, [(name, 1e308) for name in names])
    if fault == "nan":
        return orca_header(fmt, [(name, float("nan")) for name in names])
    if fault == "inf":
        return orca_header(fmt, [(name, float("inf")) for name in names])
    if fault == "negative":
        return orca_header(fmt, [(name, -1.0 - i) for i, name in enumerate(names)])
    if fault == "many":
        metrics = snapshot.named_metrics()
        metrics += [(f"m{i}", float(i)) for i in range(MANY_FIELDS - len(metrics))]
        return orca_header(fmt, metrics)
    if fault == "empty":
        return fmt.encode()
    if fault == "no_prefix":
        return orca_header(fmt, snapshot.named_metrics()).split(b" ", 1)[1]
    if fault == "wrong_type":
        if fmt == "TEXT":
            return (
                b'TEXT named_metrics.kv_cache_usage_perc="0.5", '
                b"named_metrics.num_requests_waiting=true, named_metrics.num_requests_running=[1]"
            )
        return (
            b'JSON {"named_metrics": {"kv_cache_usage_perc": "0.5", '
            b'"num_requests_waiting": null, "num_requests_running": [1]}}'
        )
    # "garbage": almost the right shape, but not parseable.
    if fmt == "TEXT":
        return (
            b"TEXT named_metrics.kv_cache_usage_perc=zero point five, "
            b"named_metrics.num_requests_waiting, =1.0, named_metrics.=2.0, ,, "
            b"named_metrics.num_requests_running==3 ;; \\x00 %ff"
        )
    return b'JSON {"named_metrics": {"kv_cache_usage_perc": 0.5, "num_requests_waiting": '


# name, type, help, the LoadSnapshot value it reports
_Family = tuple[str, str, str, str]

_VLLM_FAMILIES: Final[tuple[_Family, ...]] = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
     "running"),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
     "waiting"),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
     "kv_usage"),
    ("vllm:prefix_cache_queries_total", "counter",
     "Prefix cache queries, in terms of number of queried tokens.", "prompt_tokens_total"),
    ("vllm:prefix_cache_hits_total", "counter",
     "Prefix cache hits, in terms of number of cached tokens.", "cached_tokens_total"),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
     "prompt_tokens_total"),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
     "generation_tokens_total"),
)  # fmt: skip

_SGLANG_FAMILIES: Final[tuple[_Family, ...]] = (
    ("sglang:num_running_reqs", "gauge", "The number of running requests.", "running"),
    ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
     "waiting"),
    ("sglang:token_usage", "gauge", "The token usage.", "kv_usage"),
    ("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", "hit_rate"),
    ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
     "prompt_tokens_total"),
    ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
     "generation_tokens_total"),
)  # fmt: skip


def prometheus_text(flavor: MetricsFlavor, model: str, snapshot: LoadSnapshot) -> bytes:
    """``GET /metrics``: the load gauges and token counters in the Prometheus text format.

    vLLM's names with labels ``engine="0"`` and ``model_name``, or SGLang's
    with ``model_name``.
    """
    escaped = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    if flavor == "sglang":
        families, labels = _SGLANG_FAMILIES, f'model_name="{escaped}"'
    else:
        families, labels = _VLLM_FAMILIES, f'engine="0",model_name="{escaped}"'
    values = {
        "running": float(snapshot.running),
        "waiting": float(snapshot.waiting),
        "kv_usage": float(snapshot.kv_usage),
        "prompt_tokens_total": float(snapshot.prompt_tokens_total),
        "cached_tokens_total": float(snapshot.cached_tokens_total),
        "generation_tokens_total": float(snapshot.generation_tokens_total),
        "hit_rate": snapshot.cached_tokens_total / snapshot.prompt_tokens_total
        if snapshot.prompt_tokens_total
        else 0.0,
    }
    lines = []
    for name, kind, help_, key in families:
        lines.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n")
        lines.append(f"{name}{{{labels}}} {values[key]}\n")
    return "".join(lines).encode("utf-8")
