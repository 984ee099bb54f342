"""Embedded durable queue in one SQLite file: the default bus, shared by workers on one machine.

A receive is one `BEGIN IMMEDIATE` transaction that moves visible rows' `visible_at` into the future and
stamps a fresh receipt, so two consumers never hold the same delivery; an ack deletes the row only if
the receipt still matches (a consumer whose timeout lapsed cannot ack the redelivered copy away).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from tether.bus.base import BusConfig, Delivery
from tether.errors import ConfigError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS bus_messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    task_id TEXT NOT NULL,
    enqueued_at REAL NOT NULL,
    visible_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    receipt TEXT
);
CREATE INDEX IF NOT EXISTS bus_messages_visible ON bus_messages (queue, visible_at, id);
"""
_POLL_S = 0.05


class SqliteQueue:
    def __init__(self, config: BusConfig, clock: Callable[[], float] = time.time) -> None:
        if not config.url.startswith("sqlite:///"):
            raise ConfigError(f"bus url {config.url!r}: the embedded queue needs sqlite:///PATH")
        self.config = config
        self.path = Path(config.url[len("sqlite:///") :])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    async def publish(self, task_id: str) -> str:
        now = self._clock()
        cursor = self._db.execute(
            "INSERT INTO bus_messages (queue, task_id, enqueued_at, visible_at) VALUES (?, ?, ?, ?)",
            (self.config.name, task_id, now, now),
        )
        return str(cursor.lastrowid)

    def _take(self, max_messages: int) -> list[Delivery]:
        now = self._clock()
        deliveries = []
        self._db.execute("BEGIN IMMEDIATE")
        try:
            rows = self._db.execute(
                "SELECT id, task_id, attempts FROM bus_messages WHERE queue = ? AND visible_at <= ? "
                "ORDER BY id LIMIT ?",
                (self.config.name, now, max_messages),
            ).fetchall()
            for message_id, task_id, attempts in rows:
                receipt = uuid.uuid4().hex
                self._db.execute(
                    "UPDATE bus_messages SET visible_at = ?, attempts = attempts + 1, receipt = ? "
                    "WHERE id = ?",
                    (now + self.config.visibility_timeout_s, receipt, message_id),
                )
                deliveries.append(Delivery(task_id, str(message_id), attempts + 1, receipt))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return deliveries

    async def receive(self, max_messages: int, wait_s: float) -> list[Delivery]:
        if max_messages < 1:
            return []
        deadline = time.monotonic() + wait_s
        while True:
            deliveries = self._take(max_messages)
            if deliveries or time.monotonic() >= deadline:
                return deliveries
            await asyncio.sleep(_POLL_S)

    async def ack(self, delivery: Delivery) -> None:
        self._db.execute(
            "DELETE FROM bus_messages WHERE id = ? AND receipt = ?",
            (int(delivery.message_id), delivery.receipt),
        )

    async def extend(self, delivery: Delivery) -> None:
        self._db.execute(
            "UPDATE bus_messages SET visible_at = ? WHERE id = ? AND receipt = ?",
            (self._clock() + self.config.visibility_timeout_s, int(delivery.message_id), delivery.receipt),
        )

    async def depth(self) -> int:
        row = self._db.execute(
            "SELECT COUNT(*) FROM bus_messages WHERE queue = ?", (self.config.name,)
        ).fetchone()
        return int(row[0])

    async def close(self) -> None:
        self._db.close()

    async def destroy(self) -> None:
        self._db.execute("DELETE FROM bus_messages WHERE queue = ?", (self.config.name,))
