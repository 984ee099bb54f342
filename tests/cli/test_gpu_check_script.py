"""`scripts/gpu-check.sh`, which only a GPU machine runs in full: it is executable, parses, and every
`tether` command it calls exists with the options it passes, so it does not rot between GPU runs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import typer.main
from typer._click.core import Context
from typer.core import TyperGroup

from tests.cli.test_readme import OPTION, command_paths
from tether.cli.main import app

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"
# `"$TETHER" words...` or `-m tether words...`, up to a shell operator or the end of the line.
CALL = re.compile(r'(?:"\$TETHER"|-m tether) ([^|&;>\n]+)')


def script_commands() -> list[str]:
    return sorted({"tether " + " ".join(call.split()) for call in CALL.findall(SCRIPT.read_text())})


def exists(words: list[str]) -> bool:
    command = typer.main.get_command(app)
    for word in words:
        if not isinstance(command, TyperGroup):
            return False
        found = command.get_command(Context(command), word)
        if found is None:
            return False
        command = found
    return True


def test_the_script_is_executable_and_parses() -> None:
    assert os.access(SCRIPT, os.X_OK)
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_the_script_calls_the_commands_it_is_for() -> None:
    called = {" ".join(c.split()[:3]) for c in script_commands()}
    assert {
        "tether serve --model",
        "tether train --config",
        "tether models pull",
        "tether rl bench-sync",
    } <= called
    assert any("--device" in c and "--dtype bfloat16" in c for c in script_commands() if "serve" in c)


@pytest.mark.parametrize("written", script_commands())
def test_every_command_the_script_calls_exists_with_its_options(written: str) -> None:
    assert exists(written.split()[1:3]) or exists(written.split()[1:2]), written
    for path, command, rest in command_paths(written):
        known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        known |= {"--help", "-h"}
        for option in OPTION.findall(rest):
            assert option in known, (
                f"{written!r}: `tether {' '.join(path)}` has no {option} ({sorted(known)})"
            )
