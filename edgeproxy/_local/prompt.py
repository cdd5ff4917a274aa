"""Fitting a request into a model context: the chat template rendered, the prompt
tokenized, and cut or refused when it overflows.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgeproxy._core.config import LocalModelConfig
from edgeproxy._local.binding import _Slot
from edgeproxy._local.request import GenerationRequest, _bad


@dataclass(slots=True)
class _Prepared:
    """A tokenized prompt and the generation plan for it."""

    tokens: list[int]
    budget: int
    stop: list[str]
    truncated: int


def prepare_prompt(config: LocalModelConfig, slot: _Slot, req: GenerationRequest) -> _Prepared:
    """Worker thread: render the chat template, tokenize, fit the context."""
    llm = slot.llm
    n_ctx: int = llm.n_ctx()
    cap = config.max_tokens
    # The answer's room: what was asked (capped), else what is left, up to the cap.
    reserve = min(req.max_tokens, cap) if req.max_tokens is not None else min(cap, n_ctx // 4)
    limit = n_ctx - reserve
    stop = list(req.stop)
    truncated = 0
    if req.chat:
        messages = list(req.messages)
        tokens, format_stop = _render(slot, messages)
        original = len(tokens)
        if len(tokens) > limit and config.on_overflow == "truncate":
            # Drop the oldest turns first, keeping system prompts and the last message.
            while len(tokens) > limit:
                drop = next((i for i, m in enumerate(messages[:-1]) if m["role"] != "system"), None)
                if drop is None:
                    break
                del messages[drop]
                tokens, format_stop = _render(slot, messages)
        stop += [s for s in format_stop if s and s not in stop]
        if req.prefix:
            # The answer's start, after the template opened the assistant's turn.
            tokens = tokens + llm.tokenize(req.prefix.encode("utf-8"), add_bos=False, special=False)
            original = len(tokens)
    else:
        if isinstance(req.prompt, list):
            n_vocab = llm.n_vocab()
            bad = next((t for t in req.prompt if not 0 <= t < n_vocab), None)
            if bad is not None:
                raise _bad(f"prompt: token id {bad} is outside the vocabulary (0..{n_vocab - 1})")
            tokens = list(req.prompt)
        else:
            tokens = llm.tokenize(req.prompt.encode("utf-8"), add_bos=True, special=False)
        original = len(tokens)
    if len(tokens) > limit:
        if config.on_overflow == "refuse":
            raise _bad(
                f"This model's maximum context length is {n_ctx} tokens. However, you "
                f"requested {original + reserve} tokens ({original} in the prompt, "
                f"{reserve} for the completion). Please reduce the prompt or max_tokens.",
                code="context_length_exceeded",
            )
        # Keep the end of the prompt (the question), and BOS if it had one.
        bos = llm.token_bos()
        head = [bos] if tokens and tokens[0] == bos and bos != -1 else []
        tokens = head + tokens[len(tokens) - (limit - len(head)) :]
    truncated = original - len(tokens)
    budget = min(reserve if req.max_tokens is not None else cap, n_ctx - len(tokens))
    return _Prepared(tokens=tokens, budget=max(1, budget), stop=stop, truncated=truncated)


def _render(slot: _Slot, messages: list[dict[str, str]]) -> tuple[list[int], list[str]]:
    try:
        result = slot.formatter(messages=messages)
    except Exception as exc:  # noqa: BLE001 - template errors are about the messages
        raise _bad(f"messages: the model's chat template refused them: {exc}") from None
    stop = result.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    tokens = slot.llm.tokenize(
        result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True
    )
    return tokens, stops
