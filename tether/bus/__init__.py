"""Task delivery for agent workers: an embedded SQLite queue, Redis Streams or NATS JetStream."""

from tether.bus.base import BusConfig, Delivery, TaskBus
from tether.bus.factory import BACKENDS, open_bus

__all__ = ["BACKENDS", "BusConfig", "Delivery", "TaskBus", "open_bus"]
