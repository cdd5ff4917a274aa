"""Load reported by model servers: ORCA response headers and Prometheus scrapes.

Pure functions, no I/O. Everything here reads what an upstream sends, so
every input is treated as hostile: anything malformed, oversized, ambiguous
or out of range is ignored (``None``, or a line skipped and counted), never
raised. The caller counts the misses and falls back to what it knows
itself (its own count of requests in flight).

Two sources:

* :func:`parse_load_header`: the ``endpoint-load-metrics`` response header
  (ORCA, Open Request Cost Aggregation). vLLM sends it when the request
  carries ``endpoint-load-metrics-format: text`` (or ``json``), as
  ``TEXT named_metrics.kv_cache_usage_perc=0.4, named_metrics.num_requests_waiting=2.0``
  or ``JSON {"named_metrics": {"kv_cache_usage_perc": 0.4, ...}}``.
* :func:`parse_scrape`: a Prometheus text exposition (``GET /metrics``) of
  vLLM or SGLang, of which only the queue, running and KV-cache gauges are read.

Both give a :class:`LoadReport`; :func:`load_score` folds one into a number
in [0, 1] and :class:`Freshness` says whether a report is recent enough to use.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, NoReturn

__all__ = [
    "Freshness",
    "LoadReport",
    "Scrape",
    "format_load_header",
    "load_score",
    "parse_load_header",
    "parse_scrape",
]

# -- limits ------------------------------------------------------------------------

# A header value longer than this (characters) is not parsed at all: vLLM's
# two metrics take about 90.
MAX_HEADER_LEN: Final = 4096
# Fields of one header (comma-separated elements in TEXT, keys of every
# object together in JSON). More is refused, not truncated.
MAX_FIELDS: Final = 64
# Longest named metric name.
MAX_NAME_LEN: Final = 128
# Longest number in TEXT form (a double's repr takes at most 24).
_MAX_NUMBER_LEN: Final = 64
# Nesting of a JSON header: the report object, and the named_metrics object in it.
_MAX_JSON_DEPTH: Final = 2
# A /metrics body longer than this (bytes) is not parsed at all.
MAX_SCRAPE_BYTES: Final = 2 * 1024 * 1024
# A longer exposition line is skipped (and counted).
MAX_SCRAPE_LINE: Final = 8192


# -- the report ----------------------------------------------------------------------

_NAME_RE: Final = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_NAME_LEN}}}")


def _in_unit(value: float) -> bool:
    return 0.0 <= value <= 1.0


def _non_negative(value: float) -> bool:
    return 0.0 <= value < math.inf


# Each field of the report, with the values it may hold.
_RANGES: Final = {
    "kv_cache_utilization": _in_unit,
    "num_requests_waiting": _non_negative,
    "num_requests_running": _non_negative,
    "cpu_utilization": _non_negative,  # ORCA: may exceed 1 past the soft limit
    "mem_utilization": _in_unit,
    "application_utilization": _non_negative,  # ORCA: may exceed 1, like cpu
    "rps_fractional": _non_negative,
    "eps": _non_negative,
}


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One model server's load, as it reported it. ``None``: not reported.

    * ``kv_cache_utilization``: fraction of the KV cache in use, in [0, 1]
      (vLLM ``kv_cache_usage_perc``, a fraction despite its name; SGLang
      ``token_usage``).
    * ``num_requests_waiting`` / ``num_requests_running``: requests queued
      and being decoded, >= 0 (floats: that is how ORCA and Prometheus carry them).
    * ``cpu_utilization``, ``mem_utilization`` (in [0, 1]),
      ``application_utilization``, ``rps_fractional``, ``eps``: the ORCA
      standard fields, all >= 0 (cpu and application utilisation may exceed 1).
    * ``named``: the other ORCA named metrics, ``(name, value)`` sorted by
      name, finite values of any sign, at most :data:`MAX_FIELDS`.

    Every value is finite, and -0.0 is stored as 0.0. The constructor checks
    all of this (``ValueError``), so a report is valid however it was made.
    """

    kv_cache_utilization: float | None = None
    num_requests_waiting: float | None = None
    num_requests_running: float | None = None
    cpu_utilization: float | None = None
    mem_utilization: float | None = None
    application_utilization: float | None = None
    rps_fractional: float | None = None
    eps: float | None = None
    named: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        for field, allowed in _RANGES.items():
            value = getattr(self, field)
            if value is None:
                continue
            if type(value) is not float or not allowed(value):
                raise ValueError(f"{field} out of range: {value!r}")
            object.__setattr__(self, field, value + 0.0)  # -0.0 -> 0.0
        try:
            named = tuple(sorted(self.named))
        except TypeError:
            raise ValueError(f"named is not (name, value) pairs: {self.named!r}") from None
        if len(named) > MAX_FIELDS:
            raise ValueError(f"more than {MAX_FIELDS} named metrics")
        names = set()
        for name, value in named:
            if type(name) is not str or not _NAME_RE.fullmatch(name):
                raise ValueError(f"bad named metric name: {name!r}")
            if name in _NAMED_FIELDS:
                raise ValueError(f"{name!r} is a field of the report, not another named metric")
            if name in names:
                raise ValueError(f"named metric {name!r} twice")
            if type(value) is not float or not math.isfinite(value):
                raise ValueError(f"named metric {name!r} not a finite float: {value!r}")
            names.add(name)
        object.__setattr__(self, "named", tuple((n, v + 0.0) for n, v in named))

    @property
    def named_metrics(self) -> dict[str, float]:
        """``named`` as a new dict."""
        return dict(self.named)

    @property
    def empty(self) -> bool:
        """Whether the report carries nothing at all (the parsers never return one)."""
        return not self.named and all(getattr(self, f) is None for f in _RANGES)


