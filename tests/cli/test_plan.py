"""`tether train --plan`: per-rank memory for a named architecture or a config, without allocating."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tether.cli.main import app
from tether.cli.plan import PlanOptions, build_plan, print_plan
from tether.models.memory_plan import CATEGORIES
from tether.rl.config import load_config

runner = CliRunner()


def _json(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["train", "--plan", "--json", *args])
    assert result.exit_code == 0, result.output
    parsed: dict[str, Any] = json.loads(result.output)
    return parsed


def test_a_72b_model_is_planned_per_rank_at_a_given_world_size() -> None:
    one = _json("--model", "qwen2.5-72b", "--strategy", "fsdp", "--dtype", "bfloat16")
    eight = _json("--model", "qwen2.5-72b", "--strategy", "fsdp", "--world-size", "8", "--dtype", "bfloat16")
    assert eight["world_size"] == 8 and eight["dtype"] == "bfloat16"
    assert eight["parameter_count"] == one["parameter_count"]
    one_bytes, eight_bytes = one["bytes"], eight["bytes"]
    assert isinstance(one_bytes, dict) and isinstance(eight_bytes, dict)
    assert list(eight_bytes) == list(CATEGORIES)
    assert eight_bytes["optimizer"] == pytest.approx(one_bytes["optimizer"] / 8, abs=1)


def test_the_config_sizes_the_micro_batch_and_the_dtype(tmp_path: Path) -> None:
    config = tmp_path / "train.toml"
    config.write_text(
        '[model]\nname = "llama-3-8b"\ndtype = "float16"\n[envs.weights]\n"math/arithmetic" = 1.0\n'
        "[rollout]\nsamples_per_prompt = 2\nmax_new_tokens = 100\n[optim]\nmicro_batch = 4\n"
    )
    plan = _json("--config", str(config), "--prompt-tokens", "50")
    assert plan["model"] == "llama-3-8b" and plan["dtype"] == "float16"
    assert plan["micro_batch_tokens"] == 2 * (50 + 2 * 100)
    assert plan["kv_cache_tokens"] == 8 * 2 * (50 + 100)  # one step: prompts_per_step x samples
    budgeted = config.with_name("budgeted.toml")
    budgeted.write_text(
        config.read_text().replace("micro_batch = 4", "micro_batch = 4\nmicro_batch_tokens = 300")
    )
    assert _json("--config", str(budgeted), "--prompt-tokens", "50")["micro_batch_tokens"] == 250
    overridden = _json("--config", str(config), "--model", "qwen2.5-7b", "--kv-cache-tokens", "7")
    assert overridden["model"] == "qwen2.5-7b" and overridden["kv_cache_tokens"] == 7


def test_without_a_terminal_each_row_is_one_plain_line() -> None:
    result = runner.invoke(app, ["train", "--plan", "--model", "llama-3-8b", "--no-engine"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("llama-3-8b: 8.03B parameters, single over 1 rank(s), float32")
    assert [line.split()[0] for line in lines[1:-1]] == list(CATEGORIES)
    assert lines[-1].startswith("total per rank ")


def test_on_a_terminal_the_plan_is_a_table() -> None:
    plan = build_plan(None, PlanOptions(model="smollm2-135m"))
    out = io.StringIO()
    print_plan(plan, as_json=False, out=Console(file=out, force_terminal=True, width=120))
    text = out.getvalue()
    assert "per rank" in text and "activations" in text and "total" in text


def test_a_registered_model_and_a_local_folder_are_planned(tiny_model: Callable[[str], Path]) -> None:
    assert build_plan(None, PlanOptions()).model == "smollm2-135m-instruct"  # the config's default model
    folder = tiny_model("llama")
    assert _json("--model", str(folder))["parameter_count"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "lama-3-8b"], "did you mean 'llama-3-8b'?"),
        (
            ["--model", "llama-3-8b", "--strategy", "zero3"],
            "--strategy 'zero3': expected one of single, fsdp",
        ),
        (["--model", "llama-3-8b", "--world-size", "2"], "use strategy = 'fsdp'"),
        (["--model", "llama-3-8b", "--dtype", "fp8"], "--dtype = 'fp8': expected one of float32"),
        (["--config", "a.toml", "--resume", "b"], "at most one of --config"),
    ],
)
def test_bad_options_fail_with_the_accepted_values(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["train", "--plan", *args])
    assert result.exit_code != 0
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_a_config_file_example_can_be_planned() -> None:
    config = load_config(Path(__file__).parents[2] / "configs" / "arithmetic-grpo.toml")
    plan = build_plan(config, PlanOptions(strategy="fsdp", world_size=2))
    assert plan.settings.micro_batch.samples == min(
        config.rollout.samples_per_prompt, config.optim.micro_batch
    )
