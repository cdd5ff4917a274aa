"""Token usage of OpenAI-style answers, picked out as the body streams past."""

from __future__ import annotations

from typing import Any

import orjson

from edgeproxy._protocol.endpoints import endpoint_has

__all__ = ["UsageTracker"]

# A JSON answer longer than this is not kept for usage parsing.
_JSON_LIMIT = 1024 * 1024


class UsageTracker:
    """Finds the ``usage`` object in a JSON answer or an SSE stream, without delaying it.

    For SSE only lines that mention ``"usage"`` are parsed (OpenAI sends it
    in the last chunk when ``stream_options.include_usage`` is set); for
    JSON the body is kept up to 1 MiB and parsed at the end.
    """

    __slots__ = ("_sse", "_buf", "_usage", "_overflow")

    def __init__(self, *, sse: bool) -> None:
        self._sse = sse
        self._buf = b""
        self._usage: dict[str, Any] | None = None
        self._overflow = False

    @classmethod
    def for_response(cls, path: str, content_type: str, status: int) -> UsageTracker | None:
        if status != 200 or not endpoint_has(path, "usage"):
            return None
        if content_type.startswith("text/event-stream"):
            return cls(sse=True)
        if "json" in content_type:
            return cls(sse=False)
        return None

    def feed(self, chunk: bytes) -> None:
        if not self._sse:
            if not self._overflow:
                if len(self._buf) + len(chunk) > _JSON_LIMIT:
                    self._overflow = True
                    self._buf = b""
                else:
                    self._buf += chunk
            return
        data = self._buf + chunk if self._buf else chunk
        # find(), not `in`: for bytes it is about half the cost, once per streamed chunk.
        if data.find(b'"usage"') < 0:
            # Keep only a possibly unfinished last line.
            cut = data.rfind(b"\n")
            self._buf = data[cut + 1 :] if cut >= 0 else data
            if len(self._buf) > _JSON_LIMIT:
                self._buf = b""
            return
        lines = data.split(b"\n")
        self._buf = lines.pop()
        for line in lines:
            if line.startswith(b"data:") and b'"usage"' in line:
                self._take(line[5:].strip())

    def _take(self, raw: bytes) -> None:
        try:
            event = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return
        if isinstance(event, dict) and isinstance(event.get("usage"), dict):
            self._usage = event["usage"]

    def result(self) -> dict[str, Any] | None:
        if not self._sse and not self._overflow and self._buf:
            self._take(self._buf)
            self._buf = b""
        return self._usage
