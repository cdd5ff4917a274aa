"""Load reported by model servers: ORCA headers, Prometheus scrapes, the load score.

* ``endpoint-load-metrics`` in the two forms vLLM writes (TEXT and JSON),
  ORCA's standard fields, and every hostile class refused with None.
* ``/metrics`` bodies of vLLM (current and older) and SGLang: the gauges
  read, summed or maxed across series, everything else ignored, bad lines
  of those gauges skipped and counted.
* The load score's formula, and the freshness bound.
* Properties (hypothesis): nothing raises, and any report is in range.
"""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeproxy._protocol.loadmetrics import (
    MAX_FIELDS,
    MAX_HEADER_LEN,
    MAX_NAME_LEN,
    MAX_SCRAPE_BYTES,
    MAX_SCRAPE_LINE,
    Freshness,
    LoadReport,
    Scrape,
    format_load_header,
    load_score,
    parse_load_header,
    parse_scrape,
)
from edgeproxy.testing import LOAD_METRICS_FAULTS, LoadMetricsFault
from edgeproxy.testing._load import (
    LoadMetricsFormat,
    LoadSnapshot,
    MetricsFlavor,
    orca_header,
    prometheus_text,
    spoiled_orca_header,
)

PROPERTY = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)

UNIT_FIELDS = ("kv_cache_utilization", "mem_utilization")
NON_NEGATIVE_FIELDS = (
    "num_requests_waiting",
    "num_requests_running",
    "cpu_utilization",
    "application_utilization",
    "rps_fractional",
    "eps",
)


def assert_valid(report: LoadReport) -> None:
    """Every value finite and in its range: what any report handed out must hold."""
    for field in UNIT_FIELDS:
        value = getattr(report, field)
        assert value is None or (type(value) is float and 0.0 <= value <= 1.0), (field, value)
    for field in NON_NEGATIVE_FIELDS:
        value = getattr(report, field)
        assert value is None or (type(value) is float and 0.0 <= value < math.inf), (field, value)
        assert value is None or math.copysign(1.0, value) == 1.0, (field, value)
    assert len(report.named) <= MAX_FIELDS
    assert list(report.named) == sorted(report.named)
    for name, value in report.named:
        assert type(name) is str and 1 <= len(name) <= MAX_NAME_LEN
        assert type(value) is float and math.isfinite(value)
    assert not report.empty
    score = load_score(report)
    assert score is None or 0.0 <= score <= 1.0


# -- the header: what vLLM sends ------------------------------------------------------


def test_vllm_text_header() -> None:
    # vLLM's create_orca_header: f"named_metrics.{name}={value}" joined by ", ",
    # names kv_cache_usage_perc and num_requests_waiting, values Python floats.
    report = parse_load_header(
        "TEXT named_metrics.kv_cache_usage_perc=0.4, named_metrics.num_requests_waiting=2.0"
    )
    assert report == LoadReport(kv_cache_utilization=0.4, num_requests_waiting=2.0)


def test_vllm_text_header_with_the_docstring_name() -> None:
    # vLLM's docstring example, and GIE's name for it.
    report = parse_load_header("TEXT named_metrics.kv_cache_utilization=0.4")
    assert report == LoadReport(kv_cache_utilization=0.4)


def test_vllm_json_header() -> None:
    # f"JSON {json.dumps(orca_report)}" with orca_report = {"named_metrics": {...}}.
    body = {"named_metrics": {"kv_cache_usage_perc": 0.125, "num_requests_waiting": 3.0}}
    report = parse_load_header("JSON " + json.dumps(body))
    assert report == LoadReport(kv_cache_utilization=0.125, num_requests_waiting=3.0)


def test_vllm_idle_and_exponent_values() -> None:
    report = parse_load_header(
        "TEXT named_metrics.kv_cache_usage_perc=1e-05, named_metrics.num_requests_waiting=0.0"
    )
    assert report == LoadReport(kv_cache_utilization=1e-05, num_requests_waiting=0.0)
    assert load_score(report) == pytest.approx(0.5e-05)


