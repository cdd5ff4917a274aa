"""The world the lag scenarios run in: fake regions far away behind WAN links, the
proxies under test as their own processes behind a near PoP link, and one client.

Layout, the same for every variant of a scenario::

    client --pop link (5 ms)--> proxy --far link (150 ms)--> fake region
    client --direct link (155 ms)-------------------------> fake region

The fake regions and the WAN links run in this process (regions on their own
threads); nginx, the bare aiohttp forwarder and ``edgeproxy serve`` run as child
processes, stopped by their own pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _util as u
import aiohttp

from edgeproxy.testing import Behavior, FakeRegion, WanLink

PYTHON = sys.executable
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIGS = HERE / "scenarios"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Geometry:
    """One-way delays in seconds: user to PoP, PoP to the far regions."""

    pop: float = 0.005
    far: float = 0.150
    jitter: float = 0.002

    @property
    def direct(self) -> float:
        return self.pop + self.far


@dataclass(frozen=True)
class Tls:
    """The far regions served over TLS: their certificate for 127.0.0.1 (and ``localhost``)
    from a test CA every client of theirs trusts, verification on."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def make(cls, folder: Path) -> Tls:
        import trustme

        ca = trustme.CA()
        issued = ca.issue_cert("127.0.0.1", "localhost")
        paths = cls(folder / "region.pem", folder / "region.key", folder / "ca.pem")
        issued.cert_chain_pems[0].write_to_path(str(paths.cert))
        for extra in issued.cert_chain_pems[1:]:
            extra.write_to_path(str(paths.cert), append=True)
        issued.private_key_pem.write_to_path(str(paths.key))
        ca.cert_pem.write_to_path(str(paths.ca))
        return paths

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


def region_url(link: WanLink, tls: Tls | None) -> str:
    return link.url.replace("http://", "https://") if tls is not None else link.url


@dataclass
class Rec:
    """One request as the client saw it."""

    variant: str
    label: str
    sent: float  # seconds since the scenario's start
    status: int  # 0: no answer (connection failed or client timeout)
    ttfb: float  # to the response head
    first_token: float  # to the first visible token (the whole body when not streamed)
    total: float
    error: str = ""
    cache: str = ""
    degraded: str = ""  # X-Edgeproxy-Degraded: what rung of the ladder answered


@dataclass
class Proxy:
    """A proxy under test: its process and the PoP link in front of it."""

    name: str
    kind: str
    service: u.Service | None
    link: WanLink | None
    admin: int = 0

    @property
    def url(self) -> str:
        assert self.link is not None
        return self.link.url

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = u.http_json(f"http://127.0.0.1:{self.admin}/status")
        return data


