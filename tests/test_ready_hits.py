"""Cache hits served from what the cache made once: an entry's ready forms, and what the
cache made of a request (bypass, key, plan) remembered by every input it read.

The differential tests hold a hit served from the ready forms to the answer the general
path made before them (the stored body replayed and its headers rebuilt per hit); the
others hold that nothing remembered outlives what it was made from: a request differing in
any keyed input, an entry stored again, purged or expired.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
import httpx
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from multidict import CIMultiDict

from edgeproxy import Config, EdgeProxy, Exchange, RequestContext, hookimpl
from edgeproxy._cache.entry import Entry, replay_parts, response_headers
from edgeproxy._cache.plan import CachePlan
from edgeproxy._cache.stage import CacheStage
from edgeproxy._core.answer import Answer
from edgeproxy._core.context import start_context
from edgeproxy._plugins import Plugins
from edgeproxy._protocol.dialects import dialect_named
from edgeproxy._protocol.headers import trace_context
from edgeproxy.testing import FakeRegion

from .conftest import FakeClock, ProxyFactory, RegionFactory, eventually, proxy_config
from .test_cache_key_security import _context, _key, _keyed_config, _requests

CHAT = "/v1/chat/completions"
CHAT_API = dialect_named("chat.completions")
# Per delivery: never part of what a hit shares with another.
PER_DELIVERY = {"age", "x-request-id"}

JSON_ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "word " * 400},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 400, "total_tokens": 402},
    }
)


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    event = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **extra,
    }
    return b"data: " + orjson.dumps(event) + b"\n\n"


SSE_ANSWER = (
    b"".join(_chunk({"content": f" tok{i}"}) for i in range(300))
    + _chunk({}, "stop")
    + b"data: "
    + orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 2, "completion_tokens": 300, "total_tokens": 302},
        }
    )
    + b"\n\ndata: [DONE]\n\n"
)


def _config(*, compress_sse: bool = False) -> Config:
    data = proxy_config([{"name": "r1", "url": "http://127.0.0.1:9"}])
    data["routes"] = [{"name": "chat", "path": CHAT, "compress_sse": compress_sse}]
    return Config.from_mapping(data, environ={})


def _ctx(config: Config, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    raw = orjson.dumps(body)
    sent: CIMultiDict[str] = CIMultiDict({"content-type": "application/json", **(headers or {})})
    ctx = start_context(
        "req-1",
        trace_context(None),
        "POST",
        CHAT,
        sent,
        "192.0.2.1",
        0.0,
        config.route_for("POST", CHAT),
        "http",
        "1.1",
        "proxy",
    )
    ctx.body = raw
    ctx.body_read = True
    ctx._json = body
    ctx.fix("chat.completions")
    return ctx


def _entry(kind: str, body: bytes, now: float) -> Entry:
    content_type = "text/event-stream" if kind == "sse" else "application/json"
    return Entry.build(
        status=200,
        headers=[("Content-Type", content_type), ("x-fake-region", "r1")],
        body=body,
        kind=kind,
        ttl=60.0,
        swr=0.0,
        sie=0.0,
        delta=0.1,
        region="r1",
        now=now,
    )


def _general(
    stage: CacheStage, ctx: RequestContext, plan: CachePlan, entry: Entry, now: float
) -> Answer | None:
    """The hit as the general path made it before the ready forms: the stored body replayed
    and its headers rebuilt for this hit, compressed anew."""
    converted = replay_parts(
        entry, wants_sse=plan.wants_sse, include_usage=plan.include_usage, dialect=plan.dialect
    )
    if converted is None:
        return None
    parts, sse = converted
    headers = response_headers(entry, sse=sse)
    headers += (
        ("Age", str(entry.age(now))),
        ("X-Edgeproxy-Cache", "HIT"),
        ("X-Edgeproxy-Cache-Key", plan.key),
        ("X-Edgeproxy-Region", "none"),
        ("X-Request-Id", ctx.request_id),
    )
    length = len(parts[0]) if len(parts) == 1 else None
    encoding = stage.compression.choose(ctx, entry.status, length, headers, sse=sse)
    if encoding is not None:
        parts = [stage.compression.whole(parts, encoding)]
        headers += (("Content-Encoding", encoding), ("Vary", "Accept-Encoding"))
    if sse:
        return Answer(entry.status, headers, "cache", parts=parts, sse=True)
    return Answer(entry.status, headers, "cache", body=parts[0])


def _seen(answer: Answer) -> tuple[int, list[tuple[str, str]], bytes, bool]:
    """What the client reads of an answer, less what is its delivery's own."""
    body = answer.body if answer.parts is None else b"".join(answer.parts)
    headers = [(k, v) for k, v in answer.headers if k.lower() not in PER_DELIVERY]
    return answer.status, headers, body or b"", answer.sse


