"""Keys and the ledger on SQLite and the real PostgreSQL: hashed storage, revocation, exact sums, reports."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

import pytest
import sqlalchemy as sa

from tether.chat import Usage
from tether.chat.pricing import Tier
from tether.errors import ConfigError
from tether.gateway.config import Limits
from tether.gateway.keys import KeyStore, UnknownKey, hash_key
from tether.gateway.ledger import Charge, Ledger, RecentUsage, Reservation
from tether.store import make_engine

from .conftest import unique_prefix

DAY = 86400.0


@pytest.fixture
def stores(ledger_url: str) -> Iterator[tuple[KeyStore, Ledger]]:
    engine = make_engine(ledger_url)
    prefix = unique_prefix()
    keys, ledger = KeyStore(engine, prefix, clock=lambda: 1000.0), Ledger(engine, prefix)
    yield keys, ledger
    ledger.drop()
    keys.drop()
    engine.dispose()


def test_keys_are_stored_hashed_and_found_by_secret(stores: tuple[KeyStore, Ledger]) -> None:
    keys, _ = stores
    secret, record = keys.create("acme", Tier.FAST, Limits(requests_per_minute=7), name="ci")
    assert secret.startswith("tk-") and record.key_id in secret
    with keys.engine.connect() as conn:
        stored = [tuple(row) for row in conn.execute(keys.table.select())]
    assert not any(secret in str(value) for row in stored for value in row)
    assert stored[0][1] == hash_key(secret)
    found = keys.lookup(secret)
    assert found == record and found.limits.requests_per_minute == 7 and found.tier is Tier.FAST
    assert keys.lookup(secret[:-1]) is None


def test_revoked_keys_stay_listed_and_cannot_be_revoked_twice(stores: tuple[KeyStore, Ledger]) -> None:
    keys, _ = stores
    _, first = keys.create("acme", Tier.STANDARD, Limits())
    keys.create("other", Tier.STANDARD, Limits())
    revoked = keys.revoke(first.key_id)
    assert revoked.revoked and revoked.revoked_at == 1000.0
    assert [k.key_id for k in keys.list("acme")] == [first.key_id] and len(keys.list()) == 2
    with pytest.raises(ConfigError, match="already revoked"):
        keys.revoke(first.key_id)
    with pytest.raises(UnknownKey, match="no such key"):
        keys.revoke("nope")


@pytest.mark.parametrize("tenant", ["", "a b", "-x", "x" * 65, "semi;colon"])
def test_bad_tenant_names_are_refused(stores: tuple[KeyStore, Ledger], tenant: str) -> None:
    with pytest.raises(ConfigError, match="tenant"):
        stores[0].create(tenant, Tier.STANDARD, Limits())


def test_report_groups_by_day_model_and_tier_with_exact_sums(stores: tuple[KeyStore, Ledger]) -> None:
    _, ledger = stores
    charges = [
        (0.0, "m1", Tier.STANDARD, Usage(10, 4, 5), Decimal("0.000001230001")),
        (10.0, "m1", Tier.STANDARD, Usage(20, 0, 1), Decimal("0.000000000001")),
        (20.0, "m1", Tier.FAST, Usage(1, 1, 1), Decimal("0.5")),
        (DAY + 1, "m2", Tier.STANDARD, Usage(3, 0, 3), Decimal("1.25")),
        (DAY + 2, "m2", Tier.STANDARD, Usage(3, 0, 3), Decimal("7")),
    ]
    for i, (at, model, tier, usage, cost) in enumerate(charges):
        ledger.record([Charge(f"r{i}", at, "acme", "k", model, tier, usage, cost)])
    ledger.record([Charge("other", 5.0, "other", "k", "m1", Tier.STANDARD, Usage(1, 0, 1), Decimal(1))])
    rows = ledger.report("acme", since=0)
    assert [(r.day, r.model, r.tier, r.requests) for r in rows] == [
        ("1970-01-01", "m1", Tier.FAST, 1),
        ("1970-01-01", "m1", Tier.STANDARD, 2),
        ("1970-01-02", "m2", Tier.STANDARD, 2),
    ]
    assert rows[1].cost_usd == Decimal("0.000001230002") and rows[1].prompt_tokens == 30
    assert rows[1].cached_tokens == 4 and rows[1].completion_tokens == 6
    assert rows[2].cost_usd == Decimal("8.25")
    assert [r.day for r in ledger.report("acme", since=DAY)] == ["1970-01-02"]
    assert ledger.daily_spend("acme", "1970-01-02") == (2, 12, Decimal("8.25"))
    assert ledger.daily_spend("acme", "1970-01-01") == (3, 38, Decimal("0.500001230002"))


def test_a_failed_ledger_write_leaves_the_spend_untouched(stores: tuple[KeyStore, Ledger]) -> None:
    _, ledger = stores
    charge = Charge("same-id", 0.0, "acme", "k", "m", Tier.STANDARD, Usage(1, 0, 1), Decimal(1))
    ledger.record([charge])
    second = Charge("new-id", 0.0, "acme", "k", "m", Tier.STANDARD, Usage(1, 0, 1), Decimal(1))
    with pytest.raises(sa.exc.IntegrityError):  # one bad row fails its whole batch
        ledger.record([second, charge])
    assert ledger.daily_spend("acme", "1970-01-01") == (1, 2, Decimal(1))


def test_recent_usage_sums_per_key_and_span_with_costs_rounded_up(stores: tuple[KeyStore, Ledger]) -> None:
    _, ledger = stores
    charges = [
        (1210.0, "k1", Usage(10, 0, 5), Decimal("0.000000000001")),  # 1 pico-USD: rounds up to 1 nano
        (1220.0, "k1", Usage(1, 0, 1), Decimal("0.000000002")),
        (1220.0, "k2", Usage(2, 0, 2), Decimal("0.000000003")),
        (1290.0, "k1", Usage(3, 0, 3), Decimal("0.000000004")),  # the next minute
        (900.0, "k1", Usage(50, 0, 50), Decimal(1)),  # before `since`
    ]
    ledger.record(
        [
            Charge(f"r{i}", at, "acme", key, "m", Tier.STANDARD, usage, cost)
            for i, (at, key, usage, cost) in enumerate(charges)
        ]
    )
    usage = ledger.recent_usage(since=1200.0, span_s=60.0)
    assert [u.last_at for u in usage] == [1220.0, 1220.0, 1290.0]  # oldest first
    assert sorted(usage, key=lambda u: (u.last_at, u.key_id)) == [
        RecentUsage("acme", "k1", 1220.0, 17, 3),
        RecentUsage("acme", "k2", 1220.0, 4, 3),
        RecentUsage("acme", "k1", 1290.0, 6, 4),
    ]


def test_a_reservation_stays_open_until_its_charge_or_release_ends_it(
    stores: tuple[KeyStore, Ledger],
) -> None:
    _, ledger = stores
    reserved = [Reservation(f"r{i}", 1000.0 + i, "acme", "k1", 70, 13_100) for i in range(4)]
    ledger.record([], reserved=reserved[:3])
    charge = Charge("r0", 1005.0, "acme", "k1", "m", Tier.STANDARD, Usage(2, 0, 1), Decimal("0.0000131"))
    # a reservation committed with its own release (a request refused upstream at once) never shows
    ledger.record([charge], reserved=reserved[3:], released=["r1", "r3"])
    assert ledger.open_reservations(since=1000.0) == [RecentUsage("acme", "k1", 1002.0, 70, 13_100)]
    assert ledger.open_reservations(since=1002.5) == []
    assert ledger.daily_spend("acme", "1970-01-01") == (1, 3, Decimal("0.0000131"))
