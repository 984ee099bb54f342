"""`tether sandbox run` hands the program to the sandbox as the bytes of its file."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tether.cli.main import app

runner = CliRunner()


def test_sandbox_run_passes_a_program_that_is_not_utf8_through_unchanged(tmp_path: Path) -> None:
    program = tmp_path / "latin1.py"
    program.write_bytes(b"# -*- coding: latin-1 -*-\nprint('caf\xe9')\n")
    from_file = runner.invoke(app, ["sandbox", "run", str(program)])
    from_stdin = runner.invoke(app, ["sandbox", "run", "-"], input=program.read_bytes())
    for result in (from_file, from_stdin):
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["stdout"] == "café\n"