@pytest.mark.parametrize(
    ("kind", "stream", "usage", "accept"),
    [
        ("json", False, False, None),
        ("json", False, False, "gzip"),
        ("json", True, False, None),
        ("sse", True, True, None),
        ("sse", True, False, None),
        ("sse", True, False, "gzip"),
        ("sse", False, False, None),
        ("raw", True, False, None),
    ],
    ids=[
        "json",
        "json-gzip",
        "json-as-sse",
        "sse-usage",
        "sse",
        "sse-gzip",
        "sse-as-json",
        "raw",
    ],
)
def test_a_hit_from_the_ready_forms_is_the_general_paths_answer(
    kind: str, stream: bool, usage: bool, accept: str | None
) -> None:
    config = _config(compress_sse=accept is not None)
    stage = CacheStage(config, Plugins())
    body: dict[str, Any] = {"model": "m", "temperature": 0, "messages": []}
    if stream:
        body["stream"] = True
        if usage:
            body["stream_options"] = {"include_usage": True}
    headers = {"accept-encoding": accept} if accept else {}
    now = time.time()
    entry = _entry(kind, SSE_ANSWER if kind == "sse" else JSON_ANSWER, now)
    for hit in range(3):
        ctx = _ctx(config, body, headers)
        plan = CachePlan(
            "pub:k", "POST", True, False, stream, usage, 60.0, 0.0, 0.0, False, CHAT_API
        )
        served = stage.answer_of(ctx, plan, entry, "HIT", now)
        general = _general(stage, ctx, plan, entry, now)
        assert served is not None and general is not None
        assert _seen(served) == _seen(general), f"hit {hit}"
        # Per delivery, still each hit's own.
        assert ("X-Request-Id", "req-1") in served.headers
        assert ("Age", "0") in served.headers
    if kind == "sse" and stream or kind != "sse" and not stream or kind == "raw":
        # Served as stored: made once, then reused as it is.
        assert len(entry.forms) == 1
        form = next(iter(entry.forms.values()))
        again = stage.answer_of(_ctx(config, body, headers), plan, entry, "HIT", now)
        assert again is not None
        if accept is None and not form.sse:
            assert again.body is form.body is entry.body
    else:
        assert not entry.forms


async def test_a_stored_again_purged_or_expired_entry_is_not_served_from_old_forms() -> None:
    config = _config()
    clock = FakeClock(time.time())
    stage = CacheStage(config, Plugins(), clock=clock)
    await stage.open()
    try:
        body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "q"}]}

        async def hit() -> Answer | None:
            ctx = _ctx(config, body)
            assert not stage.passes(ctx)
            found, recorder = await stage.lookup(cast(Exchange, None), ctx, checked=True)
            if recorder is not None:
                recorder.release()
            return found

        assert await hit() is None  # a miss: the plan is remembered now
        key = stage.known.plans()[0].key
        backend = stage.backend
        assert backend is not None
        first = _entry("json", b'{"answer":"first"}', clock())
        assert await backend.set(key, first)
        for _ in range(2):
            found = await hit()
            assert found is not None and found.body == b'{"answer":"first"}'
        assert first.forms

        # Stored again: the new entry's own body, not the old one's form.
        second = _entry("json", b'{"answer":"second"}', clock())
        assert await backend.set(key, second)
        found = await hit()
        assert found is not None and found.body == b'{"answer":"second"}'

        # Purged: a miss.
        assert await stage.purge(key=key) == 1
        assert await hit() is None

        # Expired (past its stale windows): a miss, though its forms were made.
        third = _entry("json", b'{"answer":"third"}', clock())
        assert await backend.set(key, third)
        found = await hit()
        assert found is not None and found.body == b'{"answer":"third"}'
        clock.advance(61.0)
        assert await hit() is None
    finally:
        await stage.close()


