"""A stored object answers only the scope that made it: the tenant, else the client's
credentials, else anonymous clients. With the proxy's own credentials toward the regions
(``forward_client_credentials = false``, the default), a region cannot tell clients apart,
so the proxy answers anyone else with the API's own 404, as the provider would: continuing
a chain, reading it, its input items, deleting it, reading a file or naming it in a batch.
Two PoPs sharing Redis, fake regions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import redis.asyncio as aioredis

from edgeproxy import EdgeProxy, RequestContext, hookimpl
from edgeproxy.testing import FakeRegion

from .conftest import ProxyFactory, RegionFactory

RESPONSES = "/v1/responses"
TwoPops = tuple[list[FakeRegion], list[EdgeProxy]]


def tables(regions: list[FakeRegion]) -> list[dict[str, Any]]:
    return [{"name": r.name, "url": r.url, "lat": 1.3, "lon": 103.8} for r in regions]


def headers_of(key: str | None, tenant: str | None = None) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    if tenant is not None:
        headers["x-tenant-id"] = tenant
    return headers


async def call(
    proxy: EdgeProxy,
    method: str,
    path: str,
    key: str | None,
    body: dict[str, Any] | None = None,
    tenant: str | None = None,
) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as client:
        async with client.request(
            method,
            proxy.url + path,
            data=orjson.dumps(body) if body is not None else None,
            headers=headers_of(key, tenant),
        ) as resp:
            return resp.status, await resp.json(content_type=None)


async def create(proxy: EdgeProxy, key: str | None, tenant: str | None = None) -> str:
    status, answer = await call(
        proxy, "POST", RESPONSES, key, {"model": "fake-llm", "input": "mine"}, tenant
    )
    assert status == 200, answer
    return str(answer["id"])


def follow_up(previous: str) -> dict[str, Any]:
    return {"model": "fake-llm", "input": "next", "previous_response_id": previous}


async def strangers_get_404(
    proxy: EdgeProxy, object_id: str, key: str | None, tenant: str | None = None
) -> None:
    """Every way of using a stored response, from a scope that did not make it: the 404
    OpenAI answers for a response the caller cannot see."""
    status, answer = await call(proxy, "POST", RESPONSES, key, follow_up(object_id), tenant)
    assert status == 404, answer
    assert answer["error"]["code"] == "previous_response_not_found"
    assert answer["error"]["param"] == "previous_response_id"
    for method, path in (
        ("GET", f"{RESPONSES}/{object_id}"),
        ("GET", f"{RESPONSES}/{object_id}/input_items"),
        ("DELETE", f"{RESPONSES}/{object_id}"),
    ):
        status, answer = await call(proxy, method, path, key, tenant=tenant)
        assert status == 404, (method, path, answer)
        assert set(answer) == {"error"}
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["code"] == "response_not_found"
        assert object_id in answer["error"]["message"]


@pytest.fixture
async def two_pops(
    make_region: RegionFactory, make_proxy: ProxyFactory, redis_server: str, redis_prefix: str
) -> AsyncIterator[TwoPops]:
    regions = [await make_region(f"r{i}", tokens=2) for i in range(3)]
    stateful = {"redis_url": redis_server, "redis_prefix": redis_prefix + "owner:"}
    pops = [await make_proxy(tables(regions), stateful=stateful) for _ in range(2)]
    yield regions, pops


async def test_another_key_or_no_key_gets_the_apis_404_for_a_stored_chain(
    two_pops: TwoPops,
) -> None:
    regions, pops = two_pops
    object_id = await create(pops[0], "sk-alice")
    asked = sum(r.requests_total for r in regions)
    for pop in pops:
        for key in ("sk-mallory", None):
            await strangers_get_404(pop, object_id, key)
    # No region was asked: with the proxy's credentials it would have answered.
    assert sum(r.requests_total for r in regions) == asked
    assert all(pop.status()["stateful"]["other_scope_total"] > 0 for pop in pops)
    # The key that made it goes on from the other PoP, reads it, and deletes it.
    status, answer = await call(pops[1], "POST", RESPONSES, "sk-alice", follow_up(object_id))
    assert status == 200 and answer["previous_response_id"] == object_id
    status, answer = await call(pops[1], "GET", f"{RESPONSES}/{object_id}", "sk-alice")
    assert status == 200 and answer["id"] == object_id
    status, _ = await call(pops[1], "GET", f"{RESPONSES}/{object_id}/input_items", "sk-alice")
    assert status == 200
    status, answer = await call(pops[1], "DELETE", f"{RESPONSES}/{object_id}", "sk-alice")
    assert status == 200 and answer["deleted"] is True


class Tenants:
    """The tenant from a header, as an auth plugin would set it."""

    @hookimpl
    def edgeproxy_request_received(self, ctx: RequestContext) -> None:
        ctx.tenant = ctx.headers.get("x-tenant-id")


async def test_keys_of_one_tenant_share_its_objects_and_other_tenants_do_not(
    make_region: RegionFactory, make_proxy: ProxyFactory, redis_server: str, redis_prefix: str
) -> None:
    regions = [await make_region(f"r{i}", tokens=2) for i in range(2)]
    stateful = {"redis_url": redis_server, "redis_prefix": redis_prefix + "owner:"}
    pops = [
        await make_proxy(tables(regions), stateful=stateful, plugins=(Tenants(),)) for _ in range(2)
    ]
    object_id = await create(pops[0], "sk-acme-1", tenant="acme")
    status, _ = await call(pops[1], "POST", RESPONSES, "sk-acme-2", follow_up(object_id), "acme")
    assert status == 200
    await strangers_get_404(pops[1], object_id, "sk-acme-1", tenant="globex")


async def test_files_and_batches_of_another_key_get_the_apis_404(two_pops: TwoPops) -> None:
    _, pops = two_pops
    alice, mallory = (
        openai.AsyncOpenAI(base_url=pop.url + "/v1", api_key=key, max_retries=0)
        for pop, key in ((pops[0], "sk-alice"), (pops[1], "sk-mallory"))
    )
    try:
        made = await alice.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
        with pytest.raises(openai.NotFoundError) as caught:
            await mallory.files.retrieve(made.id)
        assert caught.value.body == {
            "message": f"No such File object: {made.id}",
            "type": "invalid_request_error",
            "param": "id",
            "code": None,
        }
        with pytest.raises(openai.NotFoundError):
            await mallory.files.content(made.id)
        with pytest.raises(openai.NotFoundError):
            await mallory.batches.create(
                input_file_id=made.id, endpoint="/v1/responses", completion_window="24h"
            )
        assert (await alice.files.retrieve(made.id)).id == made.id
    finally:
        await asyncio.gather(alice.close(), mallory.close())


async def test_with_one_region_a_known_object_of_another_key_still_gets_404(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("only", tokens=2)
    proxy = await make_proxy([region])
    object_id = await create(proxy, "sk-alice")
    await strangers_get_404(proxy, object_id, "sk-mallory")
    status, _ = await call(proxy, "POST", RESPONSES, "sk-alice", follow_up(object_id))
    assert status == 200


async def test_tenant_binding_off_lets_any_key_through(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    regions = [await make_region(f"r{i}", tokens=2) for i in range(2)]
    proxy = await make_proxy(tables(regions), stateful={"tenant_binding": False})
    object_id = await create(proxy, "sk-alice")
    status, _ = await call(proxy, "POST", RESPONSES, "sk-mallory", follow_up(object_id))
    assert status == 200


async def test_an_entry_written_before_binding_serves_any_scope(
    make_region: RegionFactory, make_proxy: ProxyFactory, redis_server: str, redis_prefix: str
) -> None:
    regions = [await make_region(f"r{i}", tokens=2) for i in range(2)]
    # Made at the region directly, its owner entry written as an older proxy wrote it: the
    # bare region name.
    async with aiohttp.ClientSession() as client:
        async with client.post(
            regions[1].url + RESPONSES, json={"model": "fake-llm", "input": "old"}
        ) as resp:
            object_id = (await resp.json())["id"]
    redis = aioredis.Redis.from_url(redis_server)
    try:
        await redis.set(redis_prefix + "owner:" + object_id, regions[1].name)
    finally:
        await redis.aclose()
    stateful = {"redis_url": redis_server, "redis_prefix": redis_prefix + "owner:"}
    proxy = await make_proxy(tables(regions), stateful=stateful)
    status, _ = await call(proxy, "POST", RESPONSES, "sk-anyone", follow_up(object_id))
    assert status == 200
