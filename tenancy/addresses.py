"""The client's address: the TCP peer, unless the peer is a proxy the operator trusts.

Only when the peer is in ``trusted`` (IPs or CIDRs; none by default) is the configured header read:

* ``x-forwarded-for``: walked from the right (the entry the nearest proxy appended) past every trusted
  proxy; the first address that is not a trusted proxy is the client. Entries a client wrote itself sit
  further left and are never reached while an untrusted hop stands between them and us.
* ``cf-connecting-ip``: the single address Cloudflare's edge sets (and overwrites when a client sends one).
  Choose it only when every trusted proxy is Cloudflare (or a tunnel from it): a generic proxy passes a
  client's own ``CF-Connecting-IP`` through untouched.

Anything unparsable falls back to the last address known good. Addresses come back in canonical text form
(IPv4-mapped IPv6 as IPv4), so one client has one identity in the rate limits.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

__all__ = ["CLIENT_IP_HEADERS", "ClientAddresses", "parse_networks"]

CLIENT_IP_HEADERS = ("x-forwarded-for", "cf-connecting-ip")
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(entries: Iterable[str]) -> tuple[_Network, ...]:
    """IPs and CIDRs as networks; raises ValueError naming the first entry that is neither."""
    out = []
    for entry in entries:
        try:
            out.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{entry.strip()!r} is not an IP address or CIDR") from None
    return tuple(out)


def _ip(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not text:
        return None
    text = text.strip().strip('"')
    if text.startswith("[") and "]" in text:  # [v6]:port
        text = text[1:text.index("]")]
    elif text.count(":") == 1:  # v4:port
        text = text.split(":", 1)[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class ClientAddresses:
    def __init__(self, trusted: Iterable[str] = (), header: str = "x-forwarded-for") -> None:
        if header not in CLIENT_IP_HEADERS:
            raise ValueError(f"header must be one of {', '.join(CLIENT_IP_HEADERS)}")
        self.trusted = parse_networks(trusted)
        self.header = header

    def _trusted(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return any(ip.version == net.version and ip in net for net in self.trusted)

    def resolve(self, peer: str | None, header_values: Iterable[str] = ()) -> str:
        """The client address of a request from ``peer`` carrying ``header_values`` of the configured header
        (every occurrence, in order)."""
        current = _ip(peer)
        if current is None:
            return peer or "unknown"
        if not self.trusted or not self._trusted(current):
            return current.compressed
        values = [v for v in header_values if v]
        if self.header == "cf-connecting-ip":
            ip = _ip(values[-1]) if values else None
            return (ip or current).compressed
        hops = [h for v in values for h in v.split(",") if h.strip()]
        for hop in reversed(hops):
            ip = _ip(hop)
            if ip is None:
                break  # garbage: the last good address is as far as we can trust
            current = ip
            if not self._trusted(ip):
                break
        return current.compressed