def test_orca_standard_fields_in_text() -> None:
    # Envoy's test header: ":" separators, no spaces.
    report = parse_load_header(
        "TEXT cpu_utilization:0.7,application_utilization:0.8,mem_utilization:0.9,"
        "rps_fractional:1000,eps:2,named_metrics.foo:123,named_metrics.bar:0.2"
    )
    assert report == LoadReport(
        cpu_utilization=0.7,
        application_utilization=0.8,
        mem_utilization=0.9,
        rps_fractional=1000.0,
        eps=2.0,
        named=(("bar", 0.2), ("foo", 123.0)),
    )
    assert report.named_metrics == {"bar": 0.2, "foo": 123.0}


def test_orca_standard_fields_in_json_either_spelling() -> None:
    report = parse_load_header(
        'JSON {"cpuUtilization": 1.5, "mem_utilization": 0.25, "rpsFractional": 10,'
        ' "namedMetrics": {"num_requests_running": 7, "queue_ms": -3.5}}'
    )
    assert report == LoadReport(
        cpu_utilization=1.5,  # ORCA: above 1 past the soft limit
        mem_utilization=0.25,
        rps_fractional=10.0,
        num_requests_running=7.0,
        named=(("queue_ms", -3.5),),
    )


def test_blanks_and_empty_elements_are_allowed() -> None:
    report = parse_load_header(
        " \tTEXT  named_metrics.num_requests_waiting = 4 ,, named_metrics.x=.5 , \t"
    )
    assert report == LoadReport(num_requests_waiting=4.0, named=(("x", 0.5),))


def test_negative_zero_is_zero() -> None:
    report = parse_load_header("TEXT named_metrics.num_requests_waiting=-0.0")
    assert report is not None and math.copysign(1.0, report.num_requests_waiting or 1.0) == 1.0


@pytest.mark.parametrize("form", ["TEXT", "JSON"])
def test_format_reads_back(form: str) -> None:
    report = LoadReport(
        kv_cache_utilization=0.3,
        num_requests_waiting=5.0,
        num_requests_running=12.0,
        cpu_utilization=0.1,
        eps=0.0,
        named=(("lora_adapters", 2.0), ("z", -1e-300)),
    )
    header = format_load_header(report, form)  # type: ignore[arg-type]
    assert header.startswith(form + " ")
    assert parse_load_header(header) == report


def test_exactly_the_limits_pass() -> None:
    fields = ", ".join(f"named_metrics.m{i}=1" for i in range(MAX_FIELDS))
    report = parse_load_header("TEXT " + fields)
    assert report is not None and len(report.named) == MAX_FIELDS
    name = "n" * MAX_NAME_LEN
    assert parse_load_header(f"TEXT named_metrics.{name}=1") == LoadReport(named=((name, 1.0),))
    padded = "TEXT named_metrics.num_requests_waiting=1" + " " * MAX_HEADER_LEN
    assert parse_load_header(padded[:MAX_HEADER_LEN]) == LoadReport(num_requests_waiting=1.0)


# -- the header: hostile input ----------------------------------------------------------

WAIT = "named_metrics.num_requests_waiting"
KV = "named_metrics.kv_cache_usage_perc"

