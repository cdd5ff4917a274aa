"""A region's JSON answer over its warm pool, for the semantic cache's parts that ask a
region (the region embedder, the model verifier). Free of numpy, so that the plain
install imports the semantic cache's modules without the extra."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgeproxy._upstream.endpoint import Endpoint

__all__ = ["MAX_ANSWER_BYTES", "RegionAnswerError", "post_json"]

MAX_ANSWER_BYTES = 4 * 2**20
"""The most of a region's answer read."""


class RegionAnswerError(RuntimeError):
    """A region's answer that is no answer: another status than 200, or too large."""


async def post_json(
    endpoint: Endpoint,
    headers: list[tuple[str, str]],
    body: bytes,
    path: str = "/v1/embeddings",
) -> bytes:
    """POST ``body`` to ``path`` of ``endpoint`` over its warm pool; the answer's bytes
    (raises :class:`RegionAnswerError` for a status other than 200, or an answer too large).
    The model verifier asks a region's ``/v1/chat/completions`` through it too."""
    resp = await endpoint.pool.request(
        "POST",
        endpoint.base_path + path,
        headers,
        body,
        authority=endpoint.authority,
    )
    try:
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.aiter_bytes():
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise RegionAnswerError(f"answer over {MAX_ANSWER_BYTES} bytes")
            chunks.append(chunk)
    finally:
        await resp.aclose()
    if resp.status != 200:
        raise RegionAnswerError(f"status {resp.status}")
    return b"".join(chunks)
