"""Outbound safety: where the mirror may connect when it fetches from a hub.

A hub endpoint, or a redirect a hub (or a file's CDN) sends, that leads to a private, loopback,
link-local, multicast, reserved or unspecified address is a server-side request forgery: the
mirror would fetch cloud metadata (169.254.169.254) or an internal service on the hub's say-so.
Such destinations are refused unless the operator says the hub lives on a private network
(``--hub-allow-private``).

:func:`refusal` is the rule, pure over the URL and the addresses its host resolves to. It is
enforced where connections are made, not by looking at URLs: :class:`OutboundResolver` checks
every DNS answer aiohttp asks for (so a name that resolves differently later is checked again, and
each redirect hop is checked as it connects), and :func:`refuse_private_literals`, a client
middleware, checks hosts written as IP addresses, which aiohttp connects to without asking a
resolver. :func:`session` puts both on one ``aiohttp.ClientSession``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

ALLOW_HINT = "set --hub-allow-private (LLMGW_HUB_ALLOW_PRIVATE=1) if your hub is on a private network"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# IPv6 prefixes that carry an IPv4 address a gateway connects to: the address checked is that one.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


class DestinationRefused(Exception):
    """A connection the outbound rule refused; ``reason`` names the host, the address and what to do.

    Not an ``OSError`` nor an ``aiohttp.ClientError`` on purpose: nothing that retries network
    trouble may mistake it for a passing fault.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def _embedded_ipv4(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 address stands for (mapped, 6to4, NAT64), else ``ip`` itself."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.sixtofour is not None:
            return ip.sixtofour
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


def address_kind(ip: IPAddress) -> str | None:
    """What makes ``ip`` a destination to refuse (``loopback``, ``link-local`` …), or None for a public one."""
    ip = _embedded_ipv4(ip)
    # The order matters: 169.254/16 is private too, but link-local says more (cloud metadata lives there).
    for kind, hit in (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("reserved", ip.is_reserved),
        ("private", ip.is_private),
        ("non-public", not ip.is_global),  # shared address space (100.64/10) and the like
    ):
        if hit:
            return kind
    return None


def _parse(address: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0].strip("[]"))  # a link-local scope (%eth0) aside
    except ValueError:
        return None


def refusal(url: str, addresses: Iterable[str], allow_private: bool) -> str | None:
    """Why connecting to ``url``'s host at ``addresses`` (what it resolved to) is refused, or None.

    Refused when any one address is not public: a name that answers with a public and a private
    address could be steered to the private one. An answer that is not an address is refused too.
    """
    if allow_private:
        return None
    host = urlsplit(url).hostname or url
    for address in addresses:
        ip = _parse(address)
        if ip is None:
            return f"{host} resolved to {address!r}, which is not an IP address: refusing to connect there"
        kind = address_kind(ip)
        if kind is None:
            continue
        where = f"{host} is" if _parse(host) == ip else f"{host} resolves to {address}, which is"
        return (
            f"{where} a {kind} address: llmgw does not fetch from private, loopback or link-local "
            f"addresses on a hub's say-so (a hub or a redirect there could reach internal services); {ALLOW_HINT}"
        )
    return None


def is_ip_literal(host: str) -> bool:
    return _parse(host) is not None


class OutboundResolver(AbstractResolver):
    """aiohttp's threaded resolver with the outbound rule applied to every answer.

    ``pinned``: hosts answered from this map (host → address) instead of DNS, and not checked — a
    test's stand-in for a public host served on loopback. ``inner``: the resolver asked otherwise
    (aiohttp's ``ThreadedResolver``, made on first use, when not given).
    """

    def __init__(
        self,
        allow_private: bool,
        *,
        pinned: Mapping[str, str] | None = None,
        inner: AbstractResolver | None = None,
    ) -> None:
        self.allow_private = allow_private
        self.pinned = dict(pinned or {})
        self._inner = inner

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        pinned = self.pinned.get(host.rstrip(".").lower())
        if pinned is not None:
            family = socket.AF_INET6 if ":" in pinned else socket.AF_INET
            return [ResolveResult(hostname=host, host=pinned, port=port, family=family, proto=0, flags=0)]
        if self._inner is None:
            self._inner = aiohttp.ThreadedResolver()
        answers = await self._inner.resolve(host, port, family)
        reason = refusal(f"//{host}", [a["host"] for a in answers], self.allow_private)
        if reason is not None:
            raise DestinationRefused(reason)
        return answers

    async def addresses(self, url: str) -> list[str]:
        """The addresses ``url``'s host is allowed to be reached at; raises :class:`DestinationRefused`.

        For clients that resolve on their own (``huggingface_hub``): checked just before they connect.
        """
        host = urlsplit(url).hostname or ""
        if is_ip_literal(host):
            reason = refusal(url, [host], self.allow_private)
            if reason is not None:
                raise DestinationRefused(reason)
            return [host]
        return [a["host"] for a in await self.resolve(host, urlsplit(url).port or 0, socket.AF_UNSPEC)]

    async def close(self) -> None:
        if self._inner is not None:
            await self._inner.close()


def refuse_private_literals(allow_private: bool) -> aiohttp.ClientMiddlewareType:
    """A client middleware refusing hosts written as non-public IP addresses, on every request and
    redirect hop (aiohttp connects to those without asking the resolver)."""

    async def middleware(req: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType) -> aiohttp.ClientResponse:
        host = req.url.raw_host or ""
        if is_ip_literal(host):
            reason = refusal(str(req.url), [host], allow_private)
            if reason is not None:
                raise DestinationRefused(reason)
        return await handler(req)

    return middleware


def session(resolver: OutboundResolver, **kwargs: object) -> aiohttp.ClientSession:
    """An ``aiohttp.ClientSession`` (``kwargs`` as for one) that connects only where ``resolver``'s rule allows."""
    connector = aiohttp.TCPConnector(resolver=resolver)
    middlewares = (refuse_private_literals(resolver.allow_private),)
    return aiohttp.ClientSession(connector=connector, middlewares=middlewares, **kwargs)  # type: ignore[arg-type]


def refused_in(exc: BaseException) -> DestinationRefused | None:
    """The :class:`DestinationRefused` behind ``exc`` (itself, or what caused it), if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, DestinationRefused):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
