"""The fake region's continuations and random resets, talked to directly (no proxy).

A continuation request is the unbroken request plus the partial answer as a
final assistant message (vLLM's ``continue_final_message``, or llama.cpp's
plain prefill); the partial answer followed by the continuation must equal
the unbroken answer, which is what the proxy's splicing is tested against.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import pytest

from edgeproxy.testing import Behavior, FakeRegion, answer_text

CHAT = "/v1/chat/completions"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me a deterministic story"},
]
VLLM = {"continue_final_message": True, "add_generation_prompt": False}


@dataclass
class Streamed:
    """What a client read of one SSE answer."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    broken: bool = False

    @property
    def text(self) -> str:
        return "".join(
            c["choices"][0]["delta"].get("content", "") for c in self.chunks if c["choices"]
        )

    @property
    def roles(self) -> int:
        return sum(1 for c in self.chunks if c["choices"] and "role" in c["choices"][0]["delta"])

    @property
    def usage(self) -> dict[str, int]:
        [usage] = [c["usage"] for c in self.chunks if c.get("usage")]
        return usage


@pytest.fixture
async def region() -> AsyncIterator[FakeRegion]:
    async with FakeRegion(name="r1", seed=7, behavior=Behavior(tokens=20)) as fake:
        yield fake


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        yield client


def body(messages: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages or MESSAGES, **extra}


def continuing(partial: Any, **extra: Any) -> dict[str, Any]:
    return body([*MESSAGES, {"role": "assistant", "content": partial}], **extra)