HOSTILE_HEADERS = {
    # size
    "too long": f"TEXT {WAIT}=1" + " " * MAX_HEADER_LEN,
    "too many fields": "TEXT " + ",".join(f"named_metrics.m{i}=1" for i in range(MAX_FIELDS + 1)),
    "10,000 fields": "TEXT " + ",".join(f"named_metrics.m{i}=1" for i in range(10_000)),
    "10,000 commas": "TEXT " + "," * 10_000,
    "65 empty elements": "TEXT " + "," * MAX_FIELDS + f"{WAIT}=1",
    "json too many fields": "JSON "
    + json.dumps({"named_metrics": {f"m{i}": 1 for i in range(MAX_FIELDS)}}),
    "name too long": f"TEXT named_metrics.{'n' * (MAX_NAME_LEN + 1)}=1",
    "number too long": f"TEXT {WAIT}=" + "1" * 65,
    # values
    "nan": f"TEXT {WAIT}=nan",
    "NaN": f"TEXT {KV}=NaN",
    "inf": f"TEXT {WAIT}=inf",
    "-inf": "TEXT named_metrics.x=-inf",
    "overflow to inf": f"TEXT {WAIT}=1e999",
    "negative queue": f"TEXT {WAIT}=-1",
    "negative running": "TEXT named_metrics.num_requests_running=-0.5",
    "kv above 1": f"TEXT {KV}=1.5",
    "kv negative": f"TEXT {KV}=-0.1",
    "mem above 1": "TEXT mem_utilization=1.01",
    "negative cpu": "TEXT cpu_utilization=-1",
    "negative eps": "TEXT eps=-2",
    "not a number": f"TEXT {WAIT}=abc",
    "hex": f"TEXT {WAIT}=0x10",
    "underscores": f"TEXT {WAIT}=1_000",
    "arabic digits": f"TEXT {WAIT}=\u0661",
    "quoted": f'TEXT {WAIT}="2"',
    "empty value": f"TEXT {WAIT}=",
    "two values": f"TEXT {WAIT}=1 2",
    # keys
    "no separator": f"TEXT {WAIT}",
    "empty key": "TEXT =1",
    "empty name": "TEXT named_metrics.=1",
    "bad name character": "TEXT named_metrics.a/b=1",
    "unknown field": "TEXT request_cost.db=1",
    "camelCase in text": "TEXT cpuUtilization=0.5",
    "two separators": f"TEXT {WAIT}==1",
    # duplicates
    "duplicate key": f"TEXT {WAIT}=1, {WAIT}=2",
    "duplicate identical": f"TEXT {WAIT}=1, {WAIT}=1",
    "both kv names": f"TEXT {KV}=0.1, named_metrics.kv_cache_utilization=0.1",
    "json duplicate top key": 'JSON {"eps": 1, "eps": 2}',
    "json duplicate named key": 'JSON {"named_metrics": {"a": 1, "a": 2}}',
    "json both spellings": 'JSON {"cpu_utilization": 1, "cpuUtilization": 1}',
    "json named twice": 'JSON {"named_metrics": {"a": 1}, "namedMetrics": {"b": 1}}',
    "two header lines joined": f"TEXT {WAIT}=1, TEXT {WAIT}=2",
    # JSON
    "bad json": 'JSON {"named_metrics": {',
    "json trailing garbage": 'JSON {"eps": 1} x',
    "json array": "JSON [1, 2]",
    "json string": 'JSON "eps"',
    "json number": "JSON 1",
    "json null": "JSON null",
    "json empty object": "JSON {}",
    "json empty named": 'JSON {"named_metrics": {}}',
    "json NaN literal": 'JSON {"eps": NaN}',
    "json Infinity literal": 'JSON {"named_metrics": {"a": -Infinity}}',
    "json number overflow": 'JSON {"eps": 1e400}',
    "json huge integer": 'JSON {"eps": ' + "9" * 4000 + "}",
    "json string number": 'JSON {"eps": "1"}',
    "json bool": 'JSON {"named_metrics": {"num_requests_waiting": true}}',
    "json null value": 'JSON {"eps": null}',
    "json named not an object": 'JSON {"named_metrics": [1]}',
    "json nested value": 'JSON {"named_metrics": {"a": {"b": 1}}}',
    "json deep": "JSON " + "[" * 3000 + "]" * 3000,
    "json deep objects": "JSON " + '{"a":' * 1000 + "1" + "}" * 1000,
    "json deep unterminated": "JSON " + "{" * 4000,
    "json unknown key": 'JSON {"rps": 3}',
    "json bad name": 'JSON {"named_metrics": {"a b": 1}}',
    "json kv above 1": 'JSON {"named_metrics": {"kv_cache_usage_perc": 2}}',
    # prefix and shape
    "empty": "",
    "blank": "   ",
    "text alone": "TEXT",
    "text and a space": "TEXT ",
    "only commas": "TEXT , ,",
    "bin": "BIN CgoJAAAAAAAA8D8=",
    "lower-case prefix": f"text {WAIT}=1",
    "no prefix": f"{WAIT}=1",
    "prefix glued": f"TEXT{WAIT}=1",
    "unknown prefix": "BAD random-value",
    "binary": "\x00\xff\x01TEXT \x7f" + "\x00" * 100,
    "surrogates": f"TEXT {WAIT}=1\udcff",
    "newline": f"TEXT {WAIT}=1\r\n{KV}=0.5",
}


