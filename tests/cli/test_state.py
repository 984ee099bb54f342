"""One state directory ($TETHER_HOME): every subsystem's default store is under it, whatever the
current directory, `tether config show` names it, and an empty store says where it was looked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli.common import CliState
from tether.cli.main import app
from tether.cli.worker import Locations
from tether.gateway.config import GatewayConfig
from tether.scheduler.store import default_store_path

runner = CliRunner()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "state"


def test_every_subsystem_default_store_is_under_tether_home(home: Path) -> None:
    agents = Locations(None, None, None, "tether-tasks", None).config(CliState())
    assert agents.store_url == f"sqlite:///{home / 'agents' / 'journal.db'}"
    assert default_store_path() == home / "jobs.sqlite"
    assert GatewayConfig().ledger_url == f"sqlite:///{home / 'gateway.db'}"


def test_config_show_prints_the_state_directory(home: Path) -> None:
    result = runner.invoke(app, ["config", "show"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["home"] == str(home)


def test_gateway_ledger_is_the_same_from_any_directory(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    created = runner.invoke(app, ["gateway", "keys", "create", "--tenant", "acme", "--json"])
    assert created.exit_code == 0, created.output
    monkeypatch.chdir(tmp_path / "b")
    listed = runner.invoke(app, ["gateway", "keys", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    assert json.loads(created.stdout)["key_id"] in listed.stdout
    assert (home / "gateway.db").is_file()


def test_an_empty_job_store_says_where_it_looked(home: Path) -> None:
    result = runner.invoke(app, ["jobs", "list"])
    assert result.exit_code == 0, result.output
    assert f"no jobs in {home / 'jobs.sqlite'}" in result.stderr
