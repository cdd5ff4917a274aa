"""One generation of a proxy's config: its regions, pipeline and load view, on one exit stack.

:meth:`EdgeProxy.open <edgeproxy.EdgeProxy.open>` opens the first generation;
:meth:`EdgeProxy.reload <edgeproxy.EdgeProxy.reload>` opens the next one beside it,
swaps it in, and retires the old one once its requests are done. The plugins'
lifetime (their startup and shutdown hooks) is the proxy's, not a generation's:
a reload that leaves ``[plugins]`` alone keeps them running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from edgeproxy._core.config import Config
from edgeproxy._pipeline import Pipeline
from edgeproxy._plugins import Plugins
from edgeproxy._shared.loadview import LoadView
from edgeproxy._upstream.regions import RegionSet

__all__ = [
    "Generation",
    "RESTART_SECTIONS",
    "Retiring",
    "build_plugins",
    "open_generation",
    "restart_errors",
]

logger = logging.getLogger("edgeproxy")

# Seconds the requests of a retiring generation, cut at the end of its drain, have to let
# go of what they hold before its pools close (as stop() gives them).
_STRAGGLER_TIMEOUT = 1.0

# What is wired when the process starts, and so cannot change in place: the listeners and
# their limits, the PoP's identity (in metrics labels, routing and the shared load), and
# the observability plugins, registered once as the same objects in every generation.
RESTART_SECTIONS: dict[str, str] = {
    "server": "listener changes need a restart",
    "admin": "admin listener changes need a restart",
    "limits": "the listener's limits are set at start; a change needs a restart",
    "pop": "the PoP's identity is set at start; a change needs a restart",
    "metrics": "metrics are set up at start; a change needs a restart",
    "tracing": "tracing is set up at start; a change needs a restart",
    "access_log": "the access log is opened at start; a change needs a restart",
}
# Keys of those sections that each request reads from its generation's config: they
# reload in place. trusted_proxies took over [admission] and [geo] keys that always did.
_RELOADED_KEYS: frozenset[tuple[str, str]] = frozenset({("server", "trusted_proxies")})


def restart_errors(old: Config, new: Config) -> list[str]:
    """One ``section.key: reason`` line per key of a restart-only section that changed."""
    errors = []
    for section, reason in RESTART_SECTIONS.items():
        before: dict[str, Any] = getattr(old, section).model_dump()
        after: dict[str, Any] = getattr(new, section).model_dump()
        for key in sorted(before.keys() | after.keys()):
            if before.get(key) != after.get(key) and (section, key) not in _RELOADED_KEYS:
                errors.append(f"{section}.{key}: {reason}")
    return errors


@dataclass(eq=False)
class Generation:
    """What one config opened: regions and their pools, the pipeline, the load view.

    Everything is entered on :attr:`stack`, so closing it undoes a failed open and a
    retired generation alike, in reverse order.
    """

    number: int
    config: Config
    plugins: Plugins
    regions: RegionSet
    pipeline: Pipeline
    load_view: LoadView | None
    stack: contextlib.AsyncExitStack
    # The tasks of the requests it serves: cut if they outlast its drain.
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    async def close(self) -> None:
        await self.stack.aclose()


async def open_generation(number: int, config: Config, plugins: Plugins) -> Generation:
    """Open the pools and warm them, with the stages that need opening, on a new exit stack.

    When a step fails, what opened before it is closed and the error raised.
    """
    stack = contextlib.AsyncExitStack()
    try:
        regions = RegionSet(config)
        pipeline = Pipeline(config, regions, plugins)
        # The local model loads in a worker thread while the pools warm; never waited for.
        pipeline.fallback.open()
        stack.push_async_callback(pipeline.fallback.close)
        # Rate-limit buckets: Redis when configured (its absence only means local limits).
        await pipeline.admission.open()
        stack.push_async_callback(pipeline.admission.close)
        # The owners of stored objects: Redis when configured (else this process's memory).
        await pipeline.owners.open()
        stack.push_async_callback(pipeline.owners.close)
        # The Responses chains the edge holds: Redis when configured (else memory).
        await pipeline.chains.open()
        stack.push_async_callback(pipeline.chains.close)
        # The sessions' client to the regions' WebSockets.
        stack.push_async_callback(pipeline.sessions.close)
        # The router lets go of its geo database once the regions are closed.
        stack.callback(pipeline.router.close)
        # Closing the regions stops the health checks too.
        stack.push_async_callback(regions.close)
        await regions.open()
        # The cache's backend: a Redis that does not answer is a warning (it fails open).
        # It closes before the pools, which its background refreshes use.
        await pipeline.cache.open()
        stack.push_async_callback(pipeline.cache.close)
        # The shared load view: a background task (Redis is never waited for here),
        # stopped before the regions it reads close.
        load_view = None
        if config.shared_load.enabled:
            load_view = LoadView(config.shared_load, regions, pop=config.pop.name)
            await load_view.open()
            stack.push_async_callback(load_view.close)
            # The router scores with its global in-flight counts while they are fresh.
            pipeline.router.load_view = load_view
        for region in regions:
            if not region.up:
                logger.warning(
                    "region %s (%s) is not reachable at startup; /readyz reports it",
                    region.name,
                    region.config.url,
                )
    except BaseException:
        await stack.aclose()
        raise
    return Generation(number, config, plugins, regions, pipeline, load_view, stack)


def build_plugins(
    config: Config, given: list[tuple[str, object]], builtin: list[tuple[str, object]]
) -> tuple[Plugins, frozenset[str]]:
    """A plugin manager for ``config``: the ``given`` plugins, ``[plugins]`` loaded anew,
    then the ``builtin`` observability plugins; and the names of the configured ones.

    ``given`` and ``builtin`` are registered as the same objects each time, so a reload
    that changes ``[plugins]`` restarts only what ``[plugins]`` loads.
    """
    plugins = Plugins(config.plugins.fail_open)
    for name, plugin in given:
        plugins.register(plugin, name=name)
    before = set(plugins.names())
    plugins.load_configured(config.plugins, base_dir=config.base_dir)
    configured = frozenset(plugins.names()) - before
    for name, plugin in builtin:
        if name == "access_log" and plugins.pm.has_plugin(name):
            logger.warning("[access_log] is on and the access_log plugin is loaded: one log")
            continue
        plugins.register(plugin, name=name)
    # A fault in metrics or tracing is logged and skipped: it never fails a request.
    plugins.fail_open |= {"edgeproxy.metrics", "edgeproxy.tracing"}
    return plugins, configured


class Retiring:
    """Generations a reload replaced, each draining in a background task until it closes.

    The tasks are kept here: the event loop holds them only weakly.
    """

    def __init__(self) -> None:
        self._tasks: dict[asyncio.Task[None], Generation] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def generations(self) -> list[Generation]:
        return list(self._tasks.values())

    def add(self, old: Generation, grace: float, stopped: frozenset[str], proxy: object) -> None:
        """Retire ``old``: its requests finish within ``grace``, then the plugins named in
        ``stopped`` get ``edgeproxy_shutdown`` and its stack closes."""
        task = asyncio.create_task(_retire(old, grace, stopped, proxy))
        self._tasks[task] = old
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every retiring generation to close; false if one
        still drains."""
        if not self._tasks:
            return True
        _, pending = await asyncio.wait(list(self._tasks), timeout=max(timeout, 0.0))
        return not pending

    async def close(self) -> None:
        """Cut the drains short: each generation still closes its stack as its task ends."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _retire(old: Generation, grace: float, stopped: frozenset[str], proxy: object) -> None:
    old.pipeline.retire()
    try:
        if not await old.pipeline.wait_idle(grace):
            logger.warning(
                "generation %d: %d requests still running after %.1fs; cutting them",
                old.number,
                old.pipeline.in_flight,
                grace,
            )
            # As at shutdown: an SSE stream gets its error event, then the pools close.
            old.pipeline.responder.shutting_down = True
            for task in list(old.tasks):
                task.cancel()
            await old.pipeline.wait_idle(_STRAGGLER_TIMEOUT)
    finally:
        # Also when cancelled (the proxy closing): its pools must not outlive it.
        try:
            if stopped:
                await old.plugins.call_all_logged_of(stopped, "edgeproxy_shutdown", proxy=proxy)
        finally:
            await old.close()
        logger.info("generation %d closed", old.number)
