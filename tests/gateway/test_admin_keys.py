"""Admin keys (those that may sign in to the console): marked in a table of their own, so a keys table
made before they existed keeps working, and only a key that is admin and not revoked passes."""

from __future__ import annotations

import json
from pathlib import Path

import sqlalchemy as sa
from typer.testing import CliRunner

from tether.chat.pricing import Tier
from tether.cli.main import app
from tether.gateway.config import Limits
from tether.gateway.keys import KeyStore
from tether.store import make_engine


def test_only_a_live_admin_key_is_an_admin(tmp_path: Path) -> None:
    keys = KeyStore(make_engine(f"sqlite:///{tmp_path / 'keys.db'}"))
    admin_secret, admin = keys.create("ops", Tier.STANDARD, Limits(), "console", admin=True)
    plain_secret, plain = keys.create("ops", Tier.STANDARD, Limits())
    assert keys.is_admin(admin_secret) and not keys.is_admin(plain_secret)
    assert not keys.is_admin(admin_secret + "x") and not keys.is_admin("")
    assert [(k.key_id, k.admin) for k in keys.list()] == [(admin.key_id, True), (plain.key_id, False)]
    keys.revoke(admin.key_id)
    assert not keys.is_admin(admin_secret)
    assert keys.lookup(admin_secret) is not None and keys.lookup(admin_secret).admin  # type: ignore[union-attr]


def test_a_keys_table_from_before_admin_keys_keeps_its_keys(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    old = KeyStore(engine)
    secret, record = old.create("acme", Tier.FAST, Limits(requests_per_minute=3))
    with engine.begin() as conn:  # the database as it was: no admin table
        conn.execute(sa.text("DROP TABLE gw_admin_keys"))
    reopened = KeyStore(engine)
    assert reopened.lookup(secret) == record and not reopened.is_admin(secret)
    admin_secret, _ = reopened.create("ops", Tier.STANDARD, Limits(), admin=True)
    assert reopened.is_admin(admin_secret)


def test_keys_create_admin_prints_an_admin_key_that_keys_list_shows(tmp_path: Path) -> None:
    runner = CliRunner()
    ledger = ["--ledger-url", f"sqlite:///{tmp_path / 'ledger.db'}"]
    made = runner.invoke(app, ["gateway", "keys", "create", "--tenant", "ops", "--admin", "--json", *ledger])
    assert made.exit_code == 0, made.output
    created = json.loads(made.stdout)
    assert created["admin"] is True
    listed = json.loads(runner.invoke(app, ["gateway", "keys", "list", "--json", *ledger]).stdout)
    assert [(row["key_id"], row["admin"]) for row in listed] == [(created["key_id"], True)]
    assert KeyStore(make_engine(ledger[1])).is_admin(created["key"])
