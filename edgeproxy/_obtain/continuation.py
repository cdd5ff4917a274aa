"""Continuation: a stream that breaks after tokens were sent goes on elsewhere.

On a route with ``continue_on_break``, the Responder relays a streamed answer through a
:class:`Splice`: only whole SSE events reach the client (read by the one
:class:`~edgeproxy._protocol.sse.SSEReader`), and the splice keeps what they carried: the
answer text, whether content that cannot be continued (a tool call, thinking, another
output item) or the answer's end came, and what the request's dialect's
:class:`~edgeproxy._protocol.dialects.Seam` keeps of the client's stream (chat's ``id``,
``created`` and ``model``; the Messages API's text block; the Responses API's response and
item ids and its sequence numbers). Which requests can be continued, and how, is each
API's (its dialect's ``continuable``, ``continuation`` and ``continuation_body``):

* chat completions by each region's own method (``[[regions]] continuation``):
  ``continue_final_message`` (vLLM, SGLang: the conversation plus the partial answer as a
  final assistant message, with ``"continue_final_message": true`` and
  ``"add_generation_prompt": false``), ``prefill`` (llama.cpp: the same message, no
  switches) or ``reissue`` (any server, deterministic requests only: ``temperature`` 0 or
  a ``seed``: the original request again, its first characters skipped);
* Anthropic Messages by an assistant prefill on any region not set to ``off``: the
  conversation plus the partial answer as a final assistant message (its trailing
  whitespace left out, as Anthropic requires), which the API continues natively; a region
  the request is translated for (it speaks chat completions only) continues it as it
  continues a chat, by its own method;
* the Responses API by a reissue, on any region not set to ``off``, of a deterministic
  request (``temperature`` 0) that neither stores nor refers to state (a reissue would
  store a second response); any other Responses stream is not continued.

When the region breaks mid-stream, :meth:`edgeproxy._obtain.Continuer.next_leg` asks the
next-best region for the rest. Candidates come from the router (health, model catalog and
residency filter them), without the region that broke; each continuation spends one unit
of the retry budget, and its first byte must come within the route's ``deadline`` from the
break. The local model is the last rung for chat: it gets the conversation with the
partial answer as the prefix of its own. The splice then rewrites the new leg into the
client's stream (its dialect's seam drops the new leg's opening, puts the client's ids on
its events, holds its end), trims a repeated overlap at the seam, sums the legs' usage
(the broken legs' counts estimated from what they sent) and writes the one end of the
client's stream, after an SSE comment ``: edgeproxy continued from=<region> to=<region>``.

A stream that breaks inside content that cannot be continued, after its end, or past
``max_continuations`` is not continued: it ends with the API's error event, as without
continuation.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgeproxy._core.context import Continuation
from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects import CHAT, Dialect, Piece, dialect_named
from edgeproxy._protocol.endpoints import dialect_for
from edgeproxy._protocol.sse import SSEEvent

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

    The Responder owns it once :meth:`edgeproxy._obtain.Continuer.next_leg` returned it, and
    calls :attr:`close` whatever happens (idempotent).
    """

    name: str
    """The region that continues the answer, or ``local``."""
    chunks: AsyncIterator[bytes]
    close: Callable[[], Awaitable[None]]
    degraded: str | None = None
    """The degradation this leg makes of the answer (``local-model``, ``lighter-model``),
    None for a region's own; recorded on the request by :class:`edgeproxy._obtain.Continuer`."""
    model: str | None = None
    """The model that continues, when it is another than the client asked for (a lighter
    one)."""


