"""`tether sandbox run` hands the program to the sandbox as the bytes of its file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_sandbox_serve_refuses_a_bad_instance_name_by_name() -> None:
    result = runner.invoke(app, ["sandbox", "serve", "--instance-name", "a/b", "--port", "1"])
    assert result.exit_code == 2
    assert "instance_name = 'a/b'" in result.output


def test_a_configured_fleet_that_does_not_answer_is_a_clear_error_not_a_local_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.live_server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("TETHER_SANDBOX__FLEET", json.dumps([url]))
    result = runner.invoke(app, ["sandbox", "humaneval", "--json"])
    assert result.exit_code == 2
    assert "no sandbox server answered" in result.output and url in result.output


async def test_scoring_and_agent_workers_get_the_configured_sandbox() -> None:
    from tests.live_server import free_port
    from tether.cli.common import open_sandbox, sandbox_provider
    from tether.config import load_settings
    from tether.sandbox import SandboxFleet, SandboxPool

    fleet = json.dumps([f"http://127.0.0.1:{free_port()}"])
    remote = load_settings(environ={"TETHER_SANDBOX__FLEET": fleet})
    provider = sandbox_provider(remote)
    try:
        assert isinstance(await provider.pool(), SandboxFleet)  # started: no local worker, no privileges
    finally:
        await provider.aclose()
    assert isinstance(open_sandbox(remote, slots=2), SandboxFleet)
    assert isinstance(open_sandbox(load_settings(environ={}), slots=2), SandboxPool)
    found = load_settings(environ={"TETHER_SANDBOX__DISCOVERY": "dns+http://localhost:8080"})
    assert isinstance(open_sandbox(found), SandboxFleet)


def test_sandbox_run_launches_its_worker_before_it_imports_the_pool() -> None:
    # The worker's interpreter and imports overlap the command's own only if it starts first.
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from tether.cli import sandbox\n"
        "from tether.cli.main import app\n"
        "seen = []\n"
        "real = sandbox.launch\n"
        "def spy(python):\n"
        "    seen.append('tether.sandbox.pool' in sys.modules)\n"
        "    return real(python)\n"
        "sandbox.launch = spy\n"
        "done = CliRunner().invoke(app, ['sandbox', 'run', '-'], input='print(6 * 7)')\n"
        "print(seen, done.exit_code, '42' in done.output)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["[False]", "0", "True"], done.stdout + done.stderr
