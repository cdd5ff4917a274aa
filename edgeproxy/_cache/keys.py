"""Cache keys: who may share an entry, and the digest naming it.

The rule: a key covers everything forwarded to the region that can change the answer,
and nothing forwarded is ambiguous. So a POST's key covers its API (its dialect: a chat
and a Messages request never share an entry, whatever the ``edgeproxy_cache_key`` hook
says), its target (path and query string, as sent: Azure OpenAI picks the API version
there), its JSON body (Messages' ``system`` and the Responses API's ``instructions``
included) with non-semantic fields removed and keys in canonical order (bodies naming a
key twice are refused before this, since parsers disagree on which counts), the request
headers that select behaviour (:data:`~edgeproxy._protocol.headers.ANSWER_HEADERS`,
``anthropic-version`` and ``anthropic-beta`` among them, and ``[cache] vary_headers``,
every value of each), and its scope: the tenant, else a hash of every credential header
the client sent (``x-api-key``, Anthropic's, among them), else ``pub``. When client
credentials are forwarded, they are in the digest too, so even within a tenant an answer
made with one key is never served to another. Keys are blake2b digests: raw prompts and
credentials never appear in a backend's key names.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from edgeproxy._core.config import Config
from edgeproxy._core.context import RequestContext
from edgeproxy._protocol.endpoints import endpoint_paths, openai_endpoint
from edgeproxy._protocol.headers import ANSWER_HEADERS, CLIENT_CREDENTIAL_HEADERS

__all__ = [
    "CACHEABLE_PATHS",
    "NON_SEMANTIC_FIELDS",
    "KeyHeaders",
    "cache_scope",
    "custom_digest",
    "hash_key",
    "semantic_scope",
    "tenant_scope",
]

CACHEABLE_PATHS = endpoint_paths("cacheable")

# Fields that do not change the answer: who asked, how it is delivered, tracing ids.
NON_SEMANTIC_FIELDS = frozenset(
    {"user", "stream", "stream_options", "request_id", "metadata", "store", "service_tier"}
)


def hash_key(material: str | bytes) -> str:
    """A fixed-size, prompt-free key for ``material``."""
    data = material.encode() if isinstance(material, str) else material
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def _short_hash(material: str) -> str:
    return hashlib.blake2b(material.encode(), digest_size=8, person=b"edgeproxy").hexdigest()


# The credential headers in the order cache_scope tries them (sorted once, here).
_CREDENTIAL_ORDER = tuple(sorted(CLIENT_CREDENTIAL_HEADERS))


def tenant_scope(tenant: str) -> str:
    """The scope, and so the key prefix (``<scope>:``), of every entry of ``tenant``."""
    return "t" + _short_hash("tenant:" + tenant)


def cache_scope(ctx: RequestContext) -> str:
    """Who may share an entry: the tenant, else the credentials the client sent, else anyone.

    ``t…`` and ``k…`` are hashes, so neither tenant names nor credentials
    appear in key names. Every credential header counts, each with all its values: two
    clients share a scope only when they sent the same credentials.
    """
    if ctx.tenant:
        return tenant_scope(ctx.tenant)
    headers = ctx.headers
    material = ""
    for name in _CREDENTIAL_ORDER:
        if name in headers:
            # Length-prefixed: no value can pass for the end of another and a next header.
            for value in headers.getall(name):
                material += f"{name}:{len(value)}:{value}"
    if material:
        return "k" + _short_hash("credential:" + material)
    return "pub"


def _header_values(ctx: RequestContext, names: tuple[str, ...]) -> list[list[str]]:
    """``[[name, value], ...]`` for each of ``names`` (sorted) the request carries, every
    value of a repeated header in the order sent: exactly what is forwarded."""
    headers = ctx.headers
    out: list[list[str]] = []
    for name in names:
        if name in headers:
            out.extend([name, value] for value in headers.getall(name))
    return out


class KeyHeaders:
    """The request headers that are part of a POST's key digest: those that select
    behaviour (built in and ``[cache] vary_headers``), and the client's credentials when
    ``[server] forward_client_credentials`` sends them to the region."""

    __slots__ = ("names",)

    def __init__(self, config: Config) -> None:
        names = set(ANSWER_HEADERS) | set(config.cache.vary_headers)
        if config.server.forward_client_credentials:
            names |= CLIENT_CREDENTIAL_HEADERS
        self.names = tuple(sorted(names))


def _api(ctx: RequestContext) -> str:
    """The API a request speaks (its dialect's name, "" for plain HTTP): part of every
    POST's key, so that no two APIs share an entry, whatever names the digest."""
    facts = ctx.facts
    if facts is not None:
        return facts.dialect or ""
    # Before entry (a request shed by admission): the name its facts would have.
    endpoint = openai_endpoint(ctx.path)
    return endpoint.name if endpoint is not None else ""


def custom_digest(ctx: RequestContext, custom: object) -> str:
    """The digest of the key the ``edgeproxy_cache_key`` hook named, within the request's
    API: a hook's key for a chat request never names a Messages answer."""
    return hash_key(f"custom:{_api(ctx)}:{custom}")


def _post_digest(ctx: RequestContext, body: dict[str, Any], scope: str, headers: KeyHeaders) -> str:
    semantic = {k: v for k, v in body.items() if k not in NON_SEMANTIC_FIELDS}
    material = orjson.dumps(
        {
            # The API, and the whole target: the query string is forwarded and may pick
            # the API version.
            "api": _api(ctx),
            "target": ctx.target,
            "body": semantic,
            "headers": _header_values(ctx, headers.names),
            "scope": scope,
        },
        option=orjson.OPT_SORT_KEYS,
    )
    return hash_key(material)


def semantic_scope(ctx: RequestContext, rest: dict[str, Any], headers: KeyHeaders) -> str:
    """The semantic cache's scope for a request whose body, its last question taken out,
    is ``rest``: what the exact key covers but that question (tenant or credential, API,
    target, headers, everything else in the body)."""
    scope = cache_scope(ctx)
    return f"{scope}:sem:{_post_digest(ctx, rest, scope, headers)}"


def _get_digest(ctx: RequestContext, scope: str) -> str:
    # The proxy forwards these, and the answer may depend on them.
    material = orjson.dumps(
        {
            "method": "GET",
            "target": ctx.target,
            "accept": ctx.headers.get("accept", ""),
            "accept-encoding": ctx.headers.get("accept-encoding", ""),
            "scope": scope,
        },
        option=orjson.OPT_SORT_KEYS,
    )
    return hash_key(material)
