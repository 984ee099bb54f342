"""The service probes speak each protocol's first words: the real services answer, a closed port or a
program that is not the service is named with the key that uses it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.live_server import free_port
from tether.errors import ConfigError
from tether.local_cluster import Service, ServiceKind
from tether.local_cluster.services import check_services, probe

REAL = [(ServiceKind.POSTGRESQL, 5432), (ServiceKind.REDIS, 6379), (ServiceKind.NATS, 4222)]


@pytest.mark.parametrize(("kind", "port"), REAL, ids=[kind.value for kind, _ in REAL])
def test_each_running_service_answers_its_probe(kind: ServiceKind, port: int, no_services: bool) -> None:
    if no_services:
        pytest.skip("TETHER_NO_SERVICES=1")
    assert probe(Service(kind, "127.0.0.1", port, "agents.bus")) is None


@contextmanager
def chatty_server(greeting: bytes) -> Iterator[int]:
    """A TCP server that answers every connection with `greeting` and closes it."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(greeting)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield port
    finally:
        server.close()


@pytest.mark.parametrize("kind", list(ServiceKind))
def test_a_program_that_is_not_the_service_is_told_apart(kind: ServiceKind) -> None:
    with chatty_server(b"HTTP/1.1 400 Bad Request\r\n\r\n") as port:
        why = probe(Service(kind, "127.0.0.1", port, "agents.bus"), timeout_s=1.0)
    assert why is not None and f"port {port}" in why


def test_an_unreachable_service_is_named_with_its_key() -> None:
    port = free_port()
    with pytest.raises(ConfigError) as raised:
        check_services((Service(ServiceKind.REDIS, "127.0.0.1", port, "agents.bus"),))
    assert f"Redis at 127.0.0.1:{port} (agents.bus) is not reachable: Connection refused" in str(raised.value)
