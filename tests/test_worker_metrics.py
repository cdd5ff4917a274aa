"""The supervisor's ``/metrics``: the workers' own series summed at scrape time, counts
of workers that left kept, gauges combined by what they mean."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from edgeproxy._observability.workermetrics import WorkerMetrics


def text(requests: float, in_flight: float, up: float, ewma: float) -> str:
    return f"""# HELP edgeproxy_requests_total Requests.
# TYPE edgeproxy_requests_total counter
edgeproxy_requests_total{{route="chat"}} {requests}
edgeproxy_requests_created{{route="chat"}} 1.7e9
# HELP edgeproxy_request_duration_seconds Time.
# TYPE edgeproxy_request_duration_seconds histogram
edgeproxy_request_duration_seconds_bucket{{le="0.1"}} {requests}
edgeproxy_request_duration_seconds_bucket{{le="+Inf"}} {requests}
edgeproxy_request_duration_seconds_count {requests}
edgeproxy_request_duration_seconds_sum {requests / 100}
# HELP edgeproxy_in_flight In flight.
# TYPE edgeproxy_in_flight gauge
edgeproxy_in_flight {in_flight}
# HELP edgeproxy_region_up Up.
# TYPE edgeproxy_region_up gauge
edgeproxy_region_up{{region="eu"}} {up}
# HELP edgeproxy_region_ewma_ttfb_seconds Latency.
# TYPE edgeproxy_region_ewma_ttfb_seconds gauge
edgeproxy_region_ewma_ttfb_seconds{{region="eu"}} {ewma}
# HELP edgeproxy_info This edgeproxy instance.
# TYPE edgeproxy_info gauge
edgeproxy_info{{pop="edge-1",version="1"}} 1.0
"""


def render(families: list) -> dict[str, float]:
    class Families:
        def collect(self) -> list:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_counters_add_up_gauges_combine_by_meaning_and_info_is_one() -> None:
    merged = WorkerMetrics()
    scraped = [(101, text(3, 2, 1, 0.2)), (102, text(4, 1, 0, 0.5))]
    got = render(merged.merge(scraped, alive=[101, 102]))
    assert got['edgeproxy_requests_total{route="chat"}'] == 7
    assert got["edgeproxy_request_duration_seconds_count"] == 7
    assert got['edgeproxy_request_duration_seconds_bucket{le="+Inf"}'] == 7
    assert got["edgeproxy_in_flight"] == 3  # amounts add up
    assert got['edgeproxy_region_up{region="eu"}'] == 0  # readiness: the least
    assert got['edgeproxy_region_ewma_ttfb_seconds{region="eu"}'] == 0.5  # latency: the most
    assert got['edgeproxy_info{pop="edge-1",version="1"}'] == 1
    assert not any("_created" in name for name in got)


def test_a_worker_that_left_keeps_its_counts_but_not_its_gauges() -> None:
    merged = WorkerMetrics()
    merged.merge([(101, text(3, 2, 1, 0.2)), (102, text(4, 1, 1, 0.5))], alive=[101, 102])
    # 102 was restarted as 103, which starts from zero.
    got = render(merged.merge([(101, text(5, 1, 1, 0.2)), (103, text(1, 1, 1, 0.1))], [101, 103]))
    assert got['edgeproxy_requests_total{route="chat"}'] == 5 + 1 + 4
    assert got["edgeproxy_request_duration_seconds_count"] == 10
    assert got["edgeproxy_in_flight"] == 2
    # And it stays counted on later scrapes.
    got = render(merged.merge([(101, text(5, 0, 1, 0.2)), (103, text(2, 0, 1, 0.1))], [101, 103]))
    assert got['edgeproxy_requests_total{route="chat"}'] == 11