# ORCA named metrics that are fields of the report. vLLM sends
# kv_cache_usage_perc (the example in its docstring says kv_cache_utilization,
# the name GIE uses): both are read, and a header with both is ambiguous.
_NAMED_FIELDS: Final = {
    "kv_cache_usage_perc": "kv_cache_utilization",
    "kv_cache_utilization": "kv_cache_utilization",
    "num_requests_waiting": "num_requests_waiting",
    "num_requests_running": "num_requests_running",
}
# ORCA's top-level fields, as TEXT and proto JSON name them (JSON also by their
# lowerCamelCase names, as proto3 JSON parsers accept).
_TOP_FIELDS: Final = {
    "cpu_utilization": "cpu_utilization",
    "cpuUtilization": "cpu_utilization",
    "mem_utilization": "mem_utilization",
    "memUtilization": "mem_utilization",
    "application_utilization": "application_utilization",
    "applicationUtilization": "application_utilization",
    "rps_fractional": "rps_fractional",
    "rpsFractional": "rps_fractional",
    "eps": "eps",
}
# TEXT names them only the first way.
_TEXT_TOP_FIELDS: Final = frozenset(_TOP_FIELDS.values())
_NAMED_KEYS: Final = frozenset({"named_metrics", "namedMetrics"})
_NAMED_PREFIX: Final = "named_metrics."


def _build(top: Mapping[str, float], named: Mapping[str, float]) -> LoadReport | None:
    """The report of already-unique ORCA fields; None when a value or name is not allowed,
    two names mean the same field, or there is nothing."""
    fields: dict[str, float] = {}
    for key, value in top.items():
        field = _TOP_FIELDS[key]
        if field in fields or not _RANGES[field](value):
            return None
        fields[field] = value
    others: list[tuple[str, float]] = []
    for name, value in named.items():
        if not _NAME_RE.fullmatch(name) or not math.isfinite(value):
            return None
        own = _NAMED_FIELDS.get(name)
        if own is None:
            others.append((name, value))
        elif own in fields or not _RANGES[own](value):
            return None
        else:
            fields[own] = value
    if not fields and not others:
        return None
    return _report(fields, tuple(others))


