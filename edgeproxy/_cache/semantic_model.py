"""The semantic cache's model verifier: an optional cross-check of a would-be hit by a
model the operator names (``[cache] semantic_model_verifier``), for deployments that can
afford one model call on each semantic hit.

It runs only once the rule verifier (:mod:`~edgeproxy._cache.semantic_verify`)
passed a candidate and its entry is fresh, so it can only turn a hit into a miss. The
model is asked, at temperature 0 for a few tokens, whether the two questions have the
same answer; ``yes`` keeps the hit, and anything else is a miss: ``no``, an answer that is
neither (``unclear``), a failure (``error``: no region serving the model, a status other
than 200, the local model not loaded or saturated) or no verdict within
``semantic_verifier_timeout`` (``timeout``). A fault here never fails the request: the
request goes upstream as on any miss.

Two askers:

* :class:`LocalAsker`: the proxy's own ``[local_model]``, through its slot queue (a
  verdict waits for a free generation slot, as a fallback answer does), on its worker
  threads.
* :class:`RegionAsker`: ``/v1/chat/completions`` of the regions that serve the model
  ``semantic_verifier_model`` (the model catalog decides, as for a request naming it;
  a region's alias for it is sent), over their warm pools, healthy endpoints first:
  the path the ``region`` embedder takes to ``/v1/embeddings``.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from edgeproxy._cache.regionpost import post_json
from edgeproxy._core.config import CacheConfig
from edgeproxy._upstream.endpoint import RegionEndpoints

if TYPE_CHECKING:
    from edgeproxy._local.binding import _Slot
    from edgeproxy._local.model import LocalModel
    from edgeproxy._local.request import GenerationRequest

__all__ = [
    "LocalAsker",
    "ModelVerifier",
    "RegionAsker",
    "VERDICTS",
    "make_model_verifier",
    "parse_verdict",
    "verifier_messages",
]

VERDICTS: Final = ("yes", "no", "unclear", "error", "timeout")
# "Yes" or "No" is one token in every tokenizer worth naming; a few more let a model that
# starts with a space, a quote or a newline still say it.
MAX_TOKENS: Final = 4
# Characters of each question put in the prompt: a long one is cut, as the rule verifier
# has compared the whole texts already and a local model's context is small.
QUESTION_CHARS: Final = 2000
CHAT_PATH: Final = "/v1/chat/completions"
_SYSTEM: Final = (
    "You check a cache. Two users asked a question each. Reply with one word: yes if one "
    "correct answer answers both questions exactly, no if anything in them (a negation, a "
    "number, a name, a direction, a language, a format) calls for a different answer."
)
_WORD = re.compile(r"[a-z]+")


class VerifierError(RuntimeError):
    """The model could not be asked, or did not answer."""


def verifier_messages(cached: str, asked: str) -> list[dict[str, str]]:
    """The chat messages asking whether ``cached``'s answer also answers ``asked``."""
    return [
        {"role": "system", "content": _SYSTEM},
        {
            "role": "user",
            "content": f"Question 1: {cached[:QUESTION_CHARS]}\n"
            f"Question 2: {asked[:QUESTION_CHARS]}\n"
            "Does the answer to question 1 answer question 2 exactly? Reply yes or no.",
        },
    ]


def parse_verdict(text: str) -> str:
    """``yes``, ``no`` or ``unclear``: the first word of a model's reply, whatever its case,
    quotes, markup or punctuation ("**Yes.**", " no,"); any other word is unclear."""
    word = _WORD.search(text.lower())
    if word is None:
        return "unclear"
    return word.group() if word.group() in ("yes", "no") else "unclear"


class Asker(Protocol):
    name: str

    async def ask(self, messages: list[dict[str, str]]) -> str:
        """The model's reply to ``messages`` (raises for any failure)."""