@pytest.mark.parametrize("value", HOSTILE_HEADERS.values(), ids=HOSTILE_HEADERS.keys())
def test_hostile_headers_are_refused(value: str) -> None:
    assert parse_load_header(value) is None


@pytest.mark.parametrize("value", [None, b"TEXT named_metrics.x=1", 1.0, ["TEXT"]])
def test_a_header_that_is_not_a_string(value: object) -> None:
    assert parse_load_header(value) is None  # type: ignore[arg-type]


# -- the test kit's fake region ---------------------------------------------------------

SNAPSHOT = LoadSnapshot(running=4, waiting=2, kv_usage=0.25)


@pytest.mark.parametrize("fmt", ["TEXT", "JSON"])
def test_the_fake_regions_header_reads(fmt: LoadMetricsFormat) -> None:
    header = orca_header(fmt, SNAPSHOT.named_metrics()).decode("latin-1")
    assert parse_load_header(header) == LoadReport(
        kv_cache_utilization=0.25, num_requests_waiting=2.0, num_requests_running=4.0
    )


@pytest.mark.parametrize("fmt", ["TEXT", "JSON"])
@pytest.mark.parametrize("fault", sorted(LOAD_METRICS_FAULTS))
def test_the_fake_regions_spoiled_headers_are_refused(
    fault: LoadMetricsFault, fmt: LoadMetricsFormat
) -> None:
    header = spoiled_orca_header(fault, fmt, SNAPSHOT).decode("latin-1")
    assert parse_load_header(header) is None


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_the_fake_regions_metrics_read(flavor: MetricsFlavor) -> None:
    body = prometheus_text(flavor, 'org/model "x"\\', SNAPSHOT)
    assert parse_scrape(body) == Scrape(
        LoadReport(kv_cache_utilization=0.25, num_requests_waiting=2.0, num_requests_running=4.0)
    )


# -- the report itself ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_cache_utilization": 1.01},
        {"kv_cache_utilization": math.nan},
        {"num_requests_waiting": -1.0},
        {"num_requests_running": math.inf},
        {"cpu_utilization": 1},  # an int, not a float
        {"eps": True},
        {"named": (("a", math.nan),)},
        {"named": (("a b", 1.0),)},
        {"named": (("a", 1.0), ("a", 2.0))},
        {"named": (("kv_cache_usage_perc", 0.5),)},
        {"named": tuple((f"m{i}", 1.0) for i in range(MAX_FIELDS + 1))},
        {"named": (("a", 1.0), (2, 1.0))},
    ],
)
def test_report_checks_its_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LoadReport(**kwargs)  # type: ignore[arg-type]


def test_report_sorts_named_and_is_hashable() -> None:
    report = LoadReport(named=(("b", 2.0), ("a", 1.0)))
    assert report.named == (("a", 1.0), ("b", 2.0))
    assert hash(report) == hash(LoadReport(named=(("a", 1.0), ("b", 2.0))))
    assert LoadReport().empty and not report.empty


# -- Prometheus scrapes -------------------------------------------------------------------

MODEL = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'