def _report(fields: Mapping[str, float], named: tuple[tuple[str, float], ...] = ()) -> LoadReport:
    return LoadReport(
        kv_cache_utilization=fields.get("kv_cache_utilization"),
        num_requests_waiting=fields.get("num_requests_waiting"),
        num_requests_running=fields.get("num_requests_running"),
        cpu_utilization=fields.get("cpu_utilization"),
        mem_utilization=fields.get("mem_utilization"),
        application_utilization=fields.get("application_utilization"),
        rps_fractional=fields.get("rps_fractional"),
        eps=fields.get("eps"),
        named=named,
    )


# -- the endpoint-load-metrics header ---------------------------------------------------

_NUMBER_RE: Final = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# One TEXT element: key, "=" (vLLM) or ":" (Envoy's parser), value.
_TEXT_ITEM_RE: Final = re.compile(
    rf"([A-Za-z0-9_.\-]{{1,{len(_NAMED_PREFIX) + MAX_NAME_LEN}}})"
    rf"[ \t]*[=:][ \t]*([^ \t]{{1,{_MAX_NUMBER_LEN}}})"
)


def parse_load_header(value: str) -> LoadReport | None:
    """The report in an ``endpoint-load-metrics`` header value; None when it is unusable.

    Two forms, told apart by their prefix (case-sensitive, as Envoy's ORCA
    parser reads it):

    * ``TEXT k=v, k=v``: comma-separated ``key=value`` (``key:value``, as
      Envoy writes it, too). Keys are ORCA's top-level fields
      (``cpu_utilization``, ``mem_utilization``, ``application_utilization``,
      ``rps_fractional``, ``eps``) or ``named_metrics.<name>``; values plain
      decimal numbers (``0.4``, ``2.0``, ``1e-05``). Empty elements are skipped.
    * ``JSON {...}``: one object with those top-level fields (or their
      lowerCamelCase names) and a ``named_metrics`` object of numbers.

    ``BIN`` (base64 protobuf) and any other prefix are not read.

    The whole header is refused (None) when it is longer than
    :data:`MAX_HEADER_LEN` or has more than :data:`MAX_FIELDS` fields; when
    any value is not a number, is NaN or infinite, or is out of its field's
    range (a utilisation outside [0, 1] where ORCA bounds it, a negative queue);
    when a key is unknown, a name has characters outside ``[A-Za-z0-9_.-]``
    or is longer than :data:`MAX_NAME_LEN`; for JSON that is not an object
    of that shape, is nested deeper than that, or uses NaN/Infinity literals
    or strings for numbers; and when it carries no field at all.

    Duplicate keys are refused, not resolved ("last wins" would pick one of
    two values the server never meant to send together, for instance two
    header lines joined by a proxy). ``kv_cache_usage_perc`` and
    ``kv_cache_utilization`` name the same field, so both at once is a duplicate
    too. Envoy's ORCA parser refuses duplicates the same way.
    """
    if type(value) is not str or len(value) > MAX_HEADER_LEN:
        return None
    value = value.strip(" \t")
    form, _, body = value.partition(" ")
    if form == "TEXT":
        return _parse_text(body)
    if form == "JSON":
        return _parse_json(body)
    return None


def _number(text: str) -> float | None:
    if not _NUMBER_RE.fullmatch(text):
        return None
    number = float(text)
    return number if math.isfinite(number) else None


def _parse_text(body: str) -> LoadReport | None:
    elements = body.split(",")
    if len(elements) > MAX_FIELDS:
        return None
    top: dict[str, float] = {}
    named: dict[str, float] = {}
    for element in elements:
        element = element.strip(" \t")
        if not element:
            continue
        match = _TEXT_ITEM_RE.fullmatch(element)
        if match is None:
            return None
        key, text = match.groups()
        number = _number(text)
        if number is None:
            return None
        if key.startswith(_NAMED_PREFIX):
            target, key = named, key[len(_NAMED_PREFIX) :]
        elif key in _TEXT_TOP_FIELDS:
            target = top
        else:
            return None
        if key in target:
            return None
        target[key] = number
    return _build(top, named)


