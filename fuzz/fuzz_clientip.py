"""Fuzz the client-IP resolver on hostile ``X-Forwarded-For`` values.

Input: a first line of trusted networks separated by spaces (as
``trusted_proxies`` lists them), a second line with the peer address
(``request.remote``), then one ``X-Forwarded-For`` value per line (decoded
as aiohttp decodes header values, UTF-8 with surrogates for bad bytes).

Property: the constructor raises only ``ValueError``; ``trusts`` answers a
bool; ``resolve`` returns None for no peer, the peer itself when it is not
an IP address (a Unix socket), and otherwise a normalized IP address (no
port, no zone, IPv4-mapped IPv6 as IPv4) that is the peer's or one of the
hops', and the peer's own when the peer is not trusted.
"""

from __future__ import annotations

import ipaddress
import sys

from _harness import check, fuzz

from edgeproxy._protocol.clientip import ClientIPResolver, _parse_hop, parse_address


def _normalized(value: str) -> bool:
    address = ipaddress.ip_address(value)
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None or address.scope_id is not None:
            return False
    return str(address) == value


def test_one_input(data: bytes) -> None:
    lines = data.split(b"\n")
    trusted = lines[0].decode("utf-8", "replace").split(" ") if lines[0] else []
    peer = lines[1].decode("utf-8", "replace") if len(lines) > 1 else None
    forwarded = [line.decode("utf-8", "surrogateescape") for line in lines[2:]]
    try:
        resolver = ClientIPResolver(trusted)
    except ValueError:
        resolver = ClientIPResolver(t for t in trusted if _is_network(t))
    trusts = resolver.trusts(peer)
    check(type(trusts) is bool, "trusts", trusts)
    result = resolver.resolve(peer, forwarded)
    if not peer:
        check(result is None, "no peer but an address", result)
        return
    address = parse_address(peer)
    if address is None:
        check(result == peer, "a non-IP peer changed", peer, result)
        check(not trusts, "a non-IP peer trusted", peer)
        return
    check(type(result) is str and _normalized(result), "not a normalized address", result)
    if not trusts:
        check(result == str(address), "an untrusted peer's headers believed", peer, result)
        return
    hops = {str(a) for value in forwarded for hop in value.split(",") if (a := _hop(hop))}
    check(result == str(address) or result in hops, "an address nobody sent", result)


def _hop(hop: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    return _parse_hop(hop.strip(" \t"))


def _is_network(entry: str) -> bool:
    try:
        ClientIPResolver([entry])
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    fuzz(test_one_input, "edgeproxy._protocol.clientip")
    sys.exit(0)