# Shaped like vLLM 0.10's /metrics (V1 engine, two data-parallel engines):
# process and GC metrics, HELP/TYPE lines, counters, histograms, an info gauge.
VLLM_METRICS = f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12027.0
python_gc_objects_collected_total{{generation="1"}} 1503.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.147483648e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{MODEL}}} 3.0
vllm:num_requests_running{{engine="1",{MODEL}}} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{MODEL}}} 2.0
vllm:num_requests_waiting{{engine="1",{MODEL}}} 7.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{{engine="0",{MODEL},reason="capacity"}} 100.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} 0.4172
vllm:kv_cache_usage_perc{{engine="1",{MODEL}}} 0.6525
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",{MODEL}}} 18432.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",{MODEL}}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.5",{MODEL}}} 40.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{MODEL}}} 42.0
vllm:time_to_first_token_seconds_count{{engine="0",{MODEL}}} 42.0
vllm:time_to_first_token_seconds_sum{{engine="0",{MODEL}}} 7.31
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="27"}} 1.0
""".encode()

# Shaped like SGLang's /metrics (--enable-metrics), two models behind one exporter.
SGLANG_METRICS = b"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen/qwen2.5-7b"} 4.0
sglang:num_running_reqs{model_name="qwen/qwen2.5-0.5b"} 1.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen/qwen2.5-7b"} 6.0
sglang:num_queue_reqs{model_name="qwen/qwen2.5-0.5b"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen/qwen2.5-7b"} 0.28
sglang:token_usage{model_name="qwen/qwen2.5-0.5b"} 0.05
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="qwen/qwen2.5-7b"} 812.4
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="qwen/qwen2.5-7b"} 0.61
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="qwen/qwen2.5-7b"} 1.024e+06
"""

OLD_VLLM_METRICS = b"""\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="facebook/opt-125m"} 0.9
# HELP vllm:cpu_cache_usage_perc CPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{model_name="facebook/opt-125m"} 0.0
vllm:num_requests_waiting{model_name="facebook/opt-125m"} 12.0
vllm:num_requests_swapped{model_name="facebook/opt-125m"} 3.0
"""


def test_vllm_scrape() -> None:
    scrape = parse_scrape(VLLM_METRICS)
    assert scrape == Scrape(
        LoadReport(kv_cache_utilization=0.6525, num_requests_waiting=9.0, num_requests_running=8.0),
        skipped=0,
    )
    # 0.5 * min(1, 9 / 16) + 0.5 * 0.6525
    assert load_score(scrape.report) == pytest.approx(0.5 * 9 / 16 + 0.5 * 0.6525)  # type: ignore[arg-type]


def test_sglang_scrape() -> None:
    scrape = parse_scrape(SGLANG_METRICS)
    assert scrape.report == LoadReport(
        kv_cache_utilization=0.28, num_requests_waiting=6.0, num_requests_running=5.0
    )
    assert scrape.skipped == 0 and not scrape.oversized


def test_older_vllm_scrape() -> None:
    scrape = parse_scrape(OLD_VLLM_METRICS)
    assert scrape.report == LoadReport(kv_cache_utilization=0.9, num_requests_waiting=12.0)


def test_scrape_line_endings_timestamps_and_exemplars() -> None:
    body = (
        b"# TYPE vllm:num_requests_waiting gauge\r\n"
        b'vllm:num_requests_waiting{engine="0"} 2 1718000000000\r\n'
        b'  vllm:num_requests_running {engine="0", model_name="a\\"b\\\\c,}"} 1.5e0 1.7e9\r\n'
        b'vllm:kv_cache_usage_perc{engine="0",} .25 # {trace_id="abc"} 0.25\r\n'
        b"vllm:num_requests_waiting\t3\r\n"
        b"# EOF\r\n"
    )
    scrape = parse_scrape(body)
    assert scrape == Scrape(
        LoadReport(kv_cache_utilization=0.25, num_requests_waiting=5.0, num_requests_running=1.5)
    )


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_scrape_takes_any_buffer(kind: type) -> None:
    assert parse_scrape(kind(SGLANG_METRICS)) == parse_scrape(SGLANG_METRICS)