class Splice:
    """What the client was sent of one streamed answer, and the seam of each new leg.

    :meth:`feed` takes a leg's events and returns what the client is to get: whole events
    only, the first leg's as they came, later legs' rewritten into the first's stream by
    the dialect's seam.
    """

    def __init__(self, body: dict[str, Any], dialect: Dialect = CHAT) -> None:
        self.body = body
        self.dialect = dialect
        self.seam = dialect.seam(body)
        self.deterministic = dialect.deterministic(body)
        self.text = ""
        self.other = False  # content that cannot be continued came (a tool call...)
        self.finished = False
        self.leg = 0
        self.method: str | None = None  # how the current leg continues the answer
        # Content deltas of the current leg: its completion tokens, estimated.
        self.leg_tokens = 0
        self.broken_tokens = 0  # the same for the legs that broke
        self.continued: list[tuple[str, str]] = []
        self.broken: set[str] = set()  # the regions that broke this answer: never asked again
        # When the answer first broke: the route's deadline bounds every leg from there on,
        # the whole continued answer rather than each leg.
        self.since: float | None = None
        # A region's refusal to continue (a 4xx: a content filter...), passed to the client
        # once as the stream's error, never retried.
        self.refused: ProxyError | None = None
        self._usage: dict[str, Any] | None = None  # the current leg's, in the API's shape
        # The seam: a new leg's first content, held until it is known whether it repeats
        # the end of the text already sent; `_skip`: characters a reissue repeats whole;
        # `_lstrip`: the prefill left the text's trailing whitespace out, so the new leg's
        # leading whitespace is the client's already.
        self._held: list[Piece] | None = None
        self._held_text = ""
        self._skip = 0
        self._lstrip = False

    @property
    def sequence(self) -> int:
        """The next sequence number of the client's stream (for the API that numbers its
        events): the error event that ends it takes it."""
        return self.seam.sequence

    # -- legs -----------------------------------------------------------------------

    def broke(self, region: str) -> None:
        """The current leg, from ``region``, broke: what it held back is dropped, never sent."""
        self.broken.add(region)
        self._held = None
        self.broken_tokens += self.leg_tokens
        self.leg_tokens = 0

    def start_leg(self, from_region: str, to_region: str, method: str) -> None:
        """A new leg, continuing the answer by ``method``, takes over from here."""
        self.leg += 1
        self.continued.append((from_region, to_region))
        self.method = method
        self._usage = None
        self.seam.start_leg()
        if method == "reissue":
            self._skip, self._held, self._lstrip = len(self.text), None, False
        else:
            self._skip, self._held, self._held_text = 0, [], ""
            self._lstrip = self.dialect.prefilled(self.text) != self.text

    # -- the client's bytes ---------------------------------------------------------

    def feed(self, events: list[SSEEvent]) -> bytes:
        """What the client is to get of a leg's ``events`` (whole events, as the Responder's
        one parse of the leg read them)."""
        if not events:
            return b""
        if self.leg == 0:
            first = self.seam.first
            for event in events:
                if not event.comment:
                    self._note(first(event))
            return events[0].raw if len(events) == 1 else b"".join(e.raw for e in events)
        return b"".join(self._rewrite(event) for event in events)

    def finish(self) -> bytes:
        """A continued leg ended cleanly: the seam, the mark, and the end of the client's
        stream (the summed usage, the API's last events)."""
        out = [self._flush()] if self._held is not None else []
        for source, target in self.continued:
            out.append(f": edgeproxy continued from={source} to={target}\n\n".encode())
        out.append(self.seam.close(self.usage(), self.text))
        return b"".join(out)

    def usage(self) -> dict[str, Any] | None:
        """The legs' usage summed, in chat's fields: the last leg's as reported, the broken
        legs' estimated (their prompt as the last leg's, less the text sent before it for a
        prefill; their completion as the deltas they sent)."""
        last = self._usage
        if last is None:
            return None
        counted = self.dialect.counted(last)
        prompt = _int(counted.get("prompt_tokens"))
        completion = _int(counted.get("completion_tokens"))
        first_prompt = prompt if self.method == "reissue" else max(0, prompt - self.broken_tokens)
        prompt += first_prompt * len(self.continued)
        completion += self.broken_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _note(self, piece: Piece) -> None:
        """What an event the client gets adds to the answer so far."""
        if piece.text:
            self.text += piece.text
            self.leg_tokens += 1
        if piece.other:
            self.other = True
            self.leg_tokens += 1
        if piece.finish:
            self.finished = True

    def _rewrite(self, event: SSEEvent) -> bytes:
        """A later leg's event, as the client's stream continues."""
        if event.comment:
            return event.raw
        piece = self.seam.later(event)
        if piece.usage is not None:
            self._usage = self.dialect.merge_usage(self._usage, piece.usage)
        kind = piece.kind
        if kind == "drop":
            return b""
        if kind == "text":
            return self._text(piece)
        # Anything else ends the leg's run of text: the seam is settled first.
        out = self._flush() if self._held is not None else b""
        if kind == "hold":
            self._note(piece)
            return out
        if kind == "raw":
            return out + event.raw
        return out + self._write(piece)

    def _text(self, piece: Piece) -> bytes:
        text = piece.text
        if self._skip and text:
            cut = min(self._skip, len(text))
            self._skip -= cut
            text = text[cut:]
        if self._lstrip and text:
            text = text.lstrip()
            self._lstrip = not text
        piece.text = text
        if not text and not piece.finish and not piece.other:
            return b""
        if self._held is not None:
            self._held.append(piece)
            self._held_text += text
            if not piece.finish and self._may_overlap():
                return b""
            return self._flush()
        return self._write(piece)

    def _write(self, piece: Piece) -> bytes:
        self._note(piece)
        return self.seam.write(piece, self.text)

    def _may_overlap(self) -> bool:
        """Whether the new leg's text so far could still be the start of a repeat."""
        tail, held = self.text[-_SEAM_WINDOW:], self._held_text
        return any(len(tail) - i > len(held) and tail.startswith(held, i) for i in range(len(tail)))

    def _flush(self) -> bytes:
        """The held start of the new leg, its repeat of the text already sent cut off."""
        held, text, self._held = self._held or [], self._held_text, None
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
        for piece in held:
            if trim and piece.text:
                cut = min(trim, len(piece.text))
                trim -= cut
                piece.text = piece.text[cut:]
                if not piece.text and not piece.finish and not piece.other:
                    continue
            out.append(self._write(piece))
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
        """A splice for this answer if it can be continued: a stream (200, SSE) of an API
        that continues, to a request its dialect can continue (one chat choice; a
        Messages request without extended thinking; a deterministic, stateless Responses
        request)."""
        body = ctx.json
        if (
            status != 200
            or not content_type.startswith("text/event-stream")
            or not isinstance(body, dict)
        ):
            return None
        facts = ctx.facts
        dialect = dialect_named(facts.dialect) if facts is not None else dialect_for(ctx.path)
        if dialect.continuation is None or not dialect.continuable(body):
            return None
        return Splice(body, dialect)

    def count(self, ctx: RequestContext, source: str, target: str, outcome: str) -> Continuation:
        """One continuation attempt's outcome, counted in ``/status``; the record returned
        is the request's (its caller adds it to ``ctx.continuations``)."""
        self.counts[(ctx.route.name, source, target, outcome)] += 1
        return Continuation(source, target, outcome)

    def refusal(self, ctx: RequestContext, splice: Splice, broken: str) -> Continuation | None:
        """None when the answer ``broken`` broke may go on: not past ``max_continuations``,
        nor inside content that cannot be continued (tool calls...), after its end, or
        before any text (blanks only count as none); else the counted record of why not."""
        splice.broke(broken)
        now = time.monotonic()
        if splice.since is None:
            splice.since = now
        said = bool(splice.text.strip())
        if (
            len(splice.continued) >= ctx.route.max_continuations
            or splice.other
            or splice.finished
            or not said
        ):
            return self.count(ctx, broken, "none", "limit" if said else "impossible")
        if now >= splice.since + ctx.route.deadline:
            # The answer's continuations took the route's deadline already.
            return self.count(ctx, broken, "none", "deadline")
        return None

    def groups(self, candidates: list[Region], splice: Splice) -> dict[str, list[Region]]:
        """The candidates able to continue ``splice``, best first, by continuation method
        (the API's, or for chat each region's own); none that broke it already."""
        groups: dict[str, list[Region]] = {}
        continued_by = splice.dialect.continued_by
        for region in candidates:
            if region.name in splice.broken:
                continue
            config = region.config
            method = continued_by(config.continuation, config.continuation_method)
            if method is not None and region.apis.lacking:
                method = _translated_method(splice.dialect, region, method)
            if method is None:
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


