"""Fleet discovery by DNS: `dns+http://NAME:PORT` names a set of A/AAAA records, one per instance.

A Kubernetes headless Service resolves so (one record per ready pod). The name is resolved with
`socket.getaddrinfo` in a thread (it blocks), and again every few seconds by the fleet client, so
instances that come and go join and leave the rotation. The resolver is injectable for tests.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tether.errors import ConfigError, TetherError

Resolver = Callable[..., Sequence[tuple[Any, ...]]]


class DiscoveryFailed(TetherError):
    """The discovery name did not resolve, or resolved to no address."""


@dataclass(frozen=True, slots=True)
class DnsDiscovery:
    scheme: str  # http or https, spoken to every instance
    host: str
    port: int
    resolver: Resolver = socket.getaddrinfo

    @classmethod
    def parse(cls, url: str, resolver: Resolver = socket.getaddrinfo) -> DnsDiscovery:
        parts = urlsplit(url)
        if parts.scheme not in ("dns+http", "dns+https") or not parts.hostname or parts.port is None:
            raise ConfigError(
                f"sandbox discovery {url!r}: expected dns+http://NAME:PORT "
                "(a name whose A records are the fleet)"
            )
        return cls(parts.scheme.removeprefix("dns+"), parts.hostname, parts.port, resolver)

    def urls(self, records: Sequence[tuple[Any, ...]]) -> list[str]:
        """getaddrinfo's records as the instances' base URLs, sorted, each address once."""
        addresses = sorted({str(record[4][0]) for record in records})
        return [f"{self.scheme}://{_host(address)}:{self.port}" for address in addresses]

    async def resolve(self) -> list[str]:
        try:
            records = await asyncio.to_thread(self.resolver, self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as error:
            raise DiscoveryFailed(f"sandbox discovery: {self.host!r} does not resolve ({error})") from None
        urls = self.urls(records)
        if not urls:
            raise DiscoveryFailed(f"sandbox discovery: {self.host!r} resolves to no address")
        return urls


def _host(address: str) -> str:
    try:
        return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:
        return address
