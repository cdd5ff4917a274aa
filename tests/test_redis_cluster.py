"""Redis Cluster: the cache, the shared rate limits and the shared load view through a real
three-master cluster these tests start and kill; the cluster and TLS settings they share."""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from edgeproxy import Config
from edgeproxy._admission.ratelimit import Charge, Limit, RedisBuckets
from edgeproxy._cache.backends import RedisTier
from edgeproxy._cache.entry import Entry
from edgeproxy._core.config import (
    AdmissionConfig,
    CacheConfig,
    ConfigError,
    RedisSettings,
    SharedLoadConfig,
)
from edgeproxy._shared.loadview import LoadView
from edgeproxy._shared.redisclient import client_options, make_client
from edgeproxy._upstream.regions import RegionSet

from .conftest import ProxyFactory, RegionFactory, eventually, proxy_config
from .test_cache import CHAT, cache_status, chat, post

MINIMAL: dict[str, Any] = {"regions": [{"name": "r1", "url": "http://127.0.0.1:1"}]}


# -- the settings, no server --------------------------------------------------------


@pytest.mark.parametrize("section", ["cache", "admission", "shared_load"])
@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("unix:///run/redis.sock", "redis_url is a Unix socket: a Redis Cluster is reached by"),
        ("redis://node-1:7000/2", "redis_url names database 2: a Redis Cluster has database 0"),
    ],
)
def test_a_cluster_needs_a_tcp_url_and_database_0(section: str, url: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(
            {**MINIMAL, section: {"redis_url": url, "redis_cluster": True}}, environ={}
        )
    [error] = info.value.errors
    assert error.startswith(f"{section}.redis_cluster: {reason}"), error
    ok = Config.from_mapping(
        {**MINIMAL, section: {"redis_url": "rediss://node-1:7000/0", "redis_cluster": True}},
        environ={},
    )
    assert getattr(ok, section).redis_cluster


@pytest.mark.parametrize("section", ["cache", "admission", "shared_load"])
def test_query_parameters_are_refused_not_ignored(section: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_mapping(
            {**MINIMAL, section: {"redis_url": "rediss://h:6380/0?ssl_ca_certs=/ca.pem"}},
            environ={},
        )
    [error] = info.value.errors
    assert error.startswith(f"{section}.redis_url: has query parameters (ssl_ca_certs)"), error
    # A socket's db is the one parameter read.
    Config.from_mapping({**MINIMAL, section: {"redis_url": "unix:///r.sock?db=2"}}, environ={})


def test_shared_load_ttl_must_outlast_the_interval() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_mapping({**MINIMAL, "shared_load": {"interval": 1.0, "ttl": 1.0}}, environ={})
    assert info.value.errors == ["shared_load: ttl must be longer than interval"]


def test_every_redis_section_builds_its_client_from_the_same_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[admission] and [shared_load] have the cache's AUTH and TLS keys, and mean the same."""
    monkeypatch.setenv("EDGE_REDIS_PW", "from-env")
    keys = {
        "redis_url": "rediss://u:url-pw@redis.internal:6380/1",
        "redis_username": "edge",
        "redis_password_env": "EDGE_REDIS_PW",
        "redis_tls_ca_file": "/ca.pem",
        "redis_tls_cert_file": "/c.pem",
        "redis_tls_key_file": "/k.pem",
    }
    sections = [CacheConfig(**keys), AdmissionConfig(**keys), SharedLoadConfig(**keys)]
    options = [client_options(s.redis_settings(), connect_timeout=1.0) for s in sections]
    assert options[0] == options[1] == options[2]
    first = options[0]
    assert (first["host"], first["port"], first["db"]) == ("redis.internal", 6380, 1)
    assert (first["username"], first["password"]) == ("edge", "from-env")
    assert first["ssl_ca_certs"] == "/ca.pem" and first["ssl_cert_reqs"] == "required"
    # Without the keys, the URL's own user and password log in.
    plain = client_options(RedisSettings("redis://u:p%40ss@h/0"), connect_timeout=1.0)
    assert (plain["username"], plain["password"]) == ("u", "p@ss")
    assert "s3cret" not in repr(RedisSettings("redis://:s3cret@h", password="s3cret"))


async def test_the_builder_makes_a_cluster_client_when_asked() -> None:
    client = make_client(RedisSettings("redis://127.0.0.1:7000", cluster=True), connect_timeout=1)
    try:
        assert isinstance(client, RedisCluster)
    finally:
        await client.aclose()


# -- a real cluster -------------------------------------------------------------------

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def _free_cluster_port() -> int:
    """A port free with its cluster bus port (port + 10000)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _cli(port: int, *args: str, timeout: float = 10.0) -> str:
    assert REDIS_CLI is not None
    result = subprocess.run(
        [REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result.stdout


class Cluster:
    """Three cluster-enabled masters on free ports, no replicas."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        for _ in range(3):
            port = _free_cluster_port()
            self.ports.append(port)
            self.procs.append(
                subprocess.Popen(
                    [
                        REDIS_SERVER,
                        "--port", str(port),
                        "--bind", "127.0.0.1",
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", str(self.workdir / f"nodes-{port}.conf"),
                        "--save", "",
                        "--appendonly", "no",
                        "--dir", str(self.workdir),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )  # fmt: skip
        for port in self.ports:
            self._wait(lambda p=port: _cli(p, "PING").strip() == "PONG", "node did not start")
        assert REDIS_CLI is not None
        subprocess.run(
            [
                REDIS_CLI, "--cluster", "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas", "0", "--cluster-yes",
            ],
            capture_output=True,
            timeout=60,
            check=True,
        )  # fmt: skip
        self._wait(
            lambda: all("cluster_state:ok" in _cli(p, "CLUSTER", "INFO") for p in self.ports),
            "cluster_state never became ok",
        )

    @staticmethod
    def _wait(ready: Any, why: str) -> None:
        deadline = time.monotonic() + 30
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(why)
            time.sleep(0.1)

    def keys_per_node(self, pattern: str) -> list[int]:
        counts = []
        for port in self.ports:
            out = _cli(port, "--scan", "--pattern", pattern)
            counts.append(len([line for line in out.splitlines() if line]))
        return counts

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(10)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("needs redis-server and redis-cli to start a Redis Cluster")
    cluster = Cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
    except (RuntimeError, subprocess.SubprocessError) as exc:
        cluster.kill()
        pytest.skip(f"could not start a Redis Cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.kill()


@pytest.fixture
async def cluster_prefix(redis_cluster: Cluster) -> AsyncIterator[str]:
    """A key prefix of this test's own; its keys are deleted from every master afterwards."""
    prefix = f"edgeproxy-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = RedisCluster.from_url(redis_cluster.url)
    try:
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


def entry(body: bytes = b"{}") -> Entry:
    return Entry.build(
        status=200,
        headers=[("content-type", "application/json")],
        body=body,
        kind="json",
        ttl=60.0,
        swr=0.0,
        sie=0.0,
        delta=0.01,
        region="r1",
    )


@pytest.mark.redis
async def test_cache_on_a_cluster_stores_spreads_and_purges_every_master(
    redis_cluster: Cluster, cluster_prefix: str
) -> None:
    tier = RedisTier(
        CacheConfig(
            backend="redis",
            redis_url=redis_cluster.url,
            redis_cluster=True,
            key_prefix=cluster_prefix,
            redis_timeout=5.0,
            redis_connect_timeout=5.0,
        )
    )
    try:
        await tier.open()
        assert tier.status()["cluster"] is True
        for i in range(60):
            assert await tier.set(f"t:a:{i}", entry(b"a%d" % i))
        for i in range(20):
            assert await tier.set(f"t:b:{i}", entry())
        got = await tier.get("t:a:7")
        assert got is not None and got.body == b"a7"
        # Single keys spread over the slots, so every master holds some.
        assert all(n > 0 for n in redis_cluster.keys_per_node(cluster_prefix + "t:a:*"))
        assert await tier.purge("t:a:") == 60
        assert redis_cluster.keys_per_node(cluster_prefix + "t:a:*") == [0, 0, 0]
        assert await tier.get("t:a:7") is None
        assert await tier.get("t:b:3") is not None  # another prefix stays
        assert await tier.delete("t:b:3") == 1
        assert tier.status()["errors"] == {}
    finally:
        await tier.close()


@pytest.mark.redis
async def test_proxy_cache_hits_through_a_cluster(
    redis_cluster: Cluster,
    cluster_prefix: str,
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
) -> None:
    region = await make_region("r1")
    cache = {
        "backend": "redis",
        "redis_url": redis_cluster.url,
        "redis_cluster": True,
        "key_prefix": cluster_prefix,
        "redis_timeout": 5.0,
        "redis_connect_timeout": 5.0,
        "xfetch_beta": 0.0,
    }
    first = await make_proxy([region], cache=cache)
    second = await make_proxy([region], cache=cache)
    async with aiohttp.ClientSession() as client:
        status, headers, _ = await post(client, first.url + CHAT, chat("cluster"))
        assert status == 200 and headers["X-Edgeproxy-Cache"] == "MISS"
        await eventually(lambda: cache_status(first)["stores"] == 1)
        # Another process sharing the cluster is served the stored answer.
        status, headers, _ = await post(client, second.url + CHAT, chat("cluster"))
        assert status == 200 and headers["X-Edgeproxy-Cache"] == "HIT"
        assert await second.purge_cache(prefix="") >= 1
        _, headers, _ = await post(client, second.url + CHAT, chat("cluster"))
        assert headers["X-Edgeproxy-Cache"] == "MISS"
    assert cache_status(first)["errors"] == {} and cache_status(second)["errors"] == {}


@pytest.mark.redis
async def test_rate_limits_on_a_cluster_are_shared_and_all_or_nothing(
    redis_cluster: Cluster,
    cluster_prefix: str,
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
) -> None:
    region = await make_region("r1")
    admission = {
        "key_requests_per_second": 0.01,
        "key_burst": 3,
        "ip_requests_per_second": 0.01,
        "ip_burst": 5,
        "redis_url": redis_cluster.url,
        "redis_cluster": True,
        "redis_prefix": cluster_prefix,
        "redis_timeout": 5.0,
    }
    first = await make_proxy([region], admission=admission)
    second = await make_proxy([region], admission=admission)
    rate = first.pipeline.admission.rate
    assert rate.redis is not None
    # The key's buckets and the IP's carry their identity as hash tag: here two slots.
    key_charge, ip_charge = rate.charges("t:alice", "127.0.0.1", 0)
    slots = {key_slot(rate.redis.key(c).encode()) for c in (key_charge, ip_charge)}
    assert rate.redis.key(key_charge) == f"{cluster_prefix}{{t:alice}}:key-requests"
    assert len(slots) == 2

    async def send(proxy: Any, tenant_key: str) -> int:
        async with aiohttp.ClientSession() as client:
            headers = {"Authorization": f"Bearer sk-{tenant_key}"}
            async with client.post(proxy.url + CHAT, json=chat(), headers=headers) as resp:
                await resp.read()
                return resp.status

    # Key a: 3 pass (shared by both proxies), then its own bucket refuses; the IP bucket,
    # in another slot, gets those refused charges back.
    statuses = [await send(p, "a") for p in (first, second, first, second, first)]
    assert statuses == [200, 200, 200, 429, 429]
    # The IP bucket paid 3 of its 5: key b gets the 2 left, then the IP refuses.
    statuses = [await send(p, "b") for p in (second, first, second)]
    assert statuses == [200, 200, 429]
    for proxy in (first, second):
        snapshot = proxy.status()["admission"]["rate_limit"]
        assert snapshot["backend"] == "redis" and snapshot["redis_cluster"] is True
        assert snapshot["redis_errors"] == 0


@pytest.mark.redis
async def test_the_bucket_script_is_atomic_on_a_cluster(
    redis_cluster: Cluster, cluster_prefix: str
) -> None:
    settings = RedisSettings(redis_cluster.url, cluster=True)
    buckets = [RedisBuckets(settings, cluster_prefix, 5.0) for _ in range(2)]
    limit = Limit("key-requests", "key", "requests", 0.001, 5)
    ip_limit = Limit("ip-requests", "ip", "requests", 0.001, 100)
    try:
        charges = [
            Charge(limit, "key-requests:k", 1.0),
            Charge(ip_limit, "ip-requests:10.0.0.1", 1),
        ]
        decisions = await asyncio.gather(*(buckets[i % 2].run("take", charges) for i in range(20)))
        assert sum(d.allowed for d in decisions) == 5
        assert all(d.limit == limit for d in decisions if not d.allowed)
        # The IP bucket paid only for the 5 allowed: 95 left, 96 cannot pass at once.
        big = [Charge(ip_limit, "ip-requests:10.0.0.1", 95.0)]
        assert (await buckets[0].run("take", big)).allowed
        assert not (await buckets[1].run("take", [Charge(ip_limit, big[0].bucket, 1.0)])).allowed
    finally:
        for b in buckets:
            await b.aclose()


@pytest.mark.redis
async def test_load_view_publishes_and_reads_through_a_cluster(
    redis_cluster: Cluster, cluster_prefix: str
) -> None:
    names = [f"region-{i}" for i in range(6)]
    config = Config.from_mapping(
        proxy_config(
            [{"name": n, "url": f"http://127.0.0.1:{1 + i}"} for i, n in enumerate(names)]
        ),
        environ={},
    )
    shared = SharedLoadConfig(
        redis_url=redis_cluster.url,
        redis_cluster=True,
        redis_prefix=cluster_prefix,
        redis_timeout=5.0,
        interval=60.0,  # rounds are driven by the test
        ttl=120.0,
    )
    sets = [RegionSet(config), RegionSet(config)]
    views = [
        LoadView(shared, sets[0], process_id="pop-a/1"),
        LoadView(shared, sets[1], process_id="pop-b/1"),
    ]
    try:
        for view in views:
            await view.open(background=False)
        # The regions' hashes are spread over the masters: one key each, own hash tag.
        slots = {key_slot(views[0]._key(n).encode()) for n in names}
        assert len(slots) == len(names)
        for i, name in enumerate(names):
            sets[0].by_name[name].in_flight = i + 1
            sets[1].by_name[name].in_flight = 10 * (i + 1)
        for view in views:
            await view.round()
        await views[0].round()  # sees the second's entries too
        for i, name in enumerate(names):
            assert views[0].global_in_flight(name) == 11 * (i + 1)
            assert views[1].global_in_flight(name) == 10 * (i + 1) + i + 1
            load = views[0].region_load(name)
            assert load is not None and load.processes == 2
        # Own counts are read live: a change shows before the next round.
        sets[1].by_name["region-0"].in_flight = 0
        assert views[1].global_in_flight("region-0") == 1
        assert all(n >= 1 for n in redis_cluster.keys_per_node(cluster_prefix + "*"))
        assert views[0].snapshot()["errors_total"] == 0
    finally:
        for view in views:
            await view.close()
        for regions in sets:
            await regions.close()
