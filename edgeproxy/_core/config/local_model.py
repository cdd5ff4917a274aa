"""The local fallback model: ``[local_model]``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from edgeproxy._core.config.base import Section
from edgeproxy._core.config.kinds import Count, CountOrZero, NonNegative
from edgeproxy._core.config.models import ModelNames

__all__ = ["LocalModelConfig"]


class LocalModelConfig(Section):
    """The local llama.cpp model that answers when no region can (the ``local`` extra)."""

    path: str | None = Field(
        None,
        description="GGUF model file; unset turns the local model off. A relative path "
        "resolves against the config file's folder.",
    )
    n_gpu_layers: int = Field(
        0,
        ge=-1,
        description="Layers offloaded to the GPU (needs llama-cpp-python built with CUDA); "
        "-1 offloads all, 0 runs on the CPU.",
    )
    n_ctx: int = Field(
        4096, ge=64, description="Context window in tokens: the prompt plus the answer."
    )
    n_threads: int | None = Field(
        None, ge=1, description="CPU threads per generation; unset lets llama.cpp choose."
    )
    n_batch: Count = Field(512, description="Prompt tokens evaluated per batch.")
    chat_format: str = Field(
        "",
        description="Chat template: empty uses the model's own (GGUF tokenizer.chat_template); "
        "else a llama-cpp-python format name such as 'chatml', 'llama-3' or 'gemma'.",
    )
    max_tokens: Count = Field(
        512,
        description="Most tokens in one answer; a request asking for more gets this many.",
    )
    model_name: str = Field(
        "", description="Model name in answers; empty means 'local/<file name without .gguf>'."
    )
    models: ModelNames = Field(
        default_factory=list,
        description="The client model names (exact, or fnmatch globs) the local model may "
        "answer for; a request for another model gets the next rung of the ladder.",
    )
    serve_all_models: bool | None = Field(
        None,
        description="Answer for every model, whatever it is named. Unset: true when models "
        "is empty, false when it lists any.",
    )
    concurrency: Count = Field(
        1,
        description="Generations at once; each has its own llama.cpp context and worker thread.",
    )
    max_queue: CountOrZero = Field(
        16, description="Requests that may wait for a generation slot; more get 503 now."
    )
    max_queue_wait: NonNegative = Field(
        5.0,
        description="Seconds a request may wait for a generation slot before 503 with Retry-After.",
    )
    on_overflow: Literal["truncate", "refuse"] = Field(
        "truncate",
        description="A prompt longer than the context allows: 'truncate' drops the oldest "
        "messages (then tokens), 'refuse' answers 400 context_length_exceeded.",
    )
    ready_requires_model: bool = Field(
        False,
        description="Keep /readyz at 503 until the local model is loaded (and while it failed).",
    )

    @field_validator("serve_all_models")
    @classmethod
    def _check_serve_all(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        models = info.data.get("models")
        if value is True and models:
            raise ValueError("is true while models lists names: keep one of the two")
        if value is False and models == []:
            raise ValueError("is false and models lists none: the local model would answer nothing")
        return value

    @property
    def answers_every_model(self) -> bool:
        """Whether the local model answers whatever model a request names."""
        if self.serve_all_models is None:
            return not self.models
        return self.serve_all_models

    @model_validator(mode="after")
    def _answer_fits(self) -> LocalModelConfig:
        if self.max_tokens >= self.n_ctx:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must be smaller than n_ctx ({self.n_ctx}), "
                "leaving room for the prompt"
            )
        return self
