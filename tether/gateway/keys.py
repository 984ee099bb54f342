"""API keys: generated once, shown once, stored only as a SHA-256 hash with their tenant, tier and limits.

Keys carry 256 bits of randomness, so a fast hash is enough (no password stretching): the hash is the
lookup index. Revocation is a timestamp; revoked keys stay listed for the ledger's sake. An admin key (one
that may also sign in to the console) is named in a table of its own, so that databases made before admin
keys existed keep working: the table is created beside them and a key not in it is an ordinary one.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tether.chat.pricing import Tier
from tether.errors import ConfigError, TetherError
from tether.gateway.config import Limits

KEY_PREFIX = "tk-"
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class UnknownKey(TetherError, LookupError):
    """No key with this id exists."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    tenant: str
    tier: Tier
    limits: Limits
    name: str
    created_at: float
    revoked_at: float | None = None
    admin: bool = False

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def summary(self) -> dict[str, object]:
        """The key as `keys list --json` and the console show it (never a secret), times in UTC."""
        return {
            "key_id": self.key_id,
            "tenant": self.tenant,
            "tier": self.tier.value,
            "name": self.name,
            "admin": self.admin,
            "limits": self.limits.model_dump(mode="json", exclude_defaults=True),
            "created": _utc(self.created_at),
            "revoked": None if self.revoked_at is None else _utc(self.revoked_at),
        }


def _utc(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="seconds")


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def check_tenant(tenant: str) -> str:
    if not _TENANT.match(tenant):
        raise ConfigError(
            f"tenant {tenant!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return tenant


class KeyStore:
    def __init__(self, engine: Engine, prefix: str = "gw_", clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.clock = clock
        self.meta = sa.MetaData()
        self.table = sa.Table(
            f"{prefix}keys",
            self.meta,
            sa.Column("key_id", sa.String(32), primary_key=True),
            sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
            sa.Column("tenant", sa.String(64), nullable=False, index=True),
            sa.Column("tier", sa.String(16), nullable=False),
            sa.Column("limits", sa.Text, nullable=False),
            sa.Column("name", sa.String(128), nullable=False),
            sa.Column("created_at", sa.Float, nullable=False),
            sa.Column("revoked_at", sa.Float),
        )
        self.admins = sa.Table(
            f"{prefix}admin_keys",
            self.meta,
            sa.Column("key_id", sa.String(32), sa.ForeignKey(self.table.c.key_id), primary_key=True),
        )
        self.meta.create_all(engine)
        self._select = sa.select(self.table, self.admins.c.key_id.is_not(None).label("admin")).select_from(
            self.table.outerjoin(self.admins, self.admins.c.key_id == self.table.c.key_id)
        )

    def create(
        self, tenant: str, tier: Tier, limits: Limits, name: str = "", admin: bool = False
    ) -> tuple[str, ApiKey]:
        """A new key: (the secret, to hand to the client once; its record). An `admin` key may also sign
        in to the console."""
        check_tenant(tenant)
        key_id = secrets.token_hex(6)
        secret = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
        record = ApiKey(key_id, tenant, tier, limits, name, self.clock(), admin=admin)
        with self.engine.begin() as conn:
            conn.execute(
                self.table.insert().values(
                    key_id=key_id,
                    key_hash=hash_key(secret),
                    tenant=tenant,
                    tier=tier.value,
                    limits=limits.model_dump_json(exclude_defaults=True),
                    name=name,
                    created_at=record.created_at,
                )
            )
            if admin:
                conn.execute(self.admins.insert().values(key_id=key_id))
        return secret, record

    def lookup(self, secret: str) -> ApiKey | None:
        """The key's record (revoked ones too), or None if no key has this secret."""
        with self.engine.connect() as conn:
            row = conn.execute(self._select.where(self.table.c.key_hash == hash_key(secret))).first()
        return None if row is None else self._record(row)

    def is_admin(self, secret: str) -> bool:
        """Whether `secret` is an admin key that is not revoked: what signing in to the console takes."""
        key = self.lookup(secret)
        return key is not None and key.admin and not key.revoked

    def list(self, tenant: str | None = None) -> list[ApiKey]:
        query = self._select.order_by(self.table.c.created_at)
        if tenant is not None:
            query = query.where(self.table.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [self._record(row) for row in conn.execute(query)]

    def revoke(self, key_id: str) -> ApiKey:
        with self.engine.begin() as conn:
            found = conn.execute(
                self.table.update()
                .where(self.table.c.key_id == key_id, self.table.c.revoked_at.is_(None))
                .values(revoked_at=self.clock())
            ).rowcount
            row = conn.execute(self._select.where(self.table.c.key_id == key_id)).first()
        if row is None:
            raise UnknownKey(f"key id {key_id!r}: no such key; `tether gateway keys list` shows the ids")
        if not found:
            raise ConfigError(f"key id {key_id!r}: already revoked")
        return self._record(row)

    def drop(self) -> None:
        self.meta.drop_all(self.engine)

    @staticmethod
    def _record(row: sa.Row[tuple[object, ...]]) -> ApiKey:
        m = row._mapping
        return ApiKey(
            str(m["key_id"]),
            str(m["tenant"]),
            Tier(m["tier"]),
            Limits.model_validate_json(str(m["limits"])),
            str(m["name"]),
            float(m["created_at"]),
            None if m["revoked_at"] is None else float(m["revoked_at"]),
            bool(m["admin"]),
        )
