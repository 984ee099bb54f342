"""The code-scoring benchmark: right answers score 1 and wrong ones 0 at speed, through one pool."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tether.cli.main import app
from tether.envs.errors import EnvError
from tether.envs.score_bench import BenchConfig, build_answers, run_bench
from tether.machine import machine_record


def test_the_mix_is_half_right_and_covers_humaneval_and_families() -> None:
    answers = build_answers(48)
    assert sum(a.correct for a in answers) == 24
    names = {a.env.name for a in answers}
    assert "code/humaneval" in names and "code/py-caesar" in names
    assert not any(name.startswith(("code/c-", "code/cpp-")) for name in names)
    assert any(a.env.name.startswith("code/cpp-") for a in build_answers(48, native=True))


@pytest.mark.parametrize(
    ("field", "value"), [("answers", 0), ("repeats", -1), ("concurrency", 0), ("slots", 0), ("answers", 1.5)]
)
def test_bad_settings_are_named(field: str, value: object) -> None:
    with pytest.raises(EnvError, match=field):
        BenchConfig(**{field: value})  # type: ignore[arg-type]


async def test_a_small_run_scores_every_answer_as_it_must() -> None:
    result = await run_bench(BenchConfig(answers=36, repeats=1, slots=2))
    assert result.mismatches == 0
    assert result.answers_per_s > 0 and len(result.per_repeat_answers_per_s) == 1
    assert sum(result.mix.values()) == 36
    assert machine_record(1, 0.0).keys() <= result.machine.keys() and result.machine["threads"] == 2


def test_cli_prints_json_and_exits_zero() -> None:
    outcome = CliRunner().invoke(app, ["envs", "bench", "--answers", "24", "--repeats", "1", "--json"])
    assert outcome.exit_code == 0, outcome.output
    assert '"mismatches": 0' in outcome.output


@pytest.mark.slow
async def test_scoring_runs_at_least_100_answers_per_second() -> None:
    result = await run_bench(BenchConfig(answers=1000, repeats=3))
    assert result.mismatches == 0
    assert result.answers_per_s >= 100, result.to_dict()
