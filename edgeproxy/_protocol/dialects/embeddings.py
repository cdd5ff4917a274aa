"""OpenAI's embeddings: never streamed, always deterministic, usage at the top."""

from __future__ import annotations

from typing import Any, ClassVar, Final

from edgeproxy._core.errors import ProxyError
from edgeproxy._protocol.dialects._base import Dialect

__all__ = ["EMBEDDINGS", "EmbeddingsDialect"]


class EmbeddingsDialect(Dialect):
    """``/v1/embeddings``: never streamed, always deterministic."""

    name = "embeddings"
    streams = False
    turns: ClassVar[str | None] = None
    prompt_keys: ClassVar[tuple[str, ...]] = ("input",)
    ranges: ClassVar[dict[str, tuple[float, float]]] = {}
    max_tokens_keys: ClassVar[tuple[str, ...]] = ()
    minimums: ClassVar[dict[str, int]] = {"dimensions": 1}
    types: ClassVar[dict[str, tuple[type, ...]]] = {
        "model": (str,),
        "input": (str, list),
        "encoding_format": (str,),
        "dimensions": (int,),
        "user": (str,),
    }

    def deterministic(self, body: dict[str, Any]) -> bool:
        return True

    def check(self, body: dict[str, Any]) -> ProxyError | None:
        err = super().check(body)
        if err is None:
            if body.get("input") is None:
                return self.invalid(
                    "Missing required parameter: 'input'.", "input", "missing_required_parameter"
                )
            if body.get("input") in ("", []):
                return self.invalid("'input' must not be empty.", "input", "empty_array")
        return err


EMBEDDINGS: Final = EmbeddingsDialect()