BAD_SAMPLES = {
    "no value": b"vllm:num_requests_waiting",
    "no value after labels": b'vllm:num_requests_waiting{engine="0"}',
    "value glued": b'vllm:num_requests_waiting{engine="0"}1',
    "not a number": b"vllm:num_requests_waiting abc",
    "three tokens": b"vllm:num_requests_waiting 1 2 3",
    "bad timestamp": b"vllm:num_requests_waiting 1 soon",
    "unclosed labels": b'vllm:num_requests_waiting{engine="0" 1',
    "unquoted label": b"vllm:num_requests_waiting{engine=0} 1",
    "unterminated label value": b'vllm:num_requests_waiting{engine="0} 1',
    "label without name": b'vllm:num_requests_waiting{="0"} 1',
    "NaN": b"vllm:num_requests_waiting NaN",
    "+Inf": b"vllm:num_requests_running +Inf",
    "negative queue": b"vllm:num_requests_waiting -1",
    "kv above 1": b"vllm:kv_cache_usage_perc 1.5",
    "kv NaN": b"sglang:token_usage nan",
    "too long": b'vllm:num_requests_waiting{a="' + b"x" * MAX_SCRAPE_LINE + b'"} 1',
}


@pytest.mark.parametrize("line", BAD_SAMPLES.values(), ids=BAD_SAMPLES.keys())
def test_a_bad_sample_of_a_gauge_is_skipped_and_counted(line: bytes) -> None:
    body = SGLANG_METRICS + line + b"\n"
    scrape = parse_scrape(body)
    assert scrape.skipped == 1
    assert scrape.report == parse_scrape(SGLANG_METRICS).report


def test_a_repeated_series_counts_once() -> None:
    line = b'vllm:num_requests_waiting{engine="0"} 4\n'
    scrape = parse_scrape(line + line + b'vllm:num_requests_waiting{engine="1"} 1\n')
    assert scrape == Scrape(LoadReport(num_requests_waiting=5.0), skipped=1)


def test_other_metrics_and_garbage_are_passed_over() -> None:
    body = (
        b"<html><body>502 Bad Gateway</body></html>\n"
        b"vllm:num_requests_waiting_total 99\n"
        b"vllm:num_requests_waiting:rate5m 99\n"
        b"xvllm:num_requests_waiting 99\n"
        b"# vllm:num_requests_waiting 99\n"
        b"some_metric{broken 1\n"
        b"\xff\xfe\x00\x01\n"
        b"vllm:num_requests_running 2\n"
    )
    assert parse_scrape(body) == Scrape(LoadReport(num_requests_running=2.0))


@pytest.mark.parametrize(
    "body",
    [b"", b"\n\n", b"# HELP x\n# TYPE x gauge\nx 1\n", b"\x00" * 1000, b"\xff" * 5000],
    ids=["empty", "blank", "other metrics", "zeros", "binary"],
)
def test_a_scrape_without_the_gauges_has_no_report(body: bytes) -> None:
    assert parse_scrape(body) == Scrape(None)


def test_an_oversized_scrape_is_not_read() -> None:
    body = VLLM_METRICS + b"#" * (MAX_SCRAPE_BYTES - len(VLLM_METRICS) + 1)
    assert parse_scrape(body) == Scrape(None, 0, oversized=True)
    assert parse_scrape(body[:-1]).report == parse_scrape(VLLM_METRICS).report


def test_a_sum_that_overflows_is_dropped() -> None:
    body = b"".join(b'vllm:num_requests_waiting{e="%d"} 1e308\n' % i for i in range(3))
    body += b"vllm:num_requests_running 1\n"
    assert parse_scrape(body) == Scrape(LoadReport(num_requests_running=1.0))