# -- what the cache made of a request, remembered ------------------------------------


@pytest.mark.parametrize("forwarded", [False, True], ids=["own-credentials", "forwarded"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=_requests, second=_requests)
def test_a_remembered_plan_is_the_one_the_request_would_get_anew(
    forwarded: bool, first: dict[str, Any], second: dict[str, Any]
) -> None:
    config = _keyed_config(forwarded)
    stage = CacheStage(config, Plugins())

    def context(request: dict[str, Any]) -> RequestContext:
        return _context(request, config, (("content-type", "application/json"),))

    async def planned(request: dict[str, Any]) -> str | None:
        ctx = context(request)
        if stage.passes(ctx):
            return None
        plan = await stage._plan(cast(Exchange, None), ctx)
        assert ctx.outcome.cache_key == plan.key
        return plan.key

    async def run() -> None:
        # The first request's plan is remembered, then the second is planned: whatever it
        # shares with the first, its key is the one made for it alone.
        await planned(first)
        # Those differing from the first in one field only, the likeliest to be mistaken.
        mixed = [{**first, field: second[field]} for field in ("query", "body", "headers")]
        mixed.append({**first, "tenant": second["tenant"]})
        for request in (second, first, *mixed, second):
            key = await planned(request)
            fresh = CacheStage(config, Plugins())
            bypass = fresh._bypass_reason(context(request))
            assert (key is None) == bool(bypass)
            if key is not None:
                assert key == _key(request, config)

    asyncio.run(run())


# -- end to end ----------------------------------------------------------------------


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _post(
    client: aiohttp.ClientSession,
    url: str,
    raw: bytes,
    headers: dict[str, str] | list[tuple[str, str]] | None = None,
) -> tuple[int, str, bytes]:
    sent: CIMultiDict[str] = CIMultiDict(headers or {})
    sent.setdefault("Content-Type", "application/json")
    async with client.post(url, data=raw, headers=sent) as resp:
        return resp.status, resp.headers.get("X-Edgeproxy-Cache", ""), await resp.read()


def _calls(region: FakeRegion) -> int:
    return region.counters().requests_by_path.get(CHAT, 0)


BODY = b'{"model":"m","temperature":0,"messages":[{"role":"user","content":"hello there"}]}'


async def test_a_request_differing_in_any_keyed_input_is_not_served_anothers_hit(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1")
    proxy = await make_proxy(
        [region], cache={"xfetch_beta": 0.0, "vary_headers": ["x-tier"]}, server={}
    )
    url = proxy.url + CHAT
    base = {"Authorization": "Bearer sk-A", "x-tier": "gold"}
    status, outcome, answer = await _post(client, url, BODY, base)
    assert status == 200 and outcome == "MISS"
    await eventually(lambda: proxy.status()["cache"]["stores"] == 1)
    for _ in range(2):
        assert await _post(client, url, BODY, base) == (200, "HIT", answer)
    assert _calls(region) == 1

    variants: list[tuple[str, bytes, Any]] = [
        ("credential", BODY, {**base, "Authorization": "Bearer sk-B"}),
        ("another credential", BODY, {**base, "x-api-key": "k"}),
        ("a second value", BODY, [*base.items(), ("x-tier", "silver")]),
        ("query", BODY, base),
        ("vary header", BODY, {**base, "x-tier": "silver"}),
        ("body byte", BODY.replace(b"hello", b"hellp"), base),
        ("body bytes, same JSON", BODY.replace(b",", b", "), base),
    ]
    calls = 1
    for name, raw, headers in variants:
        target = url + "?api-version=2" if name == "query" else url
        status, outcome, _ = await _post(client, target, raw, headers)
        calls += 1
        if name == "body bytes, same JSON":
            # Another spelling of the same JSON is the same question: the same entry.
            assert (status, outcome) == (200, "HIT"), name
            calls -= 1
        else:
            assert (status, outcome) == (200, "MISS"), name
        assert _calls(region) == calls, name
    # The remembered request still gets its own answer.
    assert await _post(client, url, BODY, base) == (200, "HIT", answer)

    # A body naming a key twice is refused, however often its clean twin was served.
    twice = BODY[:-1] + b',"temperature":1}'
    for _ in range(2):
        status, _, refused = await _post(client, url, twice, base)
        assert status == 400 and orjson.loads(refused)["error"]["param"] == "temperature"
    assert _calls(region) == calls


async def test_a_purged_or_expired_entry_is_asked_again_end_to_end(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1")
    clock = FakeClock(time.time())
    proxy = await make_proxy([region], cache={"xfetch_beta": 0.0}, cache_clock=clock)
    url = proxy.url + CHAT
    assert (await _post(client, url, BODY))[1] == "MISS"
    await eventually(lambda: proxy.status()["cache"]["stores"] == 1)
    assert (await _post(client, url, BODY))[1] == "HIT"
    await proxy.pipeline.cache.purge(prefix="")
    assert (await _post(client, url, BODY))[1] == "MISS"
    await eventually(lambda: proxy.status()["cache"]["stores"] == 2)
    assert (await _post(client, url, BODY))[1] == "HIT"
    ttl = proxy.config.route_for("POST", CHAT)
    clock.advance(ttl.cache_ttl + ttl.stale_while_revalidate + 1.0)
    assert (await _post(client, url, BODY))[1] == "MISS"
    assert _calls(region) == 3


# -- the aiohttp listener's body read -------------------------------------------------


class _ReadsAgain:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    @hookimpl
    async def edgeproxy_response_complete(self, request: Exchange, ctx: RequestContext) -> None:
        native = cast(web.Request, request.native)
        self.bodies.append(await native.read())


async def test_a_body_read_in_one_go_is_the_requests_and_within_the_hosts_limit(
    make_region: RegionFactory, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1", model="m")
    config = Config.from_mapping(
        proxy_config([{"name": "r1", "url": region.url}], cache={"xfetch_beta": 0.0}),
        environ={},
    )
    again = _ReadsAgain()
    proxy = EdgeProxy(config, plugins=[again])
    app = web.Application(client_max_size=512, middlewares=[proxy.middleware("/v1/")])
    proxy.setup(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}{CHAT}"
        for outcome in ("MISS", "HIT"):
            if outcome == "HIT":
                await eventually(lambda: proxy.status()["cache"]["stores"] == 1)
            assert (await _post(client, url, BODY))[:2] == (200, outcome)
        # What a hook reads of the request afterwards is the body as it came.
        assert again.bodies == [BODY, BODY]
        # Over the host application's client_max_size: refused as aiohttp refuses it.
        big = BODY.replace(b"hello there", b"x" * 600)
        status, _, _ = await _post(client, url, big)
        assert status == 413
        assert _calls(region) == 1
    finally:
        await runner.cleanup()


async def test_a_hit_on_the_http2_listener_is_the_aiohttp_listeners(
    make_region: RegionFactory, make_proxy: ProxyFactory, client: aiohttp.ClientSession
) -> None:
    region = await make_region("r1")
    h1 = await make_proxy([region], cache={"xfetch_beta": 0.0})
    h2 = await make_proxy([region], cache={"xfetch_beta": 0.0}, server={"http2": True, "h2c": True})
    sent = {"content-type": "application/json", "accept-encoding": "identity"}

    def seen(status: int, headers: Any, body: bytes) -> tuple[int, Any, bytes]:
        skip = PER_DELIVERY | {"date", "server", "content-length", "x-edgeproxy-cache-key"}
        kept = sorted((k.lower(), v) for k, v in headers.items() if k.lower() not in skip)
        return status, kept, body

    answers = []
    for proxy in (h1, h2):
        async with httpx.AsyncClient(http1=proxy is h1, http2=proxy is h2) as http:
            for outcome in ("MISS", "HIT", "HIT"):
                resp = await http.post(proxy.url + CHAT, content=BODY, headers=sent)
                assert resp.headers["x-edgeproxy-cache"] == outcome
                if outcome == "MISS":
                    await eventually(lambda p=proxy: p.status()["cache"]["stores"] == 1)
                else:
                    assert resp.http_version == ("HTTP/2" if proxy is h2 else "HTTP/1.1")
                    answers.append(seen(resp.status_code, resp.headers, resp.content))
    # Each listener's hits alike, and alike across listeners.
    assert answers[0] == answers[1]
    assert answers[2] == answers[3]
    assert answers[0][0] == answers[2][0] == 200
    # The region's own headers differ per answer (its timings): their names alike.
    own = [[(k, v) for k, v in a[1] if not k.startswith("x-fake-")] for a in answers]
    assert own[0] == own[2]
    assert [k for k, _ in answers[0][1]] == [k for k, _ in answers[2][1]]


# -- the aiohttp listener's framing of a whole answer ----------------------------------


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        return head + await reader.readexactly(length)
    finally:
        writer.close()


def _framing(raw: bytes) -> tuple[list[bytes], bytes]:
    """The head's lines in order, per-delivery values blanked, and the body."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = []
    for line in head.split(b"\r\n"):
        name, sep, _ = line.partition(b": ")
        if sep and name.lower() in (b"date", b"age", b"x-request-id"):
            line = name + b": ..."
        lines.append(line)
    return lines, body


@pytest.mark.parametrize("server", ["edgeproxy", ""], ids=["server-header", "no-server"])
@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "close"])
async def test_a_whole_answer_framed_by_the_listener_is_what_aiohttp_frames(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
    server: str,
    close: bool,
) -> None:
    from edgeproxy._server import aio

    region = await make_region("r1")
    proxy = await make_proxy([region], cache={"xfetch_beta": 0.0}, server={"server_header": server})
    port = int(proxy.url.rsplit(":", 1)[1])
    request = (
        b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: proxy\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n"
        % len(BODY)
        + (b"Connection: close\r\n" if close else b"")
        + b"\r\n"
        + BODY
    )
    await _raw(port, request)  # the miss
    await eventually(lambda: proxy.status()["cache"]["stores"] == 1)
    made: list[object] = []
    frame = aio._framed

    def spy(*args: Any) -> Any:
        made.append(frame(*args))
        return made[-1]

    monkeypatch.setattr(aio, "_framed", spy)
    framed = await _raw(port, request)
    assert b"\r\nX-Edgeproxy-Cache: HIT\r\n" in framed
    assert made and made[-1] is not None  # framed by the listener, not by aiohttp
    monkeypatch.setattr(aio, "_framed", lambda *args: None)
    general = await _raw(port, request)
    assert _framing(framed) == _framing(general)
    assert (b"Connection: close" in framed) == close
    assert (b"Server: " in framed) == bool(server)


@pytest.mark.parametrize(
    ("stream", "usage", "accept"),
    [(False, False, None), (False, False, "gzip"), (True, True, None), (True, False, "gzip")],
    ids=["json", "json-gzip", "sse-usage", "sse-gzip"],
)
async def test_a_hit_end_to_end_is_the_general_paths_answer(
    make_region: RegionFactory,
    make_proxy: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
    usage: bool,
    accept: str | None,
) -> None:
    from edgeproxy._cache import stage

    region = await make_region("r1")
    proxy = await make_proxy(
        [region],
        cache={"xfetch_beta": 0.0},
        routes=[{"name": "chat", "path": CHAT, "compress_sse": True}],
    )
    body: dict[str, Any] = {
        "model": "m",
        "temperature": 0,
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "tell me everything"}],
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": usage}
    raw = orjson.dumps(body)
    headers = {"Content-Type": "application/json", "Accept-Encoding": accept or "identity"}

    async def hit(session: aiohttp.ClientSession) -> tuple[int, list[tuple[str, str]], bytes]:
        async with session.post(proxy.url + CHAT, data=raw, headers=headers) as resp:
            assert resp.headers["X-Edgeproxy-Cache"] == "HIT"
            kept = [
                (k.lower(), v)
                for k, v in resp.headers.items()
                if k.lower() not in PER_DELIVERY | {"date"}
            ]
            return resp.status, kept, await resp.read()

    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.post(proxy.url + CHAT, data=raw, headers=headers) as resp:
            assert resp.headers["X-Edgeproxy-Cache"] == "MISS"
            await resp.read()
        await eventually(lambda: proxy.status()["cache"]["stores"] == 1)
        ready = [await hit(session) for _ in range(2)]
        monkeypatch.setattr(stage, "ready_form", lambda *args, **kwargs: None)
        general = [await hit(session) for _ in range(2)]
    assert ready[0] == ready[1] == general[0] == general[1]
    status, kept, sent = ready[0]
    assert status == 200
    assert (("content-encoding", "gzip") in kept) == (accept is not None)
    if stream and accept is None:
        assert sent.endswith(b"data: [DONE]\n\n")
        assert (b'"usage":{' in sent) == usage
