"""A final response's head read from its decoded header block the short way, for the
blocks a region sends on every answer: ``:status`` first, a final status, then regular
fields seen before. What :func:`~edgeproxy._http2.fields.parse_fields` would make of such a
block, without its checks of each field again; any other block gets ``None``, and
``parse_fields`` decides (a malformed block is its stream's error there).

A region sends the same few fields on every answer (``server``, ``content-type``...): each
(name, value) that passed the checks once is kept with its text, bounded since the peer
chooses them, and never for a field the peer marked never-indexed (a credential, a cookie).
"""

from __future__ import annotations

from typing import Final

from edgeproxy._core.types import Headers
from edgeproxy._http2.fields import Malformed, field_name, field_value

__all__ = ["final_head"]

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
