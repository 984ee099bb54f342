"""Help text at 80 columns: nothing eaten, nothing cut, no placeholders on flags; one name (`list`,
with `ls` as its alias) for every listing command."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from tether.cli.main import COMMANDS as COMMANDS_TABLE
from tether.cli.main import app

runner = CliRunner()
BRACKETED = re.compile(r"\[[^\]]*\]")


def _commands() -> list[tuple[list[str], Any]]:
    found: list[tuple[list[str], Any]] = []

    def walk(command: Any, path: list[str]) -> None:
        found.append((path, command))
        for name, sub in getattr(command, "commands", {}).items():
            if not sub.hidden:
                walk(sub, [*path, name])

    walk(get_command(app), [])
    return found


COMMANDS = _commands()
LISTING_GROUPS = [path for path, command in COMMANDS if "list" in getattr(command, "commands", {})]


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) or "tether" for p, _ in COMMANDS])
def test_help_at_80_columns_keeps_every_name_and_bracket(path: list[str], command: Any) -> None:
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    output = result.output
    assert "<bool>" not in output
    assert "…" not in output
    assert max(len(line) for line in output.splitlines()) <= 80
    flat = _flat(output)
    texts = [command.help or ""]
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        for name in [*param.opts, *param.secondary_opts]:
            assert name in output, f"option {name} of `tether {' '.join(path)}` is cut"
        texts.append(getattr(param, "help", None) or "")
    for text in texts:
        for bracketed in BRACKETED.findall(text):
            assert _flat(bracketed) in flat, f"{bracketed!r} was eaten from `tether {' '.join(path)} --help`"


def test_help_keeps_the_brackets_the_issue_found_eaten() -> None:
    train = _flat(runner.invoke(app, ["train", "--help"], terminal_width=80).output)
    assert "(actors, see [ray])" in train
    demo = _flat(runner.invoke(app, ["demo", "--help"], terminal_width=80).output)
    assert "optional [demo] (evaluation) section" in demo


def test_every_listing_command_is_list_with_ls_as_alias() -> None:
    assert {" ".join(path) for path in LISTING_GROUPS} >= {"models", "envs", "jobs", "agent", "gateway keys"}
    for path, command in COMMANDS:
        subcommands = getattr(command, "commands", {})
        assert "ls" not in subcommands or subcommands["ls"].hidden, f"`tether {' '.join(path)} ls` is shown"
    for path in LISTING_GROUPS:
        for name in ("list", "ls"):
            result = runner.invoke(app, [*path, name, "--help"])
            assert result.exit_code == 0, f"tether {' '.join(path)} {name}: {result.output}"


def test_list_and_ls_give_the_same_listing(tmp_path: Path) -> None:
    env = {"TETHER_HOME": str(tmp_path)}
    submitted = runner.invoke(app, ["jobs", "submit", "--name", "one", "--", "true"], env=env)
    assert submitted.exit_code == 0, submitted.output
    listed = runner.invoke(app, ["jobs", "list", "--json"], env=env)
    aliased = runner.invoke(app, ["jobs", "ls", "--json"], env=env)
    assert listed.exit_code == aliased.exit_code == 0
    assert '"name": "one"' in listed.stdout
    assert listed.stdout == aliased.stdout


@pytest.mark.parametrize("name", list(COMMANDS_TABLE))
def test_summary_in_the_root_help_is_the_command_own(name: str) -> None:
    """`tether --help` shows a summary without importing the command; it must say what the command says."""
    loaded = get_command(app).commands[name]  # type: ignore[attr-defined]
    assert COMMANDS_TABLE[name].summary == loaded.get_short_help_str(limit=1000)
