"""The example alert rules name only metrics the gateway exports; the ledger writer groups concurrent writes
in one commit, answers each only once it is committed, retries, and never settles a charge it could not
write."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from tether.chat import Usage
from tether.chat.pricing import Tier
from tether.gateway.ledger import Charge, Ledger, Reservation
from tether.gateway.metrics import GatewayMetrics
from tether.gateway.usage_log import Refused
from tether.gateway.writer import LedgerWriter

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "gateway-alerts.yml"


def test_alert_rules_use_exported_metrics() -> None:
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    families = {family.name for family in GatewayMetrics().registry.collect()}
    used = {name for rule in rules for name in re.findall(r"tether_gateway_\w+", rule["expr"])}
    assert len(rules) >= 4 and len(used) >= 4
    for name in used:
        assert re.sub(r"_(bucket|total|count|sum)$", "", name) in families, name


class FlakyLedger(Ledger):
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.batches: list[list[Charge]] = []
        self.reserved: list[str] = []

    def record(
        self,
        charges: Sequence[Charge],
        reserved: Sequence[Reservation] = (),
        released: Sequence[str] = (),
        refused: Sequence[Refused] = (),
    ) -> None:
        if self.failures:
            self.failures -= 1
            raise OSError("disk full")
        self.batches.append(list(charges))
        self.reserved += [r.request_id for r in reserved]


def charge(i: int) -> Charge:
    return Charge(f"r{i}", 0.0, "acme", "k", "m", Tier.STANDARD, Usage(1, 0, 1), Decimal(1))


async def test_concurrent_charges_share_one_commit_and_are_answered_after_it() -> None:
    ledger = FlakyLedger(failures=0)
    writer = LedgerWriter(ledger)
    settled: list[int] = []
    committed = []
    for i in range(5):

        async def after(i: int = i) -> None:
            assert any(c.request_id == f"r{i}" for batch in ledger.batches for c in batch)  # committed first
            settled.append(i)

        committed.append(writer.charge(charge(i), after))
    reserved = writer.reserve(Reservation("r9", 0.0, "acme", "k", 10, 100))
    assert not any(f.done() for f in committed)
    assert await asyncio.gather(*committed, reserved) == [True] * 6
    assert [len(batch) for batch in ledger.batches] == [5] and ledger.reserved == ["r9"]
    assert settled == [0, 1, 2, 3, 4]
    await writer.close()


@pytest.mark.parametrize(("failures", "written"), [(2, True), (3, False)])
async def test_failed_commits_are_retried_then_given_up_unsettled(
    failures: int, written: bool, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = FlakyLedger(failures)
    given_up: list[int] = []
    writer = LedgerWriter(ledger, attempts=3, backoff_s=0.001, on_failure=given_up.append)
    settled: list[bool] = []

    async def after() -> None:
        settled.append(True)

    assert await writer.charge(charge(0), after) is written
    await writer.close()
    assert bool(ledger.batches) is written and bool(settled) is written
    assert given_up == ([] if written else [1])
    assert written or "unrecorded charge" in caplog.text
