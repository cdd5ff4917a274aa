"""access_log through the real server: JSON lines written by a thread, never prompts."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from edgeproxy import PluginError, PluginLoadError, Response, hookimpl
from edgeproxy._observability import access_log
from edgeproxy._observability.access_log import AccessLog, LineWriter

from ..conftest import RegionFactory, eventually
from .conftest import CHAT, PluginProxyFactory, build_proxy, plugins_section

FIELDS = {
    "ts",
    "request_id",
    "trace_id",
    "method",
    "path",
    "route",
    "status",
    "region",
    "attempts",
    "tenant",
    "client_ip",
    "country",
    "priority",
    "sse",
    "bytes",
    "ttfb_ms",
    "upstream_ttfb_ms",
    "duration_ms",
    "cache",
    "degraded",
    "model",
    "error",
    "usage",
}
SECRET_PROMPT = "zanzibar-quokka-prompt"


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def test_lines_are_written_by_a_thread_with_fields_timings_and_usage(
    make_region: RegionFactory,
    make_plugin_proxy: PluginProxyFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGEPROXY_API_KEYS", "sk-log-test:team-log")
    log_path = tmp_path / "access.log"
    region = await make_region("r1", tokens=5)
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        plugins=plugins_section(
            apikey_auth={"exempt_paths": ["/status/"]}, access_log={"path": str(log_path)}
        ),
    )
    plugin = proxy.plugins.pm.get_plugin("access_log")
    assert isinstance(plugin, AccessLog) and plugin.writer is not None
    writer_threads: set[str] = set()
    real_write = plugin.writer._write

    def spy(data: bytes) -> None:
        writer_threads.add(threading.current_thread().name)
        real_write(data)

    plugin.writer._write = spy  # type: ignore[method-assign]

    body = {"model": "m", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    key = {"Authorization": "Bearer sk-log-test", "X-Request-Id": "req-access-1"}
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT + "?secret=q", json=body, headers=key) as resp:
            assert resp.status == 200
            answer = await resp.json()
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.post(proxy.url + CHAT, json=stream, headers=key) as resp:
            assert resp.status == 200
            streamed = await resp.read()
        async with client.post(proxy.url + CHAT, json=body) as resp:
            assert resp.status == 401
        async with client.get(proxy.url + "/status/404") as resp:
            assert resp.status == 404

    await eventually(lambda: len(lines(log_path)) == 4)
    assert writer_threads and threading.current_thread().name not in writer_threads
    assert all(name.startswith("edgeproxy-access-log") for name in writer_threads)
    raw = log_path.read_text()
    assert SECRET_PROMPT not in raw
    assert answer["choices"][0]["message"]["content"] not in raw
    assert "secret=q" not in raw and "sk-log-test" not in raw
    by_path = {(e["path"], e["status"], e["sse"]): e for e in lines(log_path)}

    chat = by_path[(CHAT, 200, False)]
    assert set(chat) == FIELDS
    assert chat["request_id"] == "req-access-1"
    assert chat["method"] == "POST"
    assert chat["region"] == "r1"
    assert chat["attempts"] == 1
    assert chat["tenant"] == "team-log"
    assert chat["client_ip"] == "127.0.0.1"
    assert chat["usage"] == answer["usage"]
    assert chat["usage"]["completion_tokens"] == 5
    assert chat["bytes"] > 0
    assert chat["error"] is None
    assert isinstance(chat["ts"], float)
    assert len(chat["trace_id"]) == 32
    for field in ("ttfb_ms", "upstream_ttfb_ms", "duration_ms"):
        assert isinstance(chat[field], float) and chat[field] >= 0, field
    assert chat["duration_ms"] >= chat["ttfb_ms"]

    sse = by_path[(CHAT, 200, True)]
    assert sse["usage"]["completion_tokens"] == 5
    assert sse["bytes"] == len(streamed)

    refused = by_path[(CHAT, 401, False)]
    assert refused["region"] is None and refused["tenant"] is None
    assert refused["attempts"] == 0 and refused["usage"] is None
    assert refused["ttfb_ms"] is None and refused["upstream_ttfb_ms"] is None
    assert isinstance(refused["duration_ms"], float)

    missing = by_path[("/status/404", 404, False)]
    assert missing["method"] == "GET" and missing["usage"] is None

    # Shutdown writes what is queued, then stops the thread and closes the file.
    writer = plugin.writer
    await proxy.stop()
    assert plugin.writer is None
    assert writer._thread is None and writer._file is None
    assert not any(t.name.startswith("edgeproxy-access-log") for t in threading.enumerate())


async def test_default_logs_to_the_edgeproxy_access_logger(
    make_region: RegionFactory,
    make_plugin_proxy: PluginProxyFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="edgeproxy.access")
    region = await make_region("r1")
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}], plugins=plugins_section(access_log={})
    )
    body = {"model": "m", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=body) as resp:
            assert resp.status == 200

    def records() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "edgeproxy.access"]

    await eventually(lambda: len(records()) == 1)
    entry = orjson.loads(records()[0].getMessage())
    assert set(entry) == FIELDS
    assert entry["status"] == 200
    assert SECRET_PROMPT not in caplog.text


async def test_moved_file_is_reopened(
    make_region: RegionFactory,
    make_plugin_proxy: PluginProxyFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(access_log, "_REOPEN_CHECK_INTERVAL", 0.0)
    log_path = tmp_path / "access.log"
    region = await make_region("r1")
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        plugins=plugins_section(access_log={"path": str(log_path)}),
    )
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/healthz") as resp:
            assert resp.status == 200
        await eventually(lambda: len(lines(log_path)) == 1)
        log_path.rename(tmp_path / "access.log.1")  # what logrotate does
        async with client.get(proxy.url + "/status/201") as resp:
            assert resp.status == 201
        await eventually(lambda: len(lines(log_path)) == 1)
    assert lines(log_path)[0]["status"] == 201
    assert lines(tmp_path / "access.log.1")[0]["status"] == 200


async def test_unwritable_path_fails_startup_naming_the_plugin(tmp_path: Path) -> None:
    proxy = build_proxy(
        [{"name": "r1", "url": "http://127.0.0.1:9"}],
        plugins=plugins_section(access_log={"path": str(tmp_path / "no-such-dir" / "a.log")}),
        upstream={"warm_connections": 0},
    )
    with pytest.raises(PluginError, match="access_log"):
        await proxy.open()
    assert proxy._regions is None


def test_full_queue_drops_lines_instead_of_blocking(tmp_path: Path) -> None:
    writer = LineWriter(str(tmp_path / "a.log"), queue_size=2)
    for _ in range(5):
        writer.write(b"{}\n")
    assert writer.dropped == 3
    writer.open()
    writer.close()
    assert (tmp_path / "a.log").read_bytes() == b"{}\n{}\n"


@pytest.mark.parametrize(
    "settings", [{"path": ""}, {"path": 5}, {"queue_size": 0}, {"file": "x.log"}]
)
def test_bad_settings_are_load_errors(settings: dict[str, Any]) -> None:
    with pytest.raises(PluginLoadError, match="access_log"):
        build_proxy(
            [{"name": "r1", "url": "http://127.0.0.1:9"}],
            plugins=plugins_section(access_log=settings),
        )


class _Degrade:
    """Answers for the regions when they cannot: a degraded answer."""

    @hookimpl
    def edgeproxy_fallback(self) -> Response:
        return Response.json({"degraded": True})


async def test_builtin_access_log_section_logs_route_cache_degraded_and_timings(
    make_region: RegionFactory,
    make_plugin_proxy: PluginProxyFactory,
    tmp_path: Path,
) -> None:
    log_path = tmp_path / "edge.jsonl"
    region = await make_region("r1", tokens=4)
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        access_log={"enabled": True, "path": str(log_path)},
    )
    assert "access_log" in proxy.plugins.names()
    body = {"model": "m", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, json=body) as resp:
            assert resp.status == 200
            cache = resp.headers.get("X-Edgeproxy-Cache")
            answer = await resp.read()
    await eventually(lambda: len(lines(log_path)) == 1)
    (chat,) = lines(log_path)
    assert set(chat) == FIELDS
    assert chat["route"] == "default"
    assert chat["region"] == "r1" and chat["attempts"] == 1 and chat["status"] == 200
    assert chat["cache"] == cache
    assert chat["degraded"] is None
    assert chat["bytes"] == len(answer)
    assert 0 <= chat["upstream_ttfb_ms"] <= chat["ttfb_ms"] <= chat["duration_ms"]
    assert SECRET_PROMPT not in log_path.read_text()


async def test_builtin_access_log_names_the_degraded_reason(
    make_region: RegionFactory,
    make_plugin_proxy: PluginProxyFactory,
    tmp_path: Path,
) -> None:
    log_path = tmp_path / "edge.jsonl"
    region = await make_region("r1")
    await region.kill()  # gone: the regions cannot answer, a degraded answer is given
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        extra=[_Degrade()],
        access_log={"enabled": True, "path": str(log_path)},
    )
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/v1/models") as resp:
            assert resp.status == 200
            reason = resp.headers["X-Edgeproxy-Degraded"]
    await eventually(lambda: len(lines(log_path)) == 1)
    (degraded,) = lines(log_path)
    assert degraded["degraded"] == reason
    assert degraded["route"] == "default"
    assert degraded["status"] == 200
    assert degraded["upstream_ttfb_ms"] is None


async def test_builtin_access_log_and_the_plugin_do_not_log_twice(
    make_region: RegionFactory,
    make_plugin_proxy: PluginProxyFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    log_path = tmp_path / "edge.jsonl"
    region = await make_region("r1")
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        plugins=plugins_section(access_log={"path": str(log_path)}),
        access_log={"enabled": True, "path": str(tmp_path / "other.jsonl")},
    )
    assert "one log" in caplog.text
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/status/200") as resp:
            assert resp.status == 200
    await eventually(lambda: len(lines(log_path)) == 1)
    assert not (tmp_path / "other.jsonl").exists()
