"""The OpenAI API's stored objects: what a server keeps, and how requests name it.

Five collections hold objects that exist only on the server that made them: Responses API
responses (``/v1/responses``), conversations (``/v1/conversations``), files
(``/v1/files``), batches (``/v1/batches``) and vector stores (``/v1/vector_stores``). A
request names one

* by its path, ``/v1/<collection>/{id}`` and anything under it (``/v1/files/{id}/content``,
  ``/v1/conversations/{id}/items/{item_id}``, ``/v1/vector_stores/{id}/search``...), with
  any method;
* by a field of its JSON body: a batch's ``input_file_id``, a vector store's ``file_ids``,
  a vector store file's ``file_id`` (:meth:`ObjectKind.body_refs`); the Responses API's
  fields (``previous_response_id``, ``conversation``) are its dialect's
  (:meth:`~edgeproxy._protocol.dialects.Dialect.state_refs`).

A ``POST`` to the collection itself creates one (a Responses request stores its answer as
its dialect says), and the answer's ``id`` names it. An id no server holds gets each
kind's own 404 (:meth:`ObjectKind.not_found`), as OpenAI words it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from edgeproxy._core.errors import ProxyError

__all__ = [
    "BATCHES",
    "CONVERSATIONS",
    "FILES",
    "KINDS",
    "RESPONSES",
    "VECTOR_STORES",
    "ObjectKind",
    "ObjectPath",
    "object_path",
]


@dataclass(frozen=True, slots=True)
class ObjectKind:
    """One collection of stored objects."""

    collection: str
    """Its path segment after ``/v1/``: ``files``."""
    message: str
    """The 404's message for an unknown id, ``{id}`` standing for it."""
    param: str | None = None
    """The 404's ``param``."""
    code: str | None = None
    """The 404's ``code``."""
    creates: bool = True
    """A ``POST`` to the collection itself creates one (the Responses API's dialect decides
    for its own)."""
    reserved: frozenset[str] = frozenset()
    """Names under the collection that are endpoints, not ids (``/v1/responses/compact``)."""
    refs: tuple[tuple[str, str], ...] = ()
    """Fields of a ``POST`` body under the collection that name other objects, as (field,
    the other kind's collection); a field may hold one id or a list of them."""

    def not_found(self, object_id: str) -> ProxyError:
        """The API's own 404 for ``object_id``, which no server holds."""
        return ProxyError(
            404,
            "invalid_request_error",
            self.message.format(id=object_id),
            code=self.code,
            param=self.param,
        )

    def body_refs(self, body: dict[str, Any]) -> list[tuple[str, str, ObjectKind]]:
        """The objects a ``POST`` body under the collection names: (field, id, kind)."""
        found: list[tuple[str, str, ObjectKind]] = []
        for field, collection in self.refs:
            value = body.get(field)
            values = value if isinstance(value, list) else [value]
            kind = KINDS[collection]
            for item in values[:_MAX_REFS]:
                if isinstance(item, str) and item:
                    found.append((field, item, kind))
        return found


# Ids named in one body that are looked up (a vector store made of 500 files names 500).
_MAX_REFS: Final = 500

RESPONSES: Final = ObjectKind(
    "responses",
    "Response with id '{id}' not found.",
    code="response_not_found",
    creates=False,
    reserved=frozenset({"input_tokens", "compact"}),
)
CONVERSATIONS: Final = ObjectKind("conversations", "Conversation with id '{id}' not found.")
FILES: Final = ObjectKind("files", "No such File object: {id}", param="id")
BATCHES: Final = ObjectKind(
    "batches", "No batch found with id '{id}'.", refs=(("input_file_id", "files"),)
)
VECTOR_STORES: Final = ObjectKind(
    "vector_stores",
    "No vector store found with id '{id}'.",
    refs=(("file_ids", "files"), ("file_id", "files")),
)

KINDS: Final[dict[str, ObjectKind]] = {
    kind.collection: kind for kind in (RESPONSES, CONVERSATIONS, FILES, BATCHES, VECTOR_STORES)
}

# "/v1/<collection>", then "/<id>" and anything under it, or nothing: "/openai/v1/files"
# (a prefix before /v1) is the same collection, "/v1/filesystem" is none.
_PATH: Final = re.compile(r"/v1/(" + "|".join(KINDS) + r")(?:/([^/]+)(?:/(.*))?)?/?$")


@dataclass(frozen=True, slots=True)
class ObjectPath:
    """A path in a collection of stored objects."""

    kind: ObjectKind
    object_id: str | None
    """The object the path names; None for the collection itself."""
    rest: str
    """What follows the id: ``""``, ``content``, ``items/msg_1``."""


# Paths already known to name no stored object (an LLM endpoint's, asked every request).
# Bounded, since paths come from clients: emptied when full.
_NONE: set[str] = set()
_NONE_MAX = 1024


def object_path(path: str) -> ObjectPath | None:
    """Where ``path`` (without its query) is among the stored objects, or None."""
    if path in _NONE:
        return None
    found = _object_path(path)
    if found is None:
        if len(_NONE) >= _NONE_MAX:
            _NONE.clear()
        _NONE.add(path)
    return found


def _object_path(path: str) -> ObjectPath | None:
    if "/v1/" not in path:
        return None
    match = _PATH.search(path)
    if match is None:
        return None
    kind = KINDS[match[1]]
    object_id = match[2]
    if object_id is not None and object_id in kind.reserved:
        return None
    return ObjectPath(kind, object_id, match[3] or "")