@dataclass
class World:
    """Regions, their links, and the proxies started against them; :meth:`close` stops all."""

    geometry: Geometry = field(default_factory=Geometry)
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="scenarios-")))
    regions: dict[str, FakeRegion] = field(default_factory=dict)
    far: dict[str, WanLink] = field(default_factory=dict)
    direct: dict[str, WanLink] = field(default_factory=dict)
    proxies: list[Proxy] = field(default_factory=list)
    tls: Tls | None = None  # set by use_tls() before the first region

    def use_tls(self) -> Tls:
        """Serve the regions over TLS: every proxy and the direct client then verify them."""
        self.tls = Tls.make(self.tmp)
        return self.tls

    def direct_url(self, name: str) -> str:
        return region_url(self.direct[name], self.tls)

    async def region(self, name: str, **settings: Any) -> FakeRegion:
        """A fake region, with a far link (from the PoP) and a direct one (from the user)."""
        behavior = {k: v for k, v in settings.items() if k in Behavior.__dataclass_fields__}
        rest = {k: v for k, v in settings.items() if k not in behavior}
        if self.tls is not None:
            rest.update(certfile=str(self.tls.cert), keyfile=str(self.tls.key))
        region = FakeRegion(name=name, behavior=Behavior(**behavior), seed=1, **rest)
        await region.start()
        self.regions[name] = region
        g = self.geometry
        self.far[name] = WanLink(region.port, delay=g.far, jitter=g.jitter, seed=2)
        self.direct[name] = WanLink(region.port, delay=g.direct, jitter=g.jitter, seed=3)
        await self.far[name].start()
        await self.direct[name].start()
        return region

    def upstream_calls(self) -> int:
        return sum(r.requests_by_path.get(CHAT, 0) for r in self.regions.values())

    async def proxy(self, name: str, kind: str, config: str | None = None, **opts: Any) -> Proxy:
        """Start a proxy of ``kind`` (``nginx``, ``reference``, ``edgeproxy``) in front of every
        region's far link, and a PoP link in front of it; ``direct`` is the no-proxy client."""
        if kind == "direct":
            proxy = Proxy(name, kind, None, None)
            self.proxies.append(proxy)
            return proxy
        port, admin = u.free_port(), u.free_port()
        upstreams = [link.port for link in self.far.values()]
        log = self.tmp / f"{name}.log"
        if kind == "nginx":
            binary = u.nginx_binary()
            assert binary is not None
            read_timeout = float(opts.get("read_timeout", 60.0))
            conf = nginx_conf(port, upstreams, read_timeout, self.tls)
            service = u.nginx_service(name, binary, self.tmp / name, conf, [])
        elif kind == "reference":
            scheme = "https" if self.tls is not None else "http"
            argv = [PYTHON, str(HERE / "reference_proxy.py"), "--port", str(port)]
            argv += ["--upstream", f"{scheme}://127.0.0.1:{upstreams[0]}"]
            # aiohttp's default context reads its trust store from SSL_CERT_FILE.
            env = None if self.tls is None else {**os.environ, "SSL_CERT_FILE": str(self.tls.ca)}
            service = u.Service(name, argv, log, env=env, cwd=REPO)
        else:
            path = self.tmp / f"{name}.toml"
            path.write_text(edgeproxy_toml(port, admin, self.far, config, self.tls))
            argv = [PYTHON, "-m", "edgeproxy", "serve", "--config", str(path)]
            # [upstream] ca_file through the environment: the scenario's config may have its
            # own [upstream] table, which TOML will not let the bench open twice.
            env = None
            if self.tls is not None:
                env = {**os.environ, "EDGEPROXY_UPSTREAM__CA_FILE": str(self.tls.ca)}
            service = u.Service(name, [*argv, "--log-level", "error"], log, env=env, cwd=REPO)
        service.start()
        await asyncio.to_thread(wait_port, service, port)
        if kind == "edgeproxy":
            await asyncio.to_thread(service.wait_http, f"http://127.0.0.1:{admin}/readyz")
        g = self.geometry
        link = WanLink(port, delay=g.pop, jitter=g.jitter / 2, seed=4)
        await link.start()
        proxy = Proxy(name, kind, service, link, admin)
        self.proxies.append(proxy)
        return proxy

    async def start_all(
        self, variants: Sequence[tuple[str, str, str | None]], **opts: Any
    ) -> dict[str, Proxy]:
        """Start every variant's proxy at once (name, kind, config), keyed by name: the
        start-up costs one proxy's wait, and each idles until its turn."""
        slugs = [name.replace(", ", "-").replace(" ", "-") for name, _, _ in variants]
        proxies = await asyncio.gather(
            *(
                self.proxy(slug, kind, config, **opts)
                for slug, (_, kind, config) in zip(slugs, variants, strict=True)
            )
        )
        return {name: proxy for (name, _, _), proxy in zip(variants, proxies, strict=True)}

    async def stop_proxy(self, proxy: Proxy) -> None:
        if proxy.link is not None:
            await proxy.link.stop()
        if proxy.service is not None:
            await asyncio.to_thread(proxy.service.stop)
        self.proxies.remove(proxy)

    async def close(self) -> None:
        for proxy in list(self.proxies):
            await self.stop_proxy(proxy)
        for link in [*self.far.values(), *self.direct.values()]:
            await link.stop()
        for region in self.regions.values():
            await region.stop(grace=0.5)


