"""The fake region's KV model caches answers: the next chat turn finds the previous
answer in the cache where it was generated, as with vLLM's and SGLang's prefix caches."""

from __future__ import annotations

from typing import Any

import httpx

from edgeproxy.testing import FakeRegion, answer_text
from edgeproxy.testing._kv import KVCache, answer_length, prompt_tokens, read_prompt

CHAT = "/v1/chat/completions"
BLOCK = 16
# 40 words of at most 4 characters: with the role marker, 41 tokens (2 whole blocks).
TURN_1 = [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}]


def chat(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, **extra}


def test_answer_blocks_follow_the_prompt_blocks() -> None:
    request = chat(TURN_1, max_tokens=60)
    plain = read_prompt(chat(TURN_1), chat=True, block_size=BLOCK, hashed=True)
    with_answer = read_prompt(request, chat=True, block_size=BLOCK, hashed=True)
    assert plain.tokens == with_answer.tokens == 41
    assert plain.answer_tokens == 0
    assert with_answer.answer_tokens > 59  # the marker, then 59 words of 1-2 pieces
    # The prompt's blocks come first, unchanged; the answer's are chained after them.
    assert with_answer.blocks[:2] == plain.blocks
    assert len(with_answer.blocks) == (41 + with_answer.answer_tokens) // BLOCK
    # A stated length wins over the request's.
    shorter = read_prompt(request, chat=True, block_size=BLOCK, hashed=True, completion_tokens=2)
    assert 2 <= shorter.answer_tokens <= 3  # the marker and one word (1-2 pieces)
    assert shorter.blocks[:2] == plain.blocks


def test_answer_length_as_the_request_states_it() -> None:
    assert answer_length({"max_tokens": 7}) == 7
    assert answer_length({"max_completion_tokens": 9}) == 9
    assert answer_length({}) is None
    assert answer_length({"max_tokens": -1}) is None
    assert answer_length({"max_tokens": True}) is None
    assert answer_length({"max_tokens": "5"}) is None
    assert answer_length({"max_tokens": 10**9}) == 100_000


def test_next_turn_prompt_starts_with_the_cached_answer() -> None:
    """Turn 2 (turn 1, the answer, a new message) finds every full block of turn 1's
    prompt and answer but the one holding the answer's last token."""
    first = chat(TURN_1, max_tokens=60)
    turn1 = read_prompt(first, chat=True, block_size=BLOCK, hashed=True)
    cache = KVCache(1000)
    cache.insert(turn1.blocks)
    # The answer as the fake region writes it (see edgeproxy.testing._content).
    from_region = answer_text(first["messages"], first["max_tokens"])
    second = chat([*TURN_1, {"role": "assistant", "content": from_region},
                   {"role": "user", "content": "and then what"}])  # fmt: skip
    turn2 = read_prompt(second, chat=True, block_size=BLOCK, hashed=True)
    eligible = (turn2.tokens - 1) // BLOCK
    matched = cache.lookup(turn2.blocks, eligible)
    assert matched == len(turn1.blocks)
    assert turn2.blocks[:matched] == turn1.blocks
    assert len(prompt_tokens(second, chat=True)) == turn2.tokens


async def test_region_caches_the_answer_for_the_next_turn() -> None:
    async with (
        FakeRegion(name="kv", kv_capacity_blocks=256) as region,
        httpx.AsyncClient(http1=False, http2=True, timeout=10.0) as client,
    ):
        first = chat(TURN_1, max_tokens=60)
        response = await client.post(region.url + CHAT, json=first)
        answer = response.json()["choices"][0]["message"]["content"]
        assert int(response.headers["x-fake-kv-cached-tokens"]) == 0
        turn1 = read_prompt(first, chat=True, block_size=BLOCK, hashed=True)
        second = chat([*TURN_1, {"role": "assistant", "content": answer},
                       {"role": "user", "content": "and then what"}])  # fmt: skip
        response = await client.post(region.url + CHAT, json=second)
        cached = int(response.headers["x-fake-kv-cached-tokens"])
        assert cached == len(turn1.blocks) * BLOCK > 41  # past the first turn's prompt
        # Without a stated length the answer is not cached: only the prompt's blocks.
        await client.post(region.url + "/_control/clear-kv-cache")
        await client.post(region.url + CHAT, json=chat(TURN_1))
        response = await client.post(region.url + CHAT, json=second)
        assert int(response.headers["x-fake-kv-cached-tokens"]) == 2 * BLOCK
