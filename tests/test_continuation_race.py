"""race_continuations: the rest of a broken stream asked of two regions at once."""

from __future__ import annotations

from typing import Any

import orjson

from edgeproxy.testing import answer_text

from .conftest import ProxyFactory, RegionFactory, eventually
from .test_continuation import CHAT, MESSAGES, TOKENS, raw_stream, regions, route, table

EXPECTED = answer_text(MESSAGES, TOKENS)


def text_of(raw: bytes) -> str:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            event: dict[str, Any] = orjson.loads(line[6:])
            for choice in event.get("choices") or []:
                out.append(choice.get("delta", {}).get("content") or "")
    return "".join(out)


async def test_a_stalled_contender_does_not_hold_the_seam(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region)
    # Ranked before the sound region, it takes the request and never answers.
    stalled = await make_region("stalled", tokens=TOKENS, fault="stall", fault_paths=[CHAT])
    proxy = await make_proxy(
        [table(broken, 0), table(stalled, 1), table(sound, 2)],
        routes=[route(race_continuations=True, deadline=60.0)],
    )
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    raw = await raw_stream(proxy.url, body)
    assert text_of(raw) == EXPECTED
    assert raw.count(b": edgeproxy continued") == 1
    assert b"to=sound" in raw and raw.rstrip().endswith(b"data: [DONE]")
    # The losing contender's request was cancelled, not left to its timeout.
    await eventually(lambda: stalled.in_flight == 0)


async def test_a_contender_that_fails_before_its_first_token_costs_no_second_seam(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    broken, sound = await regions(make_region)
    failing = await make_region(
        "failing", tokens=TOKENS, fault="reset", fault_after_tokens=0, fault_paths=[CHAT]
    )
    proxy = await make_proxy(
        [table(broken, 0), table(failing, 1), table(sound, 2)],
        routes=[route(race_continuations=True, max_continuations=1)],
    )
    raw = await raw_stream(proxy.url, {"model": "m", "messages": MESSAGES, "stream": True})
    assert text_of(raw) == EXPECTED
    assert raw.count(b": edgeproxy continued") == 1 and b"to=sound" in raw
