"""``FakeRegion``: one fake regional cluster served by hypercorn in its own thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from typing import Any, Final, cast

from edgeproxy.testing._app import Counters, RegionApp
from edgeproxy.testing._behavior import Behavior
from edgeproxy.testing._load import (
    LOAD_METRICS_FORMATS,
    METRICS_FLAVORS,
    LoadMetricsFormat,
    MetricsFlavor,
)
from edgeproxy.testing._served import Served

try:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "edgeproxy.testing needs hypercorn; install edgeproxy[testing] (or [dev], [bench])"
    ) from exc

log = logging.getLogger(__name__)

# How long hypercorn may keep waiting for connections after the region's own
# reaper has dropped them; only reached if that reaper fails.
_HYPERCORN_BACKSTOP: Final = 5.0
# After a graceful drain, how long idle connections get to close cleanly
# before they are dropped.
_IDLE_CLOSE_WAIT: Final = 1.0
# Hypercorn's graceful timeout on a kill, in seconds.
_KILL_BACKSTOP: Final = 0.05


def _check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, not {value!r}")


def _check_llm_model(
    kv_capacity_blocks: object,
    kv_block_size: object,
    max_running: object,
    max_queue: object,
    queue_full_status: object,
    load_metrics_always: object,
    metrics_flavor: object,
) -> None:
    _check_count("kv_capacity_blocks", kv_capacity_blocks, 0)
    _check_count("kv_block_size", kv_block_size, 1)
    _check_count("max_running", max_running, 0)
    if max_queue is not None:
        _check_count("max_queue", max_queue, 0)
    if (
        isinstance(queue_full_status, bool)
        or not isinstance(queue_full_status, int)
        or not 400 <= queue_full_status <= 599
    ):
        raise ValueError(f"queue_full_status must be 400-599, not {queue_full_status!r}")
    if load_metrics_always is not None and load_metrics_always not in LOAD_METRICS_FORMATS:
        raise ValueError(
            f"load_metrics_always must be None, TEXT or JSON, not {load_metrics_always!r}"
        )
    if metrics_flavor not in METRICS_FLAVORS:
        raise ValueError(f"metrics_flavor must be vllm or sglang, not {metrics_flavor!r}")


class FakeRegion(Served):
    """A fake OpenAI-compatible regional cluster listening on a real TCP port.

    The server runs hypercorn on a dedicated thread with its own event loop,
    so it keeps answering while the test's loop is busy or blocked. On a
    cleartext port it speaks HTTP/1.1 and HTTP/2 with prior knowledge (h2c);
    with ``certfile``/``keyfile`` it speaks TLS and offers ``h2`` and
    ``http/1.1`` by ALPN.

    Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``,
    ``POST /v1/embeddings``, the Responses API (``POST /v1/responses``,
    ``GET``/``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``,
    ``POST /v1/responses/{id}/cancel``; see :mod:`edgeproxy.testing._responses`),
    conversations, files, batches and vector stores (``/v1/conversations``, ``/v1/files``,
    ``/v1/batches``, ``/v1/vector_stores`` and what is under them; see
    :mod:`edgeproxy.testing._objects`),
    Anthropic's Messages API (``POST /v1/messages``,
    ``POST /v1/messages/count_tokens``; see :mod:`edgeproxy.testing._messages`),
    ``GET /v1/models``, ``GET /healthz``,
    ``ANY /echo/...`` (``?size=N``, ``?chunks=N``, ``?delay=S``),
    ``GET /status/{code}``, ``GET /metrics`` and the control API under
    ``/_control``. Every response carries ``x-fake-region: <name>``.

    The Responses API is stateful: a region stores the responses it answered
    whole (unless ``store`` is false), at most ``responses_capacity`` of them,
    and only it can continue them (``previous_response_id``), look them up or
    delete them; another region answers 404 ``previous_response_not_found``.
    The store is emptied when the region (re)starts. :attr:`responses` shows
    it, :meth:`clear_responses` (or ``POST /_control/clear-responses``)
    empties it, and :meth:`counters` counts its hits and misses. So are its
    conversations, files, batches and vector stores: each exists in the region that
    made it, another answers the API's 404 (:attr:`objects` shows them).
    :attr:`anthropic_version` and :attr:`anthropic_beta` are the last such
    headers a Messages request carried.

    Chat, completions, Responses and Messages requests go through a small model of an LLM server
    (vLLM-like). It is always on, with defaults that change nothing: no slot
    limit, no cache, no per-token cost. With ``max_running`` set, that
    many requests generate at once and the others wait in FIFO order; with
    ``kv_capacity_blocks`` set, prompts are cut into blocks of
    ``kv_block_size`` tokens kept in an LRU prefix cache, and a request's TTFT is
    ``Behavior.ttft + uncached * ttft_per_uncached_token + cached *
    ttft_per_cached_token``, counted from when it leaves the queue. Their
    answers report what happened::

        x-fake-kv-prompt-tokens: 40     # the model's token count of the prompt
        x-fake-kv-cached-tokens: 32     # the cached prefix (whole blocks)
        x-fake-ttft-ms: 1.184           # the modelled TTFT, queue time excluded
        x-fake-queue-ms: 0.012          # the time spent queued (wall clock)

    and, when the request sends ``endpoint-load-metrics-format: TEXT`` or
    ``JSON`` (or the region has ``load_metrics_always``), vLLM's ORCA load
    header, taken as the response starts (each on one line)::

        endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.25,
            named_metrics.num_requests_waiting=2.0, named_metrics.num_requests_running=4.0
        endpoint-load-metrics: JSON {"named_metrics": {"kv_cache_usage_perc": 0.25,
            "num_requests_waiting": 2.0, "num_requests_running": 4.0}}

    ``kv_cache_usage_perc`` is, as in vLLM, the share of the KV capacity held
    by the running requests (each holds the blocks of its prompt and
    completion), not the fill of the prefix cache. The header is on every
    chat and completions answer the model produced (streams included,
    unlike vLLM, which sends it on whole JSON answers only) and on the
    ``max_queue`` rejections. ``GET /metrics`` exposes the same gauges in the
    Prometheus text format: ``vllm:num_requests_running``,
    ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (labels
    ``engine="0"``, ``model_name``) with vLLM's prefix-cache and token
    counters, or with ``metrics_flavor="sglang"`` ``sglang:num_running_reqs``,
    ``sglang:num_queue_reqs``, ``sglang:token_usage``,
    ``sglang:cache_hit_rate`` and token counters (label ``model_name``).
    The totals are in :meth:`counters` too.

    The model's tokeniser is cheap and deterministic: a ``<|role|>`` token per
    chat message, then its text (text parts only; any other part is one
    token) split on whitespace into pieces of up to 4 characters; a
    completions prompt is its text, or its token ids. Block *i* is cached under
    a hash of blocks 0..i, and only whole blocks are cached, so the next turn
    of a conversation finds every whole block of the turn before. As in vLLM,
    the last prompt token is always computed: a prompt made only of cached
    blocks misses its last one. A request's blocks are cached when it gets its
    slot, refreshed from its last block to its first, so the LRU evicts the
    ends of prompts before their beginnings.

    ``behavior`` is read by every request when it arrives and may be changed at
    any time, from any thread. Counters survive :meth:`kill` and
    :meth:`restart`. The lifecycle methods themselves must not be called
    concurrently.

    Args:
        name: Region name, sent in ``x-fake-region``.
        host: Address to listen on.
        port: Port to listen on; 0 picks a free one, kept across restarts.
        behavior: Initial behaviour; a default :class:`Behavior` if omitted.
        model: Model id listed by ``/v1/models`` and answered when a request
            names none; :attr:`model` changes it while the region serves.
        max_model_len: The context window ``/v1/models`` gives the model (as vLLM's
            ``max_model_len``).
        certfile: PEM certificate chain; enables TLS together with ``keyfile``.
        keyfile: PEM private key.
        http1_only: Refuse HTTP/2: TLS offers only ``http/1.1``, and cleartext
            HTTP/2 streams are reset with HTTP_1_1_REQUIRED.
        seed: Seed for the ``fault_rate`` draws; ``None`` for a random one.
        max_concurrent_streams: HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS.
        keep_alive_timeout: Seconds an idle connection is kept open.
        shutdown_grace: Default seconds :meth:`stop` lets requests finish.
        kv_capacity_blocks: Blocks in the prefix cache; 0 (the default) for
            no cache. The cache starts empty at every (re)start.
        kv_block_size: Tokens per KV block.
        max_running: Chat and completions requests generating at once; 0 (the
            default) for no limit. A request holds its slot until its answer
            is complete or its client leaves.
        max_queue: Requests that may wait for a slot; ``None`` for no limit.
            Beyond it a request is answered ``queue_full_status`` at once.
        queue_full_status: The status for a full queue, with an OpenAI error
            body: 503 (the default), 429, or any other 4xx/5xx.
        load_metrics_always: ``"TEXT"`` or ``"JSON"``: send the
            ``endpoint-load-metrics`` header in that format when a request
            does not ask for a valid one; ``None`` (the default) sends it only
            when asked, like vLLM.
        metrics_flavor: ``"vllm"`` (the default) or ``"sglang"``: the metric
            names of ``GET /metrics``.
        responses_capacity: Responses the region stores before it drops the
            oldest (10,000 by default).
    """

    def __init__(
        self,
        name: str = "region",
        host: str = "127.0.0.1",
        port: int = 0,
        behavior: Behavior | None = None,
        *,
        model: str = "fake-llm",
        max_model_len: int = 4096,
        certfile: str | None = None,
        keyfile: str | None = None,
        http1_only: bool = False,
        seed: int | None = None,
        max_concurrent_streams: int = 100,
        keep_alive_timeout: float = 60.0,
        shutdown_grace: float = 0.5,
        kv_capacity_blocks: int = 0,
        kv_block_size: int = 16,
        max_running: int = 0,
        max_queue: int | None = None,
        queue_full_status: int = 503,
        load_metrics_always: LoadMetricsFormat | None = None,
        metrics_flavor: MetricsFlavor = "vllm",
        responses_capacity: int = 10_000,
    ) -> None:
        if (certfile is None) != (keyfile is None):
            raise ValueError("certfile and keyfile go together")
        _check_llm_model(
            kv_capacity_blocks,
            kv_block_size,
            max_running,
            max_queue,
            queue_full_status,
            load_metrics_always,
            metrics_flavor,
        )
        _check_count("responses_capacity", responses_capacity, 1)
        _check_count("max_model_len", max_model_len, 1)
        self.name = name
        self.host = host
        self._port = port
        self.certfile = certfile
        self.keyfile = keyfile
        self.http1_only = http1_only
        self.max_concurrent_streams = max_concurrent_streams
        self.keep_alive_timeout = keep_alive_timeout
        self.shutdown_grace = shutdown_grace
        self._app = RegionApp(
            name,
            behavior or Behavior(),
            model=model,
            max_model_len=max_model_len,
            http1_only=http1_only,
            seed=seed,
            kv_capacity_blocks=kv_capacity_blocks,
            kv_block_size=kv_block_size,
            max_running=max_running,
            max_queue=max_queue,
            queue_full_status=queue_full_status,
            load_metrics_always=load_metrics_always,
            metrics_flavor=metrics_flavor,
            responses_capacity=responses_capacity,
        )
        self._thread: threading.Thread | None = None
        self._done: concurrent.futures.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Event | None = None
        self._config: Config | None = None
        self._reaper: asyncio.Task[None] | None = None

    # -- addresses -------------------------------------------------------

    @property
    def port(self) -> int:
        """The listening port (the one picked, once started with ``port=0``)."""
        return self._port

    @property
    def scheme(self) -> str:
        return "https" if self.certfile else "http"

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``. Known once started."""
        if self._port == 0:
            raise RuntimeError("the port is picked when the region starts")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self._port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- behaviour and counters ------------------------------------------

    @property
    def model(self) -> str:
        """The model the region serves: listed by ``/v1/models``, named in answers to
        requests that name none. Assign it to serve another from the next request on."""
        return self._app.model

    @model.setter
    def model(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise TypeError(f"model must be a non-empty string, not {value!r}")
        self._app.model = value

    @property
    def behavior(self) -> Behavior:
        """The live behaviour; assign fields to change how the next requests are answered."""
        return self._app.behavior

    @behavior.setter
    def behavior(self, value: Behavior) -> None:
        if not isinstance(value, Behavior):
            raise TypeError(f"expected a Behavior, not {type(value).__name__}")
        self._app.behavior = value

    def configure(self, **changes: Any) -> Behavior:
        """Change several :class:`Behavior` fields at once; requests see all or none."""
        self._app.behavior = self._app.behavior.copy(**changes)
        return self._app.behavior

    def counters(self) -> Counters:
        """A consistent snapshot of all counters."""
        return self._app.counters()

    def reset_counters(self) -> None:
        """Zero the counters (``in_flight`` keeps counting what is in progress)."""
        self._app.reset_counters()

    @property
    def requests_total(self) -> int:
        return self._app.counters().requests_total

    @property
    def requests_by_path(self) -> dict[str, int]:
        return dict(self._app.counters().requests_by_path)

    @property
    def in_flight(self) -> int:
        return self._app.counters().in_flight

    def clear_kv_cache(self) -> None:
        """Empty the prefix cache, as if the server had just started."""
        self._app.clear_kv_cache()

    @property
    def responses(self) -> dict[str, dict[str, Any]]:
        """The stored Responses API responses by id, oldest first (a snapshot)."""
        return self._app.responses.snapshot()

    def clear_responses(self) -> None:
        """Forget every stored response, as a restarted server would."""
        self._app.responses.clear()

    @property
    def objects(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The stored conversations, files, batches and vector stores, by kind
        (``conversations``, ``files``, ``batches``, ``vector_stores``) and id (a snapshot)."""
        return self._app.objects.snapshot()

    @property
    def anthropic_version(self) -> str | None:
        """The ``anthropic-version`` header of the last Messages request that had one."""
        return self._app.seen.anthropic_version

    @property
    def anthropic_beta(self) -> str | None:
        """The ``anthropic-beta`` header of the last Messages request that had one."""
        return self._app.seen.anthropic_beta

    @property
    def cancelled_total(self) -> int:
        return self._app.counters().cancelled_total

    @property
    def connections_total(self) -> int:
        return self._app.counters().connections_total

    @property
    def peak_streams_per_connection(self) -> int:
        return self._app.counters().peak_streams_per_connection

    async def wait_until(
        self,
        predicate: Callable[[Counters], bool],
        timeout: float = 5.0,
        interval: float = 0.005,
    ) -> Counters:
        """Poll the counters until ``predicate`` holds; raise ``TimeoutError`` after ``timeout``.

        For example ``await region.wait_until(lambda c: c.in_flight == 3)``
        waits for three requests to have arrived, without guessing a sleep.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            counters = self._app.counters()
            if predicate(counters):
                return counters
            if loop.time() >= deadline:
                raise TimeoutError(f"fake region {self.name}: condition not met; {counters}")
            await asyncio.sleep(interval)

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Start listening; return once requests are being served."""
        ready = self._launch()
        try:
            await asyncio.wrap_future(ready)
        except BaseException:
            self._halt(grace=None)
            raise

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening and shut down.

        Requests in flight get ``grace`` seconds (default ``shutdown_grace``) to
        finish; then their connections are dropped. Stalled requests (faults
        ``stall`` and ``stall_body``) are aborted at once. Does nothing if the
        region is not running.
        """
        await self._halted(self._request_stop(self.shutdown_grace if grace is None else grace))

    async def kill(self) -> None:
        """Emulate a dead region: close the listener and drop every connection now.

        In-flight requests get no response. :meth:`restart` brings the region
        back on the same port.
        """
        await self._halted(self._request_stop(None))

    async def _halted(self, done: concurrent.futures.Future[None] | None) -> None:
        """Wait for the stop that ``done`` reports (None: the region was not running)."""
        if done is not None:
            try:
                await asyncio.wrap_future(done)
            finally:
                self._join()

    async def restart(self) -> None:
        """Listen again on the same port after :meth:`kill` or :meth:`stop`."""
        if self.running:
            raise RuntimeError(f"fake region {self.name} is running")
        await self.start()

    def start_sync(self, timeout: float = 30.0) -> None:
        """:meth:`start` for code without an event loop."""
        ready = self._launch()
        try:
            ready.result(timeout)
        except BaseException:
            self._halt(grace=None)
            raise

    def stop_sync(self, grace: float | None = None, timeout: float = 30.0) -> None:
        """:meth:`stop` for code without an event loop."""
        self._halt(self.shutdown_grace if grace is None else grace, timeout)

    def __repr__(self) -> str:
        where = self.url if self._port else "not started"
        state = "running" if self.running else "stopped"
        return f"<FakeRegion {self.name} {where} {state}>"

    # -- internals: caller's thread ------------------------------------------

    def _launch(self) -> concurrent.futures.Future[None]:
        if self.running:
            raise RuntimeError(f"fake region {self.name} is already running")
        if self.certfile is not None and self.keyfile is not None:
            # Fail here, in the caller, rather than in the server thread.
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                self.certfile, self.keyfile
            )
        sock = self._bind()
        self._port = sock.getsockname()[1]
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._done = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._thread_main,
            args=(sock, ready, self._done),
            name=f"fake-region-{self.name}",
            daemon=True,
        )
        self._thread.start()
        return ready

    def _bind(self) -> socket.socket:
        # Binding here rather than letting hypercorn bind gives port=0 a real
        # port with no window for another process to take it, and lets a
        # restart reuse the port (SO_REUSEADDR, set by create_server).
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        return socket.create_server((self.host, self._port), family=family, backlog=1024)

    def _request_stop(self, grace: float | None) -> concurrent.futures.Future[None] | None:
        """Ask the server thread to shut down; ``grace=None`` drops everything now."""
        loop, done = self._loop, self._done
        if loop is None or done is None or not self.running:
            self._join()
            return None
        try:
            loop.call_soon_threadsafe(self._begin_shutdown, grace)
        except RuntimeError:
            pass  # the loop already closed: the thread is on its way out
        return done

    def _halt(self, grace: float | None, timeout: float = 30.0) -> None:
        done = self._request_stop(grace)
        if done is not None:
            try:
                done.result(timeout)
            finally:
                self._join()

    def _join(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)
            if not thread.is_alive():
                self._thread = None
                self._loop = None

    # -- internals: server thread ----------------------------------------------

    def _thread_main(
        self,
        sock: socket.socket,
        ready: concurrent.futures.Future[None],
        done: concurrent.futures.Future[None],
    ) -> None:
        try:
            asyncio.run(self._serve(sock, ready))
        except BaseException as exc:
            log.exception("fake region %s failed", self.name)
            if not ready.done():
                ready.set_exception(exc)
            done.set_exception(exc)
        else:
            if not ready.done():
                ready.set_exception(RuntimeError(f"fake region {self.name} exited early"))
            done.set_result(None)
        finally:
            sock.close()  # only still open if hypercorn never took it over

    async def _serve(self, sock: socket.socket, ready: concurrent.futures.Future[None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._shutdown = asyncio.Event()

        def on_startup() -> None:
            if not ready.done():
                ready.set_result(None)

        self._app.begin_run(on_startup)
        self._config = config = self._hypercorn_config()
        # Hypercorn wraps the descriptor in its own socket object and closes
        # it; detach ours so that only one object owns it.
        config.bind = [f"fd://{sock.detach()}"]
        try:
            await serve(cast(Any, self._app), config, shutdown_trigger=self._shutdown.wait)
        finally:
            if self._reaper is not None:
                self._reaper.cancel()
                try:
                    await self._reaper
                except asyncio.CancelledError:
                    pass
                self._reaper = None

    def _hypercorn_config(self) -> Config:
        config = Config()
        config.errorlog = logging.getLogger("edgeproxy.testing.server")
        config.accesslog = None
        config.backlog = 1024
        config.certfile = self.certfile
        config.keyfile = self.keyfile
        config.alpn_protocols = ["http/1.1"] if self.http1_only else ["h2", "http/1.1"]
        config.h2_max_concurrent_streams = self.max_concurrent_streams
        config.keep_alive_timeout = self.keep_alive_timeout
        # Hypercorn's own request limit sends a GOAWAY that strands the
        # request which triggered it (see _hypercorn.py); the "goaway" fault
        # does it properly, so the built-in limit must never trigger.
        config.keep_alive_max_requests = sys.maxsize
        return config

    def _begin_shutdown(self, grace: float | None) -> None:
        if self._shutdown is None or self._shutdown.is_set():
            return
        self._app.begin_stop()
        if self._config is not None:
            # A kill drops connections that never carried a request (a warm pool's) too:
            # hypercorn closes them when its graceful timeout ends, so it ends at once.
            self._config.graceful_timeout = (
                _KILL_BACKSTOP if grace is None else grace + _HYPERCORN_BACKSTOP
            )
        self._reaper = asyncio.get_running_loop().create_task(self._reap(grace))
        self._shutdown.set()

    async def _reap(self, grace: float | None) -> None:
        """Drop connections that outlive the grace period.

        Hypercorn's own ``graceful_timeout`` is not enough: on Python 3.12+
        its shutdown waits in ``Server.wait_closed()`` for every connection
        before the timeout even starts (hypercorn issue #308).
        """
        await self._app.wait_stopping()
        if grace is not None:
            try:
                await asyncio.wait_for(self._app.wait_idle(), grace)
            except TimeoutError:
                pass
            else:
                # Everything was answered; hypercorn closes idle connections
                # cleanly by itself, so only stragglers need dropping.
                await asyncio.sleep(_IDLE_CLOSE_WAIT)
        while True:
            self._app.abort_all()
            await asyncio.sleep(0.05)
