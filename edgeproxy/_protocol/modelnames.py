"""Model names: matching a request's model against a list, renaming it in answers, and
reading a server's list of models.

:class:`ModelMatcher` answers "is this model in the list" with a set lookup
for the exact names and compiled ``fnmatch`` globs for the others.
:func:`parse_model_list` reads a ``GET /v1/models`` answer.
:class:`ModelRewriter` renames the model in a region's answer, JSON or SSE,
as it streams: a byte-level replace of the ``"model":"<name>"`` member (with
or without a space after the colon), safe across chunk boundaries.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import AsyncIterator, Iterable
from typing import Any, Final

import orjson

from edgeproxy._core.config.models import is_model_glob

__all__ = [
    "MAX_MODEL_LIST_BYTES",
    "ModelListError",
    "ModelMatcher",
    "ModelRewriter",
    "model_from_body",
    "parse_model_list",
]

MAX_MODEL_LIST_BYTES: Final = 4 * 1024 * 1024
"""A ``/v1/models`` answer larger than this is not read."""
# Models read from one list at most.
_MAX_MODELS: Final = 10_000


class ModelListError(ValueError):
    """A ``/v1/models`` answer that is no list of models."""


def parse_model_list(body: bytes) -> list[dict[str, Any]]:
    """The models of a ``GET /v1/models`` answer in OpenAI's list shape
    (``{"data": [{"id": ...}, ...]}``): each entry with a non-empty string ``id``, and its
    ``created``, ``owned_by`` and ``max_model_len`` (vLLM's context window) kept when
    well-typed. Entries that are not models are skipped; raises :class:`ModelListError`
    for an answer that is no list."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ModelListError("its answer is not JSON") from None
    data = value.get("data") if isinstance(value, dict) else None
    if not isinstance(data, list):
        raise ModelListError("its answer has no list of models")
    models: list[dict[str, Any]] = []
    for item in data[:_MAX_MODELS]:
        if not isinstance(item, dict):
            continue
        model = item.get("id")
        if not isinstance(model, str) or not model:
            continue
        found: dict[str, Any] = {"id": model}
        created = item.get("created")
        if isinstance(created, int) and not isinstance(created, bool):
            found["created"] = created
        owned_by = item.get("owned_by")
        if isinstance(owned_by, str):
            found["owned_by"] = owned_by
        window = item.get("max_model_len")
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            found["max_model_len"] = window
        models.append(found)
    return models


def model_from_body(body: object) -> object:
    """The ``model`` member of a parsed JSON body, or None when there is none."""
    return body.get("model") if isinstance(body, dict) else None


class ModelMatcher:
    """A list of model names and globs: ``matcher.matches(name)``."""

    __slots__ = ("exact", "globs")

    def __init__(self, names: Iterable[str]) -> None:
        exact: set[str] = set()
        globs: list[re.Pattern[str]] = []
        for name in names:
            if is_model_glob(name):
                globs.append(re.compile(fnmatch.translate(name)))
            else:
                exact.add(name)
        self.exact = frozenset(exact)
        self.globs = tuple(globs)

    def matches(self, name: str) -> bool:
        if name in self.exact:
            return True
        return any(glob.match(name) for glob in self.globs)


class ModelRewriter:
    """Renames model ``old`` to ``new`` in an answer's bytes, chunk by chunk.

    Only the exact member ``"model":"<old>"`` (or ``"model": "<old>"``) is
    replaced; the names are JSON-encoded first, so quotes and backslashes in
    them match as they appear on the wire. A chunk that ends with the start of
    a possible match keeps that tail back until the next chunk (at most one
    pattern's length), so a match split across chunks is still replaced;
    :meth:`flush` returns what is left at the end of the body.
    """

    __slots__ = ("_pairs", "_longest", "_tail")

    def __init__(self, old: str, new: str) -> None:
        old_json, new_json = orjson.dumps(old), orjson.dumps(new)
        self._pairs = tuple(
            (b'"model"' + sep + old_json, b'"model"' + sep + new_json) for sep in (b":", b": ")
        )
        self._longest = max(len(pattern) for pattern, _ in self._pairs)
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of ``chunk`` (after any tail held back) that may be sent on, renamed."""
        data = self._tail + chunk if self._tail else chunk
        # Whole matches end no later than `done`; a partial one may only start after it.
        done = 0
        for pattern, _ in self._pairs:
            at = data.rfind(pattern)
            if at >= 0:
                done = max(done, at + len(pattern))
        cut = len(data)
        at = data.find(b'"', max(done, len(data) - self._longest + 1))
        while at >= 0:
            rest = data[at:]
            if any(pattern.startswith(rest) for pattern, _ in self._pairs):
                cut = at
                break
            at = data.find(b'"', at + 1)
        self._tail = data[cut:]
        out = data[:cut] if cut < len(data) else data
        if done:
            for pattern, replacement in self._pairs:
                out = out.replace(pattern, replacement)
        return out

    def flush(self) -> bytes:
        """The tail held back at the end of the body: never a whole match, sent as it is."""
        tail, self._tail = self._tail, b""
        return tail

    async def stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``chunks`` renamed, as they come; the tail held back comes last."""
        async for chunk in chunks:
            out = self.feed(chunk)
            if out:
                yield out
        tail = self.flush()
        if tail:
            yield tail
