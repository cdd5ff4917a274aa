"""Embedders of the semantic cache: text in, L2-normalised float32 rows out.

* :class:`StaticEmbedder`: wordllama's 256-dimension static model, whose weights and
  tokenizer ship inside its wheel. It is loaded from those files, explicitly: wordllama's
  own loader looks for the tokenizer elsewhere and then tries to download it, and the
  proxy must start offline. One short question embeds in tens of microseconds, so it runs
  on the event loop.
* :class:`LlamaCppEmbedder`: a GGUF embedding model through llama-cpp-python, on a thread
  of its own (a model is not safe to call from two threads, and a forward pass must not
  block the loop).
* :class:`RegionEmbedder`: a region's ``/v1/embeddings``, over the region's own warm pool.

Each raises :class:`EmbedderError` for what goes wrong (and the model embedders give up
after ``semantic_embedder_timeout``), so the cache can skip a lookup without knowing the
model. Their dimensions are known once the first text is embedded.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgeproxy._cache.regionpost import post_json
from edgeproxy._core.config import CacheConfig
from edgeproxy._local.binding import new_llama
from edgeproxy._upstream.endpoint import RegionEndpoints

__all__ = [
    "Embedder",
    "EmbedderError",
    "LlamaCppEmbedder",
    "RegionEmbedder",
    "StaticEmbedder",
    "make_embedder",
]

# The most a region's embeddings answer may hold (a few questions' vectors).


class EmbedderError(RuntimeError):
    """An embedder could not load, or could not embed."""


class Embedder(Protocol):
    name: str

    async def embed(self, texts: list[str]) -> Any:
        """One L2-normalised float32 row per text (a numpy array)."""

    async def close(self) -> None:
        """Let go of threads and models."""


def _normalised(rows: Any) -> Any:
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2 or not rows.shape[1]:
        raise EmbedderError(f"embeddings of shape {rows.shape}, not one row per text")
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

    async def close(self) -> None:
        return None


def _pooled(vector: Any) -> Any:
    """One row for one text: a model without a pooling layer gives one row per token,
    averaged here."""
    rows = np.asarray(vector, dtype=np.float32)
    return rows.mean(axis=0) if rows.ndim == 2 else rows


class LlamaCppEmbedder:
    """A GGUF embedding model through llama-cpp-python, on one thread of its own."""

    def __init__(self, path: Path, *, timeout: float, n_ctx: int = 512) -> None:
        try:
            import llama_cpp
        except ImportError as exc:
            raise EmbedderError(
                "the gguf embedder needs llama-cpp-python (pip install 'edgeproxy[local]')"
            ) from exc
        if not path.is_file():
            raise EmbedderError(f"no GGUF file at {path}")
        self.name = f"gguf:{path.name}"
        self.timeout = timeout
        try:
            # n_ubatch = n_ctx: an embedding is computed in one batch. new_llama keeps
            # the model off ggml's AMX kernels where a GCC before 13 miscompiled them.
            self._model = new_llama(
                llama_cpp,
                model_path=str(path),
                embedding=True,
                n_ctx=n_ctx,
                n_batch=n_ctx,
                n_ubatch=n_ctx,
                n_threads=1,
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - a model that does not load is one error
            raise EmbedderError(f"llama.cpp could not load {path}: {exc}") from exc
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="edgeproxy-embed")

    def _embed(self, texts: list[str]) -> Any:
        with self._lock:
            return [_pooled(self._model.embed(text, truncate=True)) for text in texts]

    async def embed(self, texts: list[str]) -> Any:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                rows = await loop.run_in_executor(self._thread, self._embed, texts)
        except TimeoutError:
            raise EmbedderError(f"llama.cpp took more than {self.timeout:g}s") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the model is one error
            raise EmbedderError(f"llama.cpp failed: {exc}") from exc
        return _normalised(rows)

    async def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class RegionEmbedder:
    """A region's ``/v1/embeddings``, asked for ``model``, over the region's pools."""

    def __init__(self, region: RegionEndpoints, model: str, *, timeout: float) -> None:
        self.region = region
        self.model = model
        self.timeout = timeout
        self.name = f"region:{region.name}:{model}"

    async def embed(self, texts: list[str]) -> Any:
        body = json.dumps({"model": self.model, "input": texts}).encode()
        headers = [
            ("content-type", "application/json"),
            ("accept", "application/json"),
            ("user-agent", "edgeproxy-semantic-cache"),
            *self.region.credential_headers,
        ]
        endpoints = sorted(self.region.endpoints, key=lambda e: e.state == "down")
        failure = "no endpoint"
        try:
            async with asyncio.timeout(self.timeout):
                for endpoint in endpoints:
                    try:
                        raw = await post_json(endpoint, headers, body)
                    except Exception as exc:  # noqa: BLE001 - the next endpoint, then an error
                        failure = f"{type(exc).__name__}: {exc}"
                        continue
                    return _normalised(_embeddings_of(raw, len(texts)))
        except TimeoutError:
            failure = f"no answer within {self.timeout:g}s"
        raise EmbedderError(f"region {self.region.name}'s /v1/embeddings: {failure}")

    async def close(self) -> None:
        return None


def _embeddings_of(raw: bytes, count: int) -> list[Any]:
    """The vectors of an OpenAI-style embeddings answer, in input order."""
    try:
        data = json.loads(raw)["data"]
        rows = sorted(data, key=lambda item: item["index"])
        vectors = [row["embedding"] for row in rows]
    except (ValueError, KeyError, TypeError) as exc:
        raise EmbedderError(f"not an embeddings answer ({exc})") from None
    if len(vectors) != count:
        raise EmbedderError(f"{len(vectors)} embeddings for {count} inputs")
    return vectors


def make_embedder(
    config: CacheConfig, base_dir: Path | None, regions: Iterable[RegionEndpoints] = ()
) -> Embedder:
    """The embedder ``[cache] semantic_embedder`` names; raises :class:`EmbedderError`."""
    kind = config.semantic_embedder
    if kind == "gguf":
        path = Path(config.semantic_embedder_model).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        return LlamaCppEmbedder(path, timeout=config.semantic_embedder_timeout)
    if kind == "region":
        for region in regions:
            if region.name == config.semantic_embedder_region:
                return RegionEmbedder(
                    region,
                    config.semantic_embedder_model,
                    timeout=config.semantic_embedder_timeout,
                )
        raise EmbedderError(f"no region {config.semantic_embedder_region!r} to embed with")
    return StaticEmbedder()