class ModelVerifier:
    """Asks a model whether two questions have the same answer, within ``timeout``;
    counts its verdicts and the time they took."""

    def __init__(
        self,
        asker: Asker,
        *,
        timeout: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.asker = asker
        self.timeout = timeout
        self.verdicts: Counter[str] = Counter({verdict: 0 for verdict in VERDICTS})
        self.seconds = 0.0
        self.seconds_max = 0.0
        self._clock = clock

    async def same(self, cached: str, asked: str) -> bool:
        """Whether the model says ``yes``; every other outcome is False (a miss)."""
        started = self._clock()
        try:
            async with asyncio.timeout(self.timeout):
                verdict = parse_verdict(await self.asker.ask(verifier_messages(cached, asked)))
        except TimeoutError:
            verdict = "timeout"
        except Exception:  # noqa: BLE001 - a failed verdict is a miss, never a failed request
            verdict = "error"
        elapsed = self._clock() - started
        self.seconds += elapsed
        self.seconds_max = max(self.seconds_max, elapsed)
        self.verdicts[verdict] += 1
        return verdict == "yes"

    def snapshot(self) -> dict[str, Any]:
        asked = sum(self.verdicts.values())
        return {
            "model": self.asker.name,
            "timeout": self.timeout,
            "verdicts": dict(self.verdicts),
            "seconds_sum": self.seconds,
            "ms_mean": round(1000 * self.seconds / asked, 3) if asked else 0.0,
            "ms_max": round(1000 * self.seconds_max, 3),
        }


class RegionAsker:
    """``/v1/chat/completions`` of the regions serving ``model``, over their warm pools.

    ``serving`` is the model catalog's answer for a model name (the names of the regions
    that serve it; None: every region), asked on each call, as learnt lists change."""

    def __init__(
        self,
        regions: Iterable[RegionEndpoints],
        model: str,
        serving: Callable[[str], frozenset[str] | None] | None = None,
    ) -> None:
        self.regions = list(regions)
        self.model = model
        self.serving = serving
        self.name = f"region:{model}"

    def _endpoints(self) -> list[tuple[Any, RegionEndpoints]]:
        served = self.serving(self.model) if self.serving is not None else None
        found = [
            (endpoint, region)
            for region in self.regions
            if served is None or region.name in served
            for endpoint in region.endpoints
        ]
        # Those up first, in the config's order otherwise (a stable sort).
        return sorted(found, key=lambda pair: pair[0].state == "down")

    def model_for(self, region: RegionEndpoints) -> str:
        """The name ``region`` is sent: its own, where it aliases the model (as the relay
        renames a request's)."""
        aliases = getattr(getattr(region, "config", None), "model_aliases", None) or {}
        name = aliases.get(self.model, self.model)
        return name if isinstance(name, str) else self.model

    async def ask(self, messages: list[dict[str, str]]) -> str:
        failure = f"no region serves {self.model!r}"
        for endpoint, region in self._endpoints():
            body = json.dumps(
                {
                    "model": self.model_for(region),
                    "messages": messages,
                    "temperature": 0,
                    "max_tokens": MAX_TOKENS,
                    "stream": False,
                }
            ).encode()
            headers = [
                ("content-type", "application/json"),
                ("accept", "application/json"),
                ("user-agent", "edgeproxy-semantic-cache"),
                *region.credential_headers,
            ]
            try:
                raw = await post_json(endpoint, headers, body, CHAT_PATH)
            except Exception as exc:  # noqa: BLE001 - the next endpoint, then an error
                failure = f"{region.name}: {type(exc).__name__}: {exc}"
                continue
            return _reply_of(raw)
        raise VerifierError(failure)


def _reply_of(raw: bytes) -> str:
    try:
        content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise VerifierError(f"not a chat completion ({exc})") from None
    if not isinstance(content, str):
        raise VerifierError("a chat completion without text")
    return content


class LocalAsker:
    """The proxy's ``[local_model]``: a generation slot from its queue, the prompt rendered
    with its chat template and a few tokens sampled greedily on its worker thread."""

    def __init__(self, model: LocalModel) -> None:
        self.model = model
        self.name = f"local:{model.model_name}"

    async def ask(self, messages: list[dict[str, str]]) -> str:
        from edgeproxy._local.request import parse_generation_request

        model = self.model
        if not model.ready or model._executor is None:
            raise VerifierError(f"the local model is {model.state}")
        req = parse_generation_request(
            CHAT_PATH, {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
        )
        slot = await model._acquire()
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        try:
            work = model._executor.submit(_generate, model, slot, req, stop)
        except BaseException:
            model._release(slot)
            raise

        def done(_: Any) -> None:
            # The slot comes back once the thread is done with its context, even when the
            # verdict was given up on (a timeout) before.
            try:
                loop.call_soon_threadsafe(model._release, slot)
            except RuntimeError:  # the loop closed: nobody waits for the slot
                pass

        work.add_done_callback(done)
        try:
            return await asyncio.wrap_future(work)
        finally:
            stop.set()


def _generate(model: LocalModel, slot: _Slot, req: GenerationRequest, stop: threading.Event) -> str:
    """Worker thread: a few tokens, greedily, for the verdict."""
    import llama_cpp

    from edgeproxy._local.prompt import prepare_prompt

    plan = prepare_prompt(model.config, slot, req)
    llm = slot.llm
    vocab = llm._model.vocab
    tokens: list[int] = []
    generator = llm.generate(plan.tokens, **req.sampling)
    try:
        for token in generator:
            if stop.is_set() or llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            tokens.append(token)
            if len(tokens) >= plan.budget:
                break
    finally:
        generator.close()
    text: str = llm.detokenize(tokens).decode("utf-8", "replace")
    return text


def make_model_verifier(
    config: CacheConfig,
    regions: Sequence[RegionEndpoints],
    *,
    local_model: LocalModel | None = None,
    serving: Callable[[str], frozenset[str] | None] | None = None,
) -> ModelVerifier | None:
    """The model verifier ``[cache] semantic_model_verifier`` asks for; None when off."""
    kind = config.semantic_model_verifier
    asker: Asker
    if kind == "local":
        if local_model is None:
            raise VerifierError("semantic_model_verifier 'local' needs the local model")
        asker = LocalAsker(local_model)
    elif kind == "region":
        asker = RegionAsker(regions, config.semantic_verifier_model, serving)
    else:
        return None
    return ModelVerifier(asker, timeout=config.semantic_verifier_timeout)