async def stream(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> Streamed:
    """Read an SSE chat answer to its end, or to the region's reset."""
    result = Streamed()
    raw = b""
    try:
        async with session.post(url + CHAT, json={**payload, "stream": True}) as response:
            assert response.status == 200, await response.text()
            async for data in response.content.iter_any():
                raw += data
    except aiohttp.ClientPayloadError:
        result.broken = True
    for block in raw.decode().split("\n\n")[:-1]:
        data = block.removeprefix("data: ")
        if data == "[DONE]":
            result.done = True
        else:
            result.chunks.append(json.loads(data))
    return result


async def answer(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> str:
    async with session.post(url + CHAT, json=payload) as response:
        assert response.status == 200, await response.text()
        text: str = (await response.json())["choices"][0]["message"]["content"]
        return text


async def test_continue_final_message_streams_the_rest_of_the_answer(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    full = await stream(session, region.url, body())
    assert full.done and len(full.text.split()) == 20
    words = full.text.split(" ")
    partial = " ".join(words[:3])

    options = {"stream_options": {"include_usage": True}}
    rest = await stream(session, region.url, continuing(partial, **VLLM, **options))
    assert rest.done and not rest.broken
    assert partial + rest.text == full.text
    assert rest.text.startswith(" ")  # the next token, with its space
    assert rest.roles == 1  # a fresh answer's role delta: the proxy drops it at the seam
    # The partial answer is prompt now; only the new tokens are completion.
    unbroken = await stream(session, region.url, body(**options))
    assert rest.usage["completion_tokens"] == 17
    assert rest.usage["prompt_tokens"] == unbroken.usage["prompt_tokens"] + 1 + 3  # role + words


async def test_prefill_without_flags_continues_too_json_and_stream(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    full = await answer(session, region.url, body())
    partial = full[: full.index(" ", 10)]
    rest = await answer(session, region.url, continuing(partial))
    assert partial + rest == full
    streamed = await stream(session, region.url, continuing(partial))
    assert streamed.text == rest


async def test_a_partial_answer_cut_inside_a_token(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    full = await answer(session, region.url, body())
    second = full.index(" ", 1)
    partial = full[: second + 3]  # the space and two letters of the second token
    rest = await stream(session, region.url, continuing(partial, **VLLM))
    assert partial + rest.text == full
    assert len(rest.chunks[0]["choices"][0]["delta"]["content"]) >= 1
    assert not rest.chunks[0]["choices"][0]["delta"]["content"].startswith(" ")


async def test_empty_and_whole_partial_answers(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    full = await answer(session, region.url, body())
    assert await answer(session, region.url, continuing("", **VLLM)) == full
    whole = await stream(session, region.url, continuing(full, **VLLM))
    assert whole.done and whole.text == "" and whole.roles == 1


async def test_max_tokens_counts_the_new_tokens_as_vllm_does(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    full = await answer(session, region.url, body(max_tokens=30))
    partial = " ".join(full.split(" ")[:12])
    # The client's limit less what was sent: the unbroken answer again.
    rest = await answer(session, region.url, continuing(partial, max_tokens=18, **VLLM))
    assert partial + rest == full
    # A larger limit runs on past the unbroken answer's end, as a model without EOS does.
    longer = await answer(session, region.url, continuing(partial, max_tokens=25, **VLLM))
    assert len(longer.split()) == 25 and longer.startswith(rest)
    assert partial + longer == answer_text(MESSAGES, 37)
    # A repeated overlap counts against the limit.
    region.behavior.continuation_overlap = 2
    overlapped = await answer(session, region.url, continuing(partial, max_tokens=18))
    assert len(overlapped.split()) == 18
    assert overlapped == " " + " ".join(full.split(" ")[10:28])


async def test_content_as_text_parts(region: FakeRegion, session: aiohttp.ClientSession) -> None:
    full = await answer(session, region.url, body())
    words = full.split(" ")
    parts = [
        {"type": "text", "text": words[0]},
        {"type": "text", "text": " " + words[1]},
    ]
    rest = await answer(session, region.url, continuing(parts, **VLLM))
    assert " ".join(words[:2]) + rest == full


async def test_overlap_repeats_the_end_of_the_partial_answer(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    full = await answer(session, region.url, body())
    words = full.split(" ")
    partial = " ".join(words[:5])
    region.behavior.continuation_overlap = 2
    rest = await stream(session, region.url, continuing(partial, **VLLM))
    assert rest.text == " " + " ".join(words[3:])
    assert partial.endswith(rest.text[: len(" " + " ".join(words[3:5]))])
    # Cut inside a token, the cut token counts as one and is sent whole again.
    cut = partial + " " + words[5][:2]
    again = await stream(session, region.url, continuing(cut, **VLLM))
    assert again.text == " " + " ".join(words[4:])
    # More overlap than the partial answer has: the answer from its start.
    region.behavior.continuation_overlap = 50
    assert (await stream(session, region.url, continuing(partial))).text == full


async def test_a_partial_answer_from_elsewhere_is_continued_after_its_words(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    full = await answer(session, region.url, body())
    rest = await answer(session, region.url, continuing("not this model's words", **VLLM))
    # Four words: the answer after its first four tokens.
    assert rest == full[len(" ".join(full.split(" ")[:4])) :]


async def test_continuation_requests_vllm_refuses(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    async def status(payload: dict[str, Any]) -> tuple[int, str]:
        async with session.post(region.url + CHAT, json=payload) as response:
            return response.status, (await response.json())["error"]["message"]

    code, message = await status(continuing("alpha", continue_final_message=True))
    assert code == 400 and "add_generation_prompt" in message
    code, message = await status(body(**VLLM))
    assert code == 400 and "final message" in message
    code, _ = await status(continuing("alpha", continue_final_message="yes"))
    assert code == 400
    code, _ = await status(continuing(42, **VLLM))
    assert code == 400


async def test_a_broken_stream_and_its_continuation_make_the_unbroken_answer(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    full = await stream(session, region.url, body())
    region.configure(fault="reset", fault_after_tokens_random=True, continuation_overlap=1)
    broken = await stream(session, region.url, body())
    assert broken.broken and not broken.done
    assert 1 <= len(broken.chunks) <= 19
    assert full.text.startswith(broken.text)

    region.configure(fault=None)
    rest = await stream(session, region.url, continuing(broken.text, **VLLM))
    last = broken.chunks[-1]["choices"][0]["delta"]["content"]
    assert rest.text.startswith(last)  # the overlap: the proxy trims it
    assert broken.text + rest.text[len(last) :] == full.text


async def test_random_reset_points_are_seeded_and_inside_the_answer() -> None:
    async def reset_points() -> list[int]:
        behavior = Behavior(tokens=6, fault="reset", fault_after_tokens_random=True)
        async with (
            FakeRegion(seed=3, behavior=behavior) as fake,
            httpx.AsyncClient(http1=False, http2=True, base_url=fake.url) as client,
        ):
            points = []
            for _ in range(24):
                received = b""
                with pytest.raises(httpx.RemoteProtocolError):
                    async with client.stream("POST", CHAT, json=body(stream=True)) as response:
                        async for chunk in response.aiter_raw():
                            received += chunk
                points.append(received.count(b"data: "))
            return points

    first = await reset_points()
    assert first == await reset_points()
    assert set(first) == {1, 2, 3, 4, 5}  # 24 draws from 1..5 with this seed hit them all


async def test_random_reset_of_a_one_token_answer_and_of_json(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    region.configure(fault="reset", fault_after_tokens_random=True)
    one = await stream(session, region.url, body(max_tokens=1))
    assert one.broken and len(one.chunks) == 1
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(region.url + CHAT, json=body()) as response:
            await response.read()


def test_new_behavior_fields_are_validated() -> None:
    behavior = Behavior()
    with pytest.raises(TypeError):
        behavior.fault_after_tokens_random = 1  # type: ignore[assignment]
    with pytest.raises(ValueError):
        behavior.continuation_overlap = -1
    copy = behavior.copy(fault_after_tokens_random=True, continuation_overlap=2)
    assert copy.to_dict()["continuation_overlap"] == 2
    assert {"fault_after_tokens_random", "continuation_overlap"} <= Behavior.field_names()


async def test_answer_text_is_the_unbroken_answer(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    assert await answer(session, region.url, body()) == answer_text(MESSAGES, 20)
    assert await answer(session, region.url, body(max_tokens=5)) == answer_text(MESSAGES, 5)


async def test_tokens_sent_count_what_left_the_region(
    region: FakeRegion, session: aiohttp.ClientSession
) -> None:
    await stream(session, region.url, body())
    await answer(session, region.url, body(max_tokens=4))
    # Counted as each request ends in the region, which may be just after the client has read it.
    await region.wait_until(lambda c: c.in_flight == 0, timeout=10)
    assert region.counters().tokens_sent_total == 20 + 4
    region.reset_counters()
    region.configure(fault="reset", fault_after_tokens=3)
    broken = await stream(session, region.url, body())
    assert broken.broken and len(broken.chunks) == 3
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(region.url + CHAT, json=body()) as response:
            await response.read()
    counters = await region.wait_until(lambda c: c.in_flight == 0, timeout=10)
    assert counters.tokens_sent_total == 3  # a JSON answer cut off counts nothing
    assert counters.generation_tokens_total == 40
