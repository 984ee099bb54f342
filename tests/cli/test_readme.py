"""The README's commands as a stranger runs them: every `tether ...` it shows exists with the options it
names, and the fast ones, run as the real `tether` in an empty directory on a fresh state directory,
print what the README says they print.

Slow commands (training, benchmarks, servers, the model pull) are only checked here to exist with their
options; their own tests run them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main
from typer._click.core import Command, Context
from typer.core import TyperGroup

from tether.cli.main import app

README = Path(__file__).resolve().parents[2] / "README.md"
SPAN = re.compile(r"`(tether [^`]+)`")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])\b")
Stranger = tuple[Path, dict[str, str]]  # (empty working directory, environment with a fresh TETHER_HOME)


def readme_commands() -> list[str]:
    """Every `tether ...` in an inline code span or on a line of a fenced block, as written."""
    text = README.read_text()
    found = [" ".join(span.replace("\\|", "|").split()) for span in SPAN.findall(text)]
    in_block = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_block = not in_block
        elif in_block and line.strip().startswith("tether "):
            found.append(line.strip().split("  #")[0].strip())
    return sorted(set(found))


def command_paths(written: str) -> Iterator[tuple[list[str], Command, str]]:
    """(words, command, rest of the line) for each command a README line names; `a|b` at a subcommand
    position stands for several commands."""

    def walk(command: Command, path: list[str], rest: list[str]) -> Iterator[tuple[list[str], Command, str]]:
        if isinstance(command, TyperGroup) and rest and not rest[0].startswith(("-", "[")):
            for name in rest[0].split("|"):
                sub = command.get_command(Context(command), name)
                assert sub is not None, f"{written!r}: `tether {' '.join(path)}` has no subcommand {name!r}"
                yield from walk(sub, [*path, name], rest[1:])
            return
        yield path, command, " ".join(rest)

    yield from walk(typer.main.get_command(app), [], written.split()[1:])


def test_the_readme_shows_the_commands_this_test_walks() -> None:
    commands = readme_commands()
    assert len(commands) > 25, commands
    assert {"tether demo", "tether config show", "tether --version"} <= set(commands)


@pytest.mark.parametrize("written", readme_commands())
def test_every_readme_command_exists_with_the_options_it_names(written: str) -> None:
    for path, command, rest in command_paths(written):
        known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        known |= {"--help", "-h"}
        for option in OPTION.findall(rest.split(" -- ")[0]):  # after `--`: another program's options
            assert option in known, (
                f"{written!r}: `tether {' '.join(path)}` has no {option} ({sorted(known)})"
            )


@pytest.fixture
def stranger(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """An empty working directory and a state directory nobody has used, as on a fresh machine."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_") or k == "TETHER_NO_SERVICES"}
    env |= {"TETHER_HOME": str(tmp_path / "state"), "COLUMNS": "120"}
    yield cwd, env


def tether(stranger: Stranger, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    cwd, env = stranger
    return subprocess.run(
        [sys.executable, "-m", "tether", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=240,
    )


def test_readme_first_commands_print_what_it_promises(stranger: Stranger) -> None:
    version = tether(stranger, "--version")
    assert version.returncode == 0 and re.search(r"\d+\.\d+", version.stdout), version
    top = tether(stranger, "--help")
    assert top.returncode == 0
    for command in (
        "sandbox",
        "models",
        "engine",
        "envs",
        "serve",
        "eval",
        "train",
        "agent",
        "gateway",
        "demo",
    ):
        assert re.search(rf"^\s+{command}\s", top.stdout, re.M), f"--help does not list {command}"
    shown = tether(stranger, "config", "show")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["home"] == stranger[1]["TETHER_HOME"]


def test_readme_sandbox_run_prints_one_json_object(stranger: Stranger) -> None:
    run = tether(stranger, "sandbox", "run", "--language", "python", "-", stdin="print('olleh'[::-1])\n")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert (result["status"], result["stdout"]) == ("ok", "hello\n"), result


def test_readme_environment_commands(stranger: Stranger) -> None:
    listed = tether(stranger, "envs", "list", "bench/*", "--json")
    assert listed.returncode == 0, listed.stderr
    assert "bench/integer_arithmetic" in {row["name"] for row in json.loads(listed.stdout)["envs"]}
    shown = tether(stranger, "envs", "show", "bench/integer_arithmetic", "-n", "3", "--seed", "1")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("bench/integer_arithmetic") >= 1 and len(shown.stdout.splitlines()) >= 3
    typo = tether(stranger, "envs", "show", "bench/integer_arithmetc")
    assert typo.returncode != 0 and "bench/integer_arithmetic" in typo.stderr + typo.stdout
    assert "Traceback" not in typo.stderr


def test_readme_stores_start_empty_and_say_where_they_looked(stranger: Stranger) -> None:
    home = stranger[1]["TETHER_HOME"]
    for args in (("agent", "list"), ("jobs", "list")):
        listed = tether(stranger, *args)
        assert listed.returncode == 0, (args, listed.stderr)
        assert "Traceback" not in listed.stderr
        assert home in " ".join((listed.stdout + listed.stderr).split()), (args, listed.stdout, listed.stderr)
    models = tether(stranger, "models", "list")
    assert models.returncode == 0 and "Traceback" not in models.stderr, models.stderr
