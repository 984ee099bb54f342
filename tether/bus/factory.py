"""Choose the bus back end from its URL scheme: a registry, not a chain of special cases."""

from __future__ import annotations

from collections.abc import Callable

from tether.bus.base import BusConfig, TaskBus
from tether.errors import ConfigError


def _sqlite(config: BusConfig) -> TaskBus:
    from tether.bus.sqlite_queue import SqliteQueue

    return SqliteQueue(config)


def _redis(config: BusConfig) -> TaskBus:
    from tether.bus.redis_streams import RedisStreamsBus

    return RedisStreamsBus(config)


def _nats(config: BusConfig) -> TaskBus:
    from tether.bus.nats_jetstream import NatsJetStreamBus

    return NatsJetStreamBus(config)


# Back ends load their client library on first use, so the embedded default needs neither redis nor nats.
BACKENDS: dict[str, Callable[[BusConfig], TaskBus]] = {
    "sqlite": _sqlite,
    "redis": _redis,
    "rediss": _redis,
    "nats": _nats,
    "tls": _nats,
}


def open_bus(config: BusConfig) -> TaskBus:
    scheme = config.url.split("://", 1)[0] if "://" in config.url else ""
    factory = BACKENDS.get(scheme)
    if factory is None:
        raise ConfigError(
            f"bus url {config.url!r}: unknown scheme {scheme!r}; use sqlite:///PATH, redis://HOST:PORT "
            "or nats://HOST:PORT"
        )
    return factory(config)
