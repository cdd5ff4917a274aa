"""The run-time behaviour knobs of a fake region."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from edgeproxy.testing._load import LOAD_METRICS_FAULTS, LoadMetricsFault

Fault = Literal["5xx", "reset", "stall", "stall_body", "slow_headers", "goaway", "stream_error"]
"""The failure modes a fake region can inject; see :class:`Behavior`."""

FAULTS: Final[frozenset[str]] = frozenset(get_args(Fault))

RealtimeFault = Literal["close", "drop", "stall"]
"""The ways a fake region's Realtime session can fail mid-response; see :class:`Behavior`."""

REALTIME_FAULTS: Final[frozenset[str]] = frozenset(get_args(RealtimeFault))


def seconds(name: str, value: object) -> float:
    """``value`` as a duration, checked: a finite number of seconds, at least 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
    return float(value)


def probability(name: str, value: object) -> float:
    """``value`` as a probability, checked: a number from 0 to 1."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a probability (a number), not {value!r}")
    if not math.isfinite(value) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a probability between 0 and 1, not {value!r}")
    return float(value)


def _count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value!r}")
    return value


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, not {value!r}")
    return value


def _one_of(choices: frozenset[str]) -> Callable[[str, object], object]:
    """A check that a value is None or one of ``choices``."""

    def check(name: str, value: object) -> object:
        if value is not None and value not in choices:
            listed = ", ".join(sorted(choices))
            raise ValueError(f"{name} must be None or one of {listed}, not {value!r}")
        return value

    return check


def _status(name: str, value: object) -> int:
    status = _count(name, value, 400)
    if status > 599:
        raise ValueError(f"{name} must be an HTTP error status (400-599), not {value!r}")
    return status


