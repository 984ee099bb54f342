"""The journal's database: its three tables under a prefix, and the SQLAlchemy engine for SQLite (embedded,
WAL) or PostgreSQL that `Journal` writes them through.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from tether.errors import ConfigError


def journal_tables(prefix: str) -> tuple[sa.MetaData, sa.Table, sa.Table, sa.Table]:
    meta = sa.MetaData()
    tasks = sa.Table(
        f"{prefix}tasks",
        meta,
        sa.Column("task_id", sa.String(128), primary_key=True),
        sa.Column("spec", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("owner", sa.String(128)),
        sa.Column("lease_epoch", sa.Integer, nullable=False, default=0),
        sa.Column("lease_expires_at", sa.Float, nullable=False, default=0.0),
        sa.Column("cancel_requested", sa.Boolean, nullable=False, default=False),
        sa.Column("result", sa.Text),
        sa.Column("error", sa.Text),
    )
    steps = sa.Table(
        f"{prefix}steps",
        meta,
        sa.Column("task_id", sa.String(128), primary_key=True),
        sa.Column("step_no", sa.Integer, primary_key=True),
        sa.Column("epoch", sa.Integer, nullable=False),
        sa.Column("role", sa.String(64), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("usage", sa.Text, nullable=False),
        sa.Column("messages_in", sa.Integer, nullable=False),
        sa.Column("messages_in_digest", sa.String(64), nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("model_done_at", sa.Float, nullable=False),
        sa.Column("committed_at", sa.Float),
        sa.Column("snapshot_key", sa.String(256)),
    )
    tool_calls = sa.Table(
        f"{prefix}tool_calls",
        meta,
        sa.Column("idempotency_key", sa.String(256), primary_key=True),
        sa.Column("task_id", sa.String(128), nullable=False, index=True),
        sa.Column("step_no", sa.Integer, nullable=False),
        sa.Column("call_index", sa.Integer, nullable=False),
        sa.Column("tool", sa.String(128), nullable=False),
        sa.Column("arguments", sa.Text, nullable=False),
        sa.Column("intent_at", sa.Float, nullable=False),
        sa.Column("executions", sa.Integer, nullable=False, default=0),
        sa.Column("observation", sa.Text),
        sa.Column("observed_at", sa.Float),
    )
    return meta, tasks, steps, tool_calls


READ_ONLY = "tether_read_only"
"""The execution option of a connection that only reads: SQLite begins it without taking the write lock."""


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers (`agent ls`, `logs --follow`) run beside the workers; NORMAL syncs at checkpoints,
    # so a killed process loses nothing and a power loss can only drop the newest, unacted-on commits.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def make_engine(url: str) -> Engine:
    """An SQLAlchemy engine for `sqlite:///PATH` or `postgresql+psycopg://...` (`postgresql://` works too)."""
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    if not (url.startswith("sqlite:///") or url.startswith("postgresql+psycopg://")):
        raise ConfigError(f"store url {url!r}: use sqlite:///PATH or postgresql://USER@HOST:PORT/DB")
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": 30, "isolation_level": None})
        sa.event.listen(engine, "connect", _sqlite_pragmas)

        # pysqlite's own transaction handling is off (isolation_level None); SQLAlchemy's BEGIN is
        # issued here so a transaction that writes takes the write lock at once instead of upgrading.
        @sa.event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            reading = conn.get_execution_options().get(READ_ONLY, False)
            conn.exec_driver_sql("BEGIN" if reading else "BEGIN IMMEDIATE")

        return engine
    return sa.create_engine(url, pool_pre_ping=True)


def sqlite_path(url: str) -> Path | None:
    """The database file of a `sqlite:///PATH` URL; None for a server database."""
    return Path(url[len("sqlite:///") :]) if url.startswith("sqlite:///") else None


def journal_exists(url: str) -> bool:
    """False only for an SQLite journal whose file was never created (nothing was submitted there)."""
    path = sqlite_path(url)
    return path is None or path.is_file()
