"""What ``edgeproxy status`` and ``edgeproxy top`` draw from the admin ``/status`` JSON.

Rendering only, on rich: every function takes the decoded ``/status`` of a single process
or of a supervisor (which adds ``workers`` and ``supervisor``) and returns something a rich
console prints. Missing sections (metrics off, an older proxy) read as ``-``, never fail.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["header", "regions_table", "sparkline", "status_view", "top_view", "workers_table"]

_BARS = "▁▂▃▄▅▆▇█"
# A slot of the recent window with no request in it.
_EMPTY = "·"


def _num(value: Any, digits: int = 1) -> str:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _pct(value: Any) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    return f"{value * 100:.1f}%"


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _health(region: dict[str, Any]) -> Text:
    health = _dict(region.get("health"))
    if health.get("ejected"):
        return Text(f"ejected {_num(health.get('ejected_for_s'))}s", style="red")
    if health.get("breaker_open"):
        return Text("breaker open", style="red")
    if health.get("available") is False:
        error = health.get("last_check_error")
        return Text("unavailable" + (f": {error}" if error else ""), style="red")
    if health:
        return Text("ok", style="green")
    return Text("-")


def _state(region: dict[str, Any]) -> Text:
    state = str(region.get("state", "-"))
    return Text(state, style="green" if state == "up" else "yellow" if state == "-" else "red")


def cache_hit_ratio(status: dict[str, Any]) -> Any:
    """The cache's hit ratio: the cache section's, else the recent window's."""
    ratio = _dict(status.get("cache")).get("hit_ratio")
    if ratio is None:
        ratio = _dict(_dict(status.get("recent")).get("cache")).get("hit_ratio")
    return ratio


def header(status: dict[str, Any]) -> Text:
    """The PoP's state, recent traffic and percentiles, the cache and the local model."""
    text = Text()
    ready = status.get("ready")
    text.append(f"PoP {status.get('pop', '-')}  ", style="bold")
    text.append("ready" if ready else "NOT READY", style="green" if ready else "bold red")
    if status.get("draining"):
        text.append("  draining", style="yellow")
    text.append(
        f"  uptime {_num(status.get('uptime_s'), 0)}s  in flight {_num(status.get('in_flight'))}"
    )
    recent = _dict(status.get("recent"))
    if recent:
        latency = _dict(recent.get("latency_ms"))
        ttfb = _dict(recent.get("ttfb_ms"))
        text.append(
            f"\nlast {_num(recent.get('window_s'), 0)}s: {_num(recent.get('requests'))} requests,"
            f" {_num(recent.get('errors'))} errors"
            f"\n  latency ms p50 {_num(latency.get('p50'))} p95 {_num(latency.get('p95'))}"
            f" p99 {_num(latency.get('p99'))}; TTFB ms p50 {_num(ttfb.get('p50'))}"
            f" p95 {_num(ttfb.get('p95'))} p99 {_num(ttfb.get('p99'))}"
        )
    cache = _dict(status.get("cache"))
    if cache:
        enabled = cache.get("enabled", True)
        text.append(
            f"\ncache: {cache.get('backend', '-') if enabled else 'off'},"
            f" hit ratio {_pct(cache_hit_ratio(status))},"
            f" entries {_num(_dict(cache.get('tiers')).get('entries'))}"
        )
    model = _dict(_dict(status.get("fallback")).get("local_model"))
    if model:
        text.append(
            f"\nlocal model: {model.get('state', '-')} ({model.get('model', '-')}),"
            f" busy {_num(model.get('busy'))}, waiting {_num(model.get('waiting'))},"
            f" answered {_num(model.get('answered_total'))}"
        )
        if model.get("error"):
            text.append(f", error: {model['error']}", style="red")
    shed = _dict(_dict(status.get("admission")).get("shed"))
    if shed:
        text.append(
            "\nadmission: shed "
            + ", ".join(f"{name} {_num(count)}" for name, count in sorted(shed.items()))
        )
    reload = _dict(_dict(status.get("supervisor")).get("last_reload"))
    if reload and not reload.get("reloaded"):
        text.append(
            "\nlast reload refused: " + "; ".join(map(str, reload.get("errors") or [])),
            style="red",
        )
    return text


def _table(title: str) -> Table:
    # No vertical rules and two-line headers: the regions fit in 80 columns.
    return Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
        expand=False,
    )


