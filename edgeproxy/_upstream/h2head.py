"""A response's decoded header block taken on its stream (:func:`block_steps`): h2's
stream steps for a 1xx, the final response or trailers, with every check that makes a
malformed response its stream's error.

A final response's head is read from its decoded header block the short way, for the
blocks a region sends on every answer: ``:status`` first, a final status, then regular
fields seen before. What :func:`~edgeproxy._http2.fields.parse_fields` would make of such a
block, without its checks of each field again; any other block gets ``None``, and
``parse_fields`` decides (a malformed block is its stream's error there).

A region sends the same few fields on every answer (``server``, ``content-type``...): each
(name, value) that passed the checks once is kept with its text, bounded since the peer
chooses them, and never for a field the peer marked never-indexed (a credential, a cookie).
"""

from __future__ import annotations

from typing import Any, Final

from edgeproxy._core.types import Headers
from edgeproxy._http2.engine import received_end_stream
from edgeproxy._http2.fields import Malformed, field_name, field_value, parse_fields
from edgeproxy._upstream.h2stream import Stream, set_head, set_response_headers

__all__ = ["block_steps", "final_head"]

# The final statuses, as a block writes them: three digits, 200 to 599.
_FINAL: Final[dict[bytes, int]] = {str(n).encode(): n for n in range(200, 600)}
# Checked fields, keyed by the decoder's (name, value, never indexed) triple.
_CHECKED: dict[tuple[bytes, bytes, bool], tuple[str, str]] = {}
_CHECKED_MAX: Final = 1024


def final_head(decoded: list[tuple[bytes, bytes, bool]]) -> tuple[int, Headers, int | None] | None:
    """The status, fields and Content-Length of a final response's decoded block, as
    ``parse_fields`` gives them; None where ``parse_fields`` must look (another status,
    another pseudo-header field, a field that fails a check, an odd Content-Length)."""
    if not decoded:
        return None
    name, value, _ = decoded[0]
    status = _FINAL.get(value) if name == b":status" else None
    if status is None:
        return None
    checked = _CHECKED
    headers: Headers = []
    length: int | None = None
    for field in decoded[1:]:
        text = checked.get(field)
        if text is None:
            name, value, sensitive = field
            if name[:1] == b":":
                return None
            try:
                text = (field_name(name), value.decode("utf-8", "surrogateescape"))
                field_value(name, value)
            except Malformed:
                return None
            if name == b"content-length":
                # Its number is the answer's, not the field's: read each time.
                if not value.isdigit():
                    return None
                parsed = int(value)
                if length is not None and parsed != length:
                    return None
                length = parsed
                headers.append(text)
                continue
            if not sensitive:
                if len(checked) >= _CHECKED_MAX:
                    checked.clear()
                checked[field] = text
        headers.append(text)
    return status, headers, length


def _pairs(decoded: list[tuple[bytes, bytes, bool]]) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value, _ in decoded]


def block_steps(
    stream: Stream, machine: Any, decoded: list[tuple[bytes, bytes, bool]], last: int
) -> tuple[str, bool]:
    """A decoded header block's steps on ``stream`` and on jh2's stream state ``machine``
    (``last``: END_STREAM came with it), as jh2 and the client's engine take them: why
    the block is malformed ("" where it is not), and whether the response ended."""
    # jh2's test for a 1xx: the first :status among the leading pseudo-header fields.
    informational = False
    for name, value, _ in decoded:
        if name == b":status":
            informational = value[:1] == b"1"
            break
        if name[:1] != b":":
            break
    try:
        if informational:
            if last:
                return "an informational (1xx) response ended the stream", False
            if machine.headers_received:
                return "an informational (1xx) response came after the final one", False
            parse_fields(_pairs(decoded), trailers=False)
            return "", False
        if machine.headers_received:
            if not last:
                return "trailers did not end the stream", False
            machine.trailers_received = True
            received_end_stream(machine)
            parse_fields(_pairs(decoded), trailers=True)
            return "", True
        machine.headers_received = True
        if last:
            received_end_stream(machine)
        head = final_head(decoded)
        if head is None:
            set_response_headers(stream, _pairs(decoded))
        else:
            set_head(stream, *head)
    except Malformed as exc:
        return str(exc), False
    return "", bool(last)