def _translated_method(dialect: Dialect, region: Region, method: str) -> str | None:
    """How ``region`` continues a stream of ``dialect`` when its requests of that API are
    translated to chat completions: a prefill (Messages') as it continues a chat, by its
    own method (the final assistant message, with vLLM's switches where it takes them; a
    region that continues no chat continues none); a reissue as any region does."""
    if not region.apis.translates(dialect.name) or method != "prefill":
        return method
    config = region.config
    chat = CHAT.continued_by(config.continuation, config.continuation_method)
    return "reissue" if chat == "reissue" else None if chat is None else "prefill"


def _spend_tokens(body: dict[str, Any], splice: Splice) -> None:
    """The client's token limit less what was already sent."""
    sent = splice.broken_tokens
    for key in splice.dialect.max_tokens_keys:
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
    """The request a leg continuing ``splice`` by ``method`` sends, as its API words it
    (the partial answer as a final assistant message), its token limit less what was
    already sent; for a reissue, the original request."""
    body = splice.dialect.continuation_body(splice.body, splice.text, method)
    if method != "reissue":
        _spend_tokens(body, splice)
    return body


def carries_token(event: SSEEvent, dialect: Dialect = CHAT) -> bool:
    """Whether ``event`` of a new leg brings its first token: content or the answer's end
    as its API says (the dialect's ``commits``), not an error."""
    return not event.comment and dialect.commits(event) and not dialect.is_error(event)