class _Refused(ValueError):
    """A JSON header past a limit, or with a key twice."""


def _refuse_constant(name: str) -> NoReturn:
    raise _Refused(name)


def _json_depth_ok(text: str) -> bool:
    """Whether the arrays and objects of ``text`` nest at most :data:`_MAX_JSON_DEPTH` deep
    (strings skipped). Checked before parsing: ``json`` would recurse once per level."""
    if text.count("{") + text.count("[") <= _MAX_JSON_DEPTH:
        return True
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
            if depth > _MAX_JSON_DEPTH:
                return False
        elif char in "}]":
            depth -= 1
    return True


def _parse_json(body: str) -> LoadReport | None:
    if not _json_depth_ok(body):
        return None
    seen = 0

    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        nonlocal seen
        seen += len(items)
        if seen > MAX_FIELDS:
            raise _Refused("fields")
        obj: dict[str, object] = {}
        for key, item in items:
            if key in obj:
                raise _Refused("duplicate key")
            obj[key] = item
        return obj

    try:
        # Integers as floats: float() of a 4000-digit integer is inf (refused
        # below), where int() would build the integer first.
        report = json.loads(
            body, object_pairs_hook=pairs, parse_constant=_refuse_constant, parse_int=float
        )
    except (ValueError, RecursionError):
        return None
    if type(report) is not dict:
        return None
    top: dict[str, float] = {}
    named: dict[str, float] = {}
    named_seen = False
    for key, item in report.items():
        if key in _NAMED_KEYS:
            if named_seen or type(item) is not dict:
                return None
            named_seen = True
            for name, number in item.items():
                if type(number) is not float or not math.isfinite(number):
                    return None
                named[name] = number
        elif key in _TOP_FIELDS:
            if type(item) is not float or not math.isfinite(item):
                return None
            top[key] = item
        else:
            return None
    return _build(top, named)


def format_load_header(report: LoadReport, form: Literal["TEXT", "JSON"] = "TEXT") -> str:
    """``report`` as an ``endpoint-load-metrics`` value, in the shape vLLM writes
    (``kv_cache_usage_perc`` for the KV cache); :func:`parse_load_header` reads it back
    as an equal report, when it fits in :data:`MAX_HEADER_LEN`. For tests and fake servers."""
    top = {
        field: value
        for field in ("cpu_utilization", "mem_utilization", "application_utilization")
        + ("rps_fractional", "eps")
        if (value := getattr(report, field)) is not None
    }
    named = {
        name: value
        for name, field in (
            ("kv_cache_usage_perc", "kv_cache_utilization"),
            ("num_requests_waiting", "num_requests_waiting"),
            ("num_requests_running", "num_requests_running"),
        )
        if (value := getattr(report, field)) is not None
    }
    named.update(report.named)
    if form == "JSON":
        return "JSON " + json.dumps({**top, "named_metrics": named})
    elements = [f"{k}={v!r}" for k, v in top.items()]
    elements += [f"{_NAMED_PREFIX}{k}={v!r}" for k, v in named.items()]
    return "TEXT " + ", ".join(elements)


# -- Prometheus scrapes -----------------------------------------------------------------

# The gauges read, and the field each feeds. Several series of one field
# (label sets: model_name, engine, tp_rank...) add up for queues, and the
# highest wins for the KV cache: a server is as full as its fullest cache.
_GAUGES: Final = {
    b"vllm:num_requests_waiting": "num_requests_waiting",
    b"vllm:num_requests_running": "num_requests_running",
    b"vllm:kv_cache_usage_perc": "kv_cache_utilization",
    b"vllm:gpu_cache_usage_perc": "kv_cache_utilization",  # vLLM before 0.10
    b"sglang:num_queue_reqs": "num_requests_waiting",
    b"sglang:num_running_reqs": "num_requests_running",
    b"sglang:token_usage": "kv_cache_utilization",
}
_MAX_FIELDS_TAKEN: Final = frozenset({"kv_cache_utilization"})
# The lines that may be samples of those gauges: only these are parsed (a
# body is mostly histogram buckets, which would cost ten times as much).
_CANDIDATE_RE: Final = re.compile(
    rb"^[ \t]*(?:" + b"|".join(re.escape(name) for name in _GAUGES) + rb")[^\n]*", re.MULTILINE
)

