"""redact through the real server: prompts, answers (SSE, JSON, text) and log records."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from edgeproxy import PluginLoadError, RequestContext, hookimpl
from edgeproxy.plugins.redact import Redactor, _SseState, _WholeBody

from ..conftest import CustomRegion, RegionFactory
from .conftest import CHAT, PluginProxyFactory, build_proxy, plugins_section

EMAIL = "john.doe@example.com"
API_KEY = "sk-proj-AbCdEf0123456789XyZ"
R = "[REDACTED]"


def sse_data(raw: bytes) -> list[bytes]:
    return [line[6:] for line in raw.splitlines() if line.startswith(b"data: ")]


# -- prompts -------------------------------------------------------------------


async def test_prompt_is_redacted_before_it_goes_upstream(
    make_region: RegionFactory, make_plugin_proxy: PluginProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}], plugins=plugins_section(redact={})
    )
    prompt = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": f"Mail {EMAIL} with key {API_KEY}, ok?"},
            {"role": "user", "content": [{"type": "text", "text": f"cc: {EMAIL.upper()}"}]},
        ],
        "user": EMAIL,
        "temperature": 0.5,
        f"{EMAIL}": "keys are not redacted",
    }
    expected = json.loads(json.dumps(prompt))
    expected["messages"][1]["content"] = f"Mail {R} with key {R}, ok?"
    expected["messages"][2]["content"][0]["text"] = f"cc: {R}"
    expected["user"] = R
    untouched = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, indent=2
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/echo/x", json=prompt) as resp:
            echo = await resp.json()
        # Nothing to redact: the body goes upstream byte for byte.
        async with client.post(
            proxy.url + "/echo/x", data=untouched, headers={"Content-Type": "application/json"}
        ) as resp:
            echo_untouched = await resp.json()
        # A chat completion with a redacted prompt is answered as usual.
        async with client.post(proxy.url + CHAT, json=prompt) as resp:
            assert resp.status == 200
            assert (await resp.json())["object"] == "chat.completion"
    assert echo["body_sha256"] == hashlib.sha256(orjson.dumps(expected)).hexdigest()
    assert echo["body_length"] == len(orjson.dumps(expected))
    assert echo_untouched["body_sha256"] == hashlib.sha256(untouched.encode()).hexdigest()


async def test_json_without_a_json_content_type_is_redacted_too(
    make_region: RegionFactory, make_plugin_proxy: PluginProxyFactory
) -> None:
    region = await make_region("r1")
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}], plugins=plugins_section(redact={})
    )
    prompt = {"prompt": f"hi {EMAIL}"}
    async with aiohttp.ClientSession() as client:
        for content_type in (None, "text/plain"):
            headers = {} if content_type is None else {"Content-Type": content_type}
            async with client.post(
                proxy.url + "/echo/x",
                data=orjson.dumps(prompt),
                headers=headers,
                skip_auto_headers=["Content-Type"],
            ) as resp:
                echo = await resp.json()
            seen = {k.lower(): v for k, v in echo["headers"]}
            assert seen.get("content-type") == content_type
            assert (
                echo["body_sha256"]
                == hashlib.sha256(orjson.dumps({"prompt": f"hi {R}"})).hexdigest()
            )
        # Plain text is not a JSON body: it passes as it is.
        async with client.post(
            proxy.url + "/echo/x", data=f"hi {EMAIL}", headers={"Content-Type": "text/plain"}
        ) as resp:
            echo = await resp.json()
        assert echo["body_sha256"] == hashlib.sha256(f"hi {EMAIL}".encode()).hexdigest()


async def chunked(data: bytes) -> AsyncIterator[bytes]:
    yield data[:10]
    yield data[10:]


async def test_json_bodies_that_cannot_be_inspected_are_refused(
    make_region: RegionFactory, make_plugin_proxy: PluginProxyFactory
) -> None:
    region = await make_region("r1")
    strict = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}], plugins=plugins_section(redact={})
    )
    lenient = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}],
        plugins=plugins_section(redact={"reject_unreadable": False}),
    )
    body = orjson.dumps({"prompt": f"hi {EMAIL}"})
    json_type = {"Content-Type": "application/json"}
    before = region.requests_total
    async with aiohttp.ClientSession() as client:
        # Chunked: no Content-Length, so the proxy streams it and cannot look inside.
        async with client.post(
            strict.url + "/echo/x", data=chunked(body), headers=json_type
        ) as resp:
            assert resp.status == 411
            error = (await resp.json())["error"]
            assert set(error) == {"message", "type", "param", "code"}
        async with client.post(strict.url + "/echo/x", data=b"{nope", headers=json_type) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "invalid_json"
        assert region.requests_total == before
        async with client.post(
            lenient.url + "/echo/x", data=chunked(body), headers=json_type
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["body_sha256"] == hashlib.sha256(body).hexdigest()


# -- answers -------------------------------------------------------------------


async def test_fake_region_answers_are_redacted_sse_and_json(
    make_region: RegionFactory, make_plugin_proxy: PluginProxyFactory
) -> None:
    region = await make_region("r1", tokens=12, inter_token_delay=0.005)
    body = {"model": "m", "messages": [{"role": "user", "content": "tell me"}]}
    async with aiohttp.ClientSession() as client:
        # The fake's answer is deterministic: ask it directly, then redact one of its words.
        async with client.post(region.url + CHAT, json=body) as resp:
            direct = (await resp.json())["choices"][0]["message"]["content"]
        word = direct.split()[len(direct.split()) // 2]
        pattern = rf"\b{word}\b"
        expected = re.sub(pattern, R, direct)
        assert expected != direct
        proxy = await make_plugin_proxy(
            [{"name": "r1", "url": region.url}],
            plugins=plugins_section(redact={"patterns": ["email", pattern]}),
        )
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        raw = b""
        async with client.post(proxy.url + CHAT, json=stream) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                raw += chunk
        async with client.post(proxy.url + CHAT, json=body) as resp:
            answer = await resp.json()
    data = sse_data(raw)
    assert data[-1] == b"[DONE]"
    events = [orjson.loads(d) for d in data[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == expected
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert answer["choices"][0]["message"]["content"] == expected
    assert answer["usage"]["completion_tokens"] == 12


def split_answers_app(seen: list[dict[str, str]]) -> web.Application:
    """A hand-written region whose answers put secrets across network writes."""

    async def write_parts(
        request: web.Request, resp: web.StreamResponse, parts: list[bytes]
    ) -> web.StreamResponse:
        await resp.prepare(request)
        for part in parts:
            await resp.write(part)
            await asyncio.sleep(0.005)  # separate reads at the proxy, most likely
        await resp.write_eof()
        return resp

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        await request.read()
        kind = request.path.rsplit("/", 1)[-1]
        if kind == "sse":
            event = b'data: {"choices":[{"delta":{"content":"write to john.d'
            parts = [
                event,
                b"oe@exam",
                b'ple.com today"}}]}\n',
                b"\n",
                b'data: {"choices":[{"delta":{"content":"or john\\u0040example.com"}}]}\r\n\r\n',
                b"event: note\ndata: plain sk-proj-AbCdEf012345",
                b"6789XyZ\n\ndata: [DONE]\n\n",
            ]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            return await write_parts(request, resp, parts)
        if kind == "json":
            body = b'{"a": "jane\\u0040example.org", "b": "mail john.doe@example.com", "n": 1}'
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = len(body)
            return await write_parts(request, resp, [body[:30], body[30:50], body[50:]])
        if kind == "text":
            resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
            return await write_parts(request, resp, [b"to john.doe@example.com\n", b"bye\n"])
        if kind == "binary":
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            return await write_parts(request, resp, [b"\x00john.doe@example.com\xff"])
        if kind == "gzip":
            body = gzip.compress(b"to john.doe@example.com")
            return web.Response(
                body=body, headers={"Content-Type": "text/plain", "Content-Encoding": "gzip"}
            )
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


async def test_answers_split_across_network_reads(
    custom_region: CustomRegion, make_plugin_proxy: PluginProxyFactory
) -> None:
    seen: list[dict[str, str]] = []
    url = await custom_region(split_answers_app(seen))
    proxy = await make_plugin_proxy(
        [{"name": "custom", "url": url, "http2": False}], plugins=plugins_section(redact={})
    )
    # The bytes as the proxy wrote them: no compression toward this client.
    identity = {"Accept-Encoding": "identity"}
    async with aiohttp.ClientSession(auto_decompress=False, headers=identity) as client:

        async def get(kind: str) -> tuple[int, bytes]:
            async with client.get(proxy.url + "/answers/" + kind) as resp:
                return resp.status, await resp.read()

        status, sse = await get("sse")
        assert status == 200
        data = sse_data(sse)
        assert orjson.loads(data[0])["choices"][0]["delta"]["content"] == f"write to {R} today"
        assert orjson.loads(data[1])["choices"][0]["delta"]["content"] == f"or {R}"
        assert data[2] == b"plain " + R.encode()
        assert data[3] == b"[DONE]"
        assert b"event: note\n" in sse
        assert b"\r\n\r\n" in sse  # line ends are kept as they were

        status, body = await get("json")
        assert status == 200
        assert orjson.loads(body) == {"a": R, "b": f"mail {R}", "n": 1}

        status, body = await get("text")
        assert (status, body) == (200, f"to {R}\nbye\n".encode())

        status, body = await get("binary")
        assert (status, body) == (200, b"\x00john.doe@example.com\xff")

        # A compressed text answer cannot be inspected: fail closed.
        status, body = await get("gzip")
        assert status == 502
        assert orjson.loads(body)["error"]["code"] == "redaction_failed"
    assert b"john" not in sse + body
    # Regions are asked for uncompressed answers.
    answers = [h for h in seen if h.get("Accept-Encoding")]
    assert answers and all(h["Accept-Encoding"] == "identity" for h in answers)


STREAM = (
    b'data: {"c":"a john@x.io b","n":1}\n\n'
    b"event: note\r\ndata: mail jane@y.org\r\n\r\n"
    b'data: {"c":"k\\u0040z.com"}\r\r'
    b": comment sk-abcdefghijklmnopqrst\n\n"
    b"data: [DONE]\n\n"
)


def test_sse_redaction_does_not_depend_on_where_reads_split() -> None:
    redactor = Redactor(["email", "api_key"])
    expected = redactor.sse(STREAM)
    assert expected == (
        b'data: {"c":"a [REDACTED] b","n":1}\n\n'
        b"event: note\r\ndata: mail [REDACTED]\r\n\r\n"
        b'data: {"c":"[REDACTED]"}\r\r'
        b": comment [REDACTED]\n\n"
        b"data: [DONE]\n\n"
    )
    for i in range(len(STREAM) + 1):
        for j in range(i, len(STREAM) + 1):
            state = _SseState(redactor)
            out = state.feed(STREAM[:i]) + state.feed(STREAM[i:j]) + state.feed(STREAM[j:])
            assert out == expected, (i, j)
            assert state.reader.tail == b""


def test_sse_overlong_event_is_flushed_at_line_ends() -> None:
    redactor = Redactor(["email"], max_buffer=64)
    state = _SseState(redactor)
    line = b"data: " + b"x" * 40 + b" a@b.io\n"
    out = b"".join(state.feed(line) for _ in range(4))  # never a blank line
    assert out == (b"data: " + b"x" * 40 + b" [REDACTED]\n") * 4
    assert state.reader.tail == b""
    assert state.feed(b"data: y") == b""
    assert state.feed(b"\n\n") == b"data: y\n\n"


def test_whole_body_is_redacted_once_complete() -> None:
    redactor = Redactor(["email"])
    body = b'{"to":"a@b.io","x":[1,2]}'
    for i in range(len(body) + 1):
        state = _WholeBody(redactor, len(body))
        out = state.feed(body[:i]) + state.feed(body[i:])
        assert orjson.loads(out) == {"to": R, "x": [1, 2]}
    # More than announced: redacted as soon as the announced length is reached, then per read.
    state = _WholeBody(redactor, 5)
    assert state.feed(b"a@b.io ") == b"[REDACTED] "
    assert state.feed(b"c@d.io") == b"[REDACTED]"


def test_builtin_patterns() -> None:
    redactor = Redactor(["email", "api_key", "credit_card", "ipv4"])
    text = (
        "mail a.b+c@mail.example.co.uk, key sk-ant-api03-abcdefghijklmnop, "
        "aws AKIAABCDEFGHIJKLMNOP, gh ghp_" + "a" * 36 + ", card 4111 1111 1111 1111, "
        "not a card 4111 1111 1111 1112, ip 10.0.0.1, version 1.2.3.4.5, 300.1.1.1"
    )
    assert redactor.text(text) == (
        f"mail {R}, key {R}, aws {R}, gh {R}, card {R}, "
        "not a card 4111 1111 1111 1112, ip [REDACTED], version 1.2.3.4.5, 300.1.1.1"
    )
    assert redactor.data("é a@b.io".encode() + b"\xff") == "é [REDACTED]".encode() + b"\xff"
    assert Redactor(["secret"], replacement=r"<\1 \g<0>>").text("a secret") == r"a <\1 \g<0>>"
    # Long runs without a match are linear, not quadratic: this returns at once.
    assert redactor.text("a" * 200_000) == "a" * 200_000


# -- logs ----------------------------------------------------------------------


class Failing:
    """A test plugin that fails with personal data in its error."""

    @hookimpl
    def edgeproxy_request_received(self, ctx: RequestContext) -> None:
        if ctx.path == "/fail":
            raise ValueError(f"cannot serve {EMAIL}")


async def test_log_records_are_redacted(
    make_region: RegionFactory,
    make_plugin_proxy: PluginProxyFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    factory = logging.getLogRecordFactory()
    region = await make_region("r1")
    proxy = await make_plugin_proxy(
        [{"name": "r1", "url": region.url}], extra=[Failing()], plugins=plugins_section(redact={})
    )
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/fail") as resp:
            assert resp.status == 500
            assert EMAIL not in await resp.text()
    # The pipeline logged the plugin's failure, traceback included.
    failure = [r for r in caplog.records if r.name == "edgeproxy" and "failed" in r.getMessage()]
    assert failure and R in failure[0].getMessage()
    assert failure[0].exc_text is not None and R in failure[0].exc_text

    logging.getLogger("edgeproxy.plugins.mine").warning("user %s key %s", EMAIL, API_KEY)
    logging.getLogger("edgeproxy").info("no args %s", 5)
    logging.getLogger("elsewhere").warning("user %s", EMAIL)
    messages = {r.name: r.getMessage() for r in caplog.records}
    assert messages["edgeproxy.plugins.mine"] == f"user {R} key {R}"
    assert messages["elsewhere"] == f"user {EMAIL}"  # not an edgeproxy logger
    assert EMAIL not in caplog.text.replace(f"user {EMAIL}", "")

    await proxy.stop()
    assert logging.getLogRecordFactory() is factory
    caplog.clear()
    logging.getLogger("edgeproxy").warning("after %s", EMAIL)
    assert caplog.records[0].getMessage() == f"after {EMAIL}"


@pytest.mark.parametrize(
    "settings",
    [
        {"patterns": ["("]},
        {"patterns": ["a*"]},
        {"patterns": "email"},
        {"patterns": []},
        {"max_buffer": 0},
        {"logs": "yes"},
        {"redact_logs": True},
    ],
)
def test_bad_settings_are_load_errors(settings: dict[str, Any]) -> None:
    regions = [{"name": "r1", "url": "http://127.0.0.1:9"}]
    with pytest.raises(PluginLoadError, match="redact"):
        build_proxy(regions, plugins=plugins_section(redact=settings))