def wait_port(service: u.Service, port: int, timeout: float = 20.0) -> None:
    """Until something accepts on ``port``; fails early if the process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        service.check_alive()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise u.ServiceError(f"{service.name} never listened on {port}:\n{service.log_tail()}")


def nginx_conf(
    port: int, upstreams: Sequence[int], read_timeout: float, tls: Tls | None = None
) -> str:
    """nginx as a plain reverse proxy: round robin, a keep-alive pool, no buffering;
    with ``tls``, to the regions over TLS, verified (sessions reused, nginx's default)."""
    servers = "".join(f"        server {u.LOOPBACK}:{p};\n" for p in upstreams)
    scheme, verify = "http", ""
    if tls is not None:
        scheme = "https"
        # nginx matches proxy_ssl_name against DNS names only: the certificate's localhost.
        # TLS 1.3 as for the other clients (nginx before 1.23.4 leaves it out by default).
        verify = f"""
            proxy_ssl_protocols TLSv1.2 TLSv1.3;
            proxy_ssl_verify on;
            proxy_ssl_trusted_certificate {tls.ca};
            proxy_ssl_name localhost;"""
    return f"""
worker_processes 1;
error_log logs/error.log warn;
pid logs/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    upstream origin {{
{servers}        keepalive 64;
    }}
    server {{
        listen {u.LOOPBACK}:{port} backlog=4096;
        location / {{
            proxy_pass {scheme}://origin;{verify}
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_connect_timeout {read_timeout:g}s;
            proxy_read_timeout {read_timeout:g}s;
        }}
    }}
}}
"""


def edgeproxy_toml(
    port: int, admin: int, far: dict[str, WanLink], config: str | None, tls: Tls | None = None
) -> str:
    """The listeners and the regions (their far links), then the checked-in scenario config
    ``bench/scenarios/<config>.toml`` as it is (None: edgeproxy's defaults)."""
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "grace_period = 1.0",
        "[admin]",
        'host = "127.0.0.1"',
        f"port = {admin}",
        "[plugins]",
        "entry_points = false",
    ]
    for name, link in far.items():
        lines += ["[[regions]]", f'name = "{name}"', f'url = "{region_url(link, tls)}"']
    text = "\n".join(lines) + "\n"
    if config is not None:
        text += "\n" + (CONFIGS / f"{config}.toml").read_text()
    return text


def chat_body(question: str, *, stream: bool = False, tokens: int | None = None) -> bytes:
    body: dict[str, Any] = {
        "model": "fake-llm",
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "stream": stream,
    }
    if tokens is not None:
        body["max_tokens"] = tokens
    return json.dumps(body).encode()


class Client:
    """The one client of every variant: a new connection per request, as a page opens
    (``keepalive`` reuses them instead, to tell the cost of the client's handshakes)."""

    def __init__(self, timeout: float, *, keepalive: bool = False, tls: Tls | None = None) -> None:
        self.timeout = timeout
        self.keepalive = keepalive
        self.ssl: ssl.SSLContext | bool = True if tls is None else tls.client_context()
        self.session: aiohttp.ClientSession | None = None
        self.start = time.monotonic()

    async def __aenter__(self) -> Client:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=not self.keepalive, ssl=self.ssl),
            timeout=aiohttp.ClientTimeout(total=self.timeout),
        )
        self.start = time.monotonic()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def call(
        self,
        variant: str,
        url: str,
        body: bytes,
        *,
        label: str = "",
        headers: dict[str, str] | None = None,
        buffered: bool = False,
    ) -> Rec:
        """POST a chat request; times the head, the first visible token and the end
        (``buffered``: a page that shows nothing before the whole answer is in)."""
        assert self.session is not None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sent = time.monotonic() - self.start
        hdrs = {"content-type": "application/json", **(headers or {})}
        ttfb = first = 0.0
        try:
            async with self.session.post(url + CHAT, data=body, headers=hdrs) as resp:
                ttfb = loop.time() - t0
                streamed = resp.headers.get("content-type", "").startswith("text/event-stream")
                async for chunk in resp.content.iter_any():
                    if not first and (not streamed or b'"content"' in chunk):
                        first = loop.time() - t0
                total = loop.time() - t0
                if buffered or not streamed:
                    first = total
                cache = resp.headers.get("x-edgeproxy-cache", resp.headers.get("x-cache", ""))
                degraded = resp.headers.get("x-edgeproxy-degraded", "")
                return Rec(
                    variant,
                    label,
                    sent,
                    resp.status,
                    ttfb,
                    first,
                    total,
                    cache=cache,
                    degraded=degraded,
                )
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            spent = loop.time() - t0
            return Rec(variant, label, sent, 0, spent, spent, spent, error=type(exc).__name__)


