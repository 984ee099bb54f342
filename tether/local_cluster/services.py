"""Are the already running services a cluster uses (PostgreSQL, Redis, NATS) there? One greeting each.

A TCP connect alone would pass for any program on the port, so each probe speaks the first words of the
service's protocol: PostgreSQL answers an SSLRequest with `S` or `N`, Redis answers PING, NATS greets
with INFO. It does not log in: credentials are the piece's business, and its own error names them.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

from tether.errors import ConfigError
from tether.local_cluster.plan import Service, ServiceKind

SSL_REQUEST = struct.pack("!ii", 8, 80877103)
NAMES = {ServiceKind.POSTGRESQL: "PostgreSQL", ServiceKind.REDIS: "Redis", ServiceKind.NATS: "NATS"}


def _postgresql(sock: socket.socket) -> bool:
    sock.sendall(SSL_REQUEST)
    return sock.recv(1) in (b"S", b"N")


def _redis(sock: socket.socket) -> bool:
    sock.sendall(b"PING\r\n")
    return sock.recv(64)[:1] in (b"+", b"-")  # +PONG, or -NOAUTH from a server that wants a password


def _nats(sock: socket.socket) -> bool:
    return sock.recv(4) == b"INFO"


PROBES: dict[ServiceKind, Callable[[socket.socket], bool]] = {
    ServiceKind.POSTGRESQL: _postgresql,
    ServiceKind.REDIS: _redis,
    ServiceKind.NATS: _nats,
}


def probe(service: Service, timeout_s: float = 2.0) -> str | None:
    """None when the service answers as it should; otherwise why not, in words."""
    try:
        with socket.create_connection((service.host, service.port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            if PROBES[service.kind](sock):
                return None
            return f"something answers on port {service.port}, but not as {NAMES[service.kind]} does"
    except OSError as error:
        return error.strerror or str(error) or type(error).__name__


def check_services(services: tuple[Service, ...]) -> None:
    """Raise ConfigError naming every service that does not answer, and the key that uses it."""
    problems = []
    for service in services:
        why = probe(service)
        if why is not None:
            where = f"{service.host}:{service.port} ({service.used_by})"
            problems.append(f"{NAMES[service.kind]} at {where} is not reachable: {why}")
    if problems:
        raise ConfigError("\n".join([*problems, "start it (or change the key) and run `tether up` again"]))