@pytest.mark.parametrize(
    "line",
    [
        b"vllm:num_requests_waiting" + b" " * 8000 + b"x",
        b"vllm:num_requests_waiting{" + b" " * 8000,
        b'vllm:num_requests_waiting{a="b"' + b" " * 8000,
        b'vllm:num_requests_waiting{a="b",' + b" " * 8000,
        b'vllm:num_requests_waiting{b="' + b'\\"' * 4000,
        b"vllm:num_requests_waiting{" + b'b="",' * 1300,
    ],
    ids=["blanks", "open brace", "after a label", "after a comma", "escapes", "labels"],
)
def test_hostile_scrapes_take_linear_time(line: bytes) -> None:
    body = (line + b"\n") * (MAX_SCRAPE_BYTES // (len(line) + 1))
    started = time.perf_counter()
    scrape = parse_scrape(body)
    # About 0.1 s at worst here; backtracking would take minutes.
    assert time.perf_counter() - started < 5.0
    assert scrape.report is None and scrape.skipped > 0


# -- the load score ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("report", "score"),
    [
        (LoadReport(num_requests_waiting=0.0, kv_cache_utilization=0.0), 0.0),
        (LoadReport(num_requests_waiting=4.0, kv_cache_utilization=0.5), 0.5 * 0.25 + 0.5 * 0.5),
        (LoadReport(num_requests_waiting=16.0, kv_cache_utilization=1.0), 1.0),
        (LoadReport(num_requests_waiting=1e6, kv_cache_utilization=0.2), 0.5 + 0.1),
        (LoadReport(num_requests_waiting=8.0), 0.5),
        (LoadReport(kv_cache_utilization=0.7, num_requests_running=100.0), 0.7),
        (LoadReport(cpu_utilization=0.4), 0.4),
        (LoadReport(cpu_utilization=3.0), 1.0),
        (LoadReport(application_utilization=0.6, cpu_utilization=0.9), 0.6),
        (LoadReport(application_utilization=0.0, cpu_utilization=0.9), 0.9),
        (LoadReport(num_requests_running=5.0), None),
        (LoadReport(named=(("x", 1.0),)), None),
    ],
)
def test_load_score(report: LoadReport, score: float | None) -> None:
    assert load_score(report) == (None if score is None else pytest.approx(score))


def test_load_score_hint() -> None:
    report = LoadReport(num_requests_waiting=4.0, kv_cache_utilization=0.0)
    assert load_score(report, max_waiting_hint=4.0) == 0.5
    assert load_score(report, max_waiting_hint=64.0) == pytest.approx(0.5 * 4 / 64)
    for hint in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            load_score(report, max_waiting_hint=hint)


def test_a_busier_server_scores_higher() -> None:
    idle = parse_load_header(
        "TEXT named_metrics.kv_cache_usage_perc=0.1, named_metrics.num_requests_waiting=0.0"
    )
    busy = parse_load_header(
        "TEXT named_metrics.kv_cache_usage_perc=0.1, named_metrics.num_requests_waiting=3.0"
    )
    full = parse_load_header(
        "TEXT named_metrics.kv_cache_usage_perc=0.9, named_metrics.num_requests_waiting=3.0"
    )
    assert idle and busy and full
    assert load_score(idle) < load_score(busy) < load_score(full)  # type: ignore[operator]


# -- freshness ----------------------------------------------------------------------------


def test_freshness() -> None:
    fresh = Freshness(max_age=2.0)
    assert fresh.usable(100.0, 100.0)
    assert fresh.usable(100.0, 102.0)
    assert not fresh.usable(100.0, 102.001)
    assert not fresh.usable(100.0, 99.0)  # from the future
    assert not fresh.usable(math.nan, 100.0)
    assert not fresh.usable(100.0, math.inf)
    assert Freshness(1).usable(0.0, 1.0)


@pytest.mark.parametrize("max_age", [0.0, -1.0, math.nan, math.inf, True, "1"])
def test_freshness_bound_must_be_positive_and_finite(max_age: object) -> None:
    with pytest.raises(ValueError):
        Freshness(max_age)  # type: ignore[arg-type]


# -- properties ---------------------------------------------------------------------------