async def closed_loop(workers: int, jobs: Iterable[Callable[[], Awaitable[Rec]]]) -> list[Rec]:
    """Run the jobs with at most ``workers`` at once, in order of the iterable."""
    it = iter(jobs)
    out: list[Rec] = []

    async def worker() -> None:
        for job in it:
            out.append(await job())

    await asyncio.gather(*(worker() for _ in range(workers)))
    return out


def pct(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile in milliseconds, None for no values."""
    if not values:
        return None
    return 1000 * u.percentile(sorted(values), q)


def ratio(before: float | None, after: float | None) -> float | None:
    """How many times ``after`` is better (smaller) than ``before``."""
    if before is None or after is None or after <= 0:
        return None
    return before / after


@dataclass(frozen=True)
class Mode:
    """How long each scenario runs: the full form, or seconds for the test."""

    short: bool

    @property
    def geometry(self) -> Geometry:
        # The short form keeps the shape (a near PoP, far regions) at a tenth of the delays.
        return Geometry(pop=0.002, far=0.03, jitter=0.001) if self.short else Geometry()


def plain_proxy() -> str:
    return "nginx" if u.nginx_binary() is not None else "reference"


@dataclass
class Outcome:
    """One scenario's result: its table, its headline and the invariants the test checks."""

    name: str
    title: str
    header: list[str]
    rows: list[list[Any]]
    headline: dict[str, Any]
    invariants: dict[str, Any]
    notes: list[str]
    more_headlines: list[dict[str, Any]] = field(default_factory=list)  # more summary rows


async def open_loop(
    client: Client,
    name: str,
    urls: list[str],
    rate: float,
    phases: list[tuple[str, float, Callable[[], Any] | None]],
    *,
    prefix: str,
    headers: Callable[[int], dict[str, str]] | None = None,
    sent: list[int] | None = None,
    questions: int | None = None,
    skip_first: bool = False,
) -> list[Rec]:
    """Fixed-rate requests through ``phases`` (label, seconds, action at its start), spread
    round robin over ``urls``; waits for every answer. Each request asks its own question, or
    one of ``questions`` in turn; with ``skip_first`` the first phase only waits."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[Rec]] = []
    k = 0
    for n, (label, seconds, action) in enumerate(phases):
        if action is not None:
            result = action()
            if isinstance(result, Awaitable):
                await result
        if skip_first and n == 0:
            await asyncio.sleep(seconds)
            continue
        end = loop.time() + seconds
        due = loop.time()
        while due < end:
            await asyncio.sleep(max(0.0, due - loop.time()))
            url = urls[k % len(urls)]
            hdrs = headers(k) if headers is not None else None
            body = chat_body(f"{prefix} {k if questions is None else k % questions}")
            tasks.append(
                asyncio.ensure_future(client.call(name, url, body, label=label, headers=hdrs))
            )
            k += 1
            if sent is not None:
                sent[0] += 1
            due += 1 / rate
    return list(await asyncio.gather(*tasks))
