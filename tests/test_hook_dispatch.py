"""The hook dispatcher: one loop, pluggy's order, each spec's ``firstresult`` respected.

Every test registers real plugins (objects and modules with ``@hookimpl``)
on a real :class:`Plugins` and calls hooks the way the pipeline does.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import types
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pluggy
import pytest

from edgeproxy import EdgeProxy, PluginError, PluginLoadError, hookimpl, hookspecs
from edgeproxy._core.config import PluginsConfig, config_from_mapping
from edgeproxy._plugins import Plugins

from .conftest import proxy_config

PACKAGE = Path(__file__).parent.parent / "edgeproxy"
FIRSTRESULT = {
    "edgeproxy_request_received",
    "edgeproxy_route",
    "edgeproxy_cache_key",
    "edgeproxy_fallback",
}
CACHE_KEY: dict[str, Any] = {"request": None, "ctx": None, "default_key": "k"}
UPSTREAM_REQUEST: dict[str, Any] = {"request": None, "ctx": None, "region": "r1", "headers": []}


def firstresult(hook: str) -> bool:
    manager = pluggy.PluginManager("edgeproxy")
    manager.add_hookspecs(hookspecs)
    spec = getattr(manager.hook, hook).spec
    assert spec is not None
    return bool(spec.opts["firstresult"])


def cache_key_plugin(
    name: str, log: list[str], result: str | None, *, tryfirst: bool = False, trylast: bool = False
) -> object:
    """An object whose edgeproxy_cache_key records its name and returns ``result``."""

    class Plugin:
        @hookimpl(tryfirst=tryfirst, trylast=trylast)
        def edgeproxy_cache_key(self) -> str | None:
            log.append(name)
            return result

    Plugin.__name__ = name
    return Plugin()


def upstream_request_plugin(
    name: str, log: list[str], *, tryfirst: bool = False, trylast: bool = False
) -> object:
    """An object whose async edgeproxy_upstream_request records and returns its name."""

    class Plugin:
        @hookimpl(tryfirst=tryfirst, trylast=trylast)
        async def edgeproxy_upstream_request(self) -> str:
            log.append(name)
            return name

    Plugin.__name__ = name
    return Plugin()


# -- the specs and their call sites ------------------------------------------


def test_the_first_result_specs_are_marked_firstresult() -> None:
    assert {name for name in hookspecs.hook_names() if firstresult(name)} == FIRSTRESULT


@pytest.mark.parametrize("hook", hookspecs.hook_names())
def test_each_docstring_says_whether_the_first_result_wins(hook: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    if firstresult(hook):
        assert "*First result wins*: the first non-``None`` result" in doc
        assert "*All run*" not in doc and "*Chained*" not in doc
    else:
        assert "*First result wins*" not in doc
        assert "return values are ignored" in doc or "*Chained*: every implementation runs" in doc


def call_sites() -> Iterator[tuple[str, str, str]]:
    """(file, method, hook) for every ``plugins.call_*`` in the package and the plugins."""
    pattern = re.compile(r"\.(call_first|call_all_logged|call_all|call_chain)[(,]\s*\"(\w+)\"")
    for folder in (PACKAGE, PACKAGE.parent / "plugins"):
        for path in folder.rglob("*.py"):
            for method, hook in pattern.findall(path.read_text()):
                yield path.name, method, hook


def test_every_call_site_uses_the_method_its_spec_asks_for() -> None:
    sites = list(call_sites())
    assert {hook for _, _, hook in sites} == set(hookspecs.hook_names())
    for path, method, hook in sites:
        assert (method == "call_first") == firstresult(hook), f"{path}: {method}({hook!r})"


async def test_calling_a_hook_through_the_wrong_path_fails_loudly() -> None:
    plugins = Plugins()
    plugins.register(cache_key_plugin("a", [], "key"), "a")
    with pytest.raises(TypeError, match="edgeproxy_cache_key is a firstresult hook"):
        await plugins.call_all("edgeproxy_cache_key", **CACHE_KEY)
    with pytest.raises(TypeError, match="call_first, not call_all_logged"):
        await plugins.call_all_logged("edgeproxy_cache_key", **CACHE_KEY)
    with pytest.raises(TypeError, match="firstresult"):
        await plugins.call_chain("edgeproxy_cache_key", "default_key", **CACHE_KEY)
    # The reverse, even when nothing implements the hook.
    with pytest.raises(TypeError, match="edgeproxy_upstream_request is not a firstresult hook"):
        await plugins.call_first("edgeproxy_upstream_request", **UPSTREAM_REQUEST)
    with pytest.raises(TypeError, match="no argument 'body'"):
        await plugins.call_chain(
            "edgeproxy_stream_chunk", "body", request=None, ctx=None, chunk=b""
        )
    with pytest.raises(TypeError, match="edgeproxy_nope is not an edgeproxy hook"):
        await plugins.call_all("edgeproxy_nope")
    with pytest.raises(TypeError, match="not an edgeproxy hook"):
        plugins.has("edgeproxy_nope")


# -- results and order -------------------------------------------------------


async def test_first_result_stops_at_the_first_non_none() -> None:
    plugins = Plugins()
    log: list[str] = []
    # Registered a, b, c: called c, b, a.
    plugins.register(cache_key_plugin("a", log, "from-a"), "a")
    plugins.register(cache_key_plugin("b", log, "from-b"), "b")
    plugins.register(cache_key_plugin("c", log, None), "c")
    assert await plugins.call_first("edgeproxy_cache_key", **CACHE_KEY) == "from-b"
    assert log == ["c", "b"]


async def test_first_result_is_none_when_every_implementation_returns_none() -> None:
    plugins = Plugins()
    log: list[str] = []
    plugins.register(cache_key_plugin("a", log, None), "a")
    plugins.register(cache_key_plugin("b", log, None), "b")
    assert await plugins.call_first("edgeproxy_cache_key", **CACHE_KEY) is None
    assert log == ["b", "a"]
    assert await Plugins().call_first("edgeproxy_cache_key", **CACHE_KEY) is None


async def test_first_result_accepts_falsy_results() -> None:
    """Only None passes on: False (a fallback veto) or "" wins like any other value."""
    plugins = Plugins()
    log: list[str] = []
    plugins.register(cache_key_plugin("a", log, "from-a"), "a")
    plugins.register(cache_key_plugin("b", log, ""), "b")
    assert await plugins.call_first("edgeproxy_cache_key", **CACHE_KEY) == ""
    assert log == ["b"]


async def test_all_results_are_collected_in_pluggys_order() -> None:
    plugins = Plugins()
    log: list[str] = []
    for name in ("a", "b", "c"):
        plugins.register(upstream_request_plugin(name, log), name)

    class Quiet:
        @hookimpl
        def edgeproxy_upstream_request(self) -> None:
            log.append("quiet")

    plugins.register(Quiet(), "quiet")
    assert await plugins.call_all("edgeproxy_upstream_request", **UPSTREAM_REQUEST) == [
        "c",
        "b",
        "a",
    ]
    assert log == ["quiet", "c", "b", "a"]  # None results run but are not collected
    log.clear()
    await plugins.call_all_logged("edgeproxy_upstream_request", **UPSTREAM_REQUEST)
    assert log == ["quiet", "c", "b", "a"]


async def test_tryfirst_and_trylast_reorder_implementations() -> None:
    plugins = Plugins()
    log: list[str] = []
    plugins.register(upstream_request_plugin("first", log, tryfirst=True), "first")
    plugins.register(upstream_request_plugin("last", log, trylast=True), "last")
    plugins.register(upstream_request_plugin("plain1", log), "plain1")
    plugins.register(upstream_request_plugin("plain2", log), "plain2")
    plugins.register(upstream_request_plugin("first2", log, tryfirst=True), "first2")
    results = await plugins.call_all("edgeproxy_upstream_request", **UPSTREAM_REQUEST)
    assert results == ["first2", "first", "plain2", "plain1", "last"]
    assert [impl.plugin for impl in plugins.impls("edgeproxy_upstream_request")] == results

    log.clear()
    firsts = Plugins()
    firsts.register(cache_key_plugin("late", log, "late", trylast=True), "late")
    firsts.register(cache_key_plugin("plain", log, "plain"), "plain")
    firsts.register(cache_key_plugin("early", log, None, tryfirst=True), "early")
    assert await firsts.call_first("edgeproxy_cache_key", **CACHE_KEY) == "plain"
    assert log == ["early", "plain"]


async def test_sync_and_async_implementations_mixed() -> None:
    plugins = Plugins()

    class SyncUpper:
        @hookimpl
        def edgeproxy_stream_chunk(self, chunk: bytes) -> bytes:
            return chunk.upper()

    class AsyncSuffix:
        @hookimpl
        async def edgeproxy_stream_chunk(self, chunk: bytes) -> bytes:
            await asyncio.sleep(0)
            return chunk + b"-async"

    class AsyncKeep:
        @hookimpl
        async def edgeproxy_stream_chunk(self) -> None:
            return None

    class ReturnsAwaitable:
        """A plain function that hands back an awaitable is awaited too."""

        @hookimpl
        def edgeproxy_stream_chunk(self, chunk: bytes) -> asyncio.Future[bytes]:
            future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            future.set_result(chunk + b"-future")
            return future

    # Called in reverse: ReturnsAwaitable, AsyncKeep, AsyncSuffix, SyncUpper.
    plugins.register(SyncUpper(), "sync_upper")
    plugins.register(AsyncSuffix(), "async_suffix")
    plugins.register(AsyncKeep(), "async_keep")
    plugins.register(ReturnsAwaitable(), "returns_awaitable")
    chunk = await plugins.call_chain(
        "edgeproxy_stream_chunk", "chunk", request=None, ctx=None, chunk=b"x"
    )
    assert chunk == b"X-FUTURE-ASYNC"

    answers = Plugins()
    answers.register(cache_key_plugin("sync", [], "sync"), "sync")

    class AsyncNone:
        @hookimpl
        async def edgeproxy_cache_key(self) -> None:
            return None

    answers.register(AsyncNone(), "async_none")
    # The coroutine's None does not win (pluggy alone would count the coroutine).
    assert await answers.call_first("edgeproxy_cache_key", **CACHE_KEY) == "sync"


async def test_chain_without_implementations_returns_the_value() -> None:
    plugins = Plugins()
    assert not plugins.has("edgeproxy_stream_chunk")
    assert (
        await plugins.call_chain(
            "edgeproxy_stream_chunk", "chunk", request=None, ctx=None, chunk=b"same"
        )
        == b"same"
    )


# -- arguments ---------------------------------------------------------------


async def test_each_implementation_gets_the_arguments_it_names() -> None:
    plugins = Plugins()
    seen: dict[str, tuple[Any, ...]] = {}

    class Subset:
        @hookimpl
        def edgeproxy_fallback(self, reason: str, request: object) -> None:
            seen["subset"] = (reason, request)

    class Nothing:
        @hookimpl
        async def edgeproxy_fallback(self) -> None:
            seen["nothing"] = ()

    class Defaulted:
        @hookimpl
        def edgeproxy_fallback(self, ctx: object, answer: object = "default") -> None:
            seen["defaulted"] = (ctx, answer)

    def edgeproxy_fallback(answer: object, reason: str) -> None:
        seen["module"] = (answer, reason)

    module = types.ModuleType("module_plugin")
    module.edgeproxy_fallback = hookimpl(edgeproxy_fallback)  # type: ignore[attr-defined]

    for plugin, name in ((Subset(), "subset"), (Nothing(), "nothing"), (Defaulted(), "d")):
        plugins.register(plugin, name)
    plugins.register(module)
    verdict = await plugins.call_first(
        "edgeproxy_fallback", request="req", ctx="ctx", reason="overloaded", answer="ans"
    )
    assert verdict is None
    assert seen == {
        "subset": ("overloaded", "req"),
        "nothing": (),
        "defaulted": ("ctx", "ans"),
        "module": ("ans", "overloaded"),
    }
    assert "module_plugin" in plugins.names()


async def test_a_missing_argument_is_the_callers_error_not_the_plugins() -> None:
    plugins = Plugins(fail_open=["a"])
    plugins.register(cache_key_plugin("a", [], "x"), "a")

    class NeedsKey:
        @hookimpl
        def edgeproxy_cache_key(self, default_key: str) -> str:
            return default_key

    plugins.register(NeedsKey(), "needs_key")
    with pytest.raises(pluggy.HookCallError, match="must provide argument 'default_key'"):
        await plugins.call_first("edgeproxy_cache_key", request=None, ctx=None)


# -- failures ----------------------------------------------------------------


class Boom:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    @hookimpl
    async def edgeproxy_cache_key(self) -> str:
        self.log.append("boom")
        raise RuntimeError("kaboom")

    @hookimpl
    def edgeproxy_response_complete(self) -> None:
        self.log.append("boom")
        raise RuntimeError("kaboom")


class Fine:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    @hookimpl
    def edgeproxy_cache_key(self) -> str:
        self.log.append("fine")
        return "fine"

    @hookimpl
    async def edgeproxy_response_complete(self) -> None:
        self.log.append("fine")


async def test_a_failing_plugin_raises_plugin_error_naming_it() -> None:
    log: list[str] = []
    plugins = Plugins()
    plugins.register(Fine(log), "fine")
    plugins.register(Boom(log), "boom")
    with pytest.raises(PluginError) as info:
        await plugins.call_first("edgeproxy_cache_key", **CACHE_KEY)
    assert info.value.plugin == "boom" and info.value.hook == "edgeproxy_cache_key"
    assert isinstance(info.value.error, RuntimeError)
    assert "'boom' failed in edgeproxy_cache_key" in str(info.value)
    assert log == ["boom"]  # the next implementation did not run


async def test_a_fail_open_plugin_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    log: list[str] = []
    plugins = Plugins(fail_open=["boom"])
    plugins.register(Fine(log), "fine")
    plugins.register(Boom(log), "boom")
    with caplog.at_level(logging.WARNING, logger="edgeproxy.plugins"):
        assert await plugins.call_first("edgeproxy_cache_key", **CACHE_KEY) == "fine"
    assert log == ["boom", "fine"]
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "boom failed in edgeproxy_cache_key (fail_open, skipped)" in record.getMessage()


async def test_fail_open_applies_when_set_after_the_first_call() -> None:
    log: list[str] = []
    plugins = Plugins()
    plugins.register(Fine(log), "fine")
    plugins.register(Boom(log), "boom")
    with pytest.raises(PluginError):
        await plugins.call_first("edgeproxy_cache_key", **CACHE_KEY)
    plugins.fail_open.add("boom")
    assert await plugins.call_first("edgeproxy_cache_key", **CACHE_KEY) == "fine"


async def test_the_logged_path_logs_failures_and_runs_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log: list[str] = []
    plugins = Plugins()
    plugins.register(Fine(log), "fine")
    plugins.register(Boom(log), "boom")
    with caplog.at_level(logging.WARNING, logger="edgeproxy.plugins"):
        await plugins.call_all_logged("edgeproxy_response_complete", request=None, ctx=None)
    assert log == ["boom", "fine"]
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert "'boom' failed in edgeproxy_response_complete" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
    # The same failure through call_all is the request's error.
    with pytest.raises(PluginError, match="boom"):
        await plugins.call_all("edgeproxy_response_complete", request=None, ctx=None)


async def test_cancellation_is_not_a_plugin_failure() -> None:
    plugins = Plugins(fail_open=["cancelled"])

    class Cancelled:
        @hookimpl
        async def edgeproxy_cache_key(self) -> None:
            raise asyncio.CancelledError

    plugins.register(Cancelled(), "cancelled")
    with pytest.raises(asyncio.CancelledError):
        await plugins.call_first("edgeproxy_cache_key", **CACHE_KEY)


# -- registration ------------------------------------------------------------


class NewWrapper:
    @hookimpl(wrapper=True)
    def edgeproxy_request_received(self) -> Generator[None, Any, Any]:
        result = yield
        return result


class AsyncWrapper:
    @hookimpl(wrapper=True)
    async def edgeproxy_cache_key(self) -> None:
        return None


class OldHookwrapper:
    @hookimpl(hookwrapper=True)
    def edgeproxy_upstream_request(self) -> Generator[None, Any, None]:
        yield


@pytest.mark.parametrize(
    ("plugin", "hook", "option"),
    [
        (NewWrapper(), "edgeproxy_request_received", "wrapper"),
        (AsyncWrapper(), "edgeproxy_cache_key", "wrapper"),
        (OldHookwrapper(), "edgeproxy_upstream_request", "hookwrapper"),
    ],
)
async def test_wrappers_are_refused_naming_plugin_and_hook(
    plugin: object, hook: str, option: str
) -> None:
    plugins = Plugins()
    with pytest.raises(PluginLoadError) as info:
        plugins.register(plugin, "wrapping")
    message = str(info.value)
    assert "'wrapping'" in message and hook in message and f"{option}=True" in message
    assert info.value.plugin == "wrapping" and info.value.hook == hook
    assert not plugins.pm.has_plugin("wrapping")
    assert not plugins.has(hook)
    # Unnamed: the class names it.
    with pytest.raises(PluginLoadError, match=type(plugin).__name__):
        plugins.register(plugin)


def test_a_wrapper_in_a_configured_module_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "wrapping_module.py"
    path.write_text(
        "from edgeproxy import hookimpl\n"
        "@hookimpl(hookwrapper=True)\n"
        "def edgeproxy_route(ctx):\n"
        "    yield\n"
    )
    plugins = Plugins()
    with pytest.raises(PluginLoadError) as info:
        plugins.load_configured(PluginsConfig(enabled=[str(path)], entry_points=False))
    assert "'wrapping_module'" in str(info.value) and "edgeproxy_route" in str(info.value)
    assert "hookwrapper=True" in str(info.value)


def test_a_wrapper_given_to_the_proxy_is_refused() -> None:
    config = config_from_mapping(
        proxy_config([{"name": "r1", "url": "http://127.0.0.1:9"}]), environ={}
    )
    with pytest.raises(PluginLoadError, match=r"'NewWrapper'.*edgeproxy_request_received"):
        EdgeProxy(config, plugins=[NewWrapper()])


def test_unknown_hooks_are_refused_with_a_hint() -> None:
    class Typo:
        @hookimpl
        def edgeproxy_request_recieved(self) -> None:
            return None

    plugins = Plugins()
    with pytest.raises(PluginLoadError) as info:
        plugins.register(Typo(), "typo")
    assert str(info.value) == (
        "plugin 'typo' failed to load: edgeproxy_request_recieved is not an edgeproxy hook"
        " (did you mean edgeproxy_request_received?)"
    )
    assert info.value.hook == "edgeproxy_request_recieved"
    assert not plugins.pm.has_plugin("typo")


def test_specname_and_optionalhook() -> None:
    class Renamed:
        @hookimpl(specname="edgeproxy_cache_key")
        def key(self) -> str:
            return "renamed"

    class RenamedWrong:
        @hookimpl(specname="edgeproxy_cachekey")
        def key(self) -> str:
            return "wrong"

    class OptionalOwn:
        @hookimpl(optionalhook=True)
        def edgeproxy_not_a_hook(self) -> None:
            return None

    class OptionalOther:
        @hookimpl(optionalhook=True)
        def other_project_hook(self) -> None:
            return None

    plugins = Plugins()
    plugins.register(Renamed(), "renamed")
    assert plugins.has("edgeproxy_cache_key")
    with pytest.raises(PluginLoadError, match="edgeproxy_cachekey is not an edgeproxy hook"):
        plugins.register(RenamedWrong(), "renamed_wrong")
    # The edgeproxy_* names are all edgeproxy's: optional or not, a name without a spec is a typo.
    with pytest.raises(PluginLoadError, match="edgeproxy_not_a_hook"):
        plugins.register(OptionalOwn(), "optional_own")
    plugins.register(OptionalOther(), "optional_other")
    assert plugins.names() == ["optional_other", "renamed"]


def test_bad_arguments_are_a_load_error_naming_the_plugin() -> None:
    class BadArgs:
        @hookimpl
        def edgeproxy_cache_key(self, key: str) -> str:
            return key

    plugins = Plugins()
    with pytest.raises(PluginLoadError, match=r"'bad_args'.*edgeproxy_cache_key.*'key'"):
        plugins.register(BadArgs(), "bad_args")
    assert not plugins.pm.has_plugin("bad_args")


async def test_register_and_unregister_refresh_the_implementations() -> None:
    plugins = Plugins()
    log: list[str] = []
    assert not plugins.has("edgeproxy_cache_key")
    plugins.register(cache_key_plugin("a", log, "a"), "a")
    assert plugins.has("edgeproxy_cache_key")
    assert await plugins.call_first("edgeproxy_cache_key", **CACHE_KEY) == "a"
    plugins.register(cache_key_plugin("b", log, "b"), "b")
    assert await plugins.call_first("edgeproxy_cache_key", **CACHE_KEY) == "b"
    plugins.unregister("b")
    plugins.unregister("a")
    assert not plugins.has("edgeproxy_cache_key")