def regions_table(status: dict[str, Any]) -> Table:
    """One row a region: state, health, latency, load and counters."""
    table = _table("regions")
    table.add_column("region", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("health", no_wrap=True)
    for name in ("EWMA\nms", "p95 TTFB\nms", "in\nflight", "share", "requests", "errors"):
        table.add_column(name, justify="right", no_wrap=True)
    regions = status.get("regions")
    for region in regions if isinstance(regions, list) else []:
        region = _dict(region)
        latency = _dict(region.get("latency"))
        table.add_row(
            str(region.get("name", "-")),
            _state(region),
            _health(region),
            _num(latency.get("ewma_ms")),
            _num(latency.get("p95_ttfb_ms")),
            _num(region.get("in_flight")),
            _pct(region.get("share")),
            _num(region.get("requests_total")),
            _num(region.get("errors_total")),
        )
    return table


def workers_table(status: dict[str, Any]) -> Table | None:
    """The supervisor's workers, or None for a single process."""
    workers = status.get("workers")
    if not isinstance(workers, list):
        return None
    supervisor = _dict(status.get("supervisor"))
    title = (
        f"workers (supervisor pid {_num(supervisor.get('pid'))},"
        f" generation {_num(supervisor.get('generation'))})"
    )
    table = _table(title)
    for name in ("worker", "pid", "gen", "ready", "in\nflight", "requests", "restarts"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("last exit", no_wrap=True)
    for worker in workers:
        worker = _dict(worker)
        ready = worker.get("ready")
        answering = worker.get("answering", True)
        table.add_row(
            _num(worker.get("index")),
            _num(worker.get("pid")),
            _num(worker.get("generation")),
            Text(
                "yes" if ready else ("no" if answering else "no answer"),
                style="green" if ready else "red",
            ),
            _num(worker.get("in_flight")),
            _num(worker.get("requests_total")),
            _num(worker.get("restarts")),
            str(worker.get("last_exit") or "-"),
        )
    return table


def status_view(status: dict[str, Any]) -> RenderableType:
    """What ``edgeproxy status`` prints."""
    parts: list[RenderableType] = [header(status), regions_table(status)]
    workers = workers_table(status)
    if workers is not None:
        parts.append(workers)
    return Group(*parts)


def sparkline(values: Sequence[float | None], top: float | None = None) -> str:
    """One character a value, from ``▁`` to ``█`` of ``top`` (the largest value by default);
    ``·`` where there is none."""
    present = [v for v in values if v is not None and math.isfinite(v)]
    if top is None:
        top = max(present, default=0.0)
    out = []
    for value in values:
        if value is None or not math.isfinite(value):
            out.append(_EMPTY)
        elif top <= 0:
            out.append(_BARS[0])
        else:
            index = round(min(value, top) / top * (len(_BARS) - 1))
            out.append(_BARS[max(0, index)])
    return "".join(out)


def _series_table(status: dict[str, Any], width: int) -> Table:
    recent = _dict(status.get("recent"))
    series = [_dict(p) for p in recent.get("series") or [] if isinstance(p, dict)]
    series = series[-max(1, width) :]
    step = recent.get("step_s")
    table = _table(f"latency, {len(series)} x {_num(step, 0)}s, oldest first")
    table.add_column("", no_wrap=True)
    table.add_column("now ms", justify="right", no_wrap=True)
    table.add_column("trend (p50, p95, p99 on one scale)", no_wrap=True)
    lines = {q: [_float(p.get(f"{q}_ms")) for p in series] for q in ("p50", "p95", "p99")}
    top = max((v for vs in lines.values() for v in vs if v is not None), default=0.0)
    for name, values in lines.items():
        last = next((v for v in reversed(values) if v is not None), None)
        table.add_row(name, _num(last), sparkline(values, top))
    requests = [_float(p.get("requests")) for p in series]
    rate = [None if v is None or not step else v / float(step) for v in requests]
    last_rate = next((v for v in reversed(rate) if v is not None), None)
    table.add_row("req/s", _num(last_rate), sparkline(rate))
    return table


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def top_view(
    status: dict[str, Any] | None,
    *,
    admin: str,
    updated: str,
    error: str | None,
    width: int,
    live: bool = True,
) -> RenderableType:
    """One frame of ``edgeproxy top``: the status view with the latency sparklines; the
    last good ``status`` with the error above it when the admin stopped answering.
    ``live``: frames follow until Ctrl-C, which the frame says (not for ``--once``)."""
    title = Text(f"edgeproxy top  {admin}  {updated}", style="bold reverse")
    parts: list[RenderableType] = [title]
    if error is not None:
        parts.append(Text(error, style="bold red"))
    if status is not None:
        parts += [header(status), regions_table(status), _series_table(status, width - 30)]
        workers = workers_table(status)
        if workers is not None:
            parts.append(workers)
    if live:
        parts.append(Text("Ctrl-C quits", style="dim"))
    return Group(*parts)
