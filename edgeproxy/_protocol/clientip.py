"""Who the client is: the peer, or, behind trusted proxies, the address they saw.

The pipeline resolves each request's client once, as it enters, from the
one list ``[server] trusted_proxies`` (:func:`client_ip_resolver`), into
``ctx.client_ip``, with ``ctx.peer`` the connection's own address and
``ctx.peer_trusted`` whether it is a trusted proxy. Everything that needs the
client's address or must decide whether to believe what a peer says about it
reads those: the per-IP rate limits, client geo, the access log and plugins
such as ``geo_tenant``.

The default is to trust nobody: with no trusted networks configured the peer
is the client, and nothing it says about other addresses (``X-Forwarded-For``,
a CDN's country or location headers) is believed. A proxy reachable only
through a CDN or a load balancer lists their networks to be told more.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

__all__ = ["ClientIPResolver", "client_ip_resolver"]

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# X-Forwarded-For hops examined, right to left, before giving up: the walk
# stops at the first untrusted hop, so only a chain of this many trusted
# proxies would reach it.
MAX_HOPS: Final = 32
# Longer than any address a proxy writes ("[v6%zone]:port"): not parsed at all.
_MAX_HOP_LEN: Final = 64


class ClientIPResolver:
    """Finds the client's address from the peer and ``X-Forwarded-For``.

    ``trusted`` lists the addresses or CIDR networks (``"10.0.0.0/8"``,
    ``"::1"``) of the proxies in front of this one; they are parsed once,
    here, and a bad entry is a ``ValueError``. Empty (the default) trusts
    nobody.

    :meth:`resolve` reads ``X-Forwarded-For`` right to left, each hop having
    been appended by the proxy before it, and returns the first hop outside
    the trusted networks: hops to its left were written by the client and
    prove nothing. A peer outside the trusted networks is the client itself,
    and its headers are not believed.
    """

    __slots__ = ("networks",)

    def __init__(self, trusted: Iterable[object] = ()) -> None:
        networks: list[_Network] = []
        for entry in trusted:
            if not isinstance(entry, str):
                raise ValueError(f"{entry!r} is not an IP address or CIDR network")
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                raise ValueError(f"{entry!r} is not an IP address or CIDR network") from None
        self.networks: tuple[_Network, ...] = tuple(networks)

    def __repr__(self) -> str:
        return f"ClientIPResolver({[str(n) for n in self.networks]!r})"

    def _trusted(self, address: _Address) -> bool:
        return any(address in network for network in self.networks)

    def trusts(self, peer: str | None) -> bool:
        """Whether ``peer`` is a trusted proxy, whose headers about the client are believed."""
        if not self.networks or not peer:
            return False
        known = _peer(peer)
        return known is not None and self._trusted(known[0])

    def resolve(self, peer: str | None, forwarded_for: Iterable[str] = ()) -> str | None:
        """The client's address; None when the peer is unknown.

        ``peer`` is the address of the connection (``request.remote``) and
        ``forwarded_for`` the ``X-Forwarded-For`` values in the order they
        came. From a trusted peer, the rightmost hop outside the trusted
        networks is the client; if every hop is trusted, the leftmost one.
        A hop that is not an address ends the walk at the last trusted hop,
        since a trusted proxy would not have written it. Addresses come back
        normalized: no port, no IPv6 zone, IPv4-mapped IPv6 as IPv4.

        A peer that is not an IP address (a Unix socket) comes back as it is,
        never trusted.
        """
        return self.resolve_peer(peer, forwarded_for)[0]

    def resolve_peer(
        self, peer: str | None, forwarded_for: Iterable[str] = ()
    ) -> tuple[str | None, bool]:
        """:meth:`resolve`'s address, and whether ``peer`` is trusted (:meth:`trusts`), at the
        cost of one look at the peer: what the pipeline asks of every request."""
        if not peer:
            return None, False
        if not self.networks:
            # Nobody is trusted: the peer as the parse normalizes it, looked up first (peers
            # repeat, one per connection).
            text = _PLAIN.get(peer)
            if text is None:
                known = _peer(peer)
                text = peer if known is None else known[1]
                if len(_PLAIN) >= _PLAIN_MAX:
                    _PLAIN.clear()
                _PLAIN[peer] = text
            return text, False
        known = _peer(peer)
        if known is None:
            return peer, False
        address, text = known
        if not self.networks or not self._trusted(address):
            return text, False
        current = address
        for hop in _hops(forwarded_for):
            parsed = _parse_hop(hop)
            if parsed is None:
                break
            current = parsed
            if not self._trusted(parsed):
                break
        return (text if current is address else str(current)), True


_NOBODY: Final = ClientIPResolver()

# Peers normalized for a resolver that trusts nobody: bounded, emptied when full.
_PLAIN: dict[str, str] = {}
_PLAIN_MAX = 4096


def client_ip_resolver(trusted: Sequence[str]) -> ClientIPResolver:
    """The resolver of ``trusted`` (``[server] trusted_proxies``, already checked); the
    pipeline builds one per config."""
    return ClientIPResolver(trusted) if trusted else _NOBODY


# Peers are the addresses of connections, so they repeat: parsing one costs more than
# looking it up. Hops of X-Forwarded-For, which a client writes, never come here.
@functools.lru_cache(maxsize=4096)
def _peer(peer: str) -> tuple[_Address, str] | None:
    """``peer`` parsed and written back normalized; None if it is not an IP address."""
    address = parse_address(peer)
    return None if address is None else (address, str(address))


def parse_address(value: str | None) -> _Address | None:
    """``value`` as an IP address, without IPv6 zone, IPv4-mapped as IPv4; None if not one."""
    if not value:
        return None
    try:
        address = ipaddress.ip_address(value.strip().split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _hops(values: Iterable[str]) -> Iterator[str]:
    """``X-Forwarded-For`` hops right to left, empty ones skipped, at most ``MAX_HOPS``."""
    seen = 0
    for value in reversed(list(values)):
        for hop in reversed(value.split(",")):
            hop = hop.strip(" \t")
            if not hop:
                continue  # an empty list element (RFC 9110 §5.6.1): ignored
            yield hop
            seen += 1
            if seen >= MAX_HOPS:
                return


def _parse_hop(hop: str) -> _Address | None:
    """One hop as an address. Forms seen in the wild: ``1.2.3.4``, ``1.2.3.4:5678``,
    ``2001:db8::1``, ``[2001:db8::1]`` and ``[2001:db8::1]:443``."""
    if len(hop) > _MAX_HOP_LEN:
        return None
    if hop.startswith("["):
        end = hop.find("]")
        if end < 0:
            return None
        host, port = hop[1:end], hop[end + 1 :]
        if port and not (port.startswith(":") and _is_port(port[1:])):
            return None
    elif hop.count(":") == 1:
        host, _, port = hop.partition(":")
        if not _is_port(port):
            return None
    else:
        host = hop
    if not host or host != host.strip():
        return None
    return parse_address(host)


def _is_port(value: str) -> bool:
    return 0 < len(value) <= 5 and value.isascii() and value.isdigit()
