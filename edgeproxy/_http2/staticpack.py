"""HPACK header blocks (RFC 7541) written without the dynamic table: a field is an index
into the static table when the table holds it whole, otherwise a literal that is not
indexed (its name an index where the static table knows the name), its value a plain
string (no Huffman coding).

Such a block means the same to any decoder whatever its dynamic table holds, so a field's
encoding is a constant: each is computed once and looked up by ``(name, value)`` after
that, with no per-connection state to keep in step with the peer. The price is a few bytes
on the wire for fields a dynamic table would have indexed after their first request.
Sensitive fields (authorization, cookies) are never-indexed literals (§7.1.3), written each
time and never kept.

The one thing a peer asks of such an encoder: after it lowers its
SETTINGS_HEADER_TABLE_SIZE, the next block opens with a dynamic table size update
(§4.2, §6.3); :data:`TABLE_SIZE_ZERO` is one, to a table of nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final, cast

from jh2.hpack.table import HeaderTable
from mypy_extensions import mypyc_attr

__all__ = ["TABLE_SIZE_ZERO", "NeverIndexed", "encode_block", "encode_field"]

TABLE_SIZE_ZERO: Final = b"\x20"
"""A dynamic table size update to 0 (§6.3): always within what the peer allows."""

_STATIC: Final[tuple[tuple[bytes, bytes], ...]] = tuple(HeaderTable.STATIC_TABLE)
# The static table's indices start at 1; a name's first index is the one written.
_WHOLE: Final[dict[tuple[bytes, bytes], int]] = {
    field: index for index, field in reversed(list(enumerate(_STATIC, 1)))
}
_NAMES: Final[dict[bytes, int]] = {
    name: index for index, (name, _) in reversed(list(enumerate(_STATIC, 1)))
}
_NOT_INDEXED: Final = 0x00  # a literal without indexing (§6.2.2)
_NEVER_INDEXED: Final = 0x10  # a literal never indexed (§6.2.3)
# Encoded fields kept, keyed by name and value as text. Bounded, since values are the
# client's: emptied when full.
_ENCODED: dict[tuple[str, str], bytes] = {}
_ENCODED_MAX: Final = 2048


@mypyc_attr(native_class=False)
class NeverIndexed(tuple[str, str]):
    """A (name, value) field that :func:`encode_block` writes as a never-indexed literal:
    a plain tuple's subclass, built without a Python-level constructor."""

    __slots__ = ()


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (§5.1) in a ``prefix_bits`` prefix whose first byte's other
    bits are ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(data: bytes) -> bytes:
    """A string literal (§5.2), not Huffman coded."""
    return _integer(len(data), 7, 0) + data


def encode_field(name: bytes, value: bytes, sensitive: bool = False) -> bytes:
    """One header field's representation, using the static table alone."""
    if not sensitive:
        index = _WHOLE.get((name, value))
        if index is not None:
            return _integer(index, 7, 0x80)
    first = _NEVER_INDEXED if sensitive else _NOT_INDEXED
    index = _NAMES.get(name, 0)
    head = _integer(index, 4, first) if index else bytes((first,)) + _string(name)
    size = len(value)
    if size < 127:  # the usual value: its length one byte
        return head + bytes((size,)) + value
    return head + _string(value)


def encode_block(fields: Iterable[tuple[str, str]]) -> bytes:
    """The header block of ``fields`` (names in lower case). A field of a tuple subclass
    (:class:`NeverIndexed`, or hpack's ``NeverIndexedHeaderTuple``) is a never-indexed
    literal, encoded afresh each time and not kept: credentials, and values that change
    with every request."""
    encoded = _ENCODED
    parts = []
    # Each field as the object it is, read through an iterable of Any: from an iterable of
    # tuples the compiled build would unbox each into a plain tuple, and a never-indexed
    # field would be indexed and kept.
    for field in cast("Iterable[Any]", fields):
        name, value = field
        if type(field) is not tuple:
            parts.append(encode_field(name.encode(), value.encode(), True))
            continue
        part = encoded.get(field)
        if part is None:
            part = encode_field(name.encode(), value.encode())
            if len(encoded) >= _ENCODED_MAX:
                encoded.clear()
            encoded[field] = part
        parts.append(part)
    return b"".join(parts)