_KEYS = st.sampled_from(
    [
        WAIT,
        KV,
        "named_metrics.kv_cache_utilization",
        "named_metrics.num_requests_running",
        "named_metrics.other",
        "cpu_utilization",
        "mem_utilization",
        "application_utilization",
        "rps_fractional",
        "eps",
        "rps",
        "named_metrics.",
    ]
)
_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats(min_value=0, max_value=1).map(str),
    st.integers(min_value=-5, max_value=10**30).map(str),
    st.sampled_from(["", "nan", "-0", ".5", "1.", "1e-05", "abc", '"1"', "true"]),
)
_ELEMENTS = st.tuples(_KEYS, st.sampled_from(["=", ":", " = ", "=="]), _VALUES).map("".join)


@st.composite
def near_headers(draw: st.DrawFn) -> str:
    """Headers close to valid ones: real keys, values of every kind, both forms."""
    pairs = draw(st.lists(st.tuples(_KEYS, _VALUES), max_size=8))
    if draw(st.booleans()):
        return "TEXT " + draw(st.sampled_from([",", ", ", " ,"])).join(
            draw(st.lists(_ELEMENTS, max_size=8))
        )
    top = {k: v for k, v in pairs if not k.startswith("named_metrics.")}
    named = {k.removeprefix("named_metrics."): v for k, v in pairs if k not in top}
    items = [f'"{k}": {v or "null"}' for k, v in top.items()]
    items.append('"named_metrics": {' + ", ".join(f'"{k}": {v or 0}' for k, v in named.items()))
    return "JSON {" + ", ".join(items) + "}}"


@PROPERTY
@given(value=st.one_of(st.text(), st.text().map(lambda t: "TEXT " + t), near_headers()))
def test_parse_load_header_never_raises_and_stays_in_range(value: str) -> None:
    report = parse_load_header(value)
    if report is not None:
        assert_valid(report)
        assert parse_load_header(value) == report


@PROPERTY
@given(
    kv=st.none() | st.floats(0, 1),
    waiting=st.none() | st.floats(0, 1e12),
    cpu=st.none() | st.floats(0, 64),
    named=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_.\-]{0,20}", fullmatch=True),
        st.floats(allow_nan=False, allow_infinity=False),
        max_size=8,
    ),
    form=st.sampled_from(["TEXT", "JSON"]),
)
def test_any_report_formats_and_reads_back(
    kv: float | None,
    waiting: float | None,
    cpu: float | None,
    named: dict[str, float],
    form: str,
) -> None:
    named = {k: v for k, v in named.items() if k not in ("kv_cache_usage_perc",)}
    report = LoadReport(
        kv_cache_utilization=kv,
        num_requests_waiting=waiting,
        cpu_utilization=cpu,
        named=tuple((k, v) for k, v in named.items() if not k.startswith("num_requests_")),
    )
    if report.empty:
        return
    assert parse_load_header(format_load_header(report, form)) == report  # type: ignore[arg-type]


_SCRAPE_LINES = st.one_of(
    st.binary(max_size=40),
    st.tuples(
        st.sampled_from(
            [
                b"vllm:num_requests_waiting",
                b"vllm:num_requests_running",
                b"vllm:kv_cache_usage_perc",
                b"sglang:token_usage",
                b"sglang:num_queue_reqs",
                b"other",
            ]
        ),
        st.sampled_from([b"", b"{}", b'{a="1"}', b'{a="2",b="x"}', b"{a=1}", b"{"]),
        st.sampled_from([b" ", b"\t", b""]),
        _VALUES.map(str.encode),
        st.sampled_from([b"", b" 123", b" x", b' # {a="b"} 1']),
    ).map(b"".join),
)


@PROPERTY
@given(lines=st.lists(_SCRAPE_LINES, max_size=20))
def test_parse_scrape_never_raises_and_stays_in_range(lines: list[bytes]) -> None:
    body = b"\n".join(lines)
    scrape = parse_scrape(body)
    assert 0 <= scrape.skipped <= body.count(b"\n") + 1
    assert not scrape.oversized
    if scrape.report is not None:
        assert_valid(scrape.report)
        assert scrape.report.named == () and scrape.report.cpu_utilization is None
