"""Loading plugins and calling hooks, async-aware.

pluggy has no async support: an ``async def`` implementation returns a
coroutine, which pluggy would count as a non-None result. So edgeproxy uses
pluggy for registration, ordering and validation, and calls the
implementations itself, in pluggy's order, through one dispatch loop
(:meth:`Plugins._dispatch`) that awaits what is awaitable and honours each
spec's ``firstresult``:

- ``firstresult`` specs are called with :meth:`Plugins.call_first`: the first
  non-None result wins and later implementations do not run;
- the other specs are called with :meth:`Plugins.call_all` (every
  implementation runs; the non-None results are returned),
  :meth:`Plugins.call_all_logged` (the same, but failures are only logged) or
  :meth:`Plugins.call_chain` (each implementation receives the previous one's
  result).

Calling a hook through the wrong method is a :class:`TypeError`, so the
specs and the call sites cannot drift apart. pluggy's wrappers
(``wrapper=True`` / ``hookwrapper=True``) are generators around a synchronous
call and cannot wrap awaited implementations: a plugin that declares one is
refused at registration, as is one that implements a hook with no spec.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import operator
import sys
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from edgeproxy import hookspecs
from edgeproxy._core.config import PluginsConfig
from edgeproxy._core.errors import ProxyError
from edgeproxy._core.response import StreamResponse

__all__ = ["PluginError", "PluginLoadError", "Plugins", "hook_answer"]

logger = logging.getLogger("edgeproxy.plugins")

ENTRY_POINT_GROUP = "edgeproxy.plugins"
# A plugin module may define this factory to build its plugin object from its settings.
FACTORY_NAME = "edgeproxy_plugin"
HOOK_PREFIX = "edgeproxy_"


class PluginLoadError(RuntimeError):
    """A configured plugin could not be loaded; the message names it (and the hook, if any)."""

    def __init__(self, plugin: str, reason: str, *, hook: str | None = None) -> None:
        super().__init__(f"plugin {plugin!r} failed to load: {reason}")
        self.plugin = plugin
        self.hook = hook


class PluginError(RuntimeError):
    """A plugin raised at request time; the pipeline answers 500 for that request only."""

    def __init__(self, plugin: str, hook: str, error: BaseException) -> None:
        super().__init__(f"plugin {plugin!r} failed in {hook}: {error!r}")
        self.plugin = plugin
        self.hook = hook
        self.error = error


def hook_answer(hook: str, value: object) -> StreamResponse:
    """``value``, a hook's answer, checked: an :class:`edgeproxy.Response` (or a stream
    response). Anything else (a server's own response type, out of habit) is the plugin's
    mistake: logged, and answered with a 500 for that request."""
    if isinstance(value, StreamResponse):
        return value
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    logger.error("a plugin's %s returned %s; hooks answer with edgeproxy.Response", hook, kind)
    raise ProxyError(
        500, "plugin_error", f"a plugin's {hook} gave no usable answer", code="plugin_error"
    )


# How the dispatch loop combines results, named after the public methods.
# Plain strings: an Enum member lookup costs more than the rest of a small call.
_FIRST = "call_first"
_ALL = "call_all"
_LOGGED = "call_all_logged"
_CHAIN = "call_chain"


class _Impl:
    """One hook implementation, with what is needed to call it quickly."""

    __slots__ = ("plugin", "function", "argnames", "kwargnames", "args", "is_async")

    def __init__(
        self,
        plugin: str,
        function: Callable[..., Any],
        argnames: tuple[str, ...],
        kwargnames: tuple[str, ...] = (),
    ) -> None:
        self.plugin = plugin
        self.function = function
        # As in pluggy: parameters without a default are passed by position,
        # those with a default by keyword, and only when the call provides them.
        self.argnames = argnames
        self.kwargnames = kwargnames
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

    def keywords(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The defaulted parameters that this call provides."""
        return {name: kwargs[name] for name in self.kwargnames if name in kwargs}


class _Hook:
    """A hook's spec options and its implementations in call order."""

    __slots__ = ("name", "firstresult", "argnames", "impls")

    def __init__(
        self, name: str, firstresult: bool, argnames: tuple[str, ...], impls: list[_Impl]
    ) -> None:
        self.name = name
        self.firstresult = firstresult
        self.argnames = argnames
        self.impls = impls


# Hooks that run before a request's facts are fixed, after it is answered, or outside any
# request: none can change a fixed fact.
_OUTSIDE_THE_REQUEST = frozenset(
    {
        "edgeproxy_request_received",
        "edgeproxy_response_complete",
        "edgeproxy_startup",
        "edgeproxy_shutdown",
    }
)


class Plugins:
    """The plugin manager of one proxy: registration through pluggy, async calls here.

    Hook implementations are resolved once per hook and cached, so a hook no
    plugin implements costs one dict lookup per request.
    """

    def __init__(self, fail_open: Iterable[str] = ()) -> None:
        self.pm = pluggy.PluginManager("edgeproxy")
        self.pm.add_hookspecs(hookspecs)
        self.fail_open = set(fail_open)
        self._cache: dict[str, _Hook] = {}
        # The hooks that have implementations: ``name in plugins.active`` is has(name)
        # without a call, for the checks made several times a request.
        self.active: frozenset[str] = frozenset()
        # Whether a hook that runs between a request's entry and its answer is implemented:
        # then the request's facts are guarded (RequestContext.fix), as only a hook could
        # change one.
        self.guards_facts = False

    # -- registration ----------------------------------------------------

    def register(self, plugin: object, name: str | None = None) -> str:
        """Register a module or object holding ``edgeproxy_*`` implementations.

        Raises :class:`PluginLoadError` naming the plugin (and the hook) for an
        implementation of a hook that has no spec, a ``wrapper=True`` or
        ``hookwrapper=True`` implementation, or one whose arguments are not in
        the spec; the plugin is then not registered.
        """
        label = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        self._check_impls(plugin, label)
        try:
            registered = self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            # pluggy 1.7 validates every implementation before it changes any
            # state; older releases (>=1.5 is allowed) leave the plugin half
            # registered. A plugin registered before makes pluggy raise
            # ValueError instead, so this never removes someone else's.
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            # pluggy's message spans lines; one line reads better in a log.
            reason = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            raise PluginLoadError(label, reason) from exc
        if registered is None:
            raise PluginLoadError(label, "already registered or blocked")
        self._changed()
        return registered

    def _check_impls(self, plugin: object, label: str) -> None:
        """Refuse what the dispatcher cannot call: wrappers and hooks without a spec.

        Implementations are found as pluggy finds them when it registers.
        """
        for attr in dir(plugin):
            opts = self.pm.parse_hookimpl_opts(plugin, attr)
            if opts is None:
                continue
            hook = opts.get("specname") or attr
            for option in ("wrapper", "hookwrapper"):
                if opts.get(option):
                    raise PluginLoadError(
                        label,
                        f"{hook} is declared with @hookimpl({option}=True); edgeproxy awaits "
                        "implementations itself and supports no wrapper or hookwrapper "
                        "implementations",
                        hook=hook,
                    )
            caller = getattr(self.pm.hook, hook, None)
            if caller is not None and caller.has_spec():
                continue
            # optionalhook is pluggy's way to implement another project's hook;
            # the edgeproxy_* names are all edgeproxy's own.
            if opts.get("optionalhook") and not hook.startswith(HOOK_PREFIX):
                continue
            close = difflib.get_close_matches(hook, hookspecs.hook_names(), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise PluginLoadError(label, f"{hook} is not an edgeproxy hook{hint}", hook=hook)

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._changed()

    def _changed(self) -> None:
        """The registered plugins changed: hooks are resolved again."""
        self._cache.clear()
        self.active = frozenset(name for name in hookspecs.hook_names() if self.impls(name))
        self.guards_facts = not self.active <= _OUTSIDE_THE_REQUEST

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

    def _hook(self, hook: str) -> _Hook:
        """The hook's spec options and implementations, resolved once and cached."""
        cached = self._cache.get(hook)
        if cached is None:
            caller = getattr(self.pm.hook, hook, None)
            if caller is None or caller.spec is None:
                raise TypeError(f"{hook} is not an edgeproxy hook")
            cached = _Hook(
                hook,
                bool(caller.spec.opts.get("firstresult")),
                tuple(caller.spec.argnames),
                # pluggy's call order: last registered first, tryfirst/trylast honoured.
                [
                    _Impl(
                        impl.plugin_name,
                        impl.function,
                        tuple(impl.argnames),
                        tuple(impl.kwargnames),
                    )
                    for impl in reversed(caller.get_hookimpls())
                ],
            )
            self._cache[hook] = cached
        return cached

    def impls(self, hook: str) -> list[_Impl]:
        """Implementations of ``hook`` in call order (pluggy's: last registered first)."""
        return self._hook(hook).impls

    def has(self, hook: str) -> bool:
        # Asked several times per request: the cached entry without a call to _hook().
        cached = self._cache.get(hook)
        return bool((cached if cached is not None else self._hook(hook)).impls)

    # The call_* methods hand back _dispatch's coroutine rather than awaiting
    # it in one of their own: one coroutine per hook call, not two, on a path
    # that runs several times per request and once per streamed chunk.

    def call_first(self, hook: str, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        """A ``firstresult`` hook: the first non-None result wins (later ones do not run)."""
        return self._dispatch(hook, kwargs, _FIRST)

    def call_all(self, hook: str, **kwargs: Any) -> Coroutine[Any, Any, list[Any]]:
        """Every implementation runs; their non-None results, in call order."""
        return self._dispatch(hook, kwargs, _ALL)

    def call_all_logged(self, hook: str, **kwargs: Any) -> Coroutine[Any, Any, None]:
        """Every implementation runs; a failing one is logged and the others still run."""
        return self._dispatch(hook, kwargs, _LOGGED)

    def call_chain(self, hook: str, value_arg: str, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        """Every implementation runs, fed the previous one's non-None result as ``value_arg``."""
        return self._dispatch(hook, kwargs, _CHAIN, value_arg)

    def call_all_of(
        self, names: Iterable[str], hook: str, **kwargs: Any
    ) -> Coroutine[Any, Any, list[Any]]:
        """:meth:`call_all` on the plugins named ``names`` only (a reload starts the
        plugins it loaded, not those already running)."""
        return self._dispatch(hook, kwargs, _ALL, only=frozenset(names))

    def call_all_logged_of(
        self, names: Iterable[str], hook: str, **kwargs: Any
    ) -> Coroutine[Any, Any, None]:
        """:meth:`call_all_logged` on the plugins named ``names`` only."""
        return self._dispatch(hook, kwargs, _LOGGED, only=frozenset(names))

    async def _dispatch(
        self,
        hook: str,
        kwargs: dict[str, Any],
        mode: str,
        value_arg: str = "",
        only: frozenset[str] | None = None,
    ) -> Any:
        """The one loop every ``call_*`` method goes through (pluggy's multicall, awaited).

        A sync implementation is called directly; an async one (or a sync one
        that returns an awaitable) is awaited. A failing implementation of a
        plugin in ``fail_open`` is logged and skipped; any other raises
        :class:`PluginError` naming it (through ``call_all_logged``, it is logged instead).
        """
        entry = self._cache.get(hook) or self._hook(hook)
        first = mode == _FIRST
        chain = mode == _CHAIN
        if entry.firstresult is not first:
            right = _FIRST if entry.firstresult else f"{_ALL}, {_LOGGED} or {_CHAIN}"
            raise TypeError(
                f"{hook} is {'a' if entry.firstresult else 'not a'} firstresult hook: "
                f"call it with {right}, not {mode}"
            )
        if chain and value_arg not in entry.argnames:
            raise TypeError(f"{hook} has no argument {value_arg!r} to chain")
        results: list[Any] = []
        for impl in entry.impls:
            if only is not None and impl.plugin not in only:
                continue
            try:
                args = impl.args(kwargs)
            except KeyError as exc:
                # The caller's mistake, not the plugin's.
                raise pluggy.HookCallError(
                    f"{hook} call must provide argument {exc.args[0]!r}"
                ) from None
            try:
                if impl.kwargnames:
                    result = impl.function(*args, **impl.keywords(kwargs))
                else:
                    result = impl.function(*args)
                if impl.is_async or (result is not None and inspect.isawaitable(result)):
                    result = await result
            except Exception as exc:
                self._failed(impl, hook, exc, mode)
                continue
            if result is None:
                continue
            if first:
                return result
            if chain:
                kwargs[value_arg] = result
            else:
                results.append(result)
        if chain:
            return kwargs[value_arg]
        # call_first found no result; call_all_logged returns nothing.
        return results if mode == _ALL else None

    def _failed(self, impl: _Impl, hook: str, exc: Exception, mode: str) -> None:
        """An implementation raised: log and skip it if fail_open (or when logged), else raise."""
        if impl.plugin in self.fail_open:
            logger.warning(
                "plugin %s failed in %s (fail_open, skipped): %r", impl.plugin, hook, exc
            )
            return
        error = PluginError(impl.plugin, hook, exc)
        if mode == _LOGGED:
            logger.error("%s", error, exc_info=exc)
            return
        raise error from exc


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