def _paths(name: str, value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    # A bare string would otherwise be accepted as a tuple of one-letter prefixes.
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise TypeError(f"{name} must be None or a sequence of path prefixes, not {value!r}")
    for item in value:
        if not isinstance(item, str) or not item.startswith("/"):
            raise ValueError(f"{name} entries must be paths starting with '/', not {item!r}")
    return tuple(value)


def _text(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be None or a non-empty string, not {value!r}")
    return value


_VALIDATORS: Final[dict[str, Callable[[str, object], object]]] = {
    "ttft": seconds,
    "inter_token_delay": seconds,
    "tokens": lambda n, v: _count(n, v, 0),
    "fault": _one_of(FAULTS),
    "fault_rate": probability,
    "fault_status": _status,
    "fault_after_tokens": lambda n, v: _count(n, v, 0),
    "fault_after_tokens_random": _flag,
    "fault_paths": _paths,
    "fault_body": _text,
    "slow_headers_delay": seconds,
    "goaway_after": lambda n, v: _count(n, v, 1),
    "ttft_per_uncached_token": seconds,
    "ttft_per_cached_token": seconds,
    "load_metrics_fault": _one_of(LOAD_METRICS_FAULTS),
    "continuation_overlap": lambda n, v: _count(n, v, 0),
    "fault_retry_after": _text,
    "fault_count": lambda n, v: None if v is None else _count(n, v, 1),
    "realtime_refuse": lambda n, v: None if v is None else _status(n, v),
    "realtime_accept_delay": seconds,
    "realtime_fault": _one_of(REALTIME_FAULTS),
    "realtime_fault_after_deltas": lambda n, v: _count(n, v, 0),
}


@dataclass(slots=True)
class Behavior:
    """How a fake region answers. Every field can be changed while it serves.

    A request takes a snapshot of the behaviour when it arrives, so a change
    affects the next requests, not the ones in progress. Assigning a field
    validates it at once (a typo or a bad value raises there, not inside the
    server thread); to change several fields together, use
    :meth:`FakeRegion.configure <edgeproxy.testing.FakeRegion.configure>`.

    Timing (seconds):

    ``ttft``
        Delay before the response headers of the LLM endpoints: the first
        token of a stream goes out with them, a JSON answer goes out whole.
        A Responses or Messages stream sends its headers and opening events
        (``response.created``, ``message_start``) at once, as servers do,
        and waits ``ttft`` before its first token.
    ``inter_token_delay``
        Delay between two tokens of a stream.
    ``tokens``
        Tokens per completion when the request sets no ``max_tokens``.
    ``ttft_per_uncached_token``, ``ttft_per_cached_token``
        Prefill cost per prompt token that the region's KV cache does not
        hold, and per token it does (0 and 0 by default; 0.0002 and 0.00002,
        i.e. 0.2 ms and 0.02 ms, are typical). A chat or completions request
        waits ``ttft + uncached * ttft_per_uncached_token + cached *
        ttft_per_cached_token`` before its headers, once it has left the
        queue (see ``kv_capacity_blocks`` and ``max_running`` on
        :class:`FakeRegion <edgeproxy.testing.FakeRegion>`). Other endpoints
        wait ``ttft`` alone.

    Load reports:

    ``load_metrics_fault``
        ``None``, or a way to spoil the ORCA ``endpoint-load-metrics``
        header, for tests of a proxy's parser. While set, every chat and
        completions answer carries the header, in the format the request
        asks for (``TEXT`` when it asks for none and the region has no
        ``load_metrics_always``):

        * ``"huge"``: every value ``1e+308``;
        * ``"nan"``, ``"inf"``: every value ``nan`` / ``inf`` (JSON: ``NaN``,
          ``Infinity``, as Python's ``json`` writes them);
        * ``"negative"``: -1.0, -2.0, -3.0;
        * ``"many"``: 10,000 named metrics (the real three first): a header
          of about 280 kB in TEXT, 170 kB in JSON, past most clients'
          default limits (aiohttp's 8 kB line, hpack's 64 kB header list).
          On HTTP/2 the connection's header blocks are then sent without
          Huffman coding, which hpack's pure-Python coder would take seconds
          over;
        * ``"garbage"``: the right prefix, then text that does not parse
          (TEXT: words for numbers, keys without values, empty names;
          JSON: a truncated object);
        * ``"empty"``: the prefix alone (``TEXT`` or ``JSON``);
        * ``"no_prefix"``: the right payload without its ``TEXT``/``JSON``
          prefix;
        * ``"wrong_type"``: values that are strings, booleans, nulls or lists.

    Faults, applied to every path except ``/_control``:

    ``fault``
        ``None`` or one of:

        * ``"5xx"``: answer ``fault_status`` with an error body in the API's
          shape: OpenAI's, or on ``/v1/messages`` Anthropic's (``type``
          ``overloaded_error`` for 503 and 529, ``api_error`` for other 5xx);
        * ``"reset"``: send ``fault_after_tokens`` body units (stream events,
          echo chunks, or half of a single-piece body), then reset: HTTP/2
          sends RST_STREAM(INTERNAL_ERROR), HTTP/1.1 drops the connection.
          ``fault_after_tokens=0`` resets before the response headers;
          with ``fault_after_tokens_random``, after a count drawn instead.
          A Responses or Messages stream first sends its opening events
          (``response.created`` to ``response.content_part.added``;
          ``message_start``, ``content_block_start``, ``ping``) and counts
          its tokens after them: ``fault_after_tokens=0`` resets right after
          the opening events, before the first text delta;
        * ``"stream_error"``: a stream sends ``fault_after_tokens`` tokens,
          then an in-band error event in its API's shape and ends cleanly:
          chat and completions ``data: {"error": ...}`` and ``data: [DONE]``
          (as vLLM does), the Responses API ``event: error``, the Messages
          API ``event: error`` with ``overloaded_error`` (``fault_status``
          503 or 529) or ``api_error``. Any other answer gets the ``"5xx"``
          fault instead;
        * ``"stall"``: read the request, then never answer until the client
          goes away or the region stops;
        * ``"stall_body"``: send the headers and the first body unit, then
          stall the same way;
        * ``"slow_headers"``: wait ``slow_headers_delay`` more before the
          headers, then answer normally;
        * ``"goaway"``: the ``goaway_after``-th request on a connection is
          answered normally and then ends the connection: on HTTP/2 a
          GOAWAY(NO_ERROR) follows its response, naming the highest stream
          accepted so far as the last one processed; the streams still in
          flight are answered, later ones are refused with
          RST_STREAM(REFUSED_STREAM), and the connection is closed when the
          last stream is done. On HTTP/1.1 the response carries
          ``Connection: close``.
    ``fault_rate``
        Probability that a request gets the fault (the region's ``seed``
        makes the draw repeatable).
    ``fault_status``
        Status for ``"5xx"``; any 400-599 (429 included) is accepted.
    ``fault_retry_after``
        ``None``, or the ``Retry-After`` value (seconds or an HTTP date) a ``"5xx"``
        answer carries, as a region out of capacity sends it.
    ``fault_count``
        ``None`` for every request, or how many more requests get the fault: each one
        that does counts down, and at 0 the fault turns itself off (``fault`` None). A
        fault that comes once (``1``), then the region recovers.
    ``fault_paths``
        ``None`` for every path, or the path prefixes the fault applies to,
        e.g. ``("/v1/",)`` to keep ``/healthz`` answering.
    ``fault_body``
        ``None`` for every request, or a text the request body must contain for the
        fault to apply: a region that fails only some clients' requests (a server
        answering 500 to a malformed body, say), while it serves everyone else.
    ``fault_after_tokens_random``
        ``True``: a ``"reset"`` comes after a number of tokens drawn
        uniformly from 1 to the answer's tokens minus one (at least 1), by
        the region's seeded generator, instead of ``fault_after_tokens``: a
        stream always breaks after its first token and before its last.

    Realtime sessions (a WebSocket to a path ending ``/realtime``; see
    :mod:`edgeproxy.testing._realtime`) read ``ttft``, ``inter_token_delay`` and ``tokens``
    at each ``response.create``: ``ttft`` before a response's first delta,
    ``inter_token_delay`` between two. The faults above do not apply to them; these do:

    ``realtime_refuse``
        ``None``, or an HTTP status (400-599) that answers every Realtime handshake instead
        of the upgrade, with an OpenAI error body (and ``Retry-After`` from
        ``fault_retry_after`` when that is set): 401, 429, 503...
    ``realtime_accept_delay``
        Seconds a handshake waits before it is answered (accepted or refused), for
        connect-timeout tests; a client that leaves meanwhile opens no session.
    ``realtime_fault``
        ``None`` or one of, applied to every response that starts while it is set, after
        ``realtime_fault_after_deltas`` deltas (a text delta, an audio delta with its
        transcript delta, or a piece of a function call's arguments; ``0``: right after the
        response's opening events; past the last delta: before the closing events):

        * ``"close"``: close the session abnormally, code 1011 (internal error);
        * ``"drop"``: close the TCP connection without a close frame (the client sees
          1006); on HTTP/2 reset the session's stream;
        * ``"stall"``: send nothing more, ever, while the socket stays open and the
          region keeps reading, until the client leaves or the region stops.
    ``realtime_fault_after_deltas``
        Where ``realtime_fault`` strikes (2 by default).

    Continuations (chat completions, as vLLM and llama.cpp serve them): a
    request whose last message has ``role: assistant`` asks for the rest of
    that answer. With ``"continue_final_message": true`` (vLLM's switch,
    which vLLM refuses unless ``"add_generation_prompt": false`` comes with
    it, and so does the fake) or with no such flag (llama.cpp's prefill),
    the region answers with the rest of the deterministic answer to the
    conversation without that last message, so a partial answer followed by
    its continuation equals the unbroken answer. As in vLLM, the
    continuation's ``max_tokens`` (or ``max_completion_tokens``) counts the
    new tokens only: a partial answer of *k* tokens of an answer asked with
    ``max_tokens = n`` is continued with ``max_tokens = n - k`` (a repeated
    overlap counts against it too). Without a limit, the continuation ends
    where an unlimited answer does, after ``tokens`` tokens in all. A
    partial answer that ends inside a token is continued from the rest of
    that token. A partial answer that is not a prefix of the region's answer
    is continued after as many tokens as it has words. The usage counts the
    partial answer in ``prompt_tokens`` and the continued tokens alone in
    ``completion_tokens``.

    ``continuation_overlap``
        A continuation first repeats the last this many tokens of the
        partial answer (0 by default), as some servers do; the client (the
        proxy) must trim the repeated text.
    """

    ttft: float = 0.0
    inter_token_delay: float = 0.0
    tokens: int = 8
    fault: Fault | None = None
    fault_rate: float = 1.0
    fault_status: int = 503
    fault_after_tokens: int = 2
    fault_paths: tuple[str, ...] | None = None
    fault_body: str | None = None
    slow_headers_delay: float = 1.0
    goaway_after: int = 1
    ttft_per_uncached_token: float = 0.0
    ttft_per_cached_token: float = 0.0
    load_metrics_fault: LoadMetricsFault | None = None
    fault_after_tokens_random: bool = False
    continuation_overlap: int = 0
    fault_retry_after: str | None = None
    fault_count: int | None = None
    realtime_refuse: int | None = None
    realtime_accept_delay: float = 0.0
    realtime_fault: RealtimeFault | None = None
    realtime_fault_after_deltas: int = 2

    def __setattr__(self, name: str, value: object) -> None:
        validator = _VALIDATORS.get(name)
        if validator is not None:
            value = validator(name, value)
        object.__setattr__(self, name, value)

    def copy(self, **changes: Any) -> Behavior:
        """Return a validated copy with ``changes`` applied."""
        unknown = set(changes) - set(_VALIDATORS)
        if unknown:
            raise AttributeError(f"unknown Behavior field(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values (``fault_paths`` as a list)."""
        data = dataclasses.asdict(self)
        if self.fault_paths is not None:
            data["fault_paths"] = list(self.fault_paths)
        return data

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """The names accepted by :meth:`copy` and by ``POST /_control``."""
        return frozenset(_VALIDATORS)

    def applies_to(self, path: str) -> bool:
        """Whether ``fault_paths`` covers ``path``."""
        return self.fault_paths is None or any(path.startswith(p) for p in self.fault_paths)


def behavior_from_mapping(base: Behavior, changes: Mapping[str, object]) -> Behavior:
    """Apply a JSON object of field changes to ``base``; raise ``ValueError`` on bad input."""
    try:
        return base.copy(**dict(changes))
    except (AttributeError, TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from exc
