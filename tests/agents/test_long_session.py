"""The long-session benchmark on a real engine, sandbox and journal: prompts stay within the context
budget by the engine's own count, and most of every prompt comes from the prefix cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.agents.test_memory import WordCounts
from tether.agents.long_session import SurveyPolicy, run_long_session, survey_step, survey_task
from tether.agents.service import AgentsConfig, AgentStack
from tether.cli.main import app
from tether.errors import ConfigError
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.serving.engine_client import EngineClient
from tether.testing import make_tiny_model
from tether.testing.scripted import ScriptedClient

BUDGET = 4000  # the tiny model reads a byte a token: its 4096-token window holds about 4 kB of prompt


async def test_a_long_task_stays_within_its_budget_with_most_of_each_prompt_cached(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "tiny", "qwen2", max_position_embeddings=8192)
    engine = EngineClient(str(folder), tmp_path, kv_cache_mib=64, device="cpu")
    stack = AgentStack(AgentsConfig.embedded(tmp_path / "agents"))
    try:
        async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
            result = await run_long_session(stack, pool, engine, 32, BUDGET, embedder=WordCounts)
    finally:
        await stack.close()
        await engine.close()
    assert result.status == "succeeded" and result.steps == 32
    assert result.budget_tokens == BUDGET
    prompts = [step.prompt_tokens for step in result.per_step]
    assert max(prompts) == result.max_prompt_tokens <= BUDGET  # the engine's count, not an estimate
    assert prompts[-1] < prompts[9] * 2  # bounded: no growth with the number of steps
    assert result.cached_share >= 0.7, result
    assert all(step.cached_tokens <= step.prompt_tokens for step in result.per_step)


def test_the_cli_bench_reports_the_long_session_as_json() -> None:
    args = ["agent", "bench", "--long-session", "--steps", "12", "--model", "tiny", "--no-recall"]
    outcome = CliRunner().invoke(app, [*args, "--budget-tokens", str(BUDGET), "--json"])
    assert outcome.exit_code == 0, outcome.output
    report = json.loads(outcome.stdout)  # loading notes and bars go to stderr
    assert report["steps"] == 12 and report["status"] == "succeeded"
    assert report["max_prompt_tokens"] <= report["budget_tokens"] == BUDGET
    assert 0 < report["cached_share"] <= 1 and "cached_share_last_window" in report
    assert "per_step" not in report


def test_the_survey_ends_with_finish_at_its_last_step() -> None:
    assert survey_step(9, 10)[1][0][0] == "finish"
    assert {survey_step(n, 10)[1][0][0] for n in range(9)} == {"read_file", "shell"}
    with pytest.raises(ConfigError, match="at least 2 steps"):
        survey_task(1, BUDGET)
    with pytest.raises(ConfigError, match="budget_tokens = 100: expected at least 256"):
        survey_task(10, 100)


def test_the_bench_refuses_a_client_that_cannot_count_its_prompts() -> None:
    with pytest.raises(ConfigError, match="needs a client that counts prompt tokens"):
        SurveyPolicy(ScriptedClient([]), 10)


def test_the_cli_bench_refuses_a_budget_too_small_before_loading_a_model() -> None:
    args = ["agent", "bench", "--long-session", "--model", "no-such-model", "--budget-tokens", "100"]
    outcome = CliRunner().invoke(app, args)
    assert outcome.exit_code != 0
    assert "budget_tokens = 100: expected at least 256 tokens" in outcome.output
