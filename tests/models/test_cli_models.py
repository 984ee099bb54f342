"""`tether models pull/list` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tether.cli.models import app

SMOLLM2 = "smollm2-135m-instruct"

runner = CliRunner()


def test_pull_prints_the_folder_and_list_shows_it(smollm2_folder: Path, model_cache: Path) -> None:
    pulled = runner.invoke(app, ["pull", SMOLLM2, "--cache-dir", str(model_cache)])
    assert pulled.exit_code == 0, pulled.output
    assert str(smollm2_folder) in pulled.stdout
    listed = runner.invoke(app, ["list", "--json", "--cache-dir", str(model_cache)])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert [(r["name"], r["architecture"]) for r in rows] == [(SMOLLM2, "LlamaForCausalLM")]
    table = runner.invoke(app, ["list", "--cache-dir", str(model_cache)])
    assert SMOLLM2 in table.stdout


def test_pull_of_an_unknown_model_exits_non_zero_naming_it(tmp_path: Path) -> None:
    result = runner.invoke(app, ["pull", "gpt-17", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "gpt-17" in result.output
    assert SMOLLM2 in result.output