_METRIC_NAME_RE: Final = re.compile(rb"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL: Final = rb'[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"(?:[^"\\\n]|\\.)*"'
# A sample's label set, if any, after its name; the value (and timestamp) follow.
# Each run of blanks can be taken by one repeat only: no backtracking blow-up.
_LABELS_RE: Final = re.compile(
    rb"(?:[ \t]*\{[ \t]*(?:"
    + _LABEL
    + rb"[ \t]*(?:,[ \t]*"
    + _LABEL
    + rb"[ \t]*)*(?:,[ \t]*)?)?\})?"
)
_SAMPLE_VALUE_RE: Final = re.compile(
    rb"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?i:inf(?:inity)?)|(?i:nan)"
)
# Prometheus: integer milliseconds; OpenMetrics: seconds, any real number.
_TIMESTAMP_RE: Final = re.compile(rb"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


@dataclass(frozen=True, slots=True)
class Scrape:
    """What :func:`parse_scrape` read.

    ``report`` is None when none of the gauges was present (or usable).
    ``skipped`` counts the lines skipped: malformed, longer than
    :data:`MAX_SCRAPE_LINE`, or a gauge we read whose value is unusable (NaN,
    infinite, negative, a utilisation outside [0, 1]) or whose series came
    twice. ``oversized``: the body was longer than :data:`MAX_SCRAPE_BYTES`
    and was not read at all (``report`` None, ``skipped`` 0).
    """

    report: LoadReport | None
    skipped: int = 0
    oversized: bool = False


def parse_scrape(body: bytes | bytearray | memoryview) -> Scrape:
    """The queue, running and KV-cache gauges of a vLLM or SGLang ``/metrics`` body.

    Reads the Prometheus text format (and OpenMetrics: ``# EOF``, exemplars
    and float timestamps pass). Only the samples of these gauges are parsed,
    every other line passes unread (comments, ``HELP`` and ``TYPE``, other
    metrics, garbage); a line of theirs must be ``name{label="value",...}
    value [timestamp]``, or it is skipped and counted:

    * queued: ``vllm:num_requests_waiting``, ``sglang:num_queue_reqs`` (summed)
    * running: ``vllm:num_requests_running``, ``sglang:num_running_reqs`` (summed)
    * KV cache: ``vllm:kv_cache_usage_perc``, older vLLM's
      ``vllm:gpu_cache_usage_perc``, ``sglang:token_usage`` (the maximum)

    Sums run over the series of a metric (one per ``model_name``, per data
    parallel ``engine``...); the KV cache takes the fullest one. A series
    repeated with the same labels is counted once. A sum that overflows is
    dropped. The body is not decompressed: the caller does that first.
    """
    size = body.nbytes if isinstance(body, memoryview) else len(body)
    if size > MAX_SCRAPE_BYTES:
        return Scrape(None, 0, oversized=True)
    data = bytes(body)
    totals: dict[str, float] = {}
    seen: set[tuple[bytes, bytes]] = set()
    skipped = 0
    for candidate in _CANDIDATE_RE.finditer(data):
        line = candidate.group().strip(b" \t\r")
        name = _METRIC_NAME_RE.match(line)
        assert name is not None  # the line starts with a gauge's name
        field = _GAUGES.get(name.group())
        if field is None:  # a longer name: vllm:num_requests_waiting_by_reason...
            continue
        if len(line) > MAX_SCRAPE_LINE:
            skipped += 1
            continue
        labels = _LABELS_RE.match(line, name.end())
        assert labels is not None  # it matches the empty string
        rest = line[labels.end() :]
        if rest[:1] not in (b" ", b"\t"):
            skipped += 1
            continue
        tokens = rest.split()
        if b"#" in tokens:  # an OpenMetrics exemplar
            tokens = tokens[: tokens.index(b"#")]
        if (
            not 1 <= len(tokens) <= 2
            or not _SAMPLE_VALUE_RE.fullmatch(tokens[0])
            or (len(tokens) == 2 and not _TIMESTAMP_RE.fullmatch(tokens[1]))
        ):
            skipped += 1
            continue
        value = float(tokens[0])
        series = (name.group(), labels.group().strip(b" \t"))
        if not _RANGES[field](value) or series in seen:
            skipped += 1
            continue
        seen.add(series)
        if field in totals:
            if field in _MAX_FIELDS_TAKEN:
                totals[field] = max(totals[field], value)
            else:
                totals[field] += value
        else:
            totals[field] = value
    fields = {k: v + 0.0 for k, v in totals.items() if math.isfinite(v)}
    return Scrape(_report(fields) if fields else None, skipped)


# -- the load signal --------------------------------------------------------------------


def load_score(report: LoadReport, *, max_waiting_hint: float = 16.0) -> float | None:
    """How loaded the server is, from 0 (idle) to 1 (saturated); None when the report
    says nothing about it (the caller then uses its own in-flight count, as for a stale one).

    ``0.5 * min(1, waiting / max_waiting_hint) + 0.5 * kv_cache_utilization``

    This is what the Gateway API Inference Extension's endpoint picker (and
    llm-d's, built on it) does with the same two signals: a queue scorer
    and a KV-cache utilisation scorer, each giving a value in [0, 1], added
    with equal weights (2 and 2 in their default profile, next to the
    prefix-cache scorer). Their scores measure headroom (1 - usage for the
    KV cache, 1 for the shortest queue); this one is its complement, the
    load, so lower is better here. A sum, not the maximum: a server with a long
    queue *and* a full cache ranks below one with only either, where the
    maximum would tie them. Their queue scorer normalises each queue
    between the shortest and longest of the candidates at that moment; one
    report is scored here on its own, so the queue is normalised by a fixed
    hint instead and saturates at 1 when ``waiting >= max_waiting_hint``
    (a queue that long means "avoid" whatever its exact length).

    With only one of the two signals, the score is that one alone (its
    weight taken as 1). With neither, ORCA's utilisation stands in, as
    Envoy's and gRPC's weighted round robin read it: ``application_utilization``
    when above 0, else ``cpu_utilization``, capped at 1. The requests running
    are not used: without the server's batch size they have no scale.

    ``max_waiting_hint`` must be finite and above 0 (``ValueError``).
    """
    if not (math.isfinite(max_waiting_hint) and max_waiting_hint > 0):
        raise ValueError(f"max_waiting_hint must be finite and > 0, not {max_waiting_hint!r}")
    parts: list[float] = []
    if report.num_requests_waiting is not None:
        parts.append(min(1.0, report.num_requests_waiting / max_waiting_hint))
    if report.kv_cache_utilization is not None:
        parts.append(report.kv_cache_utilization)
    if parts:
        return sum(parts) / len(parts)
    application = report.application_utilization
    utilization = application if application else report.cpu_utilization
    return None if utilization is None else min(1.0, utilization)


@dataclass(frozen=True, slots=True)
class Freshness:
    """How old a report may be and still be used: ``max_age`` seconds, finite and above 0.

    Stamps and ``now`` come from one monotonic clock. A report from the
    future (a stamp past ``now``: clocks mixed up) is not used either.
    """

    max_age: float

    def __post_init__(self) -> None:
        if type(self.max_age) not in (int, float) or not (
            math.isfinite(self.max_age) and self.max_age > 0
        ):
            raise ValueError(f"max_age must be finite and > 0, not {self.max_age!r}")

    def usable(self, stamped_at: float, now: float) -> bool:
        """Whether a report stamped at ``stamped_at`` may still be used at ``now``."""
        age = now - stamped_at
        return 0.0 <= age <= self.max_age  # False for NaN
