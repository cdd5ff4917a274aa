"""Loading plugins and calling hooks, async-aware.

pluggy has no async support: an ``async def`` implementation returns a
coroutine, which pluggy would count as a non-None result. So edgeproxy uses
pluggy for registration, ordering and validation, and calls the
implementations itself: it awaits coroutines and implements *first result
wins* and *chained* semantics over awaited values.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import operator
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from edgeproxy import hookspecs
from edgeproxy._core.config import PluginsConfig

__all__ = ["PluginError", "PluginLoadError", "Plugins"]

logger = logging.getLogger("edgeproxy.plugins")

ENTRY_POINT_GROUP = "edgeproxy.plugins"
# A plugin module may define this factory to build its plugin object from its settings.
FACTORY_NAME = "edgeproxy_plugin"


class PluginLoadError(RuntimeError):
    """A configured plugin could not be loaded; the message names it."""

    def __init__(self, plugin: str, reason: str) -> None:
        super().__init__(f"plugin {plugin!r} failed to load: {reason}")
        self.plugin = plugin


class PluginError(RuntimeError):
    """A plugin raised at request time; the pipeline answers 500 for that request only."""

    def __init__(self, plugin: str, hook: str, error: BaseException) -> None:
        super().__init__(f"plugin {plugin!r} failed in {hook}: {error!r}")
        self.plugin = plugin
        self.hook = hook
        self.error = error


class _Impl:
    """One hook implementation, with what is needed to call it quickly."""

    __slots__ = ("plugin", "function", "argnames", "args", "is_async", "fail_open")

    def __init__(self, plugin: str, function: Any, argnames: tuple[str, ...], fail_open: bool):
        self.plugin = plugin
        self.function = function
        self.argnames = argnames
        # itemgetter picks the arguments out of the call's kwargs in C; it
        # returns a bare value for one name, so normalise to a tuple.
        if len(argnames) == 1:
            getter = operator.itemgetter(argnames[0])
            self.args: Callable[[dict[str, Any]], tuple[Any, ...]] = lambda kw: (getter(kw),)
        elif argnames:
            self.args = operator.itemgetter(*argnames)
        else:
            self.args = lambda kw: ()
        self.is_async = inspect.iscoroutinefunction(function)
        self.fail_open = fail_open

    def failed(self, hook: str, exc: Exception) -> None:
        """Handle an exception from this implementation: skip if fail_open, else raise."""
        if self.fail_open:
            logger.warning(
                "plugin %s failed in %s (fail_open, skipped): %r", self.plugin, hook, exc
            )
            return
        raise PluginError(self.plugin, hook, exc) from exc


class Plugins:
    """The plugin manager of one proxy: registration through pluggy, async calls here.

    Hook implementations are resolved once per hook and cached, so a hook no
    plugin implements costs one dict lookup per request.
    """

    def __init__(self, fail_open: Iterable[str] = ()) -> None:
        self.pm = pluggy.PluginManager("edgeproxy")
        self.pm.add_hookspecs(hookspecs)
        self.fail_open = set(fail_open)
        self._cache: dict[str, list[_Impl]] = {}

    # -- registration ----------------------------------------------------

    def register(self, plugin: object, name: str | None = None) -> str:
        """Register a module or object holding ``edgeproxy_*`` implementations."""
        registered = self.pm.register(plugin, name=name)
        if registered is None:
            raise PluginLoadError(name or repr(plugin), "already registered or blocked")
        self.pm.check_pending()
        self._cache.clear()
        return registered

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._cache.clear()

    def load_configured(self, config: PluginsConfig, *, base_dir: Path | None = None) -> None:
        """Load ``[plugins] enabled`` by dotted path or file path, then entry points.

        Relative file paths are tried against ``base_dir`` (the config file's
        folder) first, then the working directory.
        """
        self.fail_open |= set(config.fail_open)
        for spec in config.enabled:
            name = _plugin_name(spec)
            try:
                module = _import_plugin(spec, base_dir)
            except Exception as exc:  # noqa: BLE001 - any import failure is a load error
                raise PluginLoadError(spec, f"{type(exc).__name__}: {exc}") from exc
            settings = config.settings.get(name, config.settings.get(spec, {}))
            self._register_loaded(module, name, settings)
        if config.entry_points:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if self.pm.has_plugin(ep.name):
                    continue
                try:
                    module = ep.load()
                except Exception as exc:  # noqa: BLE001
                    raise PluginLoadError(ep.name, f"{type(exc).__name__}: {exc}") from exc
                self._register_loaded(module, ep.name, config.settings.get(ep.name, {}))

    def _register_loaded(self, module: Any, name: str, settings: dict[str, Any]) -> None:
        factory = getattr(module, FACTORY_NAME, None)
        try:
            plugin = factory(settings) if callable(factory) else module
            self.register(plugin, name=name)
        except PluginLoadError:
            raise
        except Exception as exc:  # noqa: BLE001 - bad settings, bad hook signatures
            raise PluginLoadError(name, f"{type(exc).__name__}: {exc}") from exc
        logger.info("loaded plugin %s", name)

    def names(self) -> list[str]:
        return sorted(n for n, _ in self.pm.list_name_plugin() if n is not None)

    # -- calling ---------------------------------------------------------

    def impls(self, hook: str) -> list[_Impl]:
        """Implementations of ``hook`` in call order (pluggy's: last registered first)."""
        cached = self._cache.get(hook)
        if cached is None:
            caller = getattr(self.pm.hook, hook)
            cached = [
                _Impl(
                    impl.plugin_name,
                    impl.function,
                    tuple(impl.argnames),
                    impl.plugin_name in self.fail_open,
                )
                for impl in reversed(caller.get_hookimpls())
            ]
            self._cache[hook] = cached
        return cached

    def has(self, hook: str) -> bool:
        # Asked several times per request: the cached list without a call to impls().
        cached = self._cache.get(hook)
        return bool(cached if cached is not None else self.impls(hook))

    # The call_* methods inline the per-implementation call instead of sharing
    # a helper coroutine: with several plugins on every hook, one coroutine per
    # implementation per request was most of the plugin overhead. A sync
    # implementation is called directly; an async one (or a sync one that
    # returns an awaitable) is awaited.

    async def call_all(self, hook: str, **kwargs: Any) -> list[Any]:
        """*All run*: call every implementation; return their non-None results."""
        results = []
        for impl in self.impls(hook):
            try:
                result = impl.function(*impl.args(kwargs))
                if impl.is_async or (result is not None and inspect.isawaitable(result)):
                    result = await result
            except Exception as exc:
                impl.failed(hook, exc)
                continue
            if result is not None:
                results.append(result)
        return results

    async def call_first(self, hook: str, **kwargs: Any) -> Any:
        """*First result wins*: the first non-None awaited result, or None."""
        for impl in self.impls(hook):
            try:
                result = impl.function(*impl.args(kwargs))
                if impl.is_async or (result is not None and inspect.isawaitable(result)):
                    result = await result
            except Exception as exc:
                impl.failed(hook, exc)
                continue
            if result is not None:
                return result
        return None

    async def call_chain(self, hook: str, value_arg: str, **kwargs: Any) -> Any:
        """*Chained*: feed each implementation the previous one's non-None output."""
        for impl in self.impls(hook):
            try:
                result = impl.function(*impl.args(kwargs))
                if impl.is_async or (result is not None and inspect.isawaitable(result)):
                    result = await result
            except Exception as exc:
                impl.failed(hook, exc)
                continue
            if result is not None:
                kwargs[value_arg] = result
        return kwargs[value_arg]

    async def call_all_logged(self, hook: str, **kwargs: Any) -> None:
        """*All run*, but a failing implementation is logged and the others still run."""
        for impl in self.impls(hook):
            try:
                result = impl.function(*impl.args(kwargs))
                if impl.is_async or (result is not None and inspect.isawaitable(result)):
                    await result
            except Exception as exc:
                try:
                    impl.failed(hook, exc)
                except PluginError as err:
                    logger.error("%s", err, exc_info=err.error)


def _plugin_name(spec: str) -> str:
    """A plugin's name: the file stem for paths, the last dotted part for modules."""
    if spec.endswith(".py") or "/" in spec or "\\" in spec:
        return Path(spec).stem
    return spec.rsplit(".", 1)[-1]


def _import_plugin(spec: str, base_dir: Path | None = None) -> ModuleType:
    if spec.endswith(".py") or "/" in spec or "\\" in spec:
        path = Path(spec).expanduser()
        if not path.is_absolute() and base_dir is not None and (base_dir / path).is_file():
            path = base_dir / path
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path}")
        module_name = f"edgeproxy_plugin_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        return module
    return importlib.import_module(spec)
