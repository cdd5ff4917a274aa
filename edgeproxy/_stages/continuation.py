"""Continuation: a chat stream that breaks after tokens were sent goes on elsewhere.

On a route with ``continue_on_break``, the stream stage relays a streamed chat
completion through a :class:`Splice`: only whole SSE events reach the client,
and the splice keeps what they carried (the answer's ``id``, ``created`` and
``model``, the assistant text, whether tool-call deltas or a finish came).
When the region breaks mid-stream, :meth:`edgeproxy._obtain.Continuer.next_leg` asks the
next-best region for the rest, by that region's method
(``[[regions]] continuation``):

* ``continue_final_message`` (vLLM, SGLang): the conversation plus the partial
  answer as a final assistant message, with ``"continue_final_message": true``
  and ``"add_generation_prompt": false``;
* ``prefill`` (llama.cpp): the same message, no switches;
* ``reissue`` (any server, deterministic requests only: ``temperature`` 0 or a
  ``seed``): the original request again, its first characters skipped.

Candidates come from the router (health, model catalog and residency filter
them), without the region that broke; each continuation spends one unit of
the retry budget, and its first byte must come within the route's
``deadline`` from the break. The local model is the last rung: it gets the
conversation with the partial answer as the prefix of its own. The splice
then rewrites the new leg into the client's stream: the same ``id``,
``created`` and ``model``, no second ``role`` delta, a repeated overlap
trimmed at the seam, one ``usage`` summing the legs (the broken legs' counts
estimated from what they sent) and one ``[DONE]``, after an SSE comment
``: edgeproxy continued from=<region> to=<region>``.

A stream that breaks inside tool calls, after its finish, or past
``max_continuations`` is not continued: it ends with an ``error`` event and
no ``[DONE]``, as without continuation.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from edgeproxy._core.context import Continuation
from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.endpoints import CHAT_COMPLETIONS, openai_endpoint
from edgeproxy._protocol.openai import SSE_DONE, sse_event

if TYPE_CHECKING:
    from edgeproxy._core.context import RequestContext
    from edgeproxy._upstream.regions import Region

__all__ = [
    "LOCAL",
    "Continuation",
    "ContinuationStage",
    "Leg",
    "Splice",
    "carries_token",
    "chain",
    "continuation_body",
    "spent_body",
]

logger = logging.getLogger("edgeproxy")

# How much of the relayed text the seam check compares a new leg's start against.
_SEAM_WINDOW = 256
# A shorter match at the seam is taken as the answer repeating itself (a word said twice),
# not as a server re-emitting the end of the partial answer.
_MIN_OVERLAP = 8
LOCAL = "local"


@dataclass(slots=True)
class Leg:
    """One continuation of the answer: its bytes and how to let go of it.

    The stream stage owns it once :meth:`edgeproxy._obtain.Continuer.next_leg` returned it, and
    calls :attr:`close` whatever happens (idempotent).
    """

    name: str
    """The region that continues the answer, or ``local``."""
    chunks: AsyncIterator[bytes]
    close: Callable[[], Awaitable[None]]
    degraded: str | None = None
    """The degradation this leg makes of the answer (``local-model``), None for a region's;
    recorded on the request by :class:`edgeproxy._obtain.Continuer`."""


def _deterministic(body: dict[str, Any]) -> bool:
    return body.get("temperature") == 0 or body.get("seed") is not None


class Splice:
    """What the client was sent of one streamed chat answer, and the seam of each new leg.

    :meth:`feed` takes a leg's bytes and returns what the client is to get: whole
    events only (the start of an event waits for its end), the first leg's as
    they came, later legs' rewritten into the first's stream.
    """

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and options.get("include_usage") is True
        self.deterministic = _deterministic(body)
        self._buffer = b""
        self.text = ""
        self.head: dict[str, Any] | None = None
        self.tool_calls = False
        self.finished = False
        self.leg = 0
        # Content (or tool-call) deltas of the current leg: its completion tokens, estimated.
        self.leg_tokens = 0
        self.broken_tokens = 0  # the same for the legs that broke
        self.continued: list[tuple[str, str]] = []
        self.broken: set[str] = set()  # the regions that broke this answer: never asked again
        self._usage: dict[str, Any] | None = None
        self._done = False
        # The seam: a new leg's first content, held until it is known whether it repeats
        # the end of the text already sent; `_skip`: characters a reissue repeats whole.
        self._seam: list[dict[str, Any]] | None = None
        self._seam_text = ""
        self._skip = 0

    # -- legs -----------------------------------------------------------------------

    def broke(self, region: str) -> None:
        """The current leg, from ``region``, broke: what it held back is dropped, never sent."""
        self.broken.add(region)
        self._buffer = b""
        self._seam = None
        self.broken_tokens += self.leg_tokens
        self.leg_tokens = 0

    def start_leg(self, from_region: str, to_region: str, method: str) -> None:
        """A new leg, continuing the answer by ``method``, takes over from here."""
        self.leg += 1
        self.continued.append((from_region, to_region))
        self._usage = None
        self._done = False
        if method == "reissue":
            self._skip = len(self.text)
        else:
            self._seam, self._seam_text = [], ""

    # -- the client's bytes ---------------------------------------------------------

    def feed(self, chunk: bytes) -> bytes:
        """The whole events of ``chunk`` (with what came before it) the client is to get."""
        data = self._buffer + chunk if self._buffer else chunk
        if b"\r" in data:
            # SSE allows CRLF and CR line ends; one kind makes the events' ends findable.
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        end = data.rfind(b"\n\n")
        if end < 0:
            self._buffer = data
            return b""
        complete, self._buffer = data[: end + 2], data[end + 2 :]
        if self.leg == 0:
            for event in complete.split(b"\n\n")[:-1]:
                self._record(event)
            return complete
        return b"".join(self._rewrite(event) for event in complete.split(b"\n\n")[:-1])

    def finish(self) -> bytes:
        """A continued leg ended cleanly: the seam, the mark, the summed usage and [DONE]."""
        out = [self._flush_seam()] if self._seam is not None else []
        for source, target in self.continued:
            out.append(f": edgeproxy continued from={source} to={target}\n\n".encode())
        usage = self.usage()
        if self.include_usage and usage is not None and self.head is not None:
            chunk = {**self.head, "choices": [], "usage": usage}
            out.append(sse_event(chunk))
        if self._done:
            out.append(SSE_DONE)
        return b"".join(out)

    def usage(self) -> dict[str, Any] | None:
        """The legs' usage summed: the last leg's as reported, the broken legs' estimated
        (their prompt as the last leg's without the text sent before it, their completion
        as the deltas they sent)."""
        last = self._usage
        if last is None:
            return None
        prompt = _int(last.get("prompt_tokens"))
        completion = _int(last.get("completion_tokens"))
        first_prompt = max(0, prompt - self.broken_tokens)
        prompt += first_prompt * len(self.continued)
        completion += self.broken_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _parse(self, event: bytes) -> Any:
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return payload
                try:
                    return orjson.loads(payload)
                except orjson.JSONDecodeError:
                    return None
        return None

    def _record(self, event: bytes) -> None:
        """The first leg's event, as sent: what it tells of the answer so far."""
        obj = self._parse(event)
        if not isinstance(obj, dict):
            return
        if self.head is None and "id" in obj:
            self.head = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
            if obj.get("system_fingerprint") is not None:
                self.head["system_fingerprint"] = obj["system_fingerprint"]
        self._note(obj)

    def _note(self, obj: dict[str, Any]) -> None:
        choices = obj.get("choices")
        if choices:
            choice = choices[0]
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                self.text += content
                self.leg_tokens += 1
            if delta.get("tool_calls"):
                self.tool_calls = True
                self.leg_tokens += 1
            if choice.get("finish_reason"):
                self.finished = True
        if isinstance(obj.get("usage"), dict):
            self._usage = obj["usage"]

    def _rewrite(self, event: bytes) -> bytes:
        """A later leg's event, as the client's stream continues."""
        obj = self._parse(event)
        if obj == b"[DONE]":
            self._done = True
            return b""
        if not isinstance(obj, dict):
            return b"" if obj is None and b"data:" in event else event + b"\n\n"
        if isinstance(obj.get("usage"), dict):
            self._usage = obj["usage"]
        choices = obj.get("choices")
        if not choices:
            return b""  # the usage chunk: summed and sent at the end
        if self.head is not None:
            obj.update(self.head)
        obj.pop("usage", None)
        delta = choices[0].get("delta")
        if isinstance(delta, dict):
            delta.pop("role", None)
            content = delta.get("content")
            if content and self._skip:
                cut = min(self._skip, len(content))
                self._skip -= cut
                delta["content"] = content = content[cut:]
            if not content:
                delta.pop("content", None)
            if not delta and not choices[0].get("finish_reason"):
                return b""
        if self._seam is not None:
            self._seam.append(obj)
            if isinstance(delta, dict):
                self._seam_text += delta.get("content") or ""
            if not choices[0].get("finish_reason") and self._may_overlap():
                return b""
            return self._flush_seam()
        self._note(obj)
        return sse_event(obj)

    def _may_overlap(self) -> bool:
        """Whether the new leg's text so far could still be the start of a repeat."""
        tail, held = self.text[-_SEAM_WINDOW:], self._seam_text
        return any(len(tail) - i > len(held) and tail.startswith(held, i) for i in range(len(tail)))

    def _flush_seam(self) -> bytes:
        """The held start of the new leg, its repeat of the text already sent cut off."""
        held, text, self._seam = self._seam or [], self._seam_text, None
        tail = self.text[-_SEAM_WINDOW:]
        trim = next(
            (
                len(tail) - i
                for i in range(len(tail))
                if len(tail) - i >= _MIN_OVERLAP and text.startswith(tail[i:])
            ),
            0,
        )
        out = []
        for obj in held:
            delta = obj["choices"][0].get("delta")
            if trim and isinstance(delta, dict) and delta.get("content"):
                content = delta["content"]
                cut = min(trim, len(content))
                trim -= cut
                if content[cut:]:
                    delta["content"] = content[cut:]
                else:
                    del delta["content"]
                    if not delta and not obj["choices"][0].get("finish_reason"):
                        continue
            self._note(obj)
            out.append(sse_event(obj))
        return b"".join(out)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class ContinuationStage:
    """Decides whether and where a broken stream may go on, and counts each continuation
    by route, from and to region and outcome (``continued``, ``failed``, ``limit``,
    ``impossible``, ``budget``) for ``/status``. Finding the next leg is the obtain path's
    (:class:`edgeproxy._obtain.Continuer`): this stage holds no other stage.
    """

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str, str]] = Counter()

    def splice(self, ctx: RequestContext, status: int, content_type: str) -> Splice | None:
        """A splice for this answer if the route continues it and it can be continued: a
        streamed chat completion (one choice) answered 200 in SSE."""
        body = ctx.json
        if (
            status != 200
            or not content_type.startswith("text/event-stream")
            or openai_endpoint(ctx.path) is not CHAT_COMPLETIONS
            or not isinstance(body, dict)
            or not isinstance(body.get("messages"), list)
            or body.get("n", 1) != 1
        ):
            return None
        return Splice(body)

    def count(self, ctx: RequestContext, source: str, target: str, outcome: str) -> Continuation:
        """One continuation attempt's outcome, counted in ``/status``; the record returned
        is the request's (its caller adds it to ``ctx.continuations``)."""
        self.counts[(ctx.route.name, source, target, outcome)] += 1
        return Continuation(source, target, outcome)

    def refusal(self, ctx: RequestContext, splice: Splice, broken: str) -> Continuation | None:
        """None when the answer ``broken`` broke may go on: not past ``max_continuations``,
        nor inside tool calls, after its finish, or before any text; else the counted
        record of why not."""
        splice.broke(broken)
        if (
            len(splice.continued) >= ctx.route.max_continuations
            or splice.tool_calls
            or splice.finished
            or not splice.text
        ):
            return self.count(ctx, broken, "none", "limit" if splice.text else "impossible")
        return None

    def groups(self, candidates: list[Region], splice: Splice) -> dict[str, list[Region]]:
        """The candidates able to continue ``splice``, best first, by continuation method;
        none that broke it already."""
        groups: dict[str, list[Region]] = {}
        for region in candidates:
            method = region.config.continuation_method
            if region.name in splice.broken or method == "off":
                continue
            if method == "reissue" and not splice.deterministic:
                continue
            groups.setdefault(method, []).append(region)
        return groups

    def no_region_continued(self, ctx: RequestContext, method: str, err: ProxyError) -> None:
        logger.info(
            "request %s: no region continued the stream by %s: %s",
            ctx.request_id,
            method,
            err.message,
        )

    def snapshot(self) -> dict[str, Any]:
        """The continuation part of /status: counts by outcome."""
        outcomes: Counter[str] = Counter()
        for (_, _, _, outcome), n in self.counts.items():
            outcomes[outcome] += n
        return dict(outcomes)


def _spend_tokens(body: dict[str, Any], splice: Splice) -> None:
    """The client's token limit less what was already sent."""
    sent = splice.broken_tokens
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            body[key] = max(1, value - sent)


def spent_body(splice: Splice) -> dict[str, Any]:
    """The client's request with its token limit less what was already sent (for the
    local model, which continues from the partial answer as its prefix)."""
    body = dict(splice.body)
    _spend_tokens(body, splice)
    return body


def continuation_body(splice: Splice, method: str) -> dict[str, Any]:
    """The original request plus the partial answer as a final assistant message."""
    body = dict(splice.body)
    body["messages"] = [*body["messages"], {"role": "assistant", "content": splice.text}]
    _spend_tokens(body, splice)
    if method == "continue_final_message":
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    return body


def carries_token(data: bytes) -> bool:
    """Whether the whole events in ``data`` include a chunk with content or a finish."""
    for block in data.split(b"\n\n")[:-1]:
        for line in block.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return True
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            for choice in event.get("choices") or () if isinstance(event, dict) else ():
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls") or choice.get("finish_reason"):
                    return True
    return False


async def chain(first: list[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in first:
        yield chunk
    async for chunk in rest:
        yield chunk
