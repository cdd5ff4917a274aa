"""Embedders of the semantic cache: text in, L2-normalised float32 rows out.

* :class:`StaticEmbedder`: wordllama's 256-dimension static model, whose weights and
  tokenizer ship inside its wheel. It is loaded from those files, explicitly: wordllama's
  own loader looks for the tokenizer elsewhere and then tries to download it, and the
  proxy must start offline. One short question embeds in tens of microseconds, so it runs
  on the event loop.

Both raise :class:`EmbedderError` for what goes wrong, so the cache can skip a lookup
without knowing the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgeproxy._core.config import CacheConfig

__all__ = ["Embedder", "EmbedderError", "StaticEmbedder", "make_embedder"]


class EmbedderError(RuntimeError):
    """An embedder could not load, or could not embed."""


class Embedder(Protocol):
    name: str
    dimensions: int

    async def embed(self, texts: list[str]) -> Any:
        """One L2-normalised float32 row per text (a numpy array)."""


def _normalised(rows: Any) -> Any:
    rows = np.asarray(rows, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return rows / norms


class StaticEmbedder:
    """wordllama's static model (``l2_supercat``, 256 dimensions), from its wheel's files."""

    name = "wordllama-l2_supercat-256"
    dimensions = 256

    def __init__(self) -> None:
        try:
            import wordllama
            from safetensors import safe_open
            from tokenizers import Tokenizer
            from wordllama.inference import WordLlamaInference
        except ImportError as exc:
            raise EmbedderError(
                "the static embedder needs wordllama (pip install 'edgeproxy[semantic]')"
            ) from exc
        root = Path(wordllama.__file__).parent
        weights = root / "weights" / "l2_supercat_256.safetensors"
        vocabulary = root / "tokenizers" / "l2_supercat_tokenizer_config.json"
        if not weights.is_file() or not vocabulary.is_file():
            raise EmbedderError(f"wordllama's model files are not in {root}")
        tokenizer = Tokenizer.from_file(str(vocabulary))
        with safe_open(str(weights), framework="np", device="cpu") as f:
            table = f.get_tensor("embedding.weight")
        self._model = WordLlamaInference(table, tokenizer, binary=False)

    async def embed(self, texts: list[str]) -> Any:
        try:
            return _normalised(self._model.embed(texts, norm=True))
        except Exception as exc:  # noqa: BLE001 - any failure of the model is one error
            raise EmbedderError(f"wordllama failed: {exc}") from exc


def make_embedder(config: CacheConfig, base_dir: Path | None) -> Embedder:
    """The embedder ``[cache] semantic_embedder`` names; raises :class:`EmbedderError`."""
    del base_dir  # for embedders that load a model file
    return StaticEmbedder()
