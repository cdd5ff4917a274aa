"""The fake region's stored objects: conversations, files, batches and vector stores.

Minimal, but stateful as OpenAI's are: an object exists only in the region that made it,
and another region answers the API's own 404 for it. Each region keeps its own
:class:`ObjectStore`, emptied when it (re)starts, like its response store.

* ``POST /v1/conversations`` (``items``, ``metadata``) makes a ``conv_...``;
  ``GET``/``POST``/``DELETE /v1/conversations/{id}``, ``GET``/``POST .../items``,
  ``GET``/``DELETE .../items/{item_id}``. A Responses request with ``conversation``
  answers the conversation's items and then adds its input and answer to them
  (:mod:`edgeproxy.testing._responses`). Unknown: 404 ``Conversation with id '...' not
  found.``
* ``POST /v1/files`` (multipart: ``file``, ``purpose``) makes a ``file-...``;
  ``GET``/``DELETE /v1/files/{id}``, ``GET .../content`` (the bytes uploaded). Unknown:
  404 ``No such File object: ...`` (``param`` ``id``).
* ``POST /v1/batches`` (``input_file_id`` of this region, ``endpoint``,
  ``completion_window``) makes a ``batch_...``, which stays ``validating``;
  ``GET /v1/batches/{id}``, ``POST .../cancel``. Unknown: 404 ``No batch found with id
  '...'.``
* ``POST /v1/vector_stores`` (``name``, ``file_ids`` of this region, ``metadata``) makes a
  ``vs_...``; ``GET``/``POST``/``DELETE /v1/vector_stores/{id}``, ``GET``/``POST
  .../files``, ``GET``/``DELETE .../files/{file_id}``, ``POST .../file_batches``,
  ``GET .../file_batches/{batch_id}``, ``POST .../search`` (the files whose text holds
  the query). Unknown: 404 ``No vector store found with id '...'.``

:meth:`ObjectStore.counters` counts the lookups of an id that found it and those that
did not (answered 404), whatever the kind.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from edgeproxy.testing._exchange import BadRequest, Exchange, Reply, json_reply, parse_json_object
from edgeproxy.testing._responses import read_input

__all__ = ["ObjectCounters", "ObjectStore", "route"]

_T = TypeVar("_T")

COLLECTIONS: Final = ("/v1/conversations", "/v1/files", "/v1/batches", "/v1/vector_stores")
"""The paths this module answers, and everything under them."""


def _now() -> int:
    return int(time.time())


@dataclass(slots=True)
class Conversation:
    object: dict[str, Any]
    items: list[dict[str, Any]] = field(default_factory=list)
    """Its items, oldest first, with ids (messages, and whatever else was given)."""
    messages: list[Any] = field(default_factory=list)
    """The same, as the chat messages a Responses request answers."""


@dataclass(slots=True)
class StoredFile:
    object: dict[str, Any]
    content: bytes


@dataclass(slots=True)
class VectorStore:
    object: dict[str, Any]
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    batches: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ObjectCounters:
    stored: int
    lookups_total: int
    lookup_misses_total: int


class ObjectStore:
    """A region's conversations, files, batches and vector stores, safe from any thread."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.conversations: dict[str, Conversation] = {}
        self.files: dict[str, StoredFile] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.vector_stores: dict[str, VectorStore] = {}
        self._lookups = 0
        self._misses = 0

    def clear(self) -> None:
        with self.lock:
            self.conversations.clear()
            self.files.clear()
            self.batches.clear()
            self.vector_stores.clear()

    def counters(self) -> ObjectCounters:
        with self.lock:
            stored = (
                len(self.conversations)
                + len(self.files)
                + len(self.batches)
                + len(self.vector_stores)
            )
            return ObjectCounters(stored, self._lookups, self._misses)

    def reset_counters(self) -> None:
        with self.lock:
            self._lookups = self._misses = 0

    def snapshot(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The objects by kind and id (copies)."""
        with self.lock:
            return {
                "conversations": {k: dict(v.object) for k, v in self.conversations.items()},
                "files": {k: dict(v.object) for k, v in self.files.items()},
                "batches": {k: dict(v) for k, v in self.batches.items()},
                "vector_stores": {k: dict(v.object) for k, v in self.vector_stores.items()},
            }

    # -- lookups (404 when missing) -------------------------------------------------------

    def _stored(self, table: dict[str, _T], key: str, missing: str, param: str | None = None) -> _T:
        """``table[key]``, counted as a lookup; a 404 saying ``missing`` when it is not there."""
        found = table.get(key)
        with self.lock:
            self._lookups += found is not None
            self._misses += found is None
        if found is None:
            raise BadRequest(missing, status=404, param=param)
        return found

    def conversation(self, conversation_id: str) -> Conversation:
        missing = f"Conversation with id '{conversation_id}' not found."
        return self._stored(self.conversations, conversation_id, missing)

    def file(self, file_id: str) -> StoredFile:
        return self._stored(self.files, file_id, f"No such File object: {file_id}", "id")

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self._stored(self.batches, batch_id, f"No batch found with id '{batch_id}'.")

    def vector_store(self, store_id: str) -> VectorStore:
        missing = f"No vector store found with id '{store_id}'."
        return self._stored(self.vector_stores, store_id, missing)

    # -- conversations, for the Responses API ---------------------------------------------

    def conversation_messages(self, conversation_id: str) -> list[Any]:
        with self.lock:
            return list(self.conversation(conversation_id).messages)

    def add_to_conversation(
        self, conversation_id: str, messages: list[Any], items: list[dict[str, Any]]
    ) -> None:
        """A response's input and answer, appended (if the conversation still exists)."""
        with self.lock:
            conversation = self.conversations.get(conversation_id)
            if conversation is not None:
                conversation.messages.extend(messages)
                conversation.items.extend(items)


# -- routes ---------------------------------------------------------------------------------


def route(ex: Exchange, body: bytes, store: ObjectStore) -> Reply:
    """A request under one of :data:`COLLECTIONS`."""
    parts = ex.path.strip("/").split("/")[1:]  # without "v1"
    collection, rest = parts[0], parts[1:]
    with store.lock:
        if collection == "conversations":
            return _conversations(ex, body, store, rest)
        if collection == "files":
            return _files(ex, body, store, rest)
        if collection == "batches":
            return _batches(ex, body, store, rest)
        return _vector_stores(ex, body, store, rest)


def _allow(ex: Exchange, *methods: str) -> None:
    if ex.method not in methods:
        raise BadRequest(f"method {ex.method} not allowed; use {' or '.join(methods)}", status=405)


def _no_route(ex: Exchange) -> BadRequest:
    return BadRequest(f"no route for {ex.method} {ex.path}", status=404)


def _json(body: bytes) -> dict[str, Any]:
    return parse_json_object(body) if body.strip() else {}


def _metadata(request: dict[str, Any]) -> dict[str, Any]:
    metadata = request.get("metadata")
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise BadRequest("'metadata' must be an object", param="metadata")
    return metadata


def _page(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": False,
    }


def _deleted(object_id: str, kind: str) -> Reply:
    return json_reply(200, {"id": object_id, "object": kind, "deleted": True})


def _conversations(ex: Exchange, body: bytes, store: ObjectStore, rest: list[str]) -> Reply:
    if not rest:
        _allow(ex, "POST")
        request = _json(body)
        messages, items = read_input(request.get("items") or [])
        conversation_id = "conv_" + secrets.token_hex(24)
        obj = {
            "id": conversation_id,
            "object": "conversation",
            "created_at": _now(),
            "metadata": _metadata(request),
        }
        store.conversations[conversation_id] = Conversation(obj, items, messages)
        return json_reply(200, obj)
    conversation = store.conversation(rest[0])
    if len(rest) == 1:
        _allow(ex, "GET", "POST", "DELETE")
        if ex.method == "DELETE":
            del store.conversations[rest[0]]
            return _deleted(rest[0], "conversation.deleted")
        if ex.method == "POST":
            conversation.object["metadata"] = _metadata(_json(body))
        return json_reply(200, conversation.object)
    if rest[1] != "items" or len(rest) > 3:
        raise _no_route(ex)
    if len(rest) == 2:
        _allow(ex, "GET", "POST")
        if ex.method == "POST":
            messages, items = read_input(_json(body).get("items") or [])
            conversation.messages.extend(messages)
            conversation.items.extend(items)
            return json_reply(200, _page(items))
        return json_reply(200, _page(list(conversation.items)))
    _allow(ex, "GET", "DELETE")
    for index, item in enumerate(conversation.items):
        if item["id"] == rest[2]:
            if ex.method == "DELETE":
                del conversation.items[index]
                del conversation.messages[index]
                return json_reply(200, conversation.object)
            return json_reply(200, item)
    raise BadRequest(f"Item with id '{rest[2]}' not found.", status=404)


def _files(ex: Exchange, body: bytes, store: ObjectStore, rest: list[str]) -> Reply:
    if not rest:
        _allow(ex, "POST", "GET")
        if ex.method == "GET":
            return json_reply(200, _page([f.object for f in store.files.values()]))
        form = _form(ex.header(b"content-type"), body)
        upload = form.get("file")
        purpose = form.get("purpose")
        if upload is None:
            raise BadRequest("Missing required parameter: 'file'.", param="file")
        if purpose is None or not purpose[1]:
            raise BadRequest("Missing required parameter: 'purpose'.", param="purpose")
        file_id = "file-" + secrets.token_hex(11)
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": len(upload[1]),
            "created_at": _now(),
            "filename": upload[0] or "upload",
            "purpose": purpose[1].decode("utf-8", "replace"),
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        store.files[file_id] = StoredFile(obj, upload[1])
        return json_reply(200, obj)
    stored = store.file(rest[0])
    if len(rest) == 1:
        _allow(ex, "GET", "DELETE")
        if ex.method == "DELETE":
            del store.files[rest[0]]
            return _deleted(rest[0], "file")
        return json_reply(200, stored.object)
    if rest[1:] == ["content"]:
        _allow(ex, "GET")
        headers = [
            (b"content-type", b"application/octet-stream"),
            (b"content-length", str(len(stored.content)).encode()),
        ]
        return Reply(200, headers, [stored.content])
    raise _no_route(ex)


def _batches(ex: Exchange, body: bytes, store: ObjectStore, rest: list[str]) -> Reply:
    if not rest:
        _allow(ex, "POST", "GET")
        if ex.method == "GET":
            return json_reply(200, _page(list(store.batches.values())))
        request = _json(body)
        for key in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(request.get(key), str):
                raise BadRequest(f"Missing required parameter: '{key}'.", param=key)
        store.file(request["input_file_id"])
        created = _now()
        batch_id = "batch_" + secrets.token_hex(16)
        obj: dict[str, Any] = {
            "id": batch_id,
            "object": "batch",
            "endpoint": request["endpoint"],
            "errors": None,
            "input_file_id": request["input_file_id"],
            "completion_window": request["completion_window"],
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": created,
            "in_progress_at": None,
            "expires_at": created + 24 * 3600,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": _metadata(request),
        }
        store.batches[batch_id] = obj
        return json_reply(200, obj)
    batch = store.batch(rest[0])
    if len(rest) == 1:
        _allow(ex, "GET")
        return json_reply(200, batch)
    if rest[1:] == ["cancel"]:
        _allow(ex, "POST")
        if batch["status"] in ("validating", "in_progress"):
            batch["status"] = "cancelling"
            batch["cancelling_at"] = _now()
        return json_reply(200, batch)
    raise _no_route(ex)


def _vector_stores(ex: Exchange, body: bytes, store: ObjectStore, rest: list[str]) -> Reply:
    if not rest:
        _allow(ex, "POST", "GET")
        if ex.method == "GET":
            return json_reply(200, _page([v.object for v in store.vector_stores.values()]))
        request = _json(body)
        file_ids = request.get("file_ids") or []
        if not isinstance(file_ids, list) or not all(isinstance(f, str) for f in file_ids):
            raise BadRequest("'file_ids' must be an array of strings", param="file_ids")
        files = [store.file(file_id) for file_id in file_ids]
        created = _now()
        store_id = "vs_" + secrets.token_hex(16)
        name = request.get("name")
        obj = {
            "id": store_id,
            "object": "vector_store",
            "created_at": created,
            "name": name if isinstance(name, str) else "",
            "usage_bytes": 0,
            "file_counts": {},
            "status": "completed",
            "expires_after": None,
            "expires_at": None,
            "last_active_at": created,
            "metadata": _metadata(request),
        }
        vector_store = VectorStore(obj)
        for stored in files:
            _add_file(vector_store, stored)
        store.vector_stores[store_id] = vector_store
        return json_reply(200, obj)
    vector_store = store.vector_store(rest[0])
    action = rest[1] if len(rest) > 1 else ""
    if not action:
        _allow(ex, "GET", "POST", "DELETE")
        if ex.method == "DELETE":
            del store.vector_stores[rest[0]]
            return _deleted(rest[0], "vector_store.deleted")
        if ex.method == "POST":
            request = _json(body)
            if isinstance(request.get("name"), str):
                vector_store.object["name"] = request["name"]
            if "metadata" in request:
                vector_store.object["metadata"] = _metadata(request)
        return json_reply(200, vector_store.object)
    if action == "files" and len(rest) == 2:
        _allow(ex, "GET", "POST")
        if ex.method == "GET":
            return json_reply(200, _page(list(vector_store.files.values())))
        file_id = _json(body).get("file_id")
        if not isinstance(file_id, str):
            raise BadRequest("Missing required parameter: 'file_id'.", param="file_id")
        return json_reply(200, _add_file(vector_store, store.file(file_id)))
    if action == "files" and len(rest) == 3:
        _allow(ex, "GET", "DELETE")
        entry = vector_store.files.get(rest[2])
        if entry is None:
            raise BadRequest(
                f"No file found with id '{rest[2]}' in vector store '{rest[0]}'.", status=404
            )
        if ex.method == "DELETE":
            del vector_store.files[rest[2]]
            _count_files(vector_store)
            return _deleted(rest[2], "vector_store.file.deleted")
        return json_reply(200, entry)
    if action == "file_batches" and len(rest) == 2:
        _allow(ex, "POST")
        file_ids = _json(body).get("file_ids")
        if not isinstance(file_ids, list) or not all(isinstance(f, str) for f in file_ids):
            raise BadRequest("Missing required parameter: 'file_ids'.", param="file_ids")
        files = [store.file(file_id) for file_id in file_ids]
        for stored in files:
            _add_file(vector_store, stored)
        batch_id = "vsfb_" + secrets.token_hex(16)
        batch = {
            "id": batch_id,
            "object": "vector_store.files_batch",
            "created_at": _now(),
            "vector_store_id": rest[0],
            "status": "completed",
            "file_counts": _counts(len(files)),
        }
        vector_store.batches[batch_id] = batch
        return json_reply(200, batch)
    if action == "file_batches" and len(rest) == 3:
        _allow(ex, "GET")
        found = vector_store.batches.get(rest[2])
        if found is None:
            raise BadRequest(f"No file batch found with id '{rest[2]}'.", status=404)
        return json_reply(200, found)
    if action == "search" and len(rest) == 2:
        _allow(ex, "POST")
        query = _json(body).get("query")
        if not isinstance(query, str) or not query:
            raise BadRequest("Missing required parameter: 'query'.", param="query")
        return json_reply(200, _search(store, vector_store, query))
    raise _no_route(ex)


def _counts(completed: int) -> dict[str, int]:
    return {
        "in_progress": 0,
        "completed": completed,
        "failed": 0,
        "cancelled": 0,
        "total": completed,
    }


def _count_files(vector_store: VectorStore) -> None:
    obj = vector_store.object
    obj["file_counts"] = _counts(len(vector_store.files))
    obj["usage_bytes"] = sum(entry["usage_bytes"] for entry in vector_store.files.values())


def _add_file(vector_store: VectorStore, stored: StoredFile) -> dict[str, Any]:
    file_id = stored.object["id"]
    entry = {
        "id": file_id,
        "object": "vector_store.file",
        "created_at": _now(),
        "vector_store_id": vector_store.object["id"],
        "status": "completed",
        "usage_bytes": len(stored.content),
        "last_error": None,
        "attributes": {},
    }
    vector_store.files[file_id] = entry
    _count_files(vector_store)
    return entry


def _search(store: ObjectStore, vector_store: VectorStore, query: str) -> dict[str, Any]:
    words = query.lower().split()
    data = []
    for file_id in vector_store.files:
        stored = store.files.get(file_id)
        if stored is None:
            continue
        text = stored.content.decode("utf-8", "replace")
        hits = sum(word in text.lower() for word in words)
        if hits:
            data.append(
                {
                    "file_id": file_id,
                    "filename": stored.object["filename"],
                    "score": hits / len(words),
                    "attributes": {},
                    "content": [{"type": "text", "text": text}],
                }
            )
    data.sort(key=lambda hit: -hit["score"])
    return {
        "object": "vector_store.search_results.page",
        "search_query": [query],
        "data": data,
        "has_more": False,
        "next_page": None,
    }


def _form(content_type: bytes | None, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A ``multipart/form-data`` body's fields: name -> (file name, value)."""
    media, _, params = (content_type or b"").decode("latin-1").partition(";")
    if media.strip().lower() != "multipart/form-data":
        raise BadRequest("the body must be multipart/form-data")
    boundary = ""
    for param in params.split(";"):
        key, _, given = param.strip().partition("=")
        if key.lower() == "boundary":
            boundary = given.strip('"')
    if not boundary:
        raise BadRequest("the multipart body names no boundary")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in body.split(b"--" + boundary.encode("latin-1"))[1:]:
        if part.startswith(b"--"):
            break  # the closing delimiter
        head, sep, value = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            continue
        name: str | None = None
        filename: str | None = None
        for line in head.decode("utf-8", "replace").split("\r\n"):
            key, _, rest = line.partition(":")
            if key.strip().lower() != "content-disposition":
                continue
            for item in rest.split(";"):
                attr, _, raw = item.strip().partition("=")
                if attr == "name":
                    name = raw.strip('"')
                elif attr == "filename":
                    filename = raw.strip('"')
        if name is not None:
            fields[name] = (filename, value.removesuffix(b"\r\n"))
    return fields
